"""Admission: a request's priority, the pool's saturation, and shedding.

Priority (higher is more important; negative means sheddable), first match wins:

1. the objective named in ``x-llm-d-inference-objective`` (or its older alias
   ``x-gateway-inference-objective``), looked up in the config's ``objectives``;
2. an integer in the ``admission.priorityHeader`` header (default ``x-kv-picker-priority``);
3. the ``priority`` of the requested model in ``models``;
4. 0.

Saturation of the candidate endpoints (the GIE utilization detector's formula):

```
saturation = mean over endpoints of max(waiting / queueDepthThreshold, kv_usage / kvCacheUtilThreshold)
```

with an endpoint whose metrics are older than ``metricsStalenessThreshold`` counted as 1.0
(unknown load is treated as full, so a fleet-wide scrape failure sheds rather than piles on).
A sheddable request is refused with 429 when saturation >= 1; requests with priority >= 0 are
always admitted.

The picker's own backlog: ``maxPendingRequests`` (512; 0 = no bound) requests may wait between
their headers and their pick (bodies arriving, parsing, scheduling). A request that arrives when
that many wait gets 503 ``overloaded`` at once, before its body is read: past what one process
can schedule, answering fast keeps the latency of the admitted requests bounded instead of
letting every request queue behind all the others.

The wait before the picker sees a request: a backlog forms mostly where the pending count cannot
see it, in gRPC's buffers and the event loop's ready queue, before a stream's headers reach the
handler. So the gateway stamps each request as it arrives (the generated Envoy configs set
``x-request-start: t=<microseconds since the epoch>`` from ``%START_TIME%``, overwriting any
client value), and :class:`QueueDelayGate` sheds on the time that stamp says the request waited,
with the rule of CoDel as used for server queues: while there is no standing queue a request
may have waited up to ``queueDelayInterval`` (100 ms; a burst drains); once even the smallest
wait over an interval exceeds ``queueDelayTarget`` (off by default; 5 ms is CoDel's published
target), a request that waited longer than the
target gets 503 ``overloaded`` at its headers, before its body is read, until an interval's
smallest wait is under half the target (the queue drained). Admitted requests then wait about
the target at most before the picker sees them, and the ones shed cost the picker one message
each (which is not nothing: see the README's overload figures).

Clocks: the wait is the stamp's age less the smallest age seen over the last minute, so a
gateway whose clock is ahead or behind the picker's by any constant does not shift the
threshold (a steady overload longer than that minute raises the floor by at most the smallest
wait the gate lets through). Without the header (a gateway that does not stamp) the gate is off.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Annotated

from kv_picker.decode import INTERNAL, Check, Duration, Positive, Range, key
from kv_picker.endpoint import Endpoint
from kv_picker.errors import BadRequestError, SaturatedError
from kv_picker.request import LLMRequest
from kv_picker.state.endpoints import EndpointStore
from kv_picker.wire import OBJECTIVE_HEADERS


def _header_name(name: str) -> bool:
    return bool(name) and name == name.lower()


@dataclass(frozen=True)
class AdmissionConfig:
    """The ``admission`` section, plus the priorities ``objectives`` and ``models`` give."""

    queue_depth_threshold: Annotated[float, Positive] = 5.0
    kv_cache_util_threshold: Annotated[float, Range(gt=0, le=1)] = field(
        default=0.8, metadata=key("kvCacheUtilThreshold")
    )
    # None: the metrics section's staleness bound.
    staleness_s: Annotated[Duration, Positive] | None = field(
        default=None, metadata=key("metricsStalenessThreshold")
    )
    priority_header: Annotated[str, Check(_header_name, "must be a lower-case header name")] = (
        "x-kv-picker-priority"
    )
    max_pending_requests: Annotated[int, Range(ge=0)] = 512
    # 0 (the default) turns the queue-delay gate off: it sheds under CPU contention too.
    queue_delay_target_s: Annotated[Duration, Range(ge=0)] = field(
        default=0.0, metadata=key("queueDelayTarget")
    )
    queue_delay_interval_s: Annotated[Duration, Positive] = field(
        default=0.1, metadata=key("queueDelayInterval")
    )
    request_start_header: Annotated[
        str, Check(_header_name, "must be a lower-case header name")
    ] = "x-request-start"
    objectives: Mapping[str, int] = field(default_factory=dict, metadata=INTERNAL)
    model_priorities: Mapping[str, int] = field(default_factory=dict, metadata=INTERNAL)


class Admission:
    """Decides priority and whether a sheddable request may enter."""

    def __init__(
        self, config: AdmissionConfig, store: EndpointStore, default_staleness_s: float
    ) -> None:
        self.config = config
        self.store = store
        self.staleness_s = config.staleness_s or default_staleness_s

    def priority(self, request: LLMRequest) -> int:
        """The request's priority (see the module docstring for the order).

        Raises:
            BadRequestError: the priority header is not an integer.
        """
        headers = request.headers
        for header in OBJECTIVE_HEADERS:
            objective = headers.get(header)
            if objective and objective in self.config.objectives:
                return self.config.objectives[objective]
        raw = headers.get(self.config.priority_header)
        if raw:
            try:
                return int(raw.strip())
            except ValueError:
                raise BadRequestError(
                    f"header {self.config.priority_header} must be an integer, got {raw!r}"
                ) from None
        return self.config.model_priorities.get(request.model, 0)

    def saturation(self, candidates: Sequence[Endpoint]) -> float:
        """Mean per-endpoint saturation in [0, inf); no candidates counts as saturated."""
        if not candidates:
            return 1.0
        store, config = self.store, self.config
        oldest_fresh_s = store.now() - self.staleness_s
        total = 0.0
        for endpoint in candidates:
            i = endpoint.id
            if store.scraped_s[i] < oldest_fresh_s:
                total += 1.0
                continue
            total += max(
                store.waiting[i] / config.queue_depth_threshold,
                store.kv_usage[i] / config.kv_cache_util_threshold,
            )
        return total / len(candidates)

    def admit(self, request: LLMRequest, candidates: Sequence[Endpoint]) -> float | None:
        """Set the request's priority; shed it if sheddable and the pool is saturated.

        Returns:
            The saturation when it was computed (sheddable requests), else None.

        Raises:
            SaturatedError: a sheddable request while saturation >= 1 (429).
        """
        request.priority = self.priority(request)
        if request.priority >= 0:
            return None
        saturation = self.saturation(candidates)
        if saturation >= 1.0:
            raise SaturatedError(
                f"system saturated (saturation {saturation:.2f}), sheddable request dropped "
                f"(priority {request.priority})"
            )
        return saturation


def parse_request_start(value: str) -> float | None:
    """Seconds since the epoch from an ``x-request-start`` value, or None if it is not one.

    Accepted: ``t=`` followed by a number, or the number alone, in microseconds, milliseconds or
    seconds (told apart by size, as load balancers and APM agents that use this header do).
    """
    text = value.strip()
    if text.startswith("t="):
        text = text[2:]
    if not text or len(text) > 32:
        return None
    try:
        number = float(text)
    except ValueError:
        return None
    if not math.isfinite(number) or number <= 0:
        return None
    if number > 1e14:
        return number / 1e6
    if number > 1e11:
        return number / 1e3
    return number


class QueueDelayGate:
    """Sheds requests that waited too long before the picker saw them (see the module docstring).

    Sans I/O: ``now_s`` is passed in (wall-clock seconds, the clock the gateway's stamp uses).
    """

    _BASE_BUCKET_S = 30.0  # the clock-offset floor is the minimum over two such buckets

    def __init__(self) -> None:
        self.overloaded = False  # the last complete interval had a standing queue
        self._window_end_s = 0.0
        self._window_min_s = math.inf
        self._base_bucket_end_s = 0.0
        self._base_current_s = math.inf
        self._base_previous_s = math.inf

    def wait_s(self, started_s: float, now_s: float) -> float:
        """How long a request stamped at ``started_s`` waited, clock offset removed (>= 0)."""
        age = now_s - started_s
        if now_s >= self._base_bucket_end_s:
            recent = now_s < self._base_bucket_end_s + self._BASE_BUCKET_S
            self._base_previous_s = self._base_current_s if recent else math.inf
            self._base_current_s = math.inf
            self._base_bucket_end_s = now_s + self._BASE_BUCKET_S
        if age < self._base_current_s:
            self._base_current_s = age
        return age - min(self._base_current_s, self._base_previous_s)

    def admit(self, wait_s: float, now_s: float, target_s: float, interval_s: float) -> bool:
        """Whether a request that waited ``wait_s`` may enter."""
        if now_s >= self._window_end_s:
            # The interval that ended had a standing queue when even its smallest wait was
            # long; the queue is gone when one wait was well under the target (half of it), and
            # in between the state holds. The gap keeps a queue held near the target from
            # counting as drained, which would let the next interval's waits grow to its end.
            smallest = self._window_min_s
            if now_s >= self._window_end_s + interval_s or smallest < target_s / 2:
                self.overloaded = False  # (an idle gap says nothing about now)
            elif smallest > target_s:
                self.overloaded = True
            self._window_min_s = math.inf
            self._window_end_s = now_s + interval_s
        if wait_s < self._window_min_s:
            self._window_min_s = wait_s
        return wait_s <= (target_s if self.overloaded else interval_s)
