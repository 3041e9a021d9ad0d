"""Short-lived signed tokens (JWT, HS256) that the SDK exchanges its API key for.

The SDK 0.38 asks ``/client/config``; when it says ``pjwt_auth_enabled``, the SDK posts its API key
to ``/auth/token``, sends the JWT it gets back as ``X-API-Key`` on every later request, refreshes it
at half its lifetime (``exp - iat``) and reads ``whoami`` from its claims (``sub``, ``org_id``,
``email``). A 401 carrying ``WWW-Authenticate: Bearer error="invalid_token"`` makes it fetch a new
token and replay the request once.

Why HMAC-SHA256 written here and not a JWT library: the server is the only one that mints and
checks these tokens, so a symmetric key is all that is needed, and the twenty lines below avoid a
dependency (PyJWT is not in the project's environment). The key is 32 random bytes in
``<data-dir>/token_secret`` (mode 0600), made on first use, so tokens survive a restart and
deleting the file invalidates every token at once.

Claims: ``sub`` (``tml:user:<tenant>``), ``org_id`` (the tenant), ``email`` (empty: keys are not
user-backed), ``kid`` (the SHA-256 of the API key the token came from, so a revoked key's tokens
are refused at once), ``iss``, ``iat``, ``exp``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ISSUER = "opentinker"
SECRET_FILE = "token_secret"
MAX_TOKEN_CHARS = 4096
_HEADER = {"alg": "HS256", "typ": "JWT"}


class TokenError(Exception):
    """A token that is malformed, wrongly signed or expired; the message says which."""


@dataclass(frozen=True)
class Claims:
    tenant: str
    key_hash: str
    issued: float
    expires: float


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def load_secret(data_dir: str | Path) -> bytes:
    """The signing key of ``data_dir``, created (0600, never overwritten) on first use."""
    path = Path(data_dir) / SECRET_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        secret = path.read_bytes()
        if len(secret) < 32:
            raise RuntimeError(f"{SECRET_FILE} in the data dir is shorter than 32 bytes") from None
        return secret
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_bytes(32))
        f.flush()
        os.fsync(f.fileno())
    return path.read_bytes()


class TokenSigner:
    def __init__(self, secret: bytes, ttl_s: float) -> None:
        self._secret = secret
        self.ttl_s = ttl_s

    def _sign(self, signing_input: str) -> str:
        return _b64(hmac.new(self._secret, signing_input.encode(), hashlib.sha256).digest())

    def mint(
        self, tenant: str, key_hash: str, *, now: float | None = None, ttl_s: float | None = None
    ) -> str:
        issued = int(time.time() if now is None else now)
        claims = {
            "iss": ISSUER,
            "sub": f"tml:user:{tenant}",
            "org_id": tenant,
            "email": "",
            "kid": key_hash,
            "iat": issued,
            "exp": issued + int(self.ttl_s if ttl_s is None else ttl_s),
        }
        head = _b64(json.dumps(_HEADER, separators=(",", ":")).encode())
        body = _b64(json.dumps(claims, separators=(",", ":")).encode())
        return f"{head}.{body}.{self._sign(f'{head}.{body}')}"

    def verify(self, token: str, *, now: float | None = None) -> Claims:
        """The claims of ``token``; :class:`TokenError` naming what is wrong otherwise."""
        if len(token) > MAX_TOKEN_CHARS:
            raise TokenError(f"malformed token: longer than {MAX_TOKEN_CHARS} characters")
        parts = token.split(".")
        if len(parts) != 3:
            raise TokenError("malformed token: expected three dot-separated parts (a JWT)")
        head, body, sig = parts
        try:
            header = json.loads(_unb64(head))
            claims: dict[str, Any] = json.loads(_unb64(body))
        except (ValueError, binascii.Error, UnicodeDecodeError):
            raise TokenError("malformed token: its header or claims are not base64url JSON") from None
        if not isinstance(header, dict) or header.get("alg") != "HS256":
            raise TokenError("malformed token: only HS256 tokens issued by this server are accepted")
        if not hmac.compare_digest(sig, self._sign(f"{head}.{body}")):
            raise TokenError(
                "invalid token signature: the token was not issued by this server or was altered"
            )
        try:
            tenant, key_hash = str(claims["org_id"]), str(claims["kid"])
            issued, expires = float(claims["iat"]), float(claims["exp"])
        except (KeyError, TypeError, ValueError):
            raise TokenError("malformed token: missing or invalid claims") from None
        current = time.time() if now is None else now
        if current >= expires:
            raise TokenError(
                f"token expired {current - expires:.0f} s ago: exchange the API key for a new one "
                "(POST /api/v1/auth/token)"
            )
        return Claims(tenant, key_hash, issued, expires)


def looks_like_token(credential: str) -> bool:
    """What the SDK itself tests: a JWT's base64url header starts with ``eyJ`` (``{"``)."""
    return credential.startswith("eyJ")
