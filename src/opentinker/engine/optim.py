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

import math
from collections.abc import Mapping
from typing import Any

import torch

from opentinker.engine.types import AdamParams, EngineError

# one parameter's state, as torch keeps it: step (float32 scalar), exp_avg, exp_avg_sq
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
    def __init__(self, params: dict[str, torch.Tensor]) -> None:
        self.params = params
        self.state: dict[str, State] = {}  # empty until the first step

    def step(self, grads: dict[str, torch.Tensor], hp: AdamParams) -> dict[str, float]:
        """One AdamW step with ``grads`` (name -> tensor like the param); returns metrics."""
        norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))
        clip = 1.0
        if hp.grad_clip_norm > 0 and norm > hp.grad_clip_norm:
            clip = hp.grad_clip_norm / (norm + 1e-6)
        new: dict[str, tuple[torch.Tensor, State]] = {}
        with torch.no_grad():
            try:
                for name, p in self.params.items():
                    g = grads[name] * clip if clip != 1.0 else grads[name]
                    new[name] = self._updated(p, g, self.state.get(name), hp)
            except RuntimeError as e:  # torch refuses a scalar past fp32's range
                self._refuse(f"overflows fp32 ({e})", hp)
            for name, (values, st) in new.items():
                if not _finite(values):
                    self._refuse(f"would make the adapter's weights {name} NaN or inf", hp)
                if not (_finite(st["exp_avg"]) and _finite(st["exp_avg_sq"])):
                    self._refuse(f"would make the adapter's optimizer moments of {name} NaN or inf", hp)
            for name, (values, st) in new.items():  # all checked: commit
                self.params[name].copy_(values)  # in place: the adapter's layers hold this tensor
                self.state[name] = st
        return {"grad_norm:mean": norm, "learning_rate:mean": hp.learning_rate}

    @staticmethod
    def _updated(
        p: torch.Tensor, g: torch.Tensor, st: State | None, hp: AdamParams
    ) -> tuple[torch.Tensor, State]:
        """``p``'s new values and state after one step (torch's single-tensor AdamW, out of place)."""
        step = (st["step"] if st else torch.zeros((), dtype=torch.float32)) + 1
        exp_avg = st["exp_avg"] if st else torch.zeros_like(p)
        exp_avg_sq = st["exp_avg_sq"] if st else torch.zeros_like(p)
        lr = hp.learning_rate
        values = p.mul(1 - lr * hp.weight_decay) if hp.weight_decay != 0 else p
        exp_avg = exp_avg.lerp(g, 1 - hp.beta1)
        exp_avg_sq = exp_avg_sq.mul(hp.beta2).addcmul_(g, g, value=1 - hp.beta2)
        n = float(step.item())
        step_size = lr / (1 - hp.beta1**n)
        denom = (exp_avg_sq.sqrt() / (1 - hp.beta2**n) ** 0.5).add_(hp.eps)
        values = torch.addcdiv(values, exp_avg, denom, value=-step_size)
        return values, {"step": step, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}

    @staticmethod
    def _refuse(problem: str, hp: AdamParams) -> None:
        raise EngineError(
            f"this optimizer step {problem} (learning_rate={hp.learning_rate!r}, eps={hp.eps!r}, "
            f"weight_decay={hp.weight_decay!r}); it was not applied: the weights and optimizer "
            "state are unchanged"
        )

    @property
    def steps(self) -> int:
        first = next(iter(self.state.values()), None)
        return int(first["step"]) if first else 0

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The moments and step count as flat named tensors (for safetensors)."""
        out: dict[str, torch.Tensor] = {}
        for name in self.params:
            st = self.state.get(name)
            if not st:
                continue
            out[f"{name}.exp_avg"] = st["exp_avg"]
            out[f"{name}.exp_avg_sq"] = st["exp_avg_sq"]
            out[f"{name}.step"] = st["step"].to(torch.float32).reshape(1)
        return out

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        self.state.clear()
        for name, p in self.params.items():
            if f"{name}.exp_avg" not in tensors:
                continue
            self.state[name] = {
                "step": tensors[f"{name}.step"].reshape(()).clone().to(torch.float32),
                "exp_avg": tensors[f"{name}.exp_avg"].clone().to(p.device, p.dtype),
                "exp_avg_sq": tensors[f"{name}.exp_avg_sq"].clone().to(p.device, p.dtype),
            }


def step_many(
    items: list[tuple[AdapterOptimizer, dict[str, torch.Tensor], AdamParams]],
) -> list[dict[str, float] | EngineError]:
    """Several adapters' AdamW steps at once (a tick's optimizer steps): each result is what
    ``opt.step(grads, hp)`` would give, the same elementwise operations in the same order on the
    same tensors, so the weights and moments are bitwise the same; each adapter's step is still
    all or nothing on its own (a refused one is an :class:`EngineError` in its place, the others
    go on). Every operation runs once over all the adapters' tensors (``torch._foreach_*``), so a
    tick with many small adapters does not pay Python's dispatch per tensor. Scalars torch refuses
    (a value past fp32's range) make the whole batch run one adapter at a time, as ``step`` does."""
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
    if len(items) <= 1:
        return [_step_or_error(*it) for it in items]
    # per adapter: its grad norm and clip factor (the same double-precision sum as ``step``)
    norms, clips = [], []
    for opt, grads, hp in items:
        sq = torch.stack([grads[name].double().pow(2).sum() for name in opt.params])
        norm = math.sqrt(sum(sq.tolist()))
        clip = (
            hp.grad_clip_norm / (norm + 1e-6) if hp.grad_clip_norm > 0 and norm > hp.grad_clip_norm else 1.0
        )
        norms.append(norm)
        clips.append(clip)
    params, grads_l, avgs, sqs, steps, owner = [], [], [], [], [], []
    decay, b1, b2, eps, step_size, bias2 = [], [], [], [], [], []
    for k, (opt, grads, hp) in enumerate(items):
        for name, p in opt.params.items():
            st = opt.state.get(name)
            step = (st["step"] if st else torch.zeros((), dtype=torch.float32)) + 1
            n = float(step.item())
            params.append(p)
            g = grads[name]
            grads_l.append(g * clips[k] if clips[k] != 1.0 else g)
            avgs.append(st["exp_avg"] if st else torch.zeros_like(p))
            sqs.append(st["exp_avg_sq"] if st else torch.zeros_like(p))
            steps.append(step)
            owner.append((k, name))
            lr = hp.learning_rate
            decay.append(1 - lr * hp.weight_decay if hp.weight_decay != 0 else None)
            b1.append(1 - hp.beta1)
            b2.append((hp.beta2, 1 - hp.beta2))
            eps.append(hp.eps)
            step_size.append(-(lr / (1 - hp.beta1**n)))
            bias2.append((1 - hp.beta2**n) ** 0.5)
    try:
        with torch.no_grad():
            values = [p.mul(d) if d is not None else p for p, d in zip(params, decay, strict=True)]
            new_avgs = torch._foreach_lerp(avgs, grads_l, b1)
            new_sqs = torch._foreach_mul(sqs, [b[0] for b in b2])
            torch._foreach_addcmul_(new_sqs, grads_l, grads_l, [b[1] for b in b2])
            denom = torch._foreach_sqrt(new_sqs)
            denom = torch._foreach_div(denom, bias2)
            torch._foreach_add_(denom, eps)
            values = torch._foreach_addcdiv(values, new_avgs, denom, step_size)
    except RuntimeError:  # a scalar torch refuses: each adapter alone, as ``step`` refuses it
        return [_step_or_error(*it) for it in items]
    n = len(values)
    each = finite_each([*values, *new_avgs, *new_sqs])
    finite = [each[j * n : (j + 1) * n] for j in range(3)]
    out: list[dict[str, float] | EngineError] = []
    by_adapter: list[list[int]] = [[] for _ in items]
    for i, (k, _) in enumerate(owner):
        by_adapter[k].append(i)
    for k, (opt, _, hp) in enumerate(items):
        idx = by_adapter[k]
        try:
            with torch.no_grad():
                for i in idx:
                    name = owner[i][1]
                    if not finite[0][i]:
                        opt._refuse(f"would make the adapter's weights {name} NaN or inf", hp)
                    if not (finite[1][i] and finite[2][i]):
                        opt._refuse(f"would make the adapter's optimizer moments of {name} NaN or inf", hp)
                for i in idx:  # all checked: commit
                    name = owner[i][1]
                    opt.params[name].copy_(values[i])
                    opt.state[name] = {"step": steps[i], "exp_avg": new_avgs[i], "exp_avg_sq": new_sqs[i]}
        except EngineError as e:
            out.append(e)
            continue
        out.append({"grad_norm:mean": norms[k], "learning_rate:mean": hp.learning_rate})
    return out


def _step_or_error(
    opt: AdapterOptimizer, grads: dict[str, torch.Tensor], hp: AdamParams
) -> dict[str, float] | EngineError:
    try:
        hp.validate()
        return opt.step(grads, hp)
    except EngineError as e:
        return e


def finite_each(tensors: list[torch.Tensor]) -> list[bool]:
    """Whether each tensor is all finite, from one L1 norm each, in one call (a NaN or inf makes the
    norm so; only a norm past fp32's range, of finite values, needs the element-wise look)."""
    if not tensors:
        return []
    norms1 = torch.stack(torch._foreach_norm(tensors, 1)).isfinite().tolist()
    return [ok or bool(torch.isfinite(t).all()) for ok, t in zip(norms1, tensors, strict=True)]


def _finite(t: torch.Tensor) -> bool:
    """Whether every element is finite. A finite sum proves it (a NaN or inf anywhere makes the
    sum NaN or inf) in one cheap pass; only a non-finite sum needs the element-wise look."""
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())
