"""Shared helpers of the harness tests: small traces, clusters and runs."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kv_picker_bench.harness.policies import Policy, harness_registry, resolve_policy
from kv_picker_bench.harness.simulator import (
    ClusterConfig,
    ClusterSimulator,
    EndpointSetup,
    SimulationResult,
)
from kv_picker_bench.harness.traces import SharedPrefixSpec, Trace, TraceRequest


def make_trace(
    rows: Sequence[tuple[float, int, int, list[int]]], block_tokens: int = 16, name: str = "t"
) -> Trace:
    """A trace from (arrival_s, input_tokens, output_tokens, hash_ids) rows."""
    requests = [
        TraceRequest(index=i, arrival_s=a, input_tokens=n, output_tokens=o, hash_ids=list(ids))
        for i, (a, n, o, ids) in enumerate(rows)
    ]
    return Trace(name, block_tokens, requests, "test")


def small_trace(requests: int = 120, seed: int = 0, rate: float = 20.0) -> Trace:
    """Shared-prefix requests that exercise hits, queueing and eviction on small caches."""
    return SharedPrefixSpec(
        groups=6,
        users=4,
        context_tokens=700,
        question_tokens=90,
        output_tokens=24,
        requests=requests,
        rate=rate,
        seed=seed,
    ).build("small")


def small_cluster(count: int = 4, num_gpu_blocks: int = 300, **overrides: object) -> ClusterConfig:
    return ClusterConfig(
        endpoints=tuple(EndpointSetup() for _ in range(count)),
        num_gpu_blocks=num_gpu_blocks,
        **overrides,  # type: ignore[arg-type]
    )


def simulate(
    trace: Trace,
    config: ClusterConfig,
    policy: str | Policy = "kv-picker",
    seed: int = 0,
    check: bool = True,
) -> SimulationResult:
    registry = harness_registry()
    chosen = resolve_policy(policy) if isinstance(policy, str) else policy
    simulator = ClusterSimulator(
        trace,
        config,
        chosen.config(registry),
        registry,
        chosen.name,
        seed=seed,
        needs_prompt=chosen.needs_prompt,
        check_invariants=check,
    )
    return simulator.run()


@pytest.fixture
def trace() -> Trace:
    return small_trace()
