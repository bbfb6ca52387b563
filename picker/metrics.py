"""Prometheus metrics exported by the picker (``kv_picker_`` prefix).

All metrics live on one registry owned by :class:`PickerMetrics`, created once per process (or
per test), never as module globals. Label sets are defined here and nowhere else.

Label values come from the config (profiles, plugins, endpoints), from fixed vocabularies
(outcomes, reasons, decisions) and, for one label, from requests: ``model``. A value a client
wrote goes through :meth:`PickerMetrics.model_label`, which makes it printable, valid Unicode
and short, and caps the number of distinct values, so no request can make ``/metrics`` fail or
grow without bound.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector


class GaugeReading(Protocol):
    """One value a plugin reports (``kv_picker.scheduling.framework.PluginGauge``)."""

    @property
    def name(self) -> str: ...
    @property
    def documentation(self) -> str: ...
    @property
    def value(self) -> float: ...


PluginGaugeSource = Callable[[], Sequence[tuple[str, GaugeReading]]]

# Scheduling is sub-millisecond; request latency is seconds to minutes.
_SCHEDULING_BUCKETS_S = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
)
_REQUEST_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_TOKEN_BUCKETS = (1, 16, 64, 256, 1024, 4096, 16384, 65536, 262144)

METRIC_PREFIX = "kv_picker_"
REQUEST_LABELS = ("model", "outcome")
# The model label comes from request bodies: cap its distinct values so a client cannot grow
# the exposition without bound.
MAX_MODEL_LABELS = 100
OTHER_MODEL = "other"
# Longer label values are cut: a model name is tens of characters, a body may carry megabytes.
MAX_LABEL_CHARS = 128
_REPLACEMENT = "\ufffd"
PLUGIN_LABELS = ("profile", "plugin", "type")
ENDPOINT_LABELS = ("endpoint",)
DISCOVERY_LABELS = ("resource", "reason")
# Label values known in advance, exported at 0 from the start so that rates and dashboards show
# 0 rather than no data before the first occurrence.
ADMISSION_DECISIONS = ("admitted", "admitted-sheddable", "shed")
RELOAD_RESULTS = ("applied", "rejected")
SEQUENCE_BREAKS = ("gap", "restart")


class PickerMetrics:
    """Every metric the picker exports."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self._model_labels: set[str] = set()
        r = self.registry
        self.requests = Counter(
            "kv_picker_requests",
            "Requests handled, by model and outcome (routed, passthrough, or the error reason).",
            REQUEST_LABELS,
            registry=r,
        )
        self.picks = Counter(
            "kv_picker_picks",
            "Endpoints picked, by profile and endpoint.",
            ("profile", "endpoint"),
            registry=r,
        )
        self.scheduling_seconds = Histogram(
            "kv_picker_scheduling_duration_seconds",
            "Time from parsed request to pick (all profiles).",
            buckets=_SCHEDULING_BUCKETS_S,
            registry=r,
        )
        self.plugin_seconds = Histogram(
            "kv_picker_plugin_duration_seconds",
            "Time spent in one plugin for one request.",
            PLUGIN_LABELS,
            buckets=_SCHEDULING_BUCKETS_S,
            registry=r,
        )
        self.request_seconds = Histogram(
            "kv_picker_request_duration_seconds",
            "Time from the request's headers to the end of the response.",
            buckets=_REQUEST_BUCKETS_S,
            registry=r,
        )
        self.ttft_seconds = Histogram(
            "kv_picker_time_to_first_byte_seconds",
            "Time from the pick to the first response body byte.",
            buckets=_REQUEST_BUCKETS_S,
            registry=r,
        )
        self.input_tokens = Histogram(
            "kv_picker_request_input_tokens",
            "Prompt tokens reported by the endpoint.",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.output_tokens = Histogram(
            "kv_picker_request_output_tokens",
            "Completion tokens reported by the endpoint.",
            buckets=_TOKEN_BUCKETS,
            registry=r,
        )
        self.cached_tokens = Counter(
            "kv_picker_request_cached_tokens",
            "Prompt tokens the endpoint reported as served from its prefix cache.",
            registry=r,
        )
        self.responses_unseen = Counter(
            "kv_picker_responses_unseen",
            "Requests routed on ext_proc streams that carry no response body (Envoy's "
            "processing_mode.response_body_mode NONE) and ended without the response's end "
            "(response trailers skipped: the stream ends once the request is routed, or the "
            "client went away first).",
            registry=r,
        )
        self.observability_streams = Counter(
            "kv_picker_observability_streams",
            "ext_proc streams from a filter in observability_mode: ignored, since Envoy drops "
            "every reply to such a filter and they cannot route.",
            registry=r,
        )
        self.running = Gauge(
            "kv_picker_requests_running", "Requests routed and not yet finished.", registry=r
        )
        self.pending = Gauge(
            "kv_picker_requests_pending",
            "Requests whose headers arrived and that are not routed yet (bounded by "
            "admission.maxPendingRequests).",
            registry=r,
        )
        self.queue_delay = Histogram(
            "kv_picker_request_queue_delay_seconds",
            "How long requests waited between the gateway's x-request-start stamp and the "
            "picker's handler (gRPC buffers, the event loop), clock offset removed; measured "
            "when the gateway stamps requests (admission.queueDelayTarget sheds on it).",
            buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0),
            registry=r,
        )
        self.asyncio_tasks = Gauge(
            "kv_picker_asyncio_tasks",
            "asyncio tasks alive in the picker's event loop, read at each scrape (one per open "
            "ext_proc stream plus the side tasks): a count that only grows is a leak.",
            registry=r,
        )
        self.endpoints = Gauge(
            "kv_picker_endpoints", "Endpoints by state (ready, not_ready).", ("state",), registry=r
        )
        self.endpoint_waiting = Gauge(
            "kv_picker_endpoint_requests_waiting",
            "Scraped vllm:num_requests_waiting.",
            ENDPOINT_LABELS,
            registry=r,
        )
        self.endpoint_running = Gauge(
            "kv_picker_endpoint_requests_running",
            "Scraped vllm:num_requests_running.",
            ENDPOINT_LABELS,
            registry=r,
        )
        self.endpoint_kv_usage = Gauge(
            "kv_picker_endpoint_kv_cache_usage_ratio",
            "Scraped vllm:kv_cache_usage_perc, [0,1].",
            ENDPOINT_LABELS,
            registry=r,
        )
        self.endpoint_in_flight = Gauge(
            "kv_picker_endpoint_in_flight_requests",
            "Requests routed here and not finished (a prefill endpoint under P/D: until the "
            "prompt is processed).",
            ENDPOINT_LABELS,
            registry=r,
        )
        self.endpoint_queued_prefill_tokens = Gauge(
            "kv_picker_endpoint_queued_prefill_tokens",
            "Uncached prompt tokens routed here whose first response byte has not come back "
            "(the prefill work the picker counts as queued), at the last scrape.",
            ENDPOINT_LABELS,
            registry=r,
        )
        self.endpoint_recent_prefill_tokens = Gauge(
            "kv_picker_endpoint_recent_prefill_tokens",
            "Uncached prompt tokens routed here to be computed, each request's decayed by "
            "exp(-age / 30 s): the recent work recent-work-scorer reads, at the last scrape.",
            ENDPOINT_LABELS,
            registry=r,
        )
        self.endpoint_request_seconds = Gauge(
            "kv_picker_endpoint_request_seconds",
            "How long a request on the endpoint lasts, pick to response end: the moving average "
            "predicted-latency-scorer's sequence-slot wait uses (0: none ended yet), at the last "
            "scrape.",
            ENDPOINT_LABELS,
            registry=r,
        )
        self.scrape_errors = Counter(
            "kv_picker_scrape_errors",
            "Failed metric scrapes, by endpoint.",
            ENDPOINT_LABELS,
            registry=r,
        )
        self.admission = Counter(
            "kv_picker_admission_decisions",
            "Admission decisions (admitted, admitted-sheddable, shed).",
            ("decision",),
            registry=r,
        )
        self.pool_saturation = Gauge(
            "kv_picker_pool_saturation",
            "Saturation of the candidates at the last sheddable request (>= 1 sheds).",
            registry=r,
        )
        self.config_reloads = Counter(
            "kv_picker_config_reloads",
            "Config reload attempts, by result.",
            ("result",),
            registry=r,
        )
        self.tls_reloads = Counter(
            "kv_picker_tls_reloads",
            "Certificate files re-read after they changed, by port (grpc, admin) and result "
            "(applied; rejected: the key did not match or a file did not parse, old set kept).",
            ("port", "result"),
            registry=r,
        )
        # Precise KV index (KV events). Block counts, not message counts, unless named.
        self.kv_index_blocks = Gauge(
            "kv_picker_kv_index_blocks",
            "(endpoint, block) entries in the precise KV index.",
            registry=r,
        )
        self.kv_index_keys = Gauge(
            "kv_picker_kv_index_keys",
            "Distinct block keys in the precise KV index (in-process backend).",
            registry=r,
        )
        self.kv_index_evictions = Counter(
            "kv_picker_kv_index_evictions",
            "Index entries evicted to respect a per-endpoint or total bound.",
            registry=r,
        )
        self.kv_events_applied = Counter(
            "kv_picker_kv_events_applied",
            "KV events applied: blocks stored or removed, endpoint caches cleared.",
            ("kind",),
            registry=r,
        )
        self.kv_events_dropped = Counter(
            "kv_picker_kv_events_dropped",
            "Blocks of KV events not indexed, by reason.",
            ("reason",),
            registry=r,
        )
        self.kv_events_malformed = Counter(
            "kv_picker_kv_events_malformed",
            "KV-event messages that did not follow the wire format (dropped).",
            registry=r,
        )
        self.kv_event_sequence_gaps = Counter(
            "kv_picker_kv_event_sequence_gaps",
            "Sequence breaks per publisher: gap (messages lost) or restart (sequence went back).",
            ("kind",),
            registry=r,
        )
        self.kv_event_replays = Counter(
            "kv_picker_kv_event_replays",
            "Replays asked from endpoints' replay sockets, by cause (gap, catch_up) and result.",
            ("cause", "result"),
            registry=r,
        )
        self.kv_index_backend_errors = Counter(
            "kv_picker_kv_index_backend_errors",
            "Failed calls to the shared index backend, by operation (lookup, write).",
            ("operation",),
            registry=r,
        )

        for decision in ADMISSION_DECISIONS:
            self.admission.labels(decision)
        for result in RELOAD_RESULTS:
            self.config_reloads.labels(result)
        for kind in SEQUENCE_BREAKS:
            self.kv_event_sequence_gaps.labels(kind)

        # Kubernetes discovery (kv_picker.sources.kubernetes).
        self.discovery_events = Counter(
            "kv_picker_discovery_events",
            "Watch events received from the Kubernetes API, by resource and event type.",
            ("resource", "type"),
            registry=r,
        )
        self.discovery_restarts = Counter(
            "kv_picker_discovery_watch_restarts",
            "Watches of the Kubernetes API started again, by resource and reason (gone: "
            "relisted after 410; dropped: stream broke; error: API error; ended: server "
            "closed the stream; changed: the pool's selector changed).",
            DISCOVERY_LABELS,
            registry=r,
        )

    def forget_endpoint(self, address: str) -> None:
        """Drop an endpoint's series once it left the pool, so that a pool that churns does
        not grow the exposition (and dashboards do not show endpoints that are gone)."""
        for metric in (
            self.endpoint_waiting,
            self.endpoint_running,
            self.endpoint_kv_usage,
            self.endpoint_in_flight,
            self.endpoint_queued_prefill_tokens,
            self.endpoint_recent_prefill_tokens,
            self.endpoint_request_seconds,
            self.scrape_errors,
        ):
            metric.remove(address)
        self.picks.remove_by_labels({"endpoint": address})

    def collect_plugin_gauges(self, source: PluginGaugeSource) -> None:
        """Export the gauges plugins report (:class:`~kv_picker.scheduling.framework.
        CollectsMetrics`), read from ``source`` on every scrape, labelled by plugin name."""
        self.registry.register(_PluginGauges(source))

    def model_label(self, model: str) -> str:
        """``model`` as a label value (see :func:`label_value`), or ``other`` once the cap of
        distinct models is reached."""
        seen = self._model_labels
        if model in seen:
            return model
        model = label_value(model)
        if model in seen:
            return model
        if len(seen) >= MAX_MODEL_LABELS:
            return OTHER_MODEL
        seen.add(model)
        return model

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def label_value(text: str, max_chars: int = MAX_LABEL_CHARS) -> str:
    """``text`` as a label value every exposition format can carry.

    At most ``max_chars`` characters; a character that is not printable (lone surrogates,
    control characters such as NUL or CR, line and paragraph separators) becomes U+FFFD. The
    exposition escapes backslashes, quotes and newlines itself, but it cannot encode a lone
    surrogate at all, and a raw control character confuses scrapers.
    """
    if len(text) > max_chars:
        text = text[:max_chars]
    if text.isprintable():  # fast path: every ordinary name
        return text
    return "".join(c if c.isprintable() else _REPLACEMENT for c in text)


class _PluginGauges(Collector):
    """One gauge family per metric name the plugins report, one sample per plugin."""

    def __init__(self, source: PluginGaugeSource) -> None:
        self._source = source

    def describe(self) -> list[Metric]:
        return []  # the names depend on the running config's plugins

    def collect(self) -> Iterator[Metric]:
        families: dict[str, GaugeMetricFamily] = {}
        for plugin, gauge in self._source():
            if not gauge.name.startswith(METRIC_PREFIX):
                continue  # a plugin may not write outside the picker's namespace
            family = families.get(gauge.name)
            if family is None:
                family = families[gauge.name] = GaugeMetricFamily(
                    gauge.name, gauge.documentation, labels=("plugin",)
                )
            family.add_metric((plugin,), gauge.value)
        yield from families.values()
