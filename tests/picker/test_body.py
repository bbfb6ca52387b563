import json
import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kv_picker.config import ModelConfig
from kv_picker.errors import BadRequestError, ModelNotFoundError, PickerError
from kv_picker.handlers.body import parse_request

COMPLETIONS = {":path": "/v1/completions"}
CHAT = {":path": "/v1/chat/completions?x=1"}


def body(**fields: object) -> bytes:
    return json.dumps(fields).encode()


def test_completion_string_prompt() -> None:
    request = parse_request(
        body(model="m", prompt="abc", stream=True, cache_salt="t1"), COMPLETIONS
    )
    assert (request.model, request.kind, request.prompt.text) == ("m", "completions", "abc")
    assert request.stream is True
    assert request.cache_salt == "t1"
    assert request.request_id  # generated


def test_completion_list_prompts_and_token_ids() -> None:
    # A batch is routed on its first prompt: the blocks a later request can share.
    batch = parse_request(body(model="m", prompt=["ab", "cd"]), COMPLETIONS).prompt
    assert (batch.text, batch.num_prompts, batch.token_ids) == ("ab", 2, None)
    ids = parse_request(body(model="m", prompt=[1, 2, 3]), COMPLETIONS).prompt
    assert (ids.text, ids.token_ids) == ("1 2 3", (1, 2, 3))
    nested = parse_request(body(model="m", prompt=[[1, 2], [3]]), COMPLETIONS).prompt
    assert (nested.text, nested.token_ids, nested.num_prompts) == ("1 2", (1, 2), 2)


def test_chat_string_and_parts_render_in_order() -> None:
    messages = [
        {"role": "system", "content": "be brief"},
        {
            "role": "user",
            "content": [{"type": "text", "text": "hi "}, {"type": "text", "text": "there"}],
        },
        {"role": "assistant", "content": None},
    ]
    request = parse_request(body(model="m", messages=messages), CHAT)
    assert request.kind == "chat"
    assert request.path == "/v1/chat/completions"
    assert request.prompt.text.index("be brief") < request.prompt.text.index("hi there")
    user = request.prompt.messages[1]
    assert (user.role, user.content, user.identity) == ("user", "hi there", "hi there")


def test_chat_prefix_shared_between_turns() -> None:
    first = [{"role": "system", "content": "s" * 100}, {"role": "user", "content": "q1"}]
    second = [*first, {"role": "assistant", "content": "a1"}, {"role": "user", "content": "q2"}]
    a = parse_request(body(model="m", messages=first), CHAT).prompt.text
    b = parse_request(body(model="m", messages=second), CHAT).prompt.text
    assert b.startswith(a)


def test_request_id_header_kept() -> None:
    headers = {**COMPLETIONS, "x-request-id": "abc-1"}
    assert parse_request(body(model="m", prompt="x"), headers).request_id == "abc-1"


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (b"{not json", "not valid JSON"),
        (b"\xff\xfe", "not valid JSON"),
        (b"[1, 2]", "JSON object"),
        (body(prompt="x"), "model"),
        (body(model="", prompt="x"), "model"),
        (body(model=3, prompt="x"), "model"),
        (body(model="m"), "prompt"),
        (body(model="m", prompt=5), "prompt"),
        (body(model="m", prompt=[]), "prompt"),
        (body(model="m", prompt="x", stream="yes"), "stream"),
        (body(model="m", prompt="x", cache_salt=1), "cache_salt"),
    ],
)
def test_bad_completions_are_400(raw: bytes, fragment: str) -> None:
    with pytest.raises(BadRequestError, match=fragment) as info:
        parse_request(raw, COMPLETIONS)
    assert info.value.status == 400


@pytest.mark.parametrize(
    "messages",
    [
        None,
        [],
        "hi",
        [1],
        [{"content": "x"}],
        [{"role": "user", "content": 5}],
        [{"role": "user", "content": [{"text": "no type"}]}],
        [{"role": "user", "content": [{"type": "text", "text": 3}]}],
    ],
)
def test_bad_chat_is_400(messages: object) -> None:
    with pytest.raises(BadRequestError):
        parse_request(body(model="m", messages=messages), CHAT)


def test_deeply_nested_body_is_400() -> None:
    raw = b'{"model":"m","prompt":"x","a":' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    with pytest.raises(BadRequestError):
        parse_request(raw, COMPLETIONS)


def test_declared_models_and_lora_adapters() -> None:
    models = (ModelConfig("base", ("sql-lora",)),)
    lora = parse_request(body(model="sql-lora", prompt="x"), COMPLETIONS, models)
    assert (lora.target_model, lora.lora_adapter) == ("base", "sql-lora")
    assert parse_request(body(model="base", prompt="x"), COMPLETIONS, models).lora_adapter is None
    with pytest.raises(ModelNotFoundError) as info:
        parse_request(body(model="other", prompt="x"), COMPLETIONS, models)
    assert info.value.status == 404


def test_model_rewrite_header() -> None:
    headers = {**COMPLETIONS, "x-llm-d-model-name-rewrite": "target"}
    request = parse_request(body(model="m", prompt="x"), headers)
    assert (request.model, request.target_model) == ("m", "target")


@given(st.binary(max_size=300))
def test_any_bytes_parse_or_fail_cleanly(raw: bytes) -> None:
    try:
        request = parse_request(raw, COMPLETIONS)
    except PickerError as error:
        assert 400 <= error.status < 500
    else:
        assert request.model


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=5),
        lambda inner: (
            st.lists(inner, max_size=3)
            | st.dictionaries(
                st.sampled_from(["model", "prompt", "messages", "role", "content", "type", "text"]),
                inner,
                max_size=4,
            )
        ),
        max_leaves=20,
    )
)
def test_any_json_document_parses_or_fails_cleanly(document: object) -> None:
    raw = json.dumps(document).encode()
    for headers in (COMPLETIONS, CHAT, {":path": "/v1/embeddings"}):
        try:
            parse_request(raw, headers)
        except PickerError as error:
            assert error.status == 400


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (b'{"model":"m","prompt":"\\ud800","max_tokens":2}', "'prompt' is not valid Unicode"),
        (b'{"model":"\\udfff","prompt":"x"}', "'model' is not valid Unicode"),
        (b'{"model":"m","prompt":["\\ud800b"]}', "'prompt'[0]"),
        (b'{"model":"m","prompt":"x","cache_salt":"\\ud801"}', "cache_salt"),
        ('{"model":"m","prompt":"x","n":' + "9" * 5000 + "}", "JSON decoding refuses"),
    ],
)
def test_text_that_cannot_be_encoded_and_huge_numbers_are_400(
    raw: bytes | str, fragment: str
) -> None:
    data = raw.encode() if isinstance(raw, str) else raw
    with pytest.raises(BadRequestError, match=re.escape(fragment)):
        parse_request(data, COMPLETIONS)


def test_surrogates_in_chat_content_and_roles_are_400() -> None:
    for messages in (
        [{"role": "user", "content": "\ud800"}],
        [{"role": "\ud800", "content": "x"}],
        [{"role": "user", "content": [{"type": "text", "text": "a\udc00"}]}],
    ):
        with pytest.raises(BadRequestError, match="not valid Unicode"):
            parse_request(json.dumps({"model": "m", "messages": messages}).encode(), CHAT)


def test_non_text_parts_count_by_identity_and_other_fields_reach_the_template() -> None:
    image = {"type": "image_url", "image_url": {"url": "https://x/cat.png"}}
    other = {"type": "image_url", "image_url": {"url": "https://x/dog.png"}}
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "what is "}, image]},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "t1"}]},
    ]
    request = parse_request(body(model="m", messages=messages), CHAT)
    user, assistant = request.prompt.messages
    assert user.content == "what is "  # what a chat template renders
    assert "cat.png" in user.identity and "cat.png" in request.prompt.text
    assert assistant.extra == {"tool_calls": [{"id": "t1"}]}
    messages[0]["content"][1] = other  # type: ignore[index]
    different = parse_request(body(model="m", messages=messages), CHAT)
    assert different.prompt.text != request.prompt.text  # another image, another prefix


def test_dropping_the_payload_keeps_the_request_small() -> None:
    request = parse_request(body(model="m", prompt="x" * 100_000), COMPLETIONS)
    request.state["keys"] = list(range(1000))
    request.drop_payload()
    assert request.prompt.text == "" and request.kind == "completions"
    assert request.state == {}
    assert request.model == "m"  # what the response path still reads
