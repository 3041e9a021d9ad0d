"""The main job, embedded: several LoRA policies trained with RL at once over one base model.

Each adapter gets the same questions but its own objective — reply in about 3, 6, 12 or 24 words
(the ``reply_length`` task, a dense reward). All of them sample in one mixed batch and train in
one fused forward/backward per scheduler tick, through the same client API a remote Tinker
server offers. At the end every adapter and the bare base answer one held-out question in one
mixed sampling batch, and ``<log-dir>/curves.png`` shows each adapter's reward rising.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from tinker import types

TARGETS = (3, 6, 12, 24)


def run_demo(
    *, base_model: str, n_adapters: int, steps: int, rank: int, lr: float, log_dir: str = "runs/demo"
) -> int:
    import opentinker
    from opentinker.renderers import get_renderer
    from opentinker.rl.loop import RLConfig, run_rl_many
    from opentinker.tasks import reply_length
    from opentinker.tracking import plot_metrics

    t0 = time.perf_counter()
    service = opentinker.ServiceClient()
    targets = [TARGETS[i % len(TARGETS)] * (1 + i // len(TARGETS)) for i in range(n_adapters)]
    jobs = []
    for i, target in enumerate(targets):
        cfg = RLConfig(
            base_model=base_model, log_dir=str(Path(log_dir) / f"words-{target}"), steps=steps,
            groups_per_step=2, group_size=4, lora_rank=rank, learning_rate=lr, max_tokens=48,
            eval_every=0, seed=i, progress=False, name=f"words-{target}",
            plot_keys=("reward/mean", "env/words"), extra={"target_words": target},
        )  # fmt: skip
        renderer = get_renderer("auto", service.create_sampling_client(base_model=base_model).get_tokenizer())
        dataset, _ = reply_length.build(renderer, cfg)
        jobs.append((cfg, dataset, None))
    print(f"{n_adapters} adapters (rank {rank}) on {base_model}, RL towards {targets} words, {steps} steps")
    print("step  " + "  ".join(f"{f'words-{t}':>16}" for t in targets) + "   (mean reward / mean words)")
    latest: dict[str, dict[str, Any]] = {}
    printed = -1

    def on_step(name: str, row: dict[str, Any]) -> None:
        nonlocal printed
        latest[name] = row
        if len(latest) == len(targets) and all(r["step"] > printed for r in latest.values()):
            printed = min(r["step"] for r in latest.values())
            cells = [
                f"{latest[f'words-{t}']['reward/mean']:6.2f} / {latest[f'words-{t}']['env/words']:5.1f}"
                for t in targets
            ]
            print(
                f"{printed:4d}  "
                + "  ".join(f"{c:>16}" for c in cells)
                + f"   ({time.perf_counter() - t0:.0f}s)"
            )

    results = asyncio.run(run_rl_many(jobs, service, on_step=on_step))
    plot = plot_metrics(
        {c.name: Path(c.log_dir) for c, _, _ in jobs}, ["reward/mean", "env/words"], Path(log_dir) / "curves.png",
        title=f"{n_adapters} LoRA policies, one base ({base_model.split('/')[-1]})",
    )  # fmt: skip

    question = reply_length.EVAL[0]
    sampler_tokenizer = service.create_sampling_client(base_model=base_model).get_tokenizer()
    renderer = get_renderer("auto", sampler_tokenizer)
    prompt = types.ModelInput.from_ints(
        renderer.build_generation_prompt([{"role": "user", "content": question}])
    )
    params = types.SamplingParams(max_tokens=48, temperature=0.0, stop=renderer.stop)
    policies = [r.training_client.save_weights_and_get_sampling_client() for r in results]
    policies.append(service.create_sampling_client(base_model=base_model))
    futures = [p.sample(prompt, 1, params) for p in policies]  # one mixed batch: 4 adapters + base
    print(f"\n{question!r}")
    for name, fut in zip([*(f"words-{t}" for t in targets), "base model"], futures, strict=True):
        text = renderer.parse_response(list(fut.result().sequences[0].tokens))[0]["content"]
        print(f"  {name:>10} ({len(text.split()):2d} words) -> {text!r}")
    print(f"\nmetrics: {log_dir}/*/metrics.jsonl   plot: {plot}   ({time.perf_counter() - t0:.0f}s in all)")
    return 0
