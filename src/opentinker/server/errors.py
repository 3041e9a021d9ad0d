"""HTTP-level errors of the server, and how a failed operation is reported to the SDK.

Two channels, chosen by what the ``tinker`` SDK does with each (see PROTOCOL.md, "Futures"):

- A request the server cannot even take — bad key, unknown id, malformed body, too big, too many
  pending — is refused at once with a 4xx status and ``{"detail": message}``. The SDK raises
  non-retryable 4xx errors immediately and backs off on 429.
- An operation that was taken (it has a request id) and then failed answers through
  ``/retrieve_future`` as ``200 {"error": message, "category": "user"|"server"}``: a 400 there
  would be retried by the SDK, an error payload is raised with its message.

Every message a client gets passes through a :class:`Redactor` first: a message must never show
where the server keeps its data (an ``OSError`` or a checkpoint check names absolute paths). Paths
inside a checkpoint folder become the checkpoint's ``tinker://`` path, the data dir itself becomes
``<data-dir>``, and any other absolute path ``<server path>``.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

from opentinker.service import EngineError

Category = Literal["user", "server"]


class ApiError(Exception):
    """Refuse a request with ``status`` and a message naming the problem."""

    status = 400

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        if status is not None:
            self.status = status


class BadRequest(ApiError):
    status = 400


class Unauthorized(ApiError):
    status = 401


class NotFound(ApiError):
    """Unknown ids — and ids of another tenant, which are indistinguishable from unknown ones."""

    status = 404


class Forbidden(ApiError):
    """A signed URL that does not check out (changed, expired, or made for another tenant)."""

    status = 403


class Gone(ApiError):
    status = 410


class PayloadTooLarge(ApiError):
    status = 413


class TooManyPending(ApiError):
    status = 429


class UserError(EngineError):
    """An operation refused for a reason the caller can fix (a conflict, an unsupported option)."""


def error_category(exc: BaseException) -> Category:
    """Who is at fault for a failed operation: bad input is the user's; anything else is ours."""
    if isinstance(exc, EngineError | ValueError | TypeError | KeyError | LookupError | ApiError):
        return "user"
    return "server"


def error_message(exc: BaseException) -> str:
    if isinstance(exc, ApiError):
        return exc.message
    text = str(exc.args[0]) if isinstance(exc, KeyError) and exc.args else str(exc)
    return text or type(exc).__name__


# An absolute path of two or more segments: not inside a URL or a ``tinker://`` path (no word
# character, ':', '/', '.', '<' or '>' just before it), optionally starting at ``~``.
_ABS_PATH = re.compile(r"(?<![\w:/.<>~-])~?(?:/[^\s'\"/,;()<>\[\]]+){2,}/?")


class Redactor:
    """Rewrites text for a client so that it shows no filesystem path of this server."""

    def __init__(self, data_dirs: Iterable[str | Path]) -> None:
        roots: set[str] = set()
        for d in data_dirs:
            for form in (Path(d), Path(d).absolute(), Path(d).resolve()):
                text = str(form).rstrip("/")
                if len(text) > 1:
                    roots.add(text)
        alternatives = "|".join(re.escape(r) for r in sorted(roots, key=len, reverse=True))
        self._root = re.compile(f"(?:{alternatives})(?![\\w.-])") if roots else None
        part = r"[^/\s'\"]+"
        self._checkpoint = (
            re.compile(
                rf"(?:{alternatives})/checkpoints/(?P<model>{part})/(?P<kind>weights|sampler_weights|external_weights)"
                rf"/(?P<name>{part})(?P<file>/[^\s'\"]*)?"
            )
            if roots
            else None
        )

    def __call__(self, text: str) -> str:
        if self._checkpoint is not None:
            text = self._checkpoint.sub(_tinker_path, text)
        if self._root is not None:
            text = self._root.sub("<data-dir>", text)
        return _ABS_PATH.sub(_hide, text)


def _tinker_path(m: re.Match[str]) -> str:
    path = f"tinker://{m['model']}/{m['kind']}/{m['name']}"
    file = (m["file"] or "").strip("/")
    return f"{path} (file {file})" if file else path


def _hide(m: re.Match[str]) -> str:
    text = m.group(0)
    tail = len(text) - len(text.rstrip(".:"))  # sentence punctuation after the path stays
    return "<server path>" + text[len(text) - tail :]


def image_format_refusal(errors: Sequence[Any]) -> str | None:
    """For a JSON body refused by its schema (pydantic's ``errors()``) because an ``ImageChunk``
    has a ``format`` other than png or jpeg: the 400's message naming the chunk and the format, as
    the protobuf training body's check words it; else None (the schema's own 422 stands)."""
    for err in errors:
        loc = tuple(err.get("loc", ()))
        if err.get("type") == "literal_error" and loc[-2:] == ("ImageChunk", "format"):
            where = [str(x) for x in loc[:-2] if x != "body"]
            if len(where) >= 2 and where[-2] == "chunks":  # prompt.chunks.1 -> prompt: chunk 1
                where = [*where[:-2], f"chunk {where[-1]}"]
            # worded as the engine's own refusal of a format (models/vision.py, decode_image)
            return f"{': '.join(where)}: unsupported image format {err.get('input')!r}: send png or jpeg"
    return None
