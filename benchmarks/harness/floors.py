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

The floors also define offered load: the practical floor is the least prefill time the
cluster must spend on a request, so ``sum(floors) / (duration × capacity)``, with capacity in
endpoints of the fastest class, is the fraction of the cluster's prefill capacity a perfect
router would keep busy (:func:`offered_load`, :func:`scale_to_load`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from kv_picker.state.hardware import HardwareClass
from kv_picker_bench.harness.report import latency_stats
from kv_picker_bench.harness.simulator import ClusterConfig, block_keys, output_block_keys
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
        return {"strict": latency_stats(self.strict_s), "practical": latency_stats(self.practical_s)}


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


def offered_load(trace: Trace, config: ClusterConfig, floors: Floors | None = None) -> float:
    """The fraction of the cluster's prefill capacity a perfect router keeps busy."""
    floors = floors or ttft_floors(trace, config)
    span_s = _span_s(trace)
    return sum(floors.practical_s) / (span_s * prefill_capacity(config)) if span_s > 0 else 0.0


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
