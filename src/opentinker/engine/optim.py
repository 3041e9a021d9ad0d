"""Per-adapter AdamW: each adapter owns its optimizer and state; a step touches nothing else.

AdamW as ``torch.optim.AdamW`` computes it (decoupled weight decay, bias-corrected moments, the
same operations in the same order), driven by Tinker's per-step ``AdamParams``. Gradients live in
the engine's per-adapter accumulators and are handed in only for the step, so no other adapter's
tensors are ever visited.

A step is all or nothing (invariant 9): the new weights and moments are computed out of place,
and written only if every one of them is finite. Finite inputs can still overflow — a huge
learning rate, a squared gradient past fp32's range — and such a step is refused with the
weights, moments and step count exactly as they were.

Which optimizer a model gets is chosen once, at creation (the SDK's ``optimizer_config``):
:func:`check_optimizer_config` accepts ``AdamOptimizerConfig`` (``{"type": "adamw"}``) and
refuses everything else by name. ``DimuonOptimizerConfig`` is refused on purpose: Tinker's public
docs name Dimuon's knobs (a learning rate per direction of Frobenius norm sqrt(rank), a momentum
``beta1``, damping of row and column preconditioners, a matrix-sign iteration whose count and
normalisation epsilon are "internal constants") but not its update rule, so any implementation
here would be a different optimizer under Tinker's name.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from opentinker.engine.types import AdamParams, EngineError
from opentinker.lora import LoRAWeights

# an adapter's state: step (float32 scalar), exp_avg and exp_avg_sq (flat, like its weights)
State = dict[str, torch.Tensor]


OPTIMIZER_TYPES = ("adamw",)  # what check_optimizer_config accepts

_DIMUON_REFUSAL = (
    "the Dimuon optimizer (DimuonOptimizerConfig) is not supported by this server: Tinker's public "
    "documentation names its hyperparameters but does not define its update rule (the matrix-sign "
    "iteration and its constants are internal to Tinker) precisely enough to implement it exactly; "
    "create the model with AdamOptimizerConfig (type 'adamw') instead"
)


def check_optimizer_config(config: Mapping[str, Any] | None) -> str:
    """The optimizer type of a model-creation ``optimizer_config`` (None = adamw, Tinker's default).

    Raises :class:`EngineError` naming the problem for anything this engine does not run."""
    if config is None:
        return "adamw"
    if not isinstance(config, Mapping):
        raise EngineError(f"optimizer_config must be an object with a 'type', got {type(config).__name__}")
    kind = config.get("type")
    if kind == "dimuon":
        raise EngineError(_DIMUON_REFUSAL)
    if kind != "adamw":
        raise EngineError(
            f"unknown optimizer type {kind!r} in optimizer_config; this server supports "
            "'adamw' (AdamOptimizerConfig)"
        )
    extra = sorted(set(config) - {"type"})
    if extra:
        raise EngineError(
            f"optimizer_config of type 'adamw' takes no other fields, got {', '.join(map(repr, extra))}; "
            "AdamW's hyperparameters go in each optim_step's AdamParams"
        )
    return "adamw"


def check_step_params(params_type: str | None, model_optimizer: str = "adamw") -> None:
    """Refuse an ``optim_step`` whose hyperparameters are for another optimizer than the model's."""
    kind = params_type or "adamw"
    if kind == model_optimizer:
        return
    if kind == "dimuon":
        raise EngineError(
            f"optim_step got DimuonParams, but this model was created with the {model_optimizer} "
            "optimizer; pass AdamParams (and see DimuonOptimizerConfig: Dimuon is not supported here)"
        )
    raise EngineError(
        f"optim_step got hyperparameters of unknown optimizer type {kind!r}; this model uses "
        f"{model_optimizer}: pass AdamParams"
    )


class AdapterOptimizer:
    """One adapter's AdamW. Its weights are flattened (``LoRAWeights.flatten_``: every tensor a
    view of one buffer) and its moments and gradients are kept flat in the same order, so a step
    is a handful of operations on one buffer each, however many tensors the adapter has; its
    arithmetic is elementwise, so each element gets exactly what a per-tensor AdamW gives it."""

    def __init__(self, weights: LoRAWeights) -> None:
        self.flat = weights.flatten_()
        self.params = weights.state_dict()  # name -> view of ``flat``, in its order
        # empty until the first step; else "step" (float32 scalar), "exp_avg", "exp_avg_sq" (flat)
        self.state: State = {}

    def flat_grads(self, grads: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """``grads`` (name -> tensor like the param) as one buffer in this optimizer's order."""
        return torch.cat([grads[name].reshape(-1) for name in self.params])

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """A flat buffer in this optimizer's order as name -> tensor like the param (views)."""
        out, at = {}, 0
        for name, p in self.params.items():
            out[name] = flat[at : at + p.numel()].view(p.shape)
            at += p.numel()
        return out

    def refusal(self, problem: str, hp: AdamParams, flat: torch.Tensor | None = None) -> EngineError:
        """Why a step was refused; with ``flat``, ``{name}`` in ``problem`` becomes the name of
        its first tensor that is not all finite."""
        if flat is not None:
            name = next((n for n, v in self.views(flat).items() if not bool(torch.isfinite(v).all())), "")
            problem = problem.format(name=name)
        return EngineError(
            f"this optimizer step {problem} (learning_rate={hp.learning_rate!r}, eps={hp.eps!r}, "
            f"weight_decay={hp.weight_decay!r}); it was not applied: the weights and optimizer "
            "state are unchanged"
        )

    @property
    def steps(self) -> int:
        return int(self.state["step"]) if self.state else 0

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The moments and step count as named tensors, one set per weight (for safetensors)."""
        if not self.state:
            return {}
        out: dict[str, torch.Tensor] = {}
        avg, sq = self.views(self.state["exp_avg"]), self.views(self.state["exp_avg_sq"])
        step = self.state["step"].to(torch.float32).reshape(1)
        for name in self.params:
            out[f"{name}.exp_avg"] = avg[name]
            out[f"{name}.exp_avg_sq"] = sq[name]
            out[f"{name}.step"] = step.clone()  # one tensor each: safetensors refuses a shared one
        return out

    def load_state_tensors(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Put back :meth:`state_tensors`' output; every weight's moments, of its shape, and one
        step count, or nothing at all (a fresh optimizer). A mismatch changes nothing."""
        have = [name for name in self.params if f"{name}.exp_avg" in tensors]
        if not have:
            self.state = {}
            return
        missing = [
            n for n in self.params for k in ("exp_avg", "exp_avg_sq", "step") if f"{n}.{k}" not in tensors
        ]
        if missing:
            raise EngineError(f"the optimizer state lacks the moments or step of {sorted(set(missing))}")
        for name, p in self.params.items():
            for kind in ("exp_avg", "exp_avg_sq"):
                t = tensors[f"{name}.{kind}"]
                if tuple(t.shape) != tuple(p.shape):
                    raise EngineError(
                        f"the optimizer state {name}.{kind} has shape {tuple(t.shape)}, expected {tuple(p.shape)}"
                    )
        steps = {float(tensors[f"{n}.step"].reshape(-1)[0]) for n in self.params}
        if len(steps) != 1:
            raise EngineError(
                f"the optimizer state has different step counts {sorted(steps)} for one adapter"
            )

        def flat(kind: str) -> torch.Tensor:
            return torch.cat([tensors[f"{n}.{kind}"].reshape(-1) for n in self.params]).to(
                self.flat.device, self.flat.dtype
            )

        self.state = {
            "step": torch.tensor(steps.pop(), dtype=torch.float32),
            "exp_avg": flat("exp_avg"),
            "exp_avg_sq": flat("exp_avg_sq"),
        }


def step_many(
    items: list[tuple[AdapterOptimizer, torch.Tensor, AdamParams]],
) -> list[dict[str, float] | EngineError]:
    """Several adapters' AdamW steps at once (a tick's optimizer steps): each result is what its
    adapter's step alone (a batch of one) gives, the same elementwise operations in the same
    order on the same values, so the weights and moments are bitwise the same; each adapter's step is still
    all or nothing on its own (a refused one is an :class:`EngineError` in its place, the others
    go on). Every operation runs once over all the adapters' flat buffers (``torch._foreach_*``),
    so a tick with many adapters pays Python's dispatch per operation, not per tensor.

    The step is ``torch.optim.AdamW``'s (single-tensor) arithmetic, computed out of place and
    written only if every new weight and moment is finite: finite inputs can still overflow (a
    huge learning rate, a squared gradient past fp32's range), and such a step is refused with the
    weights, moments and step count exactly as they were. Scalars torch refuses (a value past
    fp32's range) make the whole batch run one adapter at a time, so only that one is refused."""
    refused: dict[int, EngineError] = {}
    for k, (_, _, hp) in enumerate(items):
        try:
            hp.validate()
        except EngineError as e:
            refused[k] = e
    if refused:  # the valid ones as a batch, each refusal in its place
        valid = [k for k in range(len(items)) if k not in refused]
        done = iter(step_many([items[k] for k in valid]))
        return [refused[k] if k in refused else next(done) for k in range(len(items))]
    if not items:
        return []
    # per adapter: its grad norm (in double) and clip factor
    norms = torch.stack([g.double().pow(2).sum() for _, g, _ in items]).sqrt().tolist()
    batch = _AdamBatch.of(items, norms)
    try:
        values, new_avgs, new_sqs = batch.adamw()
    except RuntimeError as e:  # a scalar torch refuses: each adapter alone, so only it is refused
        if len(items) == 1:
            opt, _, hp = items[0]
            return [opt.refusal(f"overflows fp32 ({e})", hp)]
        return [step_many([it])[0] for it in items]
    return _commit(items, norms, batch.steps, values, new_avgs, new_sqs)


@dataclass
class _AdamBatch:
    """The inputs of one :func:`step_many` batch, one entry per adapter: its flat weights,
    (clipped) gradient, moments and new step count (the tensors themselves, not copies), and its
    hyperparameters as the scalars of each ``torch._foreach_*`` operation."""

    params: list[torch.Tensor] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)
    avgs: list[torch.Tensor] = field(default_factory=list)
    sqs: list[torch.Tensor] = field(default_factory=list)
    steps: list[torch.Tensor] = field(default_factory=list)
    decay: list[float | None] = field(default_factory=list)  # 1 - lr * weight_decay (None: no decay)
    b1: list[float] = field(default_factory=list)  # 1 - beta1
    b2: list[float] = field(default_factory=list)  # beta2
    b2c: list[float] = field(default_factory=list)  # 1 - beta2
    eps: list[float] = field(default_factory=list)
    step_size: list[float] = field(default_factory=list)  # -lr / (1 - beta1^n)
    bias2: list[float] = field(default_factory=list)  # sqrt(1 - beta2^n)

    @classmethod
    def of(
        cls, items: list[tuple[AdapterOptimizer, torch.Tensor, AdamParams]], norms: list[float]
    ) -> _AdamBatch:
        b = cls()
        for (opt, g, hp), norm in zip(items, norms, strict=True):
            st = opt.state
            step = (st["step"] if st else torch.zeros((), dtype=torch.float32)) + 1
            n = float(step)
            clip = (
                hp.grad_clip_norm / (norm + 1e-6)
                if hp.grad_clip_norm > 0 and norm > hp.grad_clip_norm
                else 1.0
            )
            b.params.append(opt.flat)
            b.grads.append(g * clip if clip != 1.0 else g)
            b.avgs.append(st["exp_avg"] if st else torch.zeros_like(opt.flat))
            b.sqs.append(st["exp_avg_sq"] if st else torch.zeros_like(opt.flat))
            b.steps.append(step)
            lr = hp.learning_rate
            b.decay.append(1 - lr * hp.weight_decay if hp.weight_decay != 0 else None)
            b.b1.append(1 - hp.beta1)
            b.b2.append(hp.beta2)
            b.b2c.append(1 - hp.beta2)
            b.eps.append(hp.eps)
            b.step_size.append(-(lr / (1 - hp.beta1**n)))
            b.bias2.append((1 - hp.beta2**n) ** 0.5)
        return b

    def adamw(self) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
        """(new weights, new first moments, new second moments), out of place; nothing is written."""
        with torch.no_grad():
            values = [p.mul(d) if d is not None else p for p, d in zip(self.params, self.decay, strict=True)]
            new_avgs = torch._foreach_lerp(self.avgs, self.grads, self.b1)
            new_sqs = torch._foreach_mul(self.sqs, self.b2)
            torch._foreach_addcmul_(new_sqs, self.grads, self.grads, self.b2c)
            denom = torch._foreach_sqrt(new_sqs)
            denom = torch._foreach_div(denom, self.bias2)
            torch._foreach_add_(denom, self.eps)
            values = torch._foreach_addcdiv(values, new_avgs, denom, self.step_size)
        return list(values), list(new_avgs), list(new_sqs)


def _commit(
    items: list[tuple[AdapterOptimizer, torch.Tensor, AdamParams]],
    norms: list[float],
    steps: list[torch.Tensor],
    values: list[torch.Tensor],
    new_avgs: list[torch.Tensor],
    new_sqs: list[torch.Tensor],
) -> list[dict[str, float] | EngineError]:
    """Write each adapter's new weights and moments if all of them are finite, else refuse its step."""
    k = len(items)
    finite = finite_each([*values, *new_avgs, *new_sqs])
    out: list[dict[str, float] | EngineError] = []
    for i, (opt, _, hp) in enumerate(items):
        if not finite[i]:
            out.append(opt.refusal("would make the adapter's weights {name} NaN or inf", hp, values[i]))
            continue
        if not finite[k + i]:
            out.append(
                opt.refusal(
                    "would make the adapter's optimizer moments of {name} NaN or inf", hp, new_avgs[i]
                )
            )
            continue
        if not finite[2 * k + i]:
            out.append(
                opt.refusal("would make the adapter's optimizer moments of {name} NaN or inf", hp, new_sqs[i])
            )
            continue
        with torch.no_grad():  # all checked: commit (in place: the adapter's layers view this buffer)
            opt.flat.copy_(values[i])
        opt.state = {"step": steps[i], "exp_avg": new_avgs[i], "exp_avg_sq": new_sqs[i]}
        out.append({"grad_norm:mean": norms[i], "learning_rate:mean": hp.learning_rate})
    return out


def finite_each(tensors: list[torch.Tensor]) -> list[bool]:
    """Whether each tensor is all finite, from one L1 norm each, in one call (a NaN or inf makes the
    norm so; only a norm past fp32's range, of finite values, needs the element-wise look)."""
    if not tensors:
        return []
    norms1 = torch.stack(torch._foreach_norm(tensors, 1)).isfinite().tolist()
    return [ok or bool(torch.isfinite(t).all()) for ok, t in zip(norms1, tensors, strict=True)]
