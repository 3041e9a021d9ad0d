"""The SDK 0.38 sampling extras over HTTP, through the unmodified SDK, against the embedded client:
``topk_sample_logprobs``, ``target_prompt_logprobs`` (dense and sparse CSR), ``prompt_alt_tokens_k``
and ``prompt_logprobs_last_n``.

Both paths run the same tiny base model with the same seeds, so they sample the same tokens; the
numbers they report are compared within fp32 tolerance (``LOGPROB_ATOL``: the HTTP server and the
embedded runtime are separate processes, whose batches may be padded differently). Each extra is
also checked against the plain prompt / sampled logprobs it must agree with. Bad input → 400
naming the field.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tinker
import torch
from tinker import types

import opentinker
from opentinker.client import Runtime
from opentinker.server.local import LocalServer
from tests.conftest import TEST_MODEL
from tests.tolerances import LOGPROB_ATOL, assert_logprobs_close

KEY = "tml-sample-extras"
PROMPT = [5, 17, 42, 99, 7, 250, 31, 64, 12]


@pytest.fixture(scope="module", autouse=True)
def _env() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TINKER_TELEMETRY", "0")
        for var in ("TINKER_API_KEY", "TINKER_BASE_URL", "TINKER_PROJECT_ID"):
            mp.delenv(var, raising=False)
        yield


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    with LocalServer(
        ["--dev", "--base-model", TEST_MODEL], data_dir=tmp_path_factory.mktemp("extras")
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def samplers(server: LocalServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Any]]:
    """(over HTTP, embedded) samplers of the bare base model."""
    sdk = tinker.ServiceClient(base_url=server.base_url, api_key=KEY)
    remote = sdk.create_sampling_client(base_model=TEST_MODEL).result()
    runtime = Runtime(Path(tmp_path_factory.mktemp("embedded")))
    local = opentinker.ServiceClient(runtime=runtime).create_sampling_client(base_model=TEST_MODEL)
    yield remote, local
    runtime.shutdown()


def _both(
    samplers: tuple[Any, Any], *args: Any, **kw: Any
) -> tuple[types.SampleResponse, types.SampleResponse]:
    remote, local = samplers
    return remote.sample(*args, **kw).result(), local.sample(*args, **kw).result()


PARAMS = types.SamplingParams(max_tokens=6, temperature=1.0, seed=3, stop=[])


def test_topk_sample_logprobs_match_the_embedded_client(samplers: tuple[Any, Any]) -> None:
    k = 5
    remote, local = _both(samplers, types.ModelInput.from_ints(PROMPT), 3, PARAMS, topk_sample_logprobs=k)
    included = 0
    for r, e in zip(remote.sequences, local.sequences, strict=True):
        assert r.tokens == e.tokens and r.topk_logprobs is not None and e.topk_logprobs is not None
        assert r.logprobs is not None and len(r.topk_logprobs) == len(r.tokens)
        for tok, lp, rtop, etop in zip(r.tokens, r.logprobs, r.topk_logprobs, e.topk_logprobs, strict=True):
            assert rtop is not None and etop is not None and len(rtop) == len(etop) == k
            assert_logprobs_close([v for _, v in rtop], [v for _, v in etop])
            values = [v for _, v in rtop]
            assert values == sorted(values, reverse=True)
            # ids agree except where two logprobs tie within rounding
            for (ri, rv), (ei, _) in zip(rtop, etop, strict=True):
                assert ri == ei or sum(abs(v - rv) <= LOGPROB_ATOL for v in values) > 1
            if lp > values[-1] + LOGPROB_ATOL:  # the sampled token is among the k most likely
                assert tok in [t for t, _ in rtop]
                assert_logprobs_close([dict(rtop)[tok]], [lp])
                included += 1
    assert included > 0  # the check above ran
    plain = samplers[0].sample(types.ModelInput.from_ints(PROMPT), 1, PARAMS).result()
    assert plain.sequences[0].topk_logprobs is None  # only when asked


def test_target_prompt_logprobs_dense_and_sparse(samplers: tuple[Any, Any]) -> None:
    n = len(PROMPT) - 1
    ids = torch.full((n, 3), -1, dtype=torch.long)
    ids[:, 0] = torch.tensor(PROMPT[1:])  # the true next token: must equal the prompt logprob
    ids[2:, 1] = 3
    ids[5, 2] = 400
    prompt = types.ModelInput.from_ints(PROMPT)
    params = types.SamplingParams(max_tokens=1, seed=0)
    for target in (types.TensorData.from_torch(ids), types.TensorData.from_torch_sparse(ids, pad_value=-1)):
        remote, local = _both(
            samplers, prompt, 1, params, include_prompt_logprobs=True, target_prompt_logprobs=target
        )
        assert remote.target_prompt_logprobs is not None and local.target_prompt_logprobs is not None
        sparse = target.sparse_crow_indices is not None
        assert (remote.target_prompt_logprobs.sparse_crow_indices is not None) == sparse
        got = remote.target_prompt_logprobs.to_numpy()
        assert got.shape == (n, 3)
        assert_logprobs_close(got.ravel().tolist(), local.target_prompt_logprobs.to_numpy().ravel().tolist())
        assert remote.prompt_logprobs is not None
        assert_logprobs_close(got[:, 0].tolist(), [x for x in remote.prompt_logprobs[1:] if x is not None])
        assert np.all(got[ids.numpy() == -1] == 0.0) and np.all(got[ids.numpy() >= 0] < 0)
        if sparse:
            assert remote.target_prompt_logprobs.sparse_col_indices == target.sparse_col_indices


def test_prompt_alt_tokens_are_draws_with_their_logprobs(samplers: tuple[Any, Any]) -> None:
    k, n = 4, len(PROMPT) - 1
    prompt = types.ModelInput.from_ints(PROMPT)
    remote, local = _both(samplers, prompt, 1, PARAMS, prompt_alt_tokens_k=k)
    assert remote.prompt_alt_tokens is not None and local.prompt_alt_tokens is not None
    toks = remote.prompt_alt_tokens.tokens.to_numpy()
    lps = remote.prompt_alt_tokens.logprobs.to_numpy()
    assert toks.shape == lps.shape == (n, k)
    np.testing.assert_array_equal(toks, local.prompt_alt_tokens.tokens.to_numpy())  # same seed
    assert_logprobs_close(lps.ravel().tolist(), local.prompt_alt_tokens.logprobs.to_numpy().ravel().tolist())
    # their logprobs are the model's at T = 1: what target_prompt_logprobs reports for them
    scored = (
        samplers[0]
        .sample(prompt, 1, PARAMS, target_prompt_logprobs=types.TensorData.from_numpy(toks.astype(np.int64)))
        .result()
    )
    assert scored.target_prompt_logprobs is not None
    assert_logprobs_close(scored.target_prompt_logprobs.to_numpy().ravel().tolist(), lps.ravel().tolist())
    greedy = (
        samplers[0]
        .sample(prompt, 1, types.SamplingParams(max_tokens=1, temperature=0.0), prompt_alt_tokens_k=2)
        .result()
    )
    assert greedy.prompt_alt_tokens is not None
    g = greedy.prompt_alt_tokens.tokens.to_numpy()
    top = samplers[0].sample(prompt, 1, PARAMS, topk_prompt_logprobs=1).result().topk_prompt_logprobs
    assert top is not None
    np.testing.assert_array_equal(g[:, 0], g[:, 1])
    assert g[:, 0].tolist() == [row[0][0] for row in top[1:] if row]


def test_prompt_logprobs_last_n(samplers: tuple[Any, Any]) -> None:
    prompt = types.ModelInput.from_ints(PROMPT)
    params = types.SamplingParams(max_tokens=1, seed=0)
    full = samplers[0].sample(prompt, 1, params, include_prompt_logprobs=True).result().prompt_logprobs
    remote, local = _both(
        samplers,
        prompt,
        1,
        params,
        include_prompt_logprobs=True,
        topk_prompt_logprobs=2,
        prompt_logprobs_last_n=3,
    )
    for res in (remote, local):
        assert res.prompt_logprobs is not None and full is not None and res.topk_prompt_logprobs is not None
        assert res.prompt_logprobs[:-3] == [None] * (len(PROMPT) - 3)
        assert_logprobs_close(res.prompt_logprobs[-3:], full[-3:])  # type: ignore[arg-type]
        assert all(row is None for row in res.topk_prompt_logprobs[:-3])


def _sample_body(**extra: Any) -> dict[str, Any]:
    return {
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": PROMPT}]},
        "sampling_params": {"max_tokens": 1},
        "base_model": TEST_MODEL,
        **extra,
    }


def test_bad_extras_are_400_naming_the_field(server: LocalServer, samplers: tuple[Any, Any]) -> None:
    n = len(PROMPT) - 1

    def tensor(ids: list[list[int]], dtype: str = "int64") -> dict[str, Any]:
        return {"data": [x for row in ids for x in row], "dtype": dtype, "shape": [len(ids), len(ids[0])]}

    cases = [
        ({"target_prompt_logprobs": tensor([[1]] * (n - 1))}, "len(prompt) - 1"),
        ({"target_prompt_logprobs": tensor([[-1]] * n)}, "names no token id"),
        ({"target_prompt_logprobs": tensor([[1]] * n, "float32")}, "int64"),
        ({"target_prompt_logprobs": {"data": [1], "dtype": "int64", "bogus": 1}}, "target_prompt_logprobs"),
        ({"prompt_alt_tokens_k": -2}, "prompt_alt_tokens_k"),
        ({"prompt_alt_tokens_k": 10**6}, "prompt_alt_tokens_k"),
        ({"prompt_logprobs_last_n": 2}, "set prompt_logprobs"),
        ({"prompt_logprobs": True, "prompt_logprobs_last_n": n + 1}, "prompt_logprobs_last_n"),
    ]
    with httpx.Client(base_url=f"{server.base_url}/api/v1", headers={"X-API-Key": KEY}, timeout=60) as http:
        for extra, message in cases:
            r = http.post("/asample", json=_sample_body(**extra))
            assert r.status_code == 400, (extra, r.text)
            assert message in r.json()["detail"], (extra, r.text)
            assert str(server.data_dir) not in r.text
    # through the SDK too (it checks only dtype and rank itself): a BadRequestError naming it
    bad = types.TensorData.from_torch(torch.ones(2, 1, dtype=torch.long))
    with pytest.raises(tinker.BadRequestError, match="len\\(prompt\\) - 1"):
        samplers[0].sample(types.ModelInput.from_ints(PROMPT), 1, PARAMS, target_prompt_logprobs=bad).result()
    # a token id outside the vocabulary: the request fails with a user error naming it
    huge = types.TensorData.from_torch(torch.full((n, 1), 10**7, dtype=torch.long))
    with pytest.raises(tinker.RequestFailedError, match="outside the vocabulary"):
        samplers[0].sample(
            types.ModelInput.from_ints(PROMPT), 1, PARAMS, target_prompt_logprobs=huge
        ).result()
    with pytest.raises(opentinker.engine.EngineError, match="len\\(prompt\\) - 1"):  # embedded alike
        samplers[1].sample(types.ModelInput.from_ints(PROMPT), 1, PARAMS, target_prompt_logprobs=bad)


# ---------------------------------------------------------------------------- kind="inflight"
def test_inflight_samplers_follow_the_newest_save(server: LocalServer) -> None:
    """Every inflight sampler of a training model serves its next requests on the model's newest
    inflight save; snapshot samplers keep their weights."""
    sc = tinker.ServiceClient(base_url=server.base_url, api_key=KEY)
    tc = sc.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=0).result()
    prompt = types.ModelInput.from_ints(PROMPT)

    def lps(sampler: Any) -> list[float]:
        return [float(x) for x in sampler.compute_logprobs(prompt).result()[1:]]

    def train(steps: int) -> None:
        toks = [3, *PROMPT, 8]
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(toks[:-1]),
            loss_fn_inputs={"target_tokens": types.TensorData.from_numpy(np.asarray(toks[1:], np.int64))},
        )
        for _ in range(steps):
            tc.forward_backward([datum], "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()

    a = tc.save_weights_and_get_sampling_client(kind="inflight").result()
    w1 = tc.save_weights_and_get_sampling_client().result()  # a fixed snapshot of the same weights
    first = lps(w1)
    assert_logprobs_close(lps(a), first)
    train(3)
    b = tc.save_weights_and_get_sampling_client(kind="inflight").result()
    w2 = tc.save_weights_and_get_sampling_client().result()
    second = lps(w2)
    assert max(abs(x - y) for x, y in zip(first, second, strict=True)) > 1e-2  # the weights moved
    assert_logprobs_close(lps(b), second)
    assert_logprobs_close(lps(a), second)  # the earlier inflight sampler follows
    assert_logprobs_close(lps(w1), first)  # a snapshot does not
    train(2)
    c = tc.save_weights_and_get_sampling_client(kind="inflight").result()
    third = lps(c)
    for sampler in (a, b):  # two updates on: the first target is released, the samplers go on
        assert_logprobs_close(lps(sampler), third)
    out = a.sample(prompt, 2, PARAMS).result()
    assert len(out.sequences) == 2 and all(len(s.tokens) == 6 for s in out.sequences)
    assert_logprobs_close(lps(w2), second)
    with httpx.Client(base_url=f"{server.base_url}/api/v1", headers={"X-API-Key": KEY}, timeout=60) as http:
        r = http.post(
            "/save_weights_for_sampler",
            json={"model_id": tc.model_id, "sampling_session_seq_id": 99, "kind": "live"},
        )
        assert r.status_code == 422 and "kind" in r.text
