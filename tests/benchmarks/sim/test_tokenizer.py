"""Tests of the built-in tokenizer and chat template."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kv_picker_bench.sim.tokenizer import (
    IM_END_ID,
    IM_START_ID,
    RESERVED_IDS,
    VOCAB_SIZE,
    content_text,
    decode,
    decode_token,
    encode,
    render_chat,
)

# "<" is left out so random text never builds half of a chat marker across the split point.
_text = st.text(alphabet=st.characters(blacklist_characters="<", codec="utf-8"), max_size=80)


def test_encode_is_deterministic_and_pinned() -> None:
    # Pinned ids: they must not change across processes, machines or Python hash seeds,
    # because block hashes (and the router's index) are built from them.
    assert encode("hello world") == encode("hello world")
    assert encode("hello world") == [24929, 854]
    assert encode("") == []


def test_ids_are_in_range_and_long_words_are_split() -> None:
    ids = encode("internationalization, of course!")
    assert all(RESERVED_IDS <= i < VOCAB_SIZE for i in ids)
    # "internationalization" (20 chars) becomes 5 chunks of 4 characters.
    assert len(encode("internationalization")) == 5


def test_english_text_is_about_four_characters_per_token() -> None:
    text = "The quick brown fox jumps over the lazy dog while the router counts tokens. " * 50
    chars_per_token = len(text) / len(encode(text))
    assert 3.0 <= chars_per_token <= 6.0


@given(prefix=_text, suffix=_text)
def test_shared_prefix_text_gives_shared_leading_ids(prefix: str, suffix: str) -> None:
    head = encode(prefix)
    # Only the last piece of the prefix may merge with the suffix.
    assert encode(prefix + suffix)[: max(len(head) - 1, 0)] == head[:-1]


def test_chat_markers_are_single_special_tokens() -> None:
    ids = encode(render_chat([{"role": "user", "content": "hi  "}]))
    assert ids.count(IM_START_ID) == 2
    assert ids.count(IM_END_ID) == 1
    assert ids[0] == IM_START_ID


def test_render_chat_template_and_content_parts() -> None:
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}],
        },
    ]
    assert render_chat(messages) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


def test_multi_turn_conversation_shares_leading_ids() -> None:
    turn1 = [{"role": "user", "content": "What is a KV cache?"}]
    turn2 = [
        *turn1,
        {"role": "assistant", "content": "A store of attention keys and values."},
        {"role": "user", "content": "And prefix caching?"},
    ]
    first = encode(render_chat(turn1))
    second = encode(render_chat(turn2))
    assert second[: len(first) - 1] == first[:-1]


@pytest.mark.parametrize(
    "content",
    [42, [1, 2], [{"type": "text", "text": 3}], {"text": "x"}],
)
def test_bad_content_shapes_are_rejected(content: object) -> None:
    with pytest.raises(ValueError):
        content_text(content)


def test_bad_messages_are_rejected() -> None:
    with pytest.raises(ValueError):
        render_chat([{"content": "no role"}])
    with pytest.raises(ValueError):
        render_chat(["not an object"])  # type: ignore[list-item]


def test_content_none_and_non_text_parts() -> None:
    assert content_text(None) == ""
    assert content_text([{"type": "image_url", "image_url": {"url": "x"}}]) == ""


def test_decode_produces_words_for_generated_ids() -> None:
    assert decode_token(IM_START_ID) == ""
    text = decode([RESERVED_IDS, RESERVED_IDS + 1, 5000])
    assert text.startswith(" ")
    assert len(text.split()) == 3
