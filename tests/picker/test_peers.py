"""Workers' shared picks and counts (kv_picker.peers), over real ZMQ sockets in one process."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import msgpack
import pytest

from kv_picker.endpoint import EndpointSpec
from kv_picker.peers import LANDED, PICK, PREFILLED, SCRAPED, SNAPSHOT, STATE, PeerSync
from kv_picker.scheduling.framework import PeerPick
from kv_picker.sources.scraper import EndpointSignals
from kv_picker.state.approx_index import ApproximatePrefixIndex
from kv_picker.state.endpoints import EndpointStore, LoraState

ADDRESSES = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]


class Worker:
    def __init__(self, directory: Path, index: int, count: int, addresses: Sequence[str],
                 timeout_s: float = 3.0) -> None:  # fmt: skip
        self.store = EndpointStore(time.monotonic)
        self.store.set_endpoints(EndpointSpec(address) for address in addresses)
        self.records: list[tuple[list[tuple[str, Sequence[int]]], PeerPick]] = []
        self.landed: list[str] = []
        self.sync = PeerSync(
            self.store,
            lambda records, pick: self.records.append((list(records), pick)),
            directory,
            index,
            count,
            heartbeat_s=0.05,
            timeout_s=timeout_s,
        )
        self.sync.on_landed = self.landed.append

    def endpoint(self, address: str):  # type: ignore[no-untyped-def]
        return self.store.by_address[address]

    def counts(self, address: str) -> tuple[float, ...]:
        i = self.endpoint(address).id
        s = self.store
        return (s.in_flight[i], s.in_flight_tokens[i], s.prefill_tokens[i],
                s.prefill_requests[i], s.prefill_pairs[i])  # fmt: skip


async def eventually(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


async def connected(a: Worker, b: Worker) -> list[asyncio.Task[None]]:
    """Start both and wait until each has heard the other's snapshot (ZMQ connects late)."""
    a.sync.start()
    b.sync.start()
    tasks = [asyncio.create_task(a.sync.run()), asyncio.create_task(b.sync.run())]
    await eventually(lambda: b.sync.index in a.sync.peers and a.sync.index in b.sync.peers)
    return tasks


async def stop(tasks: list[asyncio.Task[None]], *workers: Worker) -> None:
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for worker in workers:
        worker.sync.close()


async def test_a_pick_reaches_the_other_worker_by_address(tmp_path: Path) -> None:
    a = Worker(tmp_path, 0, 2, ADDRESSES)
    b = Worker(tmp_path, 1, 2, list(reversed(ADDRESSES)))  # other ids for the same addresses
    tasks = await connected(a, b)
    try:
        decode, prefill = a.endpoint(ADDRESSES[0]), a.endpoint(ADDRESSES[1])
        a.sync.picked(decode, prefill, 900.0, 600.0, 1e5, [("prefix-cache-scorer", [1, 2, 3])],
                      41)  # fmt: skip
        await eventually(lambda: b.counts(ADDRESSES[0])[0] == 1)
        assert b.counts(ADDRESSES[0]) == (1, 900.0, 0.0, 0, 0.0)
        # The prefill endpoint runs the request too, until its prefill leg ends (its prompt
        # tokens count in flight where they are decoded).
        assert b.counts(ADDRESSES[1]) == (1, 0.0, 600.0, 1, 1e5)
        ids = [b.endpoint(ADDRESSES[0]).id, b.endpoint(ADDRESSES[1]).id]
        # The landing names a's request apart from b's own and from another worker's.
        landing = f"0/{a.sync.incarnation}/41"
        assert b.records == [([("prefix-cache-scorer", [1, 2, 3])], PeerPick(*ids, landing))]
        assert ids != [decode.id, prefill.id]  # the test would pass by chance otherwise

        a.sync.prefilled(prefill, 600.0, 1e5, True)
        a.sync.landed(41)
        await eventually(lambda: b.counts(ADDRESSES[1]) == (0, 0.0, 0.0, 0, 0.0))
        await eventually(lambda: b.landed == [landing])
        assert b.counts(ADDRESSES[0]) == (1, 900.0, 0.0, 0, 0.0)
        a.sync.released(decode, 900.0)
        await eventually(lambda: b.counts(ADDRESSES[0]) == (0, 0.0, 0.0, 0, 0.0))
        # b's own picks count beside a's, and a sees them.
        b.sync.took(b.endpoint(ADDRESSES[2]))
        b.store.in_flight[b.endpoint(ADDRESSES[2]).id] += 1  # as the director does
        a.sync.took(a.endpoint(ADDRESSES[2]))
        a.store.in_flight[a.endpoint(ADDRESSES[2]).id] += 1
        await eventually(lambda: a.counts(ADDRESSES[2])[0] == 2 and b.counts(ADDRESSES[2])[0] == 2)
        # A snapshot round keeps the sum (nothing counted twice).
        await asyncio.sleep(0.2)
        assert a.counts(ADDRESSES[2])[0] == 2 and b.counts(ADDRESSES[2])[0] == 2
    finally:
        await stop(tasks, a, b)


async def test_a_silent_worker_loses_its_counts(tmp_path: Path) -> None:
    a = Worker(tmp_path, 0, 2, ADDRESSES)
    b = Worker(tmp_path, 1, 2, ADDRESSES, timeout_s=0.3)
    tasks = await connected(a, b)
    try:
        a.sync.took(a.endpoint(ADDRESSES[0]))
        await eventually(lambda: b.counts(ADDRESSES[0])[0] == 1)
        tasks[0].cancel()  # a stops sending (as a killed worker would)
        a.sync.close()
        await eventually(lambda: b.counts(ADDRESSES[0])[0] == 0, timeout_s=3.0)
        assert 0 not in b.sync.peers
    finally:
        await stop(tasks, b)


def frame(worker: int, incarnation: int, *messages: list[object]) -> bytes:
    data: bytes = msgpack.packb([worker, incarnation, list(messages)])
    return data


def pick(address: str, tokens: float = 10.0, pairs: float = 5.0) -> list[object]:
    return [PICK, address, None, tokens, tokens, pairs, [], None]


async def test_a_restarted_worker_replaces_its_old_counts(tmp_path: Path) -> None:
    b = Worker(tmp_path, 1, 2, ADDRESSES)
    b.sync.apply(frame(0, 111, pick(ADDRESSES[0]), pick(ADDRESSES[0])))
    assert b.counts(ADDRESSES[0]) == (2, 20.0, 20.0, 2, 10.0)
    # The same worker index, a new incarnation: what the old one counted is gone.
    b.sync.apply(frame(0, 222, pick(ADDRESSES[0])))
    assert b.counts(ADDRESSES[0]) == (1, 10.0, 10.0, 1, 5.0)


async def test_a_peers_pick_adds_recent_work_where_the_prompt_is_computed(tmp_path: Path) -> None:
    b = Worker(tmp_path, 1, 2, ADDRESSES)
    disaggregated = [PICK, ADDRESSES[0], ADDRESSES[1], 900.0, 600.0, 1e5, [], 3]
    b.sync.apply(frame(0, 111, disaggregated, pick(ADDRESSES[2], 40.0, 7.0)))
    recent = b.store.recent_prefill
    assert recent(b.endpoint(ADDRESSES[1]).id) == pytest.approx((600.0, 1e5), rel=1e-3)
    assert recent(b.endpoint(ADDRESSES[2]).id) == pytest.approx((40.0, 7.0), rel=1e-3)
    assert recent(b.endpoint(ADDRESSES[0]).id) == (0.0, 0.0)  # decoded there, not computed
    # The prefill ending, or a snapshot reconciling the totals, leaves the recent work.
    b.sync.apply(frame(0, 111, [PREFILLED, ADDRESSES[1], 600.0, 1e5, True]))
    b.sync.reconcile()
    assert b.counts(ADDRESSES[1])[2] == 0.0
    assert recent(b.endpoint(ADDRESSES[1]).id)[0] == pytest.approx(600.0, rel=1e-3)


async def test_a_snapshot_heals_lost_messages(tmp_path: Path) -> None:
    b = Worker(tmp_path, 1, 2, ADDRESSES)
    b.sync.apply(frame(0, 7, pick(ADDRESSES[0])))
    # The release was lost; the sender's next snapshot says it has nothing in flight, and
    # counts of an address b does not know are kept for when it does.
    b.sync.apply(frame(0, 7, [SNAPSHOT, {"10.9.9.9:1": [3, 0, 0, 0, 0]}]))
    assert b.counts(ADDRESSES[0]) == (0, 0.0, 0.0, 0, 0.0)
    b.store.set_endpoints(EndpointSpec(a) for a in [*ADDRESSES, "10.9.9.9:1"])
    b.sync.reconcile()
    assert b.counts("10.9.9.9:1")[0] == 3


@pytest.mark.parametrize(
    "data",
    [
        b"",
        b"\xc1",
        msgpack.packb({"a": 1}),
        msgpack.packb([0, 1]),
        msgpack.packb([0, "1", []]),
        frame(0, 1, [PICK, ADDRESSES[0]]),
        frame(0, 1, [99, ADDRESSES[0]]),
        frame(0, 1, [PICK, 5, None, 1, 1, 1, [], None]),  # an address that is not a string
        frame(0, 1, [PICK, ADDRESSES[0], None, 1, "x", 1, [], None]),
        frame(0, 1, [PICK, ADDRESSES[0], None, 1, 1, 1, [["p", [1, "k"]]], None]),
        frame(0, 1, [PICK, ADDRESSES[0], None, 1, float("nan"), 1, [], None]),
        frame(0, 1, [PICK, ADDRESSES[0], ADDRESSES[1], 1, 1, 1, [], "7"]),  # a serial
        frame(0, 1, [LANDED, "7"]),
        frame(0, 1, [LANDED]),
        frame(0, 1, [SNAPSHOT, {ADDRESSES[0]: [1, 2]}]),
        frame(0, 1, [PREFILLED, ADDRESSES[0], 1, 1]),  # no held field
        frame(0, 1, [PREFILLED, ADDRESSES[0], 1, 1, 1]),  # not a boolean
        frame(0, 1, "not a message"),
    ],
)
def test_a_malformed_message_is_counted_and_changes_nothing(tmp_path: Path, data: bytes) -> None:
    b = Worker(tmp_path, 1, 2, ADDRESSES)
    b.sync.apply(data)
    assert b.sync.malformed == 1
    assert all(b.counts(address) == (0, 0.0, 0.0, 0, 0.0) for address in ADDRESSES)
    assert b.records == [] and b.landed == []
    b.sync.apply(frame(0, 1, pick(ADDRESSES[1])))
    assert b.counts(ADDRESSES[1])[0] == 1


def test_a_bad_message_spoils_only_itself(tmp_path: Path) -> None:
    b = Worker(tmp_path, 1, 2, ADDRESSES)
    b.sync.apply(frame(0, 1, pick(ADDRESSES[0]), [PICK, 5], pick(ADDRESSES[1])))
    assert (b.sync.malformed, b.sync.received) == (1, 2)
    assert b.counts(ADDRESSES[0])[0] == 1 and b.counts(ADDRESSES[1])[0] == 1


def test_another_workers_scrapes_reach_the_scrape_sink(tmp_path: Path) -> None:
    b = Worker(tmp_path, 1, 2, ADDRESSES)
    seen: list[tuple[str, EndpointSignals | None, str]] = []
    b.sync.on_scrape = lambda address, signals, reason: seen.append((address, signals, reason))
    lora = LoraState(frozenset({"a"}), frozenset(), 2)
    signals = EndpointSignals(3.0, 1.0, 0.5, 16, 4096, lora, first_tokens=812.0)
    sender = Worker(tmp_path, 0, 2, ADDRESSES)
    sent: list[list[object]] = []
    sender.sync._send = sent.append  # type: ignore[method-assign]
    sender.sync.scraped(sender.endpoint(ADDRESSES[0]), signals, "")
    sender.sync.scraped(sender.endpoint(ADDRESSES[1]), None, "connection refused")
    b.sync.apply(frame(0, 1, *sent))
    assert seen == [(ADDRESSES[0], signals, ""), (ADDRESSES[1], None, "connection refused")]
    b.sync.apply(frame(0, 1, [SCRAPED, ADDRESSES[0], "many", 1.0, 0.5, 16, 4096, None, 3]))
    assert b.sync.malformed == 1 and len(seen) == 2


async def test_a_worker_started_again_gets_a_copy_of_the_learned_state(tmp_path: Path) -> None:
    a = Worker(tmp_path, 0, 2, ADDRESSES)
    b = Worker(tmp_path, 1, 2, list(reversed(ADDRESSES)))  # other ids for the same addresses
    index_a, index_b = ApproximatePrefixIndex(100), ApproximatePrefixIndex(100)
    index_a.record(a.endpoint(ADDRESSES[0]).id, [1, 2, 3])
    index_a.record(a.endpoint(ADDRESSES[2]).id, [7, 8])
    index_a.record(a.endpoint(ADDRESSES[0]).id, [1])  # now the most recent there

    def export() -> dict[str, dict[str, list[int]]]:
        held = {address: index_a.held(e.id) for address, e in a.store.by_address.items()}
        return {"prefix": {address: keys for address, keys in held.items() if keys}}

    def load(states: dict[str, dict[str, list[int]]]) -> int:
        for address, keys in states["prefix"].items():
            index_b.record(b.endpoint(address).id, keys)
        return sum(len(keys) for keys in states["prefix"].values())

    a.sync.export_state = export
    b.sync.load_state = load
    tasks = await connected(a, b)
    try:
        assert await b.sync.fetch_state(attempts=5, wait_s=0.5) == 5
        assert index_b.held(b.endpoint(ADDRESSES[0]).id) == [2, 3, 1]  # recency kept
        assert index_b.held(b.endpoint(ADDRESSES[2]).id) == [7, 8]
        assert index_b.held(b.endpoint(ADDRESSES[1]).id) == []
        # A copy comes once: asking again changes nothing.
        index_a.record(a.endpoint(ADDRESSES[1]).id, [9])
        assert await b.sync.fetch_state(attempts=1, wait_s=0.2) == 5
        assert index_b.held(b.endpoint(ADDRESSES[1]).id) == []
    finally:
        await stop(tasks, a, b)


def test_a_state_copy_for_another_worker_or_malformed_is_not_loaded(tmp_path: Path) -> None:
    b = Worker(tmp_path, 1, 2, ADDRESSES)
    loaded: list[object] = []
    b.sync.load_state = lambda states: loaded.append(states) or 0  # type: ignore[func-returns-value]
    payload = msgpack.packb({"prefix": {ADDRESSES[0]: [1, 2]}})
    for_other = msgpack.packb([0, 7, STATE, 2, b.sync.incarnation])
    b.sync.apply_state(for_other, payload)
    mine = msgpack.packb([0, 7, STATE, 1, b.sync.incarnation])
    b.sync.apply_state(mine, msgpack.packb({"prefix": {ADDRESSES[0]: [1, "x"]}}))
    b.sync.apply_state(mine, b"\xc1")
    assert loaded == [] and b.sync.malformed == 2
    b.sync.apply_state(mine, payload)
    assert loaded == [{"prefix": {ADDRESSES[0]: [1, 2]}}]


def test_a_worker_index_must_be_in_range(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="out of range"):
        Worker(tmp_path, 2, 2, ADDRESSES)
