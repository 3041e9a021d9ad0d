"""HTTP-level errors of the server, and how a failed operation is reported to the SDK.

Two channels, chosen by what the ``tinker`` SDK does with each (see PROTOCOL.md, "Futures"):

- A request the server cannot even take — bad key, unknown id, malformed body, too big, too many
  pending — is refused at once with a 4xx status and ``{"detail": message}``. The SDK raises
  non-retryable 4xx errors immediately and backs off on 429.
- An operation that was taken (it has a request id) and then failed answers through
  ``/retrieve_future`` as ``200 {"error": message, "category": "user"|"server"}``: a 400 there
  would be retried by the SDK, an error payload is raised with its message.
"""

from __future__ import annotations

from typing import Literal

from opentinker.engine import EngineError

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
