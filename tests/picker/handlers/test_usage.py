import json

from hypothesis import given
from hypothesis import strategies as st

from kv_picker.handlers.usage import UsageReader

USAGE = {"prompt_tokens": 10, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 8}}


def test_json_response_usage() -> None:
    reader = UsageReader(streaming=False)
    body = json.dumps({"choices": [], "usage": USAGE}).encode()
    reader.feed(body[:7])
    reader.feed(body[7:])
    usage = reader.result()
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_tokens) == (10, 3, 8)


def test_sse_usage_split_across_chunks() -> None:
    reader = UsageReader(streaming=True)
    stream = (
        b'data: {"choices":[{"text":"a"}]}\n\n'
        + b"data: "
        + json.dumps({"choices": [], "usage": USAGE}).encode()
        + b"\n\ndata: [DONE]\n\n"
    )
    for i in range(0, len(stream), 5):
        reader.feed(stream[i : i + 5])
    usage = reader.result()
    assert usage is not None and usage.cached_tokens == 8


def test_no_usage_is_none() -> None:
    reader = UsageReader(streaming=True)
    reader.feed(b"data: [DONE]\n\n")
    assert reader.result() is None
    plain = UsageReader(streaming=False)
    plain.feed(b"not json")
    assert plain.result() is None


@given(st.lists(st.binary(max_size=50), max_size=10), st.booleans())
def test_garbage_never_raises(chunks: list[bytes], streaming: bool) -> None:
    reader = UsageReader(streaming)
    for chunk in chunks:
        reader.feed(chunk)
    reader.result()
