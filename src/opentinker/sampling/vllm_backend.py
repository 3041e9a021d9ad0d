"""The vLLM rollout backend: vLLM's own engine and runtime LoRA behind :class:`SamplingBackend`.

- **publish** and **retire** go to the engine's LoRA table (:mod:`~opentinker.sampling.vllm_lora`:
  PEFT exports registered with vLLM, unloaded once the last row sampling them has stopped);
- **generate** and the sampling loop drive one :class:`VLLMDecoder`, the same four moves as the
  native :class:`~opentinker.sampling.decoder.StepDecoder` (pin, admit, step, rows leave when they
  stop) on vLLM's ``LLMEngine`` (``add_request`` / ``step``): vLLM batches continuously itself,
  so a request admitted between two steps decodes with the running ones.

Beside them: starting vLLM and the options checked first (:mod:`~opentinker.sampling.vllm_engine`),
the ``SamplingParams`` contract mapped onto vLLM's and its completions back
(:mod:`~opentinker.sampling.vllm_requests`), and the training engine's forward scoring what vLLM
sampled, for the sampler–trainer mismatch (:attr:`mismatch_last` / :attr:`mismatch_total`) and
the prompt logprobs (:mod:`~opentinker.sampling.vllm_scoring`).
"""

from __future__ import annotations

import itertools
import shutil
import tempfile
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from opentinker.engine import Engine, EngineError
from opentinker.engine.types import PolicyRef
from opentinker.lora import LoRAWeights, TargetGroup
from opentinker.sampling.backend import Mismatch, SamplingBackend, check_request
from opentinker.sampling.decoder import Finished, Pinned, Progress, run_to_completion
from opentinker.sampling.types import SampledSequence, SampleRequest, SampleResult
from opentinker.sampling.vllm_engine import (
    DEFAULT_MAX_LORA_RANK,
    check_max_lora_rank,
    check_tensor_parallel,
    import_vllm,
    lora_unsupported_reason,
    start_engine,
)
from opentinker.sampling.vllm_lora import NO_LORA_REASON, LoraTable, no_lora_reason
from opentinker.sampling.vllm_requests import Job, result_of, sampling_params, sequence_of
from opentinker.sampling.vllm_scoring import (
    PromptLogprobs,
    TrainerLogprobs,
    engine_logprobs,
    engine_prompt_logprobs,
    fill_prompt_logprobs,
    mismatch_of,
)


class VLLMBackend(SamplingBackend):
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
        max_cpu_loras: int | None = None,
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
        no_lora: str | None = None,
        tensor_parallel: int = 1,
    ) -> None:
        """A vLLM engine over the HF model folder ``model_path`` (``base_model`` its canonical
        name, ``groups`` the LoRA target groups the adapters' tensors are stored by, as
        ``MultiLoRA.groups``). ``resolve``: where a request's policy id is looked up when it was
        not published here (the training engine's snapshots, in process); ``trainer``: scores
        finished rows for the mismatch figures (None: not measured). ``multiprocessing``: run
        vLLM's engine core in a child process (then the caller's ``__main__`` must be guarded).
        ``kv_cache_bytes``: the KV cache's size (see :mod:`~opentinker.sampling.vllm_engine`). ``no_lora``: why vLLM runs without runtime LoRA, serving the base model only (every
        adapter refused with it, e.g. :data:`~opentinker.sampling.vllm_lora.NO_LORA_REASON`); None:
        with LoRA. ``tensor_parallel``: vLLM's tensor-parallel size
        (:func:`~opentinker.sampling.vllm_engine.tensor_parallel_args`)."""
        vllm = import_vllm()
        from vllm.lora.request import LoRARequest  # pyright: ignore[reportMissingImports]

        self._vllm, self.base_model, self.groups = vllm, base_model, groups
        self.max_context, self.vocab_size, self.eos_ids = max_context, vocab_size, set(eos_ids or ())
        self.resolve, self.trainer, self.prompt_scorer = resolve, trainer, prompt_scorer
        self.max_lora_rank, self.max_logprobs = max_lora_rank, max_logprobs
        check_max_lora_rank(max_lora_rank)
        self._own_dir, self.export_dir = export_dir is None, _export_dir(export_dir)
        self.llm = start_engine(
            vllm,
            model_path,
            base_model=base_model,
            max_context=max_context,
            max_loras=max_loras,
            max_cpu_loras=max_cpu_loras,
            max_lora_rank=max_lora_rank,
            max_num_seqs=max_num_seqs,
            max_logprobs=max_logprobs,
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            kv_cache_bytes=kv_cache_bytes,
            enforce_eager=enforce_eager,
            multiprocessing=multiprocessing,
            seed=seed,
            engine_kwargs=engine_kwargs,
            lora=no_lora is None,
            tensor_parallel=tensor_parallel,
        )
        self.loras = LoraTable(
            self.llm,
            LoRARequest,
            base_model=base_model,
            groups=groups,
            max_lora_rank=max_lora_rank,
            export_dir=self.export_dir,
            resolve=resolve,
            no_lora=no_lora,
        )
        self._request_ids = itertools.count(1)
        self._stash: dict[str, Any] = {}  # outputs of requests another decoder owns (one engine)
        self.mismatch_total = Mismatch()

    @classmethod
    def for_engine(
        cls, engine: Engine, *, measure_mismatch: bool = True, engine_forward: bool = True, **kwargs: Any
    ) -> VLLMBackend:
        """A vLLM backend over the training engine's base model: requests name the engine's
        snapshots (published on first use), and the engine's forward scores the mismatch and the
        prompt logprobs (``engine_forward`` False: neither, the engine holding no weights). vLLM
        loads the base in the engine's dtype unless ``dtype`` is given (a bf16 trainer sampled
        by an fp32 vLLM, or the reverse, would mismatch by far more than either's rounding)."""
        from opentinker.models.dtype import dtype_name
        from opentinker.sampling.native import _eos_ids

        kwargs.setdefault("dtype", dtype_name(engine.base.dtype))
        check_tensor_parallel(kwargs.get("tensor_parallel", 1), engine.base.model.config)
        kwargs.setdefault("no_lora", _no_lora(engine))

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
            trainer=engine_logprobs(engine) if measure_mismatch and engine_forward else None,
            prompt_scorer=engine_prompt_logprobs(engine) if engine_forward else None,
            **kwargs,
        )

    # ---------------------------------------------------------------- policies
    def publish(self, policy_id: str, weights: LoRAWeights) -> None:
        self.loras.publish(policy_id, weights)

    def retire(self, policy_id: str) -> None:
        self.loras.retire(policy_id)

    def published(self) -> list[str]:
        return self.loras.published()

    def refusal(self, weights: LoRAWeights) -> str | None:
        """Why vLLM cannot serve ``weights`` (:func:`~opentinker.sampling.vllm_lora.refusal`), or
        None when it can."""
        return self.loras.refusal(weights)

    # ---------------------------------------------------------------- sampling
    def validate(self, req: SampleRequest) -> None:
        check_request(req, vocab_size=self.vocab_size, max_context=self.max_context)
        if req.images:
            raise EngineError(
                "the vLLM sampler backend takes no images: vLLM builds a Qwen-VL model's processor "
                "with torchvision, which has no build for this CPU torch; sample image prompts with "
                "the native backend (rollout_backend 'native', the default)"
            )
        if req.topk_sample_logprobs > self.max_logprobs:
            raise EngineError(
                f"topk_sample_logprobs is {req.topk_sample_logprobs}; the vLLM backend reports at "
                f"most {self.max_logprobs}"
            )

    def weights_of(self, policy: PolicyRef) -> LoRAWeights | None:
        """The weights ``policy`` names now: published here, else resolved (and published)."""
        return self.loras.weights_of(policy)

    def generate(self, requests: list[SampleRequest]) -> list[SampleResult | EngineError]:
        return run_to_completion(self.decoder(), requests)

    def decoder(self) -> VLLMDecoder:
        return VLLMDecoder(self)

    def vllm_params(self, req: SampleRequest, sample: int) -> Any:
        """vLLM's ``SamplingParams`` for row ``sample`` of ``req``."""
        return sampling_params(self._vllm, req, sample, eos_ids=self.eos_ids, max_context=self.max_context)

    def close(self) -> None:
        shutdown = getattr(getattr(self.llm, "engine_core", None), "shutdown", None)
        if callable(shutdown):
            shutdown()
        if self._own_dir:
            shutil.rmtree(self.export_dir, ignore_errors=True)


class VLLMDecoder:
    """The step-wise interface of :class:`~opentinker.sampling.decoder.StepDecoder` over vLLM's
    engine, so that the sampling loop drives either (one thread drives a decoder at a time)."""

    def __init__(self, backend: VLLMBackend) -> None:
        self.backend = backend
        self.steps = 0
        self._jobs: dict[int, Job] = {}
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
                    lora = b.loras.hold(req.policy, pinned.weights, req.num_samples)
                job = Job(rid, pinned, lora, [None] * req.num_samples, req.num_samples)
                if req.prompt_logprobs or req.topk_prompt_logprobs:
                    fill_prompt_logprobs(job, b.prompt_scorer)
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

    def drop(self, rid: int) -> bool:
        """Abort request ``rid``'s rows in vLLM's engine now (its caller is gone); True if it had
        rows here."""
        had = rid in self._jobs
        self._abort(rid)
        return had

    def switch(self, group: str, pinned: Pinned) -> int:
        """Nothing moves: vLLM cannot change a running request's adapter, so rows here finish on
        the weights they started with (0 moved); requests not yet admitted are re-pinned by the
        sampling loop before they reach vLLM."""
        return 0

    def progress(self, rids: Collection[int]) -> dict[int, list[Progress]]:
        """Of requests ``rids``, those with rows here: each finished sample whole, a decoding one
        as nothing yet (vLLM returns a row's output when it finishes)."""
        return {
            rid: [([], [], None) if s is None else (s.tokens, s.logprobs, s.topk_logprobs) for s in job.seqs]
            for rid in rids
            if (job := self._jobs.get(rid)) is not None
        }

    def _abort(self, rid: int) -> None:
        job = self._jobs.pop(rid, None)
        vids = [v for v, (r, _) in self._rows.items() if r == rid]
        for v in vids:
            del self._rows[v]
        if vids:
            self.backend.llm.abort_request(vids)
        if job is not None:
            self._release(job)

    def _release(self, job: Job) -> None:
        if job.lora is not None:
            self.backend.loras.release(job.lora, job.pinned.req.num_samples)

    def step(self) -> list[Finished]:
        b = self.backend
        # RequestOutput (a generation; never PoolingRequestOutput: no pooling model is served)
        outs: list[Any] = list(b.llm.step()) if b.llm.has_unfinished_requests() else []
        for vid in [v for v in b._stash if v in self._rows]:
            outs.append(b._stash.pop(vid))
        self.steps += 1
        finished: list[Finished] = []
        scored: list[tuple[Job, SampledSequence]] = []
        for out in outs:
            if not out.finished:
                continue
            key = self._rows.pop(out.request_id, None)
            if key is None:
                b._stash[out.request_id] = out
                continue
            rid, k = key
            job = self._jobs[rid]
            seq = sequence_of(out.outputs[0], job.pinned.req.topk_sample_logprobs)
            job.seqs[k] = seq
            job.note_cached(out)
            scored.append((job, seq))
            job.left -= 1
            if job.left == 0:
                del self._jobs[rid]
                self._release(job)
                finished.append((rid, result_of(job)))
        if scored and b.trainer is not None:
            b.mismatch_last = mismatch_of(b.trainer, scored)
            b.mismatch_total = (b.mismatch_total or Mismatch()).merged(b.mismatch_last)
        return finished


def _no_lora(engine: Engine) -> str | None:
    """Why vLLM runs ``engine``'s base model without LoRA, or None: a mixture-of-experts model
    (:data:`~opentinker.sampling.vllm_lora.EXPERTS_REASON`), an architecture vLLM has no LoRA for."""
    if any(g.experts for g in engine.lora.groups.values()):
        return NO_LORA_REASON
    why = lora_unsupported_reason(engine.base.model.config)
    return None if why is None else no_lora_reason(why)


def _export_dir(export_dir: str | Path | None) -> Path:
    """Where adapters are written for vLLM to load: ``export_dir``, or a fresh temporary folder."""
    out = Path(tempfile.mkdtemp(prefix="opentinker-vllm-")) if export_dir is None else Path(export_dir)
    out.mkdir(parents=True, exist_ok=True)
    return out
