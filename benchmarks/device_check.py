"""Device check: the invariant tests and the P1-P3 benchmarks on one device, into one JSON.

Run from the repository root (``--device cpu`` is a dry run of every path)::

    PYTHONPATH=src python benchmarks/device_check.py --device cuda --out $OUT

1. ``pytest`` with ``OPENTINKER_TEST_DEVICE=<device>`` on the tests that build their engine and
   models on the test device (tests/conftest.py): invariants 1-6 and 9, multi-LoRA layers, the lean
   decoder, sampling, the prefix cache and shared-prefix training, at the fp32 tolerances of
   tests/tolerances.py (TF32 off).
2. The sharded base over NCCL (``tests/test_ray_shard.py`` with each member of a group of two
   on its own GPU): run only where two GPUs are visible (NCCL refuses two ranks on one device),
   else recorded as not run, with why. Not known to work until a run records it passing.
   Then sampling on the sharded group over NCCL (``tests/test_ray_shard_sampling.py``: the
   leader decodes, the other member replays each forward; step ``shard_sample_nccl``), the same way.
3. P1, P2, P3 (``benchmarks/p*.py --device --json``) in fp32, then in bf16 unless ``--no-bf16``, on
   a random-weight Llama shaped like SmolLM2-135M (``--model`` to use another).

Every step is recorded (its exit status, the end of its output, its results) in
``<out>/device_check.json``, rewritten after each one so that a timeout keeps what was done.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ["test_engine_invariants", "test_bad_input", "test_checkpoints_export", "test_lora_layers",
         "test_llama_decode", "test_sampling", "test_prefix_cache", "test_shared_prefix"]  # fmt: skip
BENCH = {"P1": "p1_mixed_forward.py", "P2": "p2_fused_train.py", "P3": "p3_sampling.py"}


def smollm2_shaped(folder: Path) -> str:
    """A Llama with random weights in SmolLM2-135M's shape and the tiny model's tokenizer."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from opentinker.models.registry import tiny_model_dir

    config = LlamaConfig(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, rms_norm_eps=1e-5,
                         max_position_embeddings=2048, rope_theta=100000.0, bos_token_id=1, eos_token_id=2,
                         pad_token_id=2)  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(tiny_model_dir())).save_pretrained(folder)
    return str(folder)


def run(cmd: list[str], env: dict[str, str], timeout: float) -> dict[str, object]:
    t = time.perf_counter()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        rc, out = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = 124, f"timed out after {timeout:.0f} s\n{e.stdout or ''}"
    return {"rc": rc, "seconds": round(time.perf_counter() - t, 1), "tail": str(out)[-3000:]}


def shard_nccl(
    env: dict[str, str], args: argparse.Namespace, test: str = "test_ray_shard"
) -> dict[str, object]:
    """The sharded base (FSDP2) over NCCL: its Ray tests ``tests/<test>.py``, each group member
    on its own GPU."""
    import torch

    gpus = torch.cuda.device_count() if args.device.startswith("cuda") else 0
    if gpus < 2:
        return {"rc": None, "not_run": f"needs 2 GPUs, {gpus} visible (NCCL refuses two ranks on one device)"}
    return run(
        [sys.executable, "-m", "pytest", "-q", "-m", "slow or not slow", f"tests/{test}.py"],
        env,
        args.timeout,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    ap.add_argument("--model", default=None, help="the benchmarks' model (default: SmolLM2-shaped, random)")
    ap.add_argument("--no-bf16", action="store_true")
    ap.add_argument("--no-bench", action="store_true", help="the tests only")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per step")
    ap.add_argument("--pytest-args", default="", help="extra pytest arguments, e.g. '-k inv1'")
    ap.add_argument("--bench-args", default="--repeats 5", help="extra arguments of every benchmark")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "device_check.json"
    env = dict(os.environ, OPENTINKER_TEST_DEVICE=args.device, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")]))  # fmt: skip
    import torch
    import transformers

    report: dict[str, object] = {"device": args.device, "python": sys.version.split()[0], "torch": torch.__version__,
                                 "transformers": transformers.__version__, "cuda": torch.cuda.is_available() and
                                 torch.cuda.get_device_name(0)}  # fmt: skip

    def save() -> None:
        path.write_text(json.dumps(report, indent=1))

    xml = args.out / "device_tests.xml"
    tests = [f"tests/{t}.py" for t in TESTS]
    pytest = [sys.executable, "-m", "pytest", "-q", "-m", "slow or not slow", f"--junitxml={xml}"]
    res = run([*pytest, *shlex.split(args.pytest_args), *tests], env, args.timeout)
    if xml.exists():
        cases = ET.parse(xml).getroot().iter("testcase")
        status = {f"{c.get('classname')}::{c.get('name')}": [x.tag for x in c] or ["passed"] for c in cases}
        res["failed"] = sorted(k for k, v in status.items() if "failure" in v or "error" in v)
        res["skipped"] = sorted(k for k, v in status.items() if "skipped" in v)
        res["passed"] = sum(v == ["passed"] for v in status.values())
    report["tests"] = res
    save()
    report["shard_nccl"] = shard_nccl(env, args)
    save()
    report["shard_sample_nccl"] = shard_nccl(env, args, "test_ray_shard_sampling")
    save()
    if not args.no_bench:
        with tempfile.TemporaryDirectory(prefix="device-check-") as tmp:
            model = args.model or smollm2_shaped(Path(tmp) / "smollm2-shaped")
            for dtype in ["float32"] + ([] if args.no_bf16 else ["bfloat16"]):
                for name, script in BENCH.items():
                    out = Path(tmp) / f"{name}.json"
                    cmd = [sys.executable, str(ROOT / "benchmarks" / script), "--model", model,
                           *shlex.split(args.bench_args), "--device", args.device, "--dtype", dtype,
                           "--json", str(out)]  # fmt: skip
                    step = run(cmd, env, args.timeout)
                    step["results"] = json.loads(out.read_text()) if out.exists() else None
                    report[f"{name}_{dtype}"] = step
                    save()
    failed = [k for k, v in report.items() if isinstance(v, dict) and v.get("rc") not in (0, None)]
    report["ok"] = not failed
    report["failed_steps"] = failed
    save()
    print(json.dumps({k: v for k, v in report.items() if k != "tests"}, indent=1)[-4000:])
    print(f"tests: {res.get('passed')} passed, failed {res.get('failed')}; wrote {path}")


if __name__ == "__main__":
    main()
