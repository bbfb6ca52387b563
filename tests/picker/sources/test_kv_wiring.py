"""From the config to the precise index and its subscriber: which backend, what feeds it, and
the dropped-events metric both backends report through."""

from __future__ import annotations

from typing import Any

import pytest

from kv_picker.config import parse_config
from kv_picker.endpoint import EndpointSpec
from kv_picker.errors import ConfigError
from kv_picker.metrics import PickerMetrics
from kv_picker.plugins import builtin_registry
from kv_picker.sources.kv_event_subscriber import KVEventSubscriber
from kv_picker.sources.kv_wiring import build_kv_index, build_subscriber
from kv_picker.state.block_events import DROP_MEDIUM, DROP_UNKNOWN_PARENT, BlockStored
from kv_picker.state.block_ledger import BlockLedger
from kv_picker.state.compact_ledger import CompactLedger
from kv_picker.state.kv_index import KVBlockIndex
from kv_picker.state.redis_index import RedisKVIndex
from tests.fakes import make_store

REGISTRY = builtin_registry(include_entry_points=False)


def dropped(metrics: PickerMetrics, reason: str) -> float:
    value = metrics.registry.get_sample_value(
        "kv_picker_kv_events_dropped_total", {"reason": reason}
    )
    return value or 0.0


def test_nothing_to_feed_or_share_builds_nothing() -> None:
    store, metrics = make_store(2), PickerMetrics()
    config = parse_config({}, REGISTRY)
    index = build_kv_index(config, store, metrics)
    assert index is None
    assert build_subscriber(config, store, index, metrics) is None


def test_events_feed_an_in_process_index_that_follows_the_endpoint_set() -> None:
    store, metrics = make_store(2), PickerMetrics()
    config = parse_config({"kvEvents": {"model": "m"}, "index": {"blockSizeTokens": 4}}, REGISTRY)
    index = build_kv_index(config, store, metrics)
    assert isinstance(index, KVBlockIndex)
    assert index.event_keys.block_size_tokens == 4
    subscriber = build_subscriber(config, store, index, metrics)
    assert isinstance(subscriber, KVEventSubscriber) and subscriber.index is index
    assert subscriber.settings.model == "m"
    assert index.apply_stored(1, BlockStored([1, 2], None, list(range(8)), 4), "m") == 2
    # Dropped blocks are counted by reason.
    assert index.apply_stored(0, BlockStored([3, 4], 99, list(range(8)), 4), "m") == 0
    assert index.apply_stored(0, BlockStored([5], None, [1] * 4, 4, medium="NVME"), "m") == 0
    assert dropped(metrics, DROP_UNKNOWN_PARENT) == 2
    assert dropped(metrics, DROP_MEDIUM) == 1
    # An endpoint leaving the pool leaves the index.
    store.set_endpoints([EndpointSpec(store.all()[0].address)])
    assert index.num_blocks() == 0


@pytest.mark.parametrize("events", [None, {"mode": "bind"}])
def test_a_shared_backend_is_redis_with_or_without_events(events: Any) -> None:
    store, metrics = make_store(2), PickerMetrics()
    document: dict[str, Any] = {"index": {"backend": "redis", "url": "redis://127.0.0.1:1"}}
    if events is not None:
        document["kvEvents"] = events
    config = parse_config(document, REGISTRY)
    index = build_kv_index(config, store, metrics)
    assert isinstance(index, RedisKVIndex)  # built without connecting
    subscriber = build_subscriber(config, store, index, metrics)
    assert (subscriber is not None) == (events is not None)
    # The same front half reports drops, whichever backend applies the event.
    assert index.apply_stored(0, BlockStored([1], 7, [1] * 16, 16), "m") == 0
    assert dropped(metrics, DROP_UNKNOWN_PARENT) == 1


@pytest.mark.parametrize("backend", ["memory", "redis"])
@pytest.mark.parametrize(("ledger", "kind"), [(None, CompactLedger), ("dict", BlockLedger)])
def test_the_ledger_layout_is_the_configs(backend: str, ledger: str | None, kind: type) -> None:
    store, metrics = make_store(2), PickerMetrics()
    section: dict[str, Any] = {"backend": backend, "url": "redis://127.0.0.1:1"}
    if ledger is not None:
        section["ledger"] = ledger
    config = parse_config({"kvEvents": {"model": "m"}, "index": section}, REGISTRY)
    index = build_kv_index(config, store, metrics)
    assert isinstance(index, (KVBlockIndex, RedisKVIndex))
    assert type(index.ledger) is kind


def test_an_unknown_ledger_layout_is_refused() -> None:
    with pytest.raises(ConfigError, match="ledger"):
        parse_config({"index": {"ledger": "btree"}}, REGISTRY)
