"""Request-size limit and body decoding, in front of every route (a pure ASGI middleware).

The whole body is read here, up to ``max_bytes``: a bigger one is answered ``413`` with a message
naming the limit (the rest of it is drained, up to a cap, so the client reads the answer instead
of a reset connection). A ``Content-Encoding: zstd`` body is decompressed here, with the same
limit on its decompressed size, so routes only ever see plain bodies.
"""

from __future__ import annotations

import json
from typing import Any

from opentinker.server.errors import ApiError
from opentinker.server.wire import decompress

ASGIApp = Any
BODY_KEY = "opentinker.body"  # the scope entry holding the whole (decompressed) body
_DRAIN_FACTOR = 8  # past this many times the limit, stop reading and let the connection drop


class BodyLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        declared = headers.get(b"content-length")
        too_big = declared is not None and declared.isdigit() and int(declared) > self.max_bytes
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                too_big = True
            if not too_big:
                chunks.append(body)
            more = message.get("more_body", False)
            if too_big and size > _DRAIN_FACTOR * self.max_bytes:
                break
        if too_big:
            await _answer(send, 413, f"the request body is over the limit of {self.max_bytes} bytes")
            return
        raw = b"".join(chunks)
        encoding = headers.get(b"content-encoding")
        if encoding:
            try:
                raw = decompress(raw, encoding.decode("latin-1"), self.max_bytes)
            except ApiError as e:
                await _answer(send, e.status, e.message)
                return
            kept = [(k, v) for k, v in scope["headers"] if k not in (b"content-encoding", b"content-length")]
            scope = {**scope, "headers": [*kept, (b"content-length", str(len(raw)).encode())]}
        scope = {**scope, BODY_KEY: raw}  # for handlers of refused requests (see refusals.py)
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if replayed:
                return await receive()  # the disconnect, when it comes
            replayed = True
            return {"type": "http.request", "body": raw, "more_body": False}

        await self.app(scope, replay, send)


async def _answer(send: Any, status: int, detail: str) -> None:
    body = json.dumps({"detail": detail}).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})
