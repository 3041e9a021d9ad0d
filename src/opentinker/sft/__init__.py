"""Supervised fine-tuning: chat JSONL data (:mod:`.data`), the SFT loop (:mod:`.loop`), DPO (:mod:`.dpo`)."""

from opentinker.sft.data import (
    Batcher,
    ChatExample,
    SupervisedData,
    load_supervised,
    read_chat_jsonl,
    render_examples,
)
from opentinker.sft.dpo import (
    DPOConfig,
    DPOResult,
    PreferencePair,
    read_pairs_jsonl,
    render_pairs,
    run_dpo,
    train_dpo,
)
from opentinker.sft.loop import SFTConfig, SFTResult, eval_nll, run_sft, train_sft

__all__ = [
    "Batcher",
    "ChatExample",
    "DPOConfig",
    "DPOResult",
    "PreferencePair",
    "SFTConfig",
    "SFTResult",
    "SupervisedData",
    "eval_nll",
    "load_supervised",
    "read_chat_jsonl",
    "read_pairs_jsonl",
    "render_examples",
    "render_pairs",
    "run_dpo",
    "run_sft",
    "train_dpo",
    "train_sft",
]
