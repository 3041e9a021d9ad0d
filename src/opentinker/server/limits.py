"""Request-size limit and body decoding, in front of every route (a pure ASGI middleware).

The whole body is read here, up to ``max_bytes``: a bigger one is answered ``413`` with a message
naming the limit (the rest of it is drained, up to a cap, so the client reads the answer instead
of a reset connection). A ``Content-Encoding: zstd`` body is decompressed here, with the same
limit on its decompressed size, so routes only ever see plain bodies.

A body nested more than :data:`MAX_JSON_DEPTH` levels deep is refused here too (400), whatever
route it is sent to. Python's JSON decoder recurses once per level: 100,000 levels raise
``RecursionError`` in FastAPI's body parsing and in the refusal bookkeeping (``refusals.py``),
which would answer 500. Every non-protobuf body is checked, since both of those try any such body
as JSON whatever its content type; the limit is far below the recursion limit and far above what
any request of the wire protocol nests (a handful of levels).
"""

from __future__ import annotations

import json
import re
from typing import Any

from opentinker.server.errors import ApiError
from opentinker.server.wire import decompress

ASGIApp = Any
BODY_KEY = "opentinker.body"  # the scope entry holding the whole (decompressed) body
_DRAIN_FACTOR = 8  # past this many times the limit, stop reading and let the connection drop
MAX_JSON_DEPTH = 128  # levels of arrays and objects a JSON body may nest
_STRUCTURE = re.compile(rb'[\[\]{}"\\]')  # what nesting depends on: brackets, quotes, escapes
_OPEN, _CLOSE, _QUOTE, _ESCAPE = frozenset(b"[{"), frozenset(b"]}"), ord('"'), ord("\\")


def is_protobuf(content_type: str) -> bool:
    """A body the routes decode as protobuf, never as JSON (token bytes look like brackets)."""
    return "protobuf" in content_type


def nested_too_deeply(raw: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether ``raw``, read as JSON, opens more than ``limit`` arrays or objects at once.

    Brackets inside strings do not count. Linear in the body: the bytes that matter are found by
    one regex scan, and only when the body holds more openers than the limit at all (a normal
    body is decided by two ``count`` calls)."""
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    depth, in_string, escaped = 0, False, -1
    for m in _STRUCTURE.finditer(raw):
        at = m.start()
        c = raw[at]
        if in_string:
            if at == escaped:
                continue  # the character after a backslash is taken as it is
            if c == _ESCAPE:
                escaped = at + 1
            elif c == _QUOTE:
                in_string = False
        elif c == _QUOTE:
            in_string = True
        elif c in _OPEN:
            depth += 1
            if depth > limit:
                return True
        elif c in _CLOSE:
            depth -= 1
    return False


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
            await _answer(scope, send, 413, f"the request body is over the limit of {self.max_bytes} bytes")
            return
        raw = b"".join(chunks)
        encoding = headers.get(b"content-encoding")
        if encoding:
            try:
                raw = decompress(raw, encoding.decode("latin-1"), self.max_bytes)
            except ApiError as e:
                await _answer(scope, send, e.status, e.message)
                return
            kept = [(k, v) for k, v in scope["headers"] if k not in (b"content-encoding", b"content-length")]
            scope = {**scope, "headers": [*kept, (b"content-length", str(len(raw)).encode())]}
        if not is_protobuf(headers.get(b"content-type", b"").decode("latin-1")) and nested_too_deeply(raw):
            await _answer(
                scope, send, 400, f"the JSON body is nested too deeply (over {MAX_JSON_DEPTH} levels)"
            )
            return
        scope = {**scope, BODY_KEY: raw}  # for handlers of refused requests (see refusals.py)
        replayed = False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if replayed:
                return await receive()  # the disconnect, when it comes
            replayed = True
            return {"type": "http.request", "body": raw, "more_body": False}

        await self.app(scope, replay, send)


async def _answer(scope: dict[str, Any], send: Any, status: int, detail: str) -> None:
    answer: dict[str, Any] = {"detail": detail}
    if str(scope.get("path", "")).startswith("/v1/"):  # the OpenAI-compatible routes' error shape
        answer = {"error": {"message": detail, "type": "invalid_request_error", "param": None, "code": None}}
    body = json.dumps(answer).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
        }
    )
    await send({"type": "http.response.body", "body": body})
