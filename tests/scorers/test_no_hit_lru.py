"""no-hit-lru-scorer: llm-d's spreading of cold requests, and llm-d's configs that use it."""

from collections import Counter
from typing import Any

import pytest
import yaml

from kv_picker.config import parse_config_text
from kv_picker.endpoint import EndpointSpec
from kv_picker.errors import ConfigError
from kv_picker.plugins import builtin_registry
from kv_picker.scheduling.framework import PeerPick, ProfileResult, SchedulingResult
from kv_picker.scheduling.signals import PREFIX_MATCH, PrefixMatch
from kv_picker.scorers.no_hit_lru import NoHitLruParams, NoHitLruScorer
from tests.fakes import make_context, make_request, make_scheduler, make_store

# llm-d's "optimized baseline" profile, its content as its guides ship it.
OPTIMIZED_BASELINE = """
apiVersion: llm-d.ai/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
- type: no-hit-lru-scorer
schedulingProfiles:
- name: default
  plugins: [{pluginRef: queue-scorer, weight: 2},
    {pluginRef: kv-cache-utilization-scorer, weight: 2},
    {pluginRef: prefix-cache-scorer, weight: 3}, {pluginRef: no-hit-lru-scorer, weight: 2}]
"""


def _scorer(store, **params: Any) -> NoHitLruScorer:  # type: ignore[no-untyped-def]
    return NoHitLruScorer("lru", NoHitLruParams(**params), make_context(store))


def _scores(scorer: NoHitLruScorer, store, request=None) -> list[float]:  # type: ignore[no-untyped-def]
    out = [0.0] * len(store.all())
    scorer.score(request or make_request(), store.all(), out)
    return out


def _picked(scorer: NoHitLruScorer, request, endpoint, prefill=None) -> None:  # type: ignore[no-untyped-def]
    results = {"default": ProfileResult([endpoint], [endpoint], [1.0])}
    if prefill is not None:
        results["prefill"] = ProfileResult([prefill], [prefill], [1.0])
    scorer.on_pick(
        request,
        SchedulingResult("default", results, "prefill" if prefill is not None else None),
    )


def _cold_pick(scorer: NoHitLruScorer, store, endpoint, prefill=None) -> None:  # type: ignore[no-untyped-def]
    request = make_request()
    _scores(scorer, store, request)  # no prefix match published: cold
    _picked(scorer, request, endpoint, prefill)


def test_cold_request_ranks_never_seeded_endpoints_in_candidate_order() -> None:
    store = make_store(4)
    assert _scores(_scorer(store), store) == pytest.approx([1.0, 2 / 3, 1 / 3, 0.0])


def test_seeded_endpoints_follow_the_never_seeded_least_recent_first() -> None:
    store = make_store(3)
    scorer = _scorer(store)
    a, b, _c = store.all()
    _cold_pick(scorer, store, b)
    _cold_pick(scorer, store, a)
    # c never seeded: 1; b least recent (position 0): 1 - (1 + 0) / 2; a most recent: 0.
    assert _scores(scorer, store) == pytest.approx([0.0, 0.5, 1.0])
    _cold_pick(scorer, store, b)
    assert _scores(scorer, store) == pytest.approx([0.5, 0.0, 1.0])


def test_a_hit_anywhere_scores_neutral_and_is_not_recorded() -> None:
    store = make_store(3)
    scorer = _scorer(store)
    a, b, _c = store.all()
    request = make_request()
    request.state[PREFIX_MATCH] = PrefixMatch(16.0, 10, {b.id: 3})
    assert _scores(scorer, store, request) == [0.5, 0.5, 0.5]
    _picked(scorer, request, a)
    assert len(scorer.order) == 0
    # A match with no block held anywhere is cold.
    empty = make_request()
    empty.state[PREFIX_MATCH] = PrefixMatch(16.0, 10, {})
    assert _scores(scorer, store, empty) == pytest.approx([1.0, 0.5, 0.0])


def test_single_candidate_scores_one() -> None:
    store = make_store(1)
    assert _scores(_scorer(store), store) == [1.0]


def test_size_bound_and_departed_endpoints_leave_the_order() -> None:
    store = make_store(3)
    scorer = _scorer(store, lruSize=2)
    a, b, c = store.all()
    for endpoint in (a, b, c):
        _cold_pick(scorer, store, endpoint)
    assert scorer.order.ids() == [b.id, c.id]  # a, the least recent, evicted
    store.set_endpoints(EndpointSpec(e.address, {}) for e in (a, c))
    assert scorer.order.ids() == [c.id]


def test_prefill_endpoint_of_a_disaggregated_pick_is_seeded_too() -> None:
    store = make_store(3)
    scorer = _scorer(store)
    a, b, _c = store.all()
    _cold_pick(scorer, store, a, prefill=b)
    assert scorer.order.ids() == [a.id, b.id]


def test_peer_workers_picks_move_the_order() -> None:
    store = make_store(3)
    scorer = _scorer(store)
    a, b, c = store.all()
    request = make_request()
    _scores(scorer, store, request)
    assert scorer.pick_keys(request) == (1,)
    scorer.record_peer_pick(PeerPick(c.id, a.id), [1])
    assert scorer.order.ids() == [c.id, a.id]
    hit = make_request()
    hit.state[PREFIX_MATCH] = PrefixMatch(16.0, 10, {b.id: 1})
    _scores(scorer, store, hit)
    assert scorer.pick_keys(hit) is None


def test_llm_d_optimized_baseline_loads_and_spreads_cold_requests() -> None:
    document = yaml.safe_load(OPTIMIZED_BASELINE)
    store = make_store(4)
    scheduler = make_scheduler(document, store, seed=5)
    counts: Counter[str] = Counter()
    for i in range(8):
        prompt = f"unrelated document {i}: " + f"words of document {i} " * 60
        counts[scheduler.schedule(make_request(prompt), store.all()).destination.address] += 1
    # Equal queues and KV use everywhere: the cold requests go around the pool in turn.
    assert sorted(counts.values()) == [2, 2, 2, 2]
    # A prompt seen before goes back to where it was sent (prefix 3 outweighs the LRU's 2).
    again = "unrelated document 3: " + "words of document 3 " * 60
    first = scheduler.schedule(make_request(again), store.all()).destination
    assert scheduler.schedule(make_request(again), store.all()).destination == first


def test_llm_d_parameter_spellings_are_accepted_and_unknown_ones_refused() -> None:
    registry = builtin_registry(include_entry_points=False)
    text = OPTIMIZED_BASELINE.replace(
        "- type: no-hit-lru-scorer\n",
        "- type: no-hit-lru-scorer\n  parameters:\n"
        "    prefixPluginName: prefix-cache-scorer\n"
        "    prefixPluginType: prefix-cache-scorer\n"
        "    prefixMatchInfoProducerName: approx-prefix-cache-producer\n"
        "    lruSize: 2048\n",
    )
    config = parse_config_text(text, registry)
    (lru,) = [p for p in config.plugins if p.type == "no-hit-lru-scorer"]
    assert lru.params.lruSize == 2048
    with pytest.raises(ConfigError, match="lruSiz"):
        parse_config_text(text.replace("lruSize", "lruSiz"), registry)
    with pytest.raises(ConfigError, match="lruSize"):
        parse_config_text(text.replace("lruSize: 2048", "lruSize: many"), registry)
    # As upstream, 0 or less is the default size.
    negative = parse_config_text(text.replace("lruSize: 2048", "lruSize: -1"), registry)
    (lru,) = [p for p in negative.plugins if p.type == "no-hit-lru-scorer"]
    store = make_store(2)
    assert NoHitLruScorer("n", lru.params, make_context(store)).order.size == 1024
