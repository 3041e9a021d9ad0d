"""Image prompts: the vision tower once per request ÷ the vision tower once per decode step.

16 rows on 16 adapters, one image each (a different random image per row), sampled with the
native sampler's step-wise decoder (``sampling/vision.py``: the tower embeds each request's image
at its prefill only). The naive alternative is what an implementation without that does: the
same decoder, plus the vision tower run again at every decode step on the image of every row
still decoding (the embeddings recomputed each step). Both run side by side, interleaved, in one
process; printed: each median and the ratio naive ÷ ours (> 1: once per request is faster), and
the tower calls each made (ours: one per prefill; naive: one per step more).

The model is a random Qwen3-VL (``--family``) scaled up from the tests' fixture: hidden 128, 4
layers; a vision tower of depth 4, hidden 128; the tiny model's tokenizer with the vision tokens,
and transformers' PIL image processor with up to 224x224 pixels (64 image tokens at 224x224).

    python benchmarks/p_vision.py --threads 1
    python benchmarks/p_vision.py --image 224 --new-tokens 16 --repeats 3 --threads 1
"""

from __future__ import annotations

import argparse
import io
import statistics
import tempfile
import time
from typing import Any

import numpy as np
import torch
from timing import add_device_args, device_of, interleaved, write_json

from opentinker.engine import Engine
from opentinker.lora import LoRAConfig
from opentinker.models import load_base_model
from opentinker.sampling import NativeBackend, SampleRequest, SamplingParams

SPECIAL = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def make_model(folder: str, family: str) -> str:
    """A random VL ``family`` model (module docstring), saved to ``folder``."""
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer, Qwen2VLImageProcessorPil

    from opentinker.models.registry import tiny_model_dir

    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir()))
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    start, end, image, video = tok.convert_tokens_to_ids(SPECIAL)
    ids = dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    text = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=352, head_dim=32, vocab_size=len(tok), **ids)  # fmt: skip
    if family == "qwen3_vl":
        text["rope_scaling"] = {"rope_type": "default", "mrope_section": [4, 6, 6], "mrope_interleaved": True}
    vision = dict(depth=4, hidden_size=128, intermediate_size=352, num_heads=4, out_hidden_size=128,
                  patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=256)  # fmt: skip
    config = AutoConfig.for_model(family, text_config=text, vision_config=vision, image_token_id=image,
                                  video_token_id=video, vision_start_token_id=start, vision_end_token_id=end,
                                  **ids)  # fmt: skip
    torch.manual_seed(0)
    AutoModelForImageTextToText.from_config(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2, min_pixels=32 * 32,
                             max_pixels=224 * 224).save_pretrained(folder)  # fmt: skip
    return folder


def png(size: int, seed: int) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8), "RGB").save(buf, format="PNG")
    return buf.getvalue()


def run(engine: Engine, reqs: list[SampleRequest], naive: bool, tower_calls: list[int]) -> None:
    """Sample ``reqs`` to completion; ``naive``: the tower again at every step on every live row's image."""
    model = engine.base.model
    dec = NativeBackend(engine, prefix_cache_bytes=0).decoder()
    done = dict(dec.admit([(i, dec.pin(r)) for i, r in enumerate(reqs)]))
    while dec.live_rows:
        if naive:  # the embeddings of every live row's image, recomputed for this step
            live = [reqs[i] for i in dec.running()]
            pixels = torch.cat([im.pixel_values for r in live for im in r.images]).to(engine.device)
            grid = torch.stack([im.grid_thw for r in live for im in r.images]).to(engine.device)
            with torch.no_grad():
                model.model.get_image_features(pixels, grid)
            tower_calls[0] += 1
        done.update(dec.step())
    bad = [r for r in done.values() if isinstance(r, Exception)]
    if bad:
        raise bad[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", default="qwen3_vl", choices=["qwen3_vl", "qwen2_5_vl", "qwen3_5"])
    ap.add_argument("--rows", type=int, default=16, help="rows = adapters, one image each")
    ap.add_argument("--image", type=int, default=224, help="image side in pixels")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    add_device_args(ap)
    args = ap.parse_args()
    dev, _ = device_of(args)
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    folder = make_model(tempfile.mkdtemp(prefix="p-vision-"), args.family)
    engine = Engine(load_base_model(folder, device=dev), device=dev)
    vision = engine.base.vision
    assert vision is not None
    start, end = engine.base.tokenizer.convert_tokens_to_ids(SPECIAL[:2])
    reqs = []
    for i in range(args.rows):
        aid = engine.create_adapter(LoRAConfig(rank=8, seed=i))
        for t in engine.adapter_weights(aid).b.values():
            with torch.no_grad():
                t.normal_(0, 0.01)
        image = vision.encode(png(args.image, i), "png")
        prompt = [5, 6, start, *[vision.image_token_id] * image.n_tokens, end, 7, 8]
        params = SamplingParams(max_tokens=args.new_tokens, temperature=1.0, seed=i, stop=[])
        reqs.append(SampleRequest(engine.snapshot(aid).snapshot_id, prompt, params, images=(image,)))
    calls = {"ours": [0], "naive": [0]}
    alternatives: dict[str, Any] = {
        "ours (tower once per request)": lambda: run(engine, reqs, False, calls["ours"]),
        "naive (tower per decode step)": lambda: run(engine, reqs, True, calls["naive"]),
    }
    n_tokens = reqs[0].images[0].n_tokens
    print(
        f"{args.family} (hidden 128, 4 layers; tower depth 4) on {dev}, {torch.get_num_threads()} threads: "
        f"{args.rows} rows on {args.rows} adapters, one {args.image}x{args.image} image each ({n_tokens} "
        f"image tokens), {args.new_tokens} new tokens; {args.warmup} warm-up + {args.repeats} timed; "
        f"setup {time.perf_counter() - t0:.1f} s"
    )
    times = interleaved(alternatives, args.repeats, args.warmup, dev)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    for name, ts in times.items():
        print(f"  {name:34s} median {med[name] * 1e3:8.1f} ms  ({', '.join(f'{t * 1e3:.0f}' for t in ts)})")
    ours, naive = med["ours (tower once per request)"], med["naive (tower per decode step)"]
    runs = args.warmup + args.repeats
    print(f"  extra tower calls per run (naive): {calls['naive'][0] / runs:.0f}")
    print(f"  naive ÷ ours: {naive / ours:.2f}x")
    write_json(args, {"ours_ms": ours * 1e3, "naive_ms": naive * 1e3, "ratio": naive / ours,
                      "rows": args.rows, "image": args.image, "image_tokens": n_tokens,
                      "new_tokens": args.new_tokens, "family": args.family})  # fmt: skip


if __name__ == "__main__":
    main()
