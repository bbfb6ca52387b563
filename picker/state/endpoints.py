"""Endpoint store: dense integer ids and per-endpoint signals in preallocated arrays.

Why arrays: scorers read one signal for every candidate on every request, and the scraper
writes them in place in the background. A list indexed by a dense id is the cheapest shape for
both, and swapping nothing means the request path never sees a half-updated structure.

```
id:        0          1          2   ...   (ids of removed endpoints are reused)
endpoints: Endpoint   Endpoint   None
waiting:   3          0          0          vllm:num_requests_waiting
running:   12         4          0          vllm:num_requests_running
kv_usage:  0.41       0.07       0.0        vllm:kv_cache_usage_perc, [0,1]
lora:      LoraState  None       None       vllm:lora_requests_info
in_flight: 2          0          0          requests routed here and not yet finished (at a
                                            prefill endpoint under P/D: until the first byte)
prefill_tokens: 5200.0  0.0     0.0        uncached prompt tokens sent here whose prefill has
                                            not finished (no response byte yet): queued work
prefill_requests: 1     0       0          how many requests those tokens belong to
scraped_prefill_requests: 1 0   0          prefill_requests when the last scrape was recorded
                                            (the own requests the scraped waiting can count)
prefill_pairs: 2.6e7  0.0       0.0        their attention work: sum of n * (c + n / 2) over those
                                            requests (n uncached tokens after c cached ones)
prefill_head_s: 1230.2 -1.0    -1.0       monotonic time since which the oldest of those requests
                                            has been at the head of the endpoint's queue: when
                                            the queue last became non-empty or a prefill ended
                                            (-1: none queued)
in_flight_tokens: 9100.0 0.0    0.0        prompt tokens of the requests in flight (the KV their
                                            decode steps read; a prefill endpoint's: none)
picked_s:  [1230.1, 1233.9] []  []         monotonic times this picker picked the endpoint for
                                            the requests of its own still in flight there,
                                            oldest first (a P/D prefill leg's: not kept)
recent_tokens: 31000.0 0.0      0.0        uncached prompt tokens sent here to be computed, each
                                            decayed by exp(-age / 30 s) (read with recent_prefill)
recent_pairs:  4.1e8  0.0       0.0        their attention work, decayed the same way
first_tokens: 812.0  40.0       -1.0       requests the endpoint has given a first token, as
                                            its last scrape says (the count of vLLM's
                                            vllm:time_to_first_token_seconds; -1: not exported)
scraped_s: 1234.5     1234.5     0.0        monotonic time of the last good scrape
ready:     True       True       False      last scrape succeeded
```

Besides the arrays, ``prefill_samples`` keeps the last ``PREFILL_SAMPLES`` prefills this picker
saw end with a first response byte, of at least ``prefill_sample_min_tokens`` uncached tokens
each (``PREFILL_SAMPLE_MIN_TOKENS`` unless a reader lowers it): the endpoint, the tokens, their
attention work, the seconds from the request's reaching the head of the queue
(``prefill_head_s``) to that byte, and the prompt tokens then in flight there.
``prefill_sample_count`` counts every sample ever kept, so a reader can tell when they changed.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kv_picker.endpoint import Endpoint, EndpointId, EndpointSpec, split_address

PREFILL_SAMPLES = 64
"""How many observed prefills :attr:`EndpointStore.prefill_samples` keeps."""

PREFILL_SAMPLE_MIN_TOKENS = 4096
"""The fewest uncached tokens an observed prefill has to be kept as a sample: below it the
engine's step overhead and scheduling make most of the time, not the prompt's compute."""


@dataclass(slots=True, frozen=True)
class PrefillSample:
    """One prefill this picker saw end: where, its work, and how long it took at the head of
    the queue."""

    endpoint: Endpoint
    tokens: float
    pairs: float
    seconds: float
    in_flight_tokens: float = 0.0
    """The prompt tokens in flight on the endpoint when it ended: the KV its engine's steps
    read meanwhile, so a reader can tell the steps' time from the prompt's compute."""
    ended_s: float = 0.0
    """When it ended (the store's clock): prefills an engine finished in one step end
    together, the later ones timed at about nothing since the first."""
    queued: int = 1
    """The prefills this picker had queued on the endpoint when it ended, itself included:
    with others behind it, the engine's steps also computed their chunks meanwhile."""


@dataclass(slots=True, frozen=True)
class LoraState:
    """An endpoint's LoRA adapters, from ``vllm:lora_requests_info``."""

    running: frozenset[str]
    waiting: frozenset[str]
    max_lora: int


class Subscription:
    """A callback registered with the store; ``cancel()`` removes it."""

    __slots__ = ("_callback", "_callbacks")

    def __init__(self, callbacks: list[Any], callback: object) -> None:
        self._callbacks: list[Any] | None = callbacks
        self._callback = callback

    def cancel(self) -> None:
        callbacks, self._callbacks = self._callbacks, None
        if callbacks is not None:
            for i, registered in enumerate(callbacks):
                if registered is self._callback:
                    del callbacks[i]
                    break


RECENT_WORK_TIME_CONSTANT_S = 30.0
"""Time constant of :attr:`EndpointStore.recent_tokens`: work sent a minute ago counts 0.14."""

REQUEST_AVERAGE_WEIGHT = 0.05
"""Weight of the newest request in :attr:`EndpointStore.request_s` (about the last 20)."""

MembershipCallback = Callable[[Sequence[Endpoint], Sequence[Endpoint]], None]
"""``callback(added, removed)``: endpoints that joined and left the store in one change."""


class EndpointStore:
    """All endpoints and their signals; owned by the event loop thread.

    Args:
        clock: monotonic clock in seconds (injected for tests).
    """

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self.endpoints: list[Endpoint | None] = []
        self.by_address: dict[str, Endpoint] = {}
        self.waiting: list[float] = []
        self.running: list[float] = []
        self.kv_usage: list[float] = []
        self.in_flight: list[int] = []
        self.prefill_tokens: list[float] = []
        self.prefill_requests: list[int] = []
        # prefill_requests as of the last good scrape: which of the scraped waiting requests
        # can be this picker's own stays fixed until the next scrape, like the count itself.
        self.scraped_prefill_requests: list[int] = []
        self.prefill_pairs: list[float] = []
        self.prefill_head_s: list[float] = []
        self.in_flight_tokens: list[float] = []
        # Prefill work sent here lately, decayed (see recent_prefill) as of recent_s.
        self.recent_tokens: list[float] = []
        self.recent_pairs: list[float] = []
        self.recent_s: list[float] = []
        # Seconds from the pick to the end of the response, a moving average over the requests
        # this picker saw answered by the endpoint (0: none yet): how long a request holds one
        # of the engine's sequence slots, at most.
        self.request_s: list[float] = []
        # When this picker picked each endpoint for the requests still in flight there, oldest
        # first (the main endpoint of each; other workers' picks are not here).
        self.picked_s: list[list[float]] = []
        self.scraped_s: list[float] = []
        self.first_tokens: list[float] = []
        self.ready: list[bool] = []
        self.block_size_tokens: list[int] = []
        self.num_gpu_blocks: list[int] = []
        self.lora: list[LoraState | None] = []
        self.prefill_samples: deque[PrefillSample] = deque(maxlen=PREFILL_SAMPLES)
        # A reader may lower it (predicted-latency-scorer's calibrationMinTokens).
        self.prefill_sample_min_tokens: float = PREFILL_SAMPLE_MIN_TOKENS
        self.prefill_sample_count = 0
        self._free_ids: list[EndpointId] = []
        self._on_removed: list[Callable[[EndpointId], None]] = []
        self._on_change: list[MembershipCallback] = []
        self._on_first_tokens: list[Callable[[EndpointId, float], None]] = []
        # The ready list is rebuilt only when readiness or membership changes.
        self._ready_cache: list[Endpoint] | None = None

    def on_removed(self, callback: Callable[[EndpointId], None]) -> Subscription:
        """Register a callback run when an endpoint leaves (to drop its index entries).

        Returns:
            A handle whose ``cancel()`` unregisters the callback (idempotent).
        """
        self._on_removed.append(callback)
        return Subscription(self._on_removed, callback)

    def on_change(self, callback: MembershipCallback) -> Subscription:
        """Register a callback run after each :meth:`set_endpoints` that added or removed
        endpoints, once per call, with the endpoints that joined and those that left.

        It runs after every :meth:`on_removed` callback, when the store already holds the new
        set: subscribers that follow the set (KV-event sockets, per-endpoint metric series)
        act on the change at once rather than at their next poll.

        Returns:
            A handle whose ``cancel()`` unregisters the callback (idempotent).
        """
        self._on_change.append(callback)
        return Subscription(self._on_change, callback)

    def on_first_tokens(self, callback: Callable[[EndpointId, float], None]) -> Subscription:
        """Register a callback run on each good scrape that reports the endpoint's first-token
        count, with how many first tokens it gave since the previous such scrape (0 on the
        first, and after the count went down: the server restarted).

        It runs before the scrape's own-request snapshot (``scraped_prefill_requests``) is
        taken, so prefills it ends are no longer this picker's queued requests in that scrape.

        Returns:
            A handle whose ``cancel()`` unregisters the callback (idempotent).
        """
        self._on_first_tokens.append(callback)
        return Subscription(self._on_first_tokens, callback)

    def num_subscribers(self) -> int:
        """Callbacks registered with :meth:`on_removed` (a reload must not grow this)."""
        return len(self._on_removed)

    def now(self) -> float:
        return self._clock()

    def set_endpoints(self, specs: Iterable[EndpointSpec]) -> None:
        """Make the store hold exactly these endpoints, keeping ids of those that stay.

        An endpoint stays when its address and instance are unchanged (its labels are
        updated); a new instance at a known address replaces the endpoint (see
        :class:`~kv_picker.endpoint.EndpointSpec`). Requests already routed to a removed
        endpoint keep their :class:`~kv_picker.endpoint.Endpoint` and finish; only new picks
        no longer see it.
        """
        wanted = {spec.address: spec for spec in specs}
        removed: list[Endpoint] = []
        for address, endpoint in list(self.by_address.items()):
            spec = wanted.get(address)
            if spec is None or spec.instance != endpoint.instance:
                self._remove(endpoint)
                removed.append(endpoint)
        added: list[Endpoint] = []
        for address, spec in wanted.items():
            existing = self.by_address.get(address)
            if existing is not None:
                existing.labels = dict(spec.labels)
                continue
            added.append(self._add(spec))
        self._ready_cache = None
        if added or removed:
            for callback in list(self._on_change):
                callback(added, removed)

    def _add(self, spec: EndpointSpec) -> Endpoint:
        host, port = split_address(spec.address)
        if self._free_ids:
            endpoint_id = self._free_ids.pop()
        else:
            endpoint_id = EndpointId(len(self.endpoints))
            self.endpoints.append(None)
            for floats in (self.waiting, self.running, self.kv_usage, self.scraped_s):
                floats.append(0.0)
            self.first_tokens.append(-1.0)
            self.in_flight.append(0)
            self.prefill_tokens.append(0.0)
            self.prefill_requests.append(0)
            self.scraped_prefill_requests.append(0)
            self.prefill_pairs.append(0.0)
            self.prefill_head_s.append(-1.0)
            self.in_flight_tokens.append(0.0)
            self.recent_tokens.append(0.0)
            self.recent_pairs.append(0.0)
            self.recent_s.append(0.0)
            self.request_s.append(0.0)
            self.picked_s.append([])
            self.ready.append(False)
            self.block_size_tokens.append(0)
            self.num_gpu_blocks.append(0)
            self.lora.append(None)
        endpoint = Endpoint(endpoint_id, spec.address, host, port, dict(spec.labels), spec.instance)
        self.endpoints[endpoint_id] = endpoint
        self.by_address[spec.address] = endpoint
        self.waiting[endpoint_id] = 0.0
        self.running[endpoint_id] = 0.0
        self.kv_usage[endpoint_id] = 0.0
        self.scraped_s[endpoint_id] = 0.0
        self.first_tokens[endpoint_id] = -1.0
        self.in_flight[endpoint_id] = 0
        self.prefill_tokens[endpoint_id] = 0.0
        self.prefill_requests[endpoint_id] = 0
        self.scraped_prefill_requests[endpoint_id] = 0
        self.prefill_pairs[endpoint_id] = 0.0
        self.prefill_head_s[endpoint_id] = -1.0
        self.in_flight_tokens[endpoint_id] = 0.0
        self.recent_tokens[endpoint_id] = 0.0
        self.recent_pairs[endpoint_id] = 0.0
        self.recent_s[endpoint_id] = 0.0
        self.request_s[endpoint_id] = 0.0
        self.picked_s[endpoint_id] = []
        self.ready[endpoint_id] = False
        self.block_size_tokens[endpoint_id] = 0
        self.num_gpu_blocks[endpoint_id] = 0
        self.lora[endpoint_id] = None
        return endpoint

    def _remove(self, endpoint: Endpoint) -> None:
        del self.by_address[endpoint.address]
        self.endpoints[endpoint.id] = None
        self.ready[endpoint.id] = False
        self._free_ids.append(endpoint.id)
        for callback in self._on_removed:
            callback(endpoint.id)

    def all(self) -> list[Endpoint]:
        return [e for e in self.endpoints if e is not None]

    def ready_endpoints(self) -> list[Endpoint]:
        """Endpoints whose last scrape succeeded. The list is shared: do not mutate it."""
        cached = self._ready_cache
        if cached is None:
            cached = [e for e in self.endpoints if e is not None and self.ready[e.id]]
            self._ready_cache = cached
        return cached

    def set_ready(self, endpoint_id: EndpointId, ready: bool) -> None:
        if self.ready[endpoint_id] != ready:
            self.ready[endpoint_id] = ready
            self._ready_cache = None

    def update_metrics(
        self,
        endpoint_id: EndpointId,
        *,
        waiting: float,
        running: float,
        kv_usage: float,
        block_size_tokens: int = 0,
        num_gpu_blocks: int = 0,
        lora: LoraState | None = None,
        first_tokens: float | None = None,
    ) -> None:
        """Record one good scrape; marks the endpoint ready.

        ``first_tokens``: the endpoint's count of requests given a first token (None: it
        exports none); its growth is passed to the :meth:`on_first_tokens` callbacks.
        """
        if first_tokens is None or not math.isfinite(first_tokens):  # NaN or Inf: no count
            self.first_tokens[endpoint_id] = -1.0
        else:
            previous = self.first_tokens[endpoint_id]
            self.first_tokens[endpoint_id] = first_tokens
            count = first_tokens - previous if 0.0 <= previous <= first_tokens else 0.0
            for callback in self._on_first_tokens:
                callback(endpoint_id, count)
        self.lora[endpoint_id] = lora
        self.waiting[endpoint_id] = waiting
        self.running[endpoint_id] = running
        self.kv_usage[endpoint_id] = min(max(kv_usage, 0.0), 1.0)
        if block_size_tokens:
            self.block_size_tokens[endpoint_id] = block_size_tokens
        if num_gpu_blocks:
            self.num_gpu_blocks[endpoint_id] = num_gpu_blocks
        self.scraped_prefill_requests[endpoint_id] = self.prefill_requests[endpoint_id]
        self.scraped_s[endpoint_id] = self._clock()
        self.set_ready(endpoint_id, True)

    def add_prefill(self, endpoint_id: EndpointId, tokens: float, pairs: float = 0.0) -> None:
        """Count one request's prefill work sent to an endpoint: ``tokens`` uncached tokens,
        ``pairs`` their attention work (see the module docstring)."""
        now = self._clock()
        if not self.prefill_requests[endpoint_id]:
            self.prefill_head_s[endpoint_id] = now
        self.prefill_tokens[endpoint_id] += tokens
        self.prefill_requests[endpoint_id] += 1
        self.prefill_pairs[endpoint_id] += pairs
        self.add_recent_prefill(endpoint_id, tokens, pairs, now)

    def add_recent_prefill(
        self, endpoint_id: EndpointId, tokens: float, pairs: float, now: float | None = None
    ) -> None:
        """Count prefill work sent to an endpoint in its recent work only (another worker's
        pick: its queued work arrives through the workers' exchange, see ``peers``). ``now``
        (default: the store's clock) lets a caller that has read the clock pass it on."""
        if now is None:
            now = self._clock()
        keep = self._recent_keep(endpoint_id, now)
        self.recent_tokens[endpoint_id] = self.recent_tokens[endpoint_id] * keep + tokens
        self.recent_pairs[endpoint_id] = self.recent_pairs[endpoint_id] * keep + pairs
        self.recent_s[endpoint_id] = now

    def recent_prefill(
        self, endpoint_id: EndpointId, now: float | None = None
    ) -> tuple[float, float]:
        """The uncached tokens and attention work sent to an endpoint for prefill, each pick's
        decayed by ``exp(-age / RECENT_WORK_TIME_CONSTANT_S)``: the rate of work its contexts
        bring lately, about 30 s of it. Unlike the queued work it stays after the prefill ends,
        so it tells an endpoint whose sessions will come back from one that is idle. ``now``
        (default: the store's clock) lets a caller that reads many endpoints read the clock
        once."""
        keep = self._recent_keep(endpoint_id, now)
        return self.recent_tokens[endpoint_id] * keep, self.recent_pairs[endpoint_id] * keep

    def _recent_keep(self, endpoint_id: EndpointId, now: float | None = None) -> float:
        if not self.recent_tokens[endpoint_id] and not self.recent_pairs[endpoint_id]:
            return 0.0
        if now is None:
            now = self._clock()
        age = max(0.0, now - self.recent_s[endpoint_id])
        return math.exp(-age / RECENT_WORK_TIME_CONSTANT_S)

    def prefill_done(
        self, endpoint_id: EndpointId, tokens: float, pairs: float = 0.0, observed: bool = False
    ) -> None:
        """That request's prefill finished (first response byte, or the request ended).

        ``observed``: the picker saw its first byte now, so the time since it reached the head
        of the queue is its prefill's (kept in :attr:`prefill_samples` when it computed at
        least ``prefill_sample_min_tokens`` tokens). The engine serves its queue in order, so the
        request that ends is the one at the head."""
        head_s = self.prefill_head_s[endpoint_id]
        if observed and head_s >= 0.0 and tokens >= self.prefill_sample_min_tokens:
            endpoint = self.endpoints[endpoint_id]
            if endpoint is not None:
                now = self._clock()
                self.prefill_samples.append(
                    PrefillSample(
                        endpoint,
                        tokens,
                        pairs,
                        max(0.0, now - head_s),
                        self.in_flight_tokens[endpoint_id],
                        now,
                        self.prefill_requests[endpoint_id],
                    )
                )
                self.prefill_sample_count += 1
        self.prefill_tokens[endpoint_id] = max(0.0, self.prefill_tokens[endpoint_id] - tokens)
        self.prefill_requests[endpoint_id] = max(0, self.prefill_requests[endpoint_id] - 1)
        self.prefill_pairs[endpoint_id] = max(0.0, self.prefill_pairs[endpoint_id] - pairs)
        # The engine serves its queue in order: the next request is at the head from now.
        self.prefill_head_s[endpoint_id] = (
            self._clock() if self.prefill_requests[endpoint_id] else -1.0
        )

    def request_done(self, endpoint_id: EndpointId, seconds: float) -> None:
        """A request the endpoint answered took ``seconds`` from the pick to the response's
        end."""
        previous = self.request_s[endpoint_id]
        if previous <= 0.0:
            self.request_s[endpoint_id] = seconds
        else:
            self.request_s[endpoint_id] = previous + REQUEST_AVERAGE_WEIGHT * (seconds - previous)

    def get(self, endpoint_id: EndpointId) -> Endpoint | None:
        return self.endpoints[endpoint_id]

    def __len__(self) -> int:
        return len(self.by_address)
