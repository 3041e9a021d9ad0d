"""P4: snapshot handoff — trained weights to the first token sampled from them.

``save_weights_and_get_sampling_client`` in OpenTinker is an in-memory copy of one adapter's LoRA
tensors (an immutable snapshot) that the sampler reads directly. We time snapshot → first sampled
token, and compare it with (a) one decode step of a batch (target: the handoff's copy costs no
more than one decode step) and (b) what a stack without shared-base LoRA handoff must do: reload
full model weights from disk, then sample the first token (target ≥ 10× slower than ours).
Interleaved repeats, medians. Last line ``P4 <snapshot copy time ÷ one batch decode step>``.

``--worker``: the same handoff to a rollout worker process (opentinker/rollout): the snapshot's
LoRA tensors serialized as safetensors bytes, sent down the worker's pipe, decoded and registered
there (until the worker acknowledges it), and snapshot → first token sampled in the worker; against
a full-weights reload in a worker (what a worker does at start-up: load the base model's weights
and build its engine, timed inside the worker; one per worker started). Last line
``P4worker <full reload in the worker ÷ handoff to the worker>`` (target ≥ 10).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM

from opentinker.engine import AdamParams, Engine, Example, ForwardRequest
from opentinker.lora import LoRAConfig
from opentinker.models import load_base_model
from opentinker.sampling import NativeBackend, SampleRequest, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="opentinker/tiny")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--worker", action="store_true", help="hand snapshots to a rollout worker process")
    ap.add_argument("--reloads", type=int, default=3, help="--worker: workers started (full reloads)")
    args = ap.parse_args()
    if args.worker:
        worker_mode(args)
        return
    torch.manual_seed(0)
    base = load_base_model(args.model)
    engine = Engine(base)
    sampler = NativeBackend(engine, prefix_cache_bytes=0)  # every handoff prefills its prompt
    aid = engine.create_adapter(LoRAConfig(rank=args.rank, seed=0))
    g = torch.Generator().manual_seed(0)
    seq = torch.randint(3, base.vocab_size, (65,), generator=g)
    engine.forward_backward(ForwardRequest(aid, [Example(seq[:-1], {"target_tokens": seq[1:]})]))
    engine.optim_step(aid, AdamParams(learning_rate=1e-3))
    prompt = seq[:16].tolist()
    one = SamplingParams(max_tokens=1, temperature=1.0, seed=0)

    def handoff() -> tuple[float, float]:
        t = time.perf_counter()
        snap = engine.snapshot(aid)
        copied = time.perf_counter() - t
        [res] = sampler.generate([SampleRequest(snap.snapshot_id, prompt, one)])
        first = time.perf_counter() - t
        assert not isinstance(res, Exception)
        sampler.retire(snap.snapshot_id)
        return copied, first

    batch = [
        SampleRequest(aid, prompt, SamplingParams(max_tokens=9, temperature=1.0, seed=0, stop=[]))
    ] * args.batch
    short = [
        SampleRequest(aid, prompt, SamplingParams(max_tokens=1, temperature=1.0, seed=0, stop=[]))
    ] * args.batch

    def decode_step() -> float:
        # (time for 9 tokens - time for 1 token) / 8 = one decode step of the batch
        t = time.perf_counter()
        sampler.generate(short)
        t1 = time.perf_counter() - t
        t = time.perf_counter()
        sampler.generate(batch)
        t9 = time.perf_counter() - t
        return max(t9 - t1, 1e-9) / 8

    @torch.no_grad()
    def reload() -> float:
        t = time.perf_counter()
        model = AutoModelForCausalLM.from_pretrained(base.path, dtype=torch.float32).eval()
        model(input_ids=torch.tensor([prompt])).logits[:, -1].softmax(-1).multinomial(1)
        return time.perf_counter() - t

    handoff(), decode_step(), reload()
    copies, firsts, steps, reloads = [], [], [], []
    for _ in range(args.repeats):
        c, f = handoff()
        copies.append(c)
        firsts.append(f)
        steps.append(decode_step())
        reloads.append(reload())
    c, f, s, r = (statistics.median(x) for x in (copies, firsts, steps, reloads))
    nbytes = engine.adapter_weights(aid).nbytes()
    print(f"model {args.model}, adapter rank {args.rank} ({nbytes / 1e6:.2f} MB of LoRA weights)")
    print(f"  snapshot copy:                         {c * 1e3:8.2f} ms")
    print(f"  snapshot -> first sampled token:       {f * 1e3:8.2f} ms")
    print(f"  one decode step, batch of {args.batch}:          {s * 1e3:8.2f} ms")
    print(f"  reload full weights -> first token:    {r * 1e3:8.2f} ms")
    print(f"P4reload {r / f:.1f}")
    print(f"P4 {c / s:.3f}")


def worker_mode(args: argparse.Namespace) -> None:
    from opentinker.workers.pool import WorkerPool
    from opentinker.workers.wire import WorkerOptions

    torch.manual_seed(0)
    engine = Engine(load_base_model(args.model))
    pin = NativeBackend(engine, lean_decode=False, prefix_cache_bytes=0).decoder(snapshots_only=True).pin
    pool = WorkerPool(engine, pin, 1, WorkerOptions(args.model, prefix_cache_bytes=0))
    try:
        aid = engine.create_adapter(LoRAConfig(rank=args.rank, seed=0))
        g = torch.Generator().manual_seed(0)
        seq = torch.randint(3, engine.vocab_size, (65,), generator=g)
        engine.forward_backward(ForwardRequest(aid, [Example(seq[:-1], {"target_tokens": seq[1:]})]))
        engine.optim_step(aid, AdamParams(learning_rate=1e-3))
        prompt = seq[:16].tolist()
        one = SamplingParams(max_tokens=1, temperature=1.0, seed=0)
        pool.submit(SampleRequest(None, prompt, one)).future.result()  # warm
        handoffs, firsts = [], []
        for _ in range(args.repeats):
            snap = engine.snapshot(aid).snapshot_id
            handoffs.append(pool.publish(snap))  # bytes out, decoded and registered, acknowledged
            engine.release_snapshot(snap)
            snap = engine.snapshot(aid).snapshot_id
            t = time.perf_counter()
            pool.submit(SampleRequest(snap, prompt, one)).future.result()  # handoff on first use + sample
            firsts.append(time.perf_counter() - t)
            engine.release_snapshot(snap)
        reloads = [r.load_s for r in pool.ready]
        for _ in range(max(args.reloads - 1, 0)):
            pool.add_worker()
        reloads = [r.load_s for r in pool.ready] + [
            s.handle.ready.load_s for s in pool._slots[1:] if s.handle is not None and s.handle.ready
        ]
    finally:
        pool.shutdown()
    h, f, r = statistics.median(handoffs), statistics.median(firsts), statistics.median(reloads)
    nbytes = engine.adapter_weights(aid).nbytes()
    print(f"model {args.model}, adapter rank {args.rank} ({nbytes / 1e6:.2f} MB of LoRA weights)")
    print(f"  handoff to a worker (bytes, acknowledged):   {h * 1e3:8.2f} ms  (median of {len(handoffs)})")
    print(f"  snapshot -> first token in the worker:       {f * 1e3:8.2f} ms")
    print(f"  full-weights reload in a worker:             {r * 1e3:8.2f} ms  (median of {len(reloads)})")
    print(f"P4worker {r / h:.1f}")
    print(f"P4worker_first_token {r / f:.1f}")


if __name__ == "__main__":
    main()
