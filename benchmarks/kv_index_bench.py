"""How fast and how big is the precise KV index? Ingestion, lookups, memory, Redis vs in-process.

Four measurements, all in one run so the ratios compare like with like:

1. Event ingestion: vLLM-shaped KV-event messages (msgpack batches of ``BlockStored`` with
   token ids, a ``BlockRemoved`` now and then) go through the subscriber's own decode, sequence
   and apply path into the in-process index, without sockets; then the same messages over a
   real ZMQ PUB/SUB pair into a running subscriber. Reported in block events per second.
2. Lookup latency: a request's chain of 100, 2,000 or 8,000 blocks against 16, 64 or 256
   endpoints, where endpoint ``e`` holds the chain's first ``chain * (e+1) / endpoints`` blocks
   (so the walk goes the whole chain and every endpoint drops out at a different block).
3. Memory: bytes per indexed (endpoint, block) entry, measured with tracemalloc for the
   in-process index (chains shared by many endpoints, and all-distinct blocks), and from
   ``INFO memory`` for Redis.
4. In-process vs Redis: the same lookups through the Redis backend (one ``EVALSHA`` each),
   against a Redis/Valkey server this benchmark starts on 127.0.0.1 and stops
   (:mod:`kv_picker_bench.valkey`).

``kv-picker bench kv-index [--quick] [--out DIR]``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import random
import time
import tracemalloc
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from kv_picker.endpoint import EndpointId, EndpointSpec
from kv_picker.metrics import PickerMetrics
from kv_picker.sources.kv_event_subscriber import (
    KVEventSubscriber,
    PublisherAddress,
    SubscriberSettings,
)
from kv_picker.state.block_events import BlockRemoved, BlockStored, EventKeys
from kv_picker.state.block_ledger import LedgerRules
from kv_picker.state.compact_ledger import LedgerLayout
from kv_picker.state.endpoints import EndpointStore
from kv_picker.state.kv_index import KVBlockIndex
from kv_picker.state.redis_index import RedisKVIndex
from kv_picker_bench.sim.events import encode_batch, encode_removed, encode_stored
from kv_picker_bench.valkey import ValkeyServer

BLOCK = 16
LAYOUTS: tuple[LedgerLayout, ...] = ("compact", "dict")


def _percentile(values: Sequence[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(fraction * len(ordered)))]


def _store(endpoints: int) -> EndpointStore:
    store = EndpointStore(time.monotonic)
    store.set_endpoints(EndpointSpec(f"10.{e // 250}.{e % 250}.1:8000") for e in range(endpoints))
    return store


# -- 1. ingestion -----------------------------------------------------------------------------


def event_messages(
    num_blocks: int, blocks_per_event: int, seed: int = 0
) -> list[tuple[int, bytes]]:
    """(seq, payload) of vLLM-shaped batches: prefill chunks chained to their parents."""
    rng = random.Random(seed)
    messages: list[tuple[int, bytes]] = []
    next_hash = 1
    parent: int | None = None
    stored: list[int] = []
    while next_hash <= num_blocks:
        hashes = list(range(next_hash, next_hash + blocks_per_event))
        next_hash += blocks_per_event
        tokens = [rng.randrange(32000) for _ in range(blocks_per_event * BLOCK)]
        if rng.random() < 0.2:
            parent = None  # a new request's prompt
        events = [encode_stored("array", hashes, parent, tokens, BLOCK, None, None)]
        parent = hashes[-1]
        stored += hashes
        if rng.random() < 0.1 and len(stored) > 64:  # evictions
            events.append(encode_removed("array", stored[:8]))
            del stored[:8]
        messages.append((len(messages), encode_batch(time.time(), events)))
    return messages


class KeysOnlyIndex:
    """The ingestion path without an index: events are decoded, sequenced and turned into keys
    exactly as for a real one, then dropped (any parent hash resolves). What it sustains bounds
    what any index, however fast, could reach behind this Python decode and hashing."""

    class _Ledger(LedgerRules):
        def _init_entries(self) -> None:
            pass  # it holds nothing

        def resolve(self, endpoint_id: int, tier: int, group: int, engine_hash: int) -> int:
            return 1

    def __init__(self) -> None:
        self.event_keys = EventKeys()
        self.ledger = self._Ledger(1, 1, None, lambda *_: None)

    def apply_stored(self, endpoint_id: int, event: BlockStored, model: str) -> int:
        stored = self.event_keys.stored_keys(self.ledger, endpoint_id, event, model)  # type: ignore[arg-type]
        return 0 if stored is None else len(stored[3])

    def apply_removed(self, endpoint_id: int, event: BlockRemoved) -> int:
        return len(event.block_hashes)

    def clear_endpoint(self, endpoint_id: int) -> int:
        return 0

    def remove_endpoint(self, endpoint_id: int) -> None:
        pass


def ingest_direct(
    messages: list[tuple[int, bytes]], blocks: int, layout: LedgerLayout | None
) -> dict[str, float]:
    """Messages through the subscriber into an index of ``layout`` (None: :class:`KeysOnlyIndex`)."""
    store = _store(1)
    index: Any = KeysOnlyIndex() if layout is None else KVBlockIndex(EventKeys(), layout=layout)
    subscriber = KVEventSubscriber(SubscriberSettings(), store, index, PickerMetrics())
    source = subscriber._source_from_topic(f"kv@{store.all()[0].address}@m".encode())
    assert source is not None
    topic = b"kv@x@m"
    frames = [[topic, seq.to_bytes(8, "big"), payload] for seq, payload in messages]
    started = time.perf_counter()
    for message in frames:
        subscriber._receive(source, message)
    elapsed = time.perf_counter() - started
    return {"blocks": blocks, "seconds": elapsed, "block_events_per_s": blocks / elapsed}


async def ingest_zmq(
    messages: list[tuple[int, bytes]], blocks: int, layout: LedgerLayout
) -> dict[str, float]:
    store = _store(1)
    address = store.all()[0].address
    index = KVBlockIndex(EventKeys(), layout=layout)
    context = zmq.asyncio.Context()
    pub = context.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.setsockopt(zmq.SNDHWM, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    settings = SubscriberSettings(
        endpoints=((address, PublisherAddress(f"tcp://127.0.0.1:{port}")),), catch_up=False
    )
    subscriber = KVEventSubscriber(settings, store, index, PickerMetrics())
    task = asyncio.create_task(subscriber.run())
    topic = f"kv@{address}@m".encode()
    try:
        # Probe until the subscription is live, then restart the sequence as a new publisher.
        probe = encode_batch(0.0, [])
        while not subscriber.messages:
            await pub.send_multipart([topic, (0).to_bytes(8, "big"), probe])
            await asyncio.sleep(0.01)
        index.clear_endpoint(0)
        base = subscriber.messages
        started = time.perf_counter()
        for seq, payload in messages:
            await pub.send_multipart([topic, (seq + 1).to_bytes(8, "big"), payload])
        while subscriber.messages - base < len(messages):
            await asyncio.sleep(0.001)
        elapsed = time.perf_counter() - started
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        pub.close(0)
        context.term()
    return {"blocks": blocks, "seconds": elapsed, "block_events_per_s": blocks / elapsed}


# -- 2./4. lookups ------------------------------------------------------------------------------


def populate(index: Any, endpoints: int, chain: int, seed: int) -> list[int]:
    """Endpoint e holds the first chain*(e+1)/endpoints blocks; returns the request's keys."""
    rng = random.Random(seed)
    tokens = [rng.randrange(32000) for _ in range(chain * BLOCK)]
    for e in range(endpoints):
        held = chain * (e + 1) // endpoints
        if not held:
            continue
        hashes = [(e << 40) + i + 1 for i in range(held)]
        index.apply_stored(e, BlockStored(hashes, None, tokens[: held * BLOCK], BLOCK), "m")
    keys: list[int] = index.event_keys.request_keys(tokens, "m", None, None)
    return keys


def lookup_memory(endpoints: int, chain: int, repeats: int) -> dict[str, float]:
    index = KVBlockIndex(EventKeys(), max_blocks=50_000_000, default_capacity_blocks=10**7)
    keys = populate(index, endpoints, chain, seed=chain + endpoints)
    runs = [0] * endpoints
    mask = (1 << endpoints) - 1
    timings = []
    perf = time.perf_counter
    for _ in range(repeats):
        started = perf()
        best = index.runs(keys, mask, runs)
        timings.append(perf() - started)
    assert best == chain and runs[endpoints - 1] == chain
    return {
        "p50_us": 1e6 * _percentile(timings, 0.5),
        "p99_us": 1e6 * _percentile(timings, 0.99),
        "entries": index.num_blocks(),
    }


async def lookup_redis(url: str, endpoints: int, chain: int, repeats: int) -> dict[str, float]:
    store = _store(endpoints)

    def address_of(endpoint_id: int) -> str | None:
        endpoint = store.get(EndpointId(endpoint_id))
        return None if endpoint is None else endpoint.address

    index = RedisKVIndex(
        EventKeys(),
        url,
        f"bench{endpoints}x{chain}",
        address_of,
        max_blocks=50_000_000,
        default_capacity_blocks=10**7,
        timeout_s=5.0,
    )
    task = asyncio.create_task(index.run())
    try:
        while not index.available:
            await asyncio.sleep(0.01)
        keys = populate(index, endpoints, chain, seed=chain + endpoints)
        await index.drain(timeout_s=120)
        timings = []
        result: dict[str, tuple[int, float]] | None = {}
        for _ in range(repeats):
            started = time.perf_counter()
            result = await index.lookup(keys)
            timings.append(time.perf_counter() - started)
        assert result is not None and max(run for run, _ in result.values()) == chain, result
        return {
            "p50_us": 1e6 * _percentile(timings, 0.5),
            "p99_us": 1e6 * _percentile(timings, 0.99),
        }
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await index.close()


# -- 3. memory ----------------------------------------------------------------------------------


def memory_per_block(
    endpoints: int, blocks_per_endpoint: int, shared: bool, layout: LedgerLayout
) -> float:
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    # Strict keys: the engine hash is the key, so only the index's own structures are counted.
    index = KVBlockIndex(EventKeys(key_mode="strict"), max_blocks=10**8, layout=layout)
    rng = random.Random(1)
    common = [rng.getrandbits(64) for _ in range(blocks_per_endpoint)]
    for e in range(endpoints):
        hashes = common if shared else [rng.getrandbits(64) for _ in range(blocks_per_endpoint)]
        index.apply_stored(e, BlockStored(hashes, None, [], BLOCK), "m")
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return used / index.num_blocks()


async def redis_memory_per_block(url: str, endpoints: int, blocks_per_endpoint: int) -> float:
    import redis

    admin = redis.Redis.from_url(url)
    admin.execute_command("FLUSHALL", "SYNC")  # a lazy flush frees later: before would be high
    before = int(admin.info("memory")["used_memory"])
    store = _store(endpoints)
    index = RedisKVIndex(
        EventKeys(key_mode="strict"),
        url,
        "mem",
        lambda e: a.address if (a := store.get(EndpointId(e))) else None,
        timeout_s=5.0,
    )
    task = asyncio.create_task(index.run())
    try:
        while not index.available:
            await asyncio.sleep(0.01)
        rng = random.Random(2)
        common = [rng.getrandbits(64) for _ in range(blocks_per_endpoint)]
        for e in range(endpoints):
            index.apply_stored(e, BlockStored(common, None, [], BLOCK), "m")
        await index.drain(timeout_s=120)
        after = int(admin.info("memory")["used_memory"])
        return (after - before) / index.num_blocks()
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await index.close()
        admin.flushall()


# -- report -------------------------------------------------------------------------------------


def run(quick: bool, with_redis: bool = True) -> dict[str, Any]:
    chains = (100, 500) if quick else (100, 2000, 8000)
    endpoint_counts = (16, 64) if quick else (16, 64, 256)
    repeats = 20 if quick else 200
    blocks = 20_000 if quick else 400_000
    messages = event_messages(blocks, blocks_per_event=16)
    per_endpoint = 2_000 if quick else 50_000
    result: dict[str, Any] = {
        "ingestion": {},
        "lookup_memory": {},
        "lookup_redis": {},
        "bytes_per_block": {},
    }
    result["ingestion"]["direct, decode and keys only (no index)"] = ingest_direct(
        messages, blocks, None
    )
    for layout in LAYOUTS:
        result["ingestion"][f"direct, {layout} ledger"] = ingest_direct(messages, blocks, layout)
        result["ingestion"][f"zmq, {layout} ledger"] = asyncio.run(
            ingest_zmq(messages, blocks, layout)
        )
    for layout in LAYOUTS:
        for shared, name in ((True, "shared_chains"), (False, "distinct_blocks")):
            result["bytes_per_block"][f"memory_{name}_{layout}_ledger"] = memory_per_block(
                16, per_endpoint, shared, layout
            )
    for chain in chains:
        for endpoints in endpoint_counts:
            result["lookup_memory"][f"{chain}x{endpoints}"] = lookup_memory(
                endpoints, chain, repeats
            )
    server = None
    if with_redis:
        try:
            server = ValkeyServer()
        except (FileNotFoundError, OSError) as exc:
            result["redis_skipped"] = str(exc)
    if server is not None:
        try:
            for chain in chains:
                for endpoints in endpoint_counts:
                    result["lookup_redis"][f"{chain}x{endpoints}"] = asyncio.run(
                        lookup_redis(server.url, endpoints, chain, max(10, repeats // 4))
                    )
            result["bytes_per_block"]["redis_shared_chains"] = asyncio.run(
                redis_memory_per_block(server.url, 16, 2_000 if quick else 20_000)
            )
        finally:
            server.close()
    return result


def format_result(result: dict[str, Any]) -> str:
    ingestion = result["ingestion"]
    lines = [
        "Event ingestion (BlockStored batches of 16 blocks with token ids, some removals):",
        "",
        "| path | block events | seconds | block events/s |",
        "|---|---:|---:|---:|",
    ]
    for name, row in ingestion.items():
        lines.append(
            f"| {name} | {row['blocks']} | {row['seconds']:.2f} | {row['block_events_per_s']:,.0f} |"
        )
    lines += [
        "",
        "Lookup latency, one request's chain against every endpoint (µs):",
        "",
        "| chain blocks | endpoints | entries | in-process p50 | in-process p99 | Redis p50 | "
        "Redis p99 | Redis / in-process (p50) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for shape, row in result["lookup_memory"].items():
        chain, endpoints = shape.split("x")
        redis_row = result["lookup_redis"].get(shape)
        redis_cells = (
            f"{redis_row['p50_us']:,.0f} | {redis_row['p99_us']:,.0f} | "
            f"{redis_row['p50_us'] / row['p50_us']:.1f}"
            if redis_row
            else "- | - | -"
        )
        lines.append(
            f"| {chain} | {endpoints} | {row['entries']:,} | {row['p50_us']:,.1f} | "
            f"{row['p99_us']:,.1f} | {redis_cells} |"
        )
    lines += ["", "Bytes per indexed (endpoint, block) entry:", ""]
    for name, value in result["bytes_per_block"].items():
        lines.append(f"- {name}: {value:.0f}")
    if "redis_skipped" in result:
        lines.append(f"\n(Redis part skipped: {result['redis_skipped']})")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kv-picker bench kv-index",
        description="Precise KV index: event ingestion, lookup latency, memory, Redis vs memory.",
    )
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    parser.add_argument("--no-redis", action="store_true", help="skip the Redis backend")
    parser.add_argument("--out", type=Path, default=None, help="write kv_index.json here")
    args = parser.parse_args(argv)
    result = run(args.quick, with_redis=not args.no_redis)
    print(format_result(result))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "kv_index.json").write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
