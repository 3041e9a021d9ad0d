"""Optimizer selection at model creation (the SDK's ``optimizer_config``), driven by the
UNMODIFIED ``tinker`` SDK against ``opentinker serve``.

``AdamOptimizerConfig`` trains exactly like the default (no config); ``DimuonOptimizerConfig``
is refused with an error saying why (no public definition precise enough to implement);
an unknown type, or an AdamW config with fields AdamW does not take, is refused by name; an
``optim_step`` with another optimizer's hyperparameters is refused and changes nothing. Each
refusal creates nothing and leaves the model (and server) working.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import tinker
from tinker import types
from tinker.types.optimizer import OptimizerConfigBase

from opentinker.engine import EngineError
from opentinker.engine.optim import check_optimizer_config, check_step_params
from opentinker.server.local import LocalServer
from tests.conftest import TEST_MODEL

DEV_KEY = "tml-optimizers-dev-key-0001"
TOKENS = [int(t) for t in np.random.default_rng(3).integers(3, 1000, 20)]


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tinker.ServiceClient]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TINKER_TELEMETRY", "0")
        for var in ("TINKER_API_KEY", "TINKER_BASE_URL"):
            mp.delenv(var, raising=False)
        args = ["--dev", "--base-model", TEST_MODEL, "--poll-timeout", "5"]
        with LocalServer(args, data_dir=tmp_path_factory.mktemp("optim-data")) as srv:
            sc = tinker.ServiceClient(base_url=srv.base_url, api_key=DEV_KEY)
            sc.rest_for_tests = tinker.RestClient(base_url=srv.base_url, api_key=DEV_KEY)  # type: ignore[attr-defined]
            yield sc
            sc.close("success").result()


def _datum() -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS[:-1]),
        loss_fn_inputs={"target_tokens": TOKENS[1:]},  # type: ignore[dict-item]  # the SDK converts
    )


def _step(tc: tinker.TrainingClient) -> list[float]:
    """One SFT step, then the logprobs after it."""
    tc.forward_backward([_datum()], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    out = tc.forward([_datum()], "cross_entropy").result()
    return list(out.loss_fn_outputs[0]["logprobs"].tolist())


def _run_count(service: tinker.ServiceClient) -> int:
    rest: tinker.RestClient = service.rest_for_tests  # type: ignore[attr-defined]
    return len(rest.list_training_runs(limit=1000).result().training_runs)


# ---------------------------------------------------------------------------- unit
def test_check_optimizer_config_accepts_adamw_and_refuses_the_rest_by_name() -> None:
    assert check_optimizer_config(None) == "adamw"
    assert check_optimizer_config({"type": "adamw"}) == "adamw"
    with pytest.raises(
        EngineError, match="Dimuon optimizer .* not supported .* does not define its update rule"
    ):
        check_optimizer_config({"type": "dimuon", "version": 1})
    with pytest.raises(EngineError, match="unknown optimizer type 'lion'"):
        check_optimizer_config({"type": "lion"})
    with pytest.raises(EngineError, match="unknown optimizer type None"):
        check_optimizer_config({})
    with pytest.raises(EngineError, match="takes no other fields, got 'lr'"):
        check_optimizer_config({"type": "adamw", "lr": 1.0})
    check_step_params(None)
    check_step_params("adamw")
    with pytest.raises(EngineError, match="optim_step got DimuonParams"):
        check_step_params("dimuon")


# ---------------------------------------------------------------------------- the SDK
def test_adam_optimizer_config_trains_exactly_like_the_default(service: tinker.ServiceClient) -> None:
    default = service.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=7).result()
    adam = service.create_lora_training_client(
        base_model=TEST_MODEL, rank=4, seed=7, optimizer=types.AdamOptimizerConfig()
    ).result()
    assert adam.get_info().optimizer_config == types.AdamOptimizerConfig()
    after_default, after_adam = _step(default), _step(adam)
    assert after_adam == after_default  # same seed, same data, same optimizer: bitwise equal


@pytest.mark.parametrize(
    ("optimizer", "message"),
    [
        (types.DimuonOptimizerConfig(), "Dimuon optimizer (DimuonOptimizerConfig) is not supported"),
        (OptimizerConfigBase(type="sgd"), "unknown optimizer type 'sgd'"),
        (OptimizerConfigBase(type="adamw", momentum=0.5), "takes no other fields, got 'momentum'"),  # type: ignore[call-arg]  # extra="allow"
    ],
)
def test_an_optimizer_this_server_does_not_run_is_refused_and_creates_nothing(
    service: tinker.ServiceClient, optimizer: types.OptimizerConfig, message: str
) -> None:
    before = _run_count(service)
    with pytest.raises(Exception, match=message.replace("(", r"\(").replace(")", r"\)")):
        service.create_lora_training_client(base_model=TEST_MODEL, rank=4, optimizer=optimizer).result()
    assert _run_count(service) == before
    # the service still creates and trains a model
    tc = service.create_lora_training_client(base_model=TEST_MODEL, rank=2, seed=1).result()
    assert len(_step(tc)) == len(TOKENS) - 1


def test_an_optim_step_with_another_optimizers_params_is_refused_and_changes_nothing(
    service: tinker.ServiceClient,
) -> None:
    tc = service.create_lora_training_client(base_model=TEST_MODEL, rank=4, seed=2).result()
    tc.forward_backward([_datum()], "cross_entropy").result()
    before = tc.forward([_datum()], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    with pytest.raises(
        Exception, match="optim_step got DimuonParams, but this model was created with the adamw"
    ):
        tc.optim_step(types.DimuonParams(learning_rate=1e-2)).result()
    after = tc.forward([_datum()], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    assert after == before
    # the refused step consumed its seq_id; the model's next steps run (gradients still pending)
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    stepped = tc.forward([_datum()], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    assert stepped != before
