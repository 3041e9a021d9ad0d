"""Per-adapter AdamW: each adapter owns its optimizer and state; a step touches nothing else.

We drive ``torch.optim.AdamW`` (decoupled weight decay, bias-corrected moments) with Tinker's
per-step ``AdamParams``; gradients live in the engine's per-adapter accumulators and are handed to
the optimizer only for the step, so no other adapter's tensors are ever visited.

A step is all or nothing (invariant 9): the weights and moments are copied before it, and if the
step left any of them NaN or inf (finite inputs can still overflow: a huge learning rate, a squared
gradient past fp32's range) everything is copied back bit for bit and the step is refused.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from opentinker.engine.types import AdamParams, EngineError


class AdapterOptimizer:
    def __init__(self, params: dict[str, torch.Tensor]) -> None:
        self.params = params
        self.opt = torch.optim.AdamW(list(params.values()), lr=0.0, foreach=False)

    def step(self, grads: dict[str, torch.Tensor], hp: AdamParams) -> dict[str, float]:
        """One AdamW step with ``grads`` (name -> tensor like the param); returns metrics."""
        norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads.values()))
        clip = 1.0
        if hp.grad_clip_norm > 0 and norm > hp.grad_clip_norm:
            clip = hp.grad_clip_norm / (norm + 1e-6)
        group = self.opt.param_groups[0]
        group.update(
            lr=hp.learning_rate, betas=(hp.beta1, hp.beta2), eps=hp.eps, weight_decay=hp.weight_decay
        )
        for name, p in self.params.items():
            g = grads[name]
            p.grad = g * clip if clip != 1.0 else g
        before = self._copy()
        try:
            with torch.no_grad():
                self.opt.step()
            bad = self._non_finite()
            problem = None if bad is None else f"would make the adapter's {bad} NaN or inf"
        except RuntimeError as e:  # torch refuses a scalar past fp32's range mid-step
            problem = f"overflows fp32 ({e})"
        finally:
            for p in self.params.values():
                p.grad = None
        if problem is not None:
            self._restore(before)  # the parameters it had already updated go back too
            raise EngineError(
                f"this optimizer step {problem} (learning_rate={hp.learning_rate!r}, eps={hp.eps!r}, "
                f"weight_decay={hp.weight_decay!r}); it was not applied: the weights and optimizer "
                "state are unchanged"
            )
        return {"grad_norm:mean": norm, "learning_rate:mean": hp.learning_rate}

    def _copy(self) -> list[tuple[torch.Tensor, dict[str, Any] | None]]:
        """Each parameter's values and optimizer state (None before its first step), copied."""
        out = []
        for p in self.params.values():
            st = self.opt.state.get(p)
            saved = (
                {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in st.items()} if st else None
            )
            out.append((p.detach().clone(), saved))
        return out

    def _restore(self, saved: list[tuple[torch.Tensor, dict[str, Any] | None]]) -> None:
        with torch.no_grad():
            for p, (values, state) in zip(self.params.values(), saved, strict=True):
                p.copy_(values)  # in place: the optimizer and the adapter hold this very tensor
                if state is None:
                    self.opt.state.pop(p, None)
                else:
                    self.opt.state[p] = state

    def _non_finite(self) -> str | None:
        """The first tensor the step left non-finite ("weights <name>", "moments of <name>")."""
        for name, p in self.params.items():
            if not bool(torch.isfinite(p).all()):
                return f"weights {name}"
            st = self.opt.state.get(p, {})
            for key in ("exp_avg", "exp_avg_sq"):
                if key in st and not bool(torch.isfinite(st[key]).all()):
                    return f"optimizer moments of {name}"
        return None

    @property
    def steps(self) -> int:
        states = [self.opt.state.get(p) for p in self.params.values()]
        return int(states[0]["step"]) if states and states[0] else 0

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The moments and step count as flat named tensors (for safetensors)."""
        out: dict[str, torch.Tensor] = {}
        for name, p in self.params.items():
            st = self.opt.state.get(p)
            if not st:
                continue
            out[f"{name}.exp_avg"] = st["exp_avg"]
            out[f"{name}.exp_avg_sq"] = st["exp_avg_sq"]
            out[f"{name}.step"] = torch.as_tensor(st["step"], dtype=torch.float32).reshape(1)
        return out

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        self.opt.state.clear()
        for name, p in self.params.items():
            if f"{name}.exp_avg" not in tensors:
                continue
            self.opt.state[p] = {
                "step": tensors[f"{name}.step"].reshape(()).clone().to(torch.float32),
                "exp_avg": tensors[f"{name}.exp_avg"].clone().to(p.device, p.dtype),
                "exp_avg_sq": tensors[f"{name}.exp_avg_sq"].clone().to(p.device, p.dtype),
            }
