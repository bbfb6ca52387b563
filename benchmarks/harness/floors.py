"""What no router can beat: ideal caches and zero-queue TTFT floors, from the trace alone.

Two ideal caches replay the trace in arrival order, each request looked up and then inserted
(its prompt blocks, and the blocks its decode fills when the cluster caches them):

- *unbounded*: one cache that never forgets (every reusable token is reused);
- *pooled LRU*: one LRU cache as large as the whole cluster's KV. No router can pool memory
  across endpoints, so this is the practical ceiling on reuse.

A request's **zero-queue TTFT floor** is the time an idle endpoint of the fastest class that
may prefill it (prefill endpoints under P/D) needs for its prompt's uncached tokens, chunked as
the engine chunks them, with no waiting: the *strict* floor with the unbounded cache, the
*practical* floor with the pooled LRU. Reports give each policy's TTFT as a ratio to the
practical floor (mean to mean, p90 to p90, ...).

The floors also define offered load. The practical floor is the least prefill time the
cluster must spend on a request, so ``sum(floors) / (span × capacity)``, with capacity in
endpoints of the fastest prefill class, is the share of the cluster's prefill capacity a
perfect router keeps busy. Decode is the other resource a request consumes: its output tokens,
each a share of a full batch's step (the step's fixed cost over ``max_num_seqs``, plus the read
of the request's own KV), against the decode endpoints' capacity. Offered load is the larger
of the two (:func:`offered_load`, :func:`scale_to_load`): with prefix reuse near 95%, prefill
work alone would call a cluster 30% loaded whose decode batches are already full.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from kv_picker.state.hardware import HardwareClass
from kv_picker_bench.harness.simulator import ClusterConfig, block_keys, output_block_keys
from kv_picker_bench.harness.stats import latency_stats
from kv_picker_bench.harness.traces import Trace
from kv_picker_bench.sim.engine import hardware_class


@dataclass(frozen=True, slots=True)
class IdealCaches:
    """Per request, the prompt tokens each ideal cache holds at its arrival.

    Attributes:
        unbounded_cached: tokens a cache that never forgets would serve, per request.
        pooled_cached: tokens a pooled LRU of the cluster's size would serve, per request.
        capacity_tokens: the pooled LRU's size.
        prompt_tokens: all requests' prompt tokens.
    """

    unbounded_cached: list[int]
    pooled_cached: list[int]
    capacity_tokens: int
    prompt_tokens: int

    def hit_ratios(self) -> dict[str, float]:
        total = self.prompt_tokens
        return {
            "unbounded": sum(self.unbounded_cached) / total if total else 0.0,
            "pooled_lru": sum(self.pooled_cached) / total if total else 0.0,
            "pooled_capacity_tokens": self.capacity_tokens,
        }


def ideal_caches(trace: Trace, config: ClusterConfig) -> IdealCaches:
    """Replay the trace through the two ideal caches (see the module docstring).

    As on the engines, at most ``prompt - 1`` tokens are served from a cache: the last prompt
    token is always computed.
    """
    block_size = config.block_size
    capacity = config.total_capacity_blocks
    seen: set[int] = set()
    lru: OrderedDict[int, None] = OrderedDict()
    unbounded: list[int] = []
    pooled: list[int] = []
    prompt_tokens = 0
    for request in trace.requests:
        keys = block_keys(request, trace.block_tokens, block_size)
        max_hit_blocks = (request.input_tokens - 1) // block_size
        prompt_tokens += request.input_tokens
        run = 0
        for key in keys:
            if key not in seen:
                break
            run += 1
        unbounded.append(min(run, max_hit_blocks) * block_size)
        seen.update(keys)
        run = 0
        for key in keys:
            if key not in lru:
                break
            run += 1
        pooled.append(min(run, max_hit_blocks) * block_size)
        if config.cache_output_blocks:
            filled = output_block_keys(request, trace.block_tokens, block_size)
            if filled:
                keys = keys + filled
                seen.update(filled)
        pop = lru.pop
        for key in keys:
            pop(key, None)
            lru[key] = None
        for _ in range(max(0, len(lru) - capacity)):
            lru.popitem(last=False)
    return IdealCaches(unbounded, pooled, capacity * block_size, prompt_tokens)


def prefill_classes(config: ClusterConfig) -> list[HardwareClass]:
    """Hardware classes of the endpoints that may run a prefill (all but decode-only ones)."""
    classes = [hardware_class(e.hardware) for e in config.endpoints if e.role != "decode"]
    return classes or [hardware_class(e.hardware) for e in config.endpoints]


def fastest_prefill_class(config: ClusterConfig) -> HardwareClass:
    return max(prefill_classes(config), key=lambda c: c.prefill_speed)


def isolated_prefill_s(
    config: ClusterConfig, hardware: HardwareClass, prompt_tokens: int, cached_tokens: int
) -> float:
    """Seconds an idle endpoint of ``hardware`` needs from a request's arrival to its first
    token: its uncached prompt in chunks of ``max_num_batched_tokens``, one engine step each."""
    return config.timing.isolated_prefill_s(
        hardware, prompt_tokens, cached_tokens, config.max_num_batched_tokens
    )


@dataclass(frozen=True, slots=True)
class Floors:
    """Per-request zero-queue TTFT floors (seconds) and their statistics."""

    strict_s: list[float]
    practical_s: list[float]

    def stats(self) -> dict[str, dict[str, float]]:
        return {
            "strict": latency_stats(self.strict_s),
            "practical": latency_stats(self.practical_s),
        }


def ttft_floors(trace: Trace, config: ClusterConfig, caches: IdealCaches | None = None) -> Floors:
    """The strict and practical zero-queue TTFT floor of every request (module docstring)."""
    caches = caches or ideal_caches(trace, config)
    fastest = fastest_prefill_class(config)
    strict = []
    practical = []
    for request, unbounded, pooled in zip(
        trace.requests, caches.unbounded_cached, caches.pooled_cached, strict=True
    ):
        strict.append(isolated_prefill_s(config, fastest, request.input_tokens, unbounded))
        practical.append(isolated_prefill_s(config, fastest, request.input_tokens, pooled))
    return Floors(strict, practical)


def floor_ratios(
    ttft_stats: Mapping[str, float], floor_stats: Mapping[str, float]
) -> dict[str, float]:
    """A policy's TTFT statistics over the floor's, statistic by statistic."""
    ratios: dict[str, float] = {}
    for name, value in ttft_stats.items():
        floor = floor_stats.get(name, 0.0)
        ratios[name] = value / floor if floor > 0 else float("nan")
    return ratios


def prefill_capacity(config: ClusterConfig) -> float:
    """The cluster's prefill capacity in endpoints of its fastest prefill class."""
    fastest = fastest_prefill_class(config).prefill_speed
    return sum(c.prefill_speed for c in prefill_classes(config)) / fastest


def decode_classes(config: ClusterConfig) -> list[HardwareClass]:
    """Hardware classes of the endpoints that decode (all but prefill-only ones)."""
    classes = [hardware_class(e.hardware) for e in config.endpoints if e.role != "prefill"]
    return classes or [hardware_class(e.hardware) for e in config.endpoints]


def decode_work_s(trace: Trace, config: ClusterConfig) -> float:
    """Seconds of full-batch decode on an endpoint of the fastest decode class, all requests.

    Each output token costs its share of a full batch's step (the step's fixed cost over
    ``max_num_seqs``, the per-sequence cost) and the read of the request's KV so far.
    """
    timing = config.timing
    per_token_s = timing.step_base_s / config.max_num_seqs + timing.step_per_seq_s
    total_s = 0.0
    for request in trace.requests:
        out = request.output_tokens
        context_tokens = out * request.input_tokens + out * (out - 1) / 2
        total_s += out * per_token_s + timing.kv_read_s_per_token * context_tokens
    fastest = max(c.decode_speed for c in decode_classes(config))
    return total_s / fastest


def decode_capacity(config: ClusterConfig) -> float:
    """The cluster's decode capacity in endpoints of its fastest decode class."""
    classes = decode_classes(config)
    fastest = max(c.decode_speed for c in classes)
    return sum(c.decode_speed for c in classes) / fastest


@dataclass(frozen=True, slots=True)
class Load:
    """Offered load: the shares of prefill and decode capacity a perfect router keeps busy."""

    prefill: float
    decode: float

    @property
    def binding(self) -> float:
        return max(self.prefill, self.decode)


def load_of(trace: Trace, config: ClusterConfig, floors: Floors | None = None) -> Load:
    """Prefill and decode load of a trace on a cluster (see the module docstring)."""
    floors = floors or ttft_floors(trace, config)
    span_s = _span_s(trace)
    if not span_s > 0:
        return Load(0.0, 0.0)
    prefill = sum(floors.practical_s) / (span_s * prefill_capacity(config))
    decode = decode_work_s(trace, config) / (span_s * decode_capacity(config))
    return Load(prefill, decode)


def offered_load(trace: Trace, config: ClusterConfig, floors: Floors | None = None) -> float:
    """The share of the cluster's binding resource (prefill or decode) a perfect router uses."""
    return load_of(trace, config, floors).binding


def scale_to_load(
    trace: Trace, config: ClusterConfig, load: float, floors: Floors | None = None
) -> Trace:
    """The same requests with arrival times scaled so that :func:`offered_load` is ``load``."""
    current = offered_load(trace, config, floors)
    if not current > 0:
        raise ValueError(f"{trace.name}: no prefill work to scale")
    factor = load / current
    requests = [replace(r, arrival_s=r.arrival_s / factor) for r in trace.requests]
    notes = [*trace.notes, f"load {load:g} of prefill capacity"]
    return Trace(trace.name, trace.block_tokens, requests, trace.source, notes)


def _span_s(trace: Trace) -> float:
    """Arrival span, plus one mean gap (n requests occupy n gaps, not n - 1)."""
    count = len(trace.requests)
    if count < 2:
        return 0.0
    duration = trace.duration_s
    return duration * count / (count - 1)


def floors_json(floors: Floors, caches: IdealCaches) -> dict[str, Any]:
    return {"ttft_s": floors.stats(), **caches.hit_ratios()}
