"""JWT auth as the SDK 0.38 does it: ``/client/config`` advertises it, ``/auth/token`` exchanges a
key for a short-lived signed token, every route takes either, ``whoami`` / ``auth/apikey/me`` answer.

Unit tests of the signer and the authenticator, then one server (keys made with ``opentinker keys``,
not ``--dev``) driven by the unmodified SDK and raw HTTP: an expired, a tampered and a malformed
token are refused with 401 naming the problem (and the ``invalid_token`` header the SDK acts on),
nothing stored changes, and a revoked key's tokens stop working at once.
"""

from __future__ import annotations

import base64
import json
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import tinker
from tinker import types

from opentinker.server.auth import Authenticator, InvalidToken, create_key, hash_key, keys_main
from opentinker.server.local import LocalServer
from opentinker.server.store import Store
from opentinker.server.tokens import SECRET_FILE, TokenError, TokenSigner, load_secret
from tests.conftest import TEST_MODEL, local_server


def _retamper(token: str, **claims: object) -> str:
    """``token`` with some claims changed and its original signature kept."""
    head, body, sig = token.split(".")
    data = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    data.update(claims)
    new = base64.urlsafe_b64encode(json.dumps(data).encode()).rstrip(b"=").decode()
    return f"{head}.{new}.{sig}"


# ---------------------------------------------------------------------------- units
def test_secret_file_is_private_and_stable(tmp_path: Path) -> None:
    a = load_secret(tmp_path)
    assert len(a) == 32 and load_secret(tmp_path) == a
    assert stat.S_IMODE((tmp_path / SECRET_FILE).stat().st_mode) == 0o600


def test_signer_round_trip_and_refusals(tmp_path: Path) -> None:
    signer = TokenSigner(load_secret(tmp_path), ttl_s=60)
    token = signer.mint("alice", "ab" * 32)
    assert token.startswith("eyJ")  # what the SDK takes for a JWT
    claims = signer.verify(token)
    assert (claims.tenant, claims.key_hash, claims.expires - claims.issued) == ("alice", "ab" * 32, 60)
    with pytest.raises(TokenError, match="signature"):
        signer.verify(_retamper(token, org_id="bob"))
    with pytest.raises(TokenError, match="signature"):
        TokenSigner(b"x" * 32, 60).verify(token)  # another server's (or a deleted secret's) token
    with pytest.raises(TokenError, match="expired"):
        signer.verify(token, now=time.time() + 61)
    for bad in ("eyJabc", "eyJ.a.b", "a.b.c.d"):
        with pytest.raises(TokenError, match="malformed"):
            signer.verify(bad)
    none_alg = base64.urlsafe_b64encode(b'{"alg":"none"}').rstrip(b"=").decode()
    with pytest.raises(TokenError, match="HS256"):
        signer.verify(f"{none_alg}.{token.split('.')[1]}.")


def test_authenticator_takes_keys_and_tokens_and_revocation_is_immediate(tmp_path: Path) -> None:
    key = create_key(tmp_path, "carol")
    store = Store(tmp_path)
    auth = Authenticator(store, dev=False, signer=TokenSigner(load_secret(tmp_path), 600))
    token = auth.issue(key)
    assert auth.tenant(key) == auth.tenant(token) == "carol"
    assert auth.tenant(auth.issue(token)) == "carol"  # a token can be exchanged for a fresh one
    store.revoke_keys(hash_key(key)[:12])
    with pytest.raises(InvalidToken, match="revoked"):
        auth.tenant(token)
    assert Authenticator(store, dev=False).signer is None
    with pytest.raises(InvalidToken, match="disabled"):
        Authenticator(store, dev=False).tenant(token)
    store.close()


# ---------------------------------------------------------------------------- one server
@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    with local_server(tmp_path_factory, "tokens", dev=False) as srv:
        yield srv


def _key(server: LocalServer, tenant: str) -> str:
    return create_key(server.data_dir, tenant)


def _http(server: LocalServer, credential: str) -> httpx.Client:
    return httpx.Client(base_url=f"{server.base_url}/api/v1", headers={"X-API-Key": credential}, timeout=60)


def _token(server: LocalServer, key: str) -> str:
    with _http(server, key) as http:
        r = http.post("/auth/token", json={})
    assert r.status_code == 200, r.text
    return r.json()["jwt"]


def _signer(server: LocalServer) -> TokenSigner:
    return TokenSigner(load_secret(server.data_dir), 900)


def test_client_config_advertises_tokens_and_whoami_answers(server: LocalServer) -> None:
    key = _key(server, "alice")
    with _http(server, key) as http:
        config = http.post("/client/config", json={"sdk_version": tinker.__version__}).json()
    assert config["pjwt_auth_enabled"] is True
    who = tinker.RestClient(base_url=server.base_url, api_key=key).whoami().result()
    assert who == types.WhoamiResponse(
        user_urn="tml:user:alice", org_urn="tml:organization:alice", email=None
    )


def test_every_route_takes_the_key_or_its_token(server: LocalServer) -> None:
    key = _key(server, "dora")
    # the SDK, JWT on, sends only tokens after the exchange: training and listing work on them
    sc = tinker.ServiceClient(base_url=server.base_url, api_key=key)
    tc = sc.create_lora_training_client(base_model=TEST_MODEL, rank=2, seed=0).result()
    path = tc.save_state("by-token").result().path
    token = _token(server, key)
    answers = []
    for credential in (key, token):
        with _http(server, credential) as http:
            runs = http.get("/training_runs").json()
            ckpts = http.get("/checkpoints").json()
            info = http.post("/weights_info", json={"tinker_path": path})
        assert info.status_code == 200
        answers.append((runs["cursor"]["total_count"], [c["tinker_path"] for c in ckpts["checkpoints"]]))
    assert answers[0] == answers[1] == (1, [path])
    sc.close("success").result()


def test_expired_tampered_and_malformed_tokens_are_refused(server: LocalServer) -> None:
    key = _key(server, "erin")
    sc = tinker.ServiceClient(base_url=server.base_url, api_key=key)
    tc = sc.create_lora_training_client(base_model=TEST_MODEL, rank=2, seed=0).result()
    tc.save_state("kept").result()
    with _http(server, key) as http:
        before = http.get("/checkpoints").json()
    claims = _signer(server).verify(_token(server, key))
    # rightly signed with the server's own secret, but past its exp
    expired = _signer(server).mint("erin", claims.key_hash, now=time.time() - 1000)
    tampered = _retamper(_token(server, key), exp=int(time.time()) + 10**6)
    for credential, reason in ((expired, "expired"), (tampered, "signature"), ("eyJnot-a-jwt", "malformed")):
        with _http(server, credential) as http:
            for r in (
                http.get("/checkpoints"),
                http.delete(f"/training_runs/{tc.model_id}/checkpoints/weights/kept"),
            ):
                assert r.status_code == 401, r.text
                assert reason in r.json()["detail"] and str(server.data_dir) not in r.text
                assert r.headers["WWW-Authenticate"] == 'Bearer error="invalid_token"'
    # the SDK given such a token as its credential fails with the server's reason
    with pytest.raises(tinker.AuthenticationError, match="signature"):
        tinker.RestClient(base_url=server.base_url, api_key=tampered).list_user_checkpoints().result()
    with _http(server, key) as http:
        assert http.get("/checkpoints").json() == before  # nothing stored changed
    sc.close("success").result()


def test_a_revoked_keys_tokens_stop_at_once(server: LocalServer, capsys: pytest.CaptureFixture[str]) -> None:
    key = _key(server, "frank")
    rest = tinker.RestClient(base_url=server.base_url, api_key=key)
    assert rest.list_user_checkpoints().result().checkpoints == []  # holds a live token now
    token = _token(server, key)
    assert keys_main(["revoke", hash_key(key)[:12], "--data-dir", str(server.data_dir)]) == 0
    capsys.readouterr()
    with _http(server, token) as http:
        r = http.get("/checkpoints")
    assert r.status_code == 401 and "revoked" in r.json()["detail"]
    # the SDK's unexpired token is refused too; its replacement exchange is refused for the key
    with pytest.raises(tinker.AuthenticationError, match="revoked"):
        rest.list_user_checkpoints().result()


def test_apikey_me_shows_and_deletes_the_presented_key(server: LocalServer) -> None:
    key = _key(server, "gina")
    with _http(server, key) as http:
        me = http.get("/auth/apikey/me").json()
        assert isinstance(me["key_id"], int) and me["details"]["org_details"]["name"] == "gina"
        token = _token(server, key)
        with _http(server, token) as by_token:  # deleting takes the key itself
            r = by_token.delete("/auth/apikey/me")
            assert r.status_code == 400 and "API key itself" in r.json()["detail"]
        assert http.get("/checkpoints").status_code == 200
        assert http.delete("/auth/apikey/me").status_code == 200
        assert http.get("/checkpoints").status_code == 401
    with _http(server, token) as http:
        assert http.get("/checkpoints").status_code == 401


def test_the_sdk_cli_auth_api_shows_and_deletes_its_key(server: LocalServer) -> None:
    """The SDK's own ``tinker`` CLI client (``TinkerAuthApi``: ``tinker login`` / ``logout``) on the
    same two routes."""
    import httpx
    from tinker.cli.auth_api import AuthApiError, TinkerAuthApi

    key = _key(server, "hana")
    with httpx.Client(timeout=60) as http:
        api = TinkerAuthApi(http, base_url=server.base_url)
        me = api.get_self_api_key(key)
        assert me.details.org_details.name == "hana"
        api.delete_self_api_key(key)
        with pytest.raises(AuthApiError):
            api.get_self_api_key(key)
