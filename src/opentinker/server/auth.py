"""API keys → tenants, and the ``opentinker keys create|list|revoke`` command.

Keys look like ``tml-<40 url-safe chars>`` (the SDK refuses keys without the ``tml-`` prefix) and
are sent as the ``X-API-Key`` header. Only their SHA-256 is stored, so a leaked database does not
leak keys; ``keys list`` shows hash prefixes, which ``keys revoke`` accepts.

In ``--dev`` mode any well-formed key is accepted and its tenant is ``dev-<hash prefix>``: distinct
keys are still distinct, isolated tenants. Keys created with ``keys create`` keep their named
tenant in dev mode too.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import secrets
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

from opentinker.server.errors import Unauthorized
from opentinker.server.store import Store

KEY_PATTERN = re.compile(r"^tml-[A-Za-z0-9_\-]{8,200}$")
TENANT_PATTERN = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,63}$")
_CACHE_SECONDS = 5.0  # a revoked key stops working within this long


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> str:
    return "tml-" + secrets.token_urlsafe(30)


class Authenticator:
    """Maps the ``X-API-Key`` of each request to a tenant (or refuses it with 401)."""

    def __init__(self, store: Store, *, dev: bool) -> None:
        self.store = store
        self.dev = dev
        self._cache: dict[str, tuple[str, float]] = {}
        self._lock = threading.Lock()

    def tenant(self, key: str | None) -> str:
        if not key:
            raise Unauthorized("missing X-API-Key header")
        if not KEY_PATTERN.match(key):
            raise Unauthorized("malformed API key: expected tml- followed by at least 8 letters or digits")
        digest = hash_key(key)
        now = time.monotonic()
        with self._lock:
            hit = self._cache.get(digest)
        if hit is not None and hit[1] > now:
            return hit[0]
        row = self.store.key(digest)
        if row is not None and row.revoked is None:
            tenant = row.tenant
        elif row is None and self.dev:
            tenant = f"dev-{digest[:16]}"
            self.store.ensure_tenant(tenant)
        else:
            raise Unauthorized("invalid or revoked API key")
        with self._lock:
            self._cache[digest] = (tenant, now + _CACHE_SECONDS)
        return tenant


# ---------------------------------------------------------------------------- the CLI
def create_key(data_dir: str | Path, tenant: str, name: str = "") -> str:
    """Create a key for ``tenant`` (created if new); returns the key, which is shown only once."""
    if not TENANT_PATTERN.match(tenant):
        raise ValueError(f"invalid tenant name {tenant!r}: letters, digits, '.', '_', '-' (max 64)")
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
    revoke = sub.add_parser("revoke", help="revoke keys by hash prefix (as `list` shows it)")
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
