"""Renderers: ChatML equals the model's own chat template token for token; supervised weights;
role-colon round trip; malformed messages named by index."""

from __future__ import annotations

from typing import Any

import pytest
from transformers import AutoTokenizer

from opentinker.models.registry import resolve_model_path
from opentinker.renderers import ChatMLRenderer, Message, RoleColonRenderer, get_renderer
from tests.conftest import TEST_MODEL

CONVERSATIONS: list[list[Message]] = [
    [{"role": "user", "content": "What is 12 + 34?"}],
    [
        {"role": "system", "content": "You are a calculator."},
        {"role": "user", "content": "What is 7 + 8? Answer with just the number."},
    ],
    [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Guess a number between 1 and 100."},
    ],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another, please.\nJust one word."},
        {"role": "assistant", "content": "Red"},
        {"role": "user", "content": "  spaced  out  "},
    ],
    [{"role": "user", "content": ""}],
    [{"role": "user", "content": "naïve café — 42"}],
]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return AutoTokenizer.from_pretrained(resolve_model_path(TEST_MODEL))


def _template_ids(tokenizer: Any, messages: list[Message], **kw: Any) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, **kw)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "keys") else out)


@pytest.mark.parametrize("idx", range(len(CONVERSATIONS)))
def test_chatml_prompt_equals_chat_template(tokenizer: Any, idx: int) -> None:
    messages = CONVERSATIONS[idx]
    r = ChatMLRenderer(tokenizer)
    want = _template_ids(tokenizer, messages, add_generation_prompt=True)
    assert r.build_generation_prompt(messages) == want


def test_auto_picks_chatml_for_a_chatml_template(tokenizer: Any) -> None:
    assert isinstance(get_renderer("auto", tokenizer), ChatMLRenderer)
    assert isinstance(get_renderer("role_colon", tokenizer), RoleColonRenderer)
    with pytest.raises(ValueError, match="unknown renderer"):
        get_renderer("nope", tokenizer)


def test_chatml_supervised_tokens_equal_template(tokenizer: Any) -> None:
    """The whole conversation (no generation prompt) is the template's tokens too."""
    messages = CONVERSATIONS[3][:-1]  # ends with an assistant turn
    r = ChatMLRenderer(tokenizer)
    tokens, weights = r.build_supervised_example(messages)
    assert tokens == _template_ids(tokenizer, messages)
    assert len(weights) == len(tokens)


def _trained_spans(tokens: list[int], weights: list[float]) -> list[list[int]]:
    spans: list[list[int]] = []
    cur: list[int] = []
    for t, w in zip(tokens, weights, strict=True):
        if w:
            cur.append(t)
        elif cur:
            spans.append(cur)
            cur = []
    if cur:
        spans.append(cur)
    return spans


def test_supervised_weights_all_vs_last_assistant(tokenizer: Any) -> None:
    r = ChatMLRenderer(tokenizer)
    messages = CONVERSATIONS[3][:-1]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    tokens, w_all = r.build_supervised_example(messages, "all_assistant")
    tokens2, w_last = r.build_supervised_example(messages, "last_assistant")
    assert tokens == tokens2
    assert set(w_all) == {0.0, 1.0} and set(w_last) == {0.0, 1.0}
    # every trained span is exactly one assistant body: its content, then the end marker
    spans_all = _trained_spans(tokens, w_all)
    assert spans_all == [[*r.encode("Blue."), end], [*r.encode("Red"), end]]
    assert _trained_spans(tokens, w_last) == [[*r.encode("Red"), end]]
    # last_assistant trains a subset of all_assistant
    assert all(a >= b for a, b in zip(w_all, w_last, strict=True))
    # headers, system and user turns never carry weight
    header = r.encode("<|im_start|>assistant\n")
    for i in range(len(tokens) - len(header) + 1):
        if tokens[i : i + len(header)] == header:
            assert not any(w_all[i : i + len(header)])


def test_supervised_needs_an_assistant_turn(tokenizer: Any) -> None:
    r = ChatMLRenderer(tokenizer)
    with pytest.raises(ValueError, match="assistant"):
        r.build_supervised_example([{"role": "user", "content": "hi"}])
    with pytest.raises(ValueError, match="train_on"):
        r.build_supervised_example(CONVERSATIONS[3][:3], "every_turn")  # type: ignore[arg-type]


@pytest.mark.parametrize("cls", [ChatMLRenderer, RoleColonRenderer])
def test_parse_response_round_trip(tokenizer: Any, cls: type) -> None:
    r = cls(tokenizer)
    for text in ["42", "The answer is 46.", "two words\nand a line"]:
        msgs: list[Message] = [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": text},
        ]
        tokens, weights = r.build_supervised_example(msgs)
        reply = [t for t, w in zip(tokens, weights, strict=True) if w]  # the trained body = a sampled reply
        msg, ended = r.parse_response(reply)
        assert msg == {"role": "assistant", "content": text} and ended
        # cut by the token limit: no end marker
        body = r.encode(text if cls is ChatMLRenderer else f" {text}")
        msg, ended = r.parse_response(body)
        assert msg["content"] == text and not ended


def test_role_colon_format_and_stop(tokenizer: Any) -> None:
    r = RoleColonRenderer(tokenizer)
    prompt = r.build_generation_prompt(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
    )
    assert r.decode(prompt) == "System: Be brief.\n\nUser: What is 2 + 2?\n\nAssistant:"
    assert r.stop == ["\n\n"]
    msg, ended = r.parse_response(r.encode(" 4\n\nUser: more"))
    assert msg["content"] == "4" and ended


@pytest.mark.parametrize("cls", [ChatMLRenderer, RoleColonRenderer])
def test_next_turn_extends_the_observation(tokenizer: Any, cls: type) -> None:
    """A multi-turn episode is one token sequence: prompt + reply + next_turn == the rendered
    conversation's next generation prompt."""
    r = cls(tokenizer)
    first: list[Message] = [{"role": "user", "content": "Guess my number."}]
    prompt = r.build_generation_prompt(first)
    body = r.encode("50" if cls is ChatMLRenderer else " 50")
    for ended, action in [(True, body + r._end_marker()), (False, body)]:
        feedback: list[Message] = [{"role": "user", "content": "Higher."}]
        ob = prompt + action + r.next_turn_tokens(ended, feedback)
        want = r.build_generation_prompt([*first, {"role": "assistant", "content": "50"}, *feedback])
        assert ob == want


@pytest.mark.parametrize(
    ("messages", "pattern"),
    [
        ([], r"non-empty list"),
        ("hello", r"non-empty list"),
        ([{"role": "user", "content": "ok"}, "oops"], r"messages\[1\]"),
        ([{"role": "user", "content": "ok"}, {"role": "robot", "content": "x"}], r"messages\[1\].*role"),
        ([{"role": "user", "content": 5}], r"messages\[0\].*content"),
        (
            [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user"}],
            r"messages\[2\]",
        ),
    ],
)
@pytest.mark.parametrize("cls", [ChatMLRenderer, RoleColonRenderer])
def test_bad_messages_name_the_index(tokenizer: Any, cls: type, messages: Any, pattern: str) -> None:
    r = cls(tokenizer)
    with pytest.raises(ValueError, match=pattern):
        r.build_generation_prompt(messages)
    with pytest.raises(ValueError, match=pattern):
        r.build_supervised_example(messages)


def test_chatml_needs_im_end(tokenizer: Any) -> None:
    class NoChatML:
        unk_token_id = 0
        chat_template = None

        def convert_tokens_to_ids(self, token: str) -> int:
            return 0

    with pytest.raises(ValueError, match="im_end"):
        ChatMLRenderer(NoChatML())
