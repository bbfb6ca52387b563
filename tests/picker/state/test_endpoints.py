"""The endpoint store's membership: ids kept, instances replaced, subscribers told once."""

from __future__ import annotations

from collections.abc import Sequence

from kv_picker.endpoint import Endpoint, EndpointId, EndpointSpec
from kv_picker.state.endpoints import EndpointStore
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
