"""Server-side custom losses (``create_custom_loss``): the traced graph runs in the server's
restricted interpreter and gives what the same loss gives client-side.

Unit: the interpreter equals torch.fx's own GraphModule (values and gradients); the engine's
gradients with the loss run server-side equal those of the SDK's client-side path (a forward,
dL/dlogprobs on the client, a ``cross_entropy`` backward with weights -dL/dlogprobs); every
refusal (an import, opening a file, getattr on a non-tensor, a function or method off the
allow-list, captured tensors, modules, unknown argument kinds, oversize intermediates) names the
node and op. Then the UNMODIFIED ``tinker`` SDK against ``opentinker serve``: the uploaded loss
and the same handle run client-side give equal loss, metrics, logprobs and weights after an
optimizer step; disallowed graphs and unknown or another session's loss ids are user errors
that leave the model working.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tinker
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from tinker import types
from tinker.lib.public_interfaces.custom_loss import encode_graph, trace_loss

from opentinker.engine import Engine, Example, ForwardRequest
from opentinker.engine.custom_loss import MAX_ELEMENTS, CustomLossError, compile_loss
from opentinker.lora import LoRAConfig
from opentinker.server.local import LocalServer
from tests.conftest import TEST_MODEL, local_server, make_examples
from tests.tolerances import assert_logprobs_close, assert_rel_close, assert_scalar_close

DEV_KEY = "tml-custom-loss-dev-key-0001"
T = torch.Tensor


# ---------------------------------------------------------------------------- losses under test
def clipped_pg(
    logprobs: T, sampler_logprobs: T, advantages: T
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ratio = torch.exp(logprobs - sampler_logprobs)
    clipped = torch.clamp(ratio, 0.8, 1.2)
    loss = -torch.minimum(ratio * advantages, clipped * advantages).sum()
    return loss, {"custom/ratio:mean": ratio.mean(), "custom/pg:sum": loss}


def shaped(logprobs: T, weights: T) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    n = logprobs.shape[0]
    soft = F.softplus(-logprobs).mean() + F.logsigmoid(logprobs)[1:].sum() / n
    masked = torch.where(weights > 0, logprobs, torch.zeros_like(logprobs)).sum()
    loss = -masked * math.sqrt(2.0) + 0.1 * soft + logprobs[..., :2].float().abs().max()
    return loss, {"custom/masked:sum": masked}


def scalar_scaled(logprobs: T, scale: T) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # a rank-0 input
    return -(logprobs * scale).sum(), {}


LOSSES: list[tuple[Any, dict[str, Any]]] = [
    (clipped_pg, {"logprobs": 1, "sampler_logprobs": 1, "advantages": 1}),
    (shaped, {"logprobs": 1, "weights": 1}),
    (scalar_scaled, {"logprobs": 1, "scale": 0}),
]


def _upload(fn: Any, ranks: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """What the SDK sends: (its traced handle, the CreateCustomLossRequest fields)."""
    handle = trace_loss(fn, ranks, "session")
    body = {
        "name": handle.name,
        "inputs": [i.model_dump(mode="json") for i in handle.inputs],
        "graph": encode_graph(handle).model_dump(mode="json"),
    }
    return handle, body


def _compile(fn: Any, ranks: dict[str, Any]) -> Any:
    _, body = _upload(fn, ranks)
    return compile_loss(body["name"], body["inputs"], body["graph"])


def _inputs(n: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "sampler_logprobs": -torch.rand(n, generator=g) * 3 - 1,
        "advantages": torch.randn(n, generator=g),
        "weights": (torch.rand(n, generator=g) > 0.3).float(),
        "scale": torch.tensor(0.7),
    }


# ---------------------------------------------------------------------------- unit: interpreter
@pytest.mark.parametrize(("fn", "ranks"), LOSSES, ids=[f.__name__ for f, _ in LOSSES])
def test_the_interpreter_equals_the_traced_graph_module(fn: Any, ranks: dict[str, Any]) -> None:
    handle, body = _upload(fn, ranks)
    loss = compile_loss(body["name"], body["inputs"], body["graph"])
    lp = -torch.rand(9, generator=torch.Generator().manual_seed(1)) * 4
    ins = _inputs(9, 2)
    ours_lp, theirs_lp = lp.clone().requires_grad_(True), lp.clone().requires_grad_(True)
    ours, ours_m = loss(ours_lp, ins)
    theirs, theirs_m = handle.graph(theirs_lp, *(ins[n] for n in handle.input_names))
    (ours + sum(ours_m.values(), torch.zeros(()))).backward()
    (theirs + sum(theirs_m.values(), torch.zeros(()))).backward()
    assert ours.item() == theirs.item()
    assert {k: v.item() for k, v in ours_m.items()} == {k: v.item() for k, v in theirs_m.items()}
    assert ours_lp.grad is not None and theirs_lp.grad is not None
    assert torch.equal(ours_lp.grad, theirs_lp.grad)


def test_engine_gradients_equal_the_client_side_path(engine: Engine) -> None:
    loss = _compile(*LOSSES[0])
    examples = make_examples(4, engine.vocab_size, seed=5)
    for i, ex in enumerate(examples):
        n = int(ex.tokens_T.shape[0])
        ins = _inputs(n, 10 + i)
        ex.inputs.update(sampler_logprobs=ins["sampler_logprobs"], advantages=ins["advantages"])
    server = engine.create_adapter(LoRAConfig(rank=4, seed=3))
    client = engine.create_adapter(LoRAConfig(rank=4, seed=3))
    engine.optim_step(server, _adam())  # LoRA B starts at 0 (so A's gradient is 0): move off it
    engine.optim_step(client, _adam())
    got = engine.forward_backward(ForwardRequest(server, examples, "custom", custom_loss=loss))
    # the SDK's client-side path: forward, dL/dlogprobs here, cross_entropy with weights -grad
    plain = [Example(ex.tokens_T, {"target_tokens": ex.inputs["target_tokens"]}) for ex in examples]
    fwd = engine.forward_backward(ForwardRequest(client, plain, backward=False))
    total, grads = 0.0, []
    for ex, out in zip(examples, fwd.outputs, strict=True):
        lp = out["logprobs"].clone().requires_grad_(True)
        value, _ = loss(lp, ex.inputs)
        value.backward()
        total += value.item()
        assert lp.grad is not None
        grads.append(Example(ex.tokens_T, {"target_tokens": ex.inputs["target_tokens"], "weights": -lp.grad}))
    engine.forward_backward(ForwardRequest(client, grads))
    assert_scalar_close(got.metrics["loss:sum"], total)
    ours, theirs = engine.pending_gradients(server), engine.pending_gradients(client)
    assert ours is not None and theirs is not None
    assert any(float(g.abs().max()) > 0 for g in ours.values())
    for name in theirs:
        assert_rel_close(ours[name], theirs[name])


def _adam() -> Any:
    from opentinker.engine import AdamParams

    return AdamParams(learning_rate=1e-2, eps=1e-4)


def test_the_embedded_client_runs_a_created_loss_like_its_callable_form(tmp_path: Path) -> None:
    from opentinker.client import Runtime, ServiceClient

    runtime = Runtime(tmp_path / "data")
    try:
        service = ServiceClient(runtime=runtime)
        loss = service.create_custom_loss(clipped_pg, LOSSES[0][1]).result()
        data = _data(3)
        adam = types.AdamParams(learning_rate=1e-2, eps=1e-4)

        def as_callable(
            ds: list[types.Datum], lps: list[torch.Tensor]
        ) -> tuple[torch.Tensor, dict[str, float]]:
            total = torch.zeros(())
            for d, lp in zip(ds, lps, strict=True):
                value, _ = clipped_pg(
                    lp, *(d.loss_fn_inputs[k].to_torch() for k in ("sampler_logprobs", "advantages"))
                )
                total = total + value
            return total, {}

        outs = []
        for fn in (loss, as_callable):
            tc = service.create_lora_training_client(TEST_MODEL, rank=4, seed=9)
            out = tc.forward_backward_custom(data, fn).result()  # type: ignore[arg-type]  # both forms
            tc.optim_step(adam).result()
            outs.append((out.metrics["loss:sum"], tc.forward(data[:1], "custom", custom_loss=loss).result()))
        (a, fa), (b, fb) = outs
        assert_scalar_close(a, b)
        assert_logprobs_close(
            fa.loss_fn_outputs[0]["logprobs"].tolist(), fb.loss_fn_outputs[0]["logprobs"].tolist()
        )
        with pytest.raises(CustomLossError, match="cannot be traced by torch.fx"):
            service.create_custom_loss(lambda logprobs: (np.exp(logprobs), {}), {"logprobs": 1}).result()
    finally:
        runtime.shutdown()


# ---------------------------------------------------------------------------- unit: refusals
def _graph(*nodes: dict[str, Any], out: Any = None) -> dict[str, Any]:
    head = [{"op": "placeholder", "name": "logprobs", "target": "logprobs"}]
    tail = [{"op": "output", "name": "output", "target": "output", "args": [out or _ret("logprobs")]}]
    return {"format": 1, "nodes": head + list(nodes) + tail}


def _ret(name: str) -> dict[str, Any]:
    return {"tuple": [{"ref": name}, {"dict": {}}]}


def _call(name: str, target: str, *args: Any, op: str = "call_function") -> dict[str, Any]:
    return {"op": op, "name": name, "target": target, "args": list(args), "kwargs": {}}


LP = {"ref": "logprobs"}
REFUSED = [
    ("import", _graph(_call("imp", "builtins.__import__", "os")), "node 'imp' calls 'builtins.__import__'"),
    ("importlib", _graph(_call("imp", "importlib.import_module", "os")), "calls 'importlib.import_module'"),
    ("open", _graph(_call("f", "builtins.open", "/etc/passwd")), "node 'f' calls 'builtins.open'"),
    ("open_bare", _graph(_call("f", "open", "/etc/passwd")), "node 'f' calls 'open'"),
    ("torch_load", _graph(_call("f", "torch.load", "/tmp/x.pt")), "node 'f' calls 'torch.load'"),
    ("from_file", _graph(_call("f", "torch.from_file", "/tmp/x")), "calls 'torch.from_file'"),
    ("getattr_module", _graph(_call("g", "getattr", "os", "system")), "node 'g': getattr on 'os' is refused"),
    ("getattr_dunder", _graph(_call("g", "getattr", LP, "__class__")), "getattr of '__class__' is refused"),
    ("eval", _graph(_call("e", "builtins.eval", "1")), "node 'e' calls 'builtins.eval'"),
    ("exec", _graph(_call("e", "exec", "x=1")), "node 'e' calls 'exec'"),
    ("pickle", _graph(_call("p", "pickle.loads", "gASVAAAA")), "node 'p' calls 'pickle.loads'"),
    ("randn", _graph(_call("r", "torch.randn", 5)), "node 'r' calls 'torch.randn'"),
    ("zeros", _graph(_call("z", "torch.zeros", 1 << 40)), "node 'z' calls 'torch.zeros'"),
    ("subprocess", _graph(_call("s", "subprocess.run", ["ls"])), "node 's' calls 'subprocess.run'"),
    ("method_item", _graph(_call("m", "item", LP, op="call_method")), "calls method 'item'"),
    ("method_backward", _graph(_call("m", "backward", LP, op="call_method")), "calls method 'backward'"),
    ("method_inplace", _graph(_call("m", "add_", LP, 1, op="call_method")), "calls method 'add_'"),
    (
        "method_reduce",
        _graph(_call("m", "__reduce_ex__", LP, 2, op="call_method")),
        "calls method '__reduce_ex__'",
    ),
    (
        "get_attr",
        _graph(_call("c", "_tensor_constant0", op="get_attr")),
        "node 'c' reads attribute '_tensor_constant0'",
    ),
    ("call_module", _graph(_call("c", "linear", LP, op="call_module")), "node 'c' calls module 'linear'"),
    ("unknown_ref", _graph(_call("x", "torch.exp", {"ref": "nowhere"})), "refers to 'nowhere'"),
    (
        "pickled_arg",
        _graph(_call("x", "torch.exp", {"pickle": "gASV"})),
        "argument {'pickle': 'gASV'} is not allowed",
    ),
    (
        "dtype",
        _graph(_call("x", "torch.exp", {"dtype": "object"})),
        "argument {'dtype': 'object'} is not allowed",
    ),
    (
        "bad_metric",
        _graph(out={"tuple": [LP, {"dict": {"loss": LP}}]}),
        "metric 'loss' must be a tensor named",
    ),
]


@pytest.mark.parametrize(
    ("graph", "message"), [(g, m) for _, g, m in REFUSED], ids=[i for i, _, _ in REFUSED]
)
def test_a_disallowed_graph_is_refused_naming_the_node_and_op(graph: dict[str, Any], message: str) -> None:
    with pytest.raises(CustomLossError, match=_literal(message)):
        compile_loss("bad", [{"name": "logprobs", "rank": 1}], graph)


def test_a_method_on_a_non_tensor_and_an_oversize_intermediate_are_refused_when_run() -> None:
    shape_then_method = _graph(
        _call("s", "getattr", LP, "shape"), _call("m", "sum", {"ref": "s"}, op="call_method")
    )
    loss = compile_loss("odd", [{"name": "logprobs", "rank": 1}], shape_then_method)
    with pytest.raises(CustomLossError, match="calls method 'sum' on a Size"):
        loss(torch.zeros(4), {})

    def cube(logprobs: T) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:  # T^3 elements: 27 M at T = 300
        outer = logprobs[:, None, None] * logprobs[None, :, None] * logprobs[None, None, :]
        return outer.sum(), {}

    big = _compile(cube, {"logprobs": 1})
    with pytest.raises(CustomLossError, match=f"over the limit of {MAX_ELEMENTS}"):
        big(torch.zeros(300), {})
    small, _ = big(torch.ones(4), {})  # the same graph on a short datum is fine
    assert float(small) == 64.0


def _literal(text: str) -> str:
    import re

    return re.escape(text)


# ---------------------------------------------------------------------------- the SDK
@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    with local_server(tmp_path_factory, "custom-loss-data", "--poll-timeout", "5") as srv:
        yield srv


@pytest.fixture(scope="module")
def service(server: LocalServer) -> Iterator[tinker.ServiceClient]:
    sc = tinker.ServiceClient(base_url=server.base_url, api_key=DEV_KEY)
    yield sc
    sc.close("success").result()


def _data(seed: int, n: int = 3) -> list[types.Datum]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        toks = [int(t) for t in rng.integers(3, 1000, int(rng.integers(8, 16)))]
        k = len(toks) - 1
        inputs: dict[str, Any] = {
            "target_tokens": toks[1:],
            "sampler_logprobs": (-rng.random(k) * 3 - 1).astype(np.float32),
            "advantages": rng.standard_normal(k).astype(np.float32),
        }
        out.append(types.Datum(model_input=types.ModelInput.from_ints(toks[:-1]), loss_fn_inputs=inputs))
    return out


def _weights(server: LocalServer, path: str) -> dict[str, torch.Tensor]:
    [file] = [p for p in Path(server.data_dir).rglob("adapter.safetensors") if path.split("/")[-1] in str(p)]
    return load_file(str(file))


def test_the_uploaded_loss_equals_the_same_loss_run_client_side(
    service: tinker.ServiceClient, server: LocalServer
) -> None:
    handle = service.create_custom_loss(clipped_pg, input_ranks=LOSSES[0][1]).result()
    assert handle.loss_id is not None  # uploaded: the server advertised custom_loss_server_side
    local = dataclasses.replace(handle, loss_id=None)  # the same traced loss, run by the SDK
    data, adam = _data(1), types.AdamParams(learning_rate=1e-2, eps=1e-4)
    plain = [
        types.Datum(
            model_input=d.model_input, loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"]}
        )
        for d in data
    ]
    trainers = []
    for _ in range(2):
        tc = service.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=11).result()
        tc.forward_backward(plain, "cross_entropy").result()  # leave B = 0, so A gets gradients too
        tc.optim_step(adam).result()
        trainers.append(tc)
    ours_tc, theirs_tc = trainers
    ours = ours_tc.forward_backward_custom(data, handle).result()
    theirs = theirs_tc.forward_backward_custom(data, local).result()
    assert_scalar_close(ours.metrics["loss:sum"], theirs.metrics["loss:sum"])
    for key in ("custom/ratio:mean", "custom/pg:sum"):
        assert_scalar_close(ours.metrics[key], theirs.metrics[key])
    for a, b in zip(ours.loss_fn_outputs, theirs.loss_fn_outputs, strict=True):
        assert_logprobs_close(a["logprobs"].tolist(), b["logprobs"].tolist())
    ours_tc.optim_step(adam).result()
    theirs_tc.optim_step(adam).result()
    after = [tc.forward(plain, "cross_entropy").result().loss_fn_outputs for tc in trainers]
    for a, b in zip(*after, strict=True):
        assert_logprobs_close(a["logprobs"].tolist(), b["logprobs"].tolist())
    saved = [tc.save_state(f"custom-{i}").result().path for i, tc in enumerate(trainers)]
    w_ours, w_theirs = (_weights(server, p) for p in saved)
    assert w_ours.keys() == w_theirs.keys()
    for name in w_ours:
        assert_rel_close(w_ours[name], w_theirs[name])


def _http(server: LocalServer) -> httpx.Client:
    return httpx.Client(base_url=f"{server.base_url}/api/v1", headers={"X-API-Key": DEV_KEY}, timeout=60)


def _result(http: httpx.Client, request_id: str) -> dict[str, Any]:
    for _ in range(100):
        r = http.post("/retrieve_future", json={"request_id": request_id}).json()
        if r.get("type") != "try_again":
            return r
    raise AssertionError("no result")


@pytest.mark.parametrize(("case", "graph", "message"), [REFUSED[0], REFUSED[2], REFUSED[6], REFUSED[11]])
def test_the_server_refuses_a_disallowed_graph_with_a_user_error(
    server: LocalServer, case: str, graph: dict[str, Any], message: str
) -> None:
    with _http(server) as http:
        sid = http.post("/create_session", json={"tags": [], "sdk_version": "raw"}).json()["session_id"]
        body = {
            "session_id": sid,
            "custom_loss_seq_id": 0,
            "name": case,
            "inputs": [{"name": "logprobs", "rank": 1}],
            "graph": graph,
        }
        err = _result(http, http.post("/create_custom_loss", json=body).json()["request_id"])
    assert err["category"] == "user" and message in err["error"], err


def test_unknown_and_other_sessions_loss_ids_are_user_errors_and_the_model_goes_on(
    service: tinker.ServiceClient, server: LocalServer
) -> None:
    tc = service.create_lora_training_client(base_model=TEST_MODEL, rank=2, seed=4).result()
    data = _data(2, n=1)
    with pytest.raises(Exception, match="unknown custom loss 'nope'"):
        tc.forward_backward(data, "custom", {"loss_id": "nope"}).result()
    other = tinker.ServiceClient(base_url=server.base_url, api_key=DEV_KEY)
    try:
        theirs = other.create_custom_loss(shaped, input_ranks=LOSSES[1][1]).result()
        with pytest.raises(Exception, match="belongs to another session"):
            tc.forward_backward(data, "custom", {"loss_id": theirs.loss_id or ""}).result()
    finally:
        other.close("success").result()
    # the refused requests consumed their seq_ids: the model's next request runs
    plain = [
        types.Datum(
            model_input=data[0].model_input,
            loss_fn_inputs={"target_tokens": data[0].loss_fn_inputs["target_tokens"]},
        )
    ]
    out = tc.forward_backward(plain, "cross_entropy").result()
    assert math.isfinite(out.metrics["loss:sum"])
