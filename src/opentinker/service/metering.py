"""Token metering: what a request counts, written once for every route that trains or samples.

A sample counts its prompt (``sampling_prefill``) and its generated tokens (``sampling_sample``)
and reports, unbilled, the prompt tokens it took from the prefix cache (``prompt_cache_hit``); a
training request counts its data's tokens (``training``). Where the counts go is a :class:`Meter`
(the server's usage ledger is one)."""

from __future__ import annotations

from typing import Any, Protocol

TRAINING, PREFILL, SAMPLED, CACHE_HIT = "training", "sampling_prefill", "sampling_sample", "prompt_cache_hit"


class Meter(Protocol):
    def count(self, tenant: str, kind: str, tokens: int, *, session_id: str, base_model: str) -> None:
        """Bill ``tokens`` of ``kind`` to the tenant's session."""
        ...

    def observe(self, tenant: str, kind: str, tokens: int, *, base_model: str) -> None:
        """Report ``tokens`` of ``kind`` without billing them."""
        ...


def meter_sample(
    meter: Meter,
    tenant: str,
    res: Any,
    prompt_len: int,
    *,
    session_id: str,
    base_model: str,
    sampled: bool = True,
) -> None:
    """Count one finished sample (a ``SampleResponse``) of a ``prompt_len``-token prompt;
    ``sampled`` False: its generated tokens are not counted (none is returned: the OpenAI routes'
    ``echo`` with ``max_tokens`` 0 samples one token and answers none)."""
    generated = sum(len(s.tokens) for s in res.sequences) if sampled else 0
    meter.count(tenant, PREFILL, prompt_len, session_id=session_id, base_model=base_model)
    meter.count(tenant, SAMPLED, generated, session_id=session_id, base_model=base_model)
    hits = int(getattr(res, "prompt_cache_hit_tokens", 0) or 0)
    meter.observe(tenant, CACHE_HIT, hits, base_model=base_model)


def meter_training(meter: Meter, tenant: str, tokens: int, *, session_id: str, base_model: str) -> None:
    """Count one finished training request over ``tokens`` tokens of data."""
    meter.count(tenant, TRAINING, tokens, session_id=session_id, base_model=base_model)
