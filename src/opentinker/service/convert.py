"""Translate between the ``tinker.types`` objects users pass and the engine's lean types.

The translation refuses what it cannot carry faithfully (a float ``target_tokens``) instead of
rounding it: the engine's own checks (``engine/validate.py``) see only what the user meant.
"""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np
import torch
from tinker import types

from opentinker.engine import EngineError, Example, ForwardResult
from opentinker.engine.optim import check_optimizer_config
from opentinker.models.vision import Image, ImageError, Vision
from opentinker.sampling import SampleResult, SamplingParams
from opentinker.sampling.grammar import Grammar
from opentinker.sampling.grammar import check as check_grammar  # noqa: F401 (re-exported: the OpenAI routes' 400s)
from opentinker.sampling.vision import cache_tokens

_INTEGER_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


class ImageRefused(EngineError):
    """An image the model cannot take; ``status`` 413 for one over the pixel limit, else 400."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.status = status


def model_input_parts(
    model_input: types.ModelInput, vision: Vision | None, where: str
) -> tuple[list[int], tuple[Image, ...]]:
    """A ``ModelInput``'s token ids and images: an ``ImageChunk`` is decoded by the base model's
    image processor and becomes as many image placeholder ids as it has tokens (what Tinker's
    ``ModelInput.length`` counts it as). Refused, naming the chunk: an image on a text-only base
    model, an image the processor refuses (``models/vision.py``), an ``expected_tokens`` that
    disagrees, and an ``ImageAssetPointerChunk`` (this server keeps no image assets)."""
    tokens: list[int] = []
    images: list[Image] = []
    for c, chunk in enumerate(model_input.chunks):
        if isinstance(chunk, types.EncodedTextChunk):
            tokens.extend(int(t) for t in chunk.tokens)
        elif isinstance(chunk, types.ImageChunk):
            if vision is None:
                raise EngineError(f"{where}: chunk {c} is an image, but this base model is text-only")
            try:
                image = vision.encode(chunk.data, chunk.format, chunk.expected_tokens)
            except ImageError as e:
                raise ImageRefused(f"{where}: chunk {c}: {e}", e.status) from None
            images.append(image)
            tokens.extend([vision.image_token_id] * image.n_tokens)
        elif isinstance(chunk, types.ImageAssetPointerChunk):
            raise EngineError(
                f"{where}: chunk {c} is an image_asset_pointer, which this server does not resolve "
                "(it keeps no image assets and fetches no URLs): send the image's bytes in an ImageChunk"
            )
        else:
            kind = getattr(chunk, "type", type(chunk).__name__)
            raise EngineError(f"{where}: chunk {c} is a {kind} chunk, which this server does not take")
    return tokens, tuple(images)


def checked_length(model_input: types.ModelInput, vision: Vision | None, where: str) -> int:
    """The positions ``model_input`` takes in the model, each image counted as its image
    processor's tokens (``expected_tokens`` is only checked against that; unset, the SDK's own
    ``ModelInput.length`` raises). Refused (``EngineError`` naming the chunk): an image that cannot
    run. A text-only input is not decoded."""
    if all(isinstance(c, types.EncodedTextChunk) for c in model_input.chunks):
        return sum(c.length for c in model_input.chunks)
    return len(model_input_parts(model_input, vision, where)[0])


def keyed_tokens(model_input: types.ModelInput, vision: Vision | None, where: str) -> list[int]:
    """``model_input``'s positions as the model takes them, each image's placeholders an id made
    from that image's pixel digest (``sampling/vision.py`` ``cache_tokens``, never a vocabulary
    id): equal lists, equal inputs, images included. Refused as :func:`model_input_parts` refuses."""
    if all(isinstance(c, types.EncodedTextChunk) for c in model_input.chunks):
        return model_input.to_ints()
    tokens, images = model_input_parts(model_input, vision, where)
    assert vision is not None  # an image on a text-only model was refused
    return cache_tokens(tokens, images, vision.image_token_id)


def datum_to_example(datum: types.Datum, index: int, vision: Vision | None = None) -> Example:
    tokens, images = model_input_parts(datum.model_input, vision, f"datum {index}")
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
    return Example(torch.tensor(tokens, dtype=torch.long), inputs, images)


def forward_output(res: ForwardResult) -> types.ForwardBackwardOutput:
    outputs = [
        {k: types.TensorData.from_torch(v.detach().cpu().contiguous()) for k, v in out.items()}
        for out in res.outputs
    ]
    return types.ForwardBackwardOutput(
        loss_fn_output_type="ArrayRecord", loss_fn_outputs=outputs, metrics=res.metrics
    )


class ShapedSamplingParams(types.SamplingParams):
    """The SDK's ``SamplingParams`` with OpenAI's shaping (the OpenAI-compatible routes'; see
    ``sampling/grammar.py``): penalties, a logit bias, a grammar."""

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    grammar: Grammar | None = None


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
        **_shaping(p),
    )


def _shaping(p: types.SamplingParams) -> dict[str, Any]:
    if not isinstance(p, ShapedSamplingParams):
        return {}
    return dict(
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        logit_bias=tuple(p.logit_bias),
        grammar=p.grammar,
    )


MAX_PROMPT_CELLS = 1 << 22  # len(prompt) x K cells of target / alternative prompt tokens at most


def check_prompt_extras(
    prompt_len: int,
    include_prompt_logprobs: bool,
    target: types.TensorData | None,
    alt_k: int,
    last_n: int | None,
) -> tuple[tuple[int, ...], ...] | None:
    """Check the prompt-scoring options of a sample call (raising ``EngineError`` naming the
    field); the ``target_prompt_logprobs`` ids as rows (-1 = none), or None."""
    if last_n is not None:
        if not include_prompt_logprobs:
            raise EngineError("prompt_logprobs_last_n applies to prompt logprobs; set prompt_logprobs")
        if not isinstance(last_n, int) or not 1 <= last_n <= prompt_len - 1:
            raise EngineError(
                f"prompt_logprobs_last_n must be between 1 and len(prompt) - 1 = {prompt_len - 1}, got {last_n!r}"
            )
    if not isinstance(alt_k, int) or alt_k < 0:
        raise EngineError(f"prompt_alt_tokens_k must be an integer >= 0, got {alt_k!r}")
    if alt_k * prompt_len > MAX_PROMPT_CELLS:
        raise EngineError(
            f"prompt_alt_tokens_k = {alt_k} is too large for a {prompt_len}-token prompt: "
            f"len(prompt) * k may be at most {MAX_PROMPT_CELLS}"
        )
    if target is None:
        return None
    if target.dtype != "int64" or target.shape is None or len(target.shape) != 2:
        raise EngineError(
            f"target_prompt_logprobs must be a 2-D int64 tensor [len(prompt) - 1, K], "
            f"got {target.dtype} of shape {target.shape}"
        )
    rows, k = target.shape
    if rows != prompt_len - 1:
        raise EngineError(
            f"target_prompt_logprobs must have len(prompt) - 1 = {prompt_len - 1} rows "
            f"(row i is scored at prompt position i + 1), got {rows}"
        )
    if rows * k > MAX_PROMPT_CELLS:
        raise EngineError(f"target_prompt_logprobs has {rows * k} cells; at most {MAX_PROMPT_CELLS}")
    try:
        ids = target.to_numpy(pad_value=-1).reshape(rows, k)
    except Exception as e:
        raise EngineError(f"target_prompt_logprobs is malformed ({e})") from e
    if not (ids >= 0).any():
        raise EngineError("target_prompt_logprobs names no token id (every cell is -1)")
    return tuple(tuple(int(t) for t in row) for row in ids)


def _like(layout: types.TensorData, values_PK: np.ndarray) -> types.TensorData:
    """``values_PK`` (float32 [P-1, K]) in the layout of the request's tensor: its cells only,
    when it was sparse CSR."""
    if layout.sparse_crow_indices is None or layout.sparse_col_indices is None:
        return types.TensorData(data=values_PK.reshape(-1), dtype="float32", shape=list(values_PK.shape))
    crow, col = layout.sparse_crow_indices, layout.sparse_col_indices
    rows = np.repeat(np.arange(len(crow) - 1), np.diff(np.asarray(crow)))
    vals = values_PK[rows, np.asarray(col, dtype=np.int64)] if len(col) else np.zeros(0, np.float32)
    return types.TensorData(
        data=vals.astype(np.float32),
        dtype="float32",
        shape=list(values_PK.shape),
        sparse_crow_indices=list(crow),
        sparse_col_indices=list(col),
    )


def sample_response(
    res: SampleResult,
    *,
    target_layout: types.TensorData | None = None,
    prompt_logprobs_last_n: int | None = None,
) -> types.SampleResponse:
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
    prompt_np, topk_prompt = None, res.topk_prompt_logprobs
    first = (
        None if prompt_logprobs_last_n is None else len(res.prompt_logprobs or []) - prompt_logprobs_last_n
    )
    if res.prompt_logprobs is not None:
        prompt_np = np.asarray([np.nan if x is None else x for x in res.prompt_logprobs], dtype=np.float32)
        if first is not None:
            prompt_np[:first] = np.nan
    if topk_prompt is not None and first is not None:
        topk_prompt = [None if i < first else row for i, row in enumerate(topk_prompt)]
    target = None
    if res.target_prompt_logprobs is not None and target_layout is not None:
        lps = np.asarray(res.target_prompt_logprobs, dtype=np.float32).reshape(target_layout.shape or [0, 0])
        target = _like(target_layout, lps)
    alt = None
    if res.prompt_alt_tokens is not None:
        toks, lps = (np.asarray(x) for x in res.prompt_alt_tokens)
        alt = types.PromptAltTokens(
            tokens=types.TensorData(data=toks.reshape(-1), dtype="int64", shape=list(toks.shape)),
            logprobs=types.TensorData(data=lps.reshape(-1), dtype="float32", shape=list(lps.shape)),
        )
    return types.SampleResponse(
        sequences=seqs,
        prompt_logprobs_np=prompt_np,
        _topk_prompt_logprobs_list=topk_prompt,
        target_prompt_logprobs=target,
        prompt_cache_hit_tokens=res.prompt_cache_hit_tokens,
        prompt_alt_tokens=alt,
    )


def optimizer_type(optimizer: Any) -> str:
    """The optimizer an ``optimizer=`` argument selects (``types.AdamOptimizerConfig``, the dict
    the wire carries, any object with a ``type``; None = adamw), checked: raises ``EngineError``
    naming an optimizer this engine does not run (see ``engine/optim.py``)."""
    if optimizer is None or isinstance(optimizer, dict):
        config = optimizer
    elif hasattr(optimizer, "model_dump"):
        config = dict(optimizer.model_dump(mode="json"))
    else:
        config = dict(vars(optimizer)) if hasattr(optimizer, "__dict__") else {"type": optimizer}
    return check_optimizer_config(config)
