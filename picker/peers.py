"""What one worker process's picks change, sent to the others (``kv-picker serve --workers N``).

Each worker schedules the streams the kernel hands it (one ext_proc port, SO_REUSEPORT), so
every signal the picker makes itself would split N ways without this: the approximate prefix
index and the speculative holders (what each endpoint was just sent), the in-flight counts and
the queued prefill work.

```
worker i ──PUB ipc://<dir>/peer-i.sock──> SUB of every other worker

frame (msgpack, one ZMQ frame per event-loop turn): [i, incarnation, [message, ...]]
  pick      [0, destination, prefill | None, prompt tokens, prefill tokens, prefill pairs,
             [[plugin name, keys], ...], request serial | None]
                (in flight at a separate prefill endpoint too; the serial with one)
  take      [1, destination]                                   (a request without a body)
  release   [2, destination, prompt tokens]                    (the request finished)
  prefilled [3, prefill target, tokens, pairs, separate]       (its first byte came back;
             separate: the target was a prefill endpoint, where it was in flight too)
  snapshot  [4, {address: [in flight, in-flight tokens, prefill tokens, prefill requests,
             prefill pairs]}]                                            (every 0.5 s)
  scraped   [5, address, waiting, running, KV usage, block size, GPU blocks, LoRA | None,
             first tokens | None]
  failed    [6, address, reason]                                  (a scrape of the endpoint)
  ask state [7]                          (a worker started again, once it knows its endpoints)
  landed    [8, request serial]  (a disaggregated request's prompt reached its destination)

state (two frames): [i, incarnation, "state", asker, asker's incarnation], {plugin: {address:
  [key, ...] oldest first}}        (sent by the live worker of lowest index to the one that asked)
```

A worker started again (after a crash) would otherwise hold nothing of what earlier picks taught
the plugins (the approximate index): it asks, and one peer answers with a copy.

Scrapes are shared too: each worker scrapes every endpoint N times less often and sends what it
read, so the endpoints see one picker's scrape rate and a worker that dies only slows the
scrapes down. KV events need no exchange: every worker subscribes to every endpoint.

Endpoints are named by address (ids are each worker's own). A receiving worker applies a delta
to its :class:`~kv_picker.state.endpoints.EndpointStore` at once, and keeps every peer's
running totals: a snapshot replaces a peer's totals, and each snapshot (or a peer falling
silent for ``timeout_s``, or coming back with a new incarnation) sets every endpoint's counts
to its own plus its live peers'. So a lost message, a late joiner (ZMQ drops what a
subscriber was not connected for) or a crashed worker heals within a snapshot period or the
timeout, and no count survives the worker that made it.

The messages of one event-loop turn leave together, in one non-blocking send (a PUB socket
drops rather than blocks when a peer is slow). Each other worker decodes them and applies them;
a pick costs it about what the pick cost its own worker to record.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import zmq

from kv_picker.endpoint import Endpoint
from kv_picker.scheduling.framework import PeerPick
from kv_picker.sources.scrape_process import decode_signals, encode_signals
from kv_picker.sources.scraper import EndpointSignals
from kv_picker.state.endpoints import EndpointStore

log = logging.getLogger(__name__)

PICK, TAKE, RELEASE, PREFILLED, SNAPSHOT, SCRAPED, SCRAPE_FAILED, STATE_REQUEST, LANDED = range(9)
STATE = "state"  # the header of a two-frame message: another worker's learned state
# Per address: in flight, in-flight (prompt) tokens, prefill tokens, prefill requests, pairs.
_FIELDS = 5
_MAX_BATCH = 1000  # messages applied per loop callback before yielding to the loop


def socket_path(directory: str | Path, index: int) -> Path:
    """Where worker ``index`` publishes."""
    return Path(directory) / f"peer-{index}.sock"


@dataclass
class _Peer:
    worker: int
    incarnation: int
    last_seen_s: float
    totals: dict[str, list[float]] = field(default_factory=dict)


class PeerSync:
    """One worker's side of the exchange (see the module docstring).

    Args:
        store: this worker's endpoint store.
        records: where another worker's pick records go, with the pick in this worker's
            endpoint ids (the current scheduler's ``record_peer_picks``, looked up at each
            message so a reload is followed).
        directory: the supervisor's private run directory (the sockets live there).
        index: this worker's index, ``0 <= index < count``.
        count: the number of workers.
        heartbeat_s: how often this worker sends its snapshot.
        timeout_s: a peer silent this long has its counts dropped.
        clock: monotonic clock in seconds.
    """

    def __init__(
        self,
        store: EndpointStore,
        records: Callable[[Sequence[tuple[str, Sequence[int]]], PeerPick], None],
        directory: str | Path,
        index: int,
        count: int,
        heartbeat_s: float = 0.5,
        timeout_s: float = 3.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 <= index < count:
            raise ValueError(f"worker index {index} out of range for {count} workers")
        self.store = store
        self.records = records
        self.directory = Path(directory)
        self.index = index
        self.count = count
        self.heartbeat_s = heartbeat_s
        self.timeout_s = timeout_s
        self._clock = clock
        self.incarnation = int.from_bytes(os.urandom(4), "big")
        self.local: dict[str, list[float]] = {}
        self.peers: dict[int, _Peer] = {}
        self.sent = 0
        self.dropped = 0
        self.received = 0
        self.malformed = 0
        self._context: zmq.Context[Any] | None = None
        self._pub: zmq.Socket[Any] | None = None
        self._sub: zmq.Socket[Any] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._fd = -1
        self._packer = msgpack.Packer()
        self._outbox: list[list[Any]] = []
        # Where another worker's scrape results go: (address, signals or None, failure reason).
        self.on_scrape: Callable[[str, EndpointSignals | None, str], None] | None = None
        # Where another worker's landed disaggregated requests go (the PeerPick.landing of
        # their picks): the current scheduler's ``peer_prompt_landed``.
        self.on_landed: Callable[[str], None] | None = None
        # The plugins' learned state, for a worker started again (see the module docstring):
        # export() -> {plugin: {address: keys}}; load(that) -> keys learned.
        self.export_state: Callable[[], dict[str, dict[str, list[int]]]] | None = None
        self.load_state: Callable[[dict[str, dict[str, list[int]]]], int] | None = None
        self.state_learned: int | None = None  # keys learned from a peer's copy, once one came

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> None:
        """Bind this worker's socket and connect to every other (they may not exist yet: ZMQ
        connects when they bind). Call from the event loop that will apply messages."""
        context = self._context = zmq.Context()
        pub = self._pub = context.socket(zmq.PUB)
        pub.setsockopt(zmq.LINGER, 0)
        pub.setsockopt(zmq.SNDHWM, 100_000)
        path = socket_path(self.directory, self.index)
        path.unlink(missing_ok=True)  # a previous incarnation's
        pub.bind(f"ipc://{path}")
        sub = self._sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.RCVHWM, 100_000)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        for other in range(self.count):
            if other != self.index:
                sub.connect(f"ipc://{socket_path(self.directory, other)}")
        loop = self._loop = asyncio.get_running_loop()
        self._fd = int(sub.getsockopt(zmq.FD))
        loop.add_reader(self._fd, self._drain)
        loop.call_soon(self._drain)  # the FD is edge-triggered: look once now

    async def run(self) -> None:
        """Send snapshots and expire silent peers, until cancelled."""
        while True:
            await asyncio.sleep(self.heartbeat_s)
            self._send([SNAPSHOT, self.local])
            now = self._clock()
            gone = [w for w, peer in self.peers.items() if now - peer.last_seen_s > self.timeout_s]
            for worker in gone:
                log.warning("worker %d silent for %.1f s: its counts are dropped", worker,
                            now - self.peers[worker].last_seen_s)  # fmt: skip
                del self.peers[worker]
            if gone:
                self.reconcile()

    def close(self) -> None:
        if self._loop is not None and self._sub is not None:
            self._loop.remove_reader(self._fd)
        for sock in (self._pub, self._sub):
            if sock is not None:
                sock.close(0)
        if self._context is not None:
            self._context.term()
        self._pub = self._sub = self._context = None

    # -- this worker's changes (the director calls these) -----------------------------------

    def picked(
        self,
        destination: Endpoint,
        prefill: Endpoint | None,
        prompt_tokens: float,
        prefill_tokens: float,
        pairs: float,
        records: Sequence[tuple[str, Sequence[int]]],
        serial: int | None = None,
    ) -> None:
        """A request was routed: in flight at ``destination`` (and at ``prefill``), prefill
        queued at ``prefill`` (or the destination), and the plugins' pick records. With a
        separate ``prefill`` endpoint, the request's ``serial`` names the :meth:`landed` to
        come."""
        _add(self.local, destination.address, 1, prompt_tokens, 0, 0, 0)
        target = prefill or destination
        _add(self.local, target.address,
             *_prefill_delta(prefill_tokens, pairs, prefill is not None))  # fmt: skip
        self._send([PICK, destination.address, prefill.address if prefill is not None else None,
                    prompt_tokens, prefill_tokens, pairs, records,
                    serial if prefill is not None else None])  # fmt: skip

    def took(self, destination: Endpoint) -> None:
        """A request without a body was routed to ``destination``."""
        _add(self.local, destination.address, 1, 0, 0, 0, 0)
        self._send([TAKE, destination.address])

    def released(self, destination: Endpoint, prompt_tokens: float) -> None:
        """A request routed to ``destination`` finished."""
        _add(self.local, destination.address, -1, -prompt_tokens, 0, 0, 0)
        self._send([RELEASE, destination.address, prompt_tokens])

    def prefilled(self, target: Endpoint, tokens: float, pairs: float, separate: bool) -> None:
        """A request's prefill at ``target`` finished (``separate``: a prefill endpoint, where
        the request was in flight too)."""
        _add(self.local, target.address, *_prefilled_delta(tokens, pairs, separate))
        self._send([PREFILLED, target.address, tokens, pairs, separate])

    def landed(self, serial: int) -> None:
        """A disaggregated request's prompt (its :meth:`picked` named ``serial``) reached its
        destination: the other workers' plugins record that the destination holds it."""
        self._send([LANDED, serial])

    def scraped(self, endpoint: Endpoint, signals: EndpointSignals | None, reason: str) -> None:
        """This worker scraped ``endpoint`` (``signals`` None: the scrape failed)."""
        if signals is None:
            self._send([SCRAPE_FAILED, endpoint.address, reason])
        else:
            self._send([SCRAPED, *encode_signals(endpoint.address, signals)])

    def _send(self, message: list[Any]) -> None:
        if self._pub is None or self._loop is None:
            return
        self._outbox.append(message)
        if len(self._outbox) == 1:  # the first of this turn: send them all at its end
            self._loop.call_soon(self._flush)

    def _flush(self) -> None:
        messages, self._outbox = self._outbox, []
        pub = self._pub
        if pub is None or not messages:
            return
        try:
            pub.send(self._packer.pack([self.index, self.incarnation, messages]), zmq.NOBLOCK)
            self.sent += len(messages)
        except zmq.Again:  # a PUB socket drops at its high-water mark: the snapshot heals
            self.dropped += len(messages)

    # -- the other workers' changes ---------------------------------------------------------

    async def fetch_state(self, attempts: int = 3, wait_s: float = 1.0) -> int | None:
        """Ask the other workers for a copy of their learned state, up to ``attempts`` times;
        returns the keys learned (None: no copy came, e.g. every worker started empty)."""
        for _ in range(attempts):
            if self.state_learned is not None:
                break
            self._send([STATE_REQUEST])
            deadline = self._clock() + wait_s
            while self.state_learned is None and self._clock() < deadline:
                await asyncio.sleep(0.02)
        return self.state_learned

    def _answer_state(self, asker: int, incarnation: int) -> None:
        """Send a copy of the learned state to a worker that asked, when this worker is the
        live one of lowest index (so that one answers)."""
        if self.export_state is None or self._pub is None:
            return
        now = self._clock()
        alive = [w for w, peer in self.peers.items()
                 if w != asker and now - peer.last_seen_s <= self.timeout_s]  # fmt: skip
        if min([self.index, *alive]) != self.index:
            return
        states = self.export_state()  # empty ones too: the asker then stops waiting
        header = self._packer.pack([self.index, self.incarnation, STATE, asker, incarnation])
        try:
            self._pub.send_multipart([header, msgpack.packb(states)], zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1
        else:
            log.info("sent worker %d a copy of the learned state (%d keys)", asker,
                     sum(len(keys) for state in states.values() for keys in state.values()))  # fmt: skip

    def apply_state(self, header: bytes, payload: bytes) -> None:
        """A copy of another worker's learned state: loaded when it was meant for this one."""
        try:
            _, _, kind, asker, incarnation = msgpack.unpackb(header)
            if kind != STATE:
                raise ValueError(f"a two-frame message must be a state, not {kind!r}")
            if asker != self.index or incarnation != self.incarnation:
                return  # another worker's copy
            if self.state_learned is not None or self.load_state is None:
                return
            states = msgpack.unpackb(payload, strict_map_key=False)
            if not isinstance(states, dict):
                raise ValueError("a state is {plugin: {address: [key, ...]}}")
            checked = {
                _name(name): {_address(a): _ints(keys) for a, keys in state.items()}
                for name, state in states.items()
            }
        except Exception as exc:
            self._malformed(exc)
            return
        self.state_learned = self.load_state(checked)
        log.info("learned %d keys from another worker's copy", self.state_learned)

    def _drain(self) -> None:
        sub = self._sub
        if sub is None:
            return
        for _ in range(_MAX_BATCH):
            try:
                frames = sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) == 1:
                self.apply(frames[0])
            elif len(frames) == 2:
                self.apply_state(frames[0], frames[1])
            else:
                self._malformed(ValueError(f"{len(frames)} frames"))
        if self._loop is not None:  # more waiting: let other callbacks run first
            self._loop.call_soon(self._drain)

    def apply(self, data: bytes) -> None:
        """Apply one frame from another worker. A malformed message is counted and dropped,
        having changed nothing; the frame's other messages still apply."""
        try:
            frame = msgpack.unpackb(data, use_list=True, strict_map_key=False)
            if not isinstance(frame, list) or len(frame) != 3 or not isinstance(frame[2], list):
                raise ValueError("a frame is [worker, incarnation, [message, ...]]")
            worker, incarnation = _ints(frame[:2], 2)
        except Exception as exc:
            self._malformed(exc)
            return
        if worker == self.index and incarnation == self.incarnation:
            return
        peer = self._peer(worker, incarnation)
        for message in frame[2]:
            try:
                self._apply_message(peer, message)
            except Exception as exc:  # only our own workers write here; never stop applying
                self._malformed(exc)
                continue
            self.received += 1

    def _apply_message(self, peer: _Peer, message: list[Any]) -> None:
        kind = message[0]
        if kind == PICK and len(message) == 8:
            destination = _address(message[1])
            prefill = _address(message[2]) if message[2] is not None else None
            prompt_tokens, prefill_tokens, pairs = _numbers(message[3:6])
            records = [(_name(name), _ints(keys)) for name, keys in message[6]]
            landing = _landing(peer, message[7]) if message[7] is not None else None
            self._apply(peer, destination, (1, prompt_tokens, 0, 0, 0))
            delta = _prefill_delta(prefill_tokens, pairs, prefill is not None)
            self._apply(peer, prefill or destination, delta)
            by_address = self.store.by_address
            target = by_address.get(prefill or destination)
            if target is not None:
                # Decayed, not a total: a restarted worker's share fades rather than reconciles.
                self.store.add_recent_prefill(target.id, prefill_tokens, pairs)
            held = by_address.get(destination)
            computing = by_address.get(prefill) if prefill is not None else None
            pick = PeerPick(held.id if held is not None else None,
                            computing.id if computing is not None else None, landing)  # fmt: skip
            if pick.ids and records:
                self.records(records, pick)
        elif kind == LANDED and len(message) == 2:
            landing = _landing(peer, message[1])
            if self.on_landed is not None:
                self.on_landed(landing)
        elif kind == TAKE and len(message) == 2:
            self._apply(peer, _address(message[1]), (1, 0, 0, 0, 0))
        elif kind == RELEASE and len(message) == 3:
            (tokens,) = _numbers(message[2:])
            self._apply(peer, _address(message[1]), (-1, -tokens, 0, 0, 0))
        elif kind == PREFILLED and len(message) == 5:
            tokens, pairs = _numbers(message[2:4])
            separate = _bool(message[4])
            self._apply(peer, _address(message[1]), _prefilled_delta(tokens, pairs, separate))
        elif kind == SCRAPED and len(message) == 9:
            signals = decode_signals(message[1:])
            if self.on_scrape is not None:
                self.on_scrape(_address(message[1]), signals, "")
        elif kind == SCRAPE_FAILED and len(message) == 3:
            if self.on_scrape is not None:
                self.on_scrape(_address(message[1]), None, str(message[2]))
        elif kind == STATE_REQUEST and len(message) == 1:
            self._answer_state(peer.worker, peer.incarnation)
        elif kind == SNAPSHOT and len(message) == 2 and isinstance(message[1], dict):
            peer.totals = {_address(a): _numbers(v, _FIELDS) for a, v in message[1].items()}
            self.reconcile()
        else:
            raise ValueError(f"unknown message kind {kind!r} or length {len(message)}")

    def _malformed(self, exc: Exception) -> None:
        self.malformed += 1
        if self.malformed == 1 or self.malformed % 1000 == 0:
            log.warning("malformed message from a worker (%d so far): %r", self.malformed, exc)

    def _peer(self, worker: int, incarnation: int) -> _Peer:
        peer = self.peers.get(worker)
        now = self._clock()
        if peer is None or peer.incarnation != incarnation:
            if peer is not None:
                log.info("worker %d restarted: its earlier counts are dropped", worker)
            peer = self.peers[worker] = _Peer(worker, incarnation, now)
            self.reconcile()
        peer.last_seen_s = now
        return peer

    def _apply(self, peer: _Peer, address: str, delta: Sequence[float]) -> None:
        _add(peer.totals, address, *delta)
        endpoint = self.store.by_address.get(address)
        if endpoint is not None:
            _shift(self.store, endpoint.id, delta)

    def reconcile(self) -> None:
        """Set every endpoint's counts to this worker's own plus its live peers'."""
        store = self.store
        sources = [self.local, *(peer.totals for peer in self.peers.values())]
        for address, endpoint in store.by_address.items():
            sums = [0.0] * _FIELDS
            for totals in sources:
                values = totals.get(address)
                if values is not None:
                    for i in range(_FIELDS):
                        sums[i] += values[i]
            i = endpoint.id
            store.in_flight[i] = max(0, round(sums[0]))
            store.in_flight_tokens[i] = max(0.0, sums[1])
            store.prefill_tokens[i] = max(0.0, sums[2])
            store.prefill_requests[i] = max(0, round(sums[3]))
            store.prefill_pairs[i] = max(0.0, sums[4])
        # Totals of endpoints that are gone and settled need not be kept or sent.
        for totals in sources:
            for address in [a for a, v in totals.items() if a not in store.by_address
                            and not any(v)]:  # fmt: skip
                del totals[address]


def _address(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"an address must be a string, not {type(value).__name__}")
    return value


def _landing(peer: _Peer, serial: object) -> str:
    """A peer's request, named apart from this worker's requests and another peer's."""
    if type(serial) is not int:
        raise TypeError(f"a request serial must be an integer, not {type(serial).__name__}")
    return f"{peer.worker}/{peer.incarnation}/{serial}"


def _name(value: object) -> str:
    if not isinstance(value, str):
        raise TypeError(f"a plugin name must be a string, not {type(value).__name__}")
    return value


def _ints(values: object, length: int | None = None) -> list[int]:
    if not isinstance(values, list) or (length is not None and len(values) != length):
        raise TypeError("expected a list of integers")
    for value in values:
        if type(value) is not int:
            raise TypeError(f"expected an integer, not {type(value).__name__}")
    return values


def _numbers(values: object, length: int | None = None) -> list[float]:
    if not isinstance(values, list) or (length is not None and len(values) != length):
        raise TypeError("expected a list of numbers")
    out = []
    for value in values:
        if type(value) not in (int, float) or not math.isfinite(value):
            raise TypeError(f"expected a finite number, not {value!r}")
        out.append(float(value))
    return out


def _prefill_delta(tokens: float, pairs: float, separate: bool) -> list[float]:
    """A pick's change where its prompt is computed: the queued prefill work, and at a
    ``separate`` prefill endpoint the request in flight (its prompt tokens count in flight at
    the destination only, as the director counts them)."""
    return [1 if separate else 0, 0, tokens, 1, pairs]


def _prefilled_delta(tokens: float, pairs: float, separate: bool) -> list[float]:
    """The reverse of :func:`_prefill_delta` once the prompt is processed."""
    return [-value for value in _prefill_delta(tokens, pairs, separate)]


def _bool(value: object) -> bool:
    if type(value) is not bool:
        raise TypeError(f"expected a boolean, not {value!r}")
    return value


def _add(totals: dict[str, list[float]], address: str, *delta: float) -> None:
    values = totals.get(address)
    if values is None:
        values = totals[address] = [0.0] * _FIELDS
    for i in range(_FIELDS):
        values[i] += delta[i]
    if not any(values):
        del totals[address]


def _shift(store: EndpointStore, i: int, delta: Sequence[float]) -> None:
    store.in_flight[i] = max(0, store.in_flight[i] + int(delta[0]))
    store.in_flight_tokens[i] = max(0.0, store.in_flight_tokens[i] + delta[1])
    store.prefill_tokens[i] = max(0.0, store.prefill_tokens[i] + delta[2])
    store.prefill_requests[i] = max(0, store.prefill_requests[i] + int(delta[3]))
    store.prefill_pairs[i] = max(0.0, store.prefill_pairs[i] + delta[4])
