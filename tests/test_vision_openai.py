"""Images on the OpenAI chat route: the real ``openai`` client against ``opentinker serve`` on a
random 2-layer Qwen3-VL (``tests/vision.py``). A user message with an inline PNG
(``image_url`` with a ``data:`` URL) samples exactly the tokens (and logprobs) the Tinker
``sample`` route gives for the same prompt with the same image as an ``ImageChunk``; another
image gives other tokens. Refused with a 400 in OpenAI's shape naming the part: an http(s) URL
(the server fetches nothing), another media type, bad base64, a corrupt PNG; and an image part on
a text-only model.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import TEST_MODEL, local_server
from tests.vision import SPECIAL, png, vl_model

KEY = "tml-vision-openai"


def _url(data: bytes, kind: str = "png") -> str:
    return f"data:image/{kind};base64,{base64.b64encode(data).decode()}"


def _messages(url: str) -> list[dict[str, Any]]:
    parts = [{"type": "text", "text": "what is"}, {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "?"}]  # fmt: skip
    return [{"role": "user", "content": parts}]


@pytest.mark.slow
def test_chat_with_an_image_equals_the_tinker_sample_route(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    import openai
    import tinker
    from tinker import types
    from transformers import AutoTokenizer

    folder = vl_model(tmp_path / "qwen3-vl", "qwen3_vl")
    tok = AutoTokenizer.from_pretrained(folder)
    # the prompt as the chat template renders it, the image in its place as an ImageChunk
    text = tok.apply_chat_template(
        [{"role": "user", "content": "what is" + "".join(SPECIAL[:3][i] for i in (0, 2, 1)) + "?"}],
        add_generation_prompt=True,
        tokenize=False,
    )
    ids = tok.encode(text, add_special_tokens=False)
    pad = ids.index(tok.convert_tokens_to_ids(SPECIAL[2]))
    params = types.SamplingParams(max_tokens=6, temperature=1.0, seed=11, stop=[])
    with local_server(tmp_path_factory, "vl-openai", base_model=folder) as srv:
        service = tinker.ServiceClient(base_url=srv.base_url, api_key=KEY)
        oa = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key=KEY, max_retries=0)
        try:
            sampler = service.create_sampling_client(base_model=folder).result()
            for seed in (1, 2):
                image = types.ImageChunk(data=png(seed=seed), format="png")
                prompt = types.ModelInput(
                    chunks=[types.EncodedTextChunk(tokens=ids[:pad]), image, types.EncodedTextChunk(tokens=ids[pad + 1 :])]
                )  # fmt: skip
                ref = sampler.sample(prompt, 2, params).result()
                chat = oa.chat.completions.create(
                    model=folder, messages=_messages(_url(png(seed=seed))), n=2, max_tokens=6,  # type: ignore[arg-type]
                    temperature=1.0, seed=11, logprobs=True, extra_body={"return_tokens_as_token_ids": True},
                )  # fmt: skip
                for c, s in zip(chat.choices, ref.sequences, strict=True):
                    assert c.logprobs is not None and c.logprobs.content is not None
                    assert [int(e.token.removeprefix("token_id:")) for e in c.logprobs.content] == list(
                        s.tokens
                    )
                    assert [e.logprob for e in c.logprobs.content] == pytest.approx(
                        list(s.logprobs or []), abs=1e-6
                    )
                assert (
                    chat.usage is not None and chat.usage.prompt_tokens == len(ids) - 1 + 4
                )  # the image: 4 tokens
                if seed == 1:
                    first = [list(s.tokens) for s in ref.sequences]
            assert [list(s.tokens) for s in ref.sequences] != first  # another image, other tokens
            corrupt = bytearray(png())
            corrupt[60:80] = b"\0" * 20
            bad = {
                "fetches nothing": "https://example.com/cat.png",
                "must be a data:image/png;base64": "data:image/gif;base64,R0lGODlh",
                "base64 image data is malformed": "data:image/png;base64,@@@",
                "png image is truncated or corrupt": _url(bytes(corrupt)),
            }
            for problem, url in bad.items():
                with pytest.raises(openai.BadRequestError) as e:
                    oa.chat.completions.create(model=folder, messages=_messages(url), max_tokens=2)  # type: ignore[arg-type]
                err = e.value.body
                assert isinstance(err, dict) and problem in err["message"], err
                assert (
                    err["param"].startswith("messages[0].content[1]") and str(tmp_path) not in err["message"]
                )
        finally:
            service.close("success").result()
    with local_server(tmp_path_factory, "text-openai") as srv:
        oa = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key=KEY, max_retries=0)
        with pytest.raises(openai.BadRequestError, match="is a text-only model; it takes no images"):
            oa.chat.completions.create(model=TEST_MODEL, messages=_messages(_url(png())), max_tokens=2)  # type: ignore[arg-type]
