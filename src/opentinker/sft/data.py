"""SFT data: chat JSONL -> examples -> ``Datum`` s (through a renderer) -> seeded batches.

File format: one conversation per line, ``{"messages": [{"role": ..., "content": ...}, ...]}``
(roles ``system``, ``user``, ``assistant``, ``tool``); blank lines are skipped. Any other malformed
line raises ``ValueError`` naming the file, the line number and the problem.

Over-long examples (more than ``max_length`` tokens once rendered) follow ``overlong``:

* ``"raise"`` (default): ``ValueError`` naming the example's file and line, so nothing is
  silently dropped or cut;
* ``"truncate"``: keep the first ``max_length`` tokens; an example left with no trained token is
  dropped. Both are counted (:attr:`SupervisedData.truncated`, :attr:`SupervisedData.dropped`)
  and :func:`opentinker.sft.loop.run_sft` logs the counts (``data/train_truncated``, …);
* ``"skip"``: drop the example, counted in :attr:`SupervisedData.dropped`.

Batches: each epoch is a permutation of the examples seeded by ``(seed, epoch)``, cut into
``ceil(n / batch_size)`` batches (the last one may be smaller, so every example is seen once per
epoch). The batch of a step depends only on ``(seed, step)``, so a resumed run sees the same data.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from tinker import types

from opentinker.data import supervised_datum
from opentinker.renderers import Message, Renderer, TrainOn, check_messages

T = TypeVar("T")

Overlong = Literal["raise", "truncate", "skip"]


@dataclass
class ChatExample:
    """One conversation and where it came from (``"path, line N"``) for error messages."""

    messages: list[Message]
    where: str = ""


def parse_chat_record(obj: Any, where: str) -> ChatExample:
    """Validate one decoded JSON record ``{"messages": [...]}``; ``ValueError`` names ``where``."""
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object with 'messages', got {type(obj).__name__}")
    if "messages" not in obj:
        raise ValueError(f"{where}: missing 'messages' (keys: {sorted(obj)})")
    messages = obj["messages"]
    try:
        check_messages(messages, where="messages")
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return ChatExample([{"role": m["role"], "content": m["content"]} for m in messages], where)


def read_jsonl(path: str | Path, parse: Callable[[Any, str], T], what: str) -> list[T]:
    """``parse(record, where)`` for every non-blank line of a JSONL file; errors name the file and
    the line (``where``), and an empty file is an error too."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{what} data file {str(p)!r} does not exist")
    out = []
    with p.open(encoding="utf-8") as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{p}, line {n}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
            out.append(parse(obj, where))
    if not out:
        raise ValueError(f"{p}: no {what} records (the file is empty)")
    return out


def read_chat_jsonl(path: str | Path) -> list[ChatExample]:
    """All conversations of a chat JSONL file (see the module doc for the format and errors)."""
    return read_jsonl(path, parse_chat_record, "chat")


@dataclass
class SupervisedData:
    """Rendered examples: one ``Datum`` each, with its source and the over-length counts."""

    datums: list[types.Datum] = field(default_factory=list)
    sources: list[str] = field(default_factory=list)
    truncated: int = 0  # examples cut to max_length (and kept)
    dropped: int = 0  # examples skipped: over-long (overlong="skip") or nothing trained left

    def __len__(self) -> int:
        return len(self.datums)

    def stats(self, prefix: str) -> dict[str, float]:
        return {
            f"data/{prefix}_examples": float(len(self.datums)),
            f"data/{prefix}_truncated": float(self.truncated),
            f"data/{prefix}_dropped": float(self.dropped),
        }


def render_examples(
    renderer: Renderer,
    examples: Iterable[ChatExample],
    *,
    train_on: TrainOn = "all_assistant",
    max_length: int | None = None,
    overlong: Overlong = "raise",
) -> SupervisedData:
    """Each conversation -> tokens + weights (1 on trained assistant turns) -> a ``Datum``."""
    if overlong not in ("raise", "truncate", "skip"):
        raise ValueError(f"overlong must be 'raise', 'truncate' or 'skip', got {overlong!r}")
    if max_length is not None and max_length < 2:
        raise ValueError(f"max_length must be >= 2, got {max_length}")
    out = SupervisedData()
    for ex in examples:
        try:
            tokens, weights = renderer.build_supervised_example(ex.messages, train_on)
        except ValueError as e:
            raise ValueError(f"{ex.where or 'example'}: {e}") from None
        if max_length is not None and len(tokens) > max_length:
            if overlong == "raise":
                raise ValueError(
                    f"{ex.where or 'example'}: {len(tokens)} tokens, more than max_length={max_length} "
                    "(raise max_length, or set overlong='truncate' or 'skip')"
                )
            if overlong == "skip":
                out.dropped += 1
                continue
            tokens, weights = tokens[:max_length], weights[:max_length]
            if not any(weights[1:]):  # the first token is never a target
                out.dropped += 1
                continue
            out.truncated += 1
        out.datums.append(supervised_datum(tokens, weights))
        out.sources.append(ex.where)
    return out


def load_supervised(
    renderer: Renderer,
    path: str | Path,
    *,
    train_on: TrainOn = "all_assistant",
    max_length: int | None = None,
    overlong: Overlong = "raise",
) -> SupervisedData:
    """:func:`read_chat_jsonl` then :func:`render_examples`."""
    return render_examples(
        renderer, read_chat_jsonl(path), train_on=train_on, max_length=max_length, overlong=overlong
    )


def trained_tokens(datums: Sequence[types.Datum]) -> float:
    """Sum of the cross-entropy weights: the number of tokens a batch trains on."""
    return float(sum(sum(d.loss_fn_inputs["weights"].tolist()) for d in datums))


class Batcher:
    """Deterministic epoch-shuffled batches: :meth:`indices` depends only on ``(seed, step)``."""

    def __init__(self, n: int, batch_size: int, seed: int = 0) -> None:
        if n < 1:
            raise ValueError("no training examples")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.n, self.batch_size, self.seed = n, batch_size, seed
        self.steps_per_epoch = math.ceil(n / batch_size)
        self._perm: tuple[int, list[int]] | None = None

    def permutation(self, epoch: int) -> list[int]:
        if self._perm is None or self._perm[0] != epoch:
            order = list(range(self.n))
            random.Random(f"sft/{self.seed}/{epoch}").shuffle(order)
            self._perm = (epoch, order)
        return self._perm[1]

    def epoch(self, step: int) -> int:
        return step // self.steps_per_epoch

    def indices(self, step: int) -> list[int]:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        k = step % self.steps_per_epoch
        return self.permutation(self.epoch(step))[k * self.batch_size : (k + 1) * self.batch_size]

    def batch(self, data: Sequence[types.Datum], step: int) -> list[types.Datum]:
        return [data[i] for i in self.indices(step)]
