"""The endpoint store's membership: ids kept, instances replaced, subscribers told once."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from kv_picker.endpoint import Endpoint, EndpointId, EndpointSpec
from kv_picker.state.endpoints import PREFILL_SAMPLES, EndpointStore
from tests.fakes import ManualClock


def test_membership_changes_are_reported_once_per_update() -> None:
    store = EndpointStore(ManualClock())
    changes: list[tuple[list[str], list[str]]] = []
    removed_ids: list[EndpointId] = []

    def record(added: Sequence[Endpoint], removed: Sequence[Endpoint]) -> None:
        # By now the store holds the new set, and on_removed callbacks have run.
        assert all(store.get(e.id) is e for e in added)
        assert all(store.by_address.get(e.address) is not e for e in removed)
        assert len(removed_ids) >= len(removed)
        changes.append(([e.address for e in added], [e.address for e in removed]))

    subscription = store.on_change(record)
    store.on_removed(removed_ids.append)
    store.set_endpoints([EndpointSpec("127.0.0.1:1"), EndpointSpec("127.0.0.1:2")])
    first = store.by_address["127.0.0.1:1"]
    store.set_endpoints([EndpointSpec("127.0.0.1:1", {"zone": "a"}), EndpointSpec("127.0.0.1:2")])
    assert store.by_address["127.0.0.1:1"] is first and first.labels == {"zone": "a"}
    store.set_endpoints([EndpointSpec("127.0.0.1:1", {"zone": "a"})])
    assert changes == [(["127.0.0.1:1", "127.0.0.1:2"], []), ([], ["127.0.0.1:2"])]
    subscription.cancel()
    subscription.cancel()
    store.set_endpoints([])
    assert len(changes) == 2


def test_a_new_instance_at_an_address_replaces_the_endpoint() -> None:
    store = EndpointStore(ManualClock())
    removed: list[EndpointId] = []
    store.on_removed(removed.append)
    store.set_endpoints([EndpointSpec("127.0.0.1:1", instance="pod-a")])
    old = store.by_address["127.0.0.1:1"]
    store.in_flight[old.id] = 3
    store.set_ready(old.id, True)
    store.set_endpoints([EndpointSpec("127.0.0.1:1", instance="pod-a")])
    assert store.by_address["127.0.0.1:1"] is old and not removed
    store.set_endpoints([EndpointSpec("127.0.0.1:1", instance="pod-b")])
    new = store.by_address["127.0.0.1:1"]
    assert new is not old and new.instance == "pod-b"
    assert removed == [old.id]
    # Nothing of the old server carries over: not ready until scraped, no requests counted.
    assert store.in_flight[new.id] == 0 and not store.ready[new.id]
    assert store.ready_endpoints() == []


def test_an_observed_prefill_is_kept_with_its_time_at_the_head_of_the_queue() -> None:
    clock = ManualClock()
    store = EndpointStore(clock)
    store.set_endpoints([EndpointSpec("10.0.0.1:8000"), EndpointSpec("10.0.0.2:8000")])
    first, second = store.all()
    store.add_prefill(first.id, 8000.0, 1e7)  # at the head from now
    clock.advance(0.5)
    store.add_prefill(first.id, 6000.0, 5e6)  # queued behind it
    clock.advance(1.5)
    store.prefill_done(first.id, 8000.0, 1e7, observed=True)
    assert [(s.endpoint, s.tokens, s.pairs, s.seconds) for s in store.prefill_samples] == [
        (first, 8000.0, 1e7, 2.0)
    ]
    clock.advance(3.0)  # the second reached the head when the first ended, 3 s ago
    store.prefill_done(first.id, 6000.0, 5e6, observed=True)
    assert [s.seconds for s in store.prefill_samples] == [2.0, 3.0]
    assert store.prefill_sample_count == 2
    # Not kept: an end the picker did not see (the request ended, or a scrape said so), a
    # prompt too short for its compute to be most of the time, or a queue whose head this
    # store never saw start (another worker's requests, set directly).
    store.add_prefill(second.id, 8000.0)
    clock.advance(1.0)
    store.prefill_done(second.id, 8000.0)
    store.add_prefill(second.id, 4095.0)
    clock.advance(1.0)
    store.prefill_done(second.id, 4095.0, observed=True)
    store.prefill_tokens[second.id], store.prefill_requests[second.id] = 8000.0, 1
    store.prefill_done(second.id, 8000.0, observed=True)
    assert store.prefill_sample_count == 2 and len(store.prefill_samples) == 2
    # The last PREFILL_SAMPLES are kept; the count goes on.
    for _ in range(PREFILL_SAMPLES):
        store.add_prefill(second.id, 5000.0)
        clock.advance(0.25)
        store.prefill_done(second.id, 5000.0, observed=True)
    assert len(store.prefill_samples) == PREFILL_SAMPLES
    assert store.prefill_sample_count == PREFILL_SAMPLES + 2
    assert all(s.endpoint is second for s in store.prefill_samples)


def test_a_sample_records_the_prompt_tokens_in_flight_and_a_reader_may_lower_the_floor() -> None:
    clock = ManualClock()
    store = EndpointStore(clock)
    store.set_endpoints([EndpointSpec("10.0.0.1:8000")])
    (endpoint,) = store.all()
    store.in_flight_tokens[endpoint.id] = 30_000.0  # the KV its steps read meanwhile
    store.add_prefill(endpoint.id, 2000.0)
    clock.advance(0.5)
    store.prefill_done(endpoint.id, 2000.0, observed=True)
    assert store.prefill_samples == deque()  # under the floor of 4,096 tokens
    store.prefill_sample_min_tokens = 1024
    store.add_prefill(endpoint.id, 2000.0)
    clock.advance(0.5)
    store.prefill_done(endpoint.id, 2000.0, observed=True)
    assert [(s.tokens, s.seconds, s.in_flight_tokens) for s in store.prefill_samples] == [
        (2000.0, 0.5, 30_000.0)
    ]
    # And when it ended: prefills an engine finished in one step end together.
    assert store.prefill_samples[-1].ended_s == clock()
    # And how many this picker had queued there, itself included.
    store.add_prefill(endpoint.id, 2000.0)
    store.add_prefill(endpoint.id, 3000.0)
    clock.advance(0.5)
    store.prefill_done(endpoint.id, 2000.0, observed=True)
    store.prefill_done(endpoint.id, 3000.0, observed=True)
    assert [s.queued for s in store.prefill_samples] == [1, 2, 1]
