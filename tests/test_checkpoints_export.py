"""Checkpoints (atomic, checksummed, refused when torn or foreign) and PEFT export (invariant 5)."""

from __future__ import annotations

import json

import pytest
import torch

from opentinker.engine import AdamParams, CheckpointError, Engine, ForwardRequest
from opentinker.lora import LoRAConfig
from tests.conftest import make_examples
from tests.tolerances import assert_logprobs_close, assert_rel_close


def _trained(engine: Engine, **cfg) -> str:
    aid = engine.create_adapter(LoRAConfig(**{"rank": 4, "seed": 0, **cfg}))
    for s in range(2):
        engine.forward_backward(ForwardRequest(aid, make_examples(3, engine.vocab_size, seed=s)))
        engine.optim_step(aid, AdamParams(learning_rate=2e-2))
    return aid


def test_torn_or_modified_checkpoint_is_detected(engine: Engine, tmp_path) -> None:
    aid = _trained(engine)
    path = engine.save_state(aid, tmp_path / "ck")
    f = path / "adapter.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) // 2])  # torn write
    n = len(engine.adapter_ids())
    with pytest.raises(CheckpointError, match="checksum"):
        engine.load_state(path)
    assert len(engine.adapter_ids()) == n
    (path / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="missing manifest.json"):
        engine.load_state(path)


def test_save_refuses_to_clobber_unless_asked_and_lineage_is_recorded(engine: Engine, tmp_path) -> None:
    aid = _trained(engine)
    engine.save_state(aid, tmp_path / "ck", meta={"sampler_versions": ["x@v1"]})
    with pytest.raises(CheckpointError, match="already exists"):
        engine.save_state(aid, tmp_path / "ck")
    child = engine.load_state(tmp_path / "ck")
    engine.optim_step(child, AdamParams(learning_rate=1e-3))
    engine.save_state(child, tmp_path / "ck2")
    meta = json.loads((tmp_path / "ck2" / "manifest.json").read_text())["meta"]
    assert meta["parent"] == str(tmp_path / "ck") and meta["step"] == 3
    first = json.loads((tmp_path / "ck" / "manifest.json").read_text())["meta"]
    assert first["sampler_versions"] == ["x@v1"] and first["base_model"] == engine.base.name
    engine.save_state(child, tmp_path / "ck", overwrite=True)
    assert not list(tmp_path.glob(".ck*"))  # no temp folders left behind


def test_checkpoint_of_another_base_model_is_refused(engine: Engine, tmp_path) -> None:
    aid = _trained(engine)
    path = engine.save_state(aid, tmp_path / "ck")
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["meta"]["base_model"] = "some/other-model"
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="some/other-model"):
        engine.load_state(path)


def test_load_into_existing_adapter_with_other_config_changes_nothing(engine: Engine, tmp_path) -> None:
    aid = _trained(engine)
    other = _trained(engine, rank=8)
    path = engine.save_state(aid, tmp_path / "ck")
    before = {k: v.detach().clone() for k, v in engine.adapter_weights(other).state_dict().items()}
    with pytest.raises(CheckpointError, match="LoRA config"):
        engine.load_state(path, into=other)
    after = engine.adapter_weights(other).state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_load_into_an_adapter_of_another_seed_takes_the_checkpoints_weights(engine: Engine, tmp_path) -> None:
    """The seed only chose an adapter's initial weights: a checkpoint of the same rank, scale and
    targets loads into it (with and without its optimizer state, and as an in-memory fork)."""
    aid = _trained(engine)
    path = engine.save_state(aid, tmp_path / "ck")
    want = engine.adapter_weights(aid).state_dict()
    for optimizer in (False, True):
        other = engine.create_adapter(LoRAConfig(rank=4, seed=7))
        engine.load_state(path, optimizer=optimizer, into=other)
        got = engine.adapter_weights(other).state_dict()
        assert all(torch.equal(got[k], want[k]) for k in want)
    forked = engine.create_adapter(LoRAConfig(rank=4, seed=9))
    engine.fork_adapter(aid, into=forked)
    assert all(torch.equal(engine.adapter_weights(forked).state_dict()[k], want[k]) for k in want)


@pytest.mark.parametrize("cfg", [dict(rank=4), dict(rank=8, alpha=16, train_mlp=False, train_unembed=False)])
def test_inv5_peft_export_matches_engine_logits(engine: Engine, tmp_path, cfg) -> None:
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    aid = _trained(engine, **cfg)
    out = engine.export_peft(aid, tmp_path / "peft")
    assert (out / "adapter_model.safetensors").exists() and (out / "adapter_config.json").exists()
    base = AutoModelForCausalLM.from_pretrained(engine.base.path, dtype=torch.float32).eval()
    model = peft.PeftModel.from_pretrained(base, str(out)).eval()
    tokens = make_examples(3, engine.vocab_size, seed=7, min_len=12, max_len=13)
    x = torch.stack([e.tokens_T for e in tokens])
    with torch.no_grad():
        ref = model(input_ids=x).logits
        with engine.routing([aid] * len(tokens)):
            ours = engine.base.model(input_ids=x.to(engine.device)).logits.cpu()
    assert_logprobs_close(ours.log_softmax(-1).flatten(), ref.log_softmax(-1).flatten())
    assert_rel_close(ours, ref)
    with torch.no_grad(), model.disable_adapter():
        plain = model(input_ids=x).logits
    assert (ours - plain).abs().max() > 1e-3  # the adapter really changes the function
