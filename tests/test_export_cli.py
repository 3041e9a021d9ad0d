"""``opentinker export``: a checkpoint in a data dir (no server running) as a PEFT folder or, with
``--merged``, a full HF model. Each is loaded by the library users would load it with (``peft``,
``transformers``) and compared with the engine's own logprobs of the same weights; the tiny model
ties its unembedding to its embedding, so the merged export's untying is exercised too. Bad paths
and folders get one clear line and exit 2, writing nothing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from tinker import types

from opentinker.cli.main import main
from opentinker.client import Runtime, ServiceClient
from tests.conftest import TEST_MODEL
from tests.tolerances import assert_logprobs_close

TOKENS = [int(t) for t in np.random.default_rng(3).integers(3, 1000, 20)]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, np.ndarray]:
    """A data dir holding one trained checkpoint (attention, MLP and unembedding LoRA), its path,
    and the engine's logprobs of ``TOKENS`` under it."""
    data = tmp_path_factory.mktemp("export-data")
    runtime = Runtime(data)
    try:
        tc = ServiceClient(runtime=runtime).create_lora_training_client(TEST_MODEL, rank=4, seed=0)
        datum = types.Datum(
            model_input=types.ModelInput.from_ints(TOKENS[:-1]),
            loss_fn_inputs={"target_tokens": TOKENS[1:]},  # type: ignore[dict-item]
        )
        for _ in range(3):
            tc.forward_backward([datum], "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=3e-2)).result()
        path = tc.save_state("final").result().path
        lp = tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    finally:
        runtime.shutdown()
    return data, path, lp


def _target_logprobs(model: torch.nn.Module) -> np.ndarray:
    x = torch.tensor([TOKENS[:-1]])
    with torch.no_grad():
        logp = model(input_ids=x).logits.float().log_softmax(-1)[0]
    return logp.gather(-1, torch.tensor(TOKENS[1:])[:, None])[:, 0].numpy()


def test_merged_export_loads_in_transformers_and_equals_base_plus_adapter(trained, tmp_path, capsys) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data, path, engine_lp = trained
    out = tmp_path / "merged"
    assert main(["export", path, str(out), "--merged", "--data-dir", str(data)]) == 0
    assert "merged model written" in capsys.readouterr().out
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # still tied
    assert AutoTokenizer.from_pretrained(str(out)).encode("hello")  # the tokenizer came along
    merged_lp = _target_logprobs(model)
    assert_logprobs_close(merged_lp, engine_lp)
    base = AutoModelForCausalLM.from_pretrained(Runtime(data).base_model_info(TEST_MODEL).path).eval()
    assert np.abs(_target_logprobs(base) - engine_lp).max() > 1e-2  # the adapter really is in it


def test_peft_export_loads_in_peft_and_equals_the_engine(trained, tmp_path) -> None:
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    data, path, engine_lp = trained
    out = tmp_path / "adapter"
    assert main(["export", path, str(out), "--data-dir", str(data)]) == 0
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "opentinker/tiny"  # a name, never a local folder
    assert "q_proj" in config["target_modules"] and "lm_head" in config["target_modules"]
    base_path = Runtime(data).base_model_info(TEST_MODEL).path
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.float32).eval()
    model = peft.PeftModel.from_pretrained(base, str(out)).eval()
    assert_logprobs_close(_target_logprobs(model), engine_lp)


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("not-a-path", "malformed checkpoint path"),
        ("tinker://sess-x:train:0/weights/../up", "malformed checkpoint path"),
        ("tinker://sess-x:train:0/weights/missing", "no checkpoint tinker://sess-x:train:0/weights/missing"),
        ("tinker://sess-x:train:0/external_weights/e", "already exported"),
    ],
)
def test_bad_paths_get_one_clear_error(trained, tmp_path, capsys, path: str, message: str) -> None:
    data, _, _ = trained
    out = tmp_path / "out"
    assert main(["export", path, str(out), "--data-dir", str(data)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_bad_folders_get_one_clear_error(trained, tmp_path, capsys) -> None:
    data, path, _ = trained
    assert main(["export", path, str(tmp_path / "o"), "--data-dir", str(tmp_path / "nowhere")]) == 2
    assert "is not an OpenTinker data dir" in capsys.readouterr().err
    assert not (tmp_path / "nowhere").exists()  # a typo does not create a data dir
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    assert main(["export", path, str(full), "--data-dir", str(data)]) == 2
    assert "is not an empty folder" in capsys.readouterr().err
    assert [p.name for p in full.iterdir()] == ["keep.txt"]
