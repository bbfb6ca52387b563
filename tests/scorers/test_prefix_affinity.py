"""prefix-cache-affinity-filter and token-load-scorer: llm-d's optimized-baseline plugins."""

from __future__ import annotations

import re
from typing import Any

import pytest
import yaml

from kv_picker.config import parse_config_text
from kv_picker.errors import ConfigError
from kv_picker.plugins import builtin_registry
from kv_picker.scheduling.signals import PREFIX_MATCH, PrefixMatch
from kv_picker.scorers.prefix_affinity import PrefixAffinityParams, PrefixCacheAffinityFilter
from kv_picker.scorers.token_load import TokenLoadParams, TokenLoadScorer
from tests.fakes import make_context, make_request, make_scheduler, make_store

HEADER = "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"

# llm-d's optimized-baseline guide, two released shapes of its plugin list.
OPTIMIZED_BASELINE_TOKENS = (
    HEADER
    + """
plugins:
- type: token-load-scorer
- type: inflight-load-producer
- type: approx-prefix-cache-producer
  parameters:
      maxPrefixTokensToMatch: 40960
- type: prefix-cache-affinity-filter
  parameters:
    affinityThreshold: 0.80
    maxTokensInFlightPenalty: 286720
    maxTTFTPenaltyMs: 0
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: prefix-cache-affinity-filter
  - pluginRef: token-load-scorer
"""
)
OPTIMIZED_BASELINE_TTFT = (
    HEADER
    + """
plugins:
- type: approx-prefix-cache-producer
- type: inflight-load-producer
- type: prefix-cache-affinity-filter
  parameters:
    peakPrefillThroughput: 100
- type: token-load-scorer
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: prefix-cache-affinity-filter
  - pluginRef: token-load-scorer
"""
)

REGISTRY = builtin_registry(include_entry_points=False)


def yaml_document(text: str) -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load(text)
    return document


class FakeMatcher:
    """A prefix scorer stand-in that publishes a given match (blocks of 16 tokens)."""

    type_name = "prefix-cache-scorer"

    def __init__(self, held: dict[int, int], total: int = 10) -> None:
        self.held, self.total = held, total

    def match(self, request: Any, candidates: Any) -> PrefixMatch:
        match = PrefixMatch(16.0, self.total, dict(self.held))
        request.state[PREFIX_MATCH] = match
        return match


def affinity(store: Any, held: dict[int, int], **params: Any) -> PrefixCacheAffinityFilter:
    plugin = PrefixCacheAffinityFilter("f", PrefixAffinityParams(**params), make_context(store))
    plugin.bind_plugins({"p": FakeMatcher(held)})
    return plugin


def kept(plugin: PrefixCacheAffinityFilter, store: Any) -> list[int]:
    return [e.id for e in plugin.filter(make_request(), store.all())]


def test_narrows_to_the_endpoints_holding_the_prompt() -> None:
    store = make_store(3)
    assert kept(affinity(store, {0: 9, 1: 8, 2: 1}), store) == [0, 1]
    assert kept(affinity(store, {0: 7, 2: 1}), store) == [0, 1, 2]  # none holds 80%
    assert kept(affinity(store, {0: 9}, affinityThreshold=0.0), store) == [0, 1, 2]
    assert kept(affinity(store, {0: 9}, explorationProbability=1.0), store) == [0, 1, 2]
    one = make_store(1)
    assert kept(affinity(one, {}), one) == [0]


def _load(store: Any, tokens: list[float], requests: list[int] | None = None) -> None:
    for endpoint, count in zip(store.all(), tokens, strict=True):
        store.prefill_tokens[endpoint.id] = count
    for endpoint, count in zip(store.all(), requests or [], strict=False):
        store.in_flight[endpoint.id] = count


def test_the_ttft_gate_breaks_stickiness_when_the_holder_is_too_busy() -> None:
    store = make_store(3)
    plugin = affinity(store, {0: 10}, maxTTFTPenaltyMs=1000, peakPrefillThroughput=1000)
    _load(store, [1500, 600, 900])  # 1.5 s queued on the holder, 0.6 s on the best other
    assert kept(plugin, store) == [0]  # 0.9 s more: within the penalty
    _load(store, [1700, 600, 900])  # 1.1 s more
    assert kept(plugin, store) == [0, 1, 2]
    assert (plugin.narrowed, plugin.broken) == (1, 1)


def test_the_token_gate_is_the_same_gate_in_tokens() -> None:
    store = make_store(2)
    plugin = affinity(store, {0: 9}, maxTTFTPenaltyMs=0, maxTokensInFlightPenalty=100)
    _load(store, [500, 450])
    assert kept(plugin, store) == [0]
    _load(store, [500, 50])
    assert kept(plugin, store) == [0, 1]


def test_the_request_gate_adds_the_others_within_the_penalty() -> None:
    store = make_store(3)
    plugin = affinity(
        store,
        {0: 10},
        maxTTFTPenaltyMs=1000,
        peakPrefillThroughput=1000,
        maxInFlightRequestsDelta=2,
    )
    # This request's 160 uncached tokens cost 0.16 s off the holder; endpoint 2 has 1 s queued.
    _load(store, [0, 0, 1000], requests=[5, 2, 0])
    assert kept(plugin, store) == [0, 1]  # 3 more requests on the holder; 2 is 1.16 s slower
    _load(store, [0, 0, 1000], requests=[4, 2, 0])
    assert kept(plugin, store) == [0]


@pytest.mark.parametrize(
    ("params", "message"),
    [
        ({"affinityThreshold": 1.5}, "'affinityThreshold' must be in [0, 1]"),
        ({"explorationProbability": -0.1}, "'explorationProbability' must be in [0, 1]"),
        ({"maxTTFTPenaltyMs": -1}, "must be >= 0"),
        ({"maxInFlightRequestsDelta": 2, "maxTTFTPenaltyMs": 0}, "maxTTFTPenaltyMs must be > 0"),
        ({"ttftSource": "latencyPredictor"}, "not built here"),
        ({"ttftSource": "guess"}, "'ttftSource' must be one of"),
        ({"peakPrefillThroughput": 0}, "'peakPrefillThroughput' must be > 0"),
    ],
)
def test_bad_parameters_are_refused(params: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        PrefixAffinityParams(**params).validate()


def test_token_load_counts_queued_and_own_uncached_tokens() -> None:
    store = make_store(3)
    _load(store, [0, 1000, 4000])
    scorer = TokenLoadScorer("t", TokenLoadParams(queueThresholdTokens=5000), make_context(store))
    request = make_request("abcd" * 1000)  # 1,000 tokens by the estimate
    request.state[PREFIX_MATCH] = PrefixMatch(16.0, 62, {0: 62})  # endpoint 0 holds 992
    out = [0.0] * 3
    scorer.score(request, store.all(), out)
    assert out == pytest.approx([1 - 8 / 5000, 1 - 2000 / 5000, 0.0])
    nothing = make_request("")
    scorer.score(nothing, store.all()[:1], out)
    assert out[0] == 1.0  # no load at all
    assert TokenLoadScorer("t", TokenLoadParams(-1), make_context(store)).threshold == 4194304


@pytest.mark.parametrize(
    "text", [OPTIMIZED_BASELINE_TOKENS, OPTIMIZED_BASELINE_TTFT], ids=["tokens", "ttft"]
)
def test_the_optimized_baseline_guide_loads_and_keeps_prompts_home(text: str) -> None:
    config = parse_config_text(text, REGISTRY)
    types = {p.name: p.type for p in config.plugins}
    # The producer now holds the prefix index the filter reads; it scores in no profile.
    assert types["approx-prefix-cache-producer"] == "prefix-cache-scorer"
    assert "inflight-load-producer" not in types
    (profile,) = config.profiles
    assert [e.plugin_ref for e in profile.entries] == [
        "prefix-cache-affinity-filter",
        "token-load-scorer",
        "max-score-picker",
    ]
    store = make_store(4)
    scheduler = make_scheduler(yaml_document(text), store)
    prompt = "shared system prompt and document " * 60
    first = scheduler.schedule(make_request(prompt), store.all())
    home = first.primary.targets[0]
    # The same prompt sticks to its home while the others are idle and it is not overloaded.
    for _ in range(3):
        again = scheduler.schedule(make_request(prompt), store.all())
        assert again.primary.targets[0] == home
        assert [e.id for e in again.primary.candidates] == [home.id]
    # Once the home has far more queued than another endpoint, the gate lets the request go.
    store.prefill_tokens[home.id] = 10_000_000
    moved = scheduler.schedule(make_request(prompt), store.all())
    assert len(moved.primary.candidates) == 4
    assert moved.primary.targets[0] != home


def test_the_filter_reads_the_prefix_scorer_it_is_told_to() -> None:
    text = (
        HEADER
        + """
plugins:
- type: prefix-cache-scorer
  name: a
- type: prefix-cache-scorer
  name: b
- type: prefix-cache-affinity-filter
schedulingProfiles:
- name: default
  plugins: [{pluginRef: prefix-cache-affinity-filter}, {pluginRef: a}, {pluginRef: b}]
"""
    )
    with pytest.raises(ConfigError, match="2 are declared"):
        make_scheduler(yaml_document(text), make_store(2))
    named = text.replace(
        "- type: prefix-cache-affinity-filter\n",
        "- type: prefix-cache-affinity-filter\n  parameters: {prefixMatchInfoProducerName: b}\n",
    )
    scheduler = make_scheduler(yaml_document(named), make_store(2))
    assert scheduler.plugins["prefix-cache-affinity-filter"]._matcher is scheduler.plugins["b"]
    wrong = named.replace("prefixMatchInfoProducerName: b", "prefixMatchInfoProducerName: c")
    with pytest.raises(ConfigError, match="'c' names no prefix-cache-scorer"):
        make_scheduler(yaml_document(wrong), make_store(2))


def test_without_a_producer_the_default_one_is_made() -> None:
    text = (
        HEADER
        + """
plugins:
- type: prefix-cache-affinity-filter
- type: token-load-scorer
"""
    )
    config = parse_config_text(text, REGISTRY)
    assert {p.name: p.type for p in config.plugins}["approx-prefix-cache-producer"] == (
        "prefix-cache-scorer"
    )
    # No profiles given: the default one lists the declared plugins, not the made scorer.
    (profile,) = config.profiles
    assert [e.plugin_ref for e in profile.entries] == [
        "prefix-cache-affinity-filter",
        "token-load-scorer",
        "max-score-picker",
    ]


def test_the_filter_reads_the_scorer_that_took_its_producer_over() -> None:
    text = (
        HEADER
        + """
plugins:
- type: approx-prefix-cache-producer
  name: cpu-producer
  parameters: {lruCapacityPerServer: 1000}
- type: prefix-cache-scorer
  name: gpu-prefix
- type: prefix-cache-scorer
  name: cpu-prefix
  parameters: {prefixMatchInfoProducerName: cpu-producer}
- type: prefix-cache-affinity-filter
  parameters: {prefixMatchInfoProducerName: cpu-producer}
schedulingProfiles:
- name: default
  plugins: [{pluginRef: prefix-cache-affinity-filter}, {pluginRef: gpu-prefix},
    {pluginRef: cpu-prefix}]
"""
    )
    config = parse_config_text(text, REGISTRY)
    assert "cpu-producer" not in {p.name for p in config.plugins}
    scheduler = make_scheduler(yaml_document(text), make_store(2))
    filter_plugin = scheduler.plugins["prefix-cache-affinity-filter"]
    assert filter_plugin._matcher is scheduler.plugins["cpu-prefix"]
