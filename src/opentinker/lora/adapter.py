"""One adapter's LoRA weights, stored per *target group* rather than per layer.

A target group is one kind of projection across the layers that have it (``self_attn.q_proj`` of
every decoder layer, say). An adapter holds, for each group ``g`` it trains,

    A[g]: [L_g, r, in_g]     B[g]: [L_g, out_g, r]     scale = alpha / r

and for the fused routed experts of a MoE layer (``mlp.experts.gate_up_proj``), one pair per expert:
``A[g]: [L_g, E, r, in_g]``, ``B[g]: [L_g, E, out_g, r]`` (see :mod:`opentinker.lora.experts`),

so that stacking K adapters for a batch is one ``torch.stack`` per group, not one per layer.
Its tensors have exactly its own rank: nothing is stored "above the rank" that could drift.
Initialisation follows PEFT/LoRA: A ~ kaiming-uniform(a=√5) from the adapter's seed, B = 0, so a
fresh adapter leaves the base model's function unchanged.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace

import torch


@dataclass(frozen=True)
class LoRAConfig:
    """What ``create_lora_training_client`` asks for (Tinker's ``LoraConfig``, plus ``alpha``)."""

    rank: int
    alpha: float = 32.0
    seed: int | None = None
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = True

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    def trains(self, kind: str) -> bool:
        return {"attn": self.train_attn, "mlp": self.train_mlp, "unembed": self.train_unembed}[kind]

    def same_layout(self, other: LoRAConfig) -> bool:
        """Whether weights made with ``other`` fit an adapter made with this one: the same rank,
        scale and targets. The seed only chose the initial weights, so it may differ."""
        return replace(self, seed=None) == replace(other, seed=None)


@dataclass(frozen=True)
class TargetGroup:
    """One kind of projection across the layers that have it, e.g. ``self_attn.q_proj``.

    Its ``L`` layers need not be every layer (attention in a hybrid model), and layers where the
    same name has another shape form a group of their own (``name@<first layer>``). ``experts``
    > 0 marks the fused parameter ``param`` of a routed-experts module (one LoRA pair per expert).
    """

    name: str
    kind: str  # "attn" | "mlp" | "unembed"
    d_in: int
    d_out: int
    paths: tuple[str, ...]  # module path of each layer's instance, in layer order (for PEFT export)
    fan_in_fan_out: bool  # GPT-2's Conv1D stores weight as [in, out]
    experts: int = 0  # routed experts per layer (0: a plain projection)
    param: str = ""  # the experts module's fused parameter (``gate_up_proj``, ``down_proj``)

    @property
    def n_layers(self) -> int:
        return len(self.paths)

    def a_shape(self, rank: int) -> tuple[int, ...]:
        """One adapter's A: [L, r, in], or [L, E, r, in] for experts."""
        mid = (self.experts,) if self.experts else ()
        return (self.n_layers, *mid, rank, self.d_in)

    def b_shape(self, rank: int) -> tuple[int, ...]:
        """One adapter's B: [L, out, r], or [L, E, out, r] for experts."""
        mid = (self.experts,) if self.experts else ()
        return (self.n_layers, *mid, self.d_out, rank)


_UIDS = itertools.count()


@dataclass
class LoRAWeights:
    """The tensors of one adapter (or one immutable snapshot of it)."""

    config: LoRAConfig
    a: dict[str, torch.Tensor] = field(default_factory=dict)  # group -> [L, r, in]
    b: dict[str, torch.Tensor] = field(default_factory=dict)  # group -> [L, out, r]
    # unique in this process (never reused, unlike id()): with the tensors' version counters it
    # names the exact weights something was computed from (the sampler's prefix cache)
    uid: int = field(default_factory=lambda: next(_UIDS), compare=False, repr=False)
    # when set (:meth:`flatten_`), every tensor above is a view of this one contiguous buffer, in
    # ``state_dict`` order: an optimizer step or a copy is then one pass over it, not one per tensor
    flat: torch.Tensor | None = field(default=None, compare=False, repr=False)

    @property
    def rank(self) -> int:
        return self.config.rank

    @property
    def scale(self) -> float:
        return self.config.scale

    def tensors(self) -> list[torch.Tensor]:
        return [*self.a.values(), *self.b.values()]

    def state_dict(self) -> dict[str, torch.Tensor]:
        out = {f"{g}.lora_A": t for g, t in self.a.items()}
        out.update({f"{g}.lora_B": t for g, t in self.b.items()})
        return out

    @classmethod
    def from_state_dict(
        cls,
        config: LoRAConfig,
        tensors: dict[str, torch.Tensor],
        groups: dict[str, TargetGroup] | None = None,
        *,
        device: torch.device | str = "cpu",
        requires_grad: bool = False,
    ) -> LoRAWeights:
        """The inverse of :meth:`state_dict`: ``<group>.lora_A`` / ``<group>.lora_B`` tensors,
        each copied to ``device``. Given the base model's target ``groups``, each tensor must name
        one of them and have its shape (:meth:`TargetGroup.a_shape` / ``b_shape`` at the config's
        rank), and every group the config trains must be there. A mismatch raises ``ValueError``
        naming it; nothing is shared with ``tensors``."""
        out = cls(config)
        for key, t in tensors.items():
            group, _, kind = key.rpartition(".")
            if kind not in ("lora_A", "lora_B") or (groups is not None and group not in groups):
                raise ValueError(f"{key!r} is not a LoRA weight of this model")
            if groups is not None:
                g = groups[group]
                want = g.a_shape(config.rank) if kind == "lora_A" else g.b_shape(config.rank)
                if tuple(t.shape) != want:
                    raise ValueError(f"{key} has shape {tuple(t.shape)}, expected {want}")
            target = out.a if kind == "lora_A" else out.b
            target[group] = t.detach().to(device, copy=True).requires_grad_(requires_grad)
        if groups is not None:
            wanted = {name for name, g in groups.items() if config.trains(g.kind)}
            if set(out.a) != wanted or set(out.b) != wanted:
                raise ValueError("it does not hold every LoRA group its config trains")
        return out

    def clone(self, *, requires_grad: bool = False, device: torch.device | str | None = None) -> LoRAWeights:
        """A detached copy with a uid of its own (a snapshot when ``requires_grad`` is False). A
        flattened adapter's copy is flattened too (one copy of its buffer); a copy to ``device``
        (for another device or process) is one tensor per weight, each on ``device``: pickled,
        views of one buffer would each carry the whole buffer."""
        if device is not None:
            return LoRAWeights.from_state_dict(
                self.config, self.state_dict(), device=device, requires_grad=requires_grad
            )
        if self.flat is not None:
            out = LoRAWeights(self.config)
            out._view(self.flat.detach().clone(), self._layout(), requires_grad)
            return out
        a = {g: t.detach().clone().requires_grad_(requires_grad) for g, t in self.a.items()}
        b = {g: t.detach().clone().requires_grad_(requires_grad) for g, t in self.b.items()}
        return LoRAWeights(self.config, a, b)

    def flatten_(self) -> torch.Tensor:
        """Re-home every tensor as a view of one new contiguous buffer (:attr:`flat`: the same
        values, dtype, device and ``requires_grad``); returns it. Done once, when an adapter
        becomes trainable, before anything else holds its tensors."""
        if self.flat is None:
            ts = self.tensors()
            flat = torch.cat([t.detach().reshape(-1) for t in ts]) if ts else torch.zeros(0)
            self._view(flat, self._layout(), bool(ts) and ts[0].requires_grad)
        assert self.flat is not None
        return self.flat

    @classmethod
    def from_flat(
        cls,
        config: LoRAConfig,
        flat: torch.Tensor,
        layout: list[tuple[str, str, torch.Size]],
        *,
        requires_grad: bool,
        uid: int | None = None,
    ) -> LoRAWeights:
        """Weights whose tensors are views of ``flat`` laid out as :meth:`layout` says (how paged
        state comes back: ``uid`` given for immutable weights, whose caches stay valid)."""
        out = cls(config) if uid is None else cls(config, uid=uid)
        out._view(flat, layout, requires_grad)
        return out

    def layout(self) -> list[tuple[str, str, torch.Size]]:
        """Each tensor's side ("a" / "b"), group and shape, in :attr:`flat`'s order."""
        return self._layout()

    def _layout(self) -> list[tuple[str, str, torch.Size]]:
        return [("a", g, t.shape) for g, t in self.a.items()] + [("b", g, t.shape) for g, t in self.b.items()]

    def _view(
        self, flat: torch.Tensor, layout: list[tuple[str, str, torch.Size]], requires_grad: bool
    ) -> None:
        at = 0
        for side, g, shape in layout:
            n = shape.numel()
            (self.a if side == "a" else self.b)[g] = (
                flat[at : at + n].view(shape).requires_grad_(requires_grad)
            )
            at += n
        self.flat = flat

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def init_lora_weights(
    config: LoRAConfig,
    groups: dict[str, TargetGroup],
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> LoRAWeights:
    """Fresh trainable weights for every target group the config trains."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(config.seed if config.seed is not None else torch.seed() % (2**63))
    r = config.rank
    weights = LoRAWeights(config)
    for name in sorted(groups):
        group = groups[name]
        if not config.trains(group.kind):
            continue
        # kaiming_uniform_(a=sqrt(5)) on a [r, in] matrix has bound 1/sqrt(in) (per expert, too);
        # drawn on CPU from the adapter's own generator so the same seed gives the same adapter
        # on any device.
        bound = 1.0 / math.sqrt(group.d_in)
        a = (torch.rand(group.a_shape(r), generator=gen, dtype=torch.float32) * 2 - 1) * bound
        weights.a[name] = a.to(device=device, dtype=dtype).requires_grad_(True)
        weights.b[name] = torch.zeros(group.b_shape(r), device=device, dtype=dtype, requires_grad=True)
    return weights
