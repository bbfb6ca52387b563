"""The director: from a complete request to a pick, and the in-flight accounting around it.

It owns no protocol: ``handlers/`` speaks ext_proc and calls these methods; the benchmark
harness and ``kv-picker explain`` call them too.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Awaitable, Mapping
from typing import Any

from kv_picker.admission import Admission
from kv_picker.config import PickerConfig
from kv_picker.errors import InternalError, NoEndpointsError, PickerError, SaturatedError
from kv_picker.handlers.body import parse_request
from kv_picker.metrics import PickerMetrics
from kv_picker.scheduling.scheduler import Scheduler
from kv_picker.scheduling.signals import uncached_prompt_tokens
from kv_picker.scheduling.types import LLMRequest, Prepare, SchedulingResult
from kv_picker.state.endpoints import Endpoint, EndpointStore
from kv_picker.wire import SUBSET_KEY, SUBSET_NAMESPACE

log = logging.getLogger(__name__)


class Director:
    """Candidates, scheduling and in-flight accounting.

    Args:
        config: the validated config (models, body limit).
        store: endpoint state.
        scheduler: built plugins; replaced whole by :meth:`swap` on reload.
        rng: seeded generator for body-less requests.
        metrics: exported metrics.
    """

    def __init__(
        self,
        config: PickerConfig,
        store: EndpointStore,
        scheduler: Scheduler,
        rng: random.Random,
        metrics: PickerMetrics,
    ) -> None:
        self.config = config
        self.store = store
        self.scheduler = scheduler
        self.rng = rng
        self.metrics = metrics
        self.admission = Admission(config.admission, store, config.metrics.staleness_s)
        self._preparers: list[Prepare] = []
        self._preparers_of: Scheduler | None = None

    def swap(self, config: PickerConfig, scheduler: Scheduler) -> None:
        """Adopt a new config; requests already scheduled keep their picks."""
        self.config = config
        self.scheduler = scheduler
        self.admission = Admission(config.admission, self.store, config.metrics.staleness_s)

    @property
    def max_body_bytes(self) -> int:
        return self.config.server.max_body_bytes

    def candidates(self, metadata: Mapping[str, Any] | None) -> list[Endpoint]:
        """Ready endpoints, narrowed to the gateway's subset hint when one is given.

        Raises:
            NoEndpointsError: no ready endpoint, or none in the subset (503).
        """
        ready = self.store.ready_endpoints()
        subset = _subset_hint(metadata)
        if subset is not None:
            ready = [e for e in ready if e.address in subset or e.host in subset]
            if not ready:
                raise NoEndpointsError("no ready endpoint in the gateway's endpoint subset")
        if not ready:
            raise NoEndpointsError("no ready endpoint in the pool")
        return list(ready)

    def pick_bodyless(self, metadata: Mapping[str, Any] | None) -> Endpoint:
        """A request without a body (GET and the like) goes to a random ready endpoint."""
        candidates = self.candidates(metadata)
        return candidates[self.rng.randrange(len(candidates))]

    def parse(self, body: bytes, headers: Mapping[str, str]) -> LLMRequest:
        return parse_request(body, headers, self.config.models)

    def prepare(self, request: LLMRequest) -> Awaitable[None] | None:
        """Async work plugins need before :meth:`schedule`, or None when there is none.

        The caller awaits the result (if any), then schedules; see ``types.Prepare``. It never
        raises: a plugin that could not prepare gives no signal for this request.
        """
        scheduler = self.scheduler
        if self._preparers_of is not scheduler:
            self._preparers = [p for p in scheduler.plugins.values() if isinstance(p, Prepare)]
            self._preparers_of = scheduler
        pending: list[Awaitable[None]] | None = None
        for plugin in self._preparers:
            try:
                awaitable = plugin.prepare(request)
            except Exception:
                log.exception("prepare of plugin %r failed", plugin.name)
                continue
            if awaitable is not None:
                if pending is None:
                    pending = []
                pending.append(awaitable)
        return None if pending is None else _await_all(pending)

    def schedule(
        self,
        request: LLMRequest,
        metadata: Mapping[str, Any] | None,
        explain: bool = False,
        record: bool = True,
    ) -> SchedulingResult:
        """Run the scheduler for a parsed request.

        Args:
            request: the parsed request.
            metadata: the stream's filter metadata (subset hint).
            explain: keep every scorer's scores in the result.
            record: count the decision in metrics and run post-pick hooks (index updates);
                False for a dry run that must leave no trace.

        Raises:
            PickerError: no endpoints (503), all filtered out (429), or an internal error.
        """
        candidates = self.candidates(metadata)
        try:
            saturation = self.admission.admit(request, candidates)
        except SaturatedError:
            if record:
                self.metrics.admission.labels("shed").inc()
            raise
        if record:
            if saturation is not None:
                self.metrics.pool_saturation.set(saturation)
            self.metrics.admission.labels(
                "admitted" if request.priority >= 0 else "admitted-sheddable"
            ).inc()
        try:
            result = self.scheduler.schedule(request, candidates, explain, record)
        except PickerError:
            raise
        except Exception as exc:  # a plugin bug must not take the stream down
            raise InternalError(f"scheduling failed: {type(exc).__name__}: {exc}") from exc
        if not result.primary.targets:
            raise InternalError("the picker returned no endpoint")
        return result

    def response_headers(self, request: LLMRequest, endpoint: Endpoint) -> list[tuple[str, str]]:
        """Headers the plugins add to the response for ``request`` served by ``endpoint``."""
        try:
            return self.scheduler.response_headers(request, endpoint)
        except Exception:  # a plugin bug must not break a response already under way
            log.exception("response header plugin failed")
            return []

    def begin_prefill(
        self, request: LLMRequest, endpoint: Endpoint, prefill_endpoint: Endpoint | None
    ) -> tuple[Endpoint, float]:
        """Count the request's uncached prompt as queued prefill work where it will run.

        Under P/D the prefill endpoint computes the prompt; otherwise the destination does.
        Returns what :meth:`end_prefill` takes once the prefill is over.
        """
        target = prefill_endpoint or endpoint
        tokens = uncached_prompt_tokens(request, target.id)
        self.store.add_prefill(target.id, tokens)
        return target, tokens

    def end_prefill(self, endpoint: Endpoint, tokens: float) -> None:
        if self.store.get(endpoint.id) is endpoint:
            self.store.prefill_done(endpoint.id, tokens)

    def begin(self, endpoint: Endpoint) -> None:
        self.store.in_flight[endpoint.id] += 1

    def finish(self, endpoint: Endpoint) -> None:
        # The endpoint may have left the pool (and its id been reused) meanwhile.
        if self.store.get(endpoint.id) is endpoint and self.store.in_flight[endpoint.id] > 0:
            self.store.in_flight[endpoint.id] -= 1


async def _await_all(pending: list[Awaitable[None]]) -> None:
    for awaitable in pending:
        try:
            await awaitable
        except Exception:
            log.exception("preparing a request failed: scheduling without that signal")


def _subset_hint(metadata: Mapping[str, Any] | None) -> frozenset[str] | None:
    """The ``envoy.lb.subset_hint`` list, or None when the gateway sent none.

    Entries are ``ip:port`` (matched exactly) or a bare IP (matched on the host). A comma
    list in one string is accepted too.
    """
    if not metadata:
        return None
    namespace = metadata.get(SUBSET_NAMESPACE)
    if not isinstance(namespace, Mapping) or SUBSET_KEY not in namespace:
        return None
    value = namespace[SUBSET_KEY]
    items = value.split(",") if isinstance(value, str) else value
    subset: set[str] = set()
    if isinstance(items, list | tuple):
        subset.update(item.strip() for item in items if isinstance(item, str) and item.strip())
    return frozenset(subset)
