"""GPU check: one script for a short session on an accelerator — layering, invariants, P1/P2/P3.

Run (from the repository root)::

    PYTHONPATH=src python3 benchmarks/gpu_check.py --out $OUT              # CUDA, SmolLM2-135M shape
    PYTHONPATH=src python3 benchmarks/gpu_check.py --device cpu --small    # dry run of every path

What it does, in order (each item is wrapped: a failure is recorded, never stops the script):

0. **imports** — which modules of ``opentinker.{models,lora,engine,sampling}`` import ``tinker`` /
   ``fastapi`` / ``uvicorn`` / ``gguf`` (a static scan, top-level vs lazy), and a subprocess that
   imports those layers with the four packages blocked (``sys.modules[name] = None``), naming the
   file and line of the import that breaks, if one does (a lower layer needing ``tinker`` is a
   layering bug).
1. **model** — a Llama with random weights shaped like SmolLM2-135M (hidden 576, 30 layers, 9 heads,
   3 KV heads, MLP 1536, vocab 49152, tied embeddings, rope theta 1e5, context 2048), saved to a
   temp folder with the tiny model's tokenizer and loaded with ``load_base_model`` (``--small``: a
   2-layer, hidden-64 Llama with the tokenizer's vocabulary).
2. **correctness**, fp32 with TF32 off: (a) invariant 1 — 4 adapters (ranks 4, 8, 4, 16) in one
   ``forward_backward_many`` get the gradients (and logprobs, losses) they get alone, for
   ``cross_entropy`` and ``ppo``; (b) shared-prefix training (``share_prefixes`` True vs False) on
   RL-group-shaped batches: same logprobs, losses and gradients; (c) invariant 3 — sampled-token
   logprobs at temperature 1 equal the forward's logprobs, on a mixed batch of 2 adapters + base;
   (d) greedy rows of a mixed batch equal their solo runs (on a mismatch: the top-2 logit gap there).
   Tolerance 1e-4 (relative in norm for gradients / logprobs of a batch, absolute for (c)).
3. **performance** (medians of interleaved repeats, ``torch.cuda.synchronize()`` after every run),
   the same ratios the CPU benchmarks print: ``P1`` (no-grad forward, K = 16 distinct adapters ÷ one
   adapter, 16 × 128; also ``P1engine``, ``P1peft`` = peft mixed ÷ ours mixed, ``P1peftself``),
   ``P2`` (fused fwd+bwd+optim over K = 8 adapters × 4 rows ÷ one adapter on 32 rows) and ``P2seq``
   (K sequential single-adapter steps ÷ fused), ``P3`` (greedy sampling, 16 rows on 16 distinct
   adapters, prompt 32, 64 new tokens: our tokens/s ÷ HF ``generate`` on a plain (= merged) model).
   P3 runs in fp32 and bf16; then P1 and P2 in bf16. Perf items are skipped once the script has run
   ``--time-budget`` seconds (default 360).

Everything lands in ``<out>/gpu_check.json`` (rewritten after every item, so a timeout keeps what was
done) and a summary is printed. The exit status is 0 unless the arguments are bad.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
BENCH = Path(__file__).resolve().parent
for _p in (str(SRC), str(BENCH)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

# no network on the GPU machine: never let transformers / huggingface_hub try it (and wait on timeouts)
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")

BLOCKED = ("tinker", "fastapi", "uvicorn", "gguf")  # not installed on the GPU machine
LAYERS = ("opentinker.models", "opentinker.lora", "opentinker.engine", "opentinker.sampling")
TOL = 1e-4
T0 = time.perf_counter()

RESULTS: dict[str, Any] = {"ok": None, "checks": {}, "perf": {}, "errors": []}
OUT_FILE: Path | None = None


# ---------------------------------------------------------------------------- bookkeeping
def elapsed() -> float:
    return time.perf_counter() - T0


def save() -> None:
    if OUT_FILE is None:
        return
    RESULTS["elapsed_s"] = round(elapsed(), 2)
    tmp = OUT_FILE.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(RESULTS, indent=2, default=str))
    tmp.replace(OUT_FILE)


def run_item(section: str, name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run one check or measurement; record its dict (or the exception) under RESULTS[section][name]."""
    t = time.perf_counter()
    print(f"\n=== {section}/{name} (t={elapsed():.0f}s)", flush=True)
    try:
        res = fn()
    except Exception as e:  # every item must be recorded, never stop the script
        tb = traceback.format_exc()
        print(tb, flush=True)
        res = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": tb[-4000:]}
    res["seconds"] = round(time.perf_counter() - t, 2)
    RESULTS[section][name] = res
    print(json.dumps({k: v for k, v in res.items() if k != "traceback"}, default=str), flush=True)
    save()
    return res


# ---------------------------------------------------------------------------- 0. imports
def static_scan() -> list[dict[str, Any]]:
    """Every import of a BLOCKED package in src/opentinker: file, line, top-level or lazy."""
    hits = []
    for path in sorted((SRC / "opentinker").rglob("*.py")):
        try:
            tree = ast.parse(path.read_text())
        except SyntaxError as e:
            hits.append({"file": str(path.relative_to(SRC)), "error": f"SyntaxError {e}"})
            continue
        top = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for n in names:
                if n.split(".")[0] in BLOCKED:
                    rel = str(path.relative_to(SRC))
                    module = rel[:-3].replace("/", ".").removesuffix(".__init__")
                    hits.append(
                        {
                            "module": module,
                            "line": node.lineno,
                            "imports": n,
                            "top_level": id(node) in top,
                            "lower_layer": module.startswith(LAYERS),
                        }
                    )
    return hits


_PROBE = r"""
import json, sys, traceback
for n in BLOCKED:
    sys.modules[n] = None  # 'import n' now raises ModuleNotFoundError
out = {}
for mod in LAYERS:
    try:
        __import__(mod)
        out[mod] = "ok"
    except BaseException as e:
        frames = [f for f in traceback.extract_tb(e.__traceback__) if "/opentinker/" in f.filename]
        where = f"{frames[-1].filename}:{frames[-1].lineno}: {frames[-1].line}" if frames else "?"
        out[mod] = f"FAIL {type(e).__name__}: {e} (at {where})"
out["_loaded_blocked"] = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED and sys.modules[m] is not None)
print("PROBE" + json.dumps(out))
"""


def check_imports() -> dict[str, Any]:
    scan = static_scan()
    bugs = [h for h in scan if h.get("lower_layer") and h.get("top_level")]
    lazy = [h for h in scan if h.get("lower_layer") and not h.get("top_level")]
    code = f"BLOCKED = {BLOCKED!r}\nLAYERS = {LAYERS!r}\n" + _PROBE
    env = dict(os.environ, PYTHONPATH=str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env, cwd=str(ROOT)
    )
    probe: dict[str, Any] = {}
    for line in proc.stdout.splitlines():
        if line.startswith("PROBE"):
            probe = json.loads(line[5:])
    if not probe:
        probe = {"error": f"probe exited {proc.returncode}", "stderr": proc.stderr[-2000:]}
    layers_ok = all(probe.get(m) == "ok" for m in LAYERS)
    installed = {}
    import importlib.util

    for n in BLOCKED:
        try:
            installed[n] = importlib.util.find_spec(n) is not None
        except (ImportError, ValueError):
            installed[n] = False
    return {
        "ok": layers_ok and not bugs,
        "layers_import_without_blocked": probe,
        "layering_bugs_top_level_imports_in_lower_layers": bugs,
        "lazy_imports_in_lower_layers": lazy,
        "upper_layer_modules_importing_blocked": sorted(
            {h["module"] for h in scan if not h.get("lower_layer") and "module" in h}
        ),
        "blocked_packages_installed_here": installed,
    }


# ---------------------------------------------------------------------------- sizes
class Sizes:
    def __init__(self, small: bool) -> None:
        self.small = small
        if small:
            self.inv1_rows, self.inv1_len = 2, (5, 12)
            self.prefix = dict(head=10, prompts=2, extra=6, group=3, comp=6)
            self.sample_tokens, self.prompt_lens = 6, (9, 4, 13)
            self.p1 = dict(batch=4, seq=16, repeats=2, warmup=1)
            self.p2 = dict(k=2, b=2, seq=16, repeats=2, warmup=1)
            self.p3 = dict(batch=4, prompt=8, new=6, repeats=2, warmup=1)
        else:
            self.inv1_rows, self.inv1_len = 4, (16, 96)
            self.prefix = dict(head=32, prompts=3, extra=16, group=4, comp=16)
            self.sample_tokens, self.prompt_lens = 32, (40, 17, 63)
            self.p1 = dict(batch=16, seq=128, repeats=7, warmup=2)
            self.p2 = dict(k=8, b=4, seq=128, repeats=5, warmup=2)
            self.p3 = dict(batch=16, prompt=32, new=64, repeats=5, warmup=1)


# ---------------------------------------------------------------------------- helpers
def _torch() -> Any:
    import torch

    return torch


def sync(dev: Any) -> None:
    torch = _torch()
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def build_model_folder(folder: Path, small: bool) -> dict[str, Any]:
    """A random-weight Llama (SmolLM2-135M's shape, or a 2-layer toy) + the tiny model's tokenizer."""
    torch = _torch()
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from opentinker.models.registry import tiny_model_dir

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir()))
    if small:
        dims = dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            vocab_size=max(len(tok), 1024),
        )
    else:
        dims = dict(
            hidden_size=576,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            intermediate_size=1536,
            vocab_size=49152,
        )
    kw: dict[str, Any] = dict(
        dims,
        tie_word_embeddings=True,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        hidden_act="silu",
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    try:  # transformers 5.x spelling
        config = LlamaConfig(**kw, rope_parameters={"rope_type": "default", "rope_theta": 100000.0})
    except TypeError:
        config = LlamaConfig(**kw, rope_theta=100000.0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(str(folder))
    tok.save_pretrained(str(folder))
    n_params = sum(p.numel() for p in model.parameters())
    rope = getattr(config, "rope_parameters", None) or {"rope_theta": getattr(config, "rope_theta", None)}
    del model
    return {"ok": True, "folder": str(folder), "params": n_params, "config": dims, "rope": rope}


def randomize_b(engine: Any, aid: str, seed: int, std: float) -> None:
    """Non-zero LoRA B (a fresh adapter has B = 0, which would hide routing bugs)."""
    torch = _torch()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for b in engine.adapter_weights(aid).b.values():
            b.copy_(torch.randn(b.shape, generator=g) * std)


def make_examples(n: int, vocab: int, *, seed: int, lens: tuple[int, int], rl: bool = False) -> list[Any]:
    """Random datums (conftest.make_examples); RL sampler logprobs near a uniform policy's."""
    torch = _torch()
    from opentinker.engine import Example

    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(lens[0], lens[1], (1,), generator=g))
        seq = torch.randint(3, vocab, (length + 1,), generator=g)
        inputs = {"target_tokens": seq[1:].clone()}
        if rl:
            inputs["logprobs"] = -math.log(vocab) + (torch.rand(length, generator=g) - 0.5) * 0.5
            inputs["advantages"] = torch.randn(length, generator=g)
        else:
            inputs["weights"] = (torch.rand(length, generator=g) > 0.3).float()
        out.append(Example(seq[:-1].clone(), inputs))
    return out


def rel_err(actual: Any, expected: Any) -> float:
    a, e = actual.detach().double().cpu(), expected.detach().double().cpu()
    return float((a - e).norm()) / max(float(e.norm()), 1e-30)


def flat(tensors: dict[str, Any]) -> Any:
    torch = _torch()
    return torch.cat([tensors[k].detach().reshape(-1).double().cpu() for k in sorted(tensors)])


def raise_any(results: list[Any]) -> None:
    for r in results:
        if isinstance(r, Exception):
            raise r


# ---------------------------------------------------------------------------- 2. correctness
def check_inv1(engine: Any, sz: Sizes) -> dict[str, Any]:
    from opentinker.engine import AdamParams, ForwardRequest
    from opentinker.lora import LoRAConfig

    out: dict[str, Any] = {}
    worst = 0.0
    for loss_fn in ("cross_entropy", "ppo"):
        ranks = [4, 8, 4, 16]
        ids = [engine.create_adapter(LoRAConfig(rank=r, seed=i)) for i, r in enumerate(ranks)]
        for i, aid in enumerate(ids):
            randomize_b(engine, aid, 100 + i, 0.05)
        rl = loss_fn != "cross_entropy"
        reqs = [
            ForwardRequest(
                aid, make_examples(sz.inv1_rows, engine.vocab_size, seed=i, lens=sz.inv1_len, rl=rl), loss_fn
            )
            for i, aid in enumerate(ids)
        ]
        mixed = engine.forward_backward_many(reqs)
        raise_any(mixed)
        mixed_grads = {aid: flat(engine.pending_gradients(aid)) for aid in ids}
        for aid in ids:  # clear the accumulators (lr 0: weights unchanged)
            engine.optim_step(aid, AdamParams(learning_rate=0.0))
        g_err = lp_err = loss_err = 0.0
        g_norms = []
        for req, res in zip(reqs, mixed, strict=True):
            alone = engine.forward_backward(req)
            loss_err = max(
                loss_err,
                abs(res.metrics["loss:sum"] - alone.metrics["loss:sum"])
                / max(abs(alone.metrics["loss:sum"]), 1e-30),
            )
            for om, oa in zip(res.outputs, alone.outputs, strict=True):
                lp_err = max(lp_err, rel_err(om["logprobs"], oa["logprobs"]))
            ga = flat(engine.pending_gradients(req.policy))
            g_norms.append(float(ga.norm()))
            g_err = max(g_err, rel_err(mixed_grads[req.policy], ga))
            engine.optim_step(req.policy, AdamParams(learning_rate=0.0))
        for aid in ids:
            engine.delete_adapter(aid)
        out[loss_fn] = {
            "grad_rel_err": g_err,
            "logprob_rel_err": lp_err,
            "loss_rel_err": loss_err,
            "grad_norms": g_norms,
        }
        worst = max(worst, g_err, lp_err)
        if min(g_norms) == 0.0:
            out[loss_fn]["warning"] = "a gradient is identically zero"
            worst = math.inf
    return {"ok": worst <= TOL, "max_rel_err": worst, "tol": TOL, **out}


def grouped_examples(vocab: int, *, seed: int, p: dict[str, int], soft: bool = False) -> list[Any]:
    """Like tests/test_shared_prefix.py: ``group`` completions of ``prompts`` prompts that share a head."""
    torch = _torch()
    from opentinker.engine import Example

    g = torch.Generator().manual_seed(seed)
    head = torch.randint(3, vocab, (p["head"],), generator=g).tolist()
    out = []
    for k in range(p["prompts"]):
        prompt = head + torch.randint(3, vocab, (p["extra"] + 5 * k,), generator=g).tolist()
        for _ in range(p["group"]):
            n_comp = int(torch.randint(1, p["comp"] + 1, (1,), generator=g))
            seq = prompt + torch.randint(3, vocab, (n_comp,), generator=g).tolist()
            n = len(seq) - 1
            act = torch.tensor([0.0] * (len(prompt) - 1) + [1.0] * n_comp)
            if soft:
                tgt = torch.stack([torch.tensor(seq[1:]), torch.randint(3, vocab, (n,), generator=g)], dim=1)
                inputs = {"target_tokens": tgt, "weights": torch.stack([act * 0.7, act * 0.3], dim=1)}
            else:
                inputs = {
                    "target_tokens": torch.tensor(seq[1:]),
                    "advantages": act * torch.randn(n, generator=g),
                    "logprobs": -math.log(vocab) + (torch.rand(n, generator=g) - 0.5) * 0.5,
                }
            out.append(Example(torch.tensor(seq[:-1]), inputs))
    return out


def check_shared_prefix(engine: Any, sz: Sizes) -> dict[str, Any]:
    from opentinker.engine import AdamParams, Example, ForwardRequest
    from opentinker.engine.prefix import plan_shared_prefixes
    from opentinker.lora import LoRAConfig

    vocab = engine.vocab_size
    a1 = engine.create_adapter(LoRAConfig(rank=8, seed=1))
    a2 = engine.create_adapter(LoRAConfig(rank=4, seed=2))
    randomize_b(engine, a1, 1, 0.05)
    randomize_b(engine, a2, 2, 0.05)
    ex1 = grouped_examples(vocab, seed=0, p=sz.prefix)
    ex2 = grouped_examples(vocab, seed=1, p=sz.prefix)
    ex3 = grouped_examples(vocab, seed=2, p=sz.prefix, soft=True)
    sft = [
        Example(
            e.tokens_T,
            {"target_tokens": e.inputs["target_tokens"], "weights": (e.inputs["advantages"] != 0).float()},
        )
        for e in ex1[:3]
    ]
    reqs = [
        ForwardRequest(a1, ex1, "importance_sampling"),
        ForwardRequest(a2, ex2, "ppo"),
        ForwardRequest(a1, ex3, "cross_entropy"),
        ForwardRequest(a2, sft, "cross_entropy", backward=False),
    ]
    plan = plan_shared_prefixes(
        [e.tokens_T.tolist() for r in reqs for e in r.examples], [r.policy for r in reqs for _ in r.examples]
    )
    runs = {}
    saved_flag = engine.share_prefixes
    try:
        for share in (False, True):
            engine.share_prefixes = share
            res = engine.forward_backward_many(reqs)
            raise_any(res)
            grads = {aid: dict(engine.pending_gradients(aid) or {}) for aid in (a1, a2)}
            grads = {aid: {k: v.clone() for k, v in g.items()} for aid, g in grads.items()}
            for aid in (a1, a2):
                engine.optim_step(aid, AdamParams(learning_rate=0.0))
            runs[share] = (res, grads)
    finally:
        engine.share_prefixes = saved_flag
    (dense, g_dense), (shared, g_shared) = runs[False], runs[True]
    loss_err = lp_err = el_err = g_err = 0.0
    for d, s in zip(dense, shared, strict=True):
        loss_err = max(
            loss_err,
            abs(d.metrics["loss:sum"] - s.metrics["loss:sum"]) / max(1.0, abs(d.metrics["loss:sum"])),
        )
        for od, os_ in zip(d.outputs, s.outputs, strict=True):
            lp_err = max(lp_err, rel_err(os_["logprobs"], od["logprobs"]))
            el_err = max(el_err, rel_err(os_["elementwise_loss"], od["elementwise_loss"]))
    empty = [aid for aid in (a1, a2) if not g_dense[aid]]
    for aid in (a1, a2):
        for name, g in g_dense[aid].items():
            g_err = max(g_err, rel_err(g_shared[aid][name], g))
    engine.delete_adapter(a1)
    engine.delete_adapter(a2)
    worst = max(loss_err, lp_err, el_err, g_err)
    rows = sum(len(r.examples) for r in reqs)
    return {
        "ok": plan is not None and not empty and worst <= TOL,
        "prefix_plan_used": plan is not None,
        "groups": None if plan is None else len(plan),
        "rows": rows,
        "tokens": sum(int(e.tokens_T.numel()) for r in reqs for e in r.examples),
        "loss_rel_err": loss_err,
        "logprob_rel_err": lp_err,
        "elementwise_loss_rel_err": el_err,
        "grad_rel_err_max_tensor": g_err,
        "adapters_without_grads": empty,
        "tol": TOL,
        "tests_use_tol": 1e-5,
    }


def _sampling_setup(engine: Any, sz: Sizes) -> tuple[Any, list[str], list[list[int]]]:
    torch = _torch()
    from opentinker.lora import LoRAConfig
    from opentinker.sampling import NativeBackend

    a = engine.create_adapter(LoRAConfig(rank=4, seed=0))
    b = engine.create_adapter(LoRAConfig(rank=8, seed=1, train_mlp=False))
    randomize_b(engine, a, 11, 0.05)
    randomize_b(engine, b, 12, 0.05)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, engine.vocab_size, (n,), generator=g).tolist() for n in sz.prompt_lens]
    return NativeBackend(engine), [a, b], prompts


def _forward_logprobs(engine: Any, policy: str | None, tokens: list[int]) -> Any:
    torch = _torch()
    from opentinker.engine import Example, ForwardRequest

    ex = Example(torch.tensor(tokens[:-1]), {"target_tokens": torch.tensor(tokens[1:])})
    res = engine.forward_backward(ForwardRequest(policy, [ex], backward=False))
    return res.outputs[0]["logprobs"].detach().double().cpu()


def check_inv3(engine: Any, sz: Sizes) -> dict[str, Any]:
    torch = _torch()
    from opentinker.sampling import SampleRequest, SamplingParams

    sampler, (a, b), prompts = _sampling_setup(engine, sz)
    try:
        params = SamplingParams(max_tokens=sz.sample_tokens, temperature=1.0, seed=0, stop=[])
        reqs = [SampleRequest(p, prompts[i], params, num_samples=2) for i, p in enumerate([a, b, None])]
        results = sampler.generate(reqs)
        raise_any(results)
        err = 0.0
        n_tok = 0
        mean_lp = []
        for req, res in zip(reqs, results, strict=True):
            for seq in res.sequences:
                lp = _forward_logprobs(engine, req.policy, req.prompt + seq.tokens)[len(req.prompt) - 1 :]
                got = torch.tensor(seq.logprobs, dtype=torch.float64)
                err = max(err, float((lp - got).abs().max()))
                n_tok += len(seq.tokens)
                mean_lp.append(float(got.mean()))
        return {"ok": err <= TOL, "max_abs_err": err, "tol": TOL, "tokens": n_tok, "mean_logprob": mean_lp}
    finally:
        engine.delete_adapter(a)
        engine.delete_adapter(b)


def check_greedy(engine: Any, sz: Sizes) -> dict[str, Any]:
    torch = _torch()
    from opentinker.sampling import SampleRequest, SamplingParams

    sampler, (a, b), prompts = _sampling_setup(engine, sz)
    try:
        greedy = SamplingParams(max_tokens=sz.sample_tokens, temperature=0.0, stop=[])
        reqs = [SampleRequest(p, prompts[i % 3], greedy) for i, p in enumerate([a, b, None, b, a])]
        mixed = sampler.generate(reqs)
        raise_any(mixed)
        mismatches = []
        for k, (req, res) in enumerate(zip(reqs, mixed, strict=True)):
            [solo] = sampler.generate([req])
            raise_any([solo])
            tm, ts = res.sequences[0].tokens, solo.sequences[0].tokens
            if tm != ts:
                pos = next(i for i in range(min(len(tm), len(ts))) if tm[i] != ts[i])
                seq = req.prompt + ts[:pos]  # the solo context up to the first divergence
                with torch.no_grad(), engine.routing([req.policy]):
                    logits = engine.base.model(
                        input_ids=torch.tensor([seq], device=engine.device), use_cache=False
                    ).logits[0, -1]
                top2 = torch.topk(logits.float(), 2).values
                mismatches.append(
                    {"row": k, "first_divergence": pos, "top2_logit_gap": float(top2[0] - top2[1])}
                )
        distinct = len({tuple(r.sequences[0].tokens) for r in mixed[:3]})
        return {
            "ok": not mismatches,
            "rows": len(reqs),
            "mismatches": mismatches,
            "distinct_outputs_of_rows_a_b_base": distinct,
        }
    finally:
        engine.delete_adapter(a)
        engine.delete_adapter(b)


# ---------------------------------------------------------------------------- 3. performance
def timed(
    alternatives: dict[str, Callable[[], object]], dev: Any, repeats: int, warmup: int
) -> dict[str, Any]:
    """Interleaved runs (benchmarks/timing.py), each followed by a device sync; median/min/max ms."""
    from timing import interleaved

    def synced(fn: Callable[[], object]) -> Callable[[], object]:
        def run() -> object:
            out = fn()
            sync(dev)
            return out

        return run

    sync(dev)
    times = interleaved({k: synced(f) for k, f in alternatives.items()}, repeats, warmup)
    return {
        name: {
            "median_ms": statistics.median(ts) * 1e3,
            "min_ms": min(ts) * 1e3,
            "max_ms": max(ts) * 1e3,
        }
        for name, ts in times.items()
    }


def _med(table: dict[str, Any], name: str) -> float:
    return float(table[name]["median_ms"])


def build_peft(engine: Any, ids: list[str], dtype: Any, workdir: Path) -> Any:
    """A separate HF copy of the base model, as a PeftModel holding the same adapters (as p1)."""
    import warnings

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(engine.base.path, dtype=dtype, attn_implementation="sdpa")
    hf.to(engine.device).eval()
    model = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for aid in ids:
            folder = engine.export_peft(aid, workdir / aid)
            if model is None:
                model = PeftModel.from_pretrained(hf, str(folder), adapter_name=aid)
            else:
                model.load_adapter(str(folder), adapter_name=aid)
    assert model is not None
    model.to(engine.device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def perf_p1(engine: Any, sz: Sizes, dtype: Any, with_peft: bool = True) -> dict[str, Any]:
    torch = _torch()
    from opentinker.engine import Example, ForwardRequest
    from opentinker.lora import LoRAConfig

    B, T = sz.p1["batch"], sz.p1["seq"]
    dev = engine.device
    ids = [engine.create_adapter(LoRAConfig(rank=8, seed=k)) for k in range(B)]
    peft_model = None
    try:
        for k, aid in enumerate(ids):
            randomize_b(engine, aid, 1000 + k, 0.01)
        g = torch.Generator().manual_seed(0)
        tokens_cpu = torch.randint(0, engine.vocab_size, (B, T), generator=g)
        tokens = tokens_cpu.to(dev)
        examples = [
            Example(tokens_cpu[i], {"target_tokens": torch.roll(tokens_cpu[i], -1), "weights": torch.ones(T)})
            for i in range(B)
        ]
        mixed: list[str | None] = list(ids)
        single: list[str | None] = [ids[0]] * B

        def routed(policies: list[str | None]) -> Callable[[], Any]:
            def run() -> Any:
                with torch.no_grad(), engine.routing(policies):
                    return engine.base.model(input_ids=tokens, use_cache=False).logits

            return run

        def requests(policies: list[str | None]) -> Callable[[], Any]:
            reqs = [ForwardRequest(p, [ex], backward=False) for p, ex in zip(policies, examples, strict=True)]

            def run() -> Any:
                out = engine.forward_backward_many(reqs)
                raise_any(out)
                return out

            return run

        alts: dict[str, Callable[[], object]] = {
            "ours single (routing)": routed(single),
            "ours mixed (routing)": routed(mixed),
            "ours single (fwd_bwd_many, no bwd)": requests(single),
            "ours mixed (fwd_bwd_many, no bwd)": requests(mixed),
        }
        info: dict[str, Any] = {}
        if with_peft:
            try:
                with tempfile.TemporaryDirectory(prefix="gpu-check-peft-") as tmp:
                    peft_model = build_peft(engine, ids, dtype, Path(tmp))
                pm = peft_model

                def peft_run(names: list[str] | None) -> Callable[[], Any]:
                    def run() -> Any:
                        with torch.no_grad():
                            if names is None:
                                return pm(input_ids=tokens, use_cache=False).logits
                            return pm(input_ids=tokens, use_cache=False, adapter_names=names).logits

                    return run

                pm.set_adapter(ids[0])
                alts["peft mixed (adapter_names)"] = peft_run(list(ids))
                alts["peft single (set_adapter)"] = peft_run(None)
                ours_m = alts["ours mixed (routing)"]().float()
                theirs_m = alts["peft mixed (adapter_names)"]().float()
                ours_s = alts["ours single (routing)"]().float()
                theirs_s = alts["peft single (set_adapter)"]().float()
                info["max_abs_logit_diff_vs_peft_mixed"] = float((ours_m - theirs_m).abs().max())
                info["max_abs_logit_diff_vs_peft_single"] = float((ours_s - theirs_s).abs().max())
                info["max_abs_logit"] = float(ours_m.abs().max())
            except Exception as e:
                info["peft_error"] = f"{type(e).__name__}: {e}"
                info["peft_traceback"] = traceback.format_exc()[-3000:]
                alts.pop("peft mixed (adapter_names)", None)
                alts.pop("peft single (set_adapter)", None)
        table = timed(alts, dev, sz.p1["repeats"], sz.p1["warmup"])
        res: dict[str, Any] = {
            "ok": True,
            "B": B,
            "T": T,
            "K": B,
            "P1": _med(table, "ours mixed (routing)") / _med(table, "ours single (routing)"),
            "P1engine": _med(table, "ours mixed (fwd_bwd_many, no bwd)")
            / _med(table, "ours single (fwd_bwd_many, no bwd)"),
        }
        if "peft mixed (adapter_names)" in table:
            res["P1peft"] = _med(table, "peft mixed (adapter_names)") / _med(table, "ours mixed (routing)")
            res["P1peftself"] = _med(table, "peft mixed (adapter_names)") / _med(
                table, "peft single (set_adapter)"
            )
        res.update(info)
        res["table"] = table
        return res
    finally:
        del peft_model
        for aid in ids:
            engine.delete_adapter(aid)
        free(dev)


def perf_p2(engine: Any, sz: Sizes) -> dict[str, Any]:
    torch = _torch()
    from opentinker.engine import AdamParams, Example, ForwardRequest
    from opentinker.lora import LoRAConfig

    k, b, t = sz.p2["k"], sz.p2["b"], sz.p2["seq"]
    ids = [engine.create_adapter(LoRAConfig(rank=8, seed=i)) for i in range(k)]
    solo = engine.create_adapter(LoRAConfig(rank=8, seed=k))
    try:
        g = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, engine.vocab_size, (k * b, t), generator=g)
        examples = [
            Example(tokens[i], {"target_tokens": torch.roll(tokens[i], -1), "weights": torch.ones(t)})
            for i in range(k * b)
        ]
        per_adapter = [examples[i * b : (i + 1) * b] for i in range(k)]
        adam = AdamParams(learning_rate=1e-5)
        fused_reqs = [ForwardRequest(aid, ex) for aid, ex in zip(ids, per_adapter, strict=True)]
        one_req = ForwardRequest(solo, examples)

        def fused() -> None:
            raise_any(engine.forward_backward_many(fused_reqs))
            for aid in ids:
                engine.optim_step(aid, adam)

        def one_adapter() -> None:
            raise_any(engine.forward_backward_many([one_req]))
            engine.optim_step(solo, adam)

        def sequential() -> None:
            for req in fused_reqs:
                raise_any(engine.forward_backward_many([req]))
                engine.optim_step(str(req.policy), adam)

        names = (
            f"one adapter, {k * b} rows, 1 optim_step",
            f"fused: {k} adapters x {b} rows, {k} optim_steps",
            f"sequential: {k} x (fwd_bwd {b} rows + optim)",
        )
        table = timed(
            dict(zip(names, (one_adapter, fused, sequential), strict=True)),
            engine.device,
            sz.p2["repeats"],
            sz.p2["warmup"],
        )
        one, fuse, seq = (_med(table, n) for n in names)
        return {"ok": True, "K": k, "b": b, "T": t, "P2": fuse / one, "P2seq": seq / fuse, "table": table}
    finally:
        for aid in [*ids, solo]:
            engine.delete_adapter(aid)
        free(engine.device)


def perf_p3(engine: Any, sz: Sizes, dtype: Any) -> dict[str, Any]:
    torch = _torch()
    from transformers import AutoModelForCausalLM

    from opentinker.lora import LoRAConfig
    from opentinker.sampling import NativeBackend, SampleRequest, SamplingParams

    n, plen, new = sz.p3["batch"], sz.p3["prompt"], sz.p3["new"]
    dev = engine.device
    ids = [engine.create_adapter(LoRAConfig(rank=8, seed=i)) for i in range(n)]
    hf = None
    try:
        for i, aid in enumerate(ids):
            randomize_b(engine, aid, 2000 + i, 0.01)
        sampler = NativeBackend(engine)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(3, engine.vocab_size, (plen,), generator=g).tolist() for _ in ids]
        params = SamplingParams(max_tokens=new, temperature=0.0, stop=[])  # greedy, never stops early
        mixed = [SampleRequest(aid, p, params) for aid, p in zip(ids, prompts, strict=True)]
        one = [SampleRequest(ids[0], p, params) for p in prompts]
        base = [SampleRequest(None, p, params) for p in prompts]

        def ours(reqs: list[Any]) -> Callable[[], object]:
            def run() -> object:
                res = sampler.generate(reqs)
                raise_any(res)
                assert all(len(r.sequences[0].tokens) == new for r in res)
                return res

            return run

        hf = AutoModelForCausalLM.from_pretrained(engine.base.path, dtype=dtype, attn_implementation="sdpa")
        hf.to(dev).eval()
        x = torch.tensor(prompts, device=dev)
        model = hf

        @torch.no_grad()
        def theirs() -> object:
            out = model.generate(
                input_ids=x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
            assert out.shape[1] == plen + new, out.shape
            return out

        names = {
            f"ours, {n} distinct adapters": ours(mixed),
            "ours, 1 adapter on every row": ours(one),
            "ours, base (no LoRA)": ours(base),
            "HF generate (plain = merged model)": theirs,
        }
        table = timed(names, dev, sz.p3["repeats"], sz.p3["warmup"])
        tokens = n * new
        tps = {k: tokens / (v["median_ms"] / 1e3) for k, v in table.items()}
        # greedy agreement of our base rows with HF's (same function, same argmax unless near ties)
        ours_base = [r.sequences[0].tokens for r in ours(base)()]  # type: ignore[attr-defined]
        hf_out = theirs()[:, plen:].tolist()  # type: ignore[index]
        agree = sum(a == b for a, b in zip(ours_base, hf_out, strict=True))
        return {
            "ok": True,
            "rows": n,
            "prompt": plen,
            "new_tokens": new,
            "P3": tps[f"ours, {n} distinct adapters"] / tps["HF generate (plain = merged model)"],
            "P3_one_adapter": tps["ours, 1 adapter on every row"] / tps["HF generate (plain = merged model)"],
            "P3_base_no_lora": tps["ours, base (no LoRA)"] / tps["HF generate (plain = merged model)"],
            "tokens_per_s": tps,
            "greedy_base_rows_equal_to_hf": f"{agree}/{n}",
            "table": table,
        }
    finally:
        del hf
        for aid in ids:
            engine.delete_adapter(aid)
        free(dev)


def free(dev: Any) -> None:
    import gc

    gc.collect()
    torch = _torch()
    if dev.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------- main
def environment(dev_name: str) -> dict[str, Any]:
    env: dict[str, Any] = {"python": sys.version.split()[0], "platform": platform.platform()}
    for mod in ("torch", "transformers", "peft", "safetensors", "tokenizers", "numpy"):
        try:
            env[mod] = __import__(mod).__version__
        except Exception as e:
            env[mod] = f"unavailable ({type(e).__name__}: {e})"
    try:
        torch = _torch()
        env["cuda_available"] = torch.cuda.is_available()
        env["torch_cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            env["gpu"] = torch.cuda.get_device_name(0)
            env["capability"] = list(torch.cuda.get_device_capability(0))
            env["gpu_count"] = torch.cuda.device_count()
        env["threads"] = torch.get_num_threads()
    except Exception as e:
        env["torch_error"] = str(e)
    env["device_requested"] = dev_name
    return env


def summary() -> None:
    print("\n" + "=" * 78)
    env = RESULTS.get("env", {})
    print(
        f"torch {env.get('torch')}  transformers {env.get('transformers')}  peft {env.get('peft')}  "
        f"GPU {env.get('gpu', '-')}  device {env.get('device_requested')}"
    )
    print(f"model: {RESULTS.get('model', {}).get('config')}  tf32: {RESULTS.get('tf32')}")
    imp = RESULTS.get("imports", {})
    print(f"imports: {'PASS' if imp.get('ok') else 'FAIL'}  {imp.get('layers_import_without_blocked')}")
    if imp.get("layering_bugs_top_level_imports_in_lower_layers"):
        print(f"  LAYERING BUGS: {imp['layering_bugs_top_level_imports_in_lower_layers']}")
    keys = ("max_rel_err", "grad_rel_err_max_tensor", "logprob_rel_err", "max_abs_err", "mismatches", "error")
    for name, r in RESULTS["checks"].items():
        detail = {k: r[k] for k in keys if k in r}
        print(f"  {name:<28} {'PASS' if r.get('ok') else 'FAIL'}  {detail}")
    for name, r in RESULTS["perf"].items():
        if "skipped" in r:
            print(f"  {name:<28} skipped: {r['skipped']}")
            continue
        if "error" in r:
            print(f"  {name:<28} ERROR {r['error']}")
            continue
        ratios = {
            k: round(v, 3) for k, v in r.items() if k.startswith(("P1", "P2", "P3")) and isinstance(v, float)
        }
        print(f"  {name:<28} {ratios}")
        if "tokens_per_s" in r:
            print(f"  {'':<28} tok/s {{{', '.join(f'{k}: {v:.0f}' for k, v in r['tokens_per_s'].items())}}}")
    for err in RESULTS.get("errors", []):
        print(f"  ERROR: {err}")
    print(f"overall: {'PASS' if RESULTS.get('ok') else 'FAIL'}  ({elapsed():.0f} s)")


def main() -> None:
    global OUT_FILE
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", nargs="?", default=None, help="folder for gpu_check.json (default $OUT or .)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny sizes (a CPU dry run of every code path)")
    ap.add_argument("--time-budget", type=float, default=360.0, help="skip perf items after this many s")
    ap.add_argument("--no-bf16", action="store_true", help="skip the bf16 engine")
    ap.add_argument("--no-perf", action="store_true", help="correctness checks only")
    args = ap.parse_args()
    out_dir = Path(args.out or os.environ.get("OUT") or ".")
    out_dir.mkdir(parents=True, exist_ok=True)
    OUT_FILE = out_dir / "gpu_check.json"
    RESULTS["args"] = vars(args)
    RESULTS["env"] = environment(args.device)
    print(json.dumps(RESULTS["env"], indent=1), flush=True)
    save()

    imp = run_item("checks", "imports", check_imports)
    RESULTS["imports"] = RESULTS["checks"].pop("imports")
    save()
    try:
        import torch

        import opentinker.engine
        import opentinker.lora
        import opentinker.models
        import opentinker.sampling  # noqa: F401
    except Exception as e:
        RESULTS["errors"].append(f"import failed in-process: {type(e).__name__}: {e}")
        RESULTS["import_traceback"] = traceback.format_exc()
        print(traceback.format_exc())
        RESULTS["ok"] = False
        save()
        summary()
        return
    del imp

    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        RESULTS["errors"].append("CUDA requested but torch.cuda.is_available() is False")
        RESULTS["ok"] = False
        save()
        summary()
        return
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    tf32: dict[str, Any] = {}
    for key, read in (
        ("matmul.allow_tf32", lambda: torch.backends.cuda.matmul.allow_tf32),
        ("cudnn.allow_tf32", lambda: torch.backends.cudnn.allow_tf32),
        ("float32_matmul_precision", torch.get_float32_matmul_precision),
        ("matmul.fp32_precision", lambda: getattr(torch.backends.cuda.matmul, "fp32_precision", None)),
    ):
        try:
            tf32[key] = read()
        except Exception as e:  # newer torch may refuse to read a legacy flag
            tf32[key] = f"unreadable ({type(e).__name__}: {e})"
    RESULTS["tf32"] = tf32
    sz = Sizes(args.small)
    tmp = tempfile.TemporaryDirectory(prefix="gpu-check-model-")
    folder = Path(tmp.name) / "smollm2-shaped-random"
    model_info = run_item("checks", "model_build", lambda: build_model_folder(folder, args.small))
    RESULTS["model"] = RESULTS["checks"].pop("model_build")
    if not model_info.get("ok"):
        RESULTS["ok"] = False
        save()
        summary()
        return

    from opentinker.engine import Engine
    from opentinker.models import load_base_model

    engine = None

    def load_fp32() -> dict[str, Any]:
        nonlocal engine
        base = load_base_model(str(folder), dtype=torch.float32, device=dev)
        engine = Engine(base, device=dev)
        return {"ok": True, "vocab": engine.vocab_size, "groups": sorted(engine.lora.groups)}

    run_item("checks", "engine_fp32_load", load_fp32)
    if engine is not None:
        eng = engine
        run_item("checks", "a_inv1_mixed_equals_alone", lambda: check_inv1(eng, sz))
        run_item("checks", "b_shared_prefix_equal", lambda: check_shared_prefix(eng, sz))
        run_item("checks", "c_inv3_sample_lp_eq_forward", lambda: check_inv3(eng, sz))
        run_item("checks", "d_greedy_mixed_eq_solo", lambda: check_greedy(eng, sz))

    def perf(name: str, fn: Callable[[], dict[str, Any]]) -> None:
        if args.no_perf:
            return
        if elapsed() > args.time_budget:
            RESULTS["perf"][name] = {"skipped": f"time guard: {elapsed():.0f} s > {args.time_budget:.0f} s"}
            print(f"\n=== perf/{name}: skipped by the time guard", flush=True)
            save()
            return
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        r = run_item("perf", name, fn)
        free(dev)
        if dev.type == "cuda":
            r["peak_mem_GiB"] = round(torch.cuda.max_memory_allocated(dev) / 2**30, 2)
            save()

    if engine is not None:
        eng = engine
        perf("P1_fp32", lambda: perf_p1(eng, sz, torch.float32))
        perf("P2_fp32", lambda: perf_p2(eng, sz))
        perf("P3_fp32", lambda: perf_p3(eng, sz, torch.float32))
    del engine
    free(dev)

    if not args.no_bf16:
        engine16 = None

        def load_bf16() -> dict[str, Any]:
            nonlocal engine16
            base = load_base_model(str(folder), dtype=torch.bfloat16, device=dev)
            engine16 = Engine(base, device=dev, dtype=torch.bfloat16)
            return {"ok": True}

        if args.no_perf:
            pass
        elif elapsed() <= args.time_budget:
            run_item("checks", "engine_bf16_load", load_bf16)
        else:
            RESULTS["perf"]["bf16"] = {"skipped": f"time guard: {elapsed():.0f} s > {args.time_budget:.0f} s"}
        if engine16 is not None:
            e16 = engine16
            perf("P3_bf16", lambda: perf_p3(e16, sz, torch.bfloat16))
            perf("P1_bf16", lambda: perf_p1(e16, sz, torch.bfloat16))
            perf("P2_bf16", lambda: perf_p2(e16, sz))
        del engine16
        free(dev)

    checks_ok = all(r.get("ok") for r in RESULTS["checks"].values())
    perf_ok = all(r.get("ok", True) for r in RESULTS["perf"].values())
    RESULTS["ok"] = bool(RESULTS["imports"].get("ok")) and checks_ok and perf_ok
    save()
    tmp.cleanup()
    summary()


if __name__ == "__main__":
    try:
        main()
    except SystemExit:
        raise
    except BaseException as exc:  # last resort: always leave a JSON behind
        RESULTS["ok"] = False
        RESULTS["errors"].append(f"{type(exc).__name__}: {exc}")
        RESULTS["fatal_traceback"] = traceback.format_exc()
        print(traceback.format_exc(), flush=True)
        with contextlib.suppress(Exception):
            save()
    sys.exit(0)
