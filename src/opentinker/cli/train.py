"""``opentinker train rl|sft``: run a registered task from the command line.

    opentinker train rl  --task addition --base-model opentinker/tiny --steps 30 --log-dir runs/add
    opentinker train rl  --task addition --runs 4 ...        # 4 seeds at once: one multi-LoRA run
    opentinker train rl  --task addition,guess_number ...    # several tasks at once, one adapter each
    opentinker train rl  --task reasoning_gym:basic_arithmetic ...   # an environment library's task
    opentinker train rl  --list-tasks                        # the tasks, and the libraries installed
    opentinker train sft --task chat_sft | --data chats.jsonl --base-model ... --steps 50 --log-dir runs/sft

Settings are layered: the loop's config defaults (:class:`~opentinker.rl.RLConfig`,
:class:`~opentinker.sft.SFTConfig`), then the task's ``defaults`` (its registry entry), then the
flags the user passed. The training service is embedded (this process) unless ``--server URL``
names a Tinker server (``opentinker serve``, or any Tinker-compatible one), reached through the
official SDK; the loops are the same either way.

One run writes ``D/config.json``, ``D/metrics.jsonl``, ``D/curves.png`` and its checkpoint index
``D/checkpoints.jsonl``. Several runs (``--task a,b`` or ``--runs K``) train concurrently over one
service, so their requests share the scheduler's fused batches; run *r* writes those files in
``D/<r>/`` (``<r>`` = the task, ``seed<s>``, or both), and ``D/`` gets ``config.json`` (every run's
config), a merged ``metrics.jsonl`` (each row tagged with its ``run``) and one ``curves.png``.

Exit codes: 0 done, 2 bad usage (unknown task, bad flag values, a missing data file), 130
interrupted (resume with ``--resume``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import sys
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from opentinker.tasks import TASKS, TaskSpec, get_task
from opentinker.tracking import set_default_sinks

# --dtype's choices (opentinker.models.dtype checks them again; spelt here so that parsing
# arguments does not import torch)
DTYPE_CHOICES = ("auto", "float32", "bfloat16")

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
LOSSES = ("importance_sampling", "ppo", "cispo", "dro", "gspo")
RL_PLOT_KEYS = ("reward/mean", "eval/accuracy", "loss/per_token")
HEADLINE_EVALS = ("accuracy", "success", "win_rate", "nll_per_token")  # shown in the summary line
SFT_PLOT_KEYS = ("loss/nll_per_token", "eval/nll_per_token", "eval/accuracy")

# flag dest -> config field; a flag left at None keeps the task's default (then the config's)
RL_FIELDS = {
    "base_model": "base_model", "steps": "steps", "lr": "learning_rate", "loss": "loss_fn",
    "group_size": "group_size", "groups_per_step": "groups_per_step", "max_tokens": "max_tokens",
    "temperature": "temperature", "rank": "lora_rank", "train_mlp": "train_mlp",
    "train_unembed": "train_unembed", "mode": "mode", "max_staleness": "max_staleness",
    "kl_coef": "kl_coef", "normalize_std": "normalize_std", "seed": "seed",
    "eval_every": "eval_every", "save_every": "save_every", "episode_timeout": "episode_timeout_s",
    "lr_schedule": "lr_schedule", "lr_final": "lr_final", "substeps": "substeps",
    "replay_size": "replay_size", "max_train_s": "max_train_s", "merge_timelines": "merge_timelines",
}  # fmt: skip
SFT_FIELDS = {
    "base_model": "base_model", "steps": "steps", "epochs": "epochs", "lr": "learning_rate",
    "lr_schedule": "lr_schedule", "batch_size": "batch_size", "rank": "lora_rank",
    "train_mlp": "train_mlp", "train_unembed": "train_unembed", "train_on": "train_on",
    "max_length": "max_length", "overlong": "overlong", "seed": "seed", "eval_every": "eval_every",
    "save_every": "save_every", "data": "data", "eval_data": "eval_data",
}  # fmt: skip


class UsageError(Exception):
    """A problem with what the user asked for: reported in one line, exit code 2."""


# ---------------------------------------------------------------------------------------- parser
def _common(p: argparse.ArgumentParser, log_dir_required: bool = True) -> None:
    p.add_argument("--base-model", default=None, help=f"model name or local folder (default {SMOLLM2})")
    p.add_argument(
        "--log-dir", required=log_dir_required, help="where config.json, metrics.jsonl, curves.png go"
    )
    p.add_argument("--steps", type=int, default=None, help="training steps")
    p.add_argument("--lr", type=float, default=None, help="Adam learning rate")
    p.add_argument("--rank", type=int, default=None, help="LoRA rank")
    p.add_argument("--train-mlp", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--train-unembed", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--eval-every", type=int, default=None, help="evaluate every n steps (0 = start and end)")
    p.add_argument("--save-every", type=int, default=None, help="save_state every n steps (0 = at the end)")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in --log-dir")
    p.add_argument("--renderer", default="auto", choices=("auto", "chatml", "role_colon"))
    p.add_argument("--tensorboard", action="store_true",
                   help="also write the metrics as TensorBoard event files (LOG_DIR/tensorboard/)")  # fmt: skip
    p.add_argument("--wandb", action="store_true",
                   help="also log the metrics to W&B (offline unless WANDB_MODE says otherwise)")  # fmt: skip
    p.add_argument("--extra", action="append", default=[], metavar="KEY=VALUE",
                   help="a task setting (config.extra), e.g. eval_problems=50; VALUE is JSON or a string")  # fmt: skip
    p.add_argument("--server", default=None, metavar="URL",
                   help="train on a Tinker server through the SDK (default: embedded, in this process)")  # fmt: skip
    p.add_argument("--api-key", default=None, help="the server's API key (default $TINKER_API_KEY)")
    p.add_argument("--data-dir", default=None,
                   help="embedded checkpoints' folder (default $OPENTINKER_HOME or ~/.cache/opentinker/data)")  # fmt: skip
    p.add_argument("--dtype", default=None, choices=DTYPE_CHOICES,
                   help="embedded: the frozen base's dtype (default auto: bfloat16 on a CUDA GPU, else float32); "
                        "a server chooses its own (opentinker serve --dtype)")  # fmt: skip
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bars on stderr (default: when stderr is a terminal)")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="opentinker train", description="Train LoRA adapters on a registered task (RL or SFT)."
    )
    sub = parser.add_subparsers(dest="kind", required=True)
    rl_tasks = ", ".join(n for n, t in TASKS.items() if t.kind != "sft")
    rl = sub.add_parser("rl", help="reinforcement learning (rl and multiagent tasks)")
    rl.add_argument(
        "--task", default=None,
        help=f"a task, or several comma-separated ({rl_tasks}, or an environment library's: see --list-tasks)",
    )  # fmt: skip
    rl.add_argument("--list-tasks", action="store_true", help="list the tasks and environment libraries")
    rl.add_argument("--runs", type=int, default=1, help="train K seeds at once (seed, seed+1, ...)")
    _common(rl, log_dir_required=False)  # not needed by --list-tasks (checked in train_rl_main)
    rl.add_argument("--loss", default=None, choices=LOSSES)
    rl.add_argument("--group-size", type=int, default=None, help="episodes per group (advantages within)")
    rl.add_argument("--groups-per-step", type=int, default=None)
    rl.add_argument("--max-tokens", type=int, default=None, help="sampled tokens per turn")
    rl.add_argument("--temperature", type=float, default=None)
    rl.add_argument("--mode", default=None, choices=("sync", "async"))
    rl.add_argument("--max-staleness", type=int, default=None, help="async: policy versions a batch may lag")
    rl.add_argument("--kl-coef", type=float, default=None, help="KL penalty to the base model per token")
    rl.add_argument("--normalize-std", action=argparse.BooleanOptionalAction, default=None)
    rl.add_argument(
        "--merge-timelines",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="merge an episode's calls into timelines (default on); off: one datum per call",
    )
    rl.add_argument(
        "--episode-timeout",
        type=float,
        default=None,
        help="seconds an env reset or step may take before its episode fails",
    )
    rl.add_argument("--lr-schedule", default=None, choices=("constant", "linear", "cosine"))
    rl.add_argument(
        "--lr-final", type=float, default=None, help="the schedule's last lr, as a fraction of --lr"
    )
    rl.add_argument("--substeps", type=int, default=None, help="optimizer steps per batch of rollouts")
    rl.add_argument("--replay-size", type=int, default=None, help="success replay buffer (0 = off)")
    rl.add_argument("--max-train-s", type=float, default=None, help="stop after this much training clock")

    sft_tasks = ", ".join(n for n, t in TASKS.items() if t.kind == "sft")
    sft = sub.add_parser("sft", help="supervised fine-tuning on chat data")
    sft.add_argument("--task", default=None, help=f"an SFT task ({sft_tasks}); default chat_sft")
    sft.add_argument("--data", default=None, help="chat JSONL to train on ({'messages': [...]} per line)")
    sft.add_argument("--eval-data", default=None, help="chat JSONL to evaluate NLL on")
    _common(sft)
    sft.add_argument("--epochs", type=int, default=None, help="used when --steps is not given")
    sft.add_argument("--batch-size", type=int, default=None)
    sft.add_argument("--lr-schedule", default=None, choices=("constant", "linear", "cosine"))
    sft.add_argument("--train-on", default=None, choices=("all_assistant", "last_assistant"))
    sft.add_argument("--max-length", type=int, default=None)
    sft.add_argument("--overlong", default=None, choices=("raise", "truncate", "skip"))
    return parser


# ---------------------------------------------------------------------------------------- configs
def _parse_extra(items: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--extra expects KEY=VALUE, got {item!r}")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def make_config(cls: type, spec: TaskSpec, args: argparse.Namespace, fields: dict[str, str]) -> Any:
    """``cls()`` defaults <- the task's defaults <- the flags the user passed."""
    names = {f.name for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {"base_model": SMOLLM2}
    extra: dict[str, Any] = {}
    for k, v in spec.defaults.items():
        (values if k in names else extra)[k] = v
    for dest, name in fields.items():
        v = getattr(args, dest, None)
        if v is not None:
            values[name] = v
    extra.update(_parse_extra(args.extra))
    progress = args.progress if args.progress is not None else sys.stderr.isatty()
    values.update(extra=extra, progress=progress, log_dir=args.log_dir)
    cfg = cls(**values)
    try:
        cfg.check()
    except ValueError as e:
        raise UsageError(str(e)) from None
    return cfg


def _task(name: str) -> TaskSpec:
    try:
        return get_task(name)
    except ValueError as e:
        raise UsageError(str(e)) from None


# ---------------------------------------------------------------------------------------- service
def make_service(args: argparse.Namespace) -> tuple[Any, bool]:
    """(service, remote): the SDK's client for ``--server``, else the embedded one."""
    import opentinker

    if args.server:
        if args.dtype is not None:
            raise UsageError("--dtype is the server's choice (opentinker serve --dtype), not the client's")
        key = args.api_key or os.environ.get("TINKER_API_KEY")
        if not key:
            raise UsageError("--server needs an API key: pass --api-key or set TINKER_API_KEY")
        return opentinker.ServiceClient(base_url=args.server, api_key=key), True
    if args.data_dir or args.dtype is not None:
        from opentinker.service.runtime import Runtime

        try:
            runtime = Runtime(args.data_dir, dtype=args.dtype or "auto")
        except ValueError as e:  # bf16 on a GPU without it: one line, exit 2
            raise UsageError(str(e)) from None
        return opentinker.ServiceClient(runtime=runtime), False
    return opentinker.ServiceClient(), False


def load_tokenizer(service: Any, base_model: str, remote: bool) -> Any:
    """The base model's tokenizer, for the renderer: the embedded runtime's own, or loaded here
    (a local folder or a built-in name) when training remotely."""
    try:
        if not remote:
            return service.runtime.tokenizer(base_model)
        from transformers import AutoTokenizer

        from opentinker.models.registry import resolve_model_path

        return AutoTokenizer.from_pretrained(resolve_model_path(base_model))
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot load base model {base_model!r}: {e}") from None


def make_renderer(name: str, tokenizer: Any) -> Any:
    from opentinker.renderers import get_renderer

    try:
        return get_renderer(name, tokenizer)
    except ValueError as e:
        raise UsageError(str(e)) from None


# ---------------------------------------------------------------------------------------- runs
@dataclass
class Job:
    name: str  # the run's folder under --log-dir; "" for a single run in --log-dir itself
    spec: TaskSpec
    cfg: Any
    run: Callable[[], Coroutine[Any, Any, Any]]  # the training loop, ready to go
    rl_job: tuple[Any, Any, Any] | None = None  # (cfg, dataset, evaluator): a plain RL run


def _rl_jobs(args: argparse.Namespace) -> list[tuple[str, TaskSpec, Any]]:
    from opentinker.rl import RLConfig

    if not args.task or not args.log_dir:
        raise UsageError("the following arguments are required: --task, --log-dir")
    names = [t.strip() for t in args.task.split(",") if t.strip()]
    if not names:
        raise UsageError("--task: no task named")
    if len(set(names)) != len(names):
        raise UsageError(f"--task names a task twice: {args.task}")
    if args.runs < 1:
        raise UsageError(f"--runs must be >= 1, got {args.runs}")
    specs = [_task(n) for n in names]
    for s in specs:
        if s.kind == "sft":
            raise UsageError(f"task {s.name!r} is an SFT task: use `opentinker train sft --task {s.name}`")
    out = []
    for spec in specs:
        base = make_config(RLConfig, spec, args, RL_FIELDS)
        for i in range(args.runs):
            seed = base.seed + i
            if len(specs) == 1 and args.runs == 1:
                name = ""
            elif args.runs == 1:
                name = spec.slug
            else:
                name = f"seed{seed}" if len(specs) == 1 else f"{spec.slug}-seed{seed}"
            cfg = dataclasses.replace(
                base, seed=seed, name=name or spec.name, extra=dict(base.extra),
                log_dir=str(Path(args.log_dir) / name) if name else args.log_dir,
            )  # fmt: skip
            out.append((name, spec, cfg))
    return out


def _build_rl_job(name: str, spec: TaskSpec, cfg: Any, service: Any, renderer: Any, resume: bool) -> Job:
    try:
        built = spec.build()(renderer, cfg)
    except ValueError as e:  # a bad environment name or option, a library refusing its config
        raise UsageError(str(e)) from None
    if spec.kind == "multiagent":
        from opentinker.rl.multiagent import run_multiagent

        return Job(name, spec, cfg, lambda: run_multiagent(cfg, service, built, resume=resume))
    from opentinker.rl import run_rl

    dataset, evaluator = built
    run = lambda: run_rl(cfg, service, dataset, evaluator, resume=resume)  # noqa: E731
    return Job(name, spec, cfg, run, (cfg, dataset, evaluator))


async def _run_all(jobs: list[Job], service: Any, resume: bool) -> list[Any]:
    """Every job at once over one service. Plain RL runs go through ``run_rl_many`` (the
    multi-LoRA entry point); with ``--resume`` or a multi-agent task, each loop is gathered here."""
    from opentinker.rl import run_rl_many

    rl_jobs = [j.rl_job for j in jobs if j.rl_job is not None]
    if len(jobs) > 1 and not resume and len(rl_jobs) == len(jobs):
        return await run_rl_many(rl_jobs, service)
    return list(await asyncio.gather(*(j.run() for j in jobs)))


def train_rl_main(args: argparse.Namespace) -> int:
    if args.list_tasks:
        from opentinker.tasks.registry import list_tasks

        print(list_tasks())
        return 0
    planned = _rl_jobs(args)
    base_models = {cfg.base_model for _, _, cfg in planned}
    base_model = next(iter(base_models))
    service, remote = make_service(args)
    renderer = make_renderer(args.renderer, load_tokenizer(service, base_model, remote))
    jobs = [_build_rl_job(n, s, c, service, renderer, args.resume) for n, s, c in planned]
    t0 = time.monotonic()
    asyncio.run(_run_all(jobs, service, args.resume))
    wall = time.monotonic() - t0
    _finish(args, jobs, wall, RL_PLOT_KEYS)
    return 0


def train_sft_main(args: argparse.Namespace) -> int:
    from opentinker.sft import SFTConfig, run_sft

    name = args.task or "chat_sft"
    spec = _task(name)
    if spec.kind != "sft":
        raise UsageError(f"task {name!r} is an {spec.kind} task: use `opentinker train rl --task {name}`")
    for flag, path in (("--data", args.data), ("--eval-data", args.eval_data)):
        if path and not Path(path).is_file():
            raise UsageError(f"{flag}: no such file {path!r}")
    if args.eval_data and not args.data:
        raise UsageError("--eval-data needs --data (the bundled set has its own eval split)")
    cfg = make_config(SFTConfig, spec, args, SFT_FIELDS)
    cfg.name = spec.name
    service, remote = make_service(args)
    renderer = make_renderer(args.renderer, load_tokenizer(service, cfg.base_model, remote))
    try:
        train, evald = spec.build()(renderer, cfg)
    except (ValueError, FileNotFoundError) as e:  # malformed data names its file and line
        raise UsageError(str(e)) from None
    job = Job("", spec, cfg, lambda: run_sft(cfg, service, train, evald, resume=args.resume))
    t0 = time.monotonic()
    asyncio.run(job.run())
    _finish(args, [job], time.monotonic() - t0, SFT_PLOT_KEYS)
    return 0


# ---------------------------------------------------------------------------------------- summary
def _fmt(x: float) -> str:
    return f"{x:.3f}" if abs(x) >= 1e-3 or x == 0 else f"{x:.2e}"


def summarize(rows: list[dict[str, Any]], kind: str) -> str:
    """One line: the headline metric at the start and at the end, and the last evaluation."""

    def series(key: str) -> list[float]:
        return [float(r[key]) for r in rows if isinstance(r.get(key), int | float)]

    parts: list[str] = []
    if kind == "sft":  # else "rl" or "multiagent" (per-agent "<agent>/reward/mean")
        heads = ["loss/nll_per_token"]
    else:
        heads = sorted({k for r in rows for k in r if k == "reward/mean" or k.endswith("/reward/mean")})
    for key in heads:
        xs = series(key)
        if len(xs) > 5:  # a step's reward is noisy: the end is the mean of the last 5 steps
            parts.append(f"{key} {_fmt(xs[0])} -> {_fmt(sum(xs[-5:]) / 5)} (last 5 steps)")
        elif xs:
            parts.append(f"{key} {_fmt(xs[0])} -> {_fmt(xs[-1])}")
    evals = sorted({k for r in rows for k in r if k.startswith("eval/") and k != "eval/tokens"})
    evals = [k for k in evals if k.rsplit("/", 1)[-1] in HEADLINE_EVALS] or evals
    for key in evals:
        xs = series(key)
        if len(xs) > 1:
            parts.append(f"{key} {_fmt(xs[0])} -> {_fmt(xs[-1])}")
        elif xs:
            parts.append(f"{key} {_fmt(xs[-1])}")
    steps = sum(1 for r in rows if any(k != "step" and not k.startswith(("eval/", "time/")) for k in r))
    return f"{steps} steps  " + "  ".join(parts)


def _finish(args: argparse.Namespace, jobs: list[Job], wall: float, plot_keys: tuple[str, ...]) -> None:
    from opentinker.tracking import plot_metrics, read_metrics

    root = Path(args.log_dir)
    per_run: dict[str, list[dict[str, Any]]] = {}
    for j in jobs:
        path = Path(j.cfg.log_dir) / "metrics.jsonl"
        per_run[j.name or j.spec.name] = read_metrics(path) if path.exists() else []
    if len(jobs) > 1:
        # the whole multi-run in one place: every run's config, merged metrics, one plot
        (root / "config.json").write_text(
            json.dumps(
                {"command": ["opentinker", "train", *args.argv],
                 "runs": {n: json.loads((Path(j.cfg.log_dir) / "config.json").read_text())
                          for n, j in zip(per_run, jobs, strict=True)}},
                indent=2,
            ) + "\n"
        )  # fmt: skip
        merged = sorted(
            ({"run": n, **r} for n, rows in per_run.items() for r in rows),
            key=lambda r: (r["step"], r["run"]),
        )
        (root / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in merged))
        try:
            plot_metrics(
                {n: Path(j.cfg.log_dir) for n, j in zip(per_run, jobs, strict=True)},
                list(plot_keys), root / "curves.png", title=f"{len(jobs)} adapters, one base model",
            )  # fmt: skip
        except Exception as e:  # a plot is a nicety; the metrics are written
            print(f"opentinker train: plotting failed: {e!r}", file=sys.stderr)
    if len(jobs) == 1:
        (name, rows), j = next(iter(per_run.items())), jobs[0]
        print(f"{name}: {summarize(rows, j.spec.kind)}  wall {wall:.1f}s  -> {j.cfg.log_dir}")
        return
    for (name, rows), j in zip(per_run.items(), jobs, strict=True):
        own = max((float(r.get("time/elapsed_s", 0.0)) for r in rows), default=0.0)
        print(f"{name}: {summarize(rows, j.spec.kind)}  ({own:.1f}s)  -> {j.cfg.log_dir}")
    print(f"done: {len(jobs)} runs at once in {wall:.1f}s wall  -> {root}")


# ---------------------------------------------------------------------------------------- entry
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    set_default_sinks(tensorboard=args.tensorboard, wandb=args.wandb)
    try:
        return train_rl_main(args) if args.kind == "rl" else train_sft_main(args)
    except UsageError as e:
        print(f"opentinker train {args.kind}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            f"\ninterrupted; continue with the same command plus --resume ({args.log_dir})", file=sys.stderr
        )
        return 130
