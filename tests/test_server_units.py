"""Unit tests of the server's parts that need no model: wire codecs (against the SDK's own
converters), the seq_id reorder buffer, the futures store, the body limit, keys and the store."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from concurrent.futures import Future
from typing import Any

import numpy as np
import pytest
import torch
import zstandard
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output, deserialize_sample_response

from opentinker.server.auth import Authenticator, create_key, hash_key, keys_main
from opentinker.server.config import ServerConfig
from opentinker.server.errors import BadRequest, TooManyPending, Unauthorized, error_category
from opentinker.server.futures import FutureStore, chain
from opentinker.server.limits import BodyLimit
from opentinker.server.ordering import Sequencer
from opentinker.server.store import Store
from opentinker.server.wire import decode_forward_backward, encode_forward_output, encode_sample_response


# ---------------------------------------------------------------------------- wire
def test_forward_backward_request_round_trips_through_the_sdk_encoder() -> None:
    soft = np.arange(80, dtype=np.int64).reshape(10, 8)
    soft_w = np.zeros((10, 8), dtype=np.float32)
    soft_w[:, 0] = 1.0  # mostly zero: the SDK sends it as sparse CSR
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints([5, 6, 7, 8]),
            loss_fn_inputs={"target_tokens": [6, 7, 8, 9], "weights": [0.0, 1.0, 1.0, 0.5]},
        ),
        types.Datum(
            model_input=types.ModelInput.from_ints(list(range(1, 11))),
            loss_fn_inputs={
                "target_tokens": types.TensorData.from_numpy(soft),
                "weights": types.TensorData.from_torch_sparse(torch.from_numpy(soft_w)),
            },
        ),
    ]
    assert data[1].loss_fn_inputs["weights"].sparse_crow_indices is not None
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=data, loss_fn="ppo", loss_fn_config={"clip_low_threshold": 0.7}
        ),
        model_id="s:train:0",
        seq_id=3,
    )
    msg = forward_backward_request_to_proto(req)
    msg.forward_only = True
    call = decode_forward_backward(msg.SerializeToString())
    assert (call.model_id, call.seq_id, call.forward_only, call.loss_fn) == ("s:train:0", 3, True, "ppo")
    assert call.loss_fn_config == {"clip_low_threshold": pytest.approx(0.7)} and call.error is None
    assert call.data[0].model_input.to_ints() == [5, 6, 7, 8]
    np.testing.assert_array_equal(call.data[0].loss_fn_inputs["weights"].to_numpy(), [0.0, 1.0, 1.0, 0.5])
    np.testing.assert_array_equal(call.data[1].loss_fn_inputs["target_tokens"].to_numpy(), soft)
    np.testing.assert_array_equal(call.data[1].loss_fn_inputs["weights"].to_numpy(), soft_w)
    again = decode_forward_backward(msg.SerializeToString())
    assert again.digest == call.digest
    msg.seq_id = 4
    assert decode_forward_backward(msg.SerializeToString()).digest != call.digest


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (
            lambda m: m.data[0].model_input[0].encoded_text.__setattr__("tokens", b"\x01\x02\x03"),
            "whole number",
        ),
        (lambda m: m.data[0].loss_fn_inputs["weights"].shape.extend([7]), "do not fill"),
        (lambda m: m.data[0].loss_fn_inputs["weights"].__setattr__("dtype", 9), "dtype"),
        (lambda m: m.loss_fn_config_v2["beta"].__setattr__("text", "x"), "string"),
    ],
)
def test_malformed_data_fails_the_request_with_a_message(mutate: Any, message: str) -> None:
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(
            data=[
                types.Datum(
                    model_input=types.ModelInput.from_ints([1, 2]),
                    loss_fn_inputs={"target_tokens": [2, 3], "weights": [1.0, 1.0]},
                )
            ],
            loss_fn="cross_entropy",
        ),
        model_id="m",
        seq_id=1,
    )
    msg = forward_backward_request_to_proto(req)
    mutate(msg)
    call = decode_forward_backward(msg.SerializeToString())
    assert call.error is not None and message in call.error.message


def test_unparseable_bodies_are_bad_requests() -> None:
    with pytest.raises(BadRequest, match="protobuf"):
        decode_forward_backward(b"\xff\xff\xff")
    with pytest.raises(BadRequest, match="model_id"):
        decode_forward_backward(b"")


def test_forward_output_decodes_with_the_sdk() -> None:
    out = types.ForwardBackwardOutput(
        loss_fn_output_type="ArrayRecord",
        loss_fn_outputs=[
            {
                "logprobs": types.TensorData.from_numpy(np.array([-1.0, -2.0], np.float32)),
                "elementwise_loss": types.TensorData.from_numpy(np.array([0.5, 0.25], np.float32)),
            },
            {
                "logprobs": types.TensorData.from_numpy(np.array([-3.0], np.float32)),
                "elementwise_loss": types.TensorData.from_numpy(np.array([1.5], np.float32)),
            },
            {
                "logprobs": types.TensorData.from_numpy(np.full((2, 3), -4.0, np.float32)),  # soft targets
                "elementwise_loss": types.TensorData.from_numpy(np.array([1.0, 2.0], np.float32)),
            },
        ],
        metrics={"loss:sum": 3.5, "clock_cycle:unique": 7.0},
    )
    back = deserialize_forward_backward_output(encode_forward_output(out))
    assert back.metrics == {"loss:sum": 3.5, "clock_cycle:unique": 7.0}
    assert [o["logprobs"].shape for o in back.loss_fn_outputs] == [[2], [1], [2, 3]]
    for a, b in zip(out.loss_fn_outputs, back.loss_fn_outputs, strict=True):
        for k in a:
            np.testing.assert_array_equal(a[k].to_numpy(), b[k].to_numpy())


def test_sample_response_decodes_with_the_sdk() -> None:
    res = types.SampleResponse(
        sequences=[
            types.SampledSequence(
                stop_reason="stop",
                sequence_id="a",
                tokens_np=np.array([1, 2], np.int32),
                logprobs_np=np.array([-0.5, -1.5], np.float32),
            ),
            types.SampledSequence(
                stop_reason="length",
                sequence_id="b",
                tokens_np=np.array([3], np.int32),
                logprobs_np=np.array([-2.0], np.float32),
            ),
        ],
        _prompt_logprobs_list=[None, -1.0, -2.0],
        _topk_prompt_logprobs_list=[None, [(4, -0.1), (5, -0.2)], [(6, -0.3)]],
    )
    back = deserialize_sample_response(encode_sample_response(res))
    assert [(s.tokens, s.stop_reason) for s in back.sequences] == [([1, 2], "stop"), ([3], "length")]
    assert back.sequences[0].logprobs == [-0.5, -1.5]
    assert back.prompt_logprobs == [None, -1.0, -2.0]
    assert back.topk_prompt_logprobs == [
        None,
        [(4, pytest.approx(-0.1)), (5, pytest.approx(-0.2))],
        [(6, pytest.approx(-0.3))],
    ]
    last = deserialize_sample_response(encode_sample_response(res, prompt_logprobs_last_n=1))
    assert last.prompt_logprobs == [None, None, -2.0]


# ---------------------------------------------------------------------------- ordering
def _done_future(log: list[int], seq: int) -> Any:
    return lambda: log.append(seq)


def test_sequencer_runs_in_seq_order_and_is_idempotent() -> None:
    seq, log = Sequencer(), []
    outs = {i: Future() for i in range(1, 5)}
    for i in (3, 2, 4):
        seq.submit("m", i, f"d{i}", f"r{i}", outs[i], _done_future(log, i))
    assert log == []  # all wait for seq 1
    assert seq.lookup("m", 3, "d3") == "r3"
    with pytest.raises(BadRequest, match="different request"):
        seq.lookup("m", 3, "other")
    seq.submit("m", 1, "d1", "r1", outs[1], _done_future(log, 1))
    assert log == [1, 2, 3, 4]
    with pytest.raises(BadRequest, match="after later requests"):
        seq.submit("m", 2, "new", "r", Future(), lambda: None)


def test_sequencer_fails_a_refused_request_alone_and_skips_gaps() -> None:
    seq, log = Sequencer(), []

    def boom() -> None:
        raise ValueError("bad datum")

    out1 = Future()
    seq.submit("m", 1, "d", "r1", out1, boom)
    assert isinstance(out1.exception(), ValueError)
    out5: Future = Future()
    seq.submit("m", 5, "d5", "r5", out5, _done_future(log, 5))
    assert seq.skip_gaps(gap_timeout_s=60) == 0 and log == []
    assert seq.skip_gaps(gap_timeout_s=-1) == 1 and log == []  # 5 waited for 2..4: it fails, unrun
    assert "waited" in str(out5.exception()) and "seq_ids 2..4" in str(out5.exception())
    seq.submit("m", 6, "d6", "r6", Future(), _done_future(log, 6))  # the model goes on
    assert log == [6]
    held = Future()
    seq.submit("m", 9, "d9", "r9", held, _done_future(log, 9))
    seq.close("m", "session finished")
    assert "finished" in str(held.exception())


# ---------------------------------------------------------------------------- futures
def test_future_store_long_polls_limits_and_forgets_unknown_ids() -> None:
    async def run() -> None:
        store = FutureStore(max_pending=2, result_ttl_s=60)
        rid, out = store.create("t")
        rid2, _ = store.create("t")
        with pytest.raises(TooManyPending):
            store.create("t")
        store.create("other")  # another tenant has its own budget
        assert await store.wait(rid, "t", 0.05) == ("pending", None)
        assert (await store.wait(rid, "someone-else", 0.05))[0] == "unknown"
        assert (await store.wait("req-x-1", "t", 0.05))[0] == "unknown"
        src: Future = Future()
        chain(src, out, lambda x: {"value": x * 2})
        loop = asyncio.get_running_loop()
        loop.call_later(0.05, src.set_result, 21)
        state, fut = await store.wait(rid, "t", 5)
        assert state == "done" and fut is not None and fut.result() == {"value": 42}
        assert store.pending("t") == 1
        store.create("t")  # a slot was freed
        assert rid2 != rid

    asyncio.run(run())


def test_error_categories() -> None:
    assert error_category(ValueError("x")) == "user"
    assert error_category(RuntimeError("x")) == "server"


# ---------------------------------------------------------------------------- body limit
def _call(app: Any, body: bytes, headers: list[tuple[bytes, bytes]]) -> tuple[int, bytes]:
    sent: list[dict[str, Any]] = []
    chunks = [body[i : i + 1000] for i in range(0, len(body), 1000)] or [b""]

    async def receive() -> dict[str, Any]:
        chunk = chunks.pop(0) if chunks else b""
        return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app({"type": "http", "headers": headers}, receive, send))
    return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])


def test_body_limit_and_zstd() -> None:
    async def echo(scope: dict[str, Any], receive: Any, send: Any) -> None:
        body = (await receive())["body"]
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": body})

    app = BodyLimit(echo, max_bytes=5000)
    assert _call(app, b"x" * 4000, []) == (200, b"x" * 4000)
    status, body = _call(app, b"x" * 6000, [])
    assert status == 413 and "5000" in json.loads(body)["detail"]
    packed = zstandard.ZstdCompressor().compress(b"y" * 4000)
    assert _call(app, packed, [(b"content-encoding", b"zstd")]) == (200, b"y" * 4000)
    bomb = zstandard.ZstdCompressor().compress(b"z" * 100_000)
    assert _call(app, bomb, [(b"content-encoding", b"zstd")])[0] == 413
    assert _call(app, b"x", [(b"content-encoding", b"gzip")])[0] == 400


# ---------------------------------------------------------------------------- keys and store
@pytest.mark.parametrize("tenant", ["", "a b", "../acme", "-acme", "x" * 65])
def test_a_key_for_a_bad_tenant_name_is_refused_and_nothing_stored(tmp_path: Any, tenant: str) -> None:
    with pytest.raises(ValueError, match="invalid tenant name"):
        create_key(tmp_path, tenant)
    assert not (tmp_path / "server.sqlite3").exists()


def test_keys_are_hashed_mapped_to_tenants_and_revocable(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    key = create_key(tmp_path, "acme", "ci")
    store = Store(tmp_path)
    assert store.key(hash_key(key)).tenant == "acme"  # type: ignore[union-attr]
    assert key not in (tmp_path / "server.sqlite3").read_bytes().decode("latin-1")
    auth = Authenticator(store, dev=False)
    assert auth.tenant(key) == "acme"
    for bad in (None, "", "sk-123", "tml-short", "tml-unknown-but-well-formed"):
        with pytest.raises(Unauthorized):
            auth.tenant(bad)
    dev = Authenticator(store, dev=True)
    a, b = dev.tenant("tml-first-dev-key"), dev.tenant("tml-second-dev-key")
    assert a.startswith("dev-") and a != b and dev.tenant(key) == "acme"
    assert keys_main(["list", "--data-dir", str(tmp_path)]) == 0
    prefix = capsys.readouterr().out.split()[0]
    assert keys_main(["revoke", prefix, "--data-dir", str(tmp_path)]) == 0
    assert "revoked 1" in capsys.readouterr().out
    with pytest.raises(Unauthorized):
        Authenticator(store, dev=False).tenant(key)
    assert keys_main(["create", "--tenant", "bad name!", "--data-dir", str(tmp_path)]) == 2
    assert keys_main(["revoke", "zz", "--data-dir", str(tmp_path)]) == 2
    store.close()


def test_serve_flags_reach_the_config(tmp_path: Any, capsys: Any) -> None:
    """``--prefix-cache-mb`` sets the sampler's prefix cache budget (0 turns it off); a negative
    value is refused with a message naming the flag."""
    from opentinker.server.main import build_parser, config_from_args

    args = ["--base-model", "opentinker/tiny", "--data-dir", str(tmp_path)]
    assert config_from_args(build_parser().parse_args(args)).runtime.prefix_cache_bytes == 512 << 20
    cfg = config_from_args(build_parser().parse_args([*args, "--prefix-cache-mb", "64"]))
    assert cfg.runtime.prefix_cache_bytes == 64 << 20
    assert (
        config_from_args(
            build_parser().parse_args([*args, "--prefix-cache-mb", "0"])
        ).runtime.prefix_cache_bytes
        == 0
    )
    with pytest.raises(SystemExit):
        build_parser().parse_args([*args, "--prefix-cache-mb", "-1"])
    assert "--prefix-cache-mb" in capsys.readouterr().err
    # --data-parallel K: every new model's degree (1 by default); below 1 refused, naming the flag
    assert config_from_args(build_parser().parse_args(args)).runtime.data_parallel == 1
    assert (
        config_from_args(build_parser().parse_args([*args, "--data-parallel", "2"])).runtime.data_parallel
        == 2
    )
    with pytest.raises(SystemExit):
        build_parser().parse_args([*args, "--data-parallel", "0"])
    assert "--data-parallel" in capsys.readouterr().err


def test_every_runtime_setting_has_one_name_from_flag_to_runtime(tmp_path: Any) -> None:
    """Each ``RuntimeConfig`` field with a flag is the flag of its own name (the one unit-named
    exception: ``--prefix-cache-mb`` sets ``prefix_cache_bytes``); the flags' values reach the
    server's config as that one dataclass, which the Runtime and its scale-out read as is; the
    server's own settings repeat none of its names; an unknown or old setting name is refused."""
    from opentinker.server.main import build_parser, config_from_args
    from opentinker.service.config import RuntimeConfig
    from opentinker.service.runtime import Runtime

    flags = {a.dest: a.option_strings for a in build_parser()._actions}
    flagged = [f.name for f in dataclasses.fields(RuntimeConfig) if f.metadata.get("help")]
    assert len(flagged) == 19
    for name in flagged:
        want = "--prefix-cache-mb" if name == "prefix_cache_bytes" else "--" + name.replace("_", "-")
        assert flags[name] == [want], name
    server_names = {f.name for f in dataclasses.fields(ServerConfig)}
    assert not server_names & {f.name for f in dataclasses.fields(RuntimeConfig)}
    argv = ["--base-model", "opentinker/tiny", "--device", "cpu", "--dtype", "float32"]
    argv += ["--prefix-cache-mb", "8", "--rollout-workers", "3", "--rollout-backend", "native"]
    argv += ["--vllm-max-lora-rank", "8", "--ray", "--worker-cpus", "2", "--worker-gpus", "0.5"]
    argv += ["--trainer-workers", "2", "--data-parallel", "2", "--trainer-cpus", "0.5"]
    argv += ["--trainer-gpus", "0.25", "--placement-timeout", "7", "--auto-restore"]
    argv += ["--shard-sampling", "front", "--rollout-tensor-parallel", "2"]
    got = config_from_args(build_parser().parse_args(argv)).runtime
    assert got == RuntimeConfig(
        device="cpu", dtype="float32", prefix_cache_bytes=8 << 20, rollout_workers=3,
        rollout_backend="native", vllm_max_lora_rank=8, ray="local", worker_cpus=2.0, worker_gpus=0.5,
        trainer_workers=2, data_parallel=2, trainer_cpus=0.5, trainer_gpus=0.25, placement_timeout=7.0,
        auto_restore=True, shard_sampling="front", rollout_tensor_parallel=2,
    )  # fmt: skip
    defaults = config_from_args(build_parser().parse_args(argv[:2])).runtime
    assert defaults == RuntimeConfig()
    rt = Runtime(tmp_path, RuntimeConfig(prefix_cache_bytes=0), trainer_cpus=0.5)  # no workers: no Ray
    assert rt.config == RuntimeConfig(prefix_cache_bytes=0, trainer_cpus=0.5)
    assert rt.scaleout.config is rt.config
    with pytest.raises(TypeError, match="unknown runtime setting.*trainer_options"):
        Runtime(tmp_path, trainer_options={"worker_cpus": 1.0})
    rt.shutdown()
