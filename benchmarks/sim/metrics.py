"""Prometheus metrics of the simulated endpoint, named and labelled as vLLM names them.

Everything is computed at scrape time from the engine (gauges and counters) or from latency
observations the server records as requests progress (histograms), through one custom
collector on a private ``CollectorRegistry``: several endpoints can live in one process (tests)
without sharing or clashing on prometheus_client's global registry.

Latency histograms are in **model seconds** (unscaled by the endpoint's time scale), so figures
from a fast test run and from a real-time run are directly comparable.

Exposed families (labels ``model_name`` and ``engine="0"`` unless noted)::

    vllm:num_requests_running            gauge
    vllm:num_requests_waiting            gauge
    vllm:kv_cache_usage_perc             gauge, [0,1], evictable cached blocks count as free
    vllm:cache_config_info               gauge = 1; labels engine, block_size, num_gpu_blocks,
                                         enable_prefix_caching, prefix_caching_hash_algo
    vllm:lora_requests_info              gauge = scrape time; labels max_lora,
                                         running_lora_adapters, waiting_lora_adapters
                                         (only when LoRA adapters are served, as in vLLM)
    vllm:prefix_cache_queries_total      counter, tokens
    vllm:prefix_cache_hits_total         counter, tokens
    vllm:prompt_tokens_total             counter
    vllm:generation_tokens_total         counter
    vllm:num_preemptions_total           counter (always 0: admission reserves all blocks)
    vllm:request_success_total           counter, extra label finished_reason
    vllm:time_to_first_token_seconds     histogram
    vllm:inter_token_latency_seconds     histogram
    vllm:e2e_request_latency_seconds     histogram
    vllm:request_queue_time_seconds      histogram
    kv_picker_sim_info                   gauge = 1; labels model_name, role, hardware_class,
                                         time_scale
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Iterator, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from kv_picker_bench.sim.cache import HASH_ALGO
from kv_picker_bench.sim.engine import FinishedRequest, SimEngine

# Bucket bounds as in vLLM's v1 metrics logger.
TTFT_BUCKETS_S: tuple[float, ...] = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
ITL_BUCKETS_S: tuple[float, ...] = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
REQUEST_LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip

ENGINE_INDEX = "0"


class LatencyHistogram:
    """Bucketed observations of one latency (non-cumulative counts, cumulated at export)."""

    __slots__ = ("bounds_s", "counts", "sum_s")

    def __init__(self, bounds_s: Sequence[float]) -> None:
        """Creates an empty histogram with the given upper bounds (+Inf is implicit)."""
        self.bounds_s = tuple(bounds_s)
        self.counts = [0] * (len(self.bounds_s) + 1)
        self.sum_s = 0.0

    def observe(self, value_s: float) -> None:
        """Records one value (in seconds)."""
        # bisect_left puts a value equal to a bound into that bound's bucket (le semantics).
        self.counts[bisect.bisect_left(self.bounds_s, value_s)] += 1
        self.sum_s += value_s

    @property
    def count(self) -> int:
        """Number of observations."""
        return sum(self.counts)

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative ``(le, count)`` pairs ending with ``+Inf``."""
        out: list[tuple[str, float]] = []
        total = 0
        for bound, count in zip((*self.bounds_s, float("inf")), self.counts, strict=True):
            total += count
            out.append(("+Inf" if bound == float("inf") else repr(float(bound)), float(total)))
        return out


class SimMetrics:
    """The collector of one simulated endpoint, registered on its own registry."""

    def __init__(
        self,
        engine: SimEngine,
        *,
        model_name: str,
        role: str,
        hardware_class: str,
        time_scale: float,
        lora_names: Sequence[str] = (),
        max_loras: int = 1,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        """Creates the collector and its registry.

        Args:
            engine: The engine whose state is exported.
            model_name: Served model name (label ``model_name``).
            role: Endpoint role, exported in ``kv_picker_sim_info``.
            hardware_class: Hardware class name, exported in ``kv_picker_sim_info``.
            time_scale: Wall seconds per model second, exported in ``kv_picker_sim_info``.
            lora_names: Served LoRA adapters; ``vllm:lora_requests_info`` only appears with some.
            max_loras: Value of the ``max_lora`` label.
            wall_clock: Source of the ``vllm:lora_requests_info`` timestamp.
        """
        self._engine = engine
        self._model_name = model_name
        self._role = role
        self._hardware_class = hardware_class
        self._time_scale = time_scale
        self._lora_names = tuple(lora_names)
        self._max_loras = max_loras
        self._wall_clock = wall_clock
        self.ttft = LatencyHistogram(TTFT_BUCKETS_S)
        self.inter_token = LatencyHistogram(ITL_BUCKETS_S)
        self.e2e = LatencyHistogram(REQUEST_LATENCY_BUCKETS_S)
        self.queue_time = LatencyHistogram(REQUEST_LATENCY_BUCKETS_S)
        # P/D disaggregation: legs served here by kind, failed prefill legs, blocks pulled in.
        self.pd_legs = {"prefill": 0, "decode": 0}
        self.pd_leg_failures = 0
        self.transferred_blocks = 0
        self.scrapes = 0
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)

    def observe_finished(self, summary: FinishedRequest) -> None:
        """Records the latencies of a request that left the engine."""
        if summary.scheduled_s is not None:
            self.queue_time.observe(summary.scheduled_s - summary.arrival_s)
        if summary.finish_reason != "abort":
            self.e2e.observe(summary.e2e_s)

    def render(self) -> bytes:
        """The Prometheus text exposition of the current state (counted as a scrape)."""
        self.scrapes += 1
        return generate_latest(self.registry)

    def collect(self) -> Iterator[Metric]:
        """Yields every metric family (called by the registry at scrape time)."""
        engine = self._engine
        cache = engine.cache
        labels = ["model_name", "engine"]
        values = [self._model_name, ENGINE_INDEX]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        yield gauge(
            "vllm:num_requests_running",
            "Number of requests in model execution batches.",
            engine.num_running,
        )
        yield gauge(
            "vllm:num_requests_waiting",
            "Number of requests waiting to be processed.",
            engine.num_waiting,
        )
        yield gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", cache.usage
        )

        config_info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=[
                "engine",
                "block_size",
                "num_gpu_blocks",
                "enable_prefix_caching",
                "prefix_caching_hash_algo",
            ],
        )
        config_info.add_metric(
            [
                ENGINE_INDEX,
                str(engine.config.block_size),
                str(cache.num_gpu_blocks),
                "True",
                HASH_ALGO,
            ],
            1.0,
        )
        yield config_info

        if self._lora_names:
            running, waiting = engine.lora_names()
            lora_info = GaugeMetricFamily(
                "vllm:lora_requests_info",
                "Running stats on lora requests.",
                labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            )
            lora_info.add_metric(
                [str(self._max_loras), ",".join(sorted(waiting)), ",".join(sorted(running))],
                self._wall_clock(),
            )
            yield lora_info

        yield counter(
            "vllm:prefix_cache_queries",
            "Prefix cache queries, in terms of number of queried tokens.",
            cache.queries_tokens,
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prefix cache hits, in terms of number of cached tokens.",
            cache.hits_tokens,
        )
        yield counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", engine.stats.prompt_tokens
        )
        yield counter(
            "vllm:generation_tokens",
            "Number of generation tokens processed.",
            engine.stats.generation_tokens,
        )
        yield counter("vllm:num_preemptions", "Cumulative number of preemption.", 0)

        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*labels, "finished_reason"],
        )
        by_reason = engine.stats.finished_by_reason
        for reason in ("stop", "length", "abort"):
            success.add_metric([*values, reason], by_reason.get(reason, 0))
        yield success

        for name, doc, histogram in (
            (
                "vllm:time_to_first_token_seconds",
                "Histogram of time to first token in seconds (model time).",
                self.ttft,
            ),
            (
                "vllm:inter_token_latency_seconds",
                "Histogram of inter-token latency in seconds (model time).",
                self.inter_token,
            ),
            (
                "vllm:e2e_request_latency_seconds",
                "Histogram of e2e request latency in seconds (model time).",
                self.e2e,
            ),
            (
                "vllm:request_queue_time_seconds",
                "Histogram of time spent in WAITING phase for request (model time).",
                self.queue_time,
            ),
        ):
            family = HistogramMetricFamily(name, doc, labels=labels)
            family.add_metric(values, histogram.buckets(), histogram.sum_s)
            yield family

        legs = CounterMetricFamily(
            "kv_picker_sim_pd_legs",
            "P/D legs served: prefill (computed here for another endpoint) or decode (prefill "
            "done elsewhere, KV pulled in).",
            labels=[*labels, "leg"],
        )
        for leg, count in self.pd_legs.items():
            legs.add_metric([*values, leg], count)
        yield legs
        yield counter(
            "kv_picker_sim_pd_leg_failures",
            "Prefill legs that failed (the endpoint then prefilled by itself).",
            self.pd_leg_failures,
        )
        yield counter(
            "kv_picker_sim_transferred_blocks",
            "KV blocks pulled from prefill endpoints (those not already cached here).",
            self.transferred_blocks,
        )
        yield counter(
            "kv_picker_sim_metrics_scrapes",
            "Times /metrics was read, this read included (how often routers scrape).",
            self.scrapes,
        )

        info = GaugeMetricFamily(
            "kv_picker_sim_info",
            "Simulated endpoint identity: role, hardware class and time scale.",
            labels=["model_name", "role", "hardware_class", "time_scale"],
        )
        info.add_metric(
            [self._model_name, self._role, self._hardware_class, repr(self._time_scale)], 1.0
        )
        yield info
