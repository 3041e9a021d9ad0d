"""Timeline merging: the LLM calls of one episode -> as few, as short training sequences as
their tokens allow.

An agent that calls the policy several times per episode (a planner and a solver, a tool loop, a
scratchpad that is summarised between calls) leaves one :class:`~opentinker.rl.types.Transition`
per call: the call's whole context ``ob_T``, its output ``ac_T`` and the sampler's logprobs of it.
Trained call by call, every context is recomputed in full, so an episode of n growing calls costs
O(n²) tokens. Merged, each call whose context *extends* an earlier call's context + output is
appended to that call's sequence (a *timeline*): the new context tokens are observation (weight
0), the output keeps its own sampler logprobs and its own call's advantage. Positions, tokens and
causal attention are those of the per-call sequences, so the loss and its gradient are the same
(up to float rounding) from fewer, shorter sequences.

The rule, call by call in order:

* **A claim.** ``Transition.extends = j`` says the call's context starts with call j's context +
  output. It is checked token by token; a context that does not is refused with
  :class:`TimelineError` naming both calls and the first differing position: never merged wrong.
  ``j`` must be an earlier call of the same episode.
* **No claim.** The call joins the timeline whose tokens so far are the longest prefix of its
  context (the longest extension); none: it starts a new timeline.
* **A branch.** A call that extends call j, when j's timeline has already grown past j (another
  call extended j first), starts a new timeline holding j's tokens as observation (weight 0, so
  nothing is trained twice). The two timelines share only a prefix, and the engine's shared-prefix
  pass computes it once (engine/prefix.py: rows of one policy with a common prefix).

This module uses only token lists: it runs the same embedded or against any Tinker server.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from opentinker.rl.types import Transition

OBSERVATION = -1  # call_T value of a token the policy did not generate in this sequence


class TimelineError(ValueError):
    """A call's context claims to extend an earlier call's context + output but does not."""


@dataclass
class Timeline:
    """One merged sequence: ``tokens_T``, the sampler's logprob per token (0 on observation) and,
    per token, the index of the call whose output it is (:data:`OBSERVATION` otherwise)."""

    tokens_T: list[int] = field(default_factory=list)
    logprobs_T: list[float] = field(default_factory=list)
    call_T: list[int] = field(default_factory=list)
    calls: list[int] = field(default_factory=list)  # the calls whose outputs it trains, in order

    @property
    def is_action_T(self) -> list[bool]:
        return [c != OBSERVATION for c in self.call_T]

    def extend(self, call: int, new_ob_T: Sequence[int], t: Transition) -> None:
        self.tokens_T += list(new_ob_T) + list(t.ac_T)
        self.logprobs_T += [0.0] * len(new_ob_T) + list(t.logprobs_T)
        self.call_T += [OBSERVATION] * len(new_ob_T) + [call] * len(t.ac_T)
        self.calls.append(call)


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), None if len(a) >= len(b) else n)


def merge_timelines(transitions: Sequence[Transition]) -> list[Timeline]:
    """The calls of one episode merged into timelines (the module docstring gives the rule)."""
    timelines: list[Timeline] = []
    where: list[tuple[int, int]] = []  # per call: (its timeline, the length after its output)
    for i, t in enumerate(transitions):
        ob_T = t.ob_T
        if t.extends is not None:
            j = t.extends
            if not isinstance(j, int) or not 0 <= j < i:
                raise TimelineError(f"call {i} claims to extend call {j}, which is not an earlier call")
            tl, end = where[j]
            parent = timelines[tl].tokens_T[:end]
            bad = _first_difference(ob_T, parent)
            if bad is not None:
                what = (
                    f"is only {len(ob_T)} tokens long"
                    if bad == len(ob_T)
                    else f"differs at token {bad} (token {ob_T[bad]}, expected {parent[bad]})"
                )
                raise TimelineError(
                    f"call {i} claims to extend call {j}'s context + output ({len(parent)} tokens), "
                    f"but its context {what}"
                )
            # call j at its timeline's tip: append; otherwise a branch (a new timeline)
            target = tl if len(timelines[tl].tokens_T) == end else None
        else:
            target = None
            best = -1
            for k, other in enumerate(timelines):
                n = len(other.tokens_T)
                if n > best and n <= len(ob_T) and ob_T[:n] == other.tokens_T:
                    target, best = k, n
        if target is None:
            timelines.append(Timeline())
            target = len(timelines) - 1
            new_ob_T = ob_T
        else:
            new_ob_T = ob_T[len(timelines[target].tokens_T) :]
        timelines[target].extend(i, new_ob_T, t)
        where.append((target, len(timelines[target].tokens_T)))
    return timelines


def per_call_tokens(transitions: Sequence[Transition]) -> int:
    """Tokens of the episode trained call by call (each call's context + output its own sequence)."""
    return sum(len(t.ob_T) + len(t.ac_T) for t in transitions)


def timeline_tokens(timelines: Sequence[Timeline]) -> int:
    return sum(len(tl.tokens_T) for tl in timelines)
