"""The KV-event subscriber's delivery rules (sequence gaps, replays, restarts), message by message
and over real ZMQ sockets with the simulated publisher."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import zmq
import zmq.asyncio
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_picker.metrics import PickerMetrics
from kv_picker.sources.kv_event_subscriber import (
    KVEventSubscriber,
    PublisherAddress,
    SubscriberSettings,
)
from kv_picker.state.block_events import BlockRemoved, BlockStored, EventKeys
from kv_picker.state.kv_index import KVBlockIndex
from kv_picker_bench.sim.cache import StoredBlock
from kv_picker_bench.sim.events import KVEventPublisher, encode_batch, encode_removed, encode_stored
from tests.fakes import make_store

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


def test_data_parallel_ranks_are_endpoints_with_offset_ports() -> None:
    subscriber, _, _ = make_subscriber(
        publisher_port=5557, replay_port=6557, data_parallel_base_port=8000
    )
    assert subscriber.addresses_of("10.0.0.1:8000") == PublisherAddress(
        "tcp://10.0.0.1:5557", "tcp://10.0.0.1:6557"
    )
    assert subscriber.addresses_of("10.0.0.1:8003") == PublisherAddress(
        "tcp://10.0.0.1:5560", "tcp://10.0.0.1:6560"
    )
    assert subscriber.addresses_of("10.0.0.1:7000") == PublisherAddress(  # below: rank 0
        "tcp://10.0.0.1:5557", "tcp://10.0.0.1:6557"
    )
    plain, _, _ = make_subscriber(publisher_port=5557)
    assert plain.addresses_of("10.0.0.1:8003").publisher == "tcp://10.0.0.1:5557"


def test_counters_count_what_was_applied() -> None:
    """Blocks the index did not take are dropped (by reason), not applied."""
    index = KVBlockIndex(EventKeys(block_size_tokens=4))
    metrics = PickerMetrics()
    subscriber = KVEventSubscriber(SubscriberSettings(), make_store(1), index, metrics)
    source = subscriber._source_from_topic(b"kv@10.0.0.1:8000@m")
    assert source is not None
    events = [
        encode_stored("array", [1, 2], None, list(range(8)), 4, None, None),
        encode_stored("array", [3], 99, list(range(4)), 4, None, None),  # unknown parent
        encode_removed("array", [2, 42]),  # 42 was never held
    ]
    subscriber._receive(source, frames(0, encode_batch(0.0, events)))
    assert sample(metrics, "kv_picker_kv_events_applied_total", kind="stored") == 2
    assert sample(metrics, "kv_picker_kv_events_applied_total", kind="removed") == 1
    assert sample(metrics, "kv_picker_kv_events_dropped_total", reason="not_held") == 1
    assert index.num_blocks() == 1


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
