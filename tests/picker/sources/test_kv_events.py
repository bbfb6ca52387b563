"""KV events: the wire decoder (both encodings, property-tested) and the subscriber's delivery
rules (sequence gaps, replays, restarts), over real ZMQ sockets with the simulated publisher."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import msgpack
import pytest
import zmq
import zmq.asyncio
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_picker.metrics import PickerMetrics
from kv_picker.sources.kv_events import (
    KVEventSubscriber,
    MalformedMessage,
    PublisherAddress,
    SubscriberSettings,
    decode_payload,
    decode_seq,
    parse_topic,
)
from kv_picker.state.block_events import AllBlocksCleared, BlockRemoved, BlockStored, EventKeys
from kv_picker.state.kv_index import KVBlockIndex
from kv_picker_bench.sim.cache import StoredBlock
from kv_picker_bench.sim.events import KVEventPublisher, encode_batch, encode_removed, encode_stored
from tests.fakes import make_store

HASH = 3236607068019569386  # sha256_cbor block 0 of tokens 1..16, PYTHONHASHSEED "0"

# The legacy (array) example batch of the reference notes §1.8, byte for byte.
LEGACY_BATCH = bytes.fromhex(
    "93cb41d954fc40200000"
    "93"
    "9cab426c6f636b53746f72656491cf2ceabcfae6d332eac0dc0010"
    + "".join(f"{t:02x}" for t in range(1, 17))
    + "10c0a3475055c091c000ae66756c6c5f617474656e74696f6ec0"
    "94ac426c6f636b52656d6f76656491cf2ceabcfae6d332eaa347505500"
    "91b0416c6c426c6f636b73436c6561726564"
    "00"
)


def test_decodes_the_reference_array_batch() -> None:
    assert len(LEGACY_BATCH) == 128
    batch = decode_payload(LEGACY_BATCH)
    assert batch.ts == 1700000000.5
    assert batch.data_parallel_rank == 0
    stored, removed, cleared = batch.events
    assert stored == BlockStored(
        [HASH], None, list(range(1, 17)), 16, None, "GPU", None, [None], 0, "full_attention"
    )
    assert removed == BlockRemoved([HASH], "GPU", 0)
    assert cleared == AllBlocksCleared()


def test_decodes_the_map_encoding_and_ignores_unknown_fields_and_types() -> None:
    events = [
        {
            "type": "BlockStored",
            "block_hashes": [HASH],
            "parent_block_hash": None,
            "token_ids": list(range(1, 17)),
            "block_size": 16,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
            "extra_keys": [None],
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
            "origin": "a field from the future",
        },
        {"type": "BlockRemoved", "block_hashes": [HASH], "medium": "GPU", "group_idx": 0},
        {"type": "AllBlocksCleared"},
        {"type": "BlockPromoted", "block_hashes": [1]},
        ["SomethingNew", 1, 2],
    ]
    batch = decode_payload(msgpack.packb([1.5, events, 0]))
    assert [type(e) for e in batch.events] == [BlockStored, BlockRemoved, AllBlocksCleared]
    assert batch.events[0] == decode_payload(LEGACY_BATCH).events[0]
    # An outer map, and the oldest array layout (fewer fields, no dp rank) decode too.
    as_map = decode_payload(msgpack.packb({"ts": 2, "events": [["AllBlocksCleared"]]}))
    assert as_map.events == [AllBlocksCleared()] and as_map.data_parallel_rank is None
    oldest = decode_payload(
        msgpack.packb([3.0, [["BlockStored", [7], 6, [1, 2], 2, None], ["BlockRemoved", [7]]]])
    )
    assert oldest.events == [BlockStored([7], 6, [1, 2], 2), BlockRemoved([7])]
    longer = decode_payload(msgpack.packb([3.0, [["BlockRemoved", [7], "GPU", 0, "x", 1]]]))
    assert longer.events == [BlockRemoved([7], "GPU", 0)]


def test_hashes_as_bytes_and_signed_ints_name_64_bit_blocks() -> None:
    digest = bytes.fromhex("202da172482d928bbc42ab25b0151e2b895f13f41002e27b2ceabcfae6d332ea")
    batch = decode_payload(
        msgpack.packb([0.0, [["BlockRemoved", [digest, -1, b"\x01\x02"], None]]], use_bin_type=True)
    )
    assert batch.events == [BlockRemoved([HASH, 2**64 - 1, 0x0102])]


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",
        msgpack.packb("not a batch"),
        msgpack.packb([1.0]),
        msgpack.packb(["ts", []]),
        msgpack.packb([1.0, {}]),
        msgpack.packb([1.0, [], "rank"]),
        msgpack.packb([1.0, [["BlockStored", [1], None, "tokens", 16]]]),
        msgpack.packb([1.0, [["BlockStored", [1], None, [1], 0]]]),
        msgpack.packb([1.0, [["BlockStored", [1], None, [1], True]]]),
        msgpack.packb([1.0, [["BlockStored", "hashes", None, [1], 16]]]),
        msgpack.packb([1.0, [["BlockStored", [1.5], None, [1], 16]]]),
        msgpack.packb([1.0, [["BlockStored", [b""], None, [1], 16]]], use_bin_type=True),
        msgpack.packb([1.0, [["BlockStored", [1], None, [1], 16, None, 7]]]),
        msgpack.packb([1.0, [["BlockStored", [1], None, [1], 16, None, None, None, "x"]]]),
        msgpack.packb([1.0, [["BlockRemoved"]]]),
        msgpack.packb([1.0, [[]]]),
        msgpack.packb([1.0, [5]]),
        msgpack.packb([1.0, [[5, 1]]]),
        msgpack.packb([1.0, [{"block_hashes": [1]}]]),
        msgpack.packb([1.0, [{1: 2}]]),
        msgpack.packb([1.0, []]) + b"trailing",
    ],
)
def test_malformed_payloads_raise_malformed_message(payload: bytes) -> None:
    with pytest.raises(MalformedMessage):
        decode_payload(payload)


@settings(max_examples=500)
@given(st.binary(max_size=200))
def test_any_bytes_decode_or_count_as_malformed(payload: bytes) -> None:
    try:
        batch = decode_payload(payload)
    except MalformedMessage:
        return
    assert isinstance(batch.events, list)


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=20)
    | st.binary(max_size=20)
    | st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "type"]),
    lambda children: (
        st.lists(children, max_size=12)
        | st.dictionaries(
            st.sampled_from(["type", "block_hashes", "token_ids", "block_size", "ts", "events"])
            | st.text(max_size=5),
            children,
            max_size=6,
        )
    ),
    max_leaves=30,
)


@settings(max_examples=500)
@given(msgpack_values)
def test_any_msgpack_value_decodes_or_counts_as_malformed(value: Any) -> None:
    shapes = [value, [1.0, value], [1.0, [value], 0]]
    if isinstance(value, list):
        shapes.append([1.0, [["BlockStored", *value], ["BlockRemoved", *value]]])
    for shaped in shapes:
        with contextlib.suppress(MalformedMessage):
            decode_payload(msgpack.packb(shaped, use_bin_type=True))


def test_sequence_and_topic_frames() -> None:
    assert decode_seq(b"\x00" * 7 + b"\x05") == 5
    with pytest.raises(MalformedMessage):
        decode_seq(b"\x00" * 4)
    assert parse_topic(b"kv@10.0.0.7:8000@Qwen/Qwen3-0.6B") == ("10.0.0.7:8000", "Qwen/Qwen3-0.6B")
    assert parse_topic(b"kv@10.0.0.7@") == ("10.0.0.7", None)
    assert parse_topic(b"") == (None, None)
    assert parse_topic(b"kv@a@b@c") == (None, None)
    assert parse_topic(b"\xff") == (None, None)


def test_simulated_publisher_encodings_decode_identically() -> None:
    for encoding in ("array", "map"):
        stored = encode_stored(
            encoding, [1, 2], None, list(range(8)), 4, "ad", [["ad", "s"], ["ad"]]
        )
        payload = encode_batch(5.0, [stored, encode_removed(encoding, [2])])
        batch = decode_payload(payload)
        assert batch.events == [
            BlockStored(
                [1, 2], None, list(range(8)), 4, None, "GPU", "ad", [["ad", "s"], ["ad"]], 0,
                "full_attention",
            ),
            BlockRemoved([2], "GPU", 0),
        ]  # fmt: skip


# -- delivery rules, driven message by message -------------------------------------------------


class RecordingIndex:
    """Stands in for a KVIndex: records the event calls the subscriber makes."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def apply_stored(self, endpoint_id: int, event: BlockStored, model: str) -> int:
        self.calls.append(("stored", endpoint_id, event.block_hashes, model))
        return len(event.block_hashes)

    def apply_removed(self, endpoint_id: int, event: BlockRemoved) -> int:
        self.calls.append(("removed", endpoint_id, event.block_hashes))
        return len(event.block_hashes)

    def clear_endpoint(self, endpoint_id: int) -> int:
        self.calls.append(("cleared", endpoint_id))
        return 0


def stored_payload(*hashes: int) -> bytes:
    return encode_batch(
        0.0, [encode_stored("array", list(hashes), None, [1] * 4 * len(hashes), 4, None, None)]
    )


def frames(seq: int, payload: bytes, topic: bytes = b"kv@10.0.0.1:8000@m") -> list[bytes]:
    return [topic, seq.to_bytes(8, "big"), payload]


def make_subscriber(**settings_kw: Any) -> tuple[KVEventSubscriber, RecordingIndex, PickerMetrics]:
    index = RecordingIndex()
    metrics = PickerMetrics()
    subscriber = KVEventSubscriber(SubscriberSettings(**settings_kw), make_store(2), index, metrics)
    return subscriber, index, metrics


def sample(metrics: PickerMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return value or 0.0


def test_in_order_gap_restart_and_malformed_without_replay() -> None:
    subscriber, index, metrics = make_subscriber()
    source = subscriber._source_from_topic(b"kv@10.0.0.1:8000@m")
    assert source is not None
    subscriber._receive(source, frames(5, stored_payload(1)))  # first message: any seq
    subscriber._receive(source, frames(6, stored_payload(2)))
    subscriber._receive(source, frames(9, stored_payload(3)))  # 7, 8 lost: drop what we hold
    subscriber._receive(source, frames(2, stored_payload(4)))  # publisher restarted
    subscriber._receive(source, frames(3, b"\xc1"))  # malformed payload, sequence still counts
    subscriber._receive(source, frames(4, stored_payload(5))[:2])  # two frames only
    subscriber._receive(source, [b"kv@10.0.0.1:8000@m", b"\x01", b""])  # bad seq frame
    subscriber._receive(source, frames(4, stored_payload(6)))
    assert index.calls == [
        ("stored", 0, [1], "m"),
        ("stored", 0, [2], "m"),
        ("cleared", 0),
        ("stored", 0, [3], "m"),
        ("cleared", 0),
        ("stored", 0, [4], "m"),
        ("stored", 0, [6], "m"),
    ]
    assert sample(metrics, "kv_picker_kv_event_sequence_gaps_total", kind="gap") == 1
    assert sample(metrics, "kv_picker_kv_event_sequence_gaps_total", kind="restart") == 1
    assert sample(metrics, "kv_picker_kv_events_malformed_total") == 3
    assert sample(metrics, "kv_picker_kv_events_applied_total", kind="stored") == 5


def test_topics_name_endpoints_and_models_in_bind_mode() -> None:
    subscriber, index, _ = make_subscriber(mode="bind", model="fallback")
    assert subscriber._source_from_topic(b"kv@10.0.0.9:8000@m") is None  # not in the pool
    assert subscriber._source_from_topic(b"nonsense") is None
    by_ip = subscriber._source_from_topic(b"kv@10.0.0.2@m")  # llm-d's bare pod IP
    assert by_ip is not None and by_ip.address == "10.0.0.2:8000"
    subscriber._receive(by_ip, frames(0, stored_payload(1), b"kv@10.0.0.2@"))
    assert index.calls == [("stored", 1, [1], "fallback")]


def test_publisher_addresses_from_the_map_or_the_port_pattern() -> None:
    explicit = PublisherAddress("tcp://127.0.0.1:9001", "tcp://127.0.0.1:9002")
    subscriber, _, _ = make_subscriber(
        publisher_port=5557, replay_port=5558, endpoints=(("10.0.0.1:8000", explicit),)
    )
    assert subscriber.addresses_of("10.0.0.1:8000") == explicit
    assert subscriber.addresses_of("10.0.0.2:8000") == PublisherAddress(
        "tcp://10.0.0.2:5557", "tcp://10.0.0.2:5558"
    )
    with pytest.raises(ValueError):
        make_subscriber(mode="both")


@settings(max_examples=300)
@given(st.lists(st.lists(st.binary(max_size=40), max_size=4), max_size=10))
def test_any_frames_never_raise(messages: list[list[bytes]]) -> None:
    subscriber, _, _ = make_subscriber()
    source = subscriber._source_from_topic(b"kv@10.0.0.1:8000@m")
    assert source is not None
    for message in messages:
        subscriber._receive(source, message)


# -- real sockets ------------------------------------------------------------------------------


async def wait_for(condition: Any, timeout_s: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        if loop.time() > deadline:
            raise TimeoutError("condition not met")
        await asyncio.sleep(0.01)


def blocks(tokens: list[int], hashes: list[int], parent: int | None = None) -> list[StoredBlock]:
    out = []
    for i, engine_hash in enumerate(hashes):
        out.append(
            StoredBlock(
                engine_hash, parent if i == 0 else hashes[i - 1], tuple(tokens[4 * i : 4 * i + 4])
            )
        )
    return out


@pytest.mark.parametrize("encoding", ["array", "map"])
async def test_connect_mode_applies_live_events_and_replays_gaps(encoding: str) -> None:
    store = make_store(1)
    address = store.all()[0].address
    index = KVBlockIndex(EventKeys(block_size_tokens=4))
    publisher = KVEventPublisher(
        topic=f"kv@{address}@m", encoding=encoding, block_size=4, replay_port=0
    )
    await publisher.start()
    # Published before the subscriber exists: recovered by the catch-up replay.
    tokens = list(range(100, 116))
    publisher.on_stored_for_request(blocks(tokens[:8], [1, 2]), None, None)
    publisher.flush()
    settings_ = SubscriberSettings(
        endpoints=((address, PublisherAddress(publisher.url, publisher.replay_url)),),
        reconcile_interval_s=0.05,
    )
    metrics = PickerMetrics()
    subscriber = KVEventSubscriber(settings_, store, index, metrics)
    task = asyncio.create_task(subscriber.run())
    try:
        keys = index.event_keys.request_keys(tokens, "m", None, None)
        runs = [0]

        def run_length() -> int:
            index.runs(keys, 1, runs)
            return runs[0]

        # Keep publishing until the subscription is live (ZMQ's slow joiner).
        for engine_hash in (3, 4):
            await asyncio.sleep(0.2)
            publisher.on_stored_for_request(
                blocks(tokens[4 * engine_hash - 4 :], [engine_hash], engine_hash - 1), None, None
            )
            publisher.flush()
        await wait_for(lambda: run_length() == 4)
        assert sample(metrics, "kv_picker_kv_event_replays_total", cause="catch_up", result="ok")
        # A lost batch: the publisher's buffer has it, the live socket never sent it.
        publisher._pub, pub = None, publisher._pub
        publisher.on_removed([4])
        publisher.flush()
        publisher._pub = pub
        publisher.on_removed([3])
        publisher.flush()
        await wait_for(lambda: run_length() == 2)
        assert sample(metrics, "kv_picker_kv_event_sequence_gaps_total", kind="gap") == 1
        assert sample(metrics, "kv_picker_kv_event_replays_total", cause="gap", result="ok") == 1
        publisher.on_cleared()
        publisher.flush()
        await wait_for(lambda: run_length() == 0)
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await publisher.stop()


async def test_bind_mode_and_a_gap_without_replay_drop_the_endpoint() -> None:
    store = make_store(2)
    index = KVBlockIndex(EventKeys(block_size_tokens=4))
    subscriber = KVEventSubscriber(
        SubscriberSettings(mode="bind", bind="tcp://127.0.0.1:*", topic_filter="kv@"),
        store,
        index,
        PickerMetrics(),
    )
    task = asyncio.create_task(subscriber.run())
    context = zmq.asyncio.Context()
    pub = context.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    try:
        await wait_for(lambda: bool(subscriber.bound_address))
        pub.connect(subscriber.bound_address)
        topic = f"kv@{store.all()[1].address}@m".encode()
        seq = 0

        async def send(payload: bytes, skip: int = 0) -> None:
            nonlocal seq
            seq += skip
            await pub.send_multipart([topic, seq.to_bytes(8, "big"), payload])
            seq += 1

        while not index.num_blocks():
            await send(stored_payload(seq + 1))
            await asyncio.sleep(0.05)
        await send(b"garbage")
        await send(encode_batch(0.0, [encode_removed("map", [10**6])]), skip=3)
        await wait_for(lambda: index.num_blocks() == 0)  # the gap dropped what it held
        assert subscriber.messages >= 3
    finally:
        pub.close(0)
        context.term()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_a_publisher_that_goes_away_loses_its_blocks_and_a_new_one_is_caught_up() -> None:
    store = make_store(1)
    address = store.all()[0].address
    index = KVBlockIndex(EventKeys(block_size_tokens=4))
    first = KVEventPublisher(topic=f"kv@{address}@m", block_size=4, replay_port=0)
    await first.start()
    first.on_stored_for_request(blocks(list(range(8)), [1, 2]), None, None)
    first.flush()
    where = PublisherAddress(first.url, first.replay_url)
    subscriber = KVEventSubscriber(
        SubscriberSettings(endpoints=((address, where),), reconcile_interval_s=0.05),
        store,
        index,
        PickerMetrics(),
    )
    task = asyncio.create_task(subscriber.run())
    second = KVEventPublisher(
        first.port, topic=f"kv@{address}@m", block_size=4, replay_port=first.replay_port
    )
    try:
        await wait_for(lambda: index.num_blocks() == 2)  # caught up on connect, no live batch
        await first.stop()  # the endpoint's process ends
        await wait_for(lambda: index.num_blocks() == 0)
        # A new process on the same ports, with a different cache, published before we reconnect.
        await second.start()
        second.on_stored_for_request(blocks(list(range(100, 112)), [7, 8, 9]), None, None)
        second.flush()
        await wait_for(lambda: index.num_blocks() == 3)
        keys = index.event_keys.request_keys(list(range(100, 112)), "m", None, None)
        runs = [0]
        assert index.runs(keys, 1, runs) == 3
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await first.stop()
        await second.stop()
