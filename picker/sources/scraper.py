"""Scrape each endpoint's Prometheus ``/metrics`` into the endpoint store.

Each endpoint is scraped once per interval, and the scrapes are spread evenly over the
interval rather than fired together: a round of N scrapes at once would hold the event loop for
N parses in a row and show up as a latency spike on the requests in flight. A scrape still
running when its endpoint's next turn comes is not doubled up. A failed scrape (refused, timed
out, non-200, unparsable) marks the endpoint not ready until a scrape succeeds again. Scrapes
older than the staleness bound make scorers treat the endpoint as fully loaded. An endpoint that
joins the store (discovery) is scraped at once rather than at its turn, so that it takes traffic
as soon as it answers.

Only the families the picker reads are parsed: lines are pre-selected by name and the
selection goes through ``prometheus_client``'s text parser, so a large vLLM exposition (many
histogram buckets) costs little.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from kv_picker.endpoint import Endpoint
from kv_picker.metrics import PickerMetrics
from kv_picker.state.endpoints import EndpointStore, LoraState

log = logging.getLogger(__name__)

WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_USAGE = "vllm:kv_cache_usage_perc"
KV_USAGE_OLD = "vllm:gpu_cache_usage_perc"
CACHE_CONFIG = "vllm:cache_config_info"
LORA_INFO = "vllm:lora_requests_info"
# The count of the TTFT histogram: how many requests got a first token. Its growth tells the
# picker which prefills ended when the gateway shows it no response body (see director.py).
FIRST_TOKENS = "vllm:time_to_first_token_seconds_count"
_WANTED = (WAITING, RUNNING, KV_USAGE, KV_USAGE_OLD, CACHE_CONFIG, LORA_INFO, FIRST_TOKENS)
_WANTED_PREFIXES = tuple(
    f"{prefix}{name}" for name in _WANTED for prefix in ("", "# TYPE ", "# HELP ")
)


@dataclass(slots=True)
class EndpointSignals:
    """What one scrape says about an endpoint."""

    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0
    block_size_tokens: int = 0
    num_gpu_blocks: int = 0
    lora: LoraState | None = None
    first_tokens: float | None = None


def _adapters(value: str) -> frozenset[str]:
    return frozenset(name.strip() for name in value.split(",") if name.strip())


class MetricsParseError(ValueError):
    pass


def parse_vllm_metrics(text: str) -> EndpointSignals:
    """Read the routing signals from a Prometheus text exposition.

    Gauges with several series (one per engine) are summed, except KV usage which takes the
    fullest engine. The first-token count is summed over its series too (engines, models).

    Raises:
        MetricsParseError: the text is not valid exposition format, or has no queue metric.
    """
    selected = "\n".join(line for line in text.splitlines() if line.startswith(_WANTED_PREFIXES))
    signals = EndpointSignals()
    seen_queue = False
    kv_new: float | None = None
    kv_old: float | None = None
    lora_time = -1.0
    try:
        for family in text_string_to_metric_families(selected + "\n"):
            for sample in family.samples:
                name, value = sample.name, sample.value
                if name == WAITING:
                    signals.waiting += value
                    seen_queue = True
                elif name == RUNNING:
                    signals.running += value
                elif name == FIRST_TOKENS:
                    signals.first_tokens = (signals.first_tokens or 0.0) + value
                elif name == KV_USAGE:
                    kv_new = value if kv_new is None else max(kv_new, value)
                elif name == KV_USAGE_OLD:
                    kv_old = value if kv_old is None else max(kv_old, value)
                elif name == CACHE_CONFIG:
                    labels = sample.labels
                    block_size = labels.get("block_size", "")
                    num_blocks = labels.get("num_gpu_blocks", "")
                    if block_size.isdigit():
                        signals.block_size_tokens = int(block_size)
                    if num_blocks.isdigit():
                        signals.num_gpu_blocks = int(num_blocks)
                elif name == LORA_INFO and value >= lora_time:
                    # The value is a timestamp: the newest series is the current state.
                    lora_time = value
                    labels = sample.labels
                    max_lora = labels.get("max_lora", "")
                    signals.lora = LoraState(
                        running=_adapters(labels.get("running_lora_adapters", "")),
                        waiting=_adapters(labels.get("waiting_lora_adapters", "")),
                        max_lora=int(max_lora) if max_lora.isdigit() else 0,
                    )
    except (ValueError, TypeError, IndexError) as exc:
        raise MetricsParseError(f"invalid Prometheus text: {exc}") from exc
    if not seen_queue:
        raise MetricsParseError(f"no {WAITING} metric in the exposition")
    kv = kv_new if kv_new is not None else kv_old
    signals.kv_usage = min(max(kv or 0.0, 0.0), 1.0)
    return signals


class MetricsScraper:
    """Background task that keeps the store's signals fresh.

    Args:
        store: endpoint store to update.
        metrics: exported metrics (scrape errors, per-endpoint gauges).
        interval_s: time between scrape rounds.
        timeout_s: per-request timeout.
        path: metrics path on each endpoint.
    """

    def __init__(
        self,
        store: EndpointStore,
        metrics: PickerMetrics,
        interval_s: float,
        timeout_s: float,
        path: str = "/metrics",
    ) -> None:
        self.store = store
        self.metrics = metrics
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.path = path
        self.rounds = 0
        self._session: aiohttp.ClientSession | None = None
        # With serve --workers: each of this scraper's results, for the other workers (a failed
        # scrape has no signals and a reason); results they send come in by scraped/failed.
        self.share: Callable[[Endpoint, EndpointSignals | None, str], None] | None = None

    def configure(self, interval_s: float, timeout_s: float, path: str) -> None:
        """New settings (a config reload); the next scrapes use them."""
        self.interval_s, self.timeout_s, self.path = interval_s, timeout_s, path

    async def run(self) -> None:
        """Scrape forever, staggered over the interval (cancel the task to stop)."""
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        connector = aiohttp.TCPConnector(limit=0, force_close=False)
        in_flight: dict[int, asyncio.Task[None]] = {}

        def scrape_added(added: Sequence[Endpoint], removed: Sequence[Endpoint]) -> None:
            for endpoint in added:
                previous = in_flight.get(endpoint.id)
                if previous is None or previous.done():
                    in_flight[endpoint.id] = asyncio.create_task(self._scrape(endpoint))

        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            self._session = session
            loop = asyncio.get_running_loop()
            subscription = self.store.on_change(scrape_added)
            try:
                while True:
                    endpoints = self.store.all()
                    if not endpoints:
                        await asyncio.sleep(self.interval_s)
                        continue
                    slot_s = self.interval_s / len(endpoints)
                    for endpoint in endpoints:
                        started = loop.time()
                        previous = in_flight.get(endpoint.id)
                        if previous is None or previous.done():
                            in_flight[endpoint.id] = asyncio.create_task(self._scrape(endpoint))
                        await asyncio.sleep(max(0.0, slot_s - (loop.time() - started)))
                    self._round_done(len(endpoints))
            finally:
                subscription.cancel()
                for task in in_flight.values():
                    task.cancel()
                await asyncio.gather(*in_flight.values(), return_exceptions=True)

    async def scrape_once(self) -> None:
        """One round over every endpoint, all at once (outside :meth:`run` too)."""
        if self._session is None:
            timeout = aiohttp.ClientTimeout(total=self.timeout_s)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                self._session = session
                try:
                    await self.scrape_once()
                finally:
                    self._session = None
            return
        endpoints = self.store.all()
        if endpoints:
            await asyncio.gather(*(self._scrape(e) for e in endpoints))
        self._round_done(len(endpoints))

    def _round_done(self, num_endpoints: int) -> None:
        self.rounds += 1
        ready = len(self.store.ready_endpoints())
        self.metrics.endpoints.labels("ready").set(ready)
        self.metrics.endpoints.labels("not_ready").set(num_endpoints - ready)

    async def _scrape(self, endpoint: Endpoint) -> None:
        session = self._session
        if session is None:
            raise RuntimeError("scraper is not running")
        try:
            signals = await fetch_signals(session, endpoint.address, self.path)
        except (aiohttp.ClientError, TimeoutError, MetricsParseError, UnicodeDecodeError) as exc:
            self.result(endpoint, None, str(exc) or type(exc).__name__)
            return
        self.result(endpoint, signals)

    def result(self, endpoint: Endpoint, signals: EndpointSignals | None, reason: str = "") -> None:
        """This scraper's own result (``signals`` None: it failed for ``reason``): applied, and
        shared with the other workers when there are any."""
        if signals is None:
            self.failed(endpoint, reason)
        else:
            self.scraped(endpoint, signals)
        if self.share is not None:
            self.share(endpoint, signals, reason)

    def failed(self, endpoint: Endpoint, reason: str, count_error: bool = True) -> None:
        """A scrape of ``endpoint`` failed: not ready until one succeeds.

        ``count_error`` False: another worker's scrape, which that worker counted."""
        if self.store.get(endpoint.id) is endpoint:  # else it left: no series for it
            if self.store.ready[endpoint.id]:
                log.warning("endpoint %s not ready: %s", endpoint.address, reason)
            self.store.set_ready(endpoint.id, False)
            if count_error:
                self.metrics.scrape_errors.labels(endpoint.address).inc()

    def scraped(self, endpoint: Endpoint, signals: EndpointSignals) -> None:
        """A good scrape of ``endpoint``: its signals into the store and the gauges."""
        if self.store.get(endpoint.id) is not endpoint:
            return  # removed while we were scraping
        if not self.store.ready[endpoint.id]:
            log.info("endpoint %s ready", endpoint.address)
        self.store.update_metrics(
            endpoint.id,
            waiting=signals.waiting,
            running=signals.running,
            kv_usage=signals.kv_usage,
            block_size_tokens=signals.block_size_tokens,
            num_gpu_blocks=signals.num_gpu_blocks,
            lora=signals.lora,
            first_tokens=signals.first_tokens,
        )
        address = endpoint.address
        self.metrics.endpoint_waiting.labels(address).set(signals.waiting)
        self.metrics.endpoint_running.labels(address).set(signals.running)
        self.metrics.endpoint_kv_usage.labels(address).set(signals.kv_usage)
        self.metrics.endpoint_in_flight.labels(address).set(self.store.in_flight[endpoint.id])
        self.metrics.endpoint_queued_prefill_tokens.labels(address).set(
            self.store.prefill_tokens[endpoint.id]
        )
        self.metrics.endpoint_recent_prefill_tokens.labels(address).set(
            self.store.recent_prefill(endpoint.id)[0]
        )
        self.metrics.endpoint_request_seconds.labels(address).set(self.store.request_s[endpoint.id])


async def fetch_signals(session: aiohttp.ClientSession, address: str, path: str) -> EndpointSignals:
    """GET ``http://<address><path>`` and parse it.

    Raises:
        aiohttp.ClientError, TimeoutError: the request failed.
        MetricsParseError: not a 200, or not a vLLM exposition.
        UnicodeDecodeError: the body is not text.
    """
    async with session.get(f"http://{address}{path}") as response:
        if response.status != 200:
            raise MetricsParseError(f"HTTP {response.status}")
        text = await response.text()
    return parse_vllm_metrics(text)
