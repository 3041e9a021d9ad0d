"""An engine's exports: a model or snapshot as files other programs load (PEFT, hosted Tinker's
layout, a merged HF model). A mixin of :class:`~opentinker.engine.engine.Engine`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from opentinker.engine.export import export_merged, export_peft
from opentinker.engine.model_state import _paged
from opentinker.engine.tinker_format import export_tinker
from opentinker.engine.types import PolicyRef

if TYPE_CHECKING:
    from opentinker.lora import LoRAWeights, MultiLoRA
    from opentinker.models import BaseModel


class EngineExports:
    base: BaseModel
    lora: MultiLoRA

    if TYPE_CHECKING:  # the Engine's own (this mixin holds no state of its own)

        def adapter_weights(self, ref: PolicyRef) -> LoRAWeights: ...

    @_paged
    def export_peft(self, ref: PolicyRef, out_dir: str | Path) -> Path:
        """The adapter (or snapshot) ``ref`` as a PEFT folder (see :mod:`opentinker.engine.export`)."""
        return export_peft(
            self.adapter_weights(ref),
            self.lora.groups,
            out_dir,
            base_model=self.base.name,
            tied_embedding=self.lora.tied_embedding,
        )

    @_paged
    def export_tinker(self, ref: PolicyRef, out_dir: str | Path) -> Path:
        """The adapter (or snapshot) ``ref`` in hosted Tinker's adapter layout, what
        ``save_weights_external`` writes (see :mod:`opentinker.engine.tinker_format`)."""
        weights, groups = self.adapter_weights(ref), self.lora.groups
        return export_tinker(weights, groups, out_dir, base_model=self.base.name, model=self.base.model)

    @_paged
    def export_merged(self, ref: PolicyRef, out_dir: str | Path) -> Path:
        """The base model with ``ref``'s delta merged in, as a full HF model folder."""
        return export_merged(self.adapter_weights(ref), self.lora.groups, self.base.path, out_dir)
