"""Simulator invariants: nothing lost, caches within capacity, determinism, the same timing as
the endpoint's own engine, scrape staleness, KV events and P/D."""

from __future__ import annotations

import math
import random
from dataclasses import replace

import pytest

from kv_picker.director import RoutedRequest
from kv_picker.request import LLMRequest
from kv_picker_bench.harness.policies import (
    DynamoCostPicker,
    Policy,
    harness_registry,
    pd_variant,
    resolve_policy,
)
from kv_picker_bench.harness.simulator import (
    ERROR,
    OK,
    REJECTED,
    ClusterSimulator,
    EndpointSetup,
    block_keys,
)
from kv_picker_bench.harness.traces import (
    CacheNamespaces,
    ChatSpec,
    Trace,
    TraceRequest,
    prompt_text,
    slice_trace,
)
from kv_picker_bench.sim.engine import EngineConfig, SimEngine, hardware_class
from kv_picker_bench.sim.tokenizer import encode
from tests.benchmarks.harness.conftest import make_trace, simulate, small_cluster, small_trace


@pytest.mark.parametrize(
    "policy",
    [
        "random",
        "round-robin",
        "least-queue",
        "gie-default",
        "sglang-cache-aware",
        "dynamo-cost",
        "kv-picker",
    ],
)
def test_no_request_lost_and_caches_within_capacity(policy: str) -> None:
    trace = small_trace(150, rate=40.0)
    config = small_cluster(4, num_gpu_blocks=200)
    result = simulate(trace, config, policy, check=True)  # checks caches after every event
    assert [o.index for o in result.outcomes] == list(range(150))
    assert all(o.status == OK for o in result.outcomes)
    for outcome in result.outcomes:
        assert outcome.arrival_s < outcome.first_token_s <= outcome.finish_s
        assert 0 <= outcome.cached_tokens < outcome.prompt_tokens
    assert sum(e.requests for e in result.endpoints) == 150
    for stats in result.endpoints:
        assert stats.max_used_blocks <= stats.capacity_blocks == 200


def test_determinism_under_a_seed() -> None:
    trace = small_trace(120, rate=30.0)
    config = small_cluster(4)
    for policy in ("random", "kv-picker", "dynamo-cost"):
        first = simulate(trace, config, policy, seed=3, check=False)
        second = simulate(trace, config, policy, seed=3, check=False)
        assert first.outcomes == second.outcomes
    a = simulate(trace, config, "random", seed=1, check=False)
    b = simulate(trace, config, "random", seed=2, check=False)
    assert [o.endpoint for o in a.outcomes] != [o.endpoint for o in b.outcomes]


def reference_engine_run(trace, config) -> list[tuple[float, float, int]]:
    """The endpoint's own engine (kv_picker_bench.sim.engine), stepped as the HTTP server steps it."""
    engine = SimEngine(
        EngineConfig(
            block_size=config.block_size,
            num_gpu_blocks=config.num_gpu_blocks,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=config.max_model_len,
            cached_when=config.cached_when,
        )
    )
    arrivals = [(r.arrival_s, r) for r in trace.requests]
    first: dict[str, float] = {}
    finish: dict[str, float] = {}
    cached: dict[str, int] = {}
    index = 0
    last_end_s = 0.0
    while index < len(arrivals) or engine.has_work:
        if not engine.has_work:
            last_end_s = max(last_end_s, arrivals[index][0])
        while index < len(arrivals) and arrivals[index][0] <= last_end_s:
            arrival_s, request = arrivals[index]
            tokens = encode(prompt_text(request, trace.block_tokens))
            engine.add_request(str(request.index), tokens, request.output_tokens, now_s=arrival_s)
            index += 1
        result = engine.step(last_end_s)
        for token in result.tokens:
            if token.index == 0:
                first[token.req_id] = token.time_s
        for summary in result.finished:
            finish[summary.req_id] = summary.finish_s
            cached[summary.req_id] = summary.num_cached_tokens
        last_end_s = result.end_s
    return [(first[str(i)], finish[str(i)], cached[str(i)]) for i in range(len(arrivals))]


@pytest.mark.parametrize("cached_when", ["scheduled", "computed"])
@pytest.mark.parametrize("num_gpu_blocks", [2000, 700, 500])
def test_same_timing_and_hits_as_the_endpoint_engine(num_gpu_blocks: int, cached_when: str) -> None:
    # One endpoint, so routing plays no part: the event-driven simulator must reproduce the
    # step-by-step engine exactly (queueing, chunked prefill, decode stretches, blocks cached
    # as prefill and decode fill them, LRU eviction under pressure at 700 and 500 blocks).
    # Output lengths vary: the engine releases requests that finish in the same step in set
    # order, which depends on PYTHONHASHSEED, so simultaneous finishes would make its own
    # eviction order (not the simulator's) vary between processes.
    rng = random.Random(11)
    rows = []
    arrival_s = 0.0
    next_id = 10_000
    groups = [list(range(g * 400, g * 400 + 300)) for g in range(3)]
    for _ in range(60):
        arrival_s += rng.expovariate(3.0)
        shared = groups[rng.randrange(3)][: rng.choice([150, 250, 300])]
        question = list(range(next_id, next_id + rng.randrange(5, 30)))
        next_id += len(question)
        ids = shared + question
        rows.append((arrival_s, 16 * len(ids) - rng.randrange(16), rng.randrange(5, 120), ids))
    trace = make_trace(rows)
    config = small_cluster(
        1, num_gpu_blocks=num_gpu_blocks, max_num_seqs=8, cached_when=cached_when
    )
    expected = reference_engine_run(trace, config)
    result = simulate(trace, config, "round-robin", check=True)
    got = [(o.first_token_s, o.finish_s, o.cached_tokens) for o in result.outcomes]
    assert sum(c for _, _, c in expected) > 0  # the run did exercise the cache
    for (first_e, finish_e, cached_e), (first_g, finish_g, cached_g) in zip(
        expected, got, strict=True
    ):
        assert cached_g == cached_e
        assert first_g == pytest.approx(first_e, abs=1e-6)
        assert finish_g == pytest.approx(finish_e, abs=1e-6)


@pytest.mark.parametrize("cached_when", ["scheduled", "computed"])
def test_requests_admitted_together_share_what_the_first_computes(cached_when: str) -> None:
    # An endpoint busy with one long prefill: two requests with one prompt queue behind it
    # and are admitted in the same step. Under `scheduled` the second hits the blocks the
    # first was just allocated; under `computed` both compute the prompt.
    busy = list(range(1000, 1400))
    shared = list(range(64))
    rows = [(0.0, 400 * 16, 2, busy), (0.001, 64 * 16, 2, shared), (0.002, 64 * 16, 2, shared)]
    config = small_cluster(1, num_gpu_blocks=2000, cached_when=cached_when)
    result = simulate(make_trace(rows), config, "round-robin", check=True)
    assert [o.status for o in result.outcomes] == [OK] * 3
    cached = [o.cached_tokens for o in result.outcomes]
    assert cached == ([0, 0, 1008] if cached_when == "scheduled" else [0, 0, 0])


def test_an_unknown_engine_model_is_refused() -> None:
    with pytest.raises(ValueError, match="cached_when must be one of scheduled, computed"):
        small_cluster(1, cached_when="written")


def test_scraped_metrics_lag_by_the_scrape_interval() -> None:
    trace = make_trace([(0.0, 64, 2000, [1, 2, 3, 4]), (0.01, 64, 2000, [5, 6, 7, 8])])
    seen: list[tuple[float, float, float]] = []

    class Probe:
        type_name = "probe-scorer"

        def __init__(self, store, clock) -> None:
            self.store, self.clock = store, clock

        def score(self, request, candidates, out) -> None:
            endpoint = candidates[0].id
            seen.append(
                (self.clock(), self.store.scraped_s[endpoint], self.store.running[endpoint])
            )

    config = small_cluster(1, scrape_interval_s=1.0)
    registry = harness_registry()
    simulator = ClusterSimulator(
        trace, config, resolve_policy("round-robin").config(registry), registry
    )
    probe = Probe(simulator.store, simulator.clock)
    simulator.scheduler.profiles["default"].scorers.append(
        type("Step", (), {"plugin": probe, "weight": 1.0, "type_name": "probe"})()
    )
    simulator.run()
    # The second request, 10 ms later, still sees the scrape taken at 0 s (before the first).
    assert seen == [(0.0, 0.0, 0.0), (0.01, 0.0, 0.0)]


def test_kv_events_mirror_the_caches() -> None:
    trace = small_trace(150, rate=40.0)
    config = small_cluster(4, num_gpu_blocks=150)
    registry = harness_registry()
    simulator = ClusterSimulator(
        trace, config, resolve_policy("dynamo-cost").config(registry), registry
    )
    simulator.run()
    picker = next(
        p for p in simulator.scheduler.plugins.values() if isinstance(p, DynamoCostPicker)
    )
    assert picker.events is not None
    for engine in simulator.engines:
        bit = 1 << engine.id
        indexed = {key for key, holders in picker.events.holders.items() if holders & bit}
        cached = {key for key in indexed if engine.cache.contains(key)}
        assert indexed == cached
        assert len(indexed) == engine.cache.num_cached_blocks
    assert all(not picker._prefill_tokens[e] for e in picker._prefill_tokens)
    assert all(not picker._active_blocks[e] for e in picker._active_blocks)


def test_rejections_are_counted_not_lost() -> None:
    trace = make_trace(
        [
            (0.0, 64, 4, [1, 2, 3, 4]),
            (0.1, 6000, 4, list(range(10, 385))),
            (0.2, 64, 4, [1, 2, 3, 4]),
        ]
    )
    config = small_cluster(2, num_gpu_blocks=100, max_model_len=4096)
    result = simulate(trace, config, "round-robin")
    assert [o.status for o in result.outcomes] == [OK, REJECTED, OK]
    assert "max_model_len" in result.outcomes[1].detail
    small = replace(config, max_model_len=100_000)
    result = simulate(trace, small, "round-robin")
    assert result.outcomes[1].status == REJECTED and "KV blocks" in result.outcomes[1].detail
    assert all(o.status != ERROR for o in result.outcomes)


def test_prefill_decode_disaggregation() -> None:
    trace = small_trace(60, rate=10.0)
    config = small_cluster(
        4,
        num_gpu_blocks=400,
        transfer_bytes_per_s=1e9,
        kv_bytes_per_token=100_000,
    )
    config = replace(
        config,
        endpoints=(EndpointSetup("prefill"),) * 2 + (EndpointSetup("decode"),) * 2,
    )
    policy = pd_variant(Policy("rr", {"plugins": [{"type": "round-robin-picker"}]}))
    result = simulate(trace, config, policy)
    assert all(o.status == OK for o in result.outcomes)
    assert {o.endpoint for o in result.outcomes} == {2, 3}
    assert {o.prefill_endpoint for o in result.outcomes} == {0, 1}
    transferred = [o.transferred_tokens for o in result.outcomes]
    assert all(0 < t <= o.prompt_tokens for t, o in zip(transferred, result.outcomes, strict=True))
    # The first request (nothing cached anywhere): prefill, then the whole prompt's KV at
    # 100 kB/token over 1 GB/s plus 1 ms, then one step reading that KV for the first token.
    aggregated = simulate(trace, small_cluster(4, num_gpu_blocks=400), "round-robin")
    first = result.outcomes[0]
    transfer_s = 0.001 + first.prompt_tokens * 100_000 / 1e9
    first_step_s = config.timing.step_duration_s(
        hardware_class("H100"), 1, decode_context_tokens=first.prompt_tokens
    )
    assert first.transferred_tokens == first.prompt_tokens
    assert first.ttft_s == pytest.approx(aggregated.outcomes[0].ttft_s + transfer_s + first_step_s)
    assert result.endpoints[0].output_tokens == 0  # prefill endpoints produce no output
    threshold = pd_variant(Policy("rr", {"plugins": [{"type": "round-robin-picker"}]}), 10_000)
    result = simulate(trace, config, threshold)
    assert all(o.prefill_endpoint == -1 and o.transferred_tokens == 0 for o in result.outcomes)


def test_block_keys_follow_the_trace_blocks() -> None:
    trace = make_trace([(0.0, 1000, 1, [7, 9])], block_tokens=512)
    keys = block_keys(trace.requests[0], 512, 16)
    assert len(keys) == 1000 // 16
    assert keys[:32] == [7 * 32 + j for j in range(32)]
    assert keys[32] == 9 * 32
    with pytest.raises(ValueError, match="not a multiple"):
        simulate(make_trace([(0.0, 10, 1, [1])], block_tokens=24), small_cluster(1))


def test_load_scaling_raises_latency() -> None:
    trace = small_trace(200, rate=5.0)
    config = small_cluster(2, num_gpu_blocks=400)
    light = simulate(trace, config, "round-robin", check=False)
    heavy = simulate(slice_trace(trace, load=20.0), config, "round-robin", check=False)
    ttft = lambda r: sum(o.ttft_s for o in r.outcomes) / len(r.outcomes)  # noqa: E731
    assert ttft(heavy) > ttft(light)
    assert not math.isnan(ttft(heavy))


def test_a_chat_turn_hits_the_blocks_decode_filled() -> None:
    trace = ChatSpec(
        sessions=1,
        turns=2,
        groups=1,
        system_tokens=40,
        user_tokens=10,
        output_tokens=30,
        think_s=100.0,
    ).build()
    config = small_cluster(1, num_gpu_blocks=100)
    second = simulate(trace, config, "round-robin").outcomes[1]
    # Turn 1 leaves KV for 50 + 30 - 1 tokens: 4 full blocks, 3 of prompt and 1 filled by
    # decode; turn 2 (90 tokens) starts with all four.
    assert second.prompt_tokens == 90 and second.cached_tokens == 64
    without = simulate(trace, replace(config, cache_output_blocks=False), "round-robin")
    assert without.outcomes[1].cached_tokens == 48


def test_adapters_and_salts_reach_the_picker_and_keep_caches_apart() -> None:
    # One endpoint and one content: only the adapter or the salt tells the requests apart.
    namespaces = CacheNamespaces()
    content = list(range(1, 9))  # 128 tokens, 7 blocks can hit
    names = [(None, "a"), (None, "b"), (None, "a"), ("x", None), ("x", None), (None, None)]
    requests = [
        TraceRequest(
            i, float(i), 128, 4, namespaces.apply(content, lora, salt), lora=lora, salt=salt
        )
        for i, (lora, salt) in enumerate(names)
    ]
    trace = Trace("namespaces", 16, requests)
    registry = harness_registry()
    simulator = ClusterSimulator(
        trace,
        small_cluster(1, num_gpu_blocks=200),
        resolve_policy("kv-picker").config(registry),
        registry,
    )
    seen: list[tuple[object, ...]] = []
    route = simulator.director.route

    def spy(request: LLMRequest) -> RoutedRequest:
        seen.append((request.model, request.target_model, request.lora_adapter, request.cache_salt))
        texts.append(request.prompt.text)
        return route(request)

    texts: list[str] = []
    simulator.director.route = spy  # type: ignore[method-assign]
    result = simulator.run()
    model = simulator.config.model
    assert seen == [
        (model, model, None, "a"),
        (model, model, None, "b"),
        (model, model, None, "a"),
        ("x", model, "x", None),
        ("x", model, "x", None),
        (model, model, None, None),
    ]
    assert len(set(texts)) == 1  # the same characters under every adapter and salt
    assert [o.cached_tokens for o in result.outcomes] == [0, 0, 112, 0, 112, 0]
