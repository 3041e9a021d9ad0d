"""Custom losses in the embedded client, and the compile step the server's upload route uses.

A custom loss is traced with the SDK's own tracer (``tinker``'s ``trace_loss``: torch.fx, with
the SDK's checks) and encoded as the same plain graph the SDK uploads, then compiled by the
engine's restricted interpreter (:mod:`opentinker.engine.custom_loss`). So a loss runs the same
way embedded (``ServiceClient.create_custom_loss`` here, then
``TrainingClient.forward_backward_custom(data, loss)``) as uploaded to ``opentinker serve``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from opentinker.engine.custom_loss import CustomLoss, CustomLossError, compile_loss

__all__ = ["CustomLoss", "CustomLossError", "compile_uploaded", "trace_custom_loss"]


def compile_uploaded(name: str, inputs: Sequence[Mapping[str, Any]], graph: Mapping[str, Any]) -> CustomLoss:
    """An uploaded loss (the fields of ``CreateCustomLossRequest``), checked and compiled;
    raises :class:`CustomLossError` (a user error) naming what is refused."""
    return compile_loss(name, inputs, graph)


def trace_custom_loss(fn: Callable[..., Any], input_ranks: Mapping[str, int]) -> CustomLoss:
    """``fn(logprobs, *inputs) -> (loss, metrics)`` traced as the SDK traces it, then compiled."""
    from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

    try:
        handle = trace_loss(fn, input_ranks, "embedded")  # type: ignore[arg-type]  # ranks 0/1/2
    except ValueError as e:
        raise CustomLossError(str(e)) from e
    inputs = [i.model_dump(mode="json") for i in handle.inputs]
    return compile_loss(handle.name, inputs, encode_graph(handle).model_dump(mode="json"))
