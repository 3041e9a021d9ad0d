"""The paged model table (``engine/paging.py``): under a memory budget, models and snapshots page
out to disk and back, and everything computed is bitwise what it is with every model resident.

Reference: the same engine work on an engine with no budget (every model resident), compared
bit for bit: same ops, same thread, same values. Faults: a corrupt or missing page file fails
that model alone; a page-out that cannot be written (a file-size limit here, as a full disk does)
leaves the model resident and refuses new models until a page-out succeeds again.
"""

from __future__ import annotations

import resource
from pathlib import Path

import pytest
import torch

from opentinker.engine import AdamParams, Engine, EngineError, ForwardRequest
from opentinker.engine.paging import MemoryBudget, PageError, PagingFull
from opentinker.lora import LoRAConfig
from opentinker.models import BaseModel
from opentinker.sampling import NativeBackend, SampleRequest, SamplingParams
from tests.conftest import make_examples

MODELS = 6
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, stop=[])
SEEDED = SamplingParams(max_tokens=12, temperature=1.0, seed=3, stop=[])


def _paged_engine(base: BaseModel, folder: Path, models: float) -> Engine:
    """An engine whose budget holds about ``models`` rank-4 models' state."""
    probe = Engine(base, max_rank=64)
    per_model = probe.state_bytes(LoRAConfig(rank=4))
    return Engine(base, max_rank=64, budget=MemoryBudget(int(models * per_model)), pages=folder)


def _train_round_robin(engine: Engine, steps: int) -> list[list[float]]:
    """``MODELS`` adapters, each trained in turn (two forward/backwards accumulated per step, so
    pending gradients page too); returns each step's losses."""
    ids = [engine.create_adapter(LoRAConfig(rank=4, seed=i)) for i in range(MODELS)]
    losses = []
    for s in range(steps):
        row = []
        for i, aid in enumerate(ids):
            for half in range(2):
                ex = make_examples(3, engine.vocab_size, seed=100 * s + 10 * i + half)
                res = engine.forward_backward(ForwardRequest(aid, ex, "cross_entropy"))
                row.append(res.metrics["loss:sum"])
        for aid in ids:
            engine.optim_step(aid, AdamParams(learning_rate=1e-2))
        losses.append(row)
    return losses


def _state(engine: Engine, aid: str) -> dict[str, torch.Tensor]:
    w = engine.adapter_weights(aid).state_dict()
    return {**{k: v.detach().clone() for k, v in w.items()}, **engine.optimizer_state(aid)}


def _bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_paged_training_is_bitwise_the_resident_training(tiny_base: BaseModel, tmp_path: Path) -> None:
    ref = Engine(tiny_base, max_rank=64)
    paged = _paged_engine(tiny_base, tmp_path / "pages", models=2.5)
    want = _train_round_robin(ref, steps=3)
    got = _train_round_robin(paged, steps=3)
    assert got == want  # the losses, bitwise
    stats = paged.pages.counts()
    assert stats["page_outs"] >= MODELS and stats["page_ins"] >= MODELS, stats
    assert paged.budget.resident <= paged.budget.limit  # type: ignore[operator]
    for aid in ref.adapter_ids():
        _bitwise(_state(paged, aid), _state(ref, aid))
    # pending gradients page too: accumulate, page everything out, then compare them
    for eng in (ref, paged):
        eng.forward_backward(ForwardRequest("adapter-0", make_examples(2, eng.vocab_size, seed=9)))
    paged.pages.page_out(paged.adapter_ids())
    assert not paged.pages.is_resident("adapter-0")
    _bitwise(paged.pending_gradients("adapter-0"), ref.pending_gradients("adapter-0"))  # type: ignore[arg-type]


def test_paged_snapshots_sample_bitwise_as_resident_ones(tiny_base: BaseModel, tmp_path: Path) -> None:
    ref = Engine(tiny_base, max_rank=64)
    paged = _paged_engine(tiny_base, tmp_path / "pages", models=1.0)
    outs = []
    for eng in (ref, paged):
        ids = [eng.create_adapter(LoRAConfig(rank=4, seed=i)) for i in range(MODELS)]
        snaps = []
        for i, aid in enumerate(ids):
            eng.forward_backward(ForwardRequest(aid, make_examples(3, eng.vocab_size, seed=i)))
            eng.optim_step(aid, AdamParams(learning_rate=5e-2))
            snaps.append(eng.snapshot(aid).snapshot_id)
        backend = NativeBackend(eng, prefix_cache_bytes=0)
        reqs = [
            SampleRequest(s, [5 + i, 9, 17, 3], GREEDY if i % 2 else SEEDED, num_samples=2)
            for i, s in enumerate(snaps)
        ]
        outs.append([backend.generate([r])[0] for r in reqs + reqs[::-1]])  # each twice, paged between
    assert paged.pages.counts()["page_ins"] > 0
    for got, want in zip(outs[1], outs[0], strict=True):
        assert [s.tokens for s in got.sequences] == [s.tokens for s in want.sequences]  # type: ignore[union-attr]
        assert [s.logprobs for s in got.sequences] == [s.logprobs for s in want.sequences]  # type: ignore[union-attr]


def test_a_model_larger_than_the_budget_is_refused_at_create(tiny_base: BaseModel, tmp_path: Path) -> None:
    eng = _paged_engine(tiny_base, tmp_path / "pages", models=1.0)
    with pytest.raises(EngineError, match=r"rank 8 holds .* MiB of state .* memory budget of .* MiB"):
        eng.create_adapter(LoRAConfig(rank=8))
    assert eng.adapter_ids() == []  # nothing was made


def _paged_out_model(tiny_base: BaseModel, folder: Path) -> tuple[Engine, str, str]:
    eng = _paged_engine(tiny_base, folder, models=3.0)
    bad, good = (eng.create_adapter(LoRAConfig(rank=4, seed=i)) for i in range(2))
    for aid in (bad, good):
        eng.forward_backward(ForwardRequest(aid, make_examples(2, eng.vocab_size, seed=1)))
        eng.optim_step(aid, AdamParams(learning_rate=1e-2))
    assert eng.pages.page_out([bad, good]) == 2
    return eng, bad, good


@pytest.mark.parametrize("fault", ["flipped byte", "truncated", "missing"])
def test_a_corrupt_page_file_fails_its_model_alone(tiny_base: BaseModel, tmp_path: Path, fault: str) -> None:
    eng, bad, good = _paged_out_model(tiny_base, tmp_path / "pages")
    good_state = _state(eng, good)  # pages it in
    [page] = sorted((tmp_path / "pages").glob("*.pages"))  # the one still paged out: bad's
    data = bytearray(page.read_bytes())
    if fault == "flipped byte":
        data[-5] ^= 0x40
        page.write_bytes(bytes(data))
    elif fault == "truncated":
        page.write_bytes(bytes(data[: len(data) // 2]))
    else:
        page.unlink()
    for _ in range(2):  # and it stays failed
        with pytest.raises(PageError, match=rf"paged-out state of '{bad}' is (corrupt|missing)") as err:
            eng.forward_backward(ForwardRequest(bad, make_examples(2, eng.vocab_size, seed=2)))
        assert str(tmp_path) not in str(err.value)  # it names the model, not a server path
    res = eng.forward_backward(ForwardRequest(good, make_examples(2, eng.vocab_size, seed=2)))
    assert res.metrics["loss:sum"] > 0
    _bitwise({k: v for k, v in _state(eng, good).items() if "lora" in k and "exp" not in k},
             {k: v for k, v in good_state.items() if "lora" in k and "exp" not in k})  # fmt: skip


def test_a_page_out_that_cannot_be_written_keeps_the_model_and_refuses_new_ones(
    tiny_base: BaseModel, tmp_path: Path
) -> None:
    eng = _paged_engine(tiny_base, tmp_path / "pages", models=1.0)
    first = eng.create_adapter(LoRAConfig(rank=4, seed=0))
    for _ in range(2):  # weights, moments and pending gradients: the whole budget
        eng.forward_backward(ForwardRequest(first, make_examples(2, eng.vocab_size, seed=1)))
        if not eng.optimizer_state(first):
            eng.optim_step(first, AdamParams(learning_rate=1e-2))
    before = _state(eng, first)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, hard))  # as a full disk: writes fail (EFBIG)
    try:
        eng.create_adapter(LoRAConfig(rank=4, seed=1))  # over budget: paging `first` out fails
        assert eng.pages.full is not None and eng.pages.is_resident(first)
        _bitwise(_state(eng, first), before)
        with pytest.raises(PagingFull, match="disk under the page files is full"):
            eng.create_adapter(LoRAConfig(rank=4, seed=2))
        # the resident model trains on
        eng.forward_backward(ForwardRequest(first, make_examples(2, eng.vocab_size, seed=1)))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert not list((tmp_path / "pages").glob("*.tmp"))  # no partial file is left
    eng.create_adapter(LoRAConfig(rank=4, seed=2))  # its page-outs are tried again, and succeed
    assert eng.pages.full is None and eng.pages.counts()["page_outs"] >= 1


def test_deleting_a_model_removes_its_page_file(tiny_base: BaseModel, tmp_path: Path) -> None:
    eng, bad, good = _paged_out_model(tiny_base, tmp_path / "pages")
    assert len(list((tmp_path / "pages").glob("*.pages"))) == 2
    eng.delete_adapter(bad)
    eng.delete_adapter(good)
    assert not list((tmp_path / "pages").glob("*"))
    assert eng.budget.resident == 0 and eng.pages.counts()["paged_out_bytes"] == 0
