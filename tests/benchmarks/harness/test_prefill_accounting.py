"""The simulator routes through the service's director, which keeps the store's queued
prefill work.

Token-aware scorers (``predicted-latency-scorer``) read ``EndpointStore.prefill_tokens`` and
``prefill_requests``; without that accounting in a replay they would see zeros and a replay
would say nothing about them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any

import pytest

from kv_picker.request import LLMRequest
from kv_picker_bench.harness.policies import Policy, harness_registry, pd_variant, resolve_policy
from kv_picker_bench.harness.simulator import OK, ClusterSimulator, EndpointSetup, SimulationResult
from tests.benchmarks.harness.conftest import make_trace, simulate, small_cluster, small_trace

TOKEN_AWARE = Policy(
    "token-aware",
    {
        "plugins": [
            {"type": "prefix-cache-scorer"},
            {"type": "predicted-latency-scorer"},
            {"type": "max-score-picker"},
        ],
        "schedulingProfiles": [
            {
                "name": "default",
                "plugins": [
                    {"pluginRef": "prefix-cache-scorer", "weight": 1},
                    {"pluginRef": "predicted-latency-scorer", "weight": 1},
                    {"pluginRef": "max-score-picker"},
                ],
            }
        ],
    },
)


def _replay_recording(
    simulator: ClusterSimulator, fields: tuple[str, str] = ("prefill_tokens", "prefill_requests")
) -> tuple[SimulationResult, list[tuple[list[Any], list[Any]]]]:
    """Run, keeping two of the store's per-endpoint lists (by default its queued prefills) as
    each pick saw them."""
    store = simulator.store
    first, second = fields
    seen: list[tuple[list[Any], list[Any]]] = []
    schedule = simulator.scheduler.schedule

    def recording(request: LLMRequest, candidates: Any, *args: Any) -> Any:
        seen.append((list(getattr(store, first)), list(getattr(store, second))))
        return schedule(request, candidates, *args)

    simulator.scheduler.schedule = recording  # type: ignore[method-assign]
    return simulator.run(), seen


def _simulator(trace: Any, config: Any, policy: Policy) -> ClusterSimulator:
    registry = harness_registry()
    return ClusterSimulator(
        trace, config, policy.config(registry), registry, policy.name, check_invariants=True
    )


def test_a_pick_sees_the_prefill_queued_ahead() -> None:
    # One endpoint; the second request arrives while the first (nothing cached) is prefilling.
    trace = make_trace([(0.0, 4000, 4, list(range(1, 251))), (0.01, 64, 4, [900, 901, 902, 903])])
    simulator = _simulator(trace, small_cluster(1, num_gpu_blocks=1000), TOKEN_AWARE)
    result, seen = _replay_recording(simulator)
    assert [o.status for o in result.outcomes] == [OK, OK]
    assert seen[0] == ([0.0], [0])
    assert seen[1] == ([4000.0], [1])
    assert simulator.store.prefill_tokens == [0.0]
    assert simulator.store.prefill_requests == [0]


def test_queued_prefills_rise_during_a_replay_and_return_to_zero() -> None:
    simulator = _simulator(small_trace(120, rate=40.0), small_cluster(4), TOKEN_AWARE)
    result, seen = _replay_recording(simulator)
    assert all(o.status == OK for o in result.outcomes)
    assert max(sum(tokens) for tokens, _ in seen) > 0
    assert max(sum(requests) for _, requests in seen) > 1
    assert simulator.store.prefill_tokens == [0.0] * 4
    assert simulator.store.prefill_requests == [0] * 4


def test_a_rejected_request_releases_its_prefill() -> None:
    # The second request needs more KV blocks than the endpoint holds: refused at admission.
    trace = make_trace(
        [(0.0, 64, 4, [1, 2, 3, 4]), (0.1, 6000, 4, list(range(10, 385))), (0.2, 64, 4, [1])]
    )
    config = small_cluster(1, num_gpu_blocks=100)
    simulator = _simulator(trace, config, TOKEN_AWARE)
    result, seen = _replay_recording(simulator)
    assert result.outcomes[1].status != OK
    assert seen[2][1] == [0]  # nothing of the refused request left queued
    assert simulator.store.prefill_requests == [0]


def test_under_pd_the_prefill_endpoint_carries_the_work() -> None:
    trace = make_trace(
        [(0.0, 4000, 4, list(range(1, 251))), (0.01, 4000, 4, list(range(1001, 1251)))]
    )
    config = replace(
        small_cluster(2, num_gpu_blocks=1000),
        endpoints=(EndpointSetup("prefill"), EndpointSetup("decode")),
    )
    simulator = _simulator(trace, config, pd_variant(TOKEN_AWARE))
    result, seen = _replay_recording(simulator)
    assert [o.prefill_endpoint for o in result.outcomes] == [0, 0]
    assert seen[1] == ([4000.0, 0.0], [1, 0])
    assert simulator.store.prefill_requests == [0, 0]


@pytest.mark.parametrize("first_byte_seen", [True, False], ids=["first-bytes", "scraped-count"])
def test_under_pd_the_prefill_endpoint_counts_the_request_in_flight_until_its_first_byte(
    first_byte_seen: bool,
) -> None:
    # The second request arrives while the first is prefilling (0.4 s of work), the third
    # after the first's prefill leg has ended but while it still decodes at the decode endpoint.
    # Without first bytes, the prefill endpoint's own first-token count (its prefill leg's
    # token) ends it there.
    trace = make_trace(
        [
            (0.0, 4000, 400, list(range(1, 251))),
            (0.01, 4000, 4, list(range(1001, 1251))),
            (2.0, 4000, 4, list(range(2001, 2251))),
        ]
    )
    config = replace(
        small_cluster(2, num_gpu_blocks=1000, first_byte_seen=first_byte_seen),
        endpoints=(EndpointSetup("prefill"), EndpointSetup("decode")),
    )
    simulator = _simulator(trace, config, pd_variant(TOKEN_AWARE))
    result, seen = _replay_recording(simulator, ("in_flight", "in_flight_tokens"))
    store = simulator.store
    assert [o.prefill_endpoint for o in result.outcomes] == [0, 0, 0]
    assert [o.status for o in result.outcomes] == [OK, OK, OK]
    # The first request, at both endpoints; its prompt tokens where they will be decoded.
    assert seen[1] == ([1, 1], [0.0, 4000.0])
    assert seen[2] == ([0, 1], [0.0, 4000.0])  # prefilled: at the decode endpoint only
    assert store.in_flight == [0, 0] and store.in_flight_tokens == [0.0, 0.0]


def test_the_store_learns_how_long_an_endpoints_requests_last() -> None:
    # Two requests one after the other on one endpoint: the average starts at the first one's
    # duration (pick to end) and moves a twentieth of the way toward the second's.
    trace = make_trace([(0.0, 640, 8, list(range(1, 41))), (5.0, 640, 40, list(range(101, 141)))])
    simulator = _simulator(trace, small_cluster(1, num_gpu_blocks=1000), TOKEN_AWARE)
    result = simulator.run()
    first, second = (o.finish_s - o.arrival_s for o in result.outcomes)
    assert second > first > 0
    assert simulator.store.request_s[0] == pytest.approx(first + 0.05 * (second - first))


def test_a_refused_request_does_not_count_toward_how_long_requests_last() -> None:
    trace = make_trace([(0.0, 64, 4, [1, 2, 3, 4]), (1.0, 6000, 4, list(range(10, 385)))])
    simulator = _simulator(trace, small_cluster(1, num_gpu_blocks=100), TOKEN_AWARE)
    result = simulator.run()
    assert result.outcomes[1].status != OK
    served = result.outcomes[0]
    assert simulator.store.request_s[0] == pytest.approx(served.finish_s - served.arrival_s)


@pytest.mark.parametrize(
    ("first_byte_seen", "first_tokens_scraped", "queued"),
    [(True, True, False), (False, True, False), (False, False, True)],
    ids=["first-bytes", "scraped-first-tokens", "end-only"],
)
def test_without_first_bytes_a_prefill_stays_queued_until_the_count_or_its_end_says(
    first_byte_seen: bool, first_tokens_scraped: bool, queued: bool
) -> None:
    # The second request arrives while the first decodes its 300 tokens, long after its prefill.
    trace = make_trace([(0.0, 4000, 300, list(range(1, 251))), (1.0, 64, 4, [900, 901, 902, 903])])
    config = small_cluster(
        1,
        num_gpu_blocks=1000,
        first_byte_seen=first_byte_seen,
        first_tokens_scraped=first_tokens_scraped,
    )
    simulator = _simulator(trace, config, TOKEN_AWARE)
    result, seen = _replay_recording(simulator)
    assert [o.status for o in result.outcomes] == [OK, OK]
    assert result.outcomes[0].first_token_s < 1.0 < result.outcomes[0].finish_s
    # Without first bytes, the scrape after the first token ends the prefill (the endpoint's
    # first-token count grew); a server that exports no count leaves it queued to the end.
    assert seen[1] == (([4000.0], [1]) if queued else ([0.0], [0]))
    # Either way, every request's end releases what it queued.
    assert simulator.store.prefill_tokens == [0.0]
    assert simulator.store.prefill_requests == [0]


@pytest.mark.parametrize("baseline", ["dynamo-cost", "sglang-cache-aware"])
def test_under_pd_a_baselines_prefill_copy_spreads_a_burst_over_the_prefill_pool(
    baseline: str,
) -> None:
    # Eight distinct 4,000-token prompts at once on two prefill and two decode endpoints: each
    # prefill copy books what it sends on its own prefill endpoints, so the burst is shared
    # between them. (Booked on the destination, the prefill pool looked idle to it whatever it
    # had sent there, and Dynamo's rule sent every prompt to one prefill endpoint.)
    trace = make_trace(
        [(0.001 * i, 4000, 4, list(range(1000 * i + 1, 1000 * i + 251))) for i in range(8)]
    )
    config = replace(
        small_cluster(4, num_gpu_blocks=4000),
        endpoints=(
            EndpointSetup("prefill"),
            EndpointSetup("prefill"),
            EndpointSetup("decode"),
            EndpointSetup("decode"),
        ),
    )
    result = simulate(trace, config, pd_variant(resolve_policy(baseline)))
    assert all(o.status == OK for o in result.outcomes)
    counts = Counter(o.prefill_endpoint for o in result.outcomes)
    assert set(counts) == {0, 1} and min(counts.values()) >= 3, counts
