"""The binary half of the wire protocol, through the SDK's own compiled schema (``tinker.proto``).

- decode ``ForwardBackwardRequest`` protobuf bodies into ``tinker.types.Datum`` lists — the types
  the embedded ``TrainingClient`` takes — checking every byte count, dtype, shape and sparse index
  on the way (a malformed body is refused with a message, never half-used);
- encode ``ForwardBackwardOutput`` and ``SampleResponse`` results as the SDK's
  ``proto/response_conv.py`` parses them (one ``ArrayRecord`` of ``BatchedTensor``s with int64
  *byte* offsets; int32 tokens, float32 logprobs with NaN for "undefined");
- canonical digests of request bodies, for idempotency (same key + same digest = same request);
- bounded zstd decompression (``Content-Encoding: zstd``).
"""

from __future__ import annotations

import hashlib
import io
import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import zstandard
from google.protobuf.message import DecodeError
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.types.encoded_text_chunk import EncodedTextChunk
from tinker.types.image_chunk import ImageChunk

from opentinker.server.errors import BadRequest, PayloadTooLarge

MAX_TENSOR_ELEMENTS = 1 << 26  # a sparse tensor may not declare a dense shape larger than this
MASK_LOGPROB = -99999.0  # the SDK's "empty top-k slot" sentinel (tinker.types.topk_logprobs)

_NP_OF_PROTO = {
    pb.DTYPE_FLOAT32: (np.dtype(np.float32), "float32"),
    pb.DTYPE_INT64: (np.dtype(np.int64), "int64"),
    pb.DTYPE_INT32: (np.dtype(np.int32), "int64"),
    pb.DTYPE_BFLOAT16: (np.dtype(np.uint16), "float32"),
}
_PROTO_OF_DTYPE = {"float32": pb.DTYPE_FLOAT32, "int64": pb.DTYPE_INT64}
_STOP_REASON = {"stop": pb.STOP_REASON_STOP, "length": pb.STOP_REASON_LENGTH}


@dataclass(frozen=True)
class ForwardBackwardCall:
    model_id: str
    seq_id: int
    forward_only: bool
    loss_fn: str
    loss_fn_config: dict[str, float]
    data: list[types.Datum]
    digest: str
    error: BadRequest | None = None  # the data is malformed: the request fails, in its turn
    loss_id: str | None = None  # loss_fn "custom": the uploaded loss (loss_fn_config's one string)


def digest_json(route: str, body: dict[str, Any]) -> str:
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(f"{route}\n{text}".encode()).hexdigest()


def decompress(body: bytes, encoding: str | None, max_bytes: int) -> bytes:
    if not encoding or encoding.lower() == "identity":
        return body
    if encoding.lower() != "zstd":
        raise BadRequest(f"unsupported Content-Encoding {encoding!r} (only zstd)")
    # The decoder hands back whatever a cut frame decodes to, without complaint: check first
    # that the body is whole frames, so a truncated body is refused instead of half-used.
    declared = _zstd_frames(body)
    out = io.BytesIO()
    try:
        with zstandard.ZstdDecompressor().stream_reader(io.BytesIO(body), read_across_frames=True) as reader:
            while chunk := reader.read(1 << 20):
                out.write(chunk)
                if out.tell() > max_bytes:
                    raise PayloadTooLarge(f"the decompressed body is over the limit of {max_bytes} bytes")
    except zstandard.ZstdError as e:
        raise BadRequest(f"the body is not valid zstd: {e}") from e
    if declared is not None and out.tell() != declared:
        raise BadRequest(
            f"the zstd body decodes to {out.tell()} bytes but its frame headers declare {declared}"
        )
    return out.getvalue()


_ZSTD_MAGIC = 0xFD2FB528
_SKIPPABLE = range(0x184D2A50, 0x184D2A60)


def _zstd_frames(body: bytes) -> int | None:
    """Walk the body's zstd frames (RFC 8878 §3.1) without decoding them: every frame must end
    inside the body and nothing may follow the last one. Returns the total content size the
    frame headers declare (None when a frame does not declare it)."""
    pos, total, frames = 0, 0, 0
    known = True
    while pos < len(body):
        if len(body) - pos < 8:
            raise BadRequest(f"the zstd body is truncated or has trailing bytes at byte {pos} of {len(body)}")
        magic = int.from_bytes(body[pos : pos + 4], "little")
        if magic in _SKIPPABLE:
            pos += 8 + int.from_bytes(body[pos + 4 : pos + 8], "little")
            if pos > len(body):
                raise BadRequest("the zstd body is truncated: a skippable frame runs past its end")
            continue
        if magic != _ZSTD_MAGIC:
            raise BadRequest(f"the body is not valid zstd: no frame starts at byte {pos}")
        try:
            params = zstandard.get_frame_parameters(body[pos:])
            pos += zstandard.frame_header_size(body[pos:])
        except zstandard.ZstdError as e:
            raise BadRequest(f"the body is not valid zstd: {e}") from e
        frames += 1
        if params.content_size == zstandard.CONTENTSIZE_UNKNOWN:
            known = False
        else:
            total += params.content_size
        while True:  # blocks: a 3-byte header (last flag, type, size), then the block's bytes
            if pos + 3 > len(body):
                raise BadRequest(f"the zstd body is truncated: frame {frames} ends before its last block")
            header = int.from_bytes(body[pos : pos + 3], "little")
            block_type, size = (header >> 1) & 3, header >> 3
            if block_type == 3:
                raise BadRequest(f"the body is not valid zstd: reserved block type at byte {pos}")
            pos += 3 + (1 if block_type == 1 else size)  # an RLE block stores one byte
            if pos > len(body):
                raise BadRequest(f"the zstd body is truncated: frame {frames} is cut inside a block")
            if header & 1:
                break
        pos += 4 if params.has_checksum else 0
        if pos > len(body):
            raise BadRequest(f"the zstd body is truncated: frame {frames} is missing its checksum")
    if frames == 0:
        raise BadRequest("the body is not valid zstd: it holds no frame")
    return total if known else None


# ---------------------------------------------------------------------------- requests
def decode_forward_backward(body: bytes) -> ForwardBackwardCall:
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except (DecodeError, ValueError) as e:
        raise BadRequest(f"the body is not a protobuf ForwardBackwardRequest: {e}") from e
    if not msg.model_id:
        raise BadRequest("ForwardBackwardRequest.model_id is missing")
    if msg.seq_id <= 0:
        raise BadRequest(f"ForwardBackwardRequest.seq_id must be >= 1, got {msg.seq_id}")
    digest = hashlib.sha256(b"forward_backward\n" + msg.SerializeToString(deterministic=True)).hexdigest()
    config: dict[str, float] = dict(msg.loss_fn_config)
    loss_id = None
    try:
        for key, value in msg.loss_fn_config_v2.items():
            if key == "loss_id" and value.WhichOneof("value") == "text":
                loss_id = value.text
                continue
            if value.WhichOneof("value") == "text":
                raise BadRequest(f"loss_fn_config[{key!r}] is a string; only numbers are supported")
            config[key] = value.number
        data = [_datum(i, d) for i, d in enumerate(msg.data)]
    except BadRequest as e:
        return ForwardBackwardCall(
            msg.model_id, msg.seq_id, msg.forward_only, msg.loss_fn, config, [], digest, e, loss_id
        )
    return ForwardBackwardCall(
        msg.model_id, msg.seq_id, msg.forward_only, msg.loss_fn, config, data, digest, None, loss_id
    )


def _datum(i: int, d: pb.Datum) -> types.Datum:
    chunks: list[Any] = []
    for chunk in d.model_input:
        kind = chunk.WhichOneof("chunk")
        if kind == "encoded_text":
            tokens = _frombuffer(chunk.encoded_text.tokens, np.dtype(np.int32), f"datum {i} tokens").tolist()
            chunks.append(EncodedTextChunk.model_construct(tokens=tokens))
        elif kind == "image":  # checked (a format, data, expected_tokens) on arrival: ops.py
            image = chunk.image
            expected = image.expected_tokens if image.HasField("expected_tokens") else None
            chunks.append(
                ImageChunk.model_construct(data=image.data, format=image.format, expected_tokens=expected)
            )
        else:
            raise BadRequest(
                f"datum {i}: {kind or 'empty'} chunks are not supported (only encoded_text and image)"
            )
    inputs = {name: _tensor(t, f"datum {i} loss_fn_inputs[{name!r}]") for name, t in d.loss_fn_inputs.items()}
    model_input = types.ModelInput.model_construct(chunks=chunks)
    if len(d.model_input_spans) or len(d.loss_fn_input_spans):  # provenance (stable_reinforce)
        spans = (_spans(i, d.model_input_spans), _spans(i, d.loss_fn_input_spans))
        return types.Datum(
            model_input=model_input,
            loss_fn_inputs=inputs,
            model_input_spans=spans[0],
            loss_fn_input_spans=spans[1],
        )
    return types.Datum(model_input=model_input, loss_fn_inputs=inputs)


def _spans(i: int, msgs: Any) -> list[types.PromptProvenanceSpan | types.SampledProvenanceSpan]:
    out: list[types.PromptProvenanceSpan | types.SampledProvenanceSpan] = []
    for m in msgs:
        kind = m.WhichOneof("span")
        if kind is None:
            raise BadRequest(f"datum {i}: a provenance span names neither prompt nor sampled tokens")
        arm = getattr(m, kind)
        cls = types.SampledProvenanceSpan if kind == "sampled_tokens" else types.PromptProvenanceSpan
        try:
            out.append(cls(sequence_id=arm.sequence_id, offset=int(arm.offset), length=int(arm.length)))
        except ValueError as e:
            raise BadRequest(f"datum {i}: {e}") from e
    return out


def _frombuffer(raw: bytes, dtype: np.dtype, where: str) -> np.ndarray:
    if len(raw) % dtype.itemsize:
        raise BadRequest(f"{where}: {len(raw)} bytes is not a whole number of {dtype} values")
    return np.frombuffer(raw, dtype=dtype)


def _tensor(t: pb.Tensor, where: str) -> types.TensorData:
    if t.dtype not in _NP_OF_PROTO:
        raise BadRequest(f"{where}: unsupported dtype {t.dtype}")
    np_dtype, public = _NP_OF_PROTO[t.dtype]
    shape = [int(s) for s in t.shape]
    if any(s < 0 for s in shape):
        raise BadRequest(f"{where}: negative shape {shape}")
    if t.WhichOneof("encoding") == "sparse_csr":
        arr = _dense_from_csr(t.sparse_csr, np_dtype, shape, where)
    else:
        arr = _frombuffer(t.dense, np_dtype, where)
        if shape and math.prod(shape) != arr.size:
            raise BadRequest(f"{where}: {arr.size} values do not fill shape {shape}")
        arr = arr.reshape(shape) if shape else arr
    if t.dtype == pb.DTYPE_BFLOAT16:
        arr = (arr.astype(np.uint32) << 16).view(np.float32)
    return types.TensorData(data=np.array(arr, dtype=np.dtype(public)), dtype=public, shape=list(arr.shape))  # type: ignore[arg-type]


def _dense_from_csr(csr: pb.SparseCsr, np_dtype: np.dtype, shape: list[int], where: str) -> np.ndarray:
    if len(shape) != 2:
        raise BadRequest(f"{where}: a sparse tensor needs a 2-D shape, got {shape}")
    rows, cols = shape
    if rows * cols > MAX_TENSOR_ELEMENTS:
        raise BadRequest(f"{where}: shape {shape} is too large")
    values = _frombuffer(csr.values, np_dtype, where)
    crow = _frombuffer(csr.crow_indices, np.dtype(np.int64), where + " crow_indices")
    col = _frombuffer(csr.col_indices, np.dtype(np.int64), where + " col_indices")
    ok = (
        len(crow) == rows + 1
        and crow[0] == 0
        and bool(np.all(np.diff(crow) >= 0))
        and crow[-1] == len(col) == len(values)
        and bool(np.all((col >= 0) & (col < cols)))
    )
    if not ok:
        raise BadRequest(f"{where}: inconsistent sparse CSR indices for shape {shape}")
    dense = np.zeros(shape, dtype=np_dtype)
    dense[np.repeat(np.arange(rows), np.diff(crow)), col] = values
    return dense


# ---------------------------------------------------------------------------- results
def encode_forward_output(out: types.ForwardBackwardOutput) -> bytes:
    msg = pb.ForwardBackwardOutput(loss_fn_output_type=out.loss_fn_output_type or "ArrayRecord")
    for key, value in out.metrics.items():
        msg.metrics[key] = float(value)
    per_datum = [{k: np.ascontiguousarray(td.to_numpy()) for k, td in d.items()} for d in out.loss_fn_outputs]
    # one ArrayRecord per run of datums whose fields share dtype and trailing shape
    start = 0
    while start < len(per_datum):
        sig = _signature(per_datum[start])
        end = start + 1
        while end < len(per_datum) and _signature(per_datum[end]) == sig:
            end += 1
        record = msg.loss_fn_outputs.add()
        record.num_datums = end - start
        for name in per_datum[start]:
            arrays = [per_datum[j][name] for j in range(start, end)]
            bt = record.fields[name]
            public = "int64" if arrays[0].dtype.kind in "iub" else "float32"
            raw = [a.astype(np.dtype(public), copy=False).tobytes() for a in arrays]
            bt.dtype = _PROTO_OF_DTYPE[public]
            bt.data = b"".join(raw)
            bt.offsets = np.concatenate([[0], np.cumsum([len(r) for r in raw])]).astype(np.int64).tobytes()
            bt.trailing_shape.extend(arrays[0].shape[1:])
        start = end
    return msg.SerializeToString()


def _signature(datum: dict[str, np.ndarray]) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
    return tuple((k, a.dtype.kind, tuple(a.shape[1:])) for k, a in datum.items())


def encode_sample_response(res: types.SampleResponse, *, prompt_logprobs_last_n: int | None = None) -> bytes:
    msg = pb.SampleResponse()
    for seq in res.sequences:
        s = msg.sequences.add()
        s.stop_reason = _STOP_REASON[seq.stop_reason]
        s.tokens = np.asarray(seq.tokens, dtype=np.int32).tobytes()
        if seq.logprobs is not None:
            s.logprobs = np.asarray(seq.logprobs, dtype=np.float32).tobytes()
        if seq.topk_logprobs is not None:
            _topk(s.topk_sampled_logprobs, seq.topk_logprobs)
    prompt = res.prompt_logprobs
    if prompt is not None:
        lp = np.array([np.nan if x is None else x for x in prompt], dtype=np.float32)
        if prompt_logprobs_last_n is not None:
            lp[: max(0, len(lp) - prompt_logprobs_last_n)] = np.nan
        msg.prompt_logprobs = lp.tobytes()
    topk = res.topk_prompt_logprobs
    if topk is not None:
        if prompt_logprobs_last_n is not None:
            topk = [None if i < len(topk) - prompt_logprobs_last_n else row for i, row in enumerate(topk)]
        _topk(msg.topk_prompt_logprobs, topk)
    if res.target_prompt_logprobs is not None:
        _tensor_out(msg.target_prompt_logprobs, res.target_prompt_logprobs)
    msg.prompt_cache_hit_tokens = res.prompt_cache_hit_tokens
    if res.prompt_alt_tokens is not None:
        _tensor_out(msg.prompt_alt_tokens.tokens, res.prompt_alt_tokens.tokens, np.int32)
        _tensor_out(msg.prompt_alt_tokens.logprobs, res.prompt_alt_tokens.logprobs)
    return msg.SerializeToString()


def _topk(out: pb.TopkLogprobs, rows: list[list[tuple[int, float]] | None]) -> None:
    """Rows of (token, logprob) as the dense N x K matrices the SDK parses (empty cells:
    token 0, logprob ``MASK_LOGPROB``)."""
    k = max((len(row) for row in rows if row), default=0)
    ids = np.zeros((len(rows), k), dtype=np.int32)
    lps = np.full((len(rows), k), MASK_LOGPROB, dtype=np.float32)
    for i, row in enumerate(rows):
        for j, (tok, logprob) in enumerate(row or ()):
            ids[i, j], lps[i, j] = tok, logprob
    out.token_ids, out.logprobs, out.k, out.length = ids.tobytes(), lps.tobytes(), k, len(rows)


_PROTO_OF_NP = {
    np.dtype(np.float32): pb.DTYPE_FLOAT32,
    np.dtype(np.int64): pb.DTYPE_INT64,
    np.dtype(np.int32): pb.DTYPE_INT32,
}


def _tensor_out(out: pb.Tensor, td: types.TensorData, as_dtype: type | None = None) -> None:
    """A ``TensorData`` into a proto ``Tensor`` (dense, or sparse CSR as it came)."""
    arr = np.asarray(td.data, dtype=as_dtype or (np.float32 if td.dtype == "float32" else np.int64))
    out.dtype = _PROTO_OF_NP[arr.dtype]
    if td.shape is not None:
        out.shape.extend(td.shape)
    if td.sparse_crow_indices is not None and td.sparse_col_indices is not None:
        out.sparse_csr.values = arr.tobytes()
        out.sparse_csr.crow_indices = np.asarray(td.sparse_crow_indices, dtype=np.int64).tobytes()
        out.sparse_csr.col_indices = np.asarray(td.sparse_col_indices, dtype=np.int64).tobytes()
    else:
        out.dense = arr.tobytes()
