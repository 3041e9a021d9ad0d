"""Conformance: the UNMODIFIED ``tinker`` SDK (and raw HTTP) against ``opentinker serve``.

One server per module (a child process on a loopback port, ``--dev``, the test model); every test
drives it over HTTP only. Covers the SDK's whole training / sampling / checkpoint surface, tenant
isolation (keys made with the ``keys`` command), invariant 7 (seq_id order and idempotency), bad
input (4xx or a ``category: user`` error, the server staying healthy with its data), and a
``kill -9`` + restart keeping checkpoints listed and loadable. The restart test runs last.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import tinker
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output

from opentinker.server.auth import keys_main
from opentinker.server.local import LocalServer
from tests.conftest import TEST_MODEL, local_server
from tests.tolerances import assert_logprobs_close, assert_scalar_close

MAX_BODY = 4 << 20
MAX_PENDING = 16
DEV_KEY = "tml-conformance-dev-key-0001"
LOSSES = ["cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo"]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    args = ["--max-body-bytes", str(MAX_BODY), "--max-pending", str(MAX_PENDING)]
    args += ["--poll-timeout", "5", "--gap-timeout", "4"]
    with local_server(tmp_path_factory, "server-data", *args) as srv:
        yield srv


@pytest.fixture(scope="module")
def service(server: LocalServer) -> Iterator[tinker.ServiceClient]:
    sc = tinker.ServiceClient(base_url=server.base_url, api_key=DEV_KEY)
    yield sc
    sc.close("success").result()


@pytest.fixture(scope="module")
def trainer(service: tinker.ServiceClient) -> tinker.TrainingClient:
    return service.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=0).result()


@pytest.fixture(scope="module")
def tokens() -> list[int]:
    return [int(t) for t in np.random.default_rng(0).integers(3, 1000, 24)]


def _datum(toks: list[int], **extra: list[float]) -> types.Datum:
    n = len(toks) - 1
    inputs: dict[str, Any] = {"target_tokens": toks[1:], **{k: v[:n] for k, v in extra.items()}}
    return types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]), loss_fn_inputs=inputs)


def _rl_inputs(n: int, seed: int) -> dict[str, list[float]]:
    rng = np.random.default_rng(seed)
    return {"logprobs": list(-rng.random(n) * 3 - 5), "advantages": list(rng.standard_normal(n))}


def _http(server: LocalServer, key: str = DEV_KEY) -> httpx.Client:
    return httpx.Client(base_url=f"{server.base_url}/api/v1", headers={"X-API-Key": key}, timeout=60)


def _result(http: httpx.Client, request_id: str) -> httpx.Response:
    for _ in range(100):
        r = http.post("/retrieve_future", json={"request_id": request_id})
        assert r.status_code == 200
        if (
            not r.headers["content-type"].startswith("application/json")
            or r.json().get("type") != "try_again"
        ):
            return r
    raise AssertionError("no result")


def _fb_body(model_id: str, seq_id: int, data: list[types.Datum], loss_fn: str = "cross_entropy") -> bytes:
    req = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss_fn),
        model_id=model_id,
        seq_id=seq_id,
    )
    return forward_backward_request_to_proto(req).SerializeToString()


def _raw_model(http: httpx.Client) -> str:
    sid = http.post("/create_session", json={"tags": [], "sdk_version": "raw"}).json()["session_id"]
    body = {
        "session_id": sid,
        "model_seq_id": 0,
        "base_model": TEST_MODEL,
        "lora_config": {"rank": 2, "seed": 1},
    }
    rid = http.post("/create_model", json=body).json()["request_id"]
    return _result(http, rid).json()["model_id"]


PROTO = {"Content-Type": "application/x-protobuf", "Accept": "application/x-protobuf"}


# ---------------------------------------------------------------------------- the SDK
def test_client_construction_and_capabilities(server: LocalServer, service: tinker.ServiceClient) -> None:
    caps = tinker.RestClient(base_url=server.base_url, api_key=DEV_KEY).get_server_capabilities().result()
    assert [m.model_name for m in caps.supported_models] == [TEST_MODEL]
    assert caps.supported_models[0].trainable and caps.supported_models[0].max_context_length
    assert httpx.get(f"{server.base_url}/docs").status_code == 200
    assert "/api/v1/forward_backward" in httpx.get(f"{server.base_url}/openapi.json").json()["paths"]


def test_training_client_info_and_tokenizer(trainer: tinker.TrainingClient) -> None:
    assert trainer.model_id.endswith(":train:0")
    info = trainer.get_info()
    assert info.model_id == trainer.model_id and info.lora_rank == 4 and info.is_lora
    assert trainer.get_tokenizer().encode("hello")


@pytest.mark.parametrize("loss_fn", LOSSES)
def test_forward_and_forward_backward_each_loss(
    trainer: tinker.TrainingClient, tokens: list[int], loss_fn: str
) -> None:
    extra = {} if loss_fn == "cross_entropy" else _rl_inputs(len(tokens) - 1, 1)
    data = [_datum(tokens, **extra), _datum(tokens[:10], **extra)]
    fwd = trainer.forward(data, loss_fn).result()
    fb = trainer.forward_backward(data, loss_fn).result()
    assert len(fb.loss_fn_outputs) == 2 and np.isfinite(fb.metrics["loss:sum"])
    assert fb.loss_fn_outputs[1]["logprobs"].shape == [9]
    for a, b in zip(fwd.loss_fn_outputs, fb.loss_fn_outputs, strict=True):
        assert_logprobs_close(a["logprobs"].tolist(), b["logprobs"].tolist())
    assert_scalar_close(fwd.metrics["loss:sum"], fb.metrics["loss:sum"])
    trainer.optim_step(types.AdamParams(learning_rate=0.0)).result()  # clear the accumulated gradient


def test_forward_backward_custom_loss(service: tinker.ServiceClient, tokens: list[int]) -> None:
    """The SDK's client-side custom loss: a forward, then a cross_entropy step with weights -dL/dlogp.
    -sum(logprobs) must give the same gradient step as cross_entropy with unit weights."""
    import torch

    data = [_datum(tokens, weights=[1.0] * (len(tokens) - 1))]
    a = service.create_lora_training_client(base_model=TEST_MODEL, rank=2, seed=4).result()
    b = service.create_lora_training_client(base_model=TEST_MODEL, rank=2, seed=4).result()

    def neg_ll(_: list[types.Datum], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        loss = -sum(lp.sum() for lp in logprobs)
        return loss, {"custom:sum": float(loss.detach())}

    custom = a.forward_backward_custom(data, neg_ll).result()
    plain = b.forward_backward(data, "cross_entropy").result()
    assert_scalar_close(custom.metrics["loss:sum"], plain.metrics["loss:sum"])
    for tc in (a, b):
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    la, lb = (
        tc.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy() for tc in (a, b)
    )
    assert_logprobs_close(la.tolist(), lb.tolist())


def test_sft_steps_lower_the_loss(service: tinker.ServiceClient, tokens: list[int]) -> None:
    tc = service.create_lora_training_client(base_model=TEST_MODEL, rank=8, seed=3).result()
    data = [_datum(tokens), _datum(tokens[5:])]
    losses = []
    for _ in range(4):
        fb = tc.forward_backward(data, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=2e-2))
        losses.append(fb.result().metrics["loss:sum"])
        assert "grad_norm:mean" in (opt.result().metrics or {})
    assert losses[-1] < losses[0]


def test_sampling_stop_strings_num_samples_prompt_logprobs(
    trainer: tinker.TrainingClient, tokens: list[int]
) -> None:
    sampler = trainer.save_weights_and_get_sampling_client().result()
    tok = trainer.get_tokenizer()
    prompt = types.ModelInput.from_ints(tok.encode("Once upon a time, there was a")[:8])
    res = sampler.sample(
        prompt,
        num_samples=3,
        sampling_params=types.SamplingParams(max_tokens=6, temperature=1.0, seed=7, stop=[]),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=3,
    ).result()
    assert len(res.sequences) == 3 and len({s.sequence_id for s in res.sequences}) == 3
    for s in res.sequences:
        assert (
            len(s.tokens) == 6
            and s.logprobs is not None
            and len(s.logprobs) == 6
            and s.stop_reason == "length"
        )
    assert (
        res.prompt_logprobs is not None and res.prompt_logprobs[0] is None and len(res.prompt_logprobs) == 8
    )
    assert res.topk_prompt_logprobs is not None and res.topk_prompt_logprobs[0] is None
    assert all(len(row or []) == 3 for row in res.topk_prompt_logprobs[1:])
    # a stop string taken from the greedy continuation stops the same greedy continuation early
    greedy = sampler.sample(prompt, 1, types.SamplingParams(max_tokens=8, temperature=0.0, stop=[]))
    toks = [x for x in greedy.result().sequences[0].tokens if x not in tok.all_special_ids]
    text = tok.decode(toks)
    stop = next(t for t in (tok.decode([x]).strip() for x in toks[2:]) if t and t in text)
    params = types.SamplingParams(max_tokens=8, temperature=0.0, stop=[stop])
    stopped = sampler.sample(prompt, 1, params).result().sequences[0]
    assert stopped.stop_reason == "stop" and len(stopped.tokens) < 8


def test_compute_logprobs_match_training_forward(trainer: tinker.TrainingClient, tokens: list[int]) -> None:
    """Invariant 3 across HTTP: sampler prompt logprobs = trainer forward logprobs, same weights."""
    sampler = trainer.save_weights_and_get_sampling_client().result()
    lp = sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()
    fwd = trainer.forward([_datum(tokens)], "cross_entropy").result()
    assert lp[0] is None
    assert_logprobs_close(lp[1:], fwd.loss_fn_outputs[0]["logprobs"].tolist())


def test_save_weights_for_sampler_and_base_sampler(
    service: tinker.ServiceClient, trainer: tinker.TrainingClient, tokens: list[int]
) -> None:
    path = trainer.save_weights_for_sampler("named-sampler").result().path
    assert path == f"tinker://{trainer.model_id}/sampler_weights/named-sampler"
    named = service.create_sampling_client(model_path=path).result()
    snap = trainer.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=5, temperature=0.0)
    prompt = types.ModelInput.from_ints(tokens[:6])
    a = named.sample(prompt, 1, params).result().sequences[0].tokens
    b = snap.sample(prompt, 1, params).result().sequences[0].tokens
    assert a == b
    base = service.create_sampling_client(base_model=TEST_MODEL).result()
    assert base.get_base_model() == TEST_MODEL and len(base.sample(prompt, 2, params).result().sequences) == 2


def test_save_state_and_resume_with_optimizer(service: tinker.ServiceClient, tokens: list[int]) -> None:
    tc = service.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=5).result()
    data = [_datum(tokens)]
    tc.forward_backward(data, "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    path = tc.save_state("resume-me").result().path
    resumed = service.create_training_client_from_state_with_optimizer(path).result()
    assert resumed.model_id != tc.model_id and resumed.get_info().lora_rank == 4
    for client in (tc, resumed):  # the same step from the same state, optimizer moments included
        client.forward_backward(data, "cross_entropy")
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    a, b = (
        c.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
        for c in (tc, resumed)
    )
    np.testing.assert_array_equal(a, b)
    fresh = service.create_training_client_from_state(path).result()  # weights only
    c = fresh.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    assert not np.array_equal(a, c)


def test_rest_checkpoint_listing_and_deletion(
    server: LocalServer, service: tinker.ServiceClient, tokens: list[int]
) -> None:
    tc = service.create_lora_training_client(base_model=TEST_MODEL, rank=2, seed=9).result()
    p1 = tc.save_state("keep").result().path
    p2 = tc.save_weights_for_sampler("drop").result().path
    rest = tinker.RestClient(base_url=server.base_url, api_key=DEV_KEY)
    listed = rest.list_checkpoints(tc.model_id).result().checkpoints
    assert {c.tinker_path for c in listed} == {p1, p2}
    assert {c.checkpoint_type for c in listed} == {"training", "sampler"}
    run = rest.get_training_run(tc.model_id).result()
    assert run.base_model == TEST_MODEL and run.lora_rank == 2 and run.last_checkpoint is not None
    assert tc.model_id in {
        r.training_run_id for r in rest.list_training_runs(limit=100).result().training_runs
    }
    info = rest.get_weights_info_by_tinker_path(p1).result()
    assert info.lora_rank == 2 and info.base_model == TEST_MODEL
    assert p1 in {c.tinker_path for c in rest.list_user_checkpoints(limit=1000).result().checkpoints}
    rest.delete_checkpoint_from_tinker_path(p2).result()
    assert [c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints] == [p1]
    with pytest.raises(Exception, match="404|unknown"):
        rest.delete_checkpoint_from_tinker_path(p2).result()
    with pytest.raises(Exception, match="404|unknown|Request failed"):
        service.create_sampling_client(model_path=p2).result()


def test_with_service_client_exit_finishes_the_session(server: LocalServer, tokens: list[int]) -> None:
    with tinker.ServiceClient(base_url=server.base_url, api_key=DEV_KEY) as sc:
        tc = sc.create_lora_training_client(base_model=TEST_MODEL, rank=2).result()
        tc.forward([_datum(tokens)], "cross_entropy").result()
        model_id = tc.model_id
    with _http(server) as http:  # the model was freed with its session
        assert http.post("/get_info", json={"model_id": model_id}).status_code == 404


# ---------------------------------------------------------------------------- tenants
def test_tenants_are_isolated(
    server: LocalServer, tokens: list[int], capsys: pytest.CaptureFixture[str]
) -> None:
    keys = {}
    for tenant in ("alice", "bob"):
        assert keys_main(["create", "--tenant", tenant, "--data-dir", str(server.data_dir)]) == 0
        keys[tenant] = capsys.readouterr().out.strip()
    assert keys["alice"].startswith("tml-")
    alice = tinker.ServiceClient(base_url=server.base_url, api_key=keys["alice"])
    tc = alice.create_lora_training_client(base_model=TEST_MODEL, rank=2).result()
    path = tc.save_state("secret").result().path
    sampler_path = tc.save_weights_for_sampler("secret-s").result().path
    snap = tc.save_weights_and_get_sampling_client().result()
    with _http(server, keys["alice"]) as http:
        rid = http.post(
            "/optim_step", json={"model_id": tc.model_id, "adam_params": {"learning_rate": 0.0}}
        ).json()["request_id"]
        assert "metrics" in _result(http, rid).json()
    with _http(server, keys["bob"]) as http:
        assert http.post("/get_info", json={"model_id": tc.model_id}).status_code == 404
        assert (
            http.post(
                "/forward_backward", content=_fb_body(tc.model_id, 99, [_datum(tokens)]), headers=PROTO
            ).status_code
            == 404
        )
        assert http.get(f"/training_runs/{tc.model_id}").status_code == 404
        assert http.get(f"/training_runs/{tc.model_id}/checkpoints").status_code == 404
        assert http.delete(f"/training_runs/{tc.model_id}/checkpoints/weights/secret").status_code == 404
        assert http.post("/weights_info", json={"tinker_path": path}).status_code == 404
        assert http.get(f"/samplers/{snap._sampling_session_id}").status_code == 404
        assert tc.model_id not in str(http.get("/training_runs").json()) + str(
            http.get("/checkpoints").json()
        )
        err = _result(http, rid).json()
        assert err["category"] == "user" and "unknown" in err["error"]
        asample = {
            "sampling_session_id": snap._sampling_session_id,
            "seq_id": 1,
            "num_samples": 1,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": tokens[:4]}]},
            "sampling_params": {"max_tokens": 2},
        }
        assert http.post("/asample", json=asample).status_code == 404
    bob = tinker.ServiceClient(base_url=server.base_url, api_key=keys["bob"])
    for make in (
        lambda: bob.create_training_client_from_state(path).result(),
        lambda: bob.create_sampling_client(model_path=sampler_path).result(),
    ):
        with pytest.raises(Exception, match="404|unknown"):
            make()
    assert rest_paths(server, keys["bob"]) == set() and path in rest_paths(server, keys["alice"])
    # a revoked key stops working (a fresh one: no cached lookup)
    assert keys_main(["create", "--tenant", "carol", "--data-dir", str(server.data_dir)]) == 0
    carol = capsys.readouterr().out.strip()
    assert keys_main(["list", "--data-dir", str(server.data_dir)]) == 0
    listing = capsys.readouterr().out
    assert "alice" in listing and carol not in listing  # only hashes are stored
    prefix = next(line.split()[0] for line in listing.splitlines() if "carol" in line)
    assert keys_main(["revoke", prefix, "--data-dir", str(server.data_dir)]) == 0
    with _http(server, carol) as http:
        assert http.get("/training_runs").status_code == 401
    with _http(server, "sk-not-a-tinker-key") as http:  # --dev takes any tml- key, not this
        assert http.get("/training_runs").status_code == 401
    assert httpx.get(f"{server.base_url}/api/v1/training_runs").status_code == 401
    alice.close("success").result()
    bob.close("success").result()


def rest_paths(server: LocalServer, key: str) -> set[str]:
    rest = tinker.RestClient(base_url=server.base_url, api_key=key)
    return {c.tinker_path for c in rest.list_user_checkpoints(limit=1000).result().checkpoints}


# ---------------------------------------------------------------------------- invariant 7
def test_seq_id_order_and_idempotency(server: LocalServer, tokens: list[int]) -> None:
    with _http(server) as http:
        model_id = _raw_model(http)
        data = [_datum(tokens)]
        body = _fb_body(model_id, 1, data)
        rid = http.post("/forward_backward", content=body, headers=PROTO).json()["request_id"]
        assert http.post("/forward_backward", content=body, headers=PROTO).json()["request_id"] == rid
        first = _result(http, rid)
        assert first.headers["content-type"] == "application/x-protobuf"
        assert _result(http, rid).content == first.content  # retried polls: the same result
        other = _fb_body(model_id, 1, [_datum(tokens[:12])])
        refused = http.post("/forward_backward", content=other, headers=PROTO)
        assert refused.status_code == 400 and "seq_id 1" in refused.json()["detail"]
        opt = {"model_id": model_id, "seq_id": 2, "adam_params": {"learning_rate": 1e-2}}
        rid2 = http.post("/optim_step", json=opt).json()["request_id"]
        assert http.post("/optim_step", json=opt).json()["request_id"] == rid2
        assert (
            http.post("/optim_step", json={**opt, "adam_params": {"learning_rate": 5.0}}).status_code == 400
        )
        # out of order: seq 4 arrives first and waits for seq 3; both run, in seq order
        rid4 = http.post("/forward_backward", content=_fb_body(model_id, 4, data), headers=PROTO).json()[
            "request_id"
        ]
        time.sleep(0.3)
        rid3 = http.post("/forward_backward", content=_fb_body(model_id, 3, data), headers=PROTO).json()[
            "request_id"
        ]
        out3, out4 = (deserialize_forward_backward_output(_result(http, r).content) for r in (rid3, rid4))
        assert out3.metrics["clock_cycle:unique"] < out4.metrics["clock_cycle:unique"]
        # the weights changed at seq 2, so seq 3 differs from seq 1's result
        out1 = deserialize_forward_backward_output(first.content)
        assert out1.metrics["loss:sum"] != pytest.approx(out3.metrics["loss:sum"], rel=1e-6)
        # seq_ids that never come: after the gap timeout (4 s here) the one waiting for them fails,
        # naming them, and the model goes on with the next
        rid7 = http.post("/forward_backward", content=_fb_body(model_id, 7, data), headers=PROTO).json()[
            "request_id"
        ]
        failed = _result(http, rid7).json()
        assert failed["category"] == "user" and "seq_ids 5..6" in failed["error"], failed
        rid8 = http.post("/forward_backward", content=_fb_body(model_id, 8, data), headers=PROTO).json()[
            "request_id"
        ]
        assert "loss:sum" in deserialize_forward_backward_output(_result(http, rid8).content).metrics
        late = http.post("/forward_backward", content=_fb_body(model_id, 5, data), headers=PROTO)
        assert late.status_code == 400 and "after later requests" in late.json()["detail"]


def test_pending_requests_per_tenant_are_bounded(server: LocalServer, tokens: list[int]) -> None:
    with _http(server, "tml-pending-limit-tenant") as http:
        model_id = _raw_model(http)
        data = [_datum(tokens[:6])]
        held = [  # seq 1 never comes, so these wait (pending) until the gap timeout
            http.post("/forward_backward", content=_fb_body(model_id, 2 + i, data), headers=PROTO)
            for i in range(MAX_PENDING)
        ]
        assert all(r.status_code == 200 for r in held)
        over = http.post(
            "/forward_backward", content=_fb_body(model_id, 2 + MAX_PENDING, data), headers=PROTO
        )
        assert over.status_code == 429 and "unfinished requests" in over.json()["detail"]
        for r in held:  # after the gap timeout they all fail, naming the seq_id they waited for
            failed = _result(http, r.json()["request_id"]).json()
            assert "for seq_id 1," in failed["error"] and "never arrived" in failed["error"], failed
        after = http.post(  # their slots are free again, and the model goes on
            "/forward_backward", content=_fb_body(model_id, 2 + MAX_PENDING, data), headers=PROTO
        )
        assert (
            "loss:sum"
            in deserialize_forward_backward_output(_result(http, after.json()["request_id"]).content).metrics
        )


# ---------------------------------------------------------------------------- bad input
def test_bad_input_is_refused_and_the_server_keeps_its_data(
    server: LocalServer, trainer: tinker.TrainingClient, tokens: list[int]
) -> None:
    before = (
        trainer.forward([_datum(tokens)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    )
    mid = trainer.model_id
    with _http(server) as http:
        r = http.post("/forward_backward", content=b"\xff\x00garbage\x12", headers=PROTO)
        assert r.status_code == 400 and "protobuf" in r.json()["detail"]
        assert http.post("/forward_backward", content=_fb_body("", 1, []), headers=PROTO).status_code == 400
        r = http.post("/create_model", json={"session_id": "x", "model_seq_id": "zero", "base_model": 3})
        assert r.status_code == 422 and "model_seq_id" in r.text
        assert (
            http.post(
                "/optim_step", json={"model_id": mid, "adam_params": {"learning_rate": "fast"}}
            ).status_code
            == 422
        )
        assert (
            http.post(
                "/optim_step", content=b"{not json", headers={"Content-Type": "application/json"}
            ).status_code
            == 422
        )
        assert http.post("/get_info", json={"model_id": "sess-nope:train:0"}).status_code == 404
        assert http.get("/samplers/nope").status_code == 404
        assert http.get("/training_runs/nope").status_code == 404
        assert http.post("/session_heartbeat", json={"session_id": "nope"}).status_code == 404
        err = _result(http, "req-00000000-1").json()
        assert err["category"] == "user" and "unknown or lost" in err["error"]
        r = http.post("/forward_backward", content=b"\x00" * (MAX_BODY + 1), headers=PROTO)
        assert r.status_code == 413 and str(MAX_BODY) in r.json()["detail"]
        r = http.post(
            "/forward_backward", content=b"\x00" * 64, headers={**PROTO, "Content-Encoding": "zstd"}
        )
        assert r.status_code == 400 and "zstd" in r.json()["detail"]
        # bad data inside a well-formed request: refused through its future, with a message
        sid = http.post("/create_session", json={}).json()["session_id"]
        bad_base = http.post(
            "/create_model", json={"session_id": sid, "model_seq_id": 0, "base_model": "no/such-model"}
        )
        err = _result(http, bad_base.json()["request_id"]).json()
        assert err["category"] == "user" and "not served" in err["error"]
    cases: list[tuple[list[types.Datum], str, str]] = [
        ([_datum([10**7, *tokens[:5]])], "cross_entropy", "vocabulary"),
        ([_datum(tokens, weights=[1.0] * 3)], "cross_entropy", "weights"),
        ([_datum(tokens, weights=[float("nan")] * 23)], "cross_entropy", "NaN"),
        ([_datum(tokens)], "no_such_loss", "unknown loss_fn"),
        ([_datum(tokens)], "ppo", "missing 'logprobs'"),
    ]
    for data, loss_fn, message in cases:  # each fails alone; the client goes on
        with pytest.raises(tinker.RequestFailedError, match=message):
            trainer.forward_backward(data, loss_fn).result()
    with _http(server) as http:  # a sparse tensor declaring a huge dense shape, sent raw
        msg = pb.ForwardBackwardRequest(model_id=_raw_model(http), seq_id=1, loss_fn="cross_entropy")
        d = msg.data.add()
        d.model_input.add().encoded_text.tokens = np.asarray(tokens[:4], np.int32).tobytes()
        t = d.loss_fn_inputs["target_tokens"]
        t.dtype, t.sparse_csr.values = pb.DTYPE_INT64, np.asarray([1, 2], np.int64).tobytes()
        t.shape.extend([10**6, 10**6])
        r = http.post("/forward_backward", content=msg.SerializeToString(), headers=PROTO)
        err = _result(http, r.json()["request_id"]).json()
        assert err["category"] == "user" and "too large" in err["error"]
        assert http.get("/healthz").json() == {"status": "ok"}
    after = (
        trainer.forward([_datum(tokens)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    )
    np.testing.assert_array_equal(before, after)


# ---------------------------------------------------------------------------- crash + restart (last)
def test_kill9_then_restart_keeps_checkpoints(server: LocalServer, tokens: list[int]) -> None:
    sc = tinker.ServiceClient(base_url=server.base_url, api_key=DEV_KEY)
    tc = sc.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=11).result()
    data = [_datum(tokens)]
    tc.forward_backward(data, "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    state = tc.save_state("before-crash").result().path
    sampler_path = tc.save_weights_for_sampler("before-crash-s").result().path
    expected = tc.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    prompt, greedy = (
        types.ModelInput.from_ints(tokens[:4]),
        types.SamplingParams(max_tokens=3, temperature=0.0, stop=[]),
    )
    named = sc.create_sampling_client(model_path=sampler_path).result()
    before = named.sample(prompt, 1, greedy).result().sequences[0].tokens
    snapshot = tc.save_weights_and_get_sampling_client().result()
    inflight = tc.save_weights_and_get_sampling_client(kind="inflight").result()
    assert inflight.sample(prompt, 1, greedy).result().sequences[0].tokens == before
    with _http(server) as http:
        in_flight = http.post("/forward_backward", content=_fb_body(tc.model_id, 999, data), headers=PROTO)
        in_flight_id = in_flight.json()["request_id"]  # held forever: seq 4..998 never come
    server.kill()
    server.start()
    rest = tinker.RestClient(base_url=server.base_url, api_key=DEV_KEY)
    assert {state, sampler_path} <= {
        c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints
    }
    sc2 = tinker.ServiceClient(base_url=server.base_url, api_key=DEV_KEY)
    resumed = sc2.create_training_client_from_state_with_optimizer(state).result()
    got = resumed.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    np.testing.assert_array_equal(got, expected)
    sampler = sc2.create_sampling_client(model_path=sampler_path).result()
    assert sampler.sample(prompt, 1, greedy).result().sequences[0].tokens == before
    # clients made before the crash go on: a sampler over saved weights is reloaded on first use
    assert named.sample(prompt, 1, greedy).result().sequences[0].tokens == before
    with pytest.raises(tinker.NotFoundError, match="in-memory snapshot"):
        snapshot.sample(prompt, 1, greedy).result()
    with pytest.raises(tinker.NotFoundError, match="in-memory snapshot"):  # never the base model's
        inflight.sample(prompt, 1, greedy).result()
    with _http(server) as http:
        err = _result(http, in_flight_id).json()
        assert err["category"] == "user" and "server restarted" in err["error"]
        gone = http.post("/get_info", json={"model_id": tc.model_id})
        assert gone.status_code == 404 and "earlier server process" in gone.json()["detail"]
    sc2.close("success").result()
