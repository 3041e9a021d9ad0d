"""Re-evaluate the final X and O policies of tic-tac-toe runs over many games.

Loads each run's checkpoints (``<run>/checkpoints.jsonl``, written by ``run.py``; embedded runs keep
them in the data dir, so use the same ``OPENTINKER_HOME``) and plays each policy, greedy, against
:class:`~opentinker.tasks.tictactoe.RandomMover` from the empty board on its own side, ``--games``
games with a seed other than the training-time evaluator's; then the untrained model the same way.
One JSON line per run: win / loss / draw / illegal rates.

    OMP_NUM_THREADS=1 .venv/bin/python recipes/tictactoe/evaluate.py --games 1000 runs/tictactoe
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

import opentinker
from opentinker.models.registry import TINY
from opentinker.renderers import get_renderer
from opentinker.tasks.tictactoe import make_evaluator


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="run folders (with checkpoints.jsonl)")
    ap.add_argument("--games", type=int, default=1000, help="games per agent")
    ap.add_argument("--seed", type=int, default=12345, help="the random opponents' seed")
    ap.add_argument("--base-model", default=TINY)
    return ap.parse_args()


async def main(args: argparse.Namespace) -> list[dict]:
    service = opentinker.ServiceClient()
    base = service.create_sampling_client(base_model=args.base_model)
    renderer = get_renderer("auto", base.get_tokenizer())
    evaluate = make_evaluator(renderer, games=args.games, seed=args.seed)
    out = []
    for run in args.runs:
        last: dict[str, str] = {}
        for line in (Path(run) / "checkpoints.jsonl").read_text().splitlines():
            c = json.loads(line)
            last[c["agent"]] = c["path"]  # the index is in step order: the last one wins
        policies = {a: service.create_sampling_client(model_path=p) for a, p in last.items()}
        out.append({"run": run, **(await evaluate(policies, 0))})
        print(json.dumps(out[-1]), flush=True)
    out.append({"run": "untrained", **(await evaluate({"X": base, "O": base}, 0))})
    print(json.dumps(out[-1]), flush=True)
    return out


if __name__ == "__main__":
    asyncio.run(main(parse()))
