"""Input hardening: each bad input below is sent the way a user would send it — through the
embedded client, and through the UNMODIFIED ``tinker`` SDK (or raw HTTP where the SDK cannot
produce it) against ``opentinker serve`` — and must get a clear ``user`` error naming the problem,
with no server filesystem path in the message, and leave everything stored as it was.

Covered: checkpoint names (length, control characters, full-string match), float
``target_tokens``, truncated zstd bodies, ``seq_id``s far ahead, AdamParams that cannot work and
steps that would make weights non-finite, key revocation, ``--dev`` keys, and the leftovers of
checkpoint writes a crash interrupted. Unit tests first, then one server (``--dev``, the test
model) for the module; the restart test runs last.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tinker
import torch
import zstandard
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from opentinker.client import Runtime, ServiceClient
from opentinker.engine import AdamParams, Engine, EngineError, ForwardRequest
from opentinker.engine.checkpoint import clean_partial_writes, read_checkpoint, write_checkpoint
from opentinker.engine.optim import AdapterOptimizer, _proven_bounds, step_many
from opentinker.lora import LoRAConfig
from opentinker.server.auth import Authenticator, keys_main
from opentinker.server.errors import BadRequest, Redactor, Unauthorized
from opentinker.server.local import LocalServer
from opentinker.server.ordering import MAX_AHEAD, Sequencer
from opentinker.server.store import Store
from opentinker.server.wire import decompress
from opentinker.service.checkpoints import MAX_ID_CHARS, check_name, parse_tinker_path
from tests.conftest import TEST_MODEL, local_server, make_examples

DEV_KEY = "tml-hardening-dev-key"
GAP_TIMEOUT_S = 1.0
BAD_NAMES = [
    ("x" * 300, "300 characters long"),
    ("x" * (MAX_ID_CHARS + 1), f"the limit is {MAX_ID_CHARS}"),
    ("ok\n", "control character"),  # ^…$ with re.match let this one through
    ("a\tb", "control character"),
    ("a\x00b", "control character"),
    ("../escape", "invalid checkpoint name"),
    ("a/b", "invalid checkpoint name"),
    ("", "empty"),
]


def _tree(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` with its bytes (what must not change)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _datum(toks: list[int], **inputs: Any) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(toks[:-1]),
        loss_fn_inputs={"target_tokens": toks[1:], **inputs},  # type: ignore[dict-item]  # lists: the SDK converts
    )


TOKENS = [int(t) for t in np.random.default_rng(0).integers(3, 1000, 16)]


# ---------------------------------------------------------------------------- unit: names
@pytest.mark.parametrize(("name", "message"), BAD_NAMES)
def test_check_name_refuses_by_name(name: str, message: str) -> None:
    with pytest.raises(EngineError, match=message):
        check_name(name)


def test_tinker_paths_are_matched_whole() -> None:
    good = "tinker://sess-1:train:0/weights/step-3"
    assert parse_tinker_path(good).name == "step-3"
    for bad in (
        good + "\n",
        good + "/x",
        "tinker://sess-1:train:0/weights/" + "n" * 300,
        "tinker://../weights/a",
    ):
        with pytest.raises(EngineError, match="malformed checkpoint path"):
            parse_tinker_path(bad)


def test_embedded_save_with_a_bad_name_changes_nothing(tmp_path: Path) -> None:
    runtime = Runtime(tmp_path)
    try:
        tc = ServiceClient(runtime=runtime).create_lora_training_client(TEST_MODEL, rank=2, seed=0)
        tc.save_state("kept").result()
        before = _tree(tmp_path / "checkpoints")
        for name, message in BAD_NAMES:
            for save in (tc.save_state, tc.save_weights_for_sampler):
                with pytest.raises(EngineError, match=message):
                    save(name).result()
            assert _tree(tmp_path / "checkpoints") == before
        listed = runtime.store.list()
        assert [r.ref.name for r in listed] == ["kept"]
        tc.save_state("after").result()  # the model still saves
    finally:
        runtime.shutdown()


# ---------------------------------------------------------------------------- unit: redaction
def test_redactor_removes_every_server_path(tmp_path: Path) -> None:
    data = tmp_path / "data"
    redact = Redactor([data])
    ckpt = data / "checkpoints" / "sess-1:train:0" / "weights" / "n"
    cases = {
        f"[Errno 36] File name too long: '{ckpt.parent}/.n.tmp-1-x'": "tinker://sess-1:train:0/weights/.n.tmp-1-x",
        f"checkpoint file {ckpt}/adapter.safetensors does not match": "tinker://sess-1:train:0/weights/n (file adapter.safetensors)",
        f"database {data}/server.sqlite3 is locked": "<data-dir>/server.sqlite3",
        "cannot read /usr/lib/python3/x.py: no": "<server path>: no",
        "see ~/.cache/opentinker/models/x": "<server path>",
    }
    for text, shown in cases.items():
        out = redact(text)
        assert shown in out and str(tmp_path) not in out and "/usr/lib" not in out, out
    for kept in (  # no path in these: left as they are
        "expected tinker://<model_id>/weights/<name>",
        "http://127.0.0.1:8000/api/v1/healthz",
        "base model HuggingFaceTB/SmolLM2-135M-Instruct is not served",
    ):
        assert redact(kept) == kept


# ---------------------------------------------------------------------------- unit: target dtype
def test_float_target_tokens_are_refused(tmp_path: Path) -> None:
    runtime = Runtime(tmp_path)
    try:
        tc = ServiceClient(runtime=runtime).create_lora_training_client(TEST_MODEL, rank=2, seed=0)
        good = _datum(TOKENS)
        before = tc.forward([good]).result().loss_fn_outputs[0]["logprobs"].to_numpy()
        targets = np.asarray(TOKENS[1:], dtype=np.float32) + 0.5  # 6.5 must not train as token 6
        bad = _datum(TOKENS)
        bad = types.Datum(
            model_input=bad.model_input,
            loss_fn_inputs={"target_tokens": types.TensorData.from_numpy(targets)},
        )
        for op in (tc.forward, tc.forward_backward):
            with pytest.raises(
                EngineError, match="datum 1: target_tokens must be integer token ids, got float32"
            ):
                op([good, bad]).result()
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()  # no gradient was kept
        after = tc.forward([good]).result().loss_fn_outputs[0]["logprobs"].to_numpy()
        np.testing.assert_array_equal(before, after)
    finally:
        runtime.shutdown()


def test_engine_refuses_non_integer_targets(engine: Engine) -> None:
    aid = engine.create_adapter(LoRAConfig(rank=2, seed=0))
    [ex] = make_examples(1, engine.vocab_size, seed=0)
    for dtype in (torch.float32, torch.bool):
        bad = type(ex)(ex.tokens_T, {**ex.inputs, "target_tokens": ex.inputs["target_tokens"].to(dtype)})
        with pytest.raises(EngineError, match="must be integer token ids"):
            engine.forward_backward(ForwardRequest(aid, [bad]))
    assert engine.pending_gradients(aid) is None


# ---------------------------------------------------------------------------- unit: zstd
def test_truncated_zstd_is_refused_at_every_cut() -> None:
    body = os.urandom(20_000) + bytes(range(256)) * 400  # raw and compressed blocks
    for compressor in (zstandard.ZstdCompressor(), zstandard.ZstdCompressor(write_checksum=True)):
        packed = compressor.compress(body)
        assert decompress(packed, "zstd", 1 << 20) == body
        assert decompress(packed + packed, "zstd", 1 << 20) == body + body
        for cut in range(1, len(packed)):
            with pytest.raises(BadRequest, match="zstd"):
                decompress(packed[:cut], "zstd", 1 << 20)
        with pytest.raises(BadRequest, match="trailing"):
            decompress(packed + b"\x00\x01", "zstd", 1 << 20)


# ---------------------------------------------------------------------------- unit: seq window
def test_seq_id_far_ahead_is_refused_and_the_model_goes_on() -> None:
    from concurrent.futures import Future

    seq, ran = Sequencer(), []
    for far in (2**31 - 1, 1 + MAX_AHEAD):
        with pytest.raises(BadRequest, match=f"seq_id {far} of model m is too far ahead"):
            seq.submit("m", far, "d", "r", Future(), lambda: ran.append("far"))
    seq.submit("m", MAX_AHEAD, "d", "r", Future(), lambda: ran.append(MAX_AHEAD))  # in the window: held
    assert seq.skip_gaps(gap_timeout_s=-1) == 1 and ran == []  # it waited in vain: failed, unrun
    seq.submit("m", MAX_AHEAD + 1, "d", "r", Future(), lambda: ran.append(MAX_AHEAD + 1))
    assert ran == [MAX_AHEAD + 1] and "far" not in ran


# ---------------------------------------------------------------------------- unit: optimizer
def _state(engine: Engine, aid: str) -> dict[str, torch.Tensor]:
    st = {f"w.{k}": v.detach().clone() for k, v in engine.adapter_weights(aid).state_dict().items()}
    st.update({f"o.{k}": v.clone() for k, v in engine.optimizer_state(aid).items()})
    st.update({f"g.{k}": v.clone() for k, v in (engine.pending_gradients(aid) or {}).items()})
    return st


def _bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (AdamParams(eps=0.0), "eps=0.0 is out of range"),
        (AdamParams(eps=-1e-8), "eps"),
        (AdamParams(learning_rate=-1.0), "learning_rate"),
        (AdamParams(learning_rate=float("inf")), "learning_rate"),
        (AdamParams(beta2=float("nan")), "beta2"),
        (AdamParams(weight_decay=-0.1), "weight_decay"),
        # valid on their face, but the step overflows fp32: refused after the fact, undone
        # beyond fp32's range: the fused kernel writes inf (or torch refuses the scalar): undone
        (AdamParams(learning_rate=1e39), "overflows fp32|NaN or inf"),
        (AdamParams(learning_rate=3e37), "would make the adapter's weights .* NaN or inf"),
        (AdamParams(learning_rate=1e38, weight_decay=1e3), "overflows|NaN or inf"),
    ],
)
def test_optim_step_that_cannot_work_changes_nothing_bitwise(
    engine: Engine, params: AdamParams, message: str
) -> None:
    """A refused step leaves weights, moments and pending gradients bitwise as they were, and
    the adapter then trains exactly like a twin that never saw the bad step."""
    a, twin = (engine.create_adapter(LoRAConfig(rank=4, seed=0)) for _ in range(2))
    for aid in (a, twin):
        engine.forward_backward(ForwardRequest(aid, make_examples(2, engine.vocab_size, seed=1)))
        engine.optim_step(aid, AdamParams(learning_rate=1e-2))
        engine.forward_backward(ForwardRequest(aid, make_examples(2, engine.vocab_size, seed=2)))
    before = _state(engine, a)
    assert _bitwise_equal(before, _state(engine, twin))
    with pytest.raises(EngineError, match=message):
        engine.optim_step(a, params)
    assert _bitwise_equal(_state(engine, a), before)
    assert engine.adapter_step(a) == engine.adapter_step(twin) == 1
    for aid in (a, twin):
        engine.optim_step(aid, AdamParams(learning_rate=1e-2))
    assert _bitwise_equal(_state(engine, a), _state(engine, twin))


def test_step_overflowing_the_moments_is_refused(engine: Engine) -> None:
    """Finite but huge loss weights: the gradients (~1e20) are finite, their squares are not."""
    aid = engine.create_adapter(LoRAConfig(rank=2, seed=0))
    [ex] = make_examples(1, engine.vocab_size, seed=0)
    huge = type(ex)(ex.tokens_T, {**ex.inputs, "weights": torch.full_like(ex.inputs["weights"], 1e19)})
    engine.forward_backward(ForwardRequest(aid, [huge]))
    before = _state(engine, aid)
    with pytest.raises(EngineError, match="optimizer moments of .* NaN or inf"):
        engine.optim_step(aid, AdamParams(learning_rate=1e-2))
    assert _bitwise_equal(_state(engine, aid), before) and engine.adapter_step(aid) == 0


def test_first_step_refused_leaves_no_optimizer_state(engine: Engine) -> None:
    aid = engine.create_adapter(LoRAConfig(rank=2, seed=0))
    engine.forward_backward(ForwardRequest(aid, make_examples(1, engine.vocab_size, seed=0)))
    before = _state(engine, aid)
    with pytest.raises(EngineError, match="it was not applied"):
        engine.optim_step(aid, AdamParams(learning_rate=1e39))
    assert engine.optimizer_state(aid) == {} and _bitwise_equal(_state(engine, aid), before)


def _twin_optimizers(engine: Engine) -> tuple[AdapterOptimizer, AdapterOptimizer, torch.Tensor]:
    """Two optimizers on bitwise-equal copies of a trained adapter, and a real gradient of it."""
    aid = engine.create_adapter(LoRAConfig(rank=4, seed=3))
    engine.forward_backward(ForwardRequest(aid, make_examples(2, engine.vocab_size, seed=4)))
    engine.optim_step(aid, AdamParams(learning_rate=1e-2))  # B no longer 0: every gradient non-zero
    engine.forward_backward(ForwardRequest(aid, make_examples(2, engine.vocab_size, seed=5)))
    grads = engine.pending_gradients(aid)
    assert grads is not None
    weights = engine.adapter_weights(aid)
    one, two = AdapterOptimizer(weights.clone()), AdapterOptimizer(weights.clone())
    return one, two, one.flat_grads(grads)


def _opt_state(opt: AdapterOptimizer) -> dict[str, torch.Tensor]:
    return {"flat": opt.flat.detach().clone(), **{k: v.clone() for k, v in opt.state_tensors().items()}}


def test_a_step_proven_finite_skips_the_undo_copy_and_is_bitwise_the_undoable_step(engine: Engine) -> None:
    """A step whose bounds prove it finite runs without the scratch copy (and the look for
    non-finite values after it): weights, moments and metrics bitwise those of the same step
    made undoable, fresh and stepped moments, clipping, weight decay; the bounds it keeps hold."""
    proven, undoable, grad = _twin_optimizers(engine)
    hps = [
        AdamParams(learning_rate=1e-2),
        AdamParams(learning_rate=3e-3, weight_decay=0.1, beta1=0.8),
        AdamParams(learning_rate=1e-2, grad_clip_norm=1e-3, eps=1e-6),
        AdamParams(learning_rate=5e-4, beta2=0.99),
    ]
    for k, hp in enumerate(hps):
        g = grad * (k - 1.5)
        assert step_many([(proven, g, hp)]) == step_many([(undoable, g, hp)], prove=False)
        assert proven.bounds is not None and undoable.bounds is None  # which way each went
        assert _bitwise_equal(_opt_state(proven), _opt_state(undoable))
        avg, sq = proven.state["exp_avg"], proven.state["exp_avg_sq"]
        assert float(proven.flat.abs().max()) <= proven.bounds.weights
        assert float(avg.abs().max()) <= proven.bounds.exp_avg and float(sq.max()) <= proven.bounds.exp_avg_sq


def test_a_step_its_bounds_cannot_clear_is_undone_bitwise_if_it_overflows(engine: Engine) -> None:
    """Where the bounds cannot prove a step finite it is made undoable: undone bitwise when it
    overflows (a learning rate past fp32, negative second moments loaded from a checkpoint, a
    weight written past the bounds after they were taken), applied bitwise as the undoable step
    when it does not (an eps too small for the bound)."""
    opt, twin, grad = _twin_optimizers(engine)
    for o in (opt, twin):
        step_many([(o, grad, AdamParams(learning_rate=1e-2))])
    assert opt.bounds is not None
    before = _opt_state(opt)
    huge = AdamParams(learning_rate=3e37)
    assert _proven_bounds(opt, huge, 2.0, 1.0) is None
    [out] = step_many([(opt, grad, huge)])
    assert isinstance(out, EngineError) and _bitwise_equal(_opt_state(opt), before)
    # finite, but too small an eps for the bound: run undoable, and applied
    tiny_eps = AdamParams(learning_rate=1e-2, eps=1e-44)
    assert step_many([(opt, grad, tiny_eps)]) == step_many([(twin, grad, tiny_eps)], prove=False)
    assert opt.bounds is None and _bitwise_equal(_opt_state(opt), _opt_state(twin))
    # a weight written after the bounds were taken: they are taken again, and it is seen
    step_many([(opt, grad, AdamParams(learning_rate=1e-2))])
    assert opt.bounds is not None
    with torch.no_grad():
        opt.flat[0] = 3e38
    assert _proven_bounds(opt, AdamParams(learning_rate=1e-2), 4.0, 1.0) is None
    assert opt.bounds.weights == float(opt.flat[0])
    # negative second moments (loaded as they were saved): sqrt gives NaN, refused, unchanged
    tensors = opt.state_tensors()
    name = next(k for k in tensors if k.endswith(".exp_avg_sq"))
    opt.load_state_tensors({**tensors, name: -tensors[name].abs() - 1.0})
    before = _opt_state(opt)
    [out] = step_many([(opt, grad, AdamParams(learning_rate=1e-2))])
    assert isinstance(out, EngineError) and "NaN or inf" in str(out)
    assert _bitwise_equal(_opt_state(opt), before)


# ---------------------------------------------------------------------------- unit: keys
def test_dev_mode_accepts_what_the_sdk_accepts(tmp_path: Path) -> None:
    store = Store(tmp_path)
    try:
        dev = Authenticator(store, dev=True)
        tenants = {dev.tenant(k) for k in ("tml-dummy", "tml-", "tml-a", "tml-x.y~z!")}
        assert len(tenants) == 4 and all(t.startswith("dev-") for t in tenants)
        assert dev.tenant("tml-dummy") == dev.tenant("tml-dummy")
        for bad in (None, "", "dummy", "sk-123", "tml-a b", "tml-\n", "tml-" + "x" * 600):
            with pytest.raises(Unauthorized):
                dev.tenant(bad)
        with pytest.raises(Unauthorized, match="invalid or revoked"):
            Authenticator(store, dev=False).tenant("tml-dummy")
    finally:
        store.close()


def test_a_revoked_key_is_refused_at_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert keys_main(["create", "--tenant", "acme", "--data-dir", str(tmp_path)]) == 0
    key = capsys.readouterr().out.strip()
    store = Store(tmp_path)
    try:
        auth = Authenticator(store, dev=True)  # dev mode: a revoked key must not become a dev tenant
        assert auth.tenant(key) == "acme"
        assert keys_main(["list", "--data-dir", str(tmp_path)]) == 0
        prefix = capsys.readouterr().out.split()[0]
        assert keys_main(["revoke", prefix, "--data-dir", str(tmp_path)]) == 0  # another connection
        with pytest.raises(Unauthorized, match="revoked"):
            auth.tenant(key)  # the same authenticator, right after
    finally:
        store.close()


# ---------------------------------------------------------------------------- unit: crash leftovers
def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_leftovers_of_interrupted_writes_are_cleaned(tmp_path: Path) -> None:
    files = {"adapter.safetensors": {"w": torch.arange(6.0)}}
    kind = tmp_path / "m" / "weights"
    write_checkpoint(kind / "real", files, {"step": 1})
    real = _tree(kind / "real")
    dead = _dead_pid()
    for name in (f".real.tmp-{dead}-abc", ".real.tmp-x1y2z3ab", f".gone.old-{dead}"):
        (kind / name).mkdir()
        (kind / name / "adapter.safetensors").write_bytes(b"torn")
    # a crash between the two renames of an overwrite: the old one aside, the new one complete
    write_checkpoint(kind / "mid", files, {"step": 2})
    os.replace(kind / "mid", kind / f".mid.tmp-{dead}-q")
    write_checkpoint(kind / "mid-old", files, {"step": 1})
    os.replace(kind / "mid-old", kind / f".mid.old-{dead}")
    # a writer that is still running (this process): its folder stays
    (kind / f".busy.tmp-{os.getpid()}-w").mkdir()
    assert clean_partial_writes(kind) == ["mid"]
    assert sorted(p.name for p in kind.iterdir()) == [f".busy.tmp-{os.getpid()}-w", "mid", "real"]
    assert _tree(kind / "real") == real
    assert read_checkpoint(kind / "mid")[1] == {"step": 2}  # the new one, checksums verified


# ---------------------------------------------------------------------------- through the server
@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    with local_server(
        tmp_path_factory, "hardening-data", "--poll-timeout", "5", "--gap-timeout", str(GAP_TIMEOUT_S)
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def service(server: LocalServer) -> Iterator[tinker.ServiceClient]:
    sc = tinker.ServiceClient(base_url=server.base_url, api_key=DEV_KEY)
    yield sc
    sc.close("success").result()


def _logprobs(tc: tinker.TrainingClient) -> np.ndarray:
    return tc.forward([_datum(TOKENS)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()


def _no_path(message: str, server: LocalServer) -> None:
    assert str(server.data_dir) not in message and str(server.data_dir.resolve()) not in message
    assert "/tmp/" not in message and "/root/" not in message, message


def _user_error(make: Any, message: str, server: LocalServer) -> tinker.RequestFailedError:
    with pytest.raises(tinker.RequestFailedError, match=message) as info:
        make()
    assert info.value.category == types.RequestErrorCategory.User
    _no_path(str(info.value), server)
    return info.value


def test_server_refuses_bad_checkpoint_names_as_user_errors(
    server: LocalServer, service: tinker.ServiceClient
) -> None:
    tc = service.create_lora_training_client(base_model=TEST_MODEL, rank=2, seed=1).result()
    kept = tc.save_state("kept").result().path
    rest = tinker.RestClient(base_url=server.base_url, api_key=DEV_KEY)
    listed = {c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints}
    files = _tree(server.data_dir / "checkpoints")
    for name, message in BAD_NAMES:
        for save in (tc.save_state, tc.save_weights_for_sampler):
            _user_error(lambda: save(name).result(), message, server)  # noqa: B023
    assert _tree(server.data_dir / "checkpoints") == files  # no orphan folder, nothing rewritten
    assert {c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints} == listed
    assert kept in listed
    with httpx.Client(base_url=f"{server.base_url}/api/v1", headers={"X-API-Key": DEV_KEY}) as http:
        assert http.post("/weights_info", json={"tinker_path": kept + "\n"}).status_code == 404
        sid = http.post("/create_session", json={}).json()["session_id"]
        load = {"path": kept + "\n", "session_id": sid, "model_seq_id": 0}
        r = http.post("/load_weights", json=load)
        assert r.status_code == 404 and "control character" in r.json()["detail"]
        r = http.post("/create_model", json={"session_id": "s", "model_seq_id": 10**30, "base_model": "x"})
        assert r.status_code == 422
    assert tc.save_weights_for_sampler("after").result().path.endswith("/after")  # still works


def test_no_error_message_shows_a_server_path(server: LocalServer, service: tinker.ServiceClient) -> None:
    """A checkpoint torn on disk: the engine's error names its file; the client sees the
    checkpoint's tinker path instead of where the server keeps it."""
    tc = service.create_lora_training_client(base_model=TEST_MODEL, rank=2, seed=2).result()
    path = tc.save_state("torn").result().path
    ref = parse_tinker_path(path)
    target = server.data_dir / "checkpoints" / ref.model_id / ref.kind / ref.name / "adapter.safetensors"
    raw = bytearray(target.read_bytes())
    raw[-1] ^= 0xFF  # one flipped byte in the weights
    target.write_bytes(bytes(raw))
    err = _user_error(
        lambda: service.create_training_client_from_state(path).result(),
        "does not match its checksum",
        server,
    )
    assert f"{path} (file adapter.safetensors)" in str(err)
    # a sampler over it: refused when the session is made (a 4xx naming the problem)
    with pytest.raises(tinker.APIStatusError, match="does not match its checksum") as refused:
        service.create_sampling_client(model_path=path).result()
    assert 400 <= refused.value.status_code < 500 and f"{path} (file adapter.safetensors)" in str(
        refused.value
    )
    _no_path(str(refused.value), server)


def test_server_refuses_float_target_tokens(server: LocalServer, service: tinker.ServiceClient) -> None:
    tc = service.create_lora_training_client(base_model=TEST_MODEL, rank=2, seed=3).result()
    before = _logprobs(tc)
    targets = types.TensorData.from_numpy(np.asarray(TOKENS[1:], dtype=np.float32) + 0.5)
    bad = types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS[:-1]), loss_fn_inputs={"target_tokens": targets}
    )
    _user_error(lambda: tc.forward_backward([bad], "cross_entropy").result(), "integer token ids", server)
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()  # no gradient was kept from it
    np.testing.assert_array_equal(_logprobs(tc), before)


def _fb_body(model_id: str, seq_id: int) -> bytes:
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[_datum(TOKENS)] * 8, loss_fn="cross_entropy"),
        model_id=model_id,
        seq_id=seq_id,
    )
    return forward_backward_request_to_proto(req).SerializeToString()


def _http(server: LocalServer) -> httpx.Client:
    return httpx.Client(base_url=f"{server.base_url}/api/v1", headers={"X-API-Key": DEV_KEY}, timeout=60)


def _raw_model(http: httpx.Client) -> str:
    sid = http.post("/create_session", json={}).json()["session_id"]
    body = {"session_id": sid, "model_seq_id": 0, "base_model": TEST_MODEL, "lora_config": {"rank": 2}}
    rid = http.post("/create_model", json=body).json()["request_id"]
    for _ in range(100):
        r = http.post("/retrieve_future", json={"request_id": rid}).json()
        if r.get("type") != "try_again":
            return r["model_id"]
    raise AssertionError("no model")


def _wait(http: httpx.Client, rid: str) -> httpx.Response:
    for _ in range(100):
        r = http.post("/retrieve_future", json={"request_id": rid})
        if (
            not r.headers["content-type"].startswith("application/json")
            or r.json().get("type") != "try_again"
        ):
            return r
    raise AssertionError("no result")


PROTO = {"Content-Type": "application/x-protobuf"}


def test_server_refuses_a_truncated_zstd_body(server: LocalServer) -> None:
    with _http(server) as http:
        model_id = _raw_model(http)
        packed = zstandard.ZstdCompressor().compress(_fb_body(model_id, 1))  # as the SDK packs it
        zstd = {**PROTO, "Content-Encoding": "zstd"}
        for cut in (len(packed) * 4 // 7, len(packed) - 1):
            r = http.post("/forward_backward", content=packed[:cut], headers=zstd)
            assert r.status_code == 400 and "truncated" in r.json()["detail"], r.text
        r = http.post("/forward_backward", content=packed, headers=zstd)  # seq 1 was never taken
        assert r.status_code == 200 and _wait(http, r.json()["request_id"]).headers["content-type"].endswith(
            "protobuf"
        )


def test_server_refuses_a_seq_id_far_ahead_and_the_model_goes_on(
    server: LocalServer, service: tinker.ServiceClient
) -> None:
    tc = service.create_lora_training_client(base_model=TEST_MODEL, rank=2, seed=4).result()
    tc.forward_backward([_datum(TOKENS)], "cross_entropy").result()
    with _http(server) as http:
        for far in (2**31 - 1, 2 + MAX_AHEAD + 5):
            r = http.post("/forward_backward", content=_fb_body(tc.model_id, far), headers=PROTO)
            assert r.status_code == 400 and "too far ahead" in r.json()["detail"]
            _no_path(r.json()["detail"], server)
    time.sleep(GAP_TIMEOUT_S * 2.5)  # had it been held, the gap timeout would have run it by now
    for _ in range(2):  # the SDK's own next seq_ids still run
        assert np.isfinite(
            tc.forward_backward([_datum(TOKENS)], "cross_entropy").result().metrics["loss:sum"]
        )
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()


def test_server_refuses_optimizer_steps_that_cannot_work(
    server: LocalServer, service: tinker.ServiceClient
) -> None:
    tc = service.create_lora_training_client(base_model=TEST_MODEL, rank=2, seed=5).result()
    tc.forward_backward([_datum(TOKENS)], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    before = _logprobs(tc)
    for params, message in (
        (types.AdamParams(learning_rate=1e-2, eps=0.0), "eps"),
        (types.AdamParams(learning_rate=1e39), "overflows fp32|NaN or inf"),
        (types.AdamParams(learning_rate=3e37), "NaN or inf"),
    ):
        tc.forward_backward([_datum(TOKENS)], "cross_entropy").result()
        _user_error(lambda: tc.optim_step(params).result(), message, server)  # noqa: B023
        np.testing.assert_array_equal(_logprobs(tc), before)
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()  # a good step still applies
    assert not np.array_equal(_logprobs(tc), before) and np.isfinite(_logprobs(tc)).all()


def test_revoked_key_stops_working_at_once_on_a_running_server(
    server: LocalServer, capsys: pytest.CaptureFixture[str]
) -> None:
    assert keys_main(["create", "--tenant", "dora", "--data-dir", str(server.data_dir)]) == 0
    key = capsys.readouterr().out.strip()
    with httpx.Client(base_url=f"{server.base_url}/api/v1", headers={"X-API-Key": key}) as http:
        assert http.get("/training_runs").status_code == 200  # used (and formerly cached)
        assert keys_main(["list", "--data-dir", str(server.data_dir)]) == 0
        prefix = next(line.split()[0] for line in capsys.readouterr().out.splitlines() if "dora" in line)
        assert keys_main(["revoke", prefix, "--data-dir", str(server.data_dir)]) == 0
        r = http.get("/training_runs")
        assert r.status_code == 401 and "revoked" in r.json()["detail"]


def test_dev_server_takes_tml_dummy(server: LocalServer) -> None:
    sc = tinker.ServiceClient(base_url=server.base_url, api_key="tml-dummy")
    tc = sc.create_lora_training_client(base_model=TEST_MODEL, rank=2).result()
    assert np.isfinite(_logprobs(tc)).all()
    sc.close("success").result()


# ---------------------------------------------------------------------------- restart (last)
def test_restart_cleans_leftovers_of_interrupted_writes(
    server: LocalServer, service: tinker.ServiceClient
) -> None:
    tc = service.create_lora_training_client(base_model=TEST_MODEL, rank=2, seed=6).result()
    path = tc.save_state("survivor").result().path
    expected = _logprobs(tc)
    ref = parse_tinker_path(path)
    kind = server.data_dir / "checkpoints" / ref.model_id / ref.kind
    real = _tree(kind / ref.name)
    server.kill()  # the writer dies: whatever it had half-written stays on disk
    dead = _dead_pid()
    leftovers = [kind / f".survivor.tmp-{dead}-abcd", kind / ".next.tmp-k2j4h5g6", kind / f".next.old-{dead}"]
    for folder in leftovers:
        folder.mkdir()
        (folder / "adapter.safetensors").write_bytes(b"half written")
    server.start()
    assert not any(f.exists() for f in leftovers)
    assert _tree(kind / ref.name) == real
    sc = tinker.ServiceClient(base_url=server.base_url, api_key=DEV_KEY)
    rest = tinker.RestClient(base_url=server.base_url, api_key=DEV_KEY)
    assert path in {c.tinker_path for c in rest.list_checkpoints(ref.model_id).result().checkpoints}
    resumed = sc.create_training_client_from_state_with_optimizer(path).result()
    np.testing.assert_array_equal(_logprobs(resumed), expected)
    sc.close("success").result()
