"""API keys → tenants, and the ``opentinker keys create|list|revoke`` command.

Keys made by ``keys create`` look like ``tml-<40 url-safe chars>`` and are sent as the
``X-API-Key`` header. Only their SHA-256 is stored, so a leaked database does not leak keys;
``keys list`` shows hash prefixes, which ``keys revoke`` accepts. Every request looks its key up
in the database (one indexed read), so a revoked key is refused from the very next request — by a
running server too, with no restart and no delay.

Every route also takes, in the same header, a short-lived signed token (:mod:`tokens`) that
``POST /auth/token`` gives for a key: the SDK 0.38 exchanges its key for one when ``/client/config``
says ``pjwt_auth_enabled``. A token names the key it came from, and that key is looked up on every
use just like a key, so revoking a key stops its tokens at once too (not at their expiry): a
revocation means "now" for a key, and a token must not outlive that by up to its lifetime.

In ``--dev`` mode any key the SDK accepts (``tml-`` followed by anything printable, ``tml-dummy``
included) is accepted and its tenant is ``dev-<hash prefix>``: distinct keys are still distinct,
isolated tenants. Keys created with ``keys create`` keep their named tenant in dev mode too.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import secrets
import sys
import threading
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar

from opentinker.server.errors import BadRequest, Unauthorized
from opentinker.server.store import Store
from opentinker.server.tokens import TokenError, TokenSigner, looks_like_token
from opentinker.service.sessions import check_tenant

MAX_KEY_CHARS = 512
KEY_PATTERN = re.compile(r"tml-[\x21-\x7e]*")  # what the SDK sends: tml- and printable ASCII


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return "tml-" + secrets.token_urlsafe(30)


class InvalidToken(Unauthorized):
    """A token refused as a token: the header tells the SDK to get a new one and replay once."""

    headers: ClassVar[dict[str, str]] = {"WWW-Authenticate": 'Bearer error="invalid_token"'}


@dataclass(frozen=True)
class Identity:
    tenant: str
    key_hash: str  # the SHA-256 of the API key (for a token: of the key it was issued for)
    token: bool  # whether the credential was a token rather than the key itself


class Authenticator:
    """Maps the ``X-API-Key`` of each request (a key or a token) to a tenant, or refuses it (401)."""

    def __init__(self, store: Store, *, dev: bool, signer: TokenSigner | None = None) -> None:
        self.store = store
        self.dev = dev
        self.signer = signer  # None: tokens are off, only keys are accepted
        self._dev_tenants: set[str] = set()  # dev tenants already written to the store
        self._lock = threading.Lock()

    def tenant(self, key: str | None) -> str:
        return self.identify(key).tenant

    def identify(self, key: str | None) -> Identity:
        if not key:
            raise Unauthorized("missing X-API-Key header")
        if looks_like_token(key):
            return self._token(key)
        return Identity(self._key_tenant(key), hash_key(key), token=False)

    def _token(self, token: str) -> Identity:
        if self.signer is None:
            raise InvalidToken("tokens are disabled on this server: send the API key itself")
        try:
            claims = self.signer.verify(token)
        except TokenError as e:
            raise InvalidToken(str(e)) from None
        row = self.store.key(claims.key_hash)  # not cached: a revocation takes effect at once
        if row is not None:
            if row.revoked is not None:
                raise InvalidToken("the API key this token was issued for is revoked")
            if row.tenant == claims.tenant:
                return Identity(row.tenant, claims.key_hash, token=True)
        elif self.dev and claims.tenant == _dev_tenant(claims.key_hash):
            return Identity(claims.tenant, claims.key_hash, token=True)
        raise InvalidToken("the API key this token was issued for is unknown")

    def issue(self, key: str | None) -> str:
        """``POST /auth/token``: a fresh token for the request's key (or token)."""
        if self.signer is None:
            raise BadRequest("tokens are disabled on this server (it was started with --token-ttl 0)")
        who = self.identify(key)
        return self.signer.mint(who.tenant, who.key_hash)

    def key_info(self, key: str | None) -> dict[str, Any]:
        """``GET /auth/apikey/me``: the presented key's public record, as ``tinker auth login`` reads it."""
        who = self.identify(key)
        row = self.store.key_record(who.key_hash)
        key_id, name = (row[0], row[1]) if row is not None else (0, "dev key")
        return {
            "key_id": key_id,
            "name": name,
            "note": "" if row is not None else "any tml- key is its own tenant on a --dev server",
            "details": {"org_details": {"name": who.tenant}, "user_details": {"email": ""}},
        }

    def delete_key(self, key: str | None) -> None:
        """``DELETE /auth/apikey/me``: revoke the presented key itself (``tinker auth logout``)."""
        who = self.identify(key)
        if who.token:
            raise BadRequest("send the API key itself to delete it, not a token issued for it")
        if self.store.key(who.key_hash) is None:  # a dev key: recorded, so that it stays refused
            self.store.add_key(who.key_hash, who.tenant, "dev key")
        self.store.revoke_hash(who.key_hash)

    def _key_tenant(self, key: str) -> str:
        if len(key) > MAX_KEY_CHARS or not KEY_PATTERN.fullmatch(key):
            raise Unauthorized(
                f"malformed API key: expected tml- followed by printable characters (at most {MAX_KEY_CHARS})"
            )
        digest = hash_key(key)
        row = self.store.key(digest)  # not cached: a revocation takes effect at once
        if row is not None and row.revoked is None:
            return row.tenant
        if row is None and self.dev:
            tenant = _dev_tenant(digest)
            with self._lock:
                known = tenant in self._dev_tenants
                self._dev_tenants.add(tenant)
            if not known:
                self.store.ensure_tenant(tenant)
            return tenant
        raise Unauthorized("invalid or revoked API key")


def _dev_tenant(key_hash: str) -> str:
    return f"dev-{key_hash[:16]}"


# ---------------------------------------------------------------------------- the CLI
def create_key(data_dir: str | Path, tenant: str, name: str = "") -> str:
    """Create a key for ``tenant`` (created if new); returns the key, which is shown only once."""
    check_tenant(tenant)
    key = new_key()
    store = Store(data_dir)
    try:
        store.add_key(hash_key(key), tenant, name)
    finally:
        store.close()
    return key


def keys_main(argv: list[str] | None = None) -> int:
    """``opentinker keys create|list|revoke --data-dir D``."""
    parser = argparse.ArgumentParser(prog="opentinker keys", description="manage the server's API keys")
    sub = parser.add_subparsers(dest="action", required=True)
    create = sub.add_parser("create", help="create a key for a tenant (printed once; only its hash is kept)")
    create.add_argument("--tenant", required=True)
    create.add_argument("--name", default="", help="a note to recognise the key by")
    sub.add_parser("list", help="list keys: hash prefix, tenant, name, created, revoked")
    revoke = sub.add_parser(
        "revoke",
        help="revoke keys by hash prefix (as `list` shows it); a running server refuses them from its "
        "next request on",
    )
    revoke.add_argument("prefix")
    for p in (create, revoke, sub.choices["list"]):
        p.add_argument("--data-dir", required=True, type=Path)
    args = parser.parse_args(argv)
    if args.action == "create":
        try:
            print(create_key(args.data_dir, args.tenant, args.name))
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return 0
    store = Store(args.data_dir)
    try:
        if args.action == "list":
            for k in store.api_keys():
                created = datetime.fromtimestamp(k.created, UTC).isoformat(timespec="seconds")
                state = "revoked" if k.revoked is not None else "active"
                print(f"{k.key_hash[:12]}  {k.tenant:<24} {k.name or '-':<16} {created}  {state}")
            return 0
        if not re.fullmatch(r"[0-9a-f]{6,64}", args.prefix):
            print("error: give at least 6 hex characters of the key hash", file=sys.stderr)
            return 2
        n = store.revoke_keys(args.prefix)
        print(f"revoked {n} key(s)")
        return 0 if n else 1
    finally:
        store.close()
