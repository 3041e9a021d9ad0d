"""Where a decode step's time goes: the lean forward with no adapter, with K distinct adapters, and HF's
forward on one model (what ``generate`` steps), side by side in one process.

Each arm prefills the same ``--rows`` × ``--prompt-len`` batch, then times ``--steps`` decode steps
(ms per step); the arms run in interleaved rounds after a warm-up and medians are printed. The
difference between the first two arms is the adapters' terms, between the last two HF's module
tree and cache; what the first arm costs is the base GEMMs, which every sampler pays.

    python benchmarks/make_family_model.py --family qwen3 --out Q
    OMP_NUM_THREADS=1 python benchmarks/decode_step_breakdown.py --model Q
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from timing import interleaved
from transformers import AutoModelForCausalLM, DynamicCache

from opentinker.engine import Engine
from opentinker.lora import LoRAConfig
from opentinker.models import load_base_model
from opentinker.sampling.lean_lora import LeanLoRA
from opentinker.sampling.lean_model import LeanModel, lean_model


def _lean_arm(lean: LeanModel, x: torch.Tensor, steps: int, lora: LeanLoRA | None) -> Callable[[], float]:
    rows, n = x.shape

    @torch.inference_mode()
    def run() -> float:
        cache = lean.new_cache(rows, n + steps + 1, n + steps + 1)
        lean.forward(cache, x, torch.arange(n)[None].expand(rows, n), None, lora, 1)
        t = time.perf_counter()
        for s in range(steps):
            lean.forward(cache, x[:, :1], torch.full((rows, 1), n + s), None, lora, 1)
        return (time.perf_counter() - t) / steps

    return run


def _hf_arm(model: torch.nn.Module, x: torch.Tensor, steps: int) -> Callable[[], float]:
    rows, n = x.shape

    @torch.no_grad()
    def run() -> float:
        cache = DynamicCache()
        model(input_ids=x, past_key_values=cache, use_cache=True, logits_to_keep=1)
        t = time.perf_counter()
        for s in range(steps):
            pos = torch.full((rows, 1), n + s)
            model(input_ids=x[:, :1], past_key_values=cache, use_cache=True, position_ids=pos)
        return (time.perf_counter() - t) / steps

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="a model the lean path covers")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    base = load_base_model(args.model)
    engine = Engine(base, max_rank=8)
    ids = [engine.create_adapter(LoRAConfig(rank=8, seed=i)) for i in range(args.rows)]
    with torch.no_grad():
        for aid in ids:
            for t in engine.adapter_weights(aid).b.values():
                t.normal_(std=0.01)
    lean = lean_model(base.model, engine.lora.groups)
    if lean is None:
        raise SystemExit(f"{args.model}: no lean forward for this model")
    plan = engine.plan_routing(ids)
    assert plan is not None
    lora = LeanLoRA(plan, engine.lora.groups, lean.dtype)
    hf = AutoModelForCausalLM.from_pretrained(base.path).eval()
    x = torch.randint(
        3, base.vocab_size, (args.rows, args.prompt_len), generator=torch.Generator().manual_seed(0)
    )
    step_times: dict[str, list[float]] = {}
    arms = {
        "lean, no adapter": _lean_arm(lean, x, args.steps, None),
        f"lean, {args.rows} adapters": _lean_arm(lean, x, args.steps, lora),
        "HF forward, one model": _hf_arm(hf, x, args.steps),
    }
    # each call's own return value is its per-step time (the prefill is not timed)
    wrapped = {k: (lambda f=f, k=k: step_times.setdefault(k, []).append(f())) for k, f in arms.items()}
    interleaved(wrapped, args.repeats, warmup=1)
    for k in arms:
        print(f"{k:<24} {statistics.median(step_times[k][1:]) * 1e3:8.1f} ms/step")


if __name__ == "__main__":
    main()
