"""From the config to the precise KV index and the subscriber that feeds it.

Kept out of the subscriber and the indexes so that neither depends on the config schema, and so
that the app has one place that decides which backend serves (``index.backend``) and whether
anything feeds it (``kvEvents``). Whatever is built is used through
:class:`~kv_picker.state.kv_index.KVIndex` from then on.
"""

from __future__ import annotations

from kv_picker.config import PickerConfig
from kv_picker.endpoint import EndpointId
from kv_picker.metrics import PickerMetrics
from kv_picker.sources.kv_event_subscriber import (
    KVEventSubscriber,
    PublisherAddress,
    SubscriberSettings,
)
from kv_picker.state.block_events import EventKeys, Tiers
from kv_picker.state.endpoints import EndpointStore
from kv_picker.state.kv_index import KVBlockIndex, KVIndex
from kv_picker.state.redis_index import RedisKVIndex


def build_kv_index(
    config: PickerConfig, store: EndpointStore, metrics: PickerMetrics
) -> KVIndex | None:
    """The precise index a config asks for.

    Args:
        config: the ``index`` and ``kvEvents`` sections decide.
        store: the endpoints; their scraped KV capacities bound the index, and an endpoint
            leaving the store leaves the index.
        metrics: where dropped events and backend errors are counted.

    Returns:
        The in-process index when events feed it, the Redis index whenever ``index.backend``
        is ``redis`` (a replica may only read what others write), else None: nothing would
        feed or read it.
    """
    settings = config.index
    if config.kv_events is None and settings.backend != "redis":
        return None
    dropped = metrics.kv_events_dropped

    def on_drop(reason: str, blocks: int) -> None:
        dropped.labels(reason).inc(blocks)

    event_keys = EventKeys(
        settings.block_size_tokens,
        settings.keys,
        settings.hash_algo,
        settings.hash_seed,
        on_drop,
        Tiers(settings.tier_weights),
    )

    index: KVIndex
    if settings.backend == "redis":

        def address_of(endpoint_id: int) -> str | None:
            endpoint = (
                store.get(EndpointId(endpoint_id)) if endpoint_id < len(store.endpoints) else None
            )
            return None if endpoint is None else endpoint.address

        index = RedisKVIndex(
            event_keys,
            settings.url,
            settings.key_prefix,
            address_of,
            default_capacity_blocks=settings.capacity_blocks_per_endpoint,
            max_blocks=settings.max_blocks,
            capacity_source=store.num_gpu_blocks,
            timeout_s=settings.timeout_s,
            retry_s=settings.retry_interval_s,
            metrics=metrics,
            layout=settings.ledger,
        )
    else:
        index = KVBlockIndex(
            event_keys,
            default_capacity_blocks=settings.capacity_blocks_per_endpoint,
            max_blocks=settings.max_blocks,
            capacity_source=store.num_gpu_blocks,
            layout=settings.ledger,
        )
    store.on_removed(index.remove_endpoint)
    return index


def build_subscriber(
    config: PickerConfig,
    store: EndpointStore,
    index: KVIndex | None,
    metrics: PickerMetrics,
) -> KVEventSubscriber | None:
    """The subscriber of the config's ``kvEvents`` section.

    Args:
        config: its ``kvEvents`` section.
        store: the endpoints whose events are accepted.
        index: what the events are applied to (from :func:`build_kv_index`).
        metrics: counters for applied, dropped and malformed events, gaps and replays.

    Returns:
        The subscriber, or None without a ``kvEvents`` section or an index.
    """
    events = config.kv_events
    if events is None or index is None:
        return None
    settings = SubscriberSettings(
        mode=events.mode,
        bind=events.bind,
        publisher_port=events.publisher_port,
        replay_port=events.replay_port,
        data_parallel_base_port=events.data_parallel_base_port,
        endpoints=tuple(
            (address, PublisherAddress(source.publisher, source.replay))
            for address, source in events.endpoints.items()
        ),
        topic_filter=events.topic_filter,
        model=events.model,
        replay_timeout_s=events.replay_timeout_s,
        catch_up=events.catch_up,
    )
    return KVEventSubscriber(settings, store, index, metrics)
