"""A training request refused outright spends its ``seq_id``: tell the model's reorder buffer.

The SDK numbers a model's calls before sending them, and a send answered with a 4xx it does not
retry (anything but 402, 408, 409 and 429) is given up for good: the client goes on with the next
``seq_id`` (see :mod:`ordering`). If the server refused that request before the reorder buffer
saw it — an unknown route, a body that fails validation, a bad field found while decoding — the
buffer would wait for a ``seq_id`` that never comes. So every refusal of a body naming a
``model_id`` and a ``seq_id`` (JSON, or the protobuf ``ForwardBackwardRequest``) is reported to
:meth:`Sequencer.refused <opentinker.server.ordering.Sequencer.refused>`, once the model is known
to be the sender's own — a refused request never touches another tenant's model.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from google.protobuf.message import DecodeError
from tinker.proto import tinker_public_pb2 as pb

from opentinker.server.limits import is_protobuf
from opentinker.server.ordering import Sequencer

SDK_RESENDS = frozenset({402, 408, 409, 429})  # 4xx answers the SDK waits out and sends again


def sdk_gives_up(status: int) -> bool:
    return 400 <= status < 500 and status not in SDK_RESENDS


def refused_seq(body: bytes | None, content_type: str) -> tuple[str, int] | None:
    """``(model_id, seq_id)`` named by a request body, if it names both."""
    if not body:
        return None
    if is_protobuf(content_type):
        msg = pb.ForwardBackwardRequest()
        try:
            msg.ParseFromString(body)
        except (DecodeError, ValueError):
            return None
        return (msg.model_id, msg.seq_id) if msg.model_id and msg.seq_id > 0 else None
    try:
        data = json.loads(body)  # nested shallowly enough to decode: the body limit saw to that
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(data, dict):
        return None
    model_id, seq_id = data.get("model_id"), data.get("seq_id")
    if (
        not isinstance(model_id, str)
        or not model_id
        or isinstance(seq_id, bool)
        or not isinstance(seq_id, int)
    ):
        return None
    return (model_id, seq_id) if seq_id > 0 else None


def note_refused(
    sequencer: Sequencer,
    status: int,
    body: bytes | None,
    content_type: str,
    owns: Callable[[str], bool],
) -> None:
    """Report a refused request's ``seq_id`` as spent, if the SDK will not send it again."""
    if not sdk_gives_up(status):
        return
    hit = refused_seq(body, content_type)
    if hit is not None and owns(hit[0]):
        sequencer.refused(*hit)
