"""Build the bundled arithmetic chat set of the ``chat_sft`` task (deterministic given ``--seed``).

Writes ``src/opentinker/tasks/data/arithmetic_chat.jsonl`` (train) and ``arithmetic_chat_eval.jsonl``
(eval): 2-digit additions asked exactly as the ``addition`` RL task asks them (``What is A + B? Answer
with just the number.``), answered with just the number; about one line in five is a multi-turn
conversation of 2-3 such questions. No problem is one of the 200 held-out evaluation problems of
:func:`opentinker.tasks.arithmetic.eval_problems`, so SFT-then-RL accuracy stays honest, and the
train and eval sets share no problem.

Reproduce with::

    python scripts/make_chat_data.py --seed 0 --train 500 --eval 100
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from opentinker.tasks.arithmetic import eval_problems, question

OUT = Path(__file__).resolve().parents[1] / "src" / "opentinker" / "tasks" / "data"


def conversations(
    rng: random.Random, n: int, excluded: set[tuple[int, int]], multi_turn: float
) -> list[dict]:
    out = []
    while len(out) < n:
        turns = rng.choice([2, 3]) if rng.random() < multi_turn else 1
        messages = []
        for _ in range(turns):
            while True:
                a, b = rng.randint(10, 99), rng.randint(10, 99)
                if (a, b) not in excluded:
                    break
            excluded.add((a, b))  # each problem appears once across both files
            messages += [
                {"role": "user", "content": question(a, b)},
                {"role": "assistant", "content": str(a + b)},
            ]
        out.append({"messages": messages})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--train", type=int, default=500)
    ap.add_argument("--eval", type=int, default=100)
    ap.add_argument("--multi-turn", type=float, default=0.2, help="fraction of multi-turn conversations")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    excluded = set(eval_problems())
    eval_set = conversations(rng, args.eval, excluded, args.multi_turn)
    train_set = conversations(rng, args.train, excluded, args.multi_turn)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("arithmetic_chat.jsonl", train_set), ("arithmetic_chat_eval.jsonl", eval_set)):
        path = args.out / name
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"{path}: {len(rows)} conversations")


if __name__ == "__main__":
    main()
