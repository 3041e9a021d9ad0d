"""Signed download URLs: a file of a checkpoint, for one tenant, until a time — and nothing else.

``get_external_weights_urls`` (and the session trace export) hand out URLs that this server itself
serves at ``/api/v1/downloads/<model_id>/<kind>/<name>/<file>?tenant=…&expires=…&sig=…``, fetched
with a plain GET and no API key, as the SDK documents. ``sig`` is
``HMAC-SHA256(secret, "v1\\n<tenant>\\n<tinker path>\\n<file>\\n<expires>")``, hex: it binds the tenant,
the checkpoint, the file and the expiry time, so changing any of them (another tenant's name,
another file, a later expiry) breaks it, and a URL stops working at ``expires``. Nothing but the
secret can make one: 256 random bits, made once per data dir in ``<data-dir>/url_signing.key``,
created with mode 0600 (only the server's user can read it) and reused by every later process, so
URLs survive a restart. Deleting the file revokes every URL handed out (a new secret is made).

Checking a URL (:meth:`UrlSigner.verify`) compares the signature in constant time, then the
expiry; the route then checks that the checkpoint still exists and still belongs to that tenant.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import time
from pathlib import Path
from urllib.parse import quote, urlencode

from opentinker.server.errors import Forbidden

SECRET_FILE = "url_signing.key"
DEFAULT_URL_TTL_S = 3600  # "the URL expires after about an hour" (the SDK's docs)
DOWNLOAD_ROUTE = "/api/v1/downloads"
UPLOAD_ROUTE = "/api/v1/external_weights_uploads"  # SDK 0.39's signed PUT URLs of an upload


def load_secret(data_dir: str | Path) -> bytes:
    """The data dir's signing secret, made (0600, exclusively) on first use."""
    path = Path(data_dir) / SECRET_FILE
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return _read_secret(path)
    secret = secrets.token_bytes(32)
    with os.fdopen(fd, "w") as f:
        f.write(secret.hex())
    return secret


def _read_secret(path: Path) -> bytes:
    secret = bytes.fromhex(path.read_text().strip())
    if len(secret) < 32:
        raise RuntimeError(f"{SECRET_FILE} in the data dir is too short; delete it to make a new one")
    if path.stat().st_mode & 0o077:
        os.chmod(path, 0o600)  # never left readable by other users
    return secret


class UrlSigner:
    def __init__(self, data_dir: str | Path, ttl_s: float = DEFAULT_URL_TTL_S) -> None:
        self._secret = load_secret(data_dir)
        self.ttl_s = ttl_s

    def _sig(self, tenant: str, tinker_path: str, file: str, expires: int) -> str:
        msg = f"v1\n{tenant}\n{tinker_path}\n{file}\n{expires}".encode()
        return hmac.new(self._secret, msg, hashlib.sha256).hexdigest()

    def sign(
        self, base_url: str, tenant: str, tinker_path: str, file: str, *, expires: int | None = None
    ) -> str:
        """A URL for ``file`` of ``tinker_path`` (``tinker://<model>/<kind>/<name>``) for ``tenant``."""
        if expires is None:
            expires = int(time.time() + self.ttl_s)
        where = tinker_path.removeprefix("tinker://")
        query = urlencode(
            {"tenant": tenant, "expires": expires, "sig": self._sig(tenant, tinker_path, file, expires)}
        )
        return f"{base_url.rstrip('/')}{DOWNLOAD_ROUTE}/{quote(where)}/{quote(file)}?{query}"

    def sign_upload(self, base_url: str, tenant: str, upload_id: str, file: str, expires: int) -> str:
        """A PUT URL for ``file`` of upload ``upload_id`` (signed as ``upload://<id>``, so no
        download URL works as an upload URL, nor the other way round)."""
        query = urlencode(
            {
                "tenant": tenant,
                "expires": expires,
                "sig": self._sig(tenant, upload_path(upload_id), file, expires),
            }
        )
        return f"{base_url.rstrip('/')}{UPLOAD_ROUTE}/{quote(upload_id)}/{quote(file)}?{query}"

    def verify(
        self, tenant: str, tinker_path: str, file: str, expires: str, sig: str, what: str = "download"
    ) -> None:
        """Refuse (403, naming why) a URL whose signature does not match or that has expired."""
        try:
            when = int(expires)
        except ValueError:
            raise Forbidden(f"malformed {what} URL: expires is not a unix time") from None
        want = self._sig(tenant, tinker_path, file, when)
        if not hmac.compare_digest(want.encode(), sig.encode()):
            raise Forbidden(
                f"invalid {what} URL signature: the URL was changed or was not made by this server"
            )
        if time.time() >= when:
            raise Forbidden(
                f"{what} URL expired at {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(when))}; "
                "ask for new URLs"
            )


def upload_path(upload_id: str) -> str:
    """What an upload's URLs sign in place of a tinker path."""
    return f"upload://{upload_id}"
