"""Images over HTTP: the official ``tinker`` SDK against ``opentinker serve`` on a random 2-layer
Qwen3-VL (``tests/vision.py``): an SFT step with an ``ImageChunk`` in the datum (the SDK sends it
in its protobuf body), a sample with an image prompt (JSON), and the refusals: a wrong
``expected_tokens``, a corrupt PNG, an unsupported format and an image on a text-only model each
give a 400 naming the problem, with no server path or traceback, in ``sample`` and in
``forward_backward`` / ``forward`` alike: a refused training call spends its ``seq_id``, so the
model's next calls run at once, and nothing of the model changed (a twin that never saw the bad
calls ends bitwise equal). Usage bills an image as its processor's tokens, and
``record_stability_info`` on an image prompt records it by content for ``stable_reinforce``.
"""

from __future__ import annotations

import io
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from tests.vision import SPECIAL, jpeg, png, vl_model

KEY = "tml-vision-http"


def _message(exc: BaseException) -> str:
    return str(getattr(exc, "body", None) or exc)


def _usage(base_url: str) -> dict[str, int]:
    """The tokens billed to the test's tenant this hour, by kind (``AdminClient``)."""
    import tinker

    now = datetime.now(UTC).replace(minute=0, second=0, microsecond=0)
    window = ((now - timedelta(hours=2)).isoformat(), (now + timedelta(hours=2)).isoformat())
    usage = tinker.AdminClient(base_url=base_url, api_key=KEY).get_billing_usage(*window).result()
    out: dict[str, int] = {}
    for e in usage.data:
        out[e.event_info.type] = out.get(e.event_info.type, 0) + int(
            getattr(e.event_info, "token_count", 0) or 0
        )
    return out


def _stable_reinforce_on_an_image_prompt(service: Any, folder: str, model_input: Any) -> None:
    """``record_stability_info`` on an image prompt records it by content: datums naming the
    sampled sequences train with ``stable_reinforce`` (its loss on-policy: -Σ A·log p, the ratio
    of sampler and learner within invariant 3's bound of 1), and the same datum with another
    image in the prompt is refused as tokens that differ from the record."""
    import tinker
    from tinker import types

    tc = service.create_lora_training_client(base_model=folder, rank=4, seed=2).result()
    sc = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    prompt = model_input(types.ImageChunk(data=png(seed=7), format="png"), [7])
    params = types.SamplingParams(max_tokens=4, temperature=1.0, seed=1, stop=[])
    seqs = sc.sample(prompt, 2, params).result().sequences
    p = 3 + 4 + 2

    def datum(seq: types.SampledSequence, adv: float, image: bytes) -> types.Datum:
        toks, sid, ob = list(seq.tokens), seq.sequence_id or "", p - 1
        mi = model_input(types.ImageChunk(data=image, format="png", expected_tokens=4), [7, *toks[:-1]])
        inputs: Any = {
            "target_tokens": [0] * ob + toks,
            "advantages": [0.0] * ob + [adv] * len(toks),
            "logprobs": [0.0] * ob + list(seq.logprobs or []),
        }
        return types.Datum(model_input=mi, loss_fn_inputs=inputs).with_provenance(
            model_input=[
                types.PromptProvenanceSpan(sequence_id=sid, length=p),
                types.SampledProvenanceSpan(sequence_id=sid, length=len(toks) - 1),
            ],
            loss_fn_inputs=[
                types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=ob),
                types.SampledProvenanceSpan(sequence_id=sid, length=len(toks)),
            ],
        )

    data = [datum(s, a, png(seed=7)) for s, a in zip(seqs, (1.0, -0.5), strict=True)]
    plain = [types.Datum(model_input=d.model_input, loss_fn_inputs={"target_tokens": d.loss_fn_inputs["target_tokens"]}) for d in data]  # fmt: skip
    lps = [
        o["logprobs"].tolist()[p - 1 :] for o in tc.forward(plain, "cross_entropy").result().loss_fn_outputs
    ]
    want = -sum(a * sum(lp) for a, lp in zip((1.0, -0.5), lps, strict=True))
    got = tc.forward_backward(data, "stable_reinforce").result().metrics["loss:sum"]
    assert abs(got - want) <= 1e-3 * abs(want)  # the ratio is 1 within exp(1e-4) per sequence
    other = datum(seqs[0], 1.0, png(seed=8))
    with pytest.raises(
        tinker.RequestFailedError, match="span 0: the tokens differ from those the sequence recorded"
    ):
        tc.forward_backward([other], "stable_reinforce").result()


@pytest.mark.slow
def test_sdk_sft_step_and_sample_with_an_image(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    import tinker
    from tinker import types
    from transformers import AutoTokenizer

    from tests.conftest import local_server

    folder = vl_model(tmp_path / "qwen3-vl", "qwen3_vl")
    start, end = AutoTokenizer.from_pretrained(folder).convert_tokens_to_ids(SPECIAL[:2])

    def model_input(image: types.ImageChunk, tail: list[int]) -> types.ModelInput:
        return types.ModelInput(
            chunks=[
                types.EncodedTextChunk(tokens=[5, 6, start]),
                image,
                types.EncodedTextChunk(tokens=[end, *tail]),
            ]
        )

    good = types.ImageChunk(data=png(), format="png", expected_tokens=4)
    mi = model_input(good, [7, 8, 9, 10])
    n = mi.length  # 3 + 4 + 5: Tinker counts the image as its expected_tokens
    targets = [6, start, 0, 0, 0, 0, end, 7, 8, 9, 10, 11]  # the cookbook's: 0 for the image's
    weights = [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    assert n == len(targets)
    datum = types.Datum(model_input=mi, loss_fn_inputs={"target_tokens": targets, "weights": weights})
    with local_server(tmp_path_factory, "vl-server", base_model=folder) as srv:
        service = tinker.ServiceClient(base_url=srv.base_url, api_key=KEY)
        try:
            tc = service.create_lora_training_client(base_model=folder, rank=4, seed=0).result()
            losses = []
            for _ in range(3):
                losses.append(tc.forward_backward([datum], "cross_entropy").result().metrics["loss:sum"])
                tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            assert losses[-1] < losses[0]
            out = tc.forward([datum], "cross_entropy").result()
            assert len(out.loss_fn_outputs[0]["logprobs"].data) == n
            sampler = tc.save_weights_and_get_sampling_client().result()
            params = types.SamplingParams(max_tokens=5, temperature=1.0, seed=0, stop=[])
            prompt = model_input(types.ImageChunk(data=jpeg(seed=3), format="jpeg"), [7])
            res = sampler.sample(prompt, 2, params).result()
            assert len(res.sequences) == 2 and all(len(s.tokens) == 5 for s in res.sequences)
            lps = sampler.compute_logprobs(prompt).result()
            assert len(lps) == 3 + 4 + 2 and lps[0] is None

            corrupt = bytearray(png())
            corrupt[60:80] = b"\0" * 20
            gif = io.BytesIO()
            from PIL import Image

            Image.new("RGB", (8, 8)).save(gif, format="GIF")
            bad = {
                "expected_tokens=9 but this 64x64 image is 4 tokens": types.ImageChunk(data=png(), format="png", expected_tokens=9),
                "png image is truncated or corrupt": types.ImageChunk(data=bytes(corrupt), format="png", expected_tokens=4),
                "not a PNG or JPEG image": types.ImageChunk(data=gif.getvalue(), format="png", expected_tokens=4),
            }  # fmt: skip
            # a twin of tc: the same steps, never sent a bad image
            stepped = tc.save_state("stepped").result().path
            twin = service.create_training_client_from_state_with_optimizer(stepped).result()
            for client in (tc, twin):
                client.forward_backward([datum], "cross_entropy").result()  # gradients pending
            # a format the SDK's types do not allow (sent anyway): a 400 naming it, the JSON sample
            # body's schema check and the protobuf training body's alike
            gif_chunk = types.ImageChunk.model_construct(data=gif.getvalue(), format="gif", expected_tokens=4)
            for problem, chunk in [*bad.items(), ("unsupported image format 'gif'", gif_chunk)]:
                with pytest.raises(tinker.BadRequestError) as e:
                    sampler.sample(model_input(chunk, [7]), 1, params).result()
                assert problem in _message(e.value) and "Traceback" not in _message(e.value)
                assert str(tmp_path) not in _message(e.value)
                bad_datum = types.Datum(
                    model_input=model_input(chunk, [7, 8, 9, 10]), loss_fn_inputs=datum.loss_fn_inputs
                )
                # a training call too is refused at once, its seq_id spent: later calls do not wait
                for call in (tc.forward_backward, tc.forward):
                    with pytest.raises(tinker.BadRequestError) as e2:
                        call([datum, bad_datum], "cross_entropy").result()
                    assert e2.value.status_code == 400 and "datum 1: chunk 1: " in _message(e2.value)
                    assert problem in _message(e2.value)
                    assert str(tmp_path) not in _message(e2.value)
            # the model goes on, as if the refused calls had never been sent: its pending
            # gradients are its twin's, and so are its weights after the next steps
            for client in (tc, twin):
                client.optim_step(types.AdamParams(learning_rate=5e-2)).result()
                client.forward_backward([datum], "cross_entropy").result()
                client.optim_step(types.AdamParams(learning_rate=5e-2)).result()
            ours, theirs = (c.forward([datum], "cross_entropy").result() for c in (tc, twin))
            assert ours.loss_fn_outputs[0]["logprobs"].data == theirs.loss_fn_outputs[0]["logprobs"].data
            # over the pixel limit (4096 x 4096): a 6000 x 6000 one-bit PNG of a few kB, 413
            big = io.BytesIO()
            Image.new("1", (6000, 6000)).save(big, format="PNG")
            huge = types.ImageChunk(data=big.getvalue(), format="png")
            with pytest.raises(tinker.APIStatusError) as e3:
                sampler.sample(model_input(huge, [7]), 1, params).result()
            assert e3.value.status_code == 413 and "over the limit of 16777216" in _message(e3.value)
            pointer = types.ImageAssetPointerChunk(format="png", location="/etc/hosts", expected_tokens=4)
            with pytest.raises(tinker.BadRequestError, match="image_asset_pointer"):
                sampler.sample(model_input(pointer, [7]), 1, params).result()  # type: ignore[arg-type]
            # usage counts an image as its processor's tokens, expected_tokens set or not
            before = _usage(srv.base_url)
            unset = model_input(types.ImageChunk(data=png(seed=5), format="png"), [7, 8, 9, 10])
            tc.forward(
                [types.Datum(model_input=unset, loss_fn_inputs=datum.loss_fn_inputs)], "cross_entropy"
            ).result()
            sampler.sample(prompt, 1, types.SamplingParams(max_tokens=1, seed=0, stop=[])).result()
            after = _usage(srv.base_url)
            assert after["training"] - before.get("training", 0) == n  # 3 + 4 + 5
            assert after["sampling_prefill"] - before["sampling_prefill"] == 3 + 4 + 2
            _stable_reinforce_on_an_image_prompt(service, folder, model_input)
            # the model goes on: its next step is served, unaffected
            assert tc.forward([datum], "cross_entropy").result().metrics["loss:sum"] > 0
        finally:
            service.close("success").result()


def test_an_unsupported_image_format_in_a_json_body_is_a_400(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The SDK's types refuse ``format="gif"`` client-side, so raw HTTP: the JSON ``asample`` body's
    schema check refuses it with a 400 naming the chunk and the format, not pydantic's 422 dump
    (the body is checked before any model is involved: the text-only tiny model serves)."""
    import base64

    import httpx

    from tests.conftest import local_server

    gif = base64.b64encode(b"GIF89a\x01\x00\x01\x00").decode()
    body = {
        "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6]},
                              {"type": "image", "data": gif, "format": "gif", "expected_tokens": 4}]},
        "sampling_params": {"max_tokens": 2},
        "num_samples": 1,
        "base_model": "x",
    }  # fmt: skip
    with local_server(tmp_path_factory, "gif-json") as srv:
        r = httpx.post(f"{srv.base_url}/api/v1/asample", json=body, headers={"X-API-Key": KEY}, timeout=60)
        assert r.status_code == 400, r.text
        assert r.json() == {"detail": "prompt: chunk 1: unsupported image format 'gif': send png or jpeg"}
        body["prompt"]["chunks"][1]["format"] = "png"  # type: ignore[index]
        body["sampling_params"] = {"max_tokens": "many"}
        r = httpx.post(f"{srv.base_url}/api/v1/asample", json=body, headers={"X-API-Key": KEY}, timeout=60)
        assert r.status_code == 422  # any other schema error keeps FastAPI's answer
