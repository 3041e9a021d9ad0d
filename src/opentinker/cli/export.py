"""``opentinker export TINKER_PATH OUT_DIR [--merged] [--data-dir D]``: a checkpoint for other tools.

Reads the checkpoint straight from the data dir (no server needs to run; one may, on the same
dir) and writes either a PEFT adapter folder (``adapter_model.safetensors`` + ``adapter_config.json``,
what ``peft`` and vLLM load) or, with ``--merged``, a full Hugging Face model with the adapter
merged into the base weights (``model.safetensors``, ``config.json`` and the tokenizer's files,
what ``transformers.AutoModelForCausalLM.from_pretrained`` loads). ``TINKER_PATH`` is a
``tinker://<model_id>/weights/<name>`` or ``…/sampler_weights/<name>`` path; the checkpoint's
checksums are verified before anything is written. ``OUT_DIR`` must not exist or be empty; it is
written under a temporary name and renamed at the end, so a failed export leaves nothing behind.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import uuid
from pathlib import Path

from opentinker.engine import Engine, EngineError
from opentinker.engine.checkpoint import read_manifest
from opentinker.service.checkpoints import CheckpointStore, parse_tinker_path
from opentinker.service.external import KIND as EXTERNAL


class ExportError(Exception):
    """What the user asked for cannot be done; the message says why."""


def export_checkpoint(tinker_path: str, out_dir: str | Path, *, merged: bool, data_dir: str | Path) -> Path:
    data = Path(data_dir)
    if not (data / "checkpoints").is_dir():
        raise ExportError(f"{data} is not an OpenTinker data dir (it has no checkpoints/ folder)")
    if f"/{EXTERNAL}/" in tinker_path:
        raise ExportError(
            f"{tinker_path} is already exported, in Tinker's adapter layout: fetch it with "
            "RestClient.get_external_weights_urls (tinker_cookbook.weights.build_lora_adapter turns it "
            "into PEFT's format), or export the training checkpoint it came from"
        )
    try:
        ref = parse_tinker_path(tinker_path)
    except EngineError as e:
        raise ExportError(str(e)) from None
    store = CheckpointStore(data)
    folder = store.folder(ref)
    if not store.exists(ref):
        raise ExportError(f"no checkpoint {ref.tinker_path} in this data dir")
    try:
        base_model = str(read_manifest(folder)["meta"].get("base_model", ""))
    except EngineError as e:
        raise ExportError(f"checkpoint {ref.tinker_path} is unusable: {e}") from None
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} exists and is not an empty folder")
    try:
        engine = Engine(base_model)
    except (OSError, ValueError) as e:
        raise ExportError(f"cannot load base model {base_model!r} of {ref.tinker_path}: {e}") from None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    try:
        engine.load_snapshot(folder, "export")  # verifies checksums, shapes and the base model
        (engine.export_merged if merged else engine.export_peft)("export", tmp)
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except EngineError as e:
        raise ExportError(f"checkpoint {ref.tinker_path}: {e}") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def main(argv: list[str] | None = None) -> int:
    from opentinker.service.runtime import default_data_dir

    p = argparse.ArgumentParser(
        prog="opentinker export", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("tinker_path", metavar="TINKER_PATH")
    p.add_argument("out_dir", metavar="OUT_DIR", type=Path)
    p.add_argument("--merged", action="store_true", help="a full HF model with the adapter merged in")
    p.add_argument(
        "--data-dir", type=Path, default=None, help="the server's data dir (default $OPENTINKER_HOME)"
    )
    args = p.parse_args(argv)
    try:
        out = export_checkpoint(
            args.tinker_path, args.out_dir, merged=args.merged, data_dir=args.data_dir or default_data_dir()
        )
    except ExportError as e:
        print(f"opentinker export: error: {e}", file=sys.stderr)
        return 2
    print(f"{'merged model' if args.merged else 'PEFT adapter'} written to {out}")
    return 0
