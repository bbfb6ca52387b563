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
"""

from __future__ import annotations

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
