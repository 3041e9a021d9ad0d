"""Shared fixtures: the tiny model (loaded once per session) and small helpers to build data."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest
import torch

from opentinker.engine import Engine, Example
from opentinker.models import BaseModel, load_base_model

TEST_MODEL = os.environ.get("OPENTINKER_TEST_MODEL", "opentinker/tiny")


def other_family_model(folder: Path, family: str) -> str:
    """A random 2-layer ``qwen2`` or ``gpt2`` model with the tiny model's tokenizer, saved to
    ``folder`` (what ``load_base_model`` takes): families off the lean Llama path."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

    from opentinker.models.registry import tiny_model_dir

    tok_dir = tiny_model_dir()
    vocab = len(AutoTokenizer.from_pretrained(str(tok_dir)))
    if family == "qwen2":
        model: Any = Qwen2ForCausalLM(
            Qwen2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=48, vocab_size=vocab)
        )  # fmt: skip
    else:
        model = GPT2LMHeadModel(
            GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=vocab, bos_token_id=1, eos_token_id=2)
        )
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(tok_dir)).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def tiny_base() -> BaseModel:
    torch.manual_seed(0)
    return load_base_model(TEST_MODEL)


@pytest.fixture
def engine(tiny_base: BaseModel) -> Engine:
    """A fresh engine (no adapters) over the shared, frozen tiny base model."""
    return Engine(tiny_base, max_rank=64)


def make_examples(
    n: int, vocab: int, *, seed: int, min_len: int = 5, max_len: int = 17, rl: bool = False
) -> list[Example]:
    """Random datums of varied lengths; ``rl`` adds sampler logprobs and advantages."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(min_len, max_len, (1,), generator=g))
        seq = torch.randint(3, vocab, (length + 1,), generator=g)
        inputs: dict[str, torch.Tensor] = {"target_tokens": seq[1:].clone()}
        if rl:
            inputs["logprobs"] = -torch.rand(length, generator=g) * 3 - 2
            inputs["advantages"] = torch.randn(length, generator=g)
        else:
            w = (torch.rand(length, generator=g) > 0.3).float()
            inputs["weights"] = w
        out.append(Example(seq[:-1].clone(), inputs))
    return out


def assert_rel_close(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-5) -> None:
    """Relative error in norm: ||actual - expected|| <= rel * ||expected|| (fp32 batching noise is
    per element tiny but not relative to elements that are themselves ~0)."""
    err = float((actual.double() - expected.double()).norm())
    scale = float(expected.double().norm())
    assert err <= rel * max(scale, 1e-12), f"relative error {err / max(scale, 1e-30):.3g} > {rel}"


class SlowSampler:
    """A sampling client that takes ``delay`` seconds per call (as on a loaded machine)."""

    def __init__(self, inner: Any, delay: float) -> None:
        self.inner, self.delay = inner, delay

    async def sample(self, **kw: Any) -> Any:
        await asyncio.sleep(self.delay)
        return await self.inner.sample_async(**kw)
