"""vLLM with a native fallback: one :class:`SamplingBackend` over both, each snapshot sampled by
the one that can serve it.

``--rollout-backend vllm`` runs a :class:`RoutedBackend`: a
:class:`~opentinker.sampling.vllm_backend.VLLMBackend` and a
:class:`~opentinker.sampling.native.NativeBackend` over the same training engine. Each snapshot is
**placed** when it is first published or sampled (:meth:`RoutedBackend.place`): on vLLM when
vLLM's runtime LoRA can serve it, else on the native backend, with the reason
(:func:`~opentinker.sampling.vllm_lora.refusal`: the unembedding trained, which the SDK's default
``LoraConfig`` does; routed experts; a rank above ``max_lora_rank``). The bare base model (policy
None) and servable adapters stay on vLLM. A placement depends only on the weights, so it never
changes for a snapshot.

:class:`RoutedDecoder` is the sampling loop's decoder: ``pin`` sends a request to its snapshot's
side, ``admit`` splits a group between the two decoders, and ``step`` steps both, so both halves'
rows finish through one loop and ``generate`` answers one mixed batch. ``drop``, ``switch`` and
``progress`` reach both sides: an aborted request's rows leave either (vLLM aborts its requests),
the native fallback's rows switch weights and stream every step, vLLM's rows finish on the weights
they started with and stream each sample as it finishes. The sampler–trainer
mismatch figures are vLLM's rows' (native rows sample with the trainer's own forward).
:meth:`RoutedBackend.served_by` lists which snapshot went where and why (the console's engine page).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from opentinker.engine import Engine, EngineError, UnknownPolicyError
from opentinker.lora import LoRAWeights
from opentinker.sampling.backend import SamplingBackend
from opentinker.sampling.decoder import Finished, Pinned, Progress, StepDecoder, run_to_completion
from opentinker.sampling.native import NativeBackend
from opentinker.sampling.types import SampleRequest, SampleResult
from opentinker.sampling.vllm_backend import VLLMBackend, VLLMDecoder

VLLM, NATIVE = "vllm", "native"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Placement:
    """Where snapshot ``policy_id`` (weights ``uid``) samples, ``vllm`` or ``native``, and why."""

    policy_id: str
    uid: int
    backend: str
    reason: str

    def json(self) -> dict[str, str]:
        return {"snapshot": self.policy_id, "served_by": self.backend, "reason": self.reason}


class RoutedBackend(SamplingBackend):
    def __init__(
        self, vllm: VLLMBackend | None, native: NativeBackend, *, vllm_off: str = "", native_off: str = ""
    ) -> None:
        """``vllm`` and ``native`` over one training engine (``native.engine``); ``vllm`` None:
        vLLM cannot run this base model at all (``vllm_off`` says why), so everything is native.
        ``native_off``: why the native backend cannot sample here (the engine holds no weights:
        :data:`WEIGHTLESS`), so a snapshot vLLM cannot serve is refused, not sampled natively."""
        self.native_off = native_off
        self.vllm = vllm
        self.native = native
        self.engine = native.engine
        self.vllm_off = vllm_off
        self.mismatch_total = None if vllm is None else vllm.mismatch_total
        self._placed: dict[str, Placement] = {}
        self._lock = threading.Lock()  # guards _placed (pin runs on callers' threads)

    @classmethod
    def for_engine(
        cls, engine: Engine, *, prefix_cache_bytes: int | None = None, **vllm_kwargs: Any
    ) -> RoutedBackend:
        """vLLM over ``engine``'s base model (``vllm_kwargs``: :meth:`VLLMBackend.for_engine`'s),
        the native backend over ``engine`` itself; vLLM is not started on a model it cannot run."""
        from opentinker.models.dtype import dtype_name
        from opentinker.sampling.vllm_engine import unservable_reason

        native = (
            NativeBackend(engine)
            if prefix_cache_bytes is None
            else NativeBackend(engine, prefix_cache_bytes=prefix_cache_bytes)
        )
        dtype = vllm_kwargs.get("dtype") or dtype_name(engine.base.dtype)  # vLLM's, as for_engine sets it
        off = unservable_reason(engine.base.model.config, dtype)
        if weightless(engine):
            return cls._weightless(engine, native, off, vllm_kwargs)
        if off is not None:
            log.warning("vLLM not started for %s; sampling natively: %s", engine.base.name, off)
            return cls(None, native, vllm_off=off)
        return cls(VLLMBackend.for_engine(engine, **vllm_kwargs), native)

    @classmethod
    def _weightless(
        cls, engine: Engine, native: NativeBackend, off: str | None, vllm_kwargs: dict[str, Any]
    ) -> RoutedBackend:
        """vLLM alone over ``engine``, whose base is on the meta device (a sharded base: no whole
        copy on the front-end): ``ValueError`` where the native fallback would be needed for every
        snapshot. vLLM scores nothing against the engine's forward (it has none here)."""
        from opentinker.sampling.vllm_backend import _no_lora

        why = off if off is not None else _no_lora(engine)
        if why is not None:
            family = engine.base.model.config.model_type
            raise ValueError(
                f"{engine.base.name} ({family}) cannot be sampled by vLLM here: {why}; "
                f"{WEIGHTLESS}: serve it with shard_sampling='group' (--shard-sampling group)"
            )
        vllm = VLLMBackend.for_engine(engine, measure_mismatch=False, engine_forward=False, **vllm_kwargs)
        return cls(vllm, native, native_off=WEIGHTLESS)

    # ---------------------------------------------------------------- placement
    def refusal(self, weights: LoRAWeights) -> str | None:
        """Why vLLM cannot serve ``weights``, or None."""
        if self.vllm is None:
            return f"is on a base model vLLM cannot run ({self.vllm_off})"
        return self.vllm.refusal(weights)

    def side(self, weights: LoRAWeights | None) -> str:
        """Which backend samples ``weights`` (None: the base model, on vLLM unless it cannot run it)."""
        if self.vllm is None:
            return NATIVE
        return VLLM if weights is None or self.vllm.refusal(weights) is None else NATIVE

    def base_served_by(self) -> dict[str, str]:
        """Where the bare base model samples, and why."""
        if self.vllm is None:
            return {"served_by": NATIVE, "reason": f"vLLM cannot run this base model: {self.vllm_off}"}
        return {"served_by": VLLM, "reason": "--rollout-backend vllm"}

    def place(self, policy_id: str, weights: LoRAWeights) -> Placement:
        """Where ``policy_id`` (``weights``) samples, recorded for :meth:`served_by`."""
        with self._lock:
            cur = self._placed.get(policy_id)
            if cur is not None and cur.uid == weights.uid:
                return cur
            reason = self.refusal(weights)
            if reason is None:
                p = Placement(policy_id, weights.uid, VLLM, "vLLM's runtime LoRA serves it")
            elif self.native_off:
                raise EngineError(
                    f"snapshot {policy_id!r} {reason}, and {self.native_off}: train it with "
                    "what vLLM serves, or serve with shard_sampling='group' (--shard-sampling group)"
                )
            else:
                p = Placement(policy_id, weights.uid, NATIVE, f"vLLM cannot serve it: it {reason}")
                log.info("snapshot %s samples natively: %s", policy_id, p.reason)
            self._placed[policy_id] = p
            return p

    def served_by(self) -> list[dict[str, str]]:
        """Each snapshot sampled or published so far and still served: where it samples, and why."""
        live = set(self.engine.snapshot_ids()) | set(self.vllm.published() if self.vllm else ())
        with self._lock:
            for pid in [p for p in self._placed if p not in live]:
                del self._placed[pid]
            return [p.json() for p in self._placed.values()]

    # ---------------------------------------------------------------- policies
    def publish(self, policy_id: str, weights: LoRAWeights) -> None:
        if self.vllm is not None and self.place(policy_id, weights).backend == VLLM:
            self.vllm.publish(policy_id, weights)
        else:
            self.native.publish(policy_id, weights)

    def retire(self, policy_id: str) -> None:
        with self._lock:
            placed = self._placed.pop(policy_id, None)
        if placed is None:
            raise UnknownPolicyError(f"unknown snapshot {policy_id!r}")
        if self.vllm is not None and placed.backend == VLLM:
            self.vllm.retire(policy_id)
        else:
            self.native.retire(policy_id)

    # ---------------------------------------------------------------- sampling
    def lookup(self, policy: str) -> LoRAWeights:
        """The weights snapshot ``policy`` names now (a live adapter, or an unknown id, refused)."""
        if self.engine.has_adapter(policy):
            raise EngineError(
                f"{policy!r} is a model being trained; sample from a snapshot of it "
                "(save_weights_for_sampler) so training cannot change the weights mid-sample"
            )
        return self.engine.adapter_weights(policy)

    def decoder(self) -> RoutedDecoder:
        return RoutedDecoder(self)

    def generate(self, requests: list[SampleRequest]) -> list[SampleResult | EngineError]:
        return run_to_completion(self.decoder(), requests)

    def close(self) -> None:
        if self.vllm is not None:
            self.vllm.close()


class RoutedDecoder:
    """The sampling loop's decoder over both backends: each request on its snapshot's side."""

    def __init__(self, backend: RoutedBackend) -> None:
        self.backend = backend
        self.vllm: VLLMDecoder | None = None if backend.vllm is None else backend.vllm.decoder()
        self.native: StepDecoder = backend.native.decoder(snapshots_only=True)
        self.steps = 0

    @property
    def live_rows(self) -> int:
        return (self.vllm.live_rows if self.vllm else 0) + self.native.live_rows

    def running(self) -> list[int]:
        return (self.vllm.running() if self.vllm else []) + self.native.running()

    def pin(self, req: SampleRequest) -> Pinned:
        if req.policy is None:
            return self.native.pin(req) if self.vllm is None else self.vllm.pin(req)
        placed = self.backend.place(req.policy, self.backend.lookup(req.policy))
        return (
            self.vllm.pin(req) if self.vllm is not None and placed.backend == VLLM else self.native.pin(req)
        )

    def admit(self, items: list[tuple[int, Pinned]]) -> list[Finished]:
        side = self.backend.side
        to_vllm = [(rid, p) for rid, p in items if side(p.weights) == VLLM]
        to_native = [(rid, p) for rid, p in items if side(p.weights) == NATIVE]
        failed = self.vllm.admit(to_vllm) if to_vllm and self.vllm is not None else []
        return failed + (self.native.admit(to_native) if to_native else [])

    def drop(self, rid: int) -> bool:
        """Its rows leave whichever side decodes them."""
        return (self.vllm is not None and self.vllm.drop(rid)) or self.native.drop(rid)

    def switch(self, group: str, pinned: Pinned) -> int:
        """The native side's rows following ``group`` move to ``pinned``'s weights (it decodes any
        weights, wherever they are placed for new requests); vLLM's rows finish on theirs
        (:meth:`VLLMDecoder.switch`)."""
        moved = self.vllm.switch(group, pinned) if self.vllm is not None else 0
        return moved + self.native.switch(group, pinned)

    def progress(self, rids: Collection[int]) -> dict[int, list[Progress]]:
        out = self.native.progress(rids)
        if self.vllm is not None:
            out.update(self.vllm.progress([r for r in rids if r not in out]))
        return out

    def step(self) -> list[Finished]:
        b = self.backend
        finished: list[Finished] = []
        if self.vllm is not None and b.vllm is not None and self.vllm.live_rows:
            finished += self.vllm.step()
            b.mismatch_last, b.mismatch_total = b.vllm.mismatch_last, b.vllm.mismatch_total
        if self.native.live_rows:
            finished += self.native.step()
        self.steps += 1
        return finished


ROLLOUT_BACKENDS = ("native", "vllm")

# why the native fallback is off where the engine's base is on the meta device
WEIGHTLESS = (
    "the base is sharded (shard_base) and sampled by vLLM, so the front-end holds no copy of it "
    "for the native sampler"
)


def weightless(engine: Engine) -> bool:
    """Whether ``engine``'s base model is on the meta device (no weights: a sharded base's front-end)."""
    return any(p.is_meta for p in engine.base.model.parameters())


def check_rollout_options(
    rollout_workers: int, rollout_backend: str, rollout_options: dict[str, Any]
) -> None:
    """Refuse a runtime's sampling settings that cannot work together (or a vLLM that is not
    installed), naming them, before anything starts."""
    if rollout_backend not in ROLLOUT_BACKENDS:
        raise ValueError(
            f"unknown rollout backend {rollout_backend!r}; choose one of {', '.join(ROLLOUT_BACKENDS)}"
        )
    if rollout_backend == "vllm":
        if rollout_workers:
            raise ValueError(
                "rollout_backend='vllm' runs vLLM's own engine processes; use it with rollout_workers=0"
            )
        from opentinker.sampling.vllm_engine import check_max_lora_rank, import_vllm

        import_vllm()  # not installed: fail now, naming the cause, not at the first request
        if "max_lora_rank" in rollout_options:
            check_max_lora_rank(rollout_options["max_lora_rank"])
