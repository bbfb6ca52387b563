"""The director owns a request's life in the picker, from the parsed body to the end of its
response, whoever drives it: the ext_proc handler, the Admin API's dry run, or the benchmark
harness's offline simulator.

```
parse(body, headers) ─> LLMRequest
prepare(request)     ─> awaitable | None      plugins' async work (tokenize, fetch)
route(request, metadata) ─> RoutedRequest     candidates → admission → schedule → the pick:
   │                                          in-flight slot taken, queued prefill counted
   │                                          (P/D: in flight at the prefill endpoint too)
   ├── first_byte()                           the prompt has been processed: prefill done
   │     (or, when the gateway shows no response body: no_first_byte(), and the prefill ends
   │      when the endpoint's scraped first-token count says so); P/D: its KV has reached the
   │      destination, and the plugins that wait for that learn it (PromptLanded)
   └── finish(output_tokens)                  the response ended: slot released (once), the
                                              request log's row queued (with a request log)
```

Nothing here speaks a protocol: ``handlers/`` maps :class:`~kv_picker.errors.PickerError` to
HTTP responses, and only it knows Envoy.
"""

from __future__ import annotations

import bisect
import logging
import math
import random
from collections import deque
from collections.abc import Awaitable, Mapping
from typing import Any

from kv_picker.admission import Admission, QueueDelayGate
from kv_picker.config import PickerConfig
from kv_picker.endpoint import Endpoint, EndpointId
from kv_picker.errors import InternalError, NoEndpointsError, PickerError, SaturatedError
from kv_picker.handlers.body import parse_request
from kv_picker.metrics import PickerMetrics
from kv_picker.peers import PeerSync
from kv_picker.request import LLMRequest
from kv_picker.request_log import LoggedRequest, RequestLog
from kv_picker.scheduling.framework import SchedulingResult
from kv_picker.scheduling.scheduler import Scheduler
from kv_picker.scheduling.signals import cached_tokens, prompt_tokens
from kv_picker.state.endpoints import EndpointStore
from kv_picker.tracing import RequestTrace, RequestTracer
from kv_picker.wire import SUBSET_KEY, SUBSET_NAMESPACE

log = logging.getLogger(__name__)

# The picker's share of an endpoint's first tokens is measured over about this long.
FIRST_TOKEN_SHARE_TIME_CONSTANT_S = 30.0
# Below this many first tokens (decayed) counted there, the share is taken as whole.
FIRST_TOKEN_SHARE_MIN_COUNT = 8.0
# A blind request's prefill ends once its share of first tokens adds up to this much of one.
FIRST_TOKEN_TAKEN = 0.9

ROUTED = "routed"
DISAGGREGATED = "disaggregated"
PASSTHROUGH = "passthrough"


class RoutedRequest:
    """A request the director routed: where it goes, and its accounting until it ends.

    Attributes:
        request: the request (its prompt already dropped once routed for real).
        endpoint: the destination.
        prefill_endpoint: the endpoint computing the prompt, when it is not the destination.
        result: every profile's scores and picks (None for a body-less request).
        outcome: ``routed``, ``disaggregated`` or ``passthrough``.
        dry_run: nothing was counted; :meth:`first_byte` and :meth:`finish` do nothing.
    """

    __slots__ = (
        "_answered",
        "_blind",
        "_director",
        "_finished",
        "_logged",
        "_picked_s",
        "_prefill",
        "_prompt_tokens",
        "dry_run",
        "endpoint",
        "outcome",
        "prefill_endpoint",
        "request",
        "result",
    )

    def __init__(
        self,
        director: Director,
        request: LLMRequest | None,
        endpoint: Endpoint,
        prefill_endpoint: Endpoint | None,
        result: SchedulingResult | None,
        outcome: str,
        dry_run: bool,
    ) -> None:
        self._director = director
        self.request = request
        self.endpoint = endpoint
        self.prefill_endpoint = prefill_endpoint
        self.result = result
        self.outcome = outcome
        self.dry_run = dry_run
        # Where the prompt is computed, its uncached tokens and their attention work, and
        # whether that is a separate prefill endpoint (in flight there until the first byte).
        self._prefill: tuple[Endpoint, float, float, bool] | None = None
        self._prompt_tokens = 0.0
        self._finished = dry_run
        self._picked_s = director.store.now()
        self._answered = False
        self._blind = False
        self._logged: LoggedRequest | None = None

    @property
    def prefilling(self) -> bool:
        """The prompt has not been processed yet (its prefill is still counted)."""
        return self._prefill is not None

    def first_byte(self) -> None:
        """The first response byte: the prompt has been processed, its prefill is no longer
        queued work (idempotent)."""
        self._answered = True
        if self._prefill is not None:
            self._director._settled_one(self._prefill[0])
        self._end_prefill(observed=True)

    def no_first_byte(self) -> None:
        """The gateway will not show this response's first byte (Envoy sends no response body
        to the picker). Its prefill ends instead when the endpoint's scraped first-token count
        grows past the requests queued there before it (:meth:`Director._first_tokens`), or
        when it finishes, whichever comes first. Idempotent; nothing happens once the prefill
        ended."""
        if self._blind or self._prefill is None:
            return
        self._blind = True
        self._director._await_first_token(self, self._prefill[0])

    def _end_prefill(self, observed: bool = False) -> None:
        prefill, self._prefill = self._prefill, None
        if prefill is not None:
            self._director._end_prefill(*prefill, observed=observed)
            if prefill[3] and self.request is not None and self.result is not None:
                # Disaggregated: the prompt's KV is at the destination from now.
                self._director.scheduler.prompt_landed(self.request, self.result)
                if self._director.peers is not None:
                    self._director.peers.landed(self.request.serial)

    def finish(self, output_tokens: int | None = None) -> None:
        """The response ended, or the stream closed: release the in-flight slot (once).

        Args:
            output_tokens: the completion tokens the endpoint reported in the response's
                usage, None when it reported none (only the request log reads it).
        """
        if self._blind and self._prefill is not None:
            # Its first token (if it had one) is in the endpoint's count, still to be scraped.
            self._director._settled_one(self._prefill[0])
        self._end_prefill()
        if self._finished:
            return
        self._finished = True
        # Only a response the endpoint started counts toward how long its requests last.
        seconds = self._director.store.now() - self._picked_s if self._answered else None
        self._director._release(self.endpoint, self._prompt_tokens, self._picked_s, seconds)
        logged = self._logged
        if logged is not None:
            self._logged = None
            self._director._log_finished(logged, output_tokens)

    @property
    def finished(self) -> bool:
        return self._finished


class Director:
    """Candidates, admission, scheduling and the accounting around a pick.

    Args:
        config: the validated config (models, body limit).
        store: endpoint state.
        scheduler: built plugins; replaced whole by :meth:`swap` on reload.
        rng: seeded generator for body-less requests.
        metrics: exported metrics.
        request_log: where routed requests are logged for replay, if anywhere.
    """

    def __init__(
        self,
        config: PickerConfig,
        store: EndpointStore,
        scheduler: Scheduler,
        rng: random.Random,
        metrics: PickerMetrics,
        request_log: RequestLog | None = None,
    ) -> None:
        self.config = config
        self.store = store
        self.scheduler = scheduler
        self.rng = rng
        self.metrics = metrics
        self.request_log = request_log
        self.admission = Admission(config.admission, store, config.metrics.staleness_s)
        # Streams whose headers arrived and that are not routed yet (see admission.py).
        self.pending = 0
        # Kept across reloads: its state is about the load, not the config.
        self.queue_gate = QueueDelayGate()
        # Kinds of Envoy misconfiguration a stream has shown already (each logged once).
        self.config_warnings: set[str] = set()
        # Set by the app when tracing is configured; None costs one test per stage.
        self.tracer: RequestTracer | None = None
        # With serve --workers: the other workers learn this one's picks (kv_picker.peers).
        self.peers: PeerSync | None = None
        # Requests whose first byte the gateway does not show, per endpoint computing their
        # prompt, oldest first; the prefill ends the picker learned of otherwise since that
        # endpoint's last scrape; the fraction of a first token not yet given to a blind
        # request; and (own, all, as of, endpoint): the endpoint's first tokens and the ones
        # that were this picker's, decayed, whose ratio is its share of them.
        self._blind: dict[int, deque[RoutedRequest]] = {}
        self._settled: dict[int, int] = {}
        self._carry: dict[int, float] = {}
        self._share: dict[int, tuple[float, float, float, Endpoint | None]] = {}
        self._first_tokens_subscription = store.on_first_tokens(self._first_tokens)

    def swap(self, config: PickerConfig, scheduler: Scheduler) -> None:
        """Adopt a new config; requests already routed keep their picks."""
        self.config = config
        self.scheduler = scheduler
        self.admission = Admission(config.admission, self.store, config.metrics.staleness_s)

    @property
    def max_body_bytes(self) -> int:
        return self.config.server.max_body_bytes

    # -- before the pick --------------------------------------------------------------------

    def parse(self, body: bytes, headers: Mapping[str, str]) -> LLMRequest:
        """The typed request of a complete body.

        Raises:
            RequestError: 400 or 404, with the reason.
        """
        request = parse_request(body, headers, self.config.models)
        if self.request_log is not None:
            self.request_log.arrived(request)
        return request

    def prepare(self, request: LLMRequest) -> Awaitable[None] | None:
        """Async work plugins need before :meth:`route`, or None when there is none.

        The caller awaits the result (if any), then routes; see
        :class:`~kv_picker.scheduling.framework.Prepare`. It never raises: a plugin that could
        not prepare gives no signal for this request.
        """
        pending: list[Awaitable[None]] | None = None
        for plugin in self.scheduler.preparers:
            try:
                awaitable = plugin.prepare(request)
            except Exception:
                log.exception("request %s: prepare of a plugin failed", request.request_id)
                continue
            if awaitable is not None:
                if pending is None:
                    pending = []
                pending.append(awaitable)
        return None if pending is None else _await_all(request.request_id, pending)

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

    # -- the pick ---------------------------------------------------------------------------

    def route(
        self,
        request: LLMRequest,
        metadata: Mapping[str, Any] | None = None,
        *,
        dry_run: bool = False,
        explain: bool = False,
        trace: RequestTrace | None = None,
    ) -> RoutedRequest:
        """Admit and schedule a parsed (and prepared) request; take its in-flight slot.

        Args:
            request: the parsed request.
            metadata: the stream's filter metadata (subset hint).
            dry_run: change nothing: no slot, no index update, no decision counted.
            explain: keep every scorer's scores in the result.
            trace: the request's spans, when tracing is on (``schedule`` and ``pick`` here).

        Raises:
            PickerError: shed or filtered out (429), no endpoints (503), or an internal error
                (500, whose message carries the request id only).
        """
        span = trace.start("schedule") if trace is not None else None
        try:
            result = self._schedule(request, metadata, dry_run, explain)
        except BaseException as error:
            if trace is not None:
                trace.fail(span, error)
            raise
        if explain:
            result.signals = dict(request.state)
        if trace is None:
            return self._pick(request, result, dry_run)
        if span is not None:
            span.end()
        span = trace.start("pick")
        handle = self._pick(request, result, dry_run)
        span.set_attribute("kv_picker.endpoint", handle.endpoint.address)
        span.set_attribute("kv_picker.outcome", handle.outcome)
        span.end()
        return handle

    def _schedule(
        self,
        request: LLMRequest,
        metadata: Mapping[str, Any] | None,
        dry_run: bool,
        explain: bool,
    ) -> SchedulingResult:
        """Candidates, admission and every profile's run: the result, or a PickerError."""
        record = not dry_run
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
            log.exception("request %s: scheduling failed", request.request_id)
            raise InternalError(
                f"internal error while scheduling (request id {request.request_id})"
            ) from exc
        if not result.primary.targets:
            log.error("request %s: the picker returned no endpoint", request.request_id)
            raise InternalError(f"internal error: no endpoint (request id {request.request_id})")
        return result

    def _pick(self, request: LLMRequest, result: SchedulingResult, dry_run: bool) -> RoutedRequest:
        """The destination's accounting: in-flight slot, queued prefill, picks, request log."""
        endpoint = result.destination
        prefill_endpoint = result.prefill_endpoint
        if prefill_endpoint is endpoint:
            prefill_endpoint = None
        outcome = DISAGGREGATED if prefill_endpoint is not None else ROUTED
        handle = RoutedRequest(self, request, endpoint, prefill_endpoint, result, outcome, dry_run)
        if dry_run:
            return handle
        # Queued prefill work, counted where the prompt will be computed: its uncached tokens
        # and their attention work (n tokens after c cached ones attend to c + n/2 on average).
        target = prefill_endpoint or endpoint
        total = prompt_tokens(request)
        cached = min(cached_tokens(request, target.id), total)
        tokens = total - cached
        pairs = tokens * (cached + tokens / 2)
        store = self.store
        store.add_prefill(target.id, tokens, pairs)
        # A separate prefill endpoint runs the request (one of its sequences) until its prefill
        # leg ends: in flight there too, until the first byte. Its prompt tokens count in flight
        # at the decode endpoint only: they are the KV that decode steps read.
        separate = prefill_endpoint is not None
        if separate:
            store.in_flight[target.id] += 1
        handle._prefill = (target, tokens, pairs, separate)
        handle._prompt_tokens = total
        self._take(endpoint, request.model, outcome, total, handle._picked_s)
        if self.peers is not None:
            self.peers.picked(
                endpoint,
                prefill_endpoint,
                total,
                tokens,
                pairs,
                self.scheduler.shared_picks(request),
                request.serial,
            )
        for profile, profile_result in result.profile_results.items():
            if profile_result.targets:
                self.metrics.picks.labels(profile, profile_result.targets[0].address).inc()
        if self.request_log is not None:  # the last look at the prompt
            handle._logged = self.request_log.record(request)
        request.drop_payload()
        return handle

    def route_bodyless(self, metadata: Mapping[str, Any] | None) -> RoutedRequest:
        """A request without a body (GET and the like) goes to a random ready endpoint."""
        candidates = self.candidates(metadata)
        endpoint = candidates[self.rng.randrange(len(candidates))]
        handle = RoutedRequest(self, None, endpoint, None, None, PASSTHROUGH, False)
        self._take(endpoint, "", PASSTHROUGH, 0.0, handle._picked_s)
        if self.peers is not None:
            self.peers.took(endpoint)
        return handle

    async def route_body(
        self,
        body: bytes,
        headers: Mapping[str, str],
        metadata: Mapping[str, Any] | None = None,
        *,
        dry_run: bool = False,
        explain: bool = False,
    ) -> RoutedRequest:
        """:meth:`parse`, :meth:`prepare` and :meth:`route` in one call."""
        request = self.parse(body, headers)
        preparing = self.prepare(request)
        if preparing is not None:
            await preparing
        return self.route(request, metadata, dry_run=dry_run, explain=explain)

    def response_headers(self, request: LLMRequest, endpoint: Endpoint) -> list[tuple[str, str]]:
        """Headers the plugins add to the response for ``request`` served by ``endpoint``."""
        try:
            return self.scheduler.response_headers(request, endpoint)
        except Exception:  # a plugin bug must not break a response already under way
            log.exception("request %s: response header plugin failed", request.request_id)
            return []

    # -- accounting (through RoutedRequest) -------------------------------------------------

    def _take(
        self, endpoint: Endpoint, model: str, outcome: str, tokens: float, picked_s: float
    ) -> None:
        # Picks come in time order: appending keeps the list sorted.
        self.store.picked_s[endpoint.id].append(picked_s)
        self.store.in_flight[endpoint.id] += 1
        self.store.in_flight_tokens[endpoint.id] += tokens
        self.metrics.running.inc()
        self.metrics.requests.labels(self.metrics.model_label(model), outcome).inc()

    def _release(
        self, endpoint: Endpoint, tokens: float, picked_s: float, seconds: float | None = None
    ) -> None:
        self.metrics.running.dec()
        if self.peers is not None:
            self.peers.released(endpoint, tokens)
        # The endpoint may have left the pool (and its id been reused) meanwhile.
        store = self.store
        if store.get(endpoint.id) is endpoint and store.in_flight[endpoint.id] > 0:
            store.in_flight[endpoint.id] -= 1
            store.in_flight_tokens[endpoint.id] = max(
                0.0, store.in_flight_tokens[endpoint.id] - tokens
            )
            if seconds is not None:
                store.request_done(endpoint.id, seconds)
            picks = store.picked_s[endpoint.id]
            at = bisect.bisect_left(picks, picked_s)
            if at < len(picks) and picks[at] == picked_s:
                del picks[at]

    def _end_prefill(
        self,
        endpoint: Endpoint,
        tokens: float,
        pairs: float,
        separate: bool,
        observed: bool = False,
    ) -> None:
        """The prompt at ``endpoint`` has been processed; at a ``separate`` prefill endpoint
        the request's in-flight slot there is released too. ``observed``: the first response
        byte says so now (the store may keep the prefill's time)."""
        if self.peers is not None:
            self.peers.prefilled(endpoint, tokens, pairs, separate)
        store = self.store
        if store.get(endpoint.id) is endpoint:
            store.prefill_done(endpoint.id, tokens, pairs, observed)
            if separate and store.in_flight[endpoint.id] > 0:
                store.in_flight[endpoint.id] -= 1

    # -- prefills whose end the gateway does not show --------------------------------------

    def _await_first_token(self, handle: RoutedRequest, target: Endpoint) -> None:
        if self.store.get(target.id) is not target or self.store.first_tokens[target.id] < 0:
            return  # no count to learn the end from: the prefill ends with the request
        queue = self._blind.get(target.id)
        if queue is None:
            queue = self._blind[target.id] = deque()
        while queue and queue[0]._prefill is None:
            queue.popleft()
        queue.append(handle)

    def _settled_one(self, target: Endpoint) -> None:
        """A prefill at ``target`` ended, and the picker learned it otherwise than from the
        first-token count: the count's next growth includes it."""
        self._settled[target.id] = self._settled.get(target.id, 0) + 1

    def _first_tokens(self, endpoint_id: int, count: float) -> None:
        """A scrape of ``endpoint_id`` says it gave ``count`` first tokens since the last one.

        The engine serves its queue first come, first served, so those first tokens went to
        the oldest requests there whose prefill had not ended: the prefills of that many of
        the blind requests end, oldest first, less the ones the picker learned of otherwise
        (first bytes it saw, blind requests that finished). When other pickers send there too
        (other replicas, or the other workers of ``serve --workers``, or clients around the
        gateway), only this picker's share of the count is its own: the share of the
        endpoint's recent first tokens that were its requests' (every request it sent there is
        one of them once its prefill ended, whichever way the picker learned it), and with
        workers at most its blind requests over every worker's queued prefills there.
        """
        settled = self._settled.pop(endpoint_id, 0)
        now = self.store.now()
        endpoint = self.store.get(EndpointId(endpoint_id))
        history = self._share.get(endpoint_id)
        if history is None or history[3] is not endpoint:  # new here, or a new endpoint
            own = total = 0.0
        else:
            keep = math.exp(-max(0.0, now - history[2]) / FIRST_TOKEN_SHARE_TIME_CONSTANT_S)
            own, total = history[0] * keep, history[1] * keep
        ended = settled
        queue = self._blind.get(endpoint_id)
        while queue and queue[0]._prefill is None:
            queue.popleft()
        if queue:
            share = min(1.0, own / total) if total >= FIRST_TOKEN_SHARE_MIN_COUNT else 1.0
            if self.peers is not None:
                queued = self.store.prefill_requests[endpoint_id]
                share = min(share, len(queue) / max(queued, len(queue)))
            carry = self._carry.get(endpoint_id, 0.0) + count * share - settled
            while carry > FIRST_TOKEN_TAKEN and queue:
                handle = queue.popleft()
                prefill = handle._prefill
                if prefill is None or prefill[0] is not endpoint:
                    continue  # ended meanwhile (counted in settled), or sent to a removed one
                carry = max(0.0, carry - 1.0)  # nine tenths of a first token make one
                ended += 1
                handle._answered = True
                handle._end_prefill()
            # More first bytes seen than counted: the count has yet to catch up (a scrape read
            # before they were sent); never owed more than the requests still waiting.
            self._carry[endpoint_id] = max(carry, -float(len(queue))) if queue else 0.0
        else:
            self._blind.pop(endpoint_id, None)
            self._carry.pop(endpoint_id, None)
        self._share[endpoint_id] = (own + ended, total + count, now, endpoint)

    def _log_finished(self, logged: LoggedRequest, output_tokens: int | None) -> None:
        if self.request_log is not None:
            self.request_log.finish(logged, output_tokens)


async def _await_all(request_id: str, pending: list[Awaitable[None]]) -> None:
    for awaitable in pending:
        try:
            await awaitable
        except Exception:
            log.exception(
                "request %s: preparing failed; scheduling without that signal", request_id
            )


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
