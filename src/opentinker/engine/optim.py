"""Per-adapter AdamW: each adapter owns its optimizer and state; a step touches nothing else.

AdamW as ``torch.optim.AdamW(fused=True)`` computes it (decoupled weight decay, bias-corrected
moments: torch's fused kernel, within a few ulps of the per-tensor reference), driven by Tinker's
per-step ``AdamParams``. Gradients live in the engine's per-adapter accumulators and are handed in
only for the step, so no other adapter's tensors are ever visited.

A step is all or nothing (invariant 9). Finite inputs can still overflow — a huge learning rate, a
squared gradient past fp32's range — and such a step is refused with the weights, moments and step
count exactly as they were. Most steps are proven finite before they run, from bounds on the
magnitudes of everything the step reads (:func:`_proven_bounds`), and run in place with nothing
else to do; a step the bounds cannot clear runs in place after the weights and moments are copied
to a scratch buffer, and if any new value is not finite it is undone from that copy.

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
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from opentinker.engine.types import AdamParams, EngineError
from opentinker.lora import LoRAWeights

# an adapter's state: step (float32 scalar), exp_avg and exp_avg_sq (flat, like its weights)
State = dict[str, torch.Tensor]


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
        self.bounds: _Bounds | None = None  # of the last step's results, while they are unchanged

    def flat_grads(self, grads: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """``grads`` (name -> tensor like the param) as one buffer in this optimizer's order: each
        copied once into its place (a gradient that is a strided view, as an experts stack's
        backward gives, would be copied twice by a concatenation of its flattened copy)."""
        out = torch.empty_like(self.flat, requires_grad=False)
        for name, view in self.views(out).items():
            view.copy_(grads[name])
        return out

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
            self.state, self.bounds = {}, None
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

        self.bounds = None  # (they would hold the replaced moments alive until the next step)
        self.state = {
            "step": torch.tensor(steps.pop(), dtype=torch.float32),
            "exp_avg": flat("exp_avg"),
            "exp_avg_sq": flat("exp_avg_sq"),
        }


def step_many(
    items: list[tuple[AdapterOptimizer, torch.Tensor, AdamParams]], prove: bool = True
) -> list[dict[str, float] | EngineError]:
    """Several adapters' AdamW steps at once (a tick's optimizer steps): each result is what its
    adapter's step alone (a batch of one) gives, the same operations on the same values, so the
    weights and moments are bitwise the same; each adapter's step is all or nothing on its own (a
    refused one is an :class:`EngineError` in its place, the others go on).

    Each step is one pass of torch's fused AdamW kernel (``torch._fused_adamw_``, what
    ``torch.optim.AdamW(fused=True)`` runs) over the adapter's flat weights and moments, in place:
    on a CPU a step is bound by the memory it streams through, and the kernel reads and writes
    each element once where an operation per term, each into a fresh buffer, passes over it about
    ten times. Finite inputs can still overflow (a huge learning rate, a squared gradient past
    fp32's range): a step that bounds on its inputs do not prove finite (:func:`_proven_bounds`;
    every step with ``prove=False``) first copies the weights and moments to a scratch buffer, and
    if its result is not all finite it is refused and undone from it, bitwise."""
    refused: dict[int, EngineError] = {}
    for k, (_, _, hp) in enumerate(items):
        try:
            hp.validate()
        except EngineError as e:
            refused[k] = e
    # per adapter: its grad norm, accumulated in double (of a double copy: the same value, bitwise,
    # as ``vector_norm(g, dtype=float64)``, which converts element by element, 3x slower on CPU)
    norms = [
        float(torch.linalg.vector_norm(_scratch_double(g))) if k not in refused else 0.0
        for k, (_, g, _) in enumerate(items)
    ]
    return [
        refused[k] if k in refused else _step(opt, g, hp, norm, prove)
        for k, ((opt, g, hp), norm) in enumerate(zip(items, norms, strict=True))
    ]


def _step(
    opt: AdapterOptimizer, grad: torch.Tensor, hp: AdamParams, norm: float, prove: bool = True
) -> dict[str, float] | EngineError:
    """One adapter's AdamW step in place: proven finite beforehand (``prove``) or else undone if
    its result is not all finite. Either way the same kernel on the same values: bitwise alike."""
    clip = hp.grad_clip_norm > 0 and norm > hp.grad_clip_norm
    if clip:
        grad = grad * (hp.grad_clip_norm / (norm + 1e-6))
    st = opt.state
    step = (st["step"] if st else torch.zeros((), dtype=torch.float32)) + 1
    flat = opt.flat
    avg = st["exp_avg"] if st else torch.zeros_like(flat)
    sq = st["exp_avg_sq"] if st else torch.zeros_like(flat)
    g_max = norm * (hp.grad_clip_norm / (norm + 1e-6) if clip else 1.0)  # >= every |gradient|
    after = _proven_bounds(opt, hp, float(step), g_max) if prove else None
    kept = [] if after else _scratch_copies([flat, avg, sq] if st else [flat])  # fresh: no copy
    problem = None
    with torch.no_grad():
        try:
            torch._fused_adamw_(  # type: ignore[attr-defined]
                [flat], [grad], [avg], [sq], [], [step], lr=hp.learning_rate, beta1=hp.beta1,
                beta2=hp.beta2, weight_decay=hp.weight_decay, eps=hp.eps, amsgrad=False, maximize=False,
            )  # fmt: skip
        except RuntimeError as e:  # a scalar torch refuses (never one of a proven step)
            problem = opt.refusal(f"overflows fp32 ({e})", hp)
        if problem is None and after is None:
            ok = finite_each([flat, avg, sq])
            if not all(ok):
                what = "weights" if not ok[0] else "optimizer moments"
                problem = opt.refusal(
                    f"would make the adapter's {what} of {{name}} NaN or inf",
                    hp,
                    [flat, avg, sq][ok.index(False)],
                )
        if problem is not None:
            for t, old in zip([flat, avg, sq], kept, strict=False):
                t.copy_(old)
            return problem
    # the fused kernel does not count as an in-place write: mark one, as copy_ would (what caches
    # of the weights, such as the stacks of experts pairs, read to see them change)
    torch.autograd.graph.increment_version(flat)
    opt.state = {"step": step, "exp_avg": avg, "exp_avg_sq": sq}
    opt.bounds = None if after is None else _Bounds(*after, _Bounds.key_of(opt))
    return {"grad_norm:mean": norm, "learning_rate:mean": hp.learning_rate}


# a step is proven finite when every value it computes is bounded below this: fp32's largest
# finite value is 3.4e38, and the ~340x between them is far more than the relative rounding
# (~1e-7 an operation) of the handful of fp32 operations the kernel does on each element
FINITE_BELOW = 1e36
_ROUND = 1 + 1e-6  # each bound is widened by this for the rounding of the fp32 values it bounds


@dataclass
class _Bounds:
    """Upper bounds on an adapter's weights' magnitudes, its first moments' magnitudes and its
    second moments, valid while its weights and moments are the tensors, at the version
    counters, recorded in ``key`` (any write through torch bumps them; a load replaces them)."""

    weights: float
    exp_avg: float
    exp_avg_sq: float
    key: tuple[Any, ...]

    @staticmethod
    def key_of(opt: AdapterOptimizer) -> tuple[Any, ...]:
        moments = [opt.state[k] for k in ("exp_avg", "exp_avg_sq")] if opt.state else []
        # the tensors themselves are held (their ids are not reused while they are)
        return (opt.flat._version, *moments, *(t._version for t in moments))

    def valid_for(self, opt: AdapterOptimizer) -> bool:
        key = _Bounds.key_of(opt)
        return len(key) == len(self.key) and all(
            a is b if isinstance(a, torch.Tensor) else a == b for a, b in zip(key, self.key, strict=True)
        )


def _measured_bounds(opt: AdapterOptimizer) -> tuple[float, float, float]:
    """The largest |weight|, |exp_avg| and exp_avg_sq, read from the tensors (one pass each);
    NaN or inf where a value is, inf where a second moment is negative."""

    def absmax(t: torch.Tensor) -> float:
        if t.numel() == 0:
            return 0.0
        lo, hi = torch.aminmax(t)
        return float(torch.maximum(-lo, hi))  # NaN if any value is NaN

    if not opt.state:
        return absmax(opt.flat), 0.0, 0.0
    sq = opt.state["exp_avg_sq"]
    sq_min = float(sq.min()) if sq.numel() else 0.0
    sq_max = absmax(sq) if sq_min >= 0 else math.inf  # (NaN >= 0 is false)
    return absmax(opt.flat), absmax(opt.state["exp_avg"]), sq_max


def _proven_bounds(
    opt: AdapterOptimizer, hp: AdamParams, step: float, g_max: float
) -> tuple[float, float, float] | None:
    """Bounds on the weights and moments after this step (as :class:`_Bounds` holds them) if
    every value the step computes provably stays finite, else None (then the step must be able
    to be undone). ``g_max`` bounds every |gradient| the step is given (the gradient's norm).

    What ``torch._fused_adamw_`` computes for each element, with m, v its moments, b1 = 1 -
    beta1**step and b2 = 1 - beta2**step: ``w*(1 - lr*wd)``; ``m + (1-beta1)*(g - m)``;
    ``beta2*v + (1-beta2)*g*g``; ``d = sqrt(v)/sqrt(b2) + eps``; ``w - (lr/b1)*m/d``. With |w| <=
    W, |m| <= M, 0 <= v <= V and |g| <= G every intermediate is bounded by one of the terms
    checked below, since d >= eps; the new moments are convex combinations of the old and the
    gradient's, and the update is at most lr/b1 * M/eps."""
    if opt.bounds is None or not opt.bounds.valid_for(opt):
        opt.bounds = _Bounds(*_measured_bounds(opt), _Bounds.key_of(opt))
    w, m, v = opt.bounds.weights, opt.bounds.exp_avg, opt.bounds.exp_avg_sq
    lr, wd, b1, b2 = hp.learning_rate, hp.weight_decay, hp.beta1, hp.beta2
    eps = min(hp.eps, float(torch.tensor(hp.eps, dtype=torch.float32)))  # as fp32 rounds it
    if not eps > 0:
        return None
    g = g_max * _ROUND
    m_new = (b1 * m + (1 - b1) * g) * _ROUND
    v_new = (b2 * v + (1 - b2) * g * g) * _ROUND
    step_size = lr / (1 - b1**step)
    numerator = step_size * m_new * _ROUND
    update = numerator / eps * _ROUND
    decayed = w * abs(1 - lr * wd) * _ROUND
    w_new = (decayed + update) * _ROUND
    denominator = math.sqrt(v_new) / math.sqrt(1 - b2**step) + eps
    terms = (lr, lr * wd, step_size, g * g, g + m, v_new, numerator, update, decayed, w_new, denominator)
    if all(t < FINITE_BELOW for t in terms):  # (NaN < x is false)
        return w_new, m_new, v_new
    return None


_SCRATCH = threading.local()  # each thread's scratch buffer for _scratch_copies


def _scratch_copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of ``tensors`` (one dtype and device) in this thread's scratch buffer, kept between
    steps and grown to the largest adapter stepped: a fresh buffer the size of an adapter costs
    its pages' first-touch faults on every step, about what the copy itself costs."""
    ref, need = tensors[0], sum(t.numel() for t in tensors)
    buf: torch.Tensor | None = getattr(_SCRATCH, "buf", None)
    if buf is None or buf.numel() < need or buf.dtype != ref.dtype or buf.device != ref.device:
        buf = _SCRATCH.buf = torch.empty(need, dtype=ref.dtype, device=ref.device)
    out, at = [], 0
    for t in tensors:
        out.append(buf[at : at + t.numel()].view_as(t).copy_(t))
        at += t.numel()
    return out


def _scratch_double(t: torch.Tensor) -> torch.Tensor:
    """``t`` as float64, flat, in this thread's scratch buffer for it (kept between steps, like
    :func:`_scratch_copies`': a fresh one costs more in page faults than the conversion)."""
    buf: torch.Tensor | None = getattr(_SCRATCH, "double", None)
    if buf is None or buf.numel() < t.numel() or buf.device != t.device:
        buf = _SCRATCH.double = torch.empty(t.numel(), dtype=torch.float64, device=t.device)
    return buf[: t.numel()].copy_(t.reshape(-1))


def finite_each(tensors: list[torch.Tensor]) -> list[bool]:
    """Whether each tensor is all finite, from its sum (a NaN or inf makes the sum so; only a sum
    past fp32's range, of finite values, needs the element-wise look). A sum streams through the
    tensor once, several times faster on a CPU than an L1 norm."""
    if not tensors:
        return []
    sums = torch.stack([t.sum() for t in tensors]).isfinite().tolist()
    return [ok or bool(torch.isfinite(t).all()) for ok, t in zip(sums, tensors, strict=True)]
