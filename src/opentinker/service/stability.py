"""Stability records for ``stable_reinforce``: what the sampler saw, per returned sequence, and the
resolution of a training datum's provenance spans against it.

Sampling with ``record_stability_info=True`` records each returned sequence under its
``sequence_id`` (the id ``/asample`` hands the SDK): its prompt tokens, sampled tokens, the
sampler's logprob of each, and the policy version (the sampler id and the weights it served). An
image in the prompt is recorded by content: its positions as ids made from its pixel digest
(``service/convert.py`` ``keyed_tokens``), so a datum claiming that prompt with another image is
refused like one with other tokens.

Lifetime, as Tinker documents it: a record belongs to the session that sampled it and can be
trained on for one day (``ttl_s``) after sampling; each training request that uses it restarts
that day. Records live in this server process's memory (a restart forgets them) and at most
``max_per_session`` of them per session are kept, the least recently used dropped first.

:meth:`StabilityRecords.resolve` turns a ``stable_reinforce`` datum into the inputs the engine's
loss reads (``engine/losses.py``): it checks that the spans tile ``model_input`` and
``target_tokens``, that every span names a sequence of the training model's own session, inside
its tokens, and that the tokens the datum claims are the tokens recorded (all of ``model_input``;
of ``target_tokens``, the sampled targets only: prompt targets get mask 0 and never reach the
loss, and tinker-cookbook's ``rl_loop`` fills them with placeholder zeros); then it adds
``stability_logprobs`` (the recorded sampler logprob on each sampled target, 0 elsewhere),
``stability_mask`` (1 on sampled targets) and ``stability_sequence`` (the sequence's index within
the datum, -1 on prompt targets). Anything else is a user error naming the datum and span.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
from tinker import types

from opentinker.engine import EngineError
from opentinker.engine.losses import STABILITY_INPUTS
from opentinker.models.vision import Vision
from opentinker.service.convert import keyed_tokens

DAY_S = 24 * 3600.0


@dataclass
class SequenceRecord:
    tenant: str
    session_id: str
    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]
    policy: str  # the sampler and the weights it served
    touched: float


class StabilityRecords:
    def __init__(self, ttl_s: float = DAY_S, max_per_session: int = 100_000) -> None:
        self.ttl_s = ttl_s
        self.max_per_session = max_per_session
        self._lock = threading.Lock()
        self._by_session: dict[str, OrderedDict[str, SequenceRecord]] = {}

    def record(
        self,
        tenant: str,
        session_id: str,
        ids: list[str],
        prompt: list[int],
        res: types.SampleResponse,
        policy: str,
    ) -> None:
        now = time.time()
        with self._lock:
            table = self._by_session.setdefault(session_id, OrderedDict())
            for sequence_id, seq in zip(ids, res.sequences, strict=True):
                logprobs = [float(x) for x in (seq.logprobs or [])]
                table[sequence_id] = SequenceRecord(
                    tenant, session_id, list(prompt), list(seq.tokens), logprobs, policy, now
                )
            while len(table) > self.max_per_session:
                table.popitem(last=False)

    def get(self, tenant: str, session_id: str, sequence_id: str) -> SequenceRecord | None:
        """The live record, or None (unknown, expired, another tenant's or another session's)."""
        with self._lock:
            rec = self._by_session.get(session_id, OrderedDict()).get(sequence_id)
        if rec is None or rec.tenant != tenant or time.time() - rec.touched > self.ttl_s:
            return None
        return rec

    def _find(self, tenant: str, session_id: str, sequence_id: str, where: str) -> SequenceRecord:
        rec = self.get(tenant, session_id, sequence_id)
        if rec is not None:
            return rec
        with self._lock:
            elsewhere = any(sequence_id in t for s, t in self._by_session.items() if s != session_id)
        if elsewhere:  # say no more than that: another session's (or tenant's) tokens stay private
            raise EngineError(
                f"{where} names sequence {sequence_id!r}, which was not sampled in this model's session; "
                "provenance works only within one session"
            )
        raise EngineError(
            f"{where} names sequence {sequence_id!r}, which this server has no record of (sample with "
            "record_stability_info=True in this session; records last one day and not across restarts)"
        )

    # ---------------------------------------------------------------- resolution
    def resolve(
        self, tenant: str, session_id: str, data: list[types.Datum], vision: Vision | None = None
    ) -> list[types.Datum]:
        """Each datum with the stability inputs added (see the module docstring); touches every
        record used, restarting its day. Raises ``EngineError`` and changes nothing on bad spans.
        ``vision``: the base model's, to key a datum's images as the record keyed its prompt's."""
        out, used = [], []
        for i, d in enumerate(data):
            where = f"datum {i}"
            for key in STABILITY_INPUTS:
                if key in d.loss_fn_inputs:
                    raise EngineError(
                        f"{where}: loss_fn_inputs[{key!r}] is set by the server; do not send it"
                    )
            if d.model_input_spans is None or d.loss_fn_input_spans is None:
                raise EngineError(
                    f"{where}: stable_reinforce needs provenance spans (Datum.with_provenance) naming "
                    "the sampled sequences behind its tokens"
                )
            tokens = keyed_tokens(d.model_input, vision, where)
            targets_td = d.loss_fn_inputs.get("target_tokens")
            if targets_td is None:
                raise EngineError(f"{where}: loss_fn_inputs is missing 'target_tokens'")
            targets = [int(x) for x in np.asarray(targets_td.to_numpy()).reshape(-1)]
            self._check_spans(tenant, session_id, f"{where} model_input", d.model_input_spans, tokens, used)
            q, mask, seq = self._target_spans(tenant, session_id, where, d.loss_fn_input_spans, targets, used)
            extra = {
                "stability_logprobs": types.TensorData(data=q, dtype="float32", shape=[len(q)]),
                "stability_mask": types.TensorData(data=mask, dtype="float32", shape=[len(mask)]),
                "stability_sequence": types.TensorData(data=seq, dtype="float32", shape=[len(seq)]),
            }
            out.append(types.Datum(model_input=d.model_input, loss_fn_inputs={**d.loss_fn_inputs, **extra}))
        now = time.time()
        for rec in used:
            rec.touched = now
        return out

    def _runs(
        self, tenant: str, session_id: str, where: str, spans: Any, length: int, used: list[SequenceRecord]
    ) -> list[tuple[int, bool, SequenceRecord, int, int]]:
        """(position, sampled?, record, offset, length) per span, after checking the tiling."""
        total = sum(s.length for s in spans)
        if total != length:
            raise EngineError(f"{where}: provenance spans cover {total} positions, but it has {length}")
        runs, pos = [], 0
        for j, span in enumerate(spans):
            sampled = isinstance(span, types.SampledProvenanceSpan)
            rec = self._find(tenant, session_id, span.sequence_id, f"{where} span {j}")
            have = len(rec.tokens) if sampled else len(rec.prompt)
            if span.offset < 0 or span.length < 0 or span.offset + span.length > have:
                kind = "sampled tokens" if sampled else "prompt"
                raise EngineError(
                    f"{where} span {j}: [{span.offset}, {span.offset + span.length}) is outside sequence "
                    f"{span.sequence_id!r}'s {have} {kind}"
                )
            runs.append((pos, sampled, rec, span.offset, span.length))
            used.append(rec)
            pos += span.length
        return runs

    def _check_spans(
        self,
        tenant: str,
        session_id: str,
        where: str,
        spans: Any,
        tokens: list[int],
        used: list[SequenceRecord],
    ) -> None:
        for j, (pos, sampled, rec, off, n) in enumerate(
            self._runs(tenant, session_id, where, spans, len(tokens), used)
        ):
            recorded = (rec.tokens if sampled else rec.prompt)[off : off + n]
            if tokens[pos : pos + n] != recorded:
                raise EngineError(f"{where} span {j}: the tokens differ from those the sequence recorded")

    def _target_spans(
        self,
        tenant: str,
        session_id: str,
        where: str,
        spans: Any,
        targets: list[int],
        used: list[SequenceRecord],
    ) -> tuple[list[float], list[float], list[float]]:
        n_t = len(targets)
        q, mask, seq = [0.0] * n_t, [0.0] * n_t, [-1.0] * n_t
        index: dict[int, int] = {}  # id(record) -> its index within this datum
        runs = self._runs(tenant, session_id, f"{where} loss_fn_inputs", spans, n_t, used)
        for j, (pos, sampled, rec, off, n) in enumerate(runs):
            if not sampled:  # a prompt target: mask 0, so its token value never reaches the loss
                continue
            if targets[pos : pos + n] != rec.tokens[off : off + n]:
                raise EngineError(
                    f"{where} loss_fn_inputs span {j}: target_tokens differ from the tokens the sequence recorded"
                )
            if len(rec.logprobs) < off + n:
                raise EngineError(
                    f"{where} loss_fn_inputs span {j}: the sequence recorded no sampler logprobs"
                )
            k = index.setdefault(id(rec), len(index))
            for t in range(n):
                q[pos + t], mask[pos + t], seq[pos + t] = rec.logprobs[off + t], 1.0, float(k)
        return q, mask, seq
