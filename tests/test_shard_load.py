"""A sharded group's member loads only its shard (``cluster/shard_load.py``): the base built on
the meta device, sharded with FSDP2, then each member's rows read from the safetensors files.

The reference is the same model loaded whole (``load_base_model``). Two real processes over gloo
(K = 2) build the base as a trainer worker of a group does (meta device, the LoRA layers
attached, ``shard_model``, ``materialise``) and run a forward on the same tokens: its logits must
equal the whole model's within fp32 rounding (the same kernels on the same weights: in practice
bit for bit), on the tiny model and on SmolLM2 (tied embedding, 30 layers). Each member must have
read about half the base's bytes and hold about half of it. In this process (no group: every
weight whole) the same path must give the whole model's logits, and a folder whose files lack a
weight, or hold one of another shape, is refused naming it.
"""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from opentinker.cluster.shard_load import checkpoint_names, materialise
from opentinker.engine import EngineError
from opentinker.lora.layers import MultiLoRA
from opentinker.models import load_base_model
from opentinker.models.registry import SMOLLM2, TINY, resolve_model_path
from tests.tolerances import REL, assert_rel_close

TOKENS = torch.arange(3, 43).reshape(2, 20)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _member(rank: int, world: int, model: str, port: int, out: str) -> None:
    """One member of a group of ``world``: the worker's loading path, then one forward."""
    import torch.distributed as dist

    from opentinker.cluster.shard import shard_model
    from opentinker.cluster.trainer_worker import _local_bytes

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        base = load_base_model(model, device="meta")
        names = checkpoint_names(base.model)
        MultiLoRA.attach(base.model)  # the engine wraps the projections before the group forms
        shard_model(base.model, world, "cpu")
        read = materialise(base.model, names, base.path, "cpu")
        held = _local_bytes(base.model)  # before the forward (FSDP2 keeps the root gathered after it)
        with torch.no_grad():
            logits = base.model(input_ids=TOKENS).logits
        torch.save({"logits": logits, "read": read, "held": held}, out)
    finally:
        dist.destroy_process_group()


def _whole(model: str) -> tuple[torch.Tensor, int]:
    base = load_base_model(model)
    with torch.no_grad():
        logits = base.model(input_ids=TOKENS).logits
    return logits, sum(p.numel() * p.element_size() for p in base.model.parameters())


@pytest.mark.slow  # two spawned processes importing torch and transformers: ~30-90 s here
@pytest.mark.parametrize("model", [TINY, SMOLLM2])
def test_each_member_reads_its_shard_and_the_forward_equals_the_whole_model(
    model: str, tmp_path: Path
) -> None:
    import torch.multiprocessing as mp

    world, port = 2, _free_port()
    outs = [str(tmp_path / f"member{r}.pt") for r in range(world)]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_member, args=(r, world, model, port, outs[r])) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=600)
        assert p.exitcode == 0, f"member exited with {p.exitcode}"
    want, full = _whole(model)
    for out in outs:
        got = torch.load(out)
        assert_rel_close(got["logits"], want, REL)
        # half the base each, read and held (FSDP pads a weight's rows to an even split)
        assert 0.45 * full <= got["read"] <= 0.55 * full, (got["read"], full)
        assert 0.45 * full <= got["held"] <= 0.55 * full, (got["held"], full)


def test_an_unsharded_meta_model_filled_from_its_files_equals_the_loaded_one() -> None:
    base = load_base_model(TINY, device="meta")
    names = checkpoint_names(base.model)
    tied = base.model.get_output_embeddings().weight is base.model.get_input_embeddings().weight
    assert tied  # the tiny model ties its unembedding: one weight under two names, read once
    read = materialise(base.model, names, base.path, "cpu")
    with torch.no_grad():
        got = base.model(input_ids=TOKENS).logits
    want, full = _whole(TINY)
    assert read == full
    assert torch.equal(got, want)


def _broken_copy(tmp_path: Path, change: str) -> str:
    folder = tmp_path / change
    shutil.copytree(resolve_model_path(TINY), folder)
    weights = load_file(folder / "model.safetensors")
    if change == "missing":
        del weights["model.layers.1.mlp.up_proj.weight"]
    else:
        weights["model.layers.1.mlp.up_proj.weight"] = weights["model.layers.1.mlp.up_proj.weight"][:-1]
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return str(folder)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("missing", r"weights have no 'model\.layers\.1\.mlp\.up_proj\.weight' to shard"),
        (
            "shape",
            r"weight 'model\.layers\.1\.mlp\.up_proj\.weight' is \[351, 128\] in its files, not \[352, 128\]",
        ),
    ],
)
def test_a_weight_missing_or_of_another_shape_is_refused_naming_it(
    tmp_path: Path, change: str, message: str
) -> None:
    base = load_base_model(_broken_copy(tmp_path, change), device="meta")
    with pytest.raises(EngineError, match=message):
        materialise(base.model, checkpoint_names(base.model), base.path, "cpu")
