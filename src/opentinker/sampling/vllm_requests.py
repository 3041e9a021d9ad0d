"""Requests to and from vLLM: the ``SamplingParams`` contract mapped onto vLLM's, and vLLM's
finished completions back into :class:`~opentinker.sampling.types.SampleResult`.

``num_samples`` rows are separate vLLM requests (each with its own seed derived from the
request's seed and the row index, so seeded requests are reproducible and their rows differ),
``stop=None`` stops at EOS, a list of strings or token ids stops there too (and at EOS), ``[]``
never stops early (``ignore_eos``); ``max_tokens`` is capped by the context length (stop reason
``length``), as natively. Sampled tokens carry their logprob with the native convention
(``log softmax(logits / T)``, T = 1 when greedy: vLLM's ``processed_logprobs`` mode, set by
:func:`~opentinker.sampling.vllm_engine.start_engine`).

A :class:`Job` is one request while its rows decode (the vLLM backend's decoder holds them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from opentinker.engine.types import EngineError
from opentinker.sampling.decoder import Pinned
from opentinker.sampling.types import SampledSequence, SampleRequest, SampleResult, SamplingParams, StopReason
from opentinker.sampling.vllm_lora import VLLMLora


@dataclass
class Job:
    rid: int
    pinned: Pinned
    lora: VLLMLora | None
    seqs: list[SampledSequence | None]
    left: int
    prompt_logprobs: list[float | None] | None = None
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None
    cached_tokens: int | None = None  # the fewest prompt tokens vLLM's prefix cache gave a row

    def note_cached(self, output: Any) -> None:
        """Count a finished row's prefix-cache hit (vLLM's ``RequestOutput.num_cached_tokens``,
        None or absent where it does not say: 0). Each row is its own vLLM request, and rows
        after the first may reuse the first's blocks of the same prompt; the fewest any row got
        is what the cache held for the prompt, the count the native sampler reports (once per
        prompt, not per sample)."""
        hit = int(getattr(output, "num_cached_tokens", None) or 0)
        self.cached_tokens = hit if self.cached_tokens is None else min(self.cached_tokens, hit)


def sampling_params(
    vllm: Any, req: SampleRequest, sample: int, *, eos_ids: set[int], max_context: int
) -> Any:
    """vLLM's ``SamplingParams`` for row ``sample`` of ``req`` (``vllm``: the imported module)."""
    p = req.params
    stop_strs: list[str] = []
    stop_ids = set(eos_ids)
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
    return vllm.SamplingParams(
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        logit_bias=dict(p.logit_bias) or None,
        structured_outputs=_structured(vllm, p),
        n=1,
        max_tokens=min(p.max_tokens, max_context - len(req.prompt)),
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
        output_kind=vllm.sampling_params.RequestOutputKind.FINAL_ONLY,
    )


def sequence_of(completion: Any, k: int) -> SampledSequence:
    """A finished vLLM completion as a sampled sequence (``k``: top-k logprobs per token, 0: none)."""
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


def result_of(job: Job) -> SampleResult:
    seqs = [s for s in job.seqs if s is not None]
    return SampleResult(
        seqs,
        prompt_logprobs=job.prompt_logprobs,
        topk_prompt_logprobs=job.topk_prompt_logprobs,
        prompt_cache_hit_tokens=job.cached_tokens or 0,
    )


def _structured(vllm: Any, p: SamplingParams) -> Any:
    """vLLM's own structured outputs for a grammar (a forced tool call is not one of them)."""
    g = p.grammar
    if g is None:
        return None
    if g.kind == "tool_call":
        raise EngineError(
            "a forced tool call (tool_choice 'required' or a named function) is not served with "
            "--rollout-backend vllm; use tool_choice 'auto', or the native backend"
        )
    so = vllm.sampling_params.StructuredOutputsParams
    return so(json_object=True) if g.kind == "json_object" else so(json=g.spec)
