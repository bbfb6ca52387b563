"""vLLM KV events: the wire decoder and the subscriber that keeps the precise index current.

Wire format (vLLM ``vllm/distributed/kv_events.py``; reference notes §1)::

    frames:  [topic, seq (8 bytes, big-endian), msgpack payload]      topic: kv@<endpoint>@<model>
    payload: [ts, events, data_parallel_rank]     (a map with those names is accepted too)
    event:   ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
              medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind, ...]   older vLLM
             {"type": "BlockStored", "block_hashes": ..., ...}                       newer vLLM
             BlockRemoved(block_hashes, medium, group_idx), AllBlocksCleared()
    hash:    uint64, or the digest's bytes (the last 8 bytes, big-endian, name the block)

Unknown fields and unknown event types are ignored; anything else that does not fit is a
malformed message: counted and dropped, never an exception out of the subscriber.

Delivery, per publisher (one per endpoint)::

    seq == last + 1   apply
    seq >  last + 1   gap: replay [last+1, ...) from the endpoint's ROUTER socket (DEALER
                      client) when configured, while live messages wait; without replay, or if
                      the range is gone, drop the endpoint's entries (what we hold may be wrong)
    seq <= last       the publisher restarted (vLLM counts from 0 per process): drop the
                      endpoint's entries, then apply
    first message     nothing is known about earlier history: with replay, ask for everything
                      the publisher still buffers (a picker restart recovers the index)
    disconnected      (connect mode) the publisher's process may be gone, and what it sends
                      meanwhile is lost anyway: drop the endpoint's entries at once (a
                      restarted vLLM starts empty) and catch up by replay on reconnection

Sockets (``kvEvents.mode``): ``connect`` opens one SUB socket per endpoint to its publisher
(the endpoint is known from the socket, topics may be anything); ``bind`` binds one SUB socket
that endpoints' publishers connect to (the endpoint is named by the topic). Everything runs on
the event loop with ``zmq.asyncio``: receiving never blocks, and each message is applied to the
index in place between two awaits, so the synchronous scheduling path never sees half an event.
A flood of messages yields to the loop every few messages so requests keep flowing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq
import zmq.asyncio
import zmq.utils.monitor

from kv_picker.config import PickerConfig
from kv_picker.endpoint import EndpointId, split_address
from kv_picker.metrics import PickerMetrics
from kv_picker.state.block_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventKeys,
    KVEvent,
)
from kv_picker.state.endpoints import EndpointStore
from kv_picker.state.kv_index import KVBlockIndex, KVIndex
from kv_picker.state.redis_index import RedisKVIndex

log = logging.getLogger(__name__)

_U64_MASK = (1 << 64) - 1
END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The replay socket's end-of-replay marker (``ff`` × 8)."""

_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")
_YIELD_EVERY_MESSAGES = 32
_MAX_PENDING_MESSAGES = 10_000


class MalformedMessage(ValueError):
    """A KV-event message that does not follow the wire format."""


@dataclass(slots=True)
class EventBatch:
    """One published batch (one engine step)."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


# -- decoding --------------------------------------------------------------------------------


def _hash64(value: Any) -> int:
    if type(value) is int:
        return value & _U64_MASK
    if isinstance(value, bytes) and value:
        return int.from_bytes(value[-8:], "big")
    raise MalformedMessage(f"block hash must be an int or non-empty bytes, got {value!r:.40}")


def _hashes(value: Any) -> list[int]:
    if not isinstance(value, list):
        raise MalformedMessage("block_hashes must be a list")
    return [_hash64(v) for v in value]


def _optional(value: Any, kind: type, name: str) -> Any:
    if value is None or (type(value) is kind):
        return value
    raise MalformedMessage(f"{name} must be {kind.__name__} or nil")


def _fields(event: Any, names: tuple[str, ...]) -> dict[str, Any]:
    if isinstance(event, dict):
        return event
    return dict(zip(names, event[1:], strict=False))


def _decode_event(event: Any) -> KVEvent | None:
    if isinstance(event, dict):
        tag = event.get("type")
    elif isinstance(event, list) and event:
        tag = event[0]
    else:
        raise MalformedMessage("an event must be a tagged array or a map with a 'type'")
    if tag == "BlockStored":
        f = _fields(event, _STORED_FIELDS)
        token_ids = f.get("token_ids")
        block_size = f.get("block_size")
        if not isinstance(token_ids, list):
            raise MalformedMessage("BlockStored.token_ids must be a list")
        if type(block_size) is not int or block_size <= 0:
            raise MalformedMessage("BlockStored.block_size must be a positive int")
        parent = f.get("parent_block_hash")
        extra_keys = f.get("extra_keys")
        if extra_keys is not None and not isinstance(extra_keys, list):
            raise MalformedMessage("BlockStored.extra_keys must be a list or nil")
        return BlockStored(
            block_hashes=_hashes(f.get("block_hashes")),
            parent_block_hash=None if parent is None else _hash64(parent),
            token_ids=token_ids,
            block_size=block_size,
            lora_id=_optional(f.get("lora_id"), int, "lora_id"),
            medium=_optional(f.get("medium"), str, "medium"),
            lora_name=_optional(f.get("lora_name"), str, "lora_name"),
            extra_keys=extra_keys,
            group_idx=_optional(f.get("group_idx"), int, "group_idx"),
            kv_cache_spec_kind=_optional(f.get("kv_cache_spec_kind"), str, "kv_cache_spec_kind"),
        )
    if tag == "BlockRemoved":
        f = _fields(event, _REMOVED_FIELDS)
        return BlockRemoved(
            block_hashes=_hashes(f.get("block_hashes")),
            medium=_optional(f.get("medium"), str, "medium"),
            group_idx=_optional(f.get("group_idx"), int, "group_idx"),
        )
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    if not isinstance(tag, str):
        raise MalformedMessage("an event's tag must be a string")
    return None  # an event type this picker does not know: ignored


def decode_payload(payload: bytes) -> EventBatch:
    """Decode a msgpack ``KVEventBatch``.

    Raises:
        MalformedMessage: for anything that is not a batch in either encoding.
    """
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=True)
    except Exception as exc:  # msgpack raises many types on arbitrary bytes
        raise MalformedMessage(f"payload is not msgpack: {type(exc).__name__}") from None
    ts: Any
    raw_events: Any
    rank: Any
    if isinstance(batch, dict):
        ts, raw_events, rank = batch.get("ts"), batch.get("events"), batch.get("data_parallel_rank")
    elif isinstance(batch, list) and len(batch) >= 2:
        ts, raw_events = batch[0], batch[1]
        rank = batch[2] if len(batch) > 2 else None
    else:
        raise MalformedMessage("payload must be [ts, events, dp_rank] or a map")
    if type(ts) not in (int, float):
        raise MalformedMessage("batch ts must be a number")
    if not isinstance(raw_events, list):
        raise MalformedMessage("batch events must be a list")
    if rank is not None and type(rank) is not int:
        raise MalformedMessage("data_parallel_rank must be an int or nil")
    try:
        decoded = [_decode_event(e) for e in raw_events]
    except MalformedMessage:
        raise
    except Exception as exc:  # e.g. a map whose keys are not strings
        raise MalformedMessage(f"bad event: {type(exc).__name__}") from None
    return EventBatch(float(ts), [e for e in decoded if e is not None], rank)


def decode_seq(frame: bytes) -> int:
    """The sequence number frame (8 bytes, big-endian, unsigned)."""
    if len(frame) != 8:
        raise MalformedMessage(f"sequence frame must be 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big")


def parse_topic(topic: bytes) -> tuple[str | None, str | None]:
    """(endpoint, model) from a ``kv@<endpoint>@<model>`` topic; (None, None) otherwise."""
    try:
        text = topic.decode()
    except UnicodeDecodeError:
        return None, None
    parts = text.split("@")
    if len(parts) != 3 or parts[0] != "kv" or not parts[1]:
        return None, None
    return parts[1], parts[2] or None


# -- subscriber -------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PublisherAddress:
    """Where one endpoint's events come from (connect mode) and where to ask for replays."""

    publisher: str
    replay: str | None = None


@dataclass(frozen=True)
class SubscriberSettings:
    """The subscriber's knobs (``kvEvents`` in the config).

    Attributes:
        mode: ``connect`` or ``bind``.
        bind: address of the SUB socket in bind mode.
        publisher_port: connect mode: ``tcp://<endpoint host>:<port>`` for unlisted endpoints.
        replay_port: replay socket port on the endpoint host, when not listed (None = none).
        endpoints: per endpoint address, explicit publisher and replay addresses.
        topic_filter: ZMQ subscription prefix ("" = everything).
        model: model of events whose topic does not name one.
        replay_timeout_s: how long one replay may take.
        catch_up: replay the publisher's buffer on the first message from it.
        reconcile_interval_s: how often connect mode follows the endpoint set.
    """

    mode: str = "connect"
    bind: str = "tcp://0.0.0.0:5557"
    publisher_port: int = 5557
    replay_port: int | None = None
    endpoints: tuple[tuple[str, PublisherAddress], ...] = ()
    topic_filter: str = ""
    model: str = ""
    replay_timeout_s: float = 2.0
    catch_up: bool = True
    reconcile_interval_s: float = 1.0


@dataclass(slots=True)
class _Source:
    """One publisher's delivery state."""

    address: str
    replay: str | None
    last_seq: int | None = None
    model: str | None = None
    replaying: asyncio.Task[None] | None = None
    pending: list[tuple[int, bytes | None]] = field(default_factory=list)
    caught_up: bool = False
    warned_model: bool = False


class KVEventSubscriber:
    """Receives KV events from every endpoint and applies them to the index.

    Args:
        settings: sockets, replay and topic settings.
        store: the endpoints (events for endpoints not in it are dropped).
        index: the index to update.
        metrics: counters for applied, dropped and malformed events, gaps and replays.
    """

    def __init__(
        self,
        settings: SubscriberSettings,
        store: EndpointStore,
        index: KVIndex,
        metrics: PickerMetrics,
    ) -> None:
        if settings.mode not in ("connect", "bind"):
            raise ValueError(f"mode must be connect or bind, got {settings.mode!r}")
        self.settings = settings
        self.store = store
        self.index = index
        self.metrics = metrics
        self._explicit = dict(settings.endpoints)
        self._sources: dict[str, _Source] = {}
        self._receivers: dict[str, asyncio.Task[None]] = {}
        self._context: zmq.asyncio.Context | None = None
        self.messages = 0
        self.bound_address = ""
        m = metrics
        self._applied = {
            kind: m.kv_events_applied.labels(kind) for kind in ("stored", "removed", "cleared")
        }
        self._malformed = m.kv_events_malformed
        self._dropped = m.kv_events_dropped

    # -- addresses ---------------------------------------------------------------------------

    def addresses_of(self, address: str) -> PublisherAddress:
        """The publisher and replay addresses of an endpoint."""
        explicit = self._explicit.get(address)
        if explicit is not None:
            return explicit
        host, _ = split_address(address)
        host = f"[{host}]" if ":" in host else host
        replay_port = self.settings.replay_port
        return PublisherAddress(
            f"tcp://{host}:{self.settings.publisher_port}",
            f"tcp://{host}:{replay_port}" if replay_port else None,
        )

    # -- lifecycle ---------------------------------------------------------------------------

    async def run(self) -> None:
        """Receive until cancelled; never raises because of what arrives."""
        self._context = zmq.asyncio.Context()
        try:
            if self.settings.mode == "bind":
                await self._run_bound()
            else:
                while True:
                    self._reconcile()
                    await asyncio.sleep(self.settings.reconcile_interval_s)
        finally:
            await self._shutdown()

    async def _shutdown(self) -> None:
        tasks = list(self._receivers.values())
        tasks += [s.replaying for s in self._sources.values() if s.replaying is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._receivers.clear()
        if self._context is not None:
            self._context.term()
            self._context = None

    def _socket(self, kind: int) -> zmq.asyncio.Socket:
        if self._context is None:
            raise RuntimeError("the subscriber is not running")
        sock = self._context.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        if kind == zmq.SUB:
            sock.setsockopt(zmq.RCVHWM, 100_000)
            sock.setsockopt(zmq.SUBSCRIBE, self.settings.topic_filter.encode())
        return sock

    def _reconcile(self) -> None:
        wanted = {endpoint.address for endpoint in self.store.all()}
        for address in list(self._receivers):
            if address not in wanted:
                self._receivers.pop(address).cancel()
                source = self._sources.pop(address, None)
                if source is not None and source.replaying is not None:
                    source.replaying.cancel()
        for address in wanted:
            if address not in self._receivers:
                where = self.addresses_of(address)
                self._sources[address] = _Source(address, where.replay)
                self._receivers[address] = asyncio.create_task(
                    self._receive_connected(address, where.publisher),
                    name=f"kv-events-{address}",
                )

    async def _receive_connected(self, address: str, publisher: str) -> None:
        sock = self._socket(zmq.SUB)
        # Connection events: a publisher that went away may come back as a new process whose
        # sequence restarts at 0, and what it published meanwhile is lost either way.
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        poller = zmq.asyncio.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            sock.connect(publisher)
            log.info("KV events of %s from %s", address, publisher)
            count = 0
            while True:
                ready = dict(await poller.poll())
                source = self._sources.get(address)
                if monitor in ready:
                    event = zmq.utils.monitor.parse_monitor_message(await monitor.recv_multipart())
                    if source is not None:
                        self._connection_event(source, event["event"])
                if sock in ready:
                    frames = await sock.recv_multipart()
                    if source is not None:
                        self._receive(source, frames)
                    count += 1
                    if count % _YIELD_EVERY_MESSAGES == 0:
                        await asyncio.sleep(0)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.ETERM:
                log.error("KV-event socket of %s failed: %s", address, exc)
        finally:
            sock.disable_monitor()
            monitor.close(0)
            sock.close(0)

    def _connection_event(self, source: _Source, event: int) -> None:
        """Disconnected: drop what we hold (we miss what it publishes now). Connected: catch up."""
        if event == zmq.EVENT_DISCONNECTED:
            if source.replaying is not None:
                source.replaying.cancel()
                source.replaying = None
                source.pending.clear()
            if source.last_seq is not None:
                self._reset(source, "publisher disconnected")
            source.last_seq = None
            source.caught_up = False
        elif (
            event == zmq.EVENT_CONNECTED
            and source.replay
            and self.settings.catch_up
            and source.replaying is None
            and source.last_seq is None
        ):
            # Ask for the publisher's buffered history now rather than at its next batch.
            source.caught_up = True
            source.pending = []
            source.replaying = asyncio.create_task(
                self._replay(source, 0, "catch_up"), name=f"kv-replay-{source.address}"
            )

    async def _run_bound(self) -> None:
        sock = self._socket(zmq.SUB)
        try:
            sock.bind(self.settings.bind)
            self.bound_address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            log.info("KV events: SUB socket bound at %s", self.bound_address)
            count = 0
            while True:
                frames = await sock.recv_multipart()
                source = self._source_from_topic(frames[0] if frames else b"")
                if source is None:
                    if len(frames) == 3:
                        self._dropped.labels("unknown_endpoint").inc()
                    else:
                        self._malformed.inc()
                else:
                    self._receive(source, frames)
                count += 1
                if count % _YIELD_EVERY_MESSAGES == 0:
                    await asyncio.sleep(0)
        finally:
            sock.close(0)

    def _source_from_topic(self, topic: bytes) -> _Source | None:
        named, _ = parse_topic(topic)
        if named is None:
            return None
        endpoint = self.store.by_address.get(named)
        if endpoint is None:  # llm-d's convention allows the bare pod IP
            matches = [e for e in self.store.all() if e.host == named]
            endpoint = matches[0] if len(matches) == 1 else None
        if endpoint is None:
            return None
        source = self._sources.get(endpoint.address)
        if source is None:
            source = _Source(endpoint.address, self.addresses_of(endpoint.address).replay)
            self._sources[endpoint.address] = source
        return source

    # -- delivery ---------------------------------------------------------------------------

    def _receive(self, source: _Source, frames: Sequence[bytes]) -> None:
        """One live message: check the sequence, apply, never raise."""
        self.messages += 1
        try:
            if len(frames) != 3:
                raise MalformedMessage(f"expected 3 frames, got {len(frames)}")
            seq = decode_seq(frames[1])
            _, model = parse_topic(frames[0])
            if model:
                source.model = model
        except MalformedMessage as exc:
            self._malformed.inc()
            log.debug("malformed KV-event message from %s: %s", source.address, exc)
            return
        self.deliver(source, seq, frames[2])

    def deliver(self, source: _Source, seq: int, payload: bytes | None) -> None:
        """Sequence checks, gap handling and application of one message (``None``: lost)."""
        if source.replaying is not None:
            if len(source.pending) >= _MAX_PENDING_MESSAGES:
                # The replay takes too long to keep up: give it up, start over from here.
                source.replaying.cancel()
                source.replaying = None
                source.pending.clear()
                self._reset(source, "replay_backlog")
            else:
                source.pending.append((seq, payload))
                return
        last = source.last_seq
        if last is None:
            if seq > 0 and source.replay and self.settings.catch_up and not source.caught_up:
                source.caught_up = True
                self._start_replay(source, 0, seq, payload, "catch_up")
                return
        elif seq == last + 1:
            pass
        elif seq > last + 1:
            self.metrics.kv_event_sequence_gaps.labels("gap").inc()
            if source.replay:
                self._start_replay(source, last + 1, seq, payload, "gap")
                return
            self._reset(source, "gap")
        else:
            self.metrics.kv_event_sequence_gaps.labels("restart").inc()
            log.info(
                "KV-event publisher of %s restarted (seq %d after %d)", source.address, seq, last
            )
            self._reset(source, "restart")
        source.last_seq = seq
        if payload is not None:
            self._apply(source, payload)

    def _reset(self, source: _Source, why: str) -> None:
        endpoint = self.store.by_address.get(source.address)
        if endpoint is not None:
            dropped = self.index.clear_endpoint(endpoint.id)
            log.info("KV index: dropped %d blocks of %s (%s)", dropped, source.address, why)

    def _apply(self, source: _Source, payload: bytes) -> None:
        try:
            batch = decode_payload(payload)
        except MalformedMessage as exc:
            self._malformed.inc()
            log.debug("malformed KV-event payload from %s: %s", source.address, exc)
            return
        endpoint = self.store.by_address.get(source.address)
        if endpoint is None:
            self._dropped.labels("unknown_endpoint").inc(len(batch.events))
            return
        model = source.model or self.settings.model
        if not model and not source.warned_model:
            source.warned_model = True
            log.warning(
                "KV events of %s name no model (topic kv@<endpoint>@<model>) and kvEvents.model "
                "is not set: its blocks will not match requests",
                source.address,
            )
        index = self.index
        endpoint_id = endpoint.id
        try:
            for event in batch.events:
                if type(event) is BlockStored:
                    index.apply_stored(endpoint_id, event, model)
                    self._applied["stored"].inc(len(event.block_hashes))
                elif type(event) is BlockRemoved:
                    index.apply_removed(endpoint_id, event)
                    self._applied["removed"].inc(len(event.block_hashes))
                else:
                    index.clear_endpoint(endpoint_id)
                    self._applied["cleared"].inc()
        except Exception:  # a bug in applying one batch must not end the subscriber
            log.exception("applying KV events of %s failed", source.address)
            self._malformed.inc()

    # -- replay -----------------------------------------------------------------------------

    def _start_replay(
        self, source: _Source, start_seq: int, seq: int, payload: bytes | None, why: str
    ) -> None:
        source.pending = [(seq, payload)]
        source.replaying = asyncio.create_task(
            self._replay(source, start_seq, why), name=f"kv-replay-{source.address}"
        )

    async def _replay(self, source: _Source, start_seq: int, why: str) -> None:
        applied = 0
        failed = False
        try:
            async with asyncio.timeout(self.settings.replay_timeout_s):
                async for topic, seq, payload in self.fetch_replay(source.replay or "", start_seq):
                    _, model = parse_topic(topic)
                    if model:
                        source.model = model
                    if seq < start_seq:
                        continue
                    if not applied and seq > start_seq and why == "gap":
                        # The publisher's buffer no longer has the start of the gap.
                        self._reset(source, "gap beyond the replay buffer")
                    last = source.last_seq
                    if last is not None and seq <= last:
                        continue
                    source.last_seq = seq
                    if payload:
                        self._apply(source, payload)
                    applied += 1
        except (TimeoutError, zmq.ZMQError, MalformedMessage) as exc:
            log.warning("KV-event replay from %s failed: %s", source.replay, exc or type(exc))
            failed = True
        except Exception:
            log.exception("KV-event replay from %s failed", source.replay)
            failed = True
        if why == "gap" and not applied:
            failed = True  # nothing to repair the gap with
        self.metrics.kv_event_replays.labels(why, "failed" if failed else "ok").inc()
        pending, source.pending = source.pending, []
        source.replaying = None
        if failed and why == "gap":
            self._reset(source, "replay failed")
            # Start over from the first message that arrived meanwhile.
            source.last_seq = pending[0][0] - 1 if pending else None
        for pending_seq, pending_payload in pending:
            last = source.last_seq
            if last is not None and pending_seq <= last:
                continue  # the replay delivered it already
            self.deliver(source, pending_seq, pending_payload)

    async def fetch_replay(
        self, replay_address: str, start_seq: int
    ) -> AsyncIterator[tuple[bytes, int, bytes]]:
        """Yield (topic, seq, payload) from an endpoint's replay socket from ``start_seq``.

        Replies without a topic frame (vLLM before 0.26) give an empty topic.

        Raises:
            MalformedMessage: a reply that does not follow the protocol.
            zmq.ZMQError: socket errors.
        """
        sock = self._socket(zmq.DEALER)
        try:
            sock.connect(replay_address)
            await sock.send_multipart([b"", start_seq.to_bytes(8, "big")])
            while True:
                frames = await sock.recv_multipart()
                # [b"", seq, payload] (older vLLM) or [b"", topic, seq, payload] (newer).
                if len(frames) not in (3, 4) or frames[0] != b"":
                    raise MalformedMessage("unexpected replay reply")
                seq_frame, payload = frames[-2], frames[-1]
                if seq_frame == END_SEQ:
                    return
                yield (frames[1] if len(frames) == 4 else b""), decode_seq(seq_frame), payload
        finally:
            sock.close(0)


# -- wiring -------------------------------------------------------------------------------------


def build_kv_index(
    config: PickerConfig, store: EndpointStore, metrics: PickerMetrics
) -> KVIndex | None:
    """The precise index a config asks for (None when nothing would feed or read it)."""
    settings = config.index
    if config.kv_events is None and settings.backend != "redis":
        return None
    dropped = metrics.kv_events_dropped

    def on_drop(reason: str, blocks: int) -> None:
        dropped.labels(reason).inc(blocks)

    event_keys = EventKeys(
        settings.block_size_tokens, settings.keys, settings.hash_algo, settings.hash_seed, on_drop
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
        )
    else:
        index = KVBlockIndex(
            event_keys,
            default_capacity_blocks=settings.capacity_blocks_per_endpoint,
            max_blocks=settings.max_blocks,
            capacity_source=store.num_gpu_blocks,
        )
    store.on_removed(index.remove_endpoint)
    return index


def build_subscriber(
    config: PickerConfig,
    store: EndpointStore,
    index: KVIndex | None,
    metrics: PickerMetrics,
) -> KVEventSubscriber | None:
    """The subscriber of the config's ``kvEvents`` section (None without one)."""
    events = config.kv_events
    if events is None or index is None:
        return None
    settings = SubscriberSettings(
        mode=events.mode,
        bind=events.bind,
        publisher_port=events.publisher_port,
        replay_port=events.replay_port,
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
