"""The simulated endpoint's KV events: what its cache does, on the wire as vLLM sends it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import pytest
import zmq
import zmq.asyncio

from kv_picker.sources.kv_event_decoder import decode_payload, decode_seq
from kv_picker.state.block_events import AllBlocksCleared, BlockRemoved, BlockStored
from kv_picker.state.block_keys import VllmBlockHasher
from kv_picker.state.tokenization import PromptTokenizer
from kv_picker_bench.sim import SimEndpoint
from kv_picker_bench.sim.events import END_SEQ
from tests.benchmarks.sim.conftest import StartEndpoint

TOKENIZER = Path(__file__).resolve().parents[3] / "benchmarks" / "tokenizer"
MODEL = "sim-model"


class Events:
    """A SUB socket on an endpoint's publisher, decoding with the picker's decoder."""

    def __init__(self, endpoint: SimEndpoint) -> None:
        assert endpoint.publisher is not None
        self.context = zmq.asyncio.Context()
        self.sock = self.context.socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(endpoint.publisher.url)
        self.topics: set[bytes] = set()
        self.seqs: list[int] = []
        self.raw: list[Any] = []

    async def next_events(self, timeout_s: float = 5.0) -> list[Any]:
        async with asyncio.timeout(timeout_s):
            topic, seq, payload = await self.sock.recv_multipart()
        self.topics.add(topic)
        self.seqs.append(decode_seq(seq))
        self.raw.append(msgpack.unpackb(payload))
        return decode_payload(payload).events

    async def until(self, kind: type, timeout_s: float = 5.0) -> list[Any]:
        seen: list[Any] = []
        while not any(isinstance(e, kind) for e in seen):
            seen += await self.next_events(timeout_s)
        return seen

    def close(self) -> None:
        self.sock.close(0)
        self.context.term()


async def subscribe(endpoint: SimEndpoint) -> Events:
    """Subscribe and wait until the subscription is live (ZMQ's slow joiner)."""
    events = Events(endpoint)
    publisher = endpoint.publisher
    assert publisher is not None
    for _ in range(100):
        publisher.on_cleared()  # a probe batch
        publisher.flush()
        try:
            await events.next_events(timeout_s=0.05)
            return events
        except TimeoutError:
            continue
    raise TimeoutError("subscription never became live")


async def complete(
    client: aiohttp.ClientSession, endpoint: SimEndpoint, **body: Any
) -> dict[str, Any]:
    async with client.post(
        endpoint.url + "/v1/" + ("chat/completions" if "messages" in body else "completions"),
        json={"model": MODEL, "max_tokens": 1, **body},
    ) as response:
        assert response.status == 200, await response.text()
        result: dict[str, Any] = await response.json()
        return result


@pytest.mark.parametrize("encoding", ["array", "map"])
async def test_prefill_blocks_are_published_with_tokens_hashes_and_salt(
    start_endpoint: StartEndpoint, client: aiohttp.ClientSession, encoding: str
) -> None:
    endpoint = await start_endpoint(
        tokenizer=str(TOKENIZER), kv_events_port=0, kv_events_encoding=encoding
    )
    events = await subscribe(endpoint)
    try:
        prompt = "the cache block token prefix route " * 12
        await complete(client, endpoint, prompt=prompt, cache_salt="tenant-a")
        stored = [e for e in await events.until(BlockStored) if isinstance(e, BlockStored)]
        tokens = PromptTokenizer.load(TOKENIZER).encode(prompt)
        full = len(tokens) // 16
        assert full >= 3
        (event,) = stored
        assert event.token_ids == tokens[: full * 16]
        assert event.parent_block_hash is None and event.block_size == 16
        assert event.medium == "GPU" and event.kv_cache_spec_kind == "full_attention"
        # The endpoint hashes like vLLM's xxhash algorithm with PYTHONHASHSEED "0".
        assert event.block_hashes == VllmBlockHasher("xxhash", "0").block_keys(
            tokens, cache_salt="tenant-a"
        )
        assert event.extra_keys == [["tenant-a"]] + [None] * (full - 1)
        assert events.topics == {f"kv@{endpoint.address}@{MODEL}".encode()}
        assert events.seqs == sorted(events.seqs)
        raw_event = events.raw[-1][1][0]
        assert isinstance(raw_event, dict if encoding == "map" else list)
    finally:
        events.close()


async def test_decode_fills_blocks_eviction_removes_and_reset_clears(
    start_endpoint: StartEndpoint, client: aiohttp.ClientSession
) -> None:
    endpoint = await start_endpoint(kv_events_port=0, num_gpu_blocks=12)
    events = await subscribe(endpoint)
    try:
        # 20 prompt tokens, 30 output tokens: KV for 49 tokens, 3 full blocks.
        prompt = list(range(200, 220))
        result = await complete(client, endpoint, prompt=prompt, max_tokens=30)
        assert result["usage"]["completion_tokens"] == 30
        stored: list[BlockStored] = []
        while sum(len(e.block_hashes) for e in stored) < 3:
            stored += [e for e in await events.next_events() if isinstance(e, BlockStored)]
        hashes = [h for e in stored for h in e.block_hashes]
        assert [e.parent_block_hash for e in stored] == [None, *hashes[:-1]][: len(stored)]
        assert stored[0].token_ids == prompt[:16]
        decode_tokens = [t for e in stored[1:] for t in e.token_ids]
        assert decode_tokens[:4] == prompt[16:]  # the prompt's tail, then output tokens
        # The chain continues through output tokens exactly as vLLM hashes prompt + output.
        all_tokens = stored[0].token_ids + decode_tokens
        assert hashes == VllmBlockHasher("xxhash", "0").block_keys(all_tokens)
        # A long unrelated prompt needs the whole cache: the first blocks are evicted.
        await complete(client, endpoint, prompt=list(range(1000, 1150)), max_tokens=1)
        seen = await events.until(BlockRemoved)
        removed = [h for e in seen if isinstance(e, BlockRemoved) for h in e.block_hashes]
        assert set(removed) <= set(hashes) and removed
        async with client.post(endpoint.url + "/reset_prefix_cache") as response:
            assert response.status == 200
        assert any(isinstance(e, AllBlocksCleared) for e in await events.until(AllBlocksCleared))
    finally:
        events.close()


async def test_replay_socket_answers_from_its_buffer(
    start_endpoint: StartEndpoint, client: aiohttp.ClientSession
) -> None:
    endpoint = await start_endpoint(kv_events_port=0, kv_events_replay_port=0)
    publisher = endpoint.publisher
    assert publisher is not None and publisher.replay_url is not None
    await complete(client, endpoint, prompt=list(range(100, 140)))
    await complete(client, endpoint, prompt=list(range(300, 340)))
    await asyncio.sleep(0.05)
    context = zmq.asyncio.Context()
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        dealer.connect(publisher.replay_url)
        await dealer.send_multipart([b"", (1).to_bytes(8, "big")])
        replies = []
        while True:
            async with asyncio.timeout(5.0):
                frames = await dealer.recv_multipart()
            assert frames[0] == b"" and len(frames) == 4  # [b"", topic, seq, payload]
            if frames[2] == END_SEQ:
                break
            replies.append((decode_seq(frames[2]), decode_payload(frames[3])))
        assert [seq for seq, _ in replies] == list(range(1, publisher.batches_sent))
        assert all(isinstance(e, BlockStored) for _, b in replies for e in b.events)
    finally:
        dealer.close(0)
        context.term()


async def test_chat_uses_the_tokenizer_chat_template(
    start_endpoint: StartEndpoint, client: aiohttp.ClientSession
) -> None:
    endpoint = await start_endpoint(tokenizer=str(TOKENIZER), kv_events_port=0)
    events = await subscribe(endpoint)
    try:
        messages = [
            {"role": "system", "content": "You route requests to the endpoint with the cache."},
            {"role": "user", "content": [{"type": "text", "text": "Which block is cached? " * 8}]},
        ]
        result = await complete(client, endpoint, messages=messages)
        tokenizer = PromptTokenizer.load(TOKENIZER)
        as_text = [messages[0], {"role": "user", "content": "Which block is cached? " * 8}]
        expected = tokenizer.encode(tokenizer.render_chat(as_text), add_special_tokens=False)
        assert result["usage"]["prompt_tokens"] == len(expected)
        assert expected[0] == tokenizer.tokenizer.token_to_id("<|im_start|>")
        (stored,) = [e for e in await events.until(BlockStored) if isinstance(e, BlockStored)]
        assert stored.token_ids == expected[: len(expected) // 16 * 16]
    finally:
        events.close()


async def test_bad_publisher_settings(start_endpoint: StartEndpoint) -> None:
    with pytest.raises(ValueError, match="kv_events_encoding"):
        await start_endpoint(kv_events_port=0, kv_events_encoding="json")
    with pytest.raises(ValueError, match="kv_events_port"):
        await start_endpoint(kv_events_port=70000)
