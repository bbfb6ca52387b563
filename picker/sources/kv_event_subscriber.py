"""The KV-event subscriber: sockets, sequence tracking and replay, into the precise index.

Delivery is what makes the index trustworthy, so it lives apart from the wire format
(:mod:`kv_picker.sources.kv_event_decoder`, which turns bytes into event records) and from the
index (any :class:`~kv_picker.state.kv_index.KVIndex`, which applies them).

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

Malformed messages are counted and dropped, never an exception out of the subscriber.

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
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio
import zmq.utils.monitor

from kv_picker.endpoint import Endpoint, split_address
from kv_picker.metrics import PickerMetrics
from kv_picker.sources.kv_event_decoder import (
    END_SEQ,
    MalformedMessage,
    decode_payload,
    decode_seq,
    parse_topic,
)
from kv_picker.state.block_events import DROP_NOT_HELD, BlockRemoved, BlockStored
from kv_picker.state.endpoints import EndpointStore
from kv_picker.state.kv_index import KVIndex

log = logging.getLogger(__name__)

_YIELD_EVERY_MESSAGES = 32
_MAX_PENDING_MESSAGES = 10_000


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
        data_parallel_base_port: the serving port of data-parallel rank 0 (None: no ranks).
            An unlisted endpoint ``host:port`` with ``port > base`` is rank ``port - base``,
            whose publisher and replay ports vLLM offsets by the rank.
        endpoints: per endpoint address, explicit publisher and replay addresses.
        topic_filter: ZMQ subscription prefix ("" = everything).
        model: model of events whose topic does not name one.
        replay_timeout_s: how long one replay may take.
        catch_up: replay the publisher's buffer on the first message from it.
        reconcile_interval_s: how often connect mode checks the endpoint set when the store
            reported no change (changes are followed at once).
    """

    mode: str = "connect"
    bind: str = "tcp://0.0.0.0:5557"
    publisher_port: int = 5557
    replay_port: int | None = None
    data_parallel_base_port: int | None = None
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
        # The endpoint each receiver was started for: a new endpoint at the same address (a
        # pod re-created with a reused IP) is a new publisher with a sequence of its own.
        self._receiving_for: dict[str, Endpoint] = {}
        self._changed = asyncio.Event()
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
        host, port = split_address(address)
        host = f"[{host}]" if ":" in host else host
        settings = self.settings
        base = settings.data_parallel_base_port
        # vLLM gives data-parallel rank r its own publisher at the configured port + r (and
        # replay socket at the replay port + r); with one serving port per rank, the rank is
        # the endpoint's port offset from rank 0's.
        rank = port - base if base is not None and port > base else 0
        replay_port = settings.replay_port
        return PublisherAddress(
            f"tcp://{host}:{settings.publisher_port + rank}",
            f"tcp://{host}:{replay_port + rank}" if replay_port else None,
        )

    # -- lifecycle ---------------------------------------------------------------------------

    async def run(self) -> None:
        """Receive until cancelled; never raises because of what arrives."""
        self._context = zmq.asyncio.Context()
        try:
            if self.settings.mode == "bind":
                await self._run_bound()
            else:
                # Follow the endpoint set as it changes (discovery adds and removes endpoints
                # at any time), with a slow poll as a safety net.
                subscription = self.store.on_change(self._endpoints_changed)
                try:
                    while True:
                        self._changed.clear()
                        self._reconcile()
                        with contextlib.suppress(TimeoutError):
                            async with asyncio.timeout(self.settings.reconcile_interval_s):
                                await self._changed.wait()
                finally:
                    subscription.cancel()
        finally:
            await self._shutdown()

    def _endpoints_changed(self, added: Sequence[Endpoint], removed: Sequence[Endpoint]) -> None:
        self._changed.set()

    async def _shutdown(self) -> None:
        tasks = list(self._receivers.values())
        tasks += [s.replaying for s in self._sources.values() if s.replaying is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._receivers.clear()
        self._receiving_for.clear()
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
        """One receiver per endpoint in the store: start the missing, stop those whose
        endpoint left or was replaced by a new instance."""
        wanted = {endpoint.address: endpoint for endpoint in self.store.all()}
        for address in list(self._receivers):
            if wanted.get(address) is not self._receiving_for.get(address):
                self._receivers.pop(address).cancel()
                self._receiving_for.pop(address, None)
                source = self._sources.pop(address, None)
                if source is not None and source.replaying is not None:
                    source.replaying.cancel()
        for address, endpoint in wanted.items():
            if address not in self._receivers:
                where = self.addresses_of(address)
                self._sources[address] = _Source(address, where.replay)
                self._receiving_for[address] = endpoint
                self._receivers[address] = asyncio.create_task(
                    self._receive_connected(address, where.publisher),
                    name=f"kv-events-{address}",
                )

    def receiving(self) -> dict[str, str]:
        """Per endpoint address, the publisher its receiver is connected to (connect mode)."""
        return {address: self.addresses_of(address).publisher for address in self._receivers}

    async def _receive_connected(self, address: str, publisher: str) -> None:
        sock = self._socket(zmq.SUB)
        # Connection events: a publisher that went away may come back as a new process whose
        # sequence restarts at 0, and what it published meanwhile is lost either way.
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        poller = zmq.asyncio.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        # Messages are read through a blocking-free shadow of the socket, as many as are
        # queued at each wake-up: two awaits per message cost more than applying it.
        shadow: zmq.Socket[Any] = zmq.Socket.shadow(sock.underlying)
        try:
            sock.connect(publisher)
            log.info("KV events of %s from %s", address, publisher)
            while True:
                ready = dict(await poller.poll())
                if monitor in ready:
                    event = zmq.utils.monitor.parse_monitor_message(await monitor.recv_multipart())
                    source = self._sources.get(address)
                    if source is not None:
                        self._connection_event(source, event["event"])
                if sock in ready:
                    while self._drain(shadow, lambda _: self._sources.get(address)):
                        await asyncio.sleep(0)  # more queued: let the loop run first
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
            shadow: zmq.Socket[Any] = zmq.Socket.shadow(sock.underlying)
            while True:
                await sock.poll()
                while self._drain(shadow, self._bound_source):
                    await asyncio.sleep(0)  # more queued: let the loop run first
        finally:
            sock.close(0)

    def _drain(
        self, sock: zmq.Socket[Any], source_of: Callable[[Sequence[bytes]], _Source | None]
    ) -> bool:
        """Receive and apply up to ``_YIELD_EVERY_MESSAGES`` queued messages without waiting;
        True when that many came (more may be queued)."""
        for _ in range(_YIELD_EVERY_MESSAGES):
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return False
            source = source_of(frames)
            if source is not None:
                self._receive(source, frames)
        return True

    def _bound_source(self, frames: Sequence[bytes]) -> _Source | None:
        """Bind mode: the message's endpoint, from its topic (counted when there is none)."""
        source = self._source_from_topic(frames[0] if frames else b"")
        if source is None:
            if len(frames) == 3:
                self._dropped.labels("unknown_endpoint").inc()
            else:
                self._malformed.inc()
        return source

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
        # Counted as applied: what the index took (stored events' dropped blocks are counted
        # by reason where the keys are computed; removals of blocks not held here).
        stored = removed = not_held = 0
        try:
            for event in batch.events:
                if type(event) is BlockStored:
                    stored += index.apply_stored(endpoint_id, event, model)
                elif type(event) is BlockRemoved:
                    hit = index.apply_removed(endpoint_id, event)
                    removed += hit
                    not_held += len(event.block_hashes) - hit
                else:
                    index.clear_endpoint(endpoint_id)
                    self._applied["cleared"].inc()
        except Exception:  # a bug in applying one batch must not end the subscriber
            log.exception("applying KV events of %s failed", source.address)
            self._malformed.inc()
        if stored:
            self._applied["stored"].inc(stored)
        if removed:
            self._applied["removed"].inc(removed)
        if not_held:
            self._dropped.labels(DROP_NOT_HELD).inc(not_held)

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
