"""Images as input: decoding and its refusals (``models/vision.py``), and the SDK's chunks turned
into the engine's tokens and images (``service/convert.py``): what a datum's length counts.

Tinker counts an ``ImageChunk`` as its ``expected_tokens`` positions (``ModelInput.length``), and
the cookbook's ``create_rightshifted_model_input_and_leftshifted_targets`` gives those positions
target 0 (weight 0): here an image is that many placeholder ids in the datum, so
``target_tokens``, ``weights`` and ``advantages`` line up with ``ModelInput.length`` exactly.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch
from PIL import Image as PILImage
from tinker import types

from opentinker.engine import EngineError
from opentinker.models.loader import ModelLoadError, load_base_model
from opentinker.models.vision import MAX_IMAGE_PIXELS, ImageError, Vision, decode_image
from opentinker.service.convert import datum_to_example, model_input_parts
from tests.vision import jpeg, png, vl_model


@pytest.fixture(scope="module")
def vision(tmp_path_factory: pytest.TempPathFactory) -> Vision:
    base = load_base_model(vl_model(tmp_path_factory.mktemp("qwen3_vl"), "qwen3_vl"))
    assert base.vision is not None
    return base.vision


def test_png_and_jpeg_decode_and_count_like_the_cookbook(vision: Vision) -> None:
    for data, fmt in ((png(), "png"), (jpeg(), "jpeg")):
        image = vision.encode(data, fmt)
        # the cookbook's count (renderers/base.py image_to_chunk): patches // merge_size**2
        patches = vision.processor.get_number_of_image_patches(64, 64, images_kwargs={})
        assert image.n_tokens == patches // vision.processor.merge_size**2 == 4
        assert image.pixel_values.shape[0] == int(image.grid_thw.prod())
    wide, big = vision.encode(png((128, 32)), "png"), vision.encode(png((128, 128)), "png")
    assert wide.grid_thw.tolist() == [1, 2, 8] and big.n_tokens == 16
    assert vision.encode(png(seed=1), "png").digest != vision.encode(png(seed=2), "png").digest
    assert vision.encode(png(seed=1), "png").digest == vision.encode(png(seed=1), "png").digest


def _bad(data: bytes, fmt: str) -> ImageError:
    with pytest.raises(ImageError) as e:
        decode_image(data, fmt)
    assert "/" not in str(e.value) and "Traceback" not in str(e.value)
    return e.value


def test_bad_images_are_refused_naming_the_problem() -> None:
    good = png()
    corrupt = bytearray(good)
    corrupt[60:80] = b"\0" * 20  # inside IDAT: a bad CRC / a broken stream
    assert "corrupt" in str(_bad(bytes(corrupt), "png"))
    assert "truncated" in str(_bad(jpeg()[: len(jpeg()) // 2], "jpeg"))
    assert "unsupported image format 'gif'" in str(_bad(good, "gif"))
    buf = io.BytesIO()
    PILImage.new("RGB", (8, 8)).save(buf, format="GIF")
    assert "not a PNG or JPEG" in str(_bad(buf.getvalue(), "png"))
    assert "is PNG, but its format says jpeg" in str(_bad(good, "jpeg"))
    assert "not a PNG or JPEG" in str(_bad(b"hello", "png"))
    assert "no data" in str(_bad(b"", "png"))


def test_oversize_and_decompression_bomb_are_413_from_the_header() -> None:
    # a 6000 x 6000 one-bit PNG: 36M pixels in a few kB, refused before any pixel is decoded
    buf = io.BytesIO()
    PILImage.new("1", (6000, 6000)).save(buf, format="PNG")
    assert len(buf.getvalue()) < 100_000
    err = _bad(buf.getvalue(), "png")
    assert err.status == 413 and str(MAX_IMAGE_PIXELS) in str(err)
    with pytest.raises(ImageError) as e:
        decode_image(png((64, 64)), "png", max_pixels=1000)
    assert e.value.status == 413 and "64x64" in str(e.value)


def test_expected_tokens_that_disagree_are_refused(vision: Vision) -> None:
    assert vision.encode(png(), "png", expected_tokens=4).n_tokens == 4
    with pytest.raises(ImageError, match="expected_tokens=5 but this 64x64 image is 4 tokens"):
        vision.encode(png(), "png", expected_tokens=5)


def test_datum_length_targets_and_weights_count_image_positions(vision: Vision) -> None:
    image = types.ImageChunk(data=png(), format="png", expected_tokens=4)
    mi = types.ModelInput(
        chunks=[types.EncodedTextChunk(tokens=[5, 6]), image, types.EncodedTextChunk(tokens=[7, 8])]
    )
    assert mi.length == 8
    n = mi.length
    datum = types.Datum(
        model_input=mi,
        loss_fn_inputs={"target_tokens": [6, 0, 0, 0, 0, 7, 8, 9], "weights": [1, 0, 0, 0, 0, 1, 1, 1]},
    )
    ex = datum_to_example(datum, 0, vision)
    assert ex.tokens_T.tolist() == [5, 6, *[vision.image_token_id] * 4, 7, 8]
    assert ex.tokens_T.shape[0] == n == ex.inputs["target_tokens"].shape[0] and len(ex.images) == 1
    # expected_tokens unset: the processor's count is used
    tokens, images = model_input_parts(
        types.ModelInput(chunks=[types.ImageChunk(data=jpeg(), format="jpeg")]), vision, "prompt"
    )
    assert len(tokens) == images[0].n_tokens == 4
    with pytest.raises(EngineError, match="datum 3: chunk 1: expected_tokens=9"):
        model_input_parts(
            types.ModelInput(
                chunks=[
                    types.EncodedTextChunk(tokens=[1]),
                    types.ImageChunk(data=png(), format="png", expected_tokens=9),
                ]
            ),
            vision,
            "datum 3",
        )
    pointer = types.ImageAssetPointerChunk(format="png", location="/etc/passwd", expected_tokens=4)
    with pytest.raises(EngineError, match="image_asset_pointer.*send the image's bytes in an ImageChunk"):
        model_input_parts(types.ModelInput(chunks=[pointer]), vision, "prompt")
    with pytest.raises(EngineError, match="chunk 0 is an image, but this base model is text-only"):
        model_input_parts(types.ModelInput(chunks=[image]), None, "prompt")
    tokens, images = model_input_parts(types.ModelInput.from_ints([1, 2, 3]), None, "prompt")
    assert tokens == [1, 2, 3] and images == ()
    _ = torch


def test_a_vl_folder_without_its_image_processor_is_refused(tmp_path: Path) -> None:
    folder = Path(vl_model(tmp_path / "m", "qwen2_5_vl"))
    (folder / "preprocessor_config.json").unlink()
    with pytest.raises(ModelLoadError, match="no preprocessor_config.json") as e:
        load_base_model(str(folder))
    assert str(tmp_path) not in str(e.value)
    # Qwen3.5 has a text-only causal-LM class: without its image processor it loads as that
    folder = Path(vl_model(tmp_path / "q35", "qwen3_5"))
    (folder / "preprocessor_config.json").unlink()
    base = load_base_model(str(folder))
    assert base.vision is None and type(base.model).__name__ == "Qwen3_5ForCausalLM"
