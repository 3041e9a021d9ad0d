"""Translate between the ``tinker.types`` objects users pass and the engine's lean types.

The translation refuses what it cannot carry faithfully (a float ``target_tokens``) instead of
rounding it: the engine's own checks (``engine/validate.py``) see only what the user meant.
"""

from __future__ import annotations

import uuid

import numpy as np
import torch
from tinker import types

from opentinker.engine import EngineError, Example, ForwardResult
from opentinker.sampling import SampleResult, SamplingParams

_INTEGER_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def datum_to_example(datum: types.Datum, index: int) -> Example:
    try:
        tokens = datum.model_input.to_ints()
    except Exception as e:
        raise EngineError(f"datum {index}: model_input must hold only token chunks ({e})") from e
    inputs: dict[str, torch.Tensor] = {}
    for key, td in datum.loss_fn_inputs.items():
        t = td.to_torch()
        if key == "target_tokens":
            # checked before the cast: .long() would silently train 6.5 as token 6
            if t.dtype not in _INTEGER_DTYPES:
                raise EngineError(
                    f"datum {index}: target_tokens must be integer token ids, got {str(t.dtype).removeprefix('torch.')}"
                )
            t = t.long()
        inputs[key] = t
    return Example(torch.tensor(tokens, dtype=torch.long), inputs)


def forward_output(res: ForwardResult) -> types.ForwardBackwardOutput:
    outputs = [
        {k: types.TensorData.from_torch(v.detach().cpu().contiguous()) for k, v in out.items()}
        for out in res.outputs
    ]
    return types.ForwardBackwardOutput(
        loss_fn_output_type="ArrayRecord", loss_fn_outputs=outputs, metrics=res.metrics
    )


def sampling_params(p: types.SamplingParams) -> SamplingParams:
    stop = p.stop
    if isinstance(stop, str):
        stop = [stop]
    elif stop is not None:
        stop = list(stop)
    return SamplingParams(
        max_tokens=p.max_tokens if p.max_tokens is not None else 1 << 30,
        temperature=float(p.temperature),
        top_k=int(p.top_k),
        top_p=float(p.top_p),
        seed=p.seed,
        stop=stop,  # type: ignore[arg-type]
    )


def sample_response(res: SampleResult) -> types.SampleResponse:
    seqs = [
        types.SampledSequence(
            stop_reason=s.stop_reason,
            sequence_id=uuid.uuid4().hex,
            tokens_np=np.asarray(s.tokens, dtype=np.int32),
            logprobs_np=np.asarray(s.logprobs, dtype=np.float32),
            _topk_logprobs_list=list(s.topk_logprobs) if s.topk_logprobs is not None else None,
        )
        for s in res.sequences
    ]
    prompt_np = None
    if res.prompt_logprobs is not None:
        prompt_np = np.asarray([np.nan if x is None else x for x in res.prompt_logprobs], dtype=np.float32)
    return types.SampleResponse(
        sequences=seqs,
        prompt_logprobs_np=prompt_np,
        _topk_prompt_logprobs_list=res.topk_prompt_logprobs,
    )
