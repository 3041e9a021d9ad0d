"""The step-wise decoder: a running batch that requests join and leave between decode steps.

``NativeBackend.generate`` and the sampling loop (:mod:`opentinker.sampling.loop`) both drive
one :class:`StepDecoder` through four moves:

* **pin** (:meth:`StepDecoder.pin`): validate a request and resolve its policy to the weights it
  will sample (a snapshot's immutable copy, or None for the bare base model). From then on the
  request holds those weights: a snapshot retired afterwards keeps serving it.
* **admit** (:meth:`StepDecoder.admit`): prefill a group of pinned requests (left-padded, each row
  routed through its own policy; a prompt continuing a finished sequence starts from the prefix
  cache's keys and values, prompts sharing a common prefix under one policy prefill it once), fan
  out ``num_samples`` rows per request, choose every row's first token, and merge the rows that
  go on into the running batch (:meth:`~opentinker.sampling.forward.Forward.merge`).
* **step** (:meth:`StepDecoder.step`): one decode step of every running row, old and new alike,
  each with its own policy, sampling parameters and seeded generator.
* **switch** (:meth:`StepDecoder.switch`): the rows of every request following a training model
  (``SampleRequest.follow``, a ``kind="inflight"`` sampler's) move to new weights in place, keys
  and values kept; the rule is in the method's docstring.
* **progress** (:meth:`StepDecoder.progress`): a request's samples so far, read between steps to
  stream their tokens.
* **retire**: rows that stop leave the batch (and the KV cache) at once; a request whose rows have
  all stopped is returned by the ``admit``/``step`` call that finished it. Rows leave the
  running batch (:class:`~opentinker.sampling.batch.RunningBatch`) one way, ``keep``, whether
  they stopped at a step or at their first token or their request was dropped.

What a row computes does not depend on what shares its batch: its keys and values are its own,
its draws come from its own generator (seeded per request and sample index), and padding is
masked. Only float rounding differs with the batch's shape (tests/tolerances.py).

A decoder is driven by one thread at a time (it owns the backend's prefix cache and stacked-LoRA
cache while it runs).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Hashable
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from opentinker.engine import Engine, EngineError
from opentinker.engine.passes import length_buckets
from opentinker.engine.types import PolicyRef
from opentinker.lora import LoRABatch, LoRAWeights
from opentinker.sampling.batch import RunningBatch
from opentinker.sampling.choice import Row, choose_tokens, prompt_logprobs, shaped, topk_logprobs
from opentinker.sampling.forward import (
    Forward,
    HFForward,
    LeanForward,
    LoRACache,
    SharedPrefix,
    make_plan,
    replan,
)
from opentinker.sampling.hf_cache import RowState
from opentinker.sampling.kv_cache import fill_holes
from opentinker.sampling.lean_model import LeanModel
from opentinker.sampling.prefix_cache import PrefixCache, PrefixHit
from opentinker.sampling.types import SampledSequence, SampleRequest, SampleResult, StopReason
from opentinker.sampling.vision import cache_tokens, inside_image, vision_rows

MIN_SHARED_PREFIX = 8  # tokens; a shorter common prefix is not worth a second forward

# (request id, its result or the error that refused or failed it)
Finished = tuple[int, SampleResult | Exception]
# a sample so far: its tokens, their logprobs, their top logprobs (None: not asked)
Progress = tuple[list[int], list[float], list[list[tuple[int, float]]] | None]


@dataclass
class Pinned:
    """A validated request and the weights it samples (None: the bare base model)."""

    req: SampleRequest
    weights: LoRAWeights | None

    @property
    def slot(self) -> PolicyRef:
        """The batch's name for these weights: the policy id and the weights' identity, so two
        requests naming one id for different weights (released and reused) never share a slot."""
        return None if self.weights is None else f"{self.req.policy}#{self.weights.uid}"


class Decoder(Protocol):
    """What the sampling loop drives: :class:`StepDecoder`, or another backend's step-wise decoder
    (:class:`~opentinker.sampling.vllm_backend.VLLMDecoder`, and
    :class:`~opentinker.sampling.routed.RoutedDecoder` over both). Every one implements all of it;
    where a backend cannot do a thing in place, its method says what it does instead."""

    steps: int

    @property
    def live_rows(self) -> int: ...

    def running(self) -> list[int]:
        """The ids of the requests with rows in the running batch."""
        ...

    def pin(self, req: SampleRequest) -> Pinned:
        """Validate ``req`` and resolve its weights now (``EngineError`` naming the problem)."""
        ...

    def admit(self, items: list[tuple[int, Pinned]]) -> list[Finished]:
        """Start ``items`` (request id, pinned request); returns those that finished or failed."""
        ...

    def step(self) -> list[Finished]:
        """One decode step of every running row; returns the requests that finished."""
        ...

    def drop(self, rid: int) -> bool:
        """Take request ``rid``'s rows out of the running batch now (its caller is gone); True
        if it had rows here."""
        ...

    def switch(self, group: str, pinned: Pinned) -> int:
        """Move the running requests following ``group`` to ``pinned``'s weights from the next
        step on; returns how many moved."""
        ...

    def progress(self, rids: Collection[int]) -> dict[int, list[Progress]]:
        """Of requests ``rids``, those with rows here: each sample's tokens so far."""
        ...


@dataclass
class _Job:
    rid: int
    pinned: Pinned
    cached: bool  # its finished rows' keys and values go to the prefix cache
    key: Hashable  # its policy key there
    result: SampleResult = field(default_factory=lambda: SampleResult(sequences=[]))
    seqs: list[SampledSequence | None] = field(default_factory=list)
    left: int = 0  # rows still decoding


def admission_parts(items: list[tuple[int, Pinned]]) -> list[list[tuple[int, Pinned]]]:
    """The prefills of one admission: the requests that sample as one, and those that want their
    prompt's logprobs (``compute_logprobs``: every position's logits, no prefix cache) apart, in
    length buckets (``engine/passes.py``), so that a short prompt is not padded to a long one's
    width, nor does a logprob request take the prefix cache from the others."""
    plain = [it for it in items if not it[1].req.wants_prompt]
    scored = [it for it in items if it[1].req.wants_prompt]
    buckets = length_buckets([[len(p.req.prompt)] for _, p in scored])
    return ([plain] if plain else []) + [[scored[u] for u in b] for b in buckets]


class StepDecoder:
    def __init__(
        self,
        engine: Engine,
        *,
        validate: Callable[[SampleRequest], None],
        prefix_cache: PrefixCache,
        loras: LoRACache,
        lean: LeanModel | None,
        share_prefix: bool,
        eos_ids: set[int],
        cache_kw: str,
        first_decode_cols: int,
        snapshots_only: bool = False,
    ) -> None:
        """``snapshots_only``: refuse requests naming a live adapter (a decoder on its own thread
        must never read weights the training thread updates in place)."""
        self.engine = engine
        self.validate = validate
        self.prefix_cache = prefix_cache
        self.loras = loras
        self.lean = lean
        self.share_prefix = share_prefix
        self.eos_ids = eos_ids
        self.tokenizer = engine.base.tokenizer
        self.cache_kw = cache_kw
        self.first_decode_cols = first_decode_cols
        self.snapshots_only = snapshots_only
        self._batch: RunningBatch | None = None  # the rows decoding now
        self._jobs: dict[int, _Job] = {}
        vision = engine.base.vision  # its image and vision markers are never sampled (choice.py)
        self._banned = None if vision is None else torch.tensor(sorted(vision.special_ids), dtype=torch.long)
        self.steps = 0  # decode steps run

    @property
    def live_rows(self) -> int:
        return len(self._rows)

    @property
    def _rows(self) -> list[Row]:
        return [] if self._batch is None else self._batch.rows

    def running(self) -> list[int]:
        """The ids of the requests with rows in the running batch."""
        return list(self._jobs)

    def pin(self, req: SampleRequest) -> Pinned:
        """Validate ``req`` and resolve its policy now; raises :class:`EngineError` naming the problem."""
        self.validate(req)
        if req.policy is not None and self.snapshots_only and self.engine.has_adapter(req.policy):
            raise EngineError(
                f"{req.policy!r} is a model being trained; sample from a snapshot of it "
                "(save_weights_for_sampler) so training cannot change the weights mid-sample"
            )
        weights = None if req.policy is None else self.engine.adapter_weights(req.policy)
        return Pinned(req, weights)

    def switch(self, group: str, pinned: Pinned) -> int:
        """Move the running requests that follow ``group`` to ``pinned``'s weights; returns how
        many requests moved.

        The switching rule: the next :meth:`step` after this call is the first to run their rows
        with the new weights. That step feeds each row its last sampled token, so that token's keys
        and values and the next token's logits are the new weights'; the keys and values of the
        prompt and of the tokens before it, computed with the old weights, stay in the cache (they
        are not recomputed). Sampled tokens and logprobs so far stay as they were. A moved
        request's finished rows are not put in the prefix cache (their keys and values mix two
        sets of weights, which no policy key describes), unless it has a KV-cache namespace (an
        inflight session's, whose entries are keyed by it and may mix weights by contract). Requests not following ``group`` (pinned
        ones) are untouched, in the same batch.
        """
        moved = [job for job in self._jobs.values() if job.pinned.req.follow == group]
        batch = self._batch
        if not moved or batch is None:
            return 0
        new = pinned.slot
        for job in moved:
            job.pinned = Pinned(replace(job.pinned.req, policy=pinned.req.policy), pinned.weights)
            job.cached = (
                job.cached and job.pinned.req.kv_namespace is not None
            )  # a namespace allows mixed weights
        ids = {job.rid for job in moved}
        for row in batch.rows:
            if row.req in ids:
                row.policy = new
        batch.weights[new] = pinned.weights
        live = {row.policy for row in batch.rows}
        batch.weights = {p: w for p, w in batch.weights.items() if p in live}
        batch.plan = replan(self.engine, batch.plan, [row.policy for row in batch.rows], batch.weights)
        return len(moved)

    def progress(self, rids: Collection[int]) -> dict[int, list[Progress]]:
        """Of requests ``rids``, those with rows here (admitted, not yet answered): each sample so
        far as (tokens, logprobs, top logprobs or None), finished rows and decoding ones alike.
        The lists are the decoder's own: read them before the next step."""
        out: dict[int, list[Progress]] = {}
        for rid in rids:
            job = self._jobs.get(rid)
            if job is not None:
                out[rid] = [
                    ([], [], None) if s is None else (s.tokens, s.logprobs, s.topk_logprobs) for s in job.seqs
                ]
        if out:
            for row in self._rows:
                got = out.get(row.req)
                if got is not None:
                    got[row.sample] = (row.tokens, row.logprobs, row.topk_logprobs if row.topk else None)
        return out

    def drop(self, rid: int) -> bool:
        """Take request ``rid``'s rows out of the running batch now, unfinished (its caller is
        gone); True if it had rows here. The other rows decode on, untouched; nothing of the
        dropped rows goes into the prefix cache."""
        if self._jobs.pop(rid, None) is None:
            return False
        rows = self._rows
        self._keep(fill_holes([j for j, row in enumerate(rows) if row.req != rid], len(rows)))
        return True

    def _keep(self, idx: list[int]) -> None:
        """The running batch keeps rows ``idx`` (none left: it is gone)."""
        if not idx:
            self._reset()
        elif self._batch is not None:
            self._batch.keep(idx)

    # ------------------------------------------------------------------ admit
    @torch.no_grad()
    def admit(self, items: list[tuple[int, Pinned]]) -> list[Finished]:
        """Prefill ``items`` (request id, pinned request) and merge their rows into the running
        batch; returns the requests that finished already (their first token stopped them).
        Prefills run in the groups :func:`admission_parts` makes; a failed one fails its group."""
        out: list[Finished] = []
        for part in admission_parts(items):
            try:
                out += self._admit(part)
            except Exception as e:  # a failed prefill fails its group, never the running batch
                for rid, _ in part:
                    self._jobs.pop(rid, None)
                out += [(rid, e) for rid, _ in part]
        return out

    def _admit(self, items: list[tuple[int, Pinned]]) -> list[Finished]:
        """One prefill group, in steps: where each prompt starts (a prefix-cache hit, or a prefix
        shared by all), the padded inputs, the forward (lean or HF, images placed), the prefill,
        the prompts' logprobs, the fan-out to ``num_samples`` rows, every row's first token, and
        the merge of the rows that go on into the running batch."""
        pins = [p for _, p in items]
        reqs = [p.req for p in pins]
        want_prompt = any(r.wants_prompt for r in reqs)
        cached = self.prefix_cache.max_bytes > 0 and not want_prompt
        jobs = [_Job(rid, p, cached, _policy_key(p) if cached else None) for rid, p in items]
        slots = [p.slot for p in pins]
        hits, shared = self._prompt_starts(reqs, slots, [j.key for j in jobs] if cached else [], want_prompt)
        skip = [shared] * len(reqs) if shared else [h.length if h is not None else 0 for h in hits]
        inputs = _Inputs.padded(reqs, skip, self.engine.device)
        model = self._forward(reqs, inputs, hits)
        weights = {p.slot: p.weights for p in pins}
        prefill_plan = model.plan(slots, weights)
        prefix = None
        if shared:
            prefix = SharedPrefix(reqs[0].prompt[:shared], make_plan(self.engine, [slots[0]], weights))
        logits = model.prefill(inputs.ids, inputs.mask, inputs.pos, want_prompt, prefill_plan, prefix)
        for i, r in enumerate(reqs):
            if r.wants_prompt:
                prompt_logprobs(jobs[i].result, logits[i, inputs.width - inputs.lens[i] :], r)
            if hits[i] is not None:  # a prefix shared within this batch is not a cache hit
                jobs[i].result.prompt_cache_hit_tokens = skip[i]
        batch, select = self._fan_out(jobs, model, prefill_plan, weights)
        done, keep = self._advance(batch.model, batch.rows, logits[select, -1])  # the first tokens
        if keep:
            batch.keep(keep)
            if self._batch is None:
                self._batch = batch
            else:
                self._batch.join(batch)
        return done

    def _forward(self, reqs: list[SampleRequest], inputs: _Inputs, hits: list[PrefixHit | None]) -> Forward:
        """The admission's forward: the lean one (its static cache sized for the longest row) or
        HF's, each starting from the prefix-cache entries its path keeps; images placed in HF's."""
        eng = self.engine
        prefixes = [h.kv if h is not None else None for h in hits] if any(hits) else None
        if self.lean is not None:
            tensors = (
                None if prefixes is None else [p if isinstance(p, torch.Tensor) else None for p in prefixes]
            )
            # columns the decode may feed: every row's new tokens but its last
            most = max(_limit(r, eng.max_context) for r in reqs)
            cols = max(inputs.skip) + inputs.width
            return LeanForward(eng, self.lean, cols, most - 1, self.loras, tensors, self.first_decode_cols)
        states = None if prefixes is None else [p if isinstance(p, RowState) else None for p in prefixes]
        model = HFForward(eng, self.cache_kw, states)
        if eng.base.vision is not None and any(r.images for r in reqs):  # sampling/vision.py
            prompts, images = [r.prompt for r in reqs], [r.images for r in reqs]
            model.vision = vision_rows(eng.base.model, eng.base.vision, prompts, images, inputs.skip)
        return model

    def _fan_out(
        self,
        jobs: list[_Job],
        model: Forward,
        prefill_plan: LoRABatch | None,
        weights: dict[PolicyRef, LoRAWeights | None],
    ) -> tuple[RunningBatch, torch.Tensor]:
        """``num_samples`` rows per request, its prefill's cache row copied to each; the jobs
        registered. Returns the new rows' batch and, per row, its request's prefill row."""
        rows: list[Row] = []
        index: list[int] = []
        for i, job in enumerate(jobs):
            r = job.pinned.req
            job.seqs = [None] * r.num_samples
            job.left = r.num_samples
            self._jobs[job.rid] = job
            for k in range(r.num_samples):
                rows.append(self._new_row(job.rid, job.pinned.slot, r, k))
                index.append(i)
        select = torch.tensor(index, device=self.engine.device)
        model.select(select)
        # the prefill's stacked adapters serve the decode (rows follow their requests in order)
        plan = model.fan_out(prefill_plan, select, [row.policy for row in rows], weights)
        return RunningBatch(self.engine, model, plan, rows, dict(weights)), select

    # ------------------------------------------------------------------ step
    @torch.no_grad()
    def step(self) -> list[Finished]:
        """One decode step of every running row; returns the requests it finished."""
        batch = self._batch
        if batch is None:
            return []
        rows, dev = batch.rows, self.engine.device
        try:
            ids = torch.tensor([[row.tokens[-1]] for row in rows], device=dev)
            # the fed token's position: the row's own (not its column in the cache)
            pos = torch.tensor([[row.prompt_len + len(row.tokens) - 1] for row in rows], device=dev)
            logits = batch.model.step(ids, pos, batch.plan)
            self.steps += 1
            done, keep = self._advance(batch.model, rows, logits)
        except Exception as e:  # fail what was running, keep serving what comes next
            failed: list[Finished] = [(rid, e) for rid in self._jobs]
            self._reset()
            return failed
        self._keep(keep)
        return done

    def _reset(self) -> None:
        self._batch = None
        self._jobs.clear()

    def _advance(
        self, model: Forward, rows: list[Row], last: torch.Tensor
    ) -> tuple[list[Finished], list[int]]:
        """Choose each row's next token from ``last`` ([rows, V]); finished rows are stored in
        their requests (and their keys and values in the prefix cache). Returns the requests
        finished and the indices of the rows that go on, in the order that moves the fewest rows
        of the cache (:func:`~opentinker.sampling.kv_cache.fill_holes`)."""
        ctx = self.engine.max_context
        last = shaped(last, rows)  # penalties, logit bias, grammars (unshaped rows untouched)
        topk = topk_logprobs(last, rows) if any(row.topk for row in rows) else None
        if self._banned is not None and self._banned.device != last.device:
            self._banned = self._banned.to(last.device)
        chosen = choose_tokens(last, rows, self._banned)
        for j, (row, (tok, lp)) in enumerate(zip(rows, chosen, strict=True)):
            row.tokens.append(tok)
            row.logprobs.append(lp)
            if topk is not None and (top := topk[j]) is not None:
                row.topk_logprobs.append(top)
            row.reason = self._stop_reason(row, ctx)
        done: list[Finished] = []
        keep: list[int] = []
        for j, row in enumerate(rows):
            if row.reason is None:
                keep.append(j)
                continue
            job = self._jobs[row.req]
            if job.cached:  # keep what the finished row computed
                tokens = self._cache_prompt(job.pinned.req) + row.tokens[:-1]
                self.prefix_cache.put(job.key, tokens, model.row_kv(j))
            top = row.topk_logprobs if row.topk else None
            job.seqs[row.sample] = SampledSequence(row.tokens, row.logprobs, row.reason, top)
            job.left -= 1
            if job.left == 0:
                job.result.sequences = [s for s in job.seqs if s is not None]
                done.append((job.rid, job.result))
                del self._jobs[job.rid]
        return done, fill_holes(keep, len(rows))

    # ------------------------------------------------------------------ helpers
    def _prompt_starts(
        self, reqs: list[SampleRequest], slots: list[PolicyRef], keys: list[Hashable], want_prompt: bool
    ) -> tuple[list[PrefixHit | None], int]:
        """Where each prompt's prefill starts: the prefix cache's hit per request (``keys``: their
        policy keys; empty = the cache is not used), or else the length of the prefix common to
        all prompts, prefilled once and shared (0 = none)."""
        hits: list[PrefixHit | None] = [None] * len(reqs)
        if keys:
            hits = [
                self.prefix_cache.match(k, self._cache_prompt(r)) for k, r in zip(keys, reqs, strict=True)
            ]
            hits = [
                None if h is not None and self._cuts_image(r, h.length) else h
                for h, r in zip(hits, reqs, strict=True)
            ]
        if any(hits) or want_prompt or not self.share_prefix or len(set(slots)) > 1:
            return hits, 0
        if any(r.images for r in reqs):  # the shared-prefix prefill is text-only
            return hits, 0
        return hits, common_prompt_prefix(reqs)

    def _cache_prompt(self, r: SampleRequest) -> list[int]:
        """The prompt as the prefix cache keys it: an image's positions by its content."""
        vision = self.engine.base.vision
        return r.prompt if vision is None else cache_tokens(r.prompt, r.images, vision.image_token_id)

    def _cuts_image(self, r: SampleRequest, n: int) -> bool:
        vision = self.engine.base.vision
        return vision is not None and inside_image(r.prompt, r.images, vision.image_token_id, n)

    def _new_row(self, rid: int, slot: PolicyRef, r: SampleRequest, k: int) -> Row:
        seed = r.params.seed
        gen = torch.Generator(device="cpu")
        if seed is None:
            gen.manual_seed(int.from_bytes(os.urandom(8), "little") >> 1)
        else:
            gen.manual_seed((int(seed) * 1_000_003 + k) % (1 << 63))
        stop = r.params.stop
        # the SDK's contract: None stops at EOS; a non-empty list stops at its entries *and* at
        # EOS; only [] disables every stop, EOS included
        if stop is None:
            ids, strs = frozenset(self.eos_ids), ()
        elif not stop:
            ids, strs = frozenset(), ()
        elif all(isinstance(s, int) for s in stop):
            ids, strs = frozenset(self.eos_ids | {int(s) for s in stop}), ()
        else:
            ids, strs = frozenset(self.eos_ids), tuple(str(s) for s in stop)
        return Row(rid, slot, r.params, len(r.prompt), gen, ids, strs, sample=k, topk=r.topk_sample_logprobs)

    def _stop_reason(self, row: Row, ctx: int) -> StopReason | None:
        if row.tokens[-1] in row.stop_ids:
            return "stop"
        if row.stop_strs:
            # decode the whole completion: a stop string may span several tokens
            text = self.tokenizer.decode(row.tokens, skip_special_tokens=False)
            if any(s in text for s in row.stop_strs):
                return "stop"
        if len(row.tokens) >= row.params.max_tokens or row.prompt_len + len(row.tokens) >= ctx:
            return "length"
        return None


@dataclass(frozen=True)
class _Inputs:
    """An admission's prompts, left-padded to one width: the tokens after each one's ``skip``
    (what the prefix cache or the shared prefix already holds), the mask, the positions."""

    ids: torch.Tensor
    mask: torch.Tensor
    pos: torch.Tensor
    lens: list[int]  # each prompt's new tokens
    width: int
    skip: list[int]

    @classmethod
    def padded(cls, reqs: list[SampleRequest], skip: list[int], dev: torch.device) -> _Inputs:
        lens = [len(r.prompt) - k for r, k in zip(reqs, skip, strict=True)]
        width = max(lens)
        ids = torch.zeros(len(reqs), width, dtype=torch.long, device=dev)
        mask = torch.zeros(len(reqs), width, dtype=torch.long, device=dev)
        for i, r in enumerate(reqs):
            ids[i, width - lens[i] :] = torch.tensor(r.prompt[skip[i] :], device=dev)
            mask[i, width - lens[i] :] = 1
        pos = (mask.cumsum(-1) - 1).clamp(min=0) + torch.tensor(skip, device=dev)[:, None]
        return cls(ids, mask, pos, lens, width, skip)


def run_to_completion(dec: Decoder, requests: list[SampleRequest]) -> list[SampleResult | EngineError]:
    """One batch on ``dec``, run to completion: every request admitted at once, then decoded until
    each row has stopped. A refused request yields its ``EngineError`` in its slot."""
    results: list[SampleResult | EngineError | None] = [None] * len(requests)
    pinned: list[tuple[int, Pinned]] = []
    for i, req in enumerate(requests):
        try:
            pinned.append((i, dec.pin(req)))
        except EngineError as e:
            results[i] = e
    done = dec.admit(pinned)
    while dec.live_rows:
        done += dec.step()
    for i, res in done:
        if isinstance(res, EngineError) or not isinstance(res, Exception):
            results[i] = res
        else:
            raise res  # an engine bug: the caller fails the batch
    return [r if r is not None else EngineError("request was not run") for r in results]


def _limit(r: SampleRequest, ctx: int) -> int:
    """The most tokens a row of ``r`` can sample."""
    return min(r.params.max_tokens, ctx - len(r.prompt))


def _policy_key(p: Pinned) -> Hashable:
    """What the keys and values a policy computes depend on: the base model's (None), or a
    policy's id with its weights' process-unique id and version counters (an adapter that
    trained, or a snapshot id released and reused for other weights, never matches); a request with a
    KV-cache namespace (an inflight session's): that namespace, whatever weights it is on now."""
    if p.req.kv_namespace is not None:
        return ("kv_namespace", p.req.kv_namespace)
    if p.weights is None:
        return None
    return (p.req.policy, p.weights.uid, tuple(t._version for t in p.weights.tensors()))


def common_prompt_prefix(reqs: list[SampleRequest]) -> int:
    """Length of the prompt prefix that every request shares under one policy (each keeps at least
    one token of its own to prefill), or 0 when it is not worth sharing."""
    if len(reqs) < 2 or len({r.policy for r in reqs}) > 1:
        return 0
    first = reqs[0].prompt
    n = min(len(r.prompt) for r in reqs) - 1
    for r in reqs[1:]:
        p = r.prompt
        k = 0
        while k < n and p[k] == first[k]:
            k += 1
        n = k
    return n if n >= MIN_SHARED_PREFIX else 0
