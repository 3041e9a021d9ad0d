"""Supervised fine-tuning: chat JSONL data (:mod:`.data`), the SFT loop (:mod:`.loop`), DPO (:mod:`.dpo`)."""

from opentinker.sft.data import (
    Batcher,
    ChatExample,
    SupervisedData,
    load_supervised,
    read_chat_jsonl,
    render_examples,
)
from opentinker.sft.loop import SFTConfig, SFTResult, eval_nll, run_sft, train_sft

__all__ = [
    "Batcher",
    "ChatExample",
    "SFTConfig",
    "SFTResult",
    "SupervisedData",
    "eval_nll",
    "load_supervised",
    "read_chat_jsonl",
    "render_examples",
    "run_sft",
    "train_sft",
]
