"""External weights, signed download URLs, checkpoint TTLs and publishing — through the unmodified
``tinker`` SDK (and ``tinker_cookbook.weights.download``) against ``opentinker serve``.

Two ``--dev`` keys are two tenants (A and B). Covered: ``save_weights_external`` writes hosted
Tinker's adapter layout, which the cookbook's ``build_lora_adapter`` turns into a PEFT adapter that
``peft`` loads over the HF base with the server's own logprobs (the converters on every family:
``tests/test_tinker_weights.py``); its signed
URLs download without a key and are refused when changed, expired or presented by another tenant;
the cookbook's ``weights.download`` works on both path kinds (the training one goes through an
age-encrypted temporary export); TTLs out of range are refused with nothing changed, an expired
checkpoint leaves listings at once and disk at the next sweep — but not while a live sampler uses
it; a published checkpoint can be sampled and trained from by B, read-only, and is 404 for B again
once unpublished (B's sampler included). Unit tests first: the signing secret (made once, 0600),
the TTL range, an older database's migration, and start-up re-indexing of external weights.
"""

from __future__ import annotations

import json
import sqlite3
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tinker
import torch
from tinker import types

from opentinker.server.checkpoints import reconcile
from opentinker.server.local import LocalServer
from opentinker.server.signing import SECRET_FILE, UrlSigner, load_secret
from opentinker.server.store import Store
from opentinker.service.checkpoints import MAX_TTL_S, MIN_TTL_S, CheckpointStore, InvalidTTL, check_ttl
from opentinker.service.external import ExternalStore
from tests.conftest import TEST_MODEL, local_server
from tests.tolerances import assert_logprobs_close

KEY_A, KEY_B = "tml-weights-tenant-a", "tml-weights-tenant-b"
SWEEP_S = 0.3
TOKENS = [int(t) for t in np.random.default_rng(5).integers(3, 1000, 18)]
DATUM = types.Datum(
    model_input=types.ModelInput.from_ints(TOKENS[:-1]),
    loss_fn_inputs={"target_tokens": TOKENS[1:]},  # type: ignore[dict-item]  # lists: the SDK converts
)


# ---------------------------------------------------------------------------- units
def test_signing_secret_is_made_once_with_mode_0600(tmp_path: Path) -> None:
    first = load_secret(tmp_path)
    f = tmp_path / SECRET_FILE
    assert len(first) == 32 and f.stat().st_mode & 0o777 == 0o600
    assert load_secret(tmp_path) == first  # reused, so URLs survive a restart
    f.chmod(0o644)
    assert load_secret(tmp_path) == first and f.stat().st_mode & 0o777 == 0o600  # tightened again
    other = tmp_path / "other"
    other.mkdir()
    assert load_secret(other) != first  # per data dir


def test_check_ttl_accepts_the_documented_range_only() -> None:
    assert check_ttl(None) is None and check_ttl(MIN_TTL_S) == MIN_TTL_S and check_ttl(MAX_TTL_S) == MAX_TTL_S
    for bad in (MIN_TTL_S - 1, MAX_TTL_S + 1, -5, 0):
        with pytest.raises(InvalidTTL, match="between 3600"):
            check_ttl(bad)
    for bad in (True, 3600.5, "3600"):
        with pytest.raises(InvalidTTL, match="integer"):
            check_ttl(bad)


def test_an_older_database_gains_the_ttl_and_published_columns(tmp_path: Path) -> None:
    db = sqlite3.connect(tmp_path / "server.sqlite3")
    db.execute(
        "CREATE TABLE checkpoints (tinker_path TEXT PRIMARY KEY, tenant TEXT NOT NULL, model_id TEXT NOT "
        "NULL, kind TEXT NOT NULL, name TEXT NOT NULL, created REAL NOT NULL, size_bytes INTEGER NOT NULL, "
        "meta TEXT NOT NULL)"
    )
    db.execute(
        "INSERT INTO checkpoints VALUES ('tinker://m/weights/a', 't', 'm', 'weights', 'a', 1, 2, '{}')"
    )
    db.commit()
    db.close()
    store = Store(tmp_path)
    try:
        [row] = store.checkpoints("t")[0]
        assert row.expires_at is None and row.public is False
        store.set_checkpoint_public(row.tinker_path, True)
        assert store.checkpoint(row.tinker_path).public  # type: ignore[union-attr]
    finally:
        store.close()


def test_reconcile_indexes_external_weights_and_forgets_deleted_ones(tmp_path: Path) -> None:
    ext = ExternalStore(tmp_path)
    ext.write("sess-1:train:0", "e", lambda d: (d / "adapter_config.json").write_text("{}"), {"tenant": "t"})
    (ext.root / "sess-1:train:0" / "external_weights" / ".half.tmp-0000").mkdir()  # a crash's leftover
    store = Store(tmp_path)
    try:
        assert reconcile(CheckpointStore(tmp_path), store, ext) == 1
        [row] = store.checkpoints("t")[0]
        assert (
            row.kind == "external_weights" and row.tinker_path == "tinker://sess-1:train:0/external_weights/e"
        )
        assert row.size_bytes == 2
        assert not list((ext.root / "sess-1:train:0" / "external_weights").glob(".*"))
        ext.delete("sess-1:train:0", "e")
        reconcile(CheckpointStore(tmp_path), store, ext)
        assert store.checkpoints("t")[0] == []
    finally:
        store.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    with local_server(
        tmp_path_factory, "weights-data", "--poll-timeout", "5", "--checkpoint-sweep", str(SWEEP_S)
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def sc_a(server: LocalServer) -> Iterator[tinker.ServiceClient]:
    sc = tinker.ServiceClient(base_url=server.base_url, api_key=KEY_A)
    yield sc
    sc.close("success").result()


@pytest.fixture(scope="module")
def sc_b(server: LocalServer) -> Iterator[tinker.ServiceClient]:
    sc = tinker.ServiceClient(base_url=server.base_url, api_key=KEY_B)
    yield sc
    sc.close("success").result()


@pytest.fixture(scope="module")
def trained(sc_a: tinker.ServiceClient) -> tinker.TrainingClient:
    """Tenant A's model, trained a few steps (so its LoRA B matrices are not zero). Not its
    unembedding: the tiny model ties it to the embedding, and the cookbook's ``build_lora_adapter``
    cannot write that for ``peft`` (its merge can:
    :func:`test_cookbook_merge_on_a_tied_model_with_the_sdks_default_lora_config`)."""
    tc = sc_a.create_lora_training_client(TEST_MODEL, rank=4, seed=1, train_unembed=False).result()
    for _ in range(3):
        tc.forward_backward([DATUM], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=3e-2)).result()
    return tc


def _rest(server: LocalServer, key: str) -> tinker.RestClient:
    return tinker.RestClient(base_url=server.base_url, api_key=key)


def _logprobs(tc: tinker.TrainingClient) -> np.ndarray:
    return tc.forward([DATUM], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()


def _peft_logprobs(folder: Path, base_path: str) -> np.ndarray:
    """External weights (Tinker's layout) through the cookbook's ``build_lora_adapter``, in ``peft``."""
    peft = pytest.importorskip("peft")
    weights = pytest.importorskip("tinker_cookbook.weights")
    converted = folder.with_name(folder.name + "-peft")
    weights.build_lora_adapter(base_model=base_path, adapter_path=str(folder), output_path=str(converted))
    return _model_logprobs(peft.PeftModel.from_pretrained(_load(base_path), str(converted)).eval())


def _load(path: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _model_logprobs(model: Any) -> np.ndarray:
    with torch.no_grad():
        logp = model(input_ids=torch.tensor([TOKENS[:-1]])).logits.log_softmax(-1)[0]
    return logp.gather(-1, torch.tensor(TOKENS[1:])[:, None])[:, 0].numpy()


def _base_path(tc: tinker.TrainingClient) -> str:
    return tc.get_info().model_data.tokenizer_id or ""  # the server answers its local model folder


def _get(url: str, key: str | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, headers={"X-API-Key": key} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _detail(body: bytes) -> str:
    return str(json.loads(body)["detail"])


def _no_path(message: str, server: LocalServer) -> None:
    assert str(server.data_dir) not in message and "/tmp/" not in message, message


def _set_expired(server: LocalServer, tinker_path: str) -> None:
    """What an hour passing does to a checkpoint with a TTL of an hour (the sweep then acts)."""
    db = sqlite3.connect(server.data_dir / "server.sqlite3", timeout=30)
    try:
        db.execute("UPDATE checkpoints SET expires_at=? WHERE tinker_path=?", (time.time() - 1, tinker_path))
        db.commit()
    finally:
        db.close()


def _folder(server: LocalServer, tinker_path: str) -> Path:
    model, kind, name = tinker_path.removeprefix("tinker://").split("/")
    return server.data_dir / "checkpoints" / model / kind / name


def _wait(cond, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


# ---------------------------------------------------------------------------- external weights
def test_external_weights_download_and_load_in_peft_with_the_servers_logprobs(
    server: LocalServer, sc_a: tinker.ServiceClient, trained: tinker.TrainingClient, tmp_path: Path
) -> None:
    path = trained.save_weights_external("final").result().path
    assert path == f"tinker://{trained.model_id}/external_weights/final"
    rc = _rest(server, KEY_A)
    listed = {c.tinker_path: c for c in rc.list_checkpoints(trained.model_id).result().checkpoints}
    assert listed[path].checkpoint_type == "external" and (listed[path].size_bytes or 0) > 0
    resp = rc.get_external_weights_urls(path).result()
    assert sorted(resp.urls) == ["adapter_config.json", "adapter_model.safetensors"]
    assert 3000 < (resp.expires.timestamp() - time.time()) <= 3600
    for name, url in resp.urls.items():
        assert url.startswith(server.base_url)
        status, body = _get(url)  # no API key: the signature is the credential
        assert status == 200
        (tmp_path / name).write_bytes(body)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == TEST_MODEL and config["r"] == 4
    assert_logprobs_close(_peft_logprobs(tmp_path, _base_path(trained)), _logprobs(trained))
    # the same name again is refused, and the model goes on (its seq_id was used, not lost)
    with pytest.raises(tinker.RequestFailedError, match="already exist"):
        trained.save_weights_external("final").result()
    assert len(_logprobs(trained)) == len(TOKENS) - 1


def test_signed_urls_changed_expired_or_of_another_tenant_are_refused(
    server: LocalServer,
    sc_a: tinker.ServiceClient,
    sc_b: tinker.ServiceClient,
    trained: tinker.TrainingClient,
) -> None:
    path = trained.save_weights_external("signed").result().path
    urls = _rest(server, KEY_A).get_external_weights_urls(path).result().urls
    url = urls["adapter_config.json"]
    parts = urllib.parse.urlsplit(url)
    query = dict(urllib.parse.parse_qsl(parts.query))

    def variant(path_: str | None = None, **changes: str) -> str:
        q = urllib.parse.urlencode({**query, **changes})
        return urllib.parse.urlunsplit(parts._replace(path=path_ or parts.path, query=q))

    flipped = query["sig"][:-1] + ("0" if query["sig"][-1] != "0" else "1")
    b_tenant = "dev-" + __import__("hashlib").sha256(KEY_B.encode()).hexdigest()[:16]
    cases = {
        "signature": variant(sig=flipped),
        "tenant": variant(tenant=b_tenant),
        "expiry pushed later": variant(expires=str(int(query["expires"]) + 3600)),
        "another file": variant(parts.path.replace("adapter_config.json", "adapter_model.safetensors")),
        "no signature": variant(sig=""),
    }
    for what, bad in cases.items():
        status, body = _get(bad)
        assert status == 403, what
        assert "invalid download URL signature" in _detail(body), what
        _no_path(_detail(body), server)
    # expired: a URL signed by this server's own secret, for a time already past
    signer = UrlSigner(server.data_dir)
    old = signer.sign(
        server.base_url, query["tenant"], path, "adapter_config.json", expires=int(time.time()) - 1
    )
    status, body = _get(old)
    assert status == 403 and "download URL expired" in _detail(body)
    # another tenant: B cannot get URLs for A's export, nor use A's URL with B's key
    with pytest.raises(tinker.NotFoundError):
        _rest(server, KEY_B).get_external_weights_urls(path).result()
    status, body = _get(url, KEY_B)
    assert status == 403 and "made for another tenant" in _detail(body)
    assert _get(url, KEY_A)[0] == 200 and _get(url)[0] == 200  # the real one still works
    # a sampler or training path has no download URLs (the SDK refuses it before sending)
    with pytest.raises(ValueError, match="only accepts external weights"):
        _rest(server, KEY_A).get_external_weights_urls(f"tinker://{trained.model_id}/weights/x")
    # deleted: its URLs are 404 from then on
    _rest(server, KEY_A).delete_checkpoint_from_tinker_path(path).result()
    assert _get(url)[0] == 404
    assert not _folder(server, path).exists()


def test_bad_age_recipient_is_refused_and_nothing_is_written(
    server: LocalServer, trained: tinker.TrainingClient
) -> None:
    with pytest.raises(tinker.RequestFailedError, match=r"age_encryption_recipients\[0\]"):
        trained.save_weights_external("enc", age_encryption_recipients=["age1notakey"]).result()
    assert not _folder(server, f"tinker://{trained.model_id}/external_weights/enc").exists()


def test_cookbook_weights_download_works_unmodified_on_both_path_kinds(
    server: LocalServer, trained: tinker.TrainingClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    weights = pytest.importorskip("tinker_cookbook.weights")
    monkeypatch.setenv("TINKER_API_KEY", KEY_A)
    expected = _logprobs(trained)
    ext = trained.save_weights_external("for-cookbook").result().path
    out = weights.download(tinker_path=ext, output_dir=str(tmp_path / "ext"), base_url=server.base_url)
    assert_logprobs_close(_peft_logprobs(Path(out), _base_path(trained)), expected)
    merged = tmp_path / "merged"
    weights.build_hf_model(base_model=_base_path(trained), adapter_path=out, output_path=str(merged))
    assert_logprobs_close(_model_logprobs(_load(str(merged))), expected)
    # a training checkpoint: loaded into a new run, exported encrypted to a one-off age key,
    # downloaded, decrypted, and the temporary export deleted
    state = trained.save_state("for-cookbook").result().path
    out = weights.download(tinker_path=state, output_dir=str(tmp_path / "state"), base_url=server.base_url)
    assert sorted(p.name for p in Path(out).iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    assert_logprobs_close(_peft_logprobs(Path(out), _base_path(trained)), expected)
    exports = [p for p in (server.data_dir / "checkpoints").glob("*/external_weights/download")]
    assert exports == []  # the cookbook deleted its temporary export


def test_cookbook_merge_on_a_tied_model_with_the_sdks_default_lora_config(
    server: LocalServer, sc_a: tinker.ServiceClient, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The SDK's default ``LoraConfig`` trains the unembedding, which the tiny model ties to its
    embedding: the cookbook merges it into the shared matrix, and the server computes the same."""
    weights = pytest.importorskip("tinker_cookbook.weights")
    monkeypatch.setenv("TINKER_API_KEY", KEY_A)
    tc = sc_a.create_lora_training_client(TEST_MODEL, rank=4, seed=2).result()
    for _ in range(2):
        tc.forward_backward([DATUM], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=3e-2)).result()
    sampler = tc.save_weights_and_get_sampling_client("tied")
    served = sampler.compute_logprobs(types.ModelInput.from_ints(TOKENS)).result()[1:]
    ext = tc.save_weights_external("tied").result().path
    out = weights.download(tinker_path=ext, output_dir=str(tmp_path / "ext"), base_url=server.base_url)
    merged = tmp_path / "merged"
    weights.build_hf_model(base_model=_base_path(tc), adapter_path=out, output_path=str(merged))
    model = _load(str(merged))
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    got = _model_logprobs(model)
    np.testing.assert_allclose(got, np.array(served, dtype=np.float64), atol=1e-3)
    base = _model_logprobs(_load(_base_path(tc)))
    assert np.abs(got - base).max() > 1e-2  # training moved it: the comparison is not of two bases


# ---------------------------------------------------------------------------- TTL
def test_ttl_out_of_range_is_refused_with_nothing_changed(
    server: LocalServer, sc_a: tinker.ServiceClient, trained: tinker.TrainingClient
) -> None:
    rc = _rest(server, KEY_A)
    before = [c.tinker_path for c in rc.list_checkpoints(trained.model_id).result().checkpoints]
    for ttl in (0, 59, 3599, 10**10):
        with pytest.raises(tinker.RequestFailedError, match="ttl_seconds must be between 3600"):
            trained.save_state(f"ttl-{ttl}", ttl_seconds=ttl).result()
        with pytest.raises(tinker.RequestFailedError, match="ttl_seconds must be between 3600"):
            trained.save_weights_for_sampler(f"ttl-{ttl}", ttl_seconds=ttl).result()
    assert [c.tinker_path for c in rc.list_checkpoints(trained.model_id).result().checkpoints] == before
    assert not list((server.data_dir / "checkpoints" / trained.model_id).glob("*/ttl-*"))
    path = trained.save_state("ttl-ok", ttl_seconds=7200).result().path
    [row] = [c for c in rc.list_checkpoints(trained.model_id).result().checkpoints if c.tinker_path == path]
    assert row.expires_at is not None and 7100 < row.expires_at.timestamp() - time.time() <= 7200
    with pytest.raises(tinker.BadRequestError, match="ttl_seconds must be between 3600") as info:
        rc.set_checkpoint_ttl_from_tinker_path(path, 10).result()
    _no_path(str(info.value), server)
    [again] = [c for c in rc.list_checkpoints(trained.model_id).result().checkpoints if c.tinker_path == path]
    assert again.expires_at == row.expires_at  # unchanged
    rc.set_checkpoint_ttl_from_tinker_path(path, None).result()  # None removes the TTL
    [gone] = [c for c in rc.list_checkpoints(trained.model_id).result().checkpoints if c.tinker_path == path]
    assert gone.expires_at is None


def test_expired_checkpoint_leaves_listings_then_disk_but_not_from_under_a_live_sampler(
    server: LocalServer, sc_a: tinker.ServiceClient, trained: tinker.TrainingClient
) -> None:
    rc = _rest(server, KEY_A)
    plain = trained.save_weights_for_sampler("expiring", ttl_seconds=3600).result().path
    used = trained.save_weights_for_sampler("expiring-used", ttl_seconds=3600).result().path
    # a live sampler over `used`, in a session of its own
    other = tinker.ServiceClient(base_url=server.base_url, api_key=KEY_A)
    sampler = other.create_sampling_client(model_path=used).result()
    params = types.SamplingParams(max_tokens=4, temperature=0.0, seed=0)
    prompt = types.ModelInput.from_ints(TOKENS[:6])
    first = sampler.sample(prompt, 1, params).result().sequences[0].tokens
    for p in (plain, used):
        _set_expired(server, p)
    listed = {c.tinker_path for c in rc.list_user_checkpoints(limit=1000).result().checkpoints}
    assert plain not in listed and used not in listed  # gone from listings at once
    _wait(lambda: not _folder(server, plain).exists(), "the sweep to delete the expired checkpoint")
    time.sleep(4 * SWEEP_S)
    assert _folder(server, used).exists()  # kept: a live sampler was made from it
    assert sampler.sample(prompt, 1, params).result().sequences[0].tokens == first
    with pytest.raises(tinker.NotFoundError):  # but nothing new can load it
        sc_a.create_sampling_client(model_path=used).result().sample(prompt, 1, params).result()
    other.close("success").result()  # the sampler's session ends: the next sweep deletes it
    _wait(lambda: not _folder(server, used).exists(), "the sweep after the sampler's session ended")


# ---------------------------------------------------------------------------- publishing
def test_published_checkpoint_is_readable_by_other_tenants_read_only_until_unpublished(
    server: LocalServer,
    sc_a: tinker.ServiceClient,
    sc_b: tinker.ServiceClient,
    trained: tinker.TrainingClient,
) -> None:
    rc_a, rc_b = _rest(server, KEY_A), _rest(server, KEY_B)
    sampler_path = trained.save_weights_for_sampler("shared").result().path
    state_path = trained.save_state("shared").result().path
    params = types.SamplingParams(max_tokens=5, temperature=0.0, seed=0)
    prompt = types.ModelInput.from_ints(TOKENS[:6])
    want = sc_a.create_sampling_client(model_path=sampler_path).result().sample(prompt, 1, params).result()
    with pytest.raises(tinker.NotFoundError):  # private: B does not see it
        rc_b.get_weights_info_by_tinker_path(sampler_path).result()
    for p in (sampler_path, state_path):
        rc_a.publish_checkpoint_from_tinker_path(p).result()
    with pytest.raises(tinker.BadRequestError, match="already public"):
        rc_a.publish_checkpoint_from_tinker_path(sampler_path).result()
    listed = {c.tinker_path: c for c in rc_a.list_checkpoints(trained.model_id).result().checkpoints}
    assert listed[sampler_path].public and listed[state_path].public
    # B may read it: weights info, sample from it, train from its state
    assert rc_b.get_weights_info_by_tinker_path(sampler_path).result().lora_rank == 4
    sampler_b = sc_b.create_sampling_client(model_path=sampler_path).result()
    got = sampler_b.sample(prompt, 1, params).result()
    assert got.sequences[0].tokens == want.sequences[0].tokens
    tc_b = sc_b.create_training_client_from_state(state_path).result()
    assert_logprobs_close(_logprobs(tc_b), _logprobs(trained))
    # ... read-only: not delete it, change its TTL, (un)publish it; and it is not in B's listings
    with pytest.raises(tinker.NotFoundError):
        rc_b.delete_checkpoint_from_tinker_path(sampler_path).result()
    with pytest.raises(tinker.NotFoundError):
        rc_b.set_checkpoint_ttl_from_tinker_path(sampler_path, 7200).result()
    with pytest.raises(tinker.NotFoundError):
        rc_b.unpublish_checkpoint_from_tinker_path(sampler_path).result()
    assert sampler_path not in {c.tinker_path for c in rc_b.list_user_checkpoints().result().checkpoints}
    assert _folder(server, sampler_path).exists()
    # B's own checkpoints stay B's: saving from the model trained off A's state is B's
    own = tc_b.save_state("mine").result().path
    assert own.startswith(f"tinker://{tc_b.model_id}/")
    with pytest.raises(tinker.NotFoundError):
        rc_a.get_weights_info_by_tinker_path(own).result()
    # unpublished: 404 for B again, B's sampler over it included
    rc_a.unpublish_checkpoint_from_tinker_path(sampler_path).result()
    with pytest.raises(tinker.BadRequestError, match="already private"):
        rc_a.unpublish_checkpoint_from_tinker_path(sampler_path).result()
    with pytest.raises(tinker.NotFoundError):
        rc_b.get_weights_info_by_tinker_path(sampler_path).result()
    with pytest.raises(tinker.NotFoundError):
        sampler_b.sample(prompt, 1, params).result()
    with pytest.raises(tinker.NotFoundError):
        sc_b.create_sampling_client(model_path=sampler_path).result().sample(prompt, 1, params).result()
    # A still samples it
    assert sc_a.create_sampling_client(model_path=sampler_path).result().sample(prompt, 1, params).result()
