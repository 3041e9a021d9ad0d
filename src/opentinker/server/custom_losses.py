"""``/create_custom_loss``: the session's uploaded custom losses, checked once, run by id.

The SDK (with ``custom_loss_server_side`` advertised by ``/client/config``) uploads a traced loss
as JSON (``CreateCustomLossRequest``: name, declared inputs, the torch.fx nodes); it is compiled
by the engine's restricted interpreter (``engine/custom_loss.py``, through the service layer) (allow-listed ops only, nothing executed)
and kept under the id ``<session>:loss:<custom_loss_seq_id>``. ``forward_backward`` with
``loss_fn="custom"`` and ``loss_fn_config={"loss_id": id}`` then runs it on the server.

Lifetime: a loss lives in this server process's memory, usable by the models of the session that
created it; after a restart its id is unknown (the SDK's handle must be created again).
Retries of one ``custom_loss_seq_id`` with the same body get the same id; another body is refused.
"""

from __future__ import annotations

import threading
from typing import Any

from pydantic import Field

from opentinker.server.errors import UserError
from opentinker.server.schemas import MAX_SEQ, _Wire
from opentinker.service.custom_loss import CustomLoss, compile_uploaded


class CreateCustomLossRequest(_Wire):
    session_id: str
    custom_loss_seq_id: int = Field(ge=0, le=MAX_SEQ)
    name: str
    inputs: list[dict[str, Any]]
    graph: dict[str, Any]


class CustomLosses:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._losses: dict[str, tuple[str, str, CustomLoss]] = {}  # id -> (tenant, session, loss)

    def create(self, tenant: str, session_id: str, req: CreateCustomLossRequest) -> str:
        """Compile and keep the loss; its id. Raises ``UserError`` naming what is refused."""
        loss = compile_uploaded(req.name, req.inputs, req.graph)  # CustomLossError: a user error
        loss_id = f"{session_id}:loss:{req.custom_loss_seq_id}"
        with self._lock:
            self._losses[loss_id] = (tenant, session_id, loss)
        return loss_id

    def get(self, tenant: str, session_id: str, loss_id: object) -> CustomLoss:
        """The loss ``loss_id`` for a model of ``session_id``; another tenant's, or another
        session's, is as unknown as one never made."""
        if not isinstance(loss_id, str) or not loss_id:
            raise UserError("loss_fn 'custom' needs loss_fn_config {'loss_id': <id from create_custom_loss>}")
        with self._lock:
            hit = self._losses.get(loss_id)
        if hit is None or hit[0] != tenant:
            raise UserError(
                f"unknown custom loss {loss_id!r} (custom losses live in the server's memory; "
                "after a restart, create the loss again)"
            )
        if hit[1] != session_id:
            raise UserError(f"custom loss {loss_id!r} belongs to another session; create it in this one")
        return hit[2]
