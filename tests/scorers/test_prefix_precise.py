"""precise-prefix-cache-scorer: exact tokens, real holders from KV events, cache_salt isolation
in both prefix scorers, the async preparation hook, and the config that selects it (including
the deprecated ``prefix-cache-scorer`` with ``mode: precise``)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_picker.config import parse_config
from kv_picker.director import Director
from kv_picker.errors import ConfigError
from kv_picker.handlers.body import parse_request
from kv_picker.handlers.extproc import ExternalProcessor
from kv_picker.metrics import PickerMetrics
from kv_picker.plugins import builtin_registry
from kv_picker.request import LLMRequest, Prompt
from kv_picker.scheduling.framework import ProfileResult, SchedulingResult
from kv_picker.scheduling.scheduler import Scheduler
from kv_picker.scheduling.signals import PREFIX_MATCH, PROMPT_TOKENS, cached_tokens
from kv_picker.scorers.precise_prefix_cache import (
    PrecisePrefixCacheParams,
    PrecisePrefixCacheScorer,
)
from kv_picker.scorers.prefix_cache import PrefixCacheParams, PrefixCacheScorer
from kv_picker.state.block_events import BlockRemoved, BlockStored, EventKeys, Tiers
from kv_picker.state.endpoints import EndpointStore
from kv_picker.state.kv_index import KVBlockIndex
from kv_picker.state.tokenization import PromptTokenizer, TokenizerError
from tests.fakes import ManualClock, make_context, make_store

TOKENIZER = str(Path(__file__).resolve().parents[2] / "benchmarks" / "tokenizer")
REGISTRY = builtin_registry(include_entry_points=False)
Mode = processing_mode_pb2.ProcessingMode


def request_for(body: dict[str, Any], path: str = "/v1/completions") -> LLMRequest:
    return parse_request(json.dumps(body).encode(), {":path": path})


def precise_scorer(
    store: EndpointStore, index: KVBlockIndex, **params: Any
) -> PrecisePrefixCacheScorer:
    ctx = make_context(store)
    ctx.kv_index = index
    return PrecisePrefixCacheScorer(
        "p", PrecisePrefixCacheParams(tokenizer=TOKENIZER, **params), ctx
    )


def store_blocks(index: KVBlockIndex, endpoint_id: int, tokens: list[int], **kw: Any) -> int:
    """What the endpoint's BlockStored event for these tokens makes the index hold."""
    blocks = len(tokens) // 16
    first_hash = 1000 * (endpoint_id + 1)
    hashes = list(range(first_hash, first_hash + blocks))
    return index.apply_stored(
        endpoint_id, BlockStored(hashes, None, tokens[: blocks * 16], 16, **kw), "m"
    )


def scores(
    scorer: PrefixCacheScorer | PrecisePrefixCacheScorer,
    request: LLMRequest,
    candidates: list[Any],
) -> list[float]:
    out = [0.0] * len(candidates)
    scorer.score(request, candidates, out)
    return out


TOKENIZED = PromptTokenizer.load(TOKENIZER)
PROMPT = "You are a routing assistant for the cache block token prefix. " * 12


def test_scores_are_matched_leading_blocks_over_request_blocks() -> None:
    store = make_store(3)
    index = KVBlockIndex(EventKeys())
    scorer = precise_scorer(store, index)
    tokens = TOKENIZED.encode(PROMPT)
    total = len(tokens) // 16
    assert total >= 8
    store_blocks(index, 1, tokens)  # endpoint 1 holds everything
    store_blocks(index, 2, tokens[: 16 * 3])  # endpoint 2 the first three blocks
    request = request_for({"model": "m", "prompt": PROMPT})
    assert scores(scorer, request, store.all()) == [0.0, 1.0, 3 / total]
    match = request.state[PREFIX_MATCH]
    assert match.block_tokens == 16 and match.total_blocks == total
    assert match.matched_blocks == {1: total, 2: 3}
    assert request.state[PROMPT_TOKENS] == len(tokens)
    # Candidates may be a subset, in any order.
    subset = [store.all()[2], store.all()[0]]
    assert scores(scorer, request_for({"model": "m", "prompt": PROMPT}), subset) == [3 / total, 0]
    # A removal the endpoint reports cuts its run.
    index.apply_removed(1, BlockRemoved([1000 * 2 + 4]))
    assert (
        scores(scorer, request_for({"model": "m", "prompt": PROMPT}), store.all())[1] == 4 / total
    )
    # Nothing recorded on pick: only events change what the index holds.
    before = index.num_blocks()
    result = SchedulingResult("d", {"d": ProfileResult([store.all()[0]], store.all(), [])})
    scorer.on_pick(request, result)
    assert index.num_blocks() == before
    assert scorer.hit_blocks == total + 3 + 4


def test_blocks_in_other_tiers_count_with_their_weight() -> None:
    """llm-d's weights: a block offloaded to CPU weighs 0.8; matched blocks count every tier."""
    store = make_store(3)
    index = KVBlockIndex(EventKeys(tiers=Tiers({"gpu": 1.0, "cpu": 0.8, "storage": 0.25})))
    scorer = precise_scorer(store, index)
    tokens = TOKENIZED.encode(PROMPT)
    total = len(tokens) // 16
    store_blocks(index, 0, tokens, medium="GPU")
    store_blocks(index, 1, tokens, medium="CPU")
    # Endpoint 2: its first four blocks on GPU, the rest in storage.
    store_blocks(index, 2, tokens[: 16 * 4])
    hashes = list(range(3000, 3000 + total))
    rest = BlockStored(hashes[4:], 3003, tokens[16 * 4 : 16 * total], 16, medium="STORAGE")
    assert index.apply_stored(2, rest, "m") == total - 4
    request = request_for({"model": "m", "prompt": PROMPT})
    assert scores(scorer, request, store.all()) == [
        1.0,
        pytest.approx(0.8),
        pytest.approx((4 + 0.25 * (total - 4)) / total),
    ]
    assert request.state[PREFIX_MATCH].matched_blocks == {0: total, 1: total, 2: total}
    # The CPU tier's eviction leaves endpoint 0's GPU blocks alone.
    index.apply_removed(0, BlockRemoved([1000 + 2], medium="CPU"))
    index.apply_removed(1, BlockRemoved([2000 + 2], medium="CPU"))
    request = request_for({"model": "m", "prompt": PROMPT})
    assert scores(scorer, request, store.all())[:2] == [1.0, pytest.approx(0.8 * 2 / total)]


def test_tier_weights_are_configured_in_the_index_section() -> None:
    document = {"kvEvents": {"model": "m"}, "plugins": [{"type": "max-score-picker"}]}
    config = parse_config({**document, "index": {"tierWeights": {"GPU": 1, "CPU": 0.5}}}, REGISTRY)
    assert config.index.tier_weights == {"GPU": 1.0, "CPU": 0.5}
    with pytest.raises(ConfigError, match=r"index\.tierWeights\.cpu: must be <= 1"):
        parse_config({**document, "index": {"tierWeights": {"gpu": 1, "cpu": 2}}}, REGISTRY)
    with pytest.raises(ConfigError, match=r"index\.tierWeights: the gpu tier needs a weight"):
        parse_config({**document, "index": {"tierWeights": {"cpu": 0.8}}}, REGISTRY)


def test_cache_salt_isolates_tenants_in_both_modes() -> None:
    store = make_store(2)
    index = KVBlockIndex(EventKeys())
    precise = precise_scorer(store, index)
    tokens = TOKENIZED.encode(PROMPT)
    store_blocks(index, 0, tokens, extra_keys=[("tenant-a",)])  # salted as vLLM reports it
    store_blocks(index, 1, tokens)  # the same text, unsalted
    body = {"model": "m", "prompt": PROMPT}
    assert scores(precise, request_for({**body, "cache_salt": "tenant-a"}), store.all()) == [1, 0]
    assert scores(precise, request_for({**body, "cache_salt": "tenant-b"}), store.all()) == [0, 0]
    assert scores(precise, request_for(body), store.all()) == [0, 1]
    approximate = PrefixCacheScorer("a", PrefixCacheParams(), make_context(store))
    salted = request_for({**body, "cache_salt": "tenant-a"})
    scores(approximate, salted, store.all())
    approximate.on_pick(
        salted, SchedulingResult("d", {"d": ProfileResult([store.all()[0]], store.all(), [])})
    )
    assert scores(approximate, request_for({**body, "cache_salt": "tenant-a"}), store.all()) == [
        1,
        0,
    ]
    assert scores(approximate, request_for({**body, "cache_salt": "tenant-b"}), store.all()) == [
        0,
        0,
    ]
    assert scores(approximate, request_for(body), store.all()) == [0, 0]


def test_chat_requests_use_the_chat_template_and_token_prompts_their_ids() -> None:
    store = make_store(2)
    index = KVBlockIndex(EventKeys())
    scorer = precise_scorer(store, index)
    messages = [
        {"role": "system", "content": PROMPT},
        {"role": "user", "content": [{"type": "text", "text": "Which endpoint?"}]},
    ]
    # What the template sees: each message's text content as a string.
    rendered = TOKENIZED.render_chat([messages[0], {"role": "user", "content": "Which endpoint?"}])
    chat_tokens = TOKENIZED.encode(rendered, add_special_tokens=False)
    assert rendered.startswith("<|im_start|>system\n")
    store_blocks(index, 1, chat_tokens)
    chat = request_for({"model": "m", "messages": messages}, "/v1/chat/completions")
    assert scores(scorer, chat, store.all()) == [0.0, 1.0]
    # The same conversation one turn later shares the leading blocks.
    later = [
        *messages,
        {"role": "assistant", "content": "That one."},
        {"role": "user", "content": "Why?"},
    ]
    longer = request_for({"model": "m", "messages": later}, "/v1/chat/completions")
    assert 0 < scores(scorer, longer, store.all())[1] < 1
    # A completion sent as token ids is matched on those ids.
    ids = request_for({"model": "m", "prompt": chat_tokens})
    assert scores(scorer, ids, store.all()) == [0.0, 1.0]
    nested = request_for({"model": "m", "prompt": [chat_tokens]})
    assert scores(scorer, nested, store.all()) == [0.0, 1.0]
    # A prompt of no known shape, or out-of-range ids: no signal, no failure.
    odd = LLMRequest("r", "m", "m", "/v1/chat/completions", Prompt("chat", "x"))
    assert scores(scorer, odd, store.all()) == [0.0, 0.0]
    huge = request_for({"model": "m", "prompt": [2**40] * 32})
    assert scores(scorer, huge, store.all()) == [0.0, 0.0]


async def test_long_prompts_are_tokenized_on_a_thread_pool() -> None:
    store = make_store(2)
    index = KVBlockIndex(EventKeys())
    scorer = precise_scorer(store, index, tokenizeInlineMaxChars=1000)
    long_prompt = PROMPT * 40
    tokens = TOKENIZED.encode(long_prompt)
    store_blocks(index, 0, tokens[: 16 * 300])
    short = request_for({"model": "m", "prompt": PROMPT})
    assert scorer.prepare(short) is None  # tokenized inline, nothing to fetch: no coroutine
    request = request_for({"model": "m", "prompt": long_prompt})
    pending = scorer.prepare(request)
    assert pending is not None
    await pending
    assert scorer.prepare(request) is None  # done once
    # Head-only tokenization: the first maxPrefixBlocksToMatch blocks, exactly.
    assert scores(scorer, request, store.all()) == [1.0, 0.0]
    assert request.state[PREFIX_MATCH].total_blocks == 256
    assert request.state[PREFIX_MATCH].capped  # the prompt goes on past the blocks looked up
    inline = request_for({"model": "m", "prompt": long_prompt})
    assert scores(scorer, inline, store.all()) == [1.0, 0.0]
    scores(scorer, short, store.all())
    assert not short.state[PREFIX_MATCH].capped
    assert TOKENIZED.encode(long_prompt, max_tokens=4096) == tokens[:4096]


def test_capped_match_is_whole_counts_the_tokenized_prompt_as_held() -> None:
    store = make_store(2)
    index = KVBlockIndex(EventKeys())
    long_prompt = PROMPT * 40
    tokens = TOKENIZED.encode(long_prompt)
    store_blocks(index, 0, tokens[: 16 * 300])
    # Only the head is tokenized, so the whole prompt's length is its characters / 4.
    for whole, held in ((False, 256 * 16), (True, len(long_prompt) / 4)):
        scorer = precise_scorer(store, index, cappedMatchIsWhole=whole)
        request = request_for({"model": "m", "prompt": long_prompt})
        assert scores(scorer, request, store.all()) == [1.0, 0.0]
        assert request.state[PREFIX_MATCH].capped
        assert cached_tokens(request, store.all()[0].id) == held
        assert cached_tokens(request, store.all()[1].id) == 0.0


def test_tokenizer_loading_and_template_errors(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError):
        PromptTokenizer.load(tmp_path)
    tokenizer_json = Path(TOKENIZER) / "tokenizer.json"
    bare = tmp_path / "tokenizer.json"
    bare.write_bytes(tokenizer_json.read_bytes())
    no_template = PromptTokenizer.load(bare)
    with pytest.raises(TokenizerError, match="no chat template"):
        no_template.render_chat([{"role": "user", "content": "hi"}])
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": [
                    {"name": "default", "template": "{{ raise_exception('no system turns') }}"}
                ],
                "eos_token": {"content": "<|im_end|>"},
            }
        )
    )
    refusing = PromptTokenizer.load(tmp_path)
    assert refusing.special_tokens == {"eos_token": "<|im_end|>"}
    with pytest.raises(TokenizerError, match="no system turns"):
        refusing.render_chat([{"role": "user", "content": "hi"}])


# -- config -------------------------------------------------------------------------------------


def precise_document(**extra: Any) -> dict[str, Any]:
    return {
        "plugins": [
            {"type": "precise-prefix-cache-scorer", "parameters": {"tokenizer": TOKENIZER}},
            {"type": "max-score-picker"},
        ],
        **extra,
    }


def test_the_deprecated_spelling_is_the_precise_scorer() -> None:
    document = {
        "plugins": [
            {
                "type": "prefix-cache-scorer",
                "parameters": {"mode": "precise", "tokenizer": TOKENIZER, "blockSizeChars": 64},
            }
        ],
        "kvEvents": {},
    }
    (plugin,) = parse_config(document, REGISTRY).plugins
    # Its name stays what profiles refer to; the parameters only the approximate mode reads go.
    assert (plugin.name, plugin.type) == ("prefix-cache-scorer", "precise-prefix-cache-scorer")
    assert isinstance(plugin.params, PrecisePrefixCacheParams)


def test_without_an_index_to_read_the_build_fails_naming_the_plugin() -> None:
    config = parse_config(precise_document(), REGISTRY)  # valid on its own
    with pytest.raises(ConfigError, match=r"precise-prefix-cache-scorer.*kvEvents"):
        Scheduler(config, REGISTRY, make_context(make_store(2)))


def test_config_sections_for_events_and_the_index() -> None:
    config = parse_config(
        precise_document(
            kvEvents={
                "mode": "connect",
                "publisherPort": 5557,
                "replayPort": 5558,
                "endpoints": {
                    "127.0.0.1:8001": {
                        "publisher": "tcp://127.0.0.1:9001",
                        "replay": "tcp://127.0.0.1:9002",
                    }
                },
                "model": "m",
                "replayTimeout": "500ms",
            },
            index={"backend": "memory", "keys": "strict", "hashAlgo": "xxhash", "hashSeed": 0},
        ),
        REGISTRY,
    )
    assert config.kv_events is not None and config.kv_events.replay_port == 5558
    assert config.kv_events.endpoints["127.0.0.1:8001"].replay == "tcp://127.0.0.1:9002"
    assert config.kv_events.replay_timeout_s == 0.5
    assert config.index.keys == "strict" and config.index.hash_seed == "0"
    assert parse_config({}, REGISTRY).kv_events is None
    # A replica without events may read a shared index.
    assert parse_config(precise_document(index={"backend": "redis"}), REGISTRY).kv_events is None


@pytest.mark.parametrize(
    ("document", "fragments"),
    [
        (precise_document(kvEvents={"mode": "both"}), ["kvEvents.mode", "connect, bind"]),
        (precise_document(kvEvents={"replayPort": 0}), ["kvEvents.replayPort", ">= 1"]),
        (precise_document(kvEvents={"color": 1}), ["kvEvents", "unknown field(s) color"]),
        (
            precise_document(kvEvents={"endpoints": {"nohost": {"publisher": "tcp://x:1"}}}),
            ["kvEvents.endpoints['nohost']"],
        ),
        (
            precise_document(kvEvents={"endpoints": {"10.0.0.1:80": {"publisher": "http://x"}}}),
            ["kvEvents.endpoints['10.0.0.1:80'].publisher", "ZMQ address"],
        ),
        (precise_document(kvEvents={"bind": "udp://x"}), ["kvEvents.bind"]),
        (precise_document(kvEvents={}, index={"backend": "disk"}), ["index.backend"]),
        (precise_document(kvEvents={}, index={"keys": "loose"}), ["index.keys"]),
        (precise_document(kvEvents={}, index={"hashAlgo": "md5"}), ["index.hashAlgo", "sha256"]),
        (precise_document(kvEvents={}, index={"blockSizeTokens": 0}), ["index.blockSizeTokens"]),
        (precise_document(kvEvents={}, index={"url": "http://x"}), ["index.url"]),
        (precise_document(kvEvents={}, index={"timeout": "soon"}), ["index.timeout"]),
        (precise_document(kvEvents={}, index={"size": 1}), ["index", "unknown field(s) size"]),
        (
            {
                "plugins": [
                    {
                        "type": "prefix-cache-scorer",
                        "parameters": {"mode": "precise", "tokenizer": "/nowhere"},
                    }
                ]
            },
            ["prefix-cache-scorer", "parameters.tokenizer", "no tokenizer.json at /nowhere"],
        ),
    ],
)
def test_bad_sections_name_the_field(document: dict[str, Any], fragments: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(document, REGISTRY)
    for fragment in fragments:
        assert fragment in str(info.value)


# -- the async hook through the ext_proc stream ---------------------------------------------------


def headers(mode: int) -> pb.ProcessingRequest:
    header_map = base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key=":path", raw_value=b"/v1/completions")]
    )
    return pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=header_map),
        protocol_config=pb.ProtocolConfiguration(request_body_mode=mode, response_body_mode=mode),
    )


async def messages(*items: pb.ProcessingRequest) -> AsyncIterator[pb.ProcessingRequest]:
    for item in items:
        await asyncio.sleep(0)
        yield item


@pytest.mark.parametrize(
    ("mode", "trailers"),
    [(Mode.FULL_DUPLEX_STREAMED, False), (Mode.FULL_DUPLEX_STREAMED, True), (Mode.BUFFERED, False)],
)
async def test_prepared_requests_route_in_order_through_ext_proc(mode: int, trailers: bool) -> None:
    store = make_store(3)
    index = KVBlockIndex(EventKeys())
    document = precise_document(kvEvents={})
    document["plugins"][0]["parameters"]["tokenizeInlineMaxChars"] = 100  # long: thread pool
    config = parse_config(document, REGISTRY)
    ctx = make_context(store)
    ctx.kv_index = index
    metrics = PickerMetrics()
    director = Director(config, store, Scheduler(config, REGISTRY, ctx, metrics), ctx.rng, metrics)
    store_blocks(index, 2, TOKENIZED.encode(PROMPT))
    body = json.dumps({"model": "m", "prompt": PROMPT}).encode()
    items = [
        headers(mode),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=not trailers)),
    ]
    if trailers:
        items.append(pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))
    out = [r async for r in ExternalProcessor(director).Process(messages(*items), None)]
    kinds = [r.WhichOneof("response") for r in out]
    if mode == Mode.BUFFERED:
        assert kinds == ["request_headers", "request_body"]
        common = out[1].request_body.response
    else:
        expected = ["request_headers", "request_body"] + (["request_trailers"] if trailers else [])
        assert kinds == expected
        common = out[0].request_headers.response
    picked = {h.header.key: h.header.raw_value for h in common.header_mutation.set_headers}
    assert picked["x-gateway-destination-endpoint"] == store.all()[2].address.encode()


piece = st.one_of(
    st.sampled_from(["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|im_", "\n", " ", "user"]),
    st.text(max_size=40),
    st.text(alphabet="abc <|>\n", min_size=200, max_size=400),
)


@settings(max_examples=200, deadline=None)
@given(st.lists(piece, max_size=12))
def test_split_and_cached_encoding_equals_the_tokenizer(pieces: list[str]) -> None:
    tokenizer = PromptTokenizer.load(TOKENIZER)
    text = "".join(pieces)
    plain = tokenizer.tokenizer.encode(text).ids
    assert tokenizer.encode(text) == plain
    assert tokenizer.encode(text) == plain  # from the cache now
    assert asyncio.run(tokenizer.encode_async(text)) == plain  # on a pool thread


def test_a_shared_system_prompt_is_tokenized_once() -> None:
    tokenizer = PromptTokenizer.load(TOKENIZER)
    system = {"role": "system", "content": PROMPT}
    for question in ("Which one?", "And why?", "Where is it?"):
        text = tokenizer.render_chat([system, {"role": "user", "content": question}])
        plain = tokenizer.tokenizer.encode(text, add_special_tokens=False).ids
        assert tokenizer.encode(text, False) == plain
    assert tokenizer.cache_hits == 2


def test_a_pick_counts_until_events_can_confirm_it() -> None:
    clock = ManualClock()
    store = make_store(3, clock=clock)
    index = KVBlockIndex(EventKeys())
    scorer = precise_scorer(store, index, speculativeTTL=2.0)
    first = request_for({"model": "m", "prompt": PROMPT})
    assert scores(scorer, first, store.all()) == [0.0, 0.0, 0.0]
    picked = SchedulingResult("d", {"d": ProfileResult([store.all()[1]], store.all(), [])})
    scorer.on_pick(first, picked)
    # Before endpoint 1's BlockStored arrives, the same prefix follows the pick.
    assert scores(scorer, request_for({"model": "m", "prompt": PROMPT}), store.all()) == [0, 1, 0]
    clock.advance(2.5)
    assert scores(scorer, request_for({"model": "m", "prompt": PROMPT}), store.all()) == [0, 0, 0]
    # Disabled: only events count.
    strict = precise_scorer(store, index, speculativeTTL=0)
    strict.on_pick(first, picked)
    assert scores(strict, request_for({"model": "m", "prompt": PROMPT}), store.all()) == [0, 0, 0]


words = st.one_of(
    st.text(min_size=1, max_size=12),
    st.sampled_from(["the", "KV", "cache's", "1234", "naïve", "日本", "--", "\n", "\t", "  "]),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(words, min_size=1, max_size=400), st.sampled_from([" ", "  ", "\n", ""]))
def test_chunked_encoding_equals_the_tokenizer(parts: list[str], glue: str) -> None:
    tokenizer = PromptTokenizer.load(TOKENIZER)
    assert tokenizer.chunk_chars > 0  # the shipped tokenizer is byte-level BPE: chunked
    tokenizer.chunk_chars = 64  # many cuts in a short text
    text = glue.join(parts)
    plain = tokenizer.tokenizer.encode(text).ids
    assert tokenizer.encode(text) == plain
    assert asyncio.run(tokenizer.encode_async(text)) == plain  # chunks from the cache now


def test_prompts_sharing_a_long_prefix_share_its_chunks() -> None:
    tokenizer = PromptTokenizer.load(TOKENIZER)
    shared = " ".join(f"word{i % 97} of the shared context" for i in range(1000))
    first = tokenizer.encode(shared + " first question?")
    hits = tokenizer.cache_hits
    second = tokenizer.encode(shared + " a different question?")
    assert first == tokenizer.tokenizer.encode(shared + " first question?").ids
    assert second == tokenizer.tokenizer.encode(shared + " a different question?").ids
    assert tokenizer.cache_hits - hits >= len(shared) // tokenizer.chunk_chars - 1


def test_tokenizers_that_are_not_byte_level_bpe_are_not_chunked() -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers

    wordpiece = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.Whitespace()
    assert PromptTokenizer(wordpiece).chunk_chars == 0
