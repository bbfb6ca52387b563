"""The baselines' rules, checked on hand-made states, and policy resolution."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml

from kv_picker.endpoint import EndpointSpec
from kv_picker.errors import ConfigError
from kv_picker.request import LLMRequest, Prompt
from kv_picker.scheduling.context import BuildContext
from kv_picker.scheduling.framework import ProfileResult, SchedulingResult
from kv_picker.scheduling.signals import PROMPT_TOKENS
from kv_picker.state.endpoints import EndpointStore
from kv_picker_bench.harness.policies import (
    BASELINES,
    DynamoCostParams,
    DynamoCostPicker,
    Policy,
    RoundRobinParams,
    RoundRobinPicker,
    SGLangCacheAwareParams,
    SGLangCacheAwarePicker,
    harness_registry,
    pd_variant,
    resolve_policies,
    resolve_policy,
)
from kv_picker_bench.harness.simulator import BLOCK_KEYS_STATE
from kv_picker_bench.sim.timing import TIMING_PROFILES


def store_with(count: int) -> EndpointStore:
    store = EndpointStore(lambda: 0.0)
    store.set_endpoints(EndpointSpec(f"10.0.0.{i + 1}:8000") for i in range(count))
    for endpoint in store.all():
        store.update_metrics(endpoint.id, waiting=0, running=0, kv_usage=0)
    return store


def request(prompt: str = "", request_id: str = "r", **state: object) -> LLMRequest:
    return LLMRequest(
        request_id=request_id,
        model="m",
        target_model="m",
        path="/v1/completions",
        prompt=Prompt("completions", prompt),
        state=dict(state),
    )


def picked(endpoint) -> SchedulingResult:  # type: ignore[no-untyped-def]
    return SchedulingResult("default", {"default": ProfileResult([endpoint], [endpoint], [0.0])})


def test_round_robin_rotates() -> None:
    store = store_with(3)
    picker = RoundRobinPicker(
        "rr", RoundRobinParams(), BuildContext(store, random.Random(), store.now, 2.0)
    )
    candidates = store.all()
    picks = [picker.pick(request(), candidates, [0.0] * 3)[0].id for _ in range(7)]
    assert picks == [0, 1, 2, 0, 1, 2, 0]


def test_sglang_cache_aware_rules() -> None:
    store = store_with(3)
    ctx = BuildContext(store, random.Random(), store.now, 2.0)
    picker = SGLangCacheAwarePicker("s", SGLangCacheAwareParams(blockSizeChars=8), ctx)
    candidates = store.all()
    shared = "system prompt shared by all " * 4  # 112 characters
    first = request(shared + "question one")
    # Nothing recorded, all loads equal: the first least-loaded endpoint (sgl-router's tie rule).
    assert picker.pick(first, candidates, [])[0].id == 0
    picker.on_pick(first, picked(candidates[0]))
    store.in_flight[0] = 5
    # Long shared prefix (match rate > 0.3): stays with endpoint 0 despite its load.
    second = request(shared + "question two")
    assert picker.pick(second, candidates, [])[0].id == 0
    # Short match (below the threshold): least loaded instead, first on ties.
    third = request(shared[:16] + "x" * 200)
    assert picker.pick(third, candidates, [])[0].id == 1
    # Imbalance: max - min > 64 and max > 1.5 * min -> least loaded, cache ignored.
    store.in_flight[:] = [100, 20, 30]
    assert picker.pick(request(shared + "question three"), candidates, [])[0].id == 1
    store.in_flight[:] = [100, 80, 90]  # abs gap 20 < 64: balanced, cache wins
    assert picker.pick(request(shared + "question four"), candidates, [])[0].id == 0


def test_dynamo_cost_function_matches_the_documented_example() -> None:
    # Dynamo's docs: weight 1.0, workers (prefill 8, decode 10) = 18, (5, 5) = 10 <- chosen,
    # (2, 9) = 11. Reproduce those block counts with overlaps and in-flight requests.
    store = store_with(3)
    ctx = BuildContext(store, random.Random(0), store.now, 2.0)
    picker = DynamoCostPicker("d", DynamoCostParams(blockSize=16), ctx)
    assert picker.events is not None
    keys = list(range(10))
    picker.on_blocks_stored(0, keys[:2])  # overlap 2 -> 8 blocks to prefill
    picker.on_blocks_stored(1, keys[:5])  # overlap 5 -> 5
    picker.on_blocks_stored(2, keys[:8])  # overlap 8 -> 2
    picker._active_blocks.update({0: 0, 1: -5, 2: -1})  # decode = active + 10 request blocks
    req = request(**{BLOCK_KEYS_STATE: keys, PROMPT_TOKENS: 160})
    assert picker.pick(req, store.all(), [])[0].id == 1
    # Routing bookkeeping: pending prefill and active blocks follow the request.
    picker._active_blocks.clear()
    picker.on_pick(req, picked(store.all()[1]))
    assert picker._prefill_tokens[1] == 80 and picker._active_blocks[1] == 10
    picker.on_first_token(req, 1)
    assert picker._prefill_tokens[1] == 0
    picker.on_finished(req, 1)
    assert picker._active_blocks[1] == 0
    picker.on_blocks_removed(1, keys[:5])
    assert all(not holders & 0b10 for holders in picker.events.holders.values())


def pd_picked(decode_endpoint, prefill_endpoint) -> SchedulingResult:  # type: ignore[no-untyped-def]
    """A P/D pick: the decode profile's endpoint is the destination, the prefill profile's
    computes the prompt."""
    return SchedulingResult(
        "decode",
        {
            "decode": ProfileResult([decode_endpoint], [decode_endpoint], [0.0]),
            "prefill": ProfileResult([prefill_endpoint], [prefill_endpoint], [0.0]),
        },
        prefill_profile="prefill",
    )


def test_under_pd_each_dynamo_copy_books_the_request_on_its_own_sides_endpoint() -> None:
    # Endpoints 0-1 prefill, 2-3 decode; one copy of the picker per profile, as pd_variant
    # builds them, both seeing every pick's whole result on the same request.
    store = store_with(4)
    ctx = BuildContext(store, random.Random(0), store.now, 2.0)
    prefill = DynamoCostPicker("prefill-d", DynamoCostParams(blockSize=16), ctx)
    decode = DynamoCostPicker("decode-d", DynamoCostParams(blockSize=16), ctx)
    endpoints = store.all()
    req = request(**{BLOCK_KEYS_STATE: list(range(10)), PROMPT_TOKENS: 160})
    assert decode.pick(req, endpoints[2:], [])[0].id in (2, 3)
    chosen_decode = req.state["decode-d.picked"]
    assert prefill.pick(req, endpoints[:2], [])[0].id in (0, 1)
    chosen_prefill = req.state["prefill-d.picked"]
    result = pd_picked(endpoints[chosen_decode], endpoints[chosen_prefill])
    for copy in (decode, prefill):
        copy.on_pick(req, result)
    # The prefill copy's load is on the prefill endpoint it ranks, not on the destination.
    assert prefill._active_blocks == {chosen_prefill: 10}
    assert prefill._prefill_tokens == {chosen_prefill: 160}
    assert decode._active_blocks == {chosen_decode: 10}
    # So the next prompt goes to the other prefill endpoint.
    other = request(request_id="r2", **{BLOCK_KEYS_STATE: [99], PROMPT_TOKENS: 16})
    assert prefill.pick(other, endpoints[:2], [])[0].id == 1 - chosen_prefill
    # The prefill endpoint's part ends at the first token; the destination's at the end.
    for copy in (decode, prefill):
        copy.on_first_token(req, chosen_decode)
    assert prefill._active_blocks[chosen_prefill] == 0 and not prefill._requests
    assert decode._active_blocks[chosen_decode] == 10
    for copy in (decode, prefill):
        copy.on_finished(req, chosen_decode)
    assert decode._active_blocks[chosen_decode] == 0
    assert prefill._active_blocks[chosen_prefill] == 0  # released once, not twice
    # A copy whose pick the handler did not use (served aggregated) books nothing.
    alone = request(request_id="r3", **{BLOCK_KEYS_STATE: [7], PROMPT_TOKENS: 16})
    decode.pick(alone, endpoints[2:], [])
    prefill.pick(alone, endpoints[:2], [])
    aggregated = picked(endpoints[alone.state["decode-d.picked"]])
    for copy in (decode, prefill):
        copy.on_pick(alone, aggregated)
    assert "r3" in decode._requests and "r3" not in prefill._requests


def test_under_pd_the_sglang_prefill_copy_learns_its_own_endpoints_prefixes() -> None:
    store = store_with(4)
    ctx = BuildContext(store, random.Random(), store.now, 2.0)
    params = SGLangCacheAwareParams(blockSizeChars=8)
    prefill = SGLangCacheAwarePicker("prefill-s", params, ctx)
    decode = SGLangCacheAwarePicker("decode-s", params, ctx)
    endpoints = store.all()
    shared = "system prompt shared by all " * 4
    first = request(shared + "question one")
    assert decode.pick(first, endpoints[2:], [])[0].id == 2
    assert prefill.pick(first, endpoints[:2], [])[0].id == 0
    for copy in (decode, prefill):
        copy.on_pick(first, pd_picked(endpoints[2], endpoints[0]))
    # Endpoint 0 now busier: the prefix it holds keeps the next question there, as the rule
    # says, which it can only do having recorded the prompt for endpoint 0.
    store.in_flight[0] = 5
    second = request(shared + "question two", request_id="r2")
    assert prefill.pick(second, endpoints[:2], [])[0].id == 0
    assert decode.pick(second, endpoints[2:], [])[0].id == 2


def test_dynamo_temperature_samples_cheaper_endpoints_more_often() -> None:
    store = store_with(2)
    ctx = BuildContext(store, random.Random(1), store.now, 2.0)
    picker = DynamoCostPicker("d", DynamoCostParams(temperature=0.5), ctx)
    picker.on_blocks_stored(0, list(range(8)))
    counts = [0, 0]
    for _ in range(400):
        req = request(**{BLOCK_KEYS_STATE: list(range(10)), PROMPT_TOKENS: 160})
        counts[picker.pick(req, store.all(), [])[0].id] += 1
    assert counts[0] > counts[1] > 0


def test_policy_resolution(tmp_path: Path) -> None:
    registry = harness_registry()
    for name in BASELINES:
        resolve_policy(name).config(registry)
    assert [p.name for p in resolve_policies([])] == list(BASELINES)
    config = tmp_path / "mine.yaml"
    config.write_text(
        "plugins:\n- type: queue-scorer\n- type: max-score-picker\n"
        "schedulingProfiles:\n- name: default\n  plugins:\n  - pluginRef: queue-scorer\n"
    )
    named = resolve_policy(f"short={config}")
    assert named.name == "short" and not named.needs_prompt
    assert resolve_policy(str(config)).name == "mine"
    assert resolve_policy("kv-picker").needs_prompt
    # Named but not one of `baselines`: the stored matrices ran without it.
    llm_d = resolve_policy("llm-d-default")
    assert "llm-d-default" not in [p.name for p in resolve_policies(["baselines"])]
    types = [p["type"] for p in llm_d.document["plugins"]]
    assert "no-hit-lru-scorer" in types
    llm_d.config(registry)
    affinity = resolve_policy("llm-d-affinity")
    assert "llm-d-affinity" not in [p.name for p in resolve_policies(["baselines"])]
    config = affinity.config(registry)
    assert [e.plugin_ref for e in config.profiles[0].entries] == [
        "prefix-cache-affinity-filter",
        "token-load-scorer",
        "max-score-picker",
    ]
    with pytest.raises(ConfigError, match="not a named policy"):
        resolve_policy("fastest")
    with pytest.raises(ConfigError, match="repeated: random"):
        resolve_policies(["random", "random"])
    bad = tmp_path / "bad.yaml"
    bad.write_text("plugins:\n- type: queue-scorer\n  parameters: {depth: 3}\n")
    with pytest.raises(ConfigError, match=r"policy bad .*unknown field\(s\) depth"):
        resolve_policy(str(bad)).config(registry)


def test_the_upstream_baselines_record_a_pd_destination_at_the_pick() -> None:
    # Upstream's approximate index records a P/D destination at the pick; the picker's own
    # default waits for the prompt's KV to land there.
    registry = harness_registry()
    for name, expected in (
        ("gie-default", "pick"),
        ("llm-d-default", "pick"),
        ("kv-picker", "landed"),
    ):
        config = pd_variant(resolve_policy(name), 256).config(registry)
        seen = {
            p.params.recordDestinationAt for p in config.plugins if p.type == "prefix-cache-scorer"
        }
        assert seen == {expected}, name


def test_pd_variant_gives_each_side_its_own_plugins() -> None:
    registry = harness_registry()
    affinity = pd_variant(resolve_policy("llm-d-affinity"), 256).config(registry)
    types = {p.name: p.type for p in affinity.plugins}
    for side in ("decode", "prefill"):  # each side's filter reads its own side's index
        assert types[f"{side}-approx-prefix-cache-producer"] == "prefix-cache-scorer"
        (filter_plugin,) = [
            p for p in affinity.plugins if p.name == f"{side}-prefix-cache-affinity-filter"
        ]
        assert (
            filter_plugin.params.prefixMatchInfoProducerName
            == f"{side}-approx-prefix-cache-producer"
        )
    for name in ("kv-picker", "round-robin", "gie-default", "llm-d-default"):
        variant = pd_variant(resolve_policy(name), 256)
        config = variant.config(registry)
        assert [p.name for p in config.profiles] == ["decode", "prefill"]
        decode, prefill = config.profiles
        assert decode.entries[0].plugin_ref == "decode-filter"
        assert prefill.entries[0].plugin_ref == "prefill-filter"
        assert all(e.plugin_ref.startswith("decode-") for e in decode.entries)
    with pytest.raises(ConfigError, match="exactly one profile"):
        pd_variant(
            Policy(
                "two",
                {
                    "plugins": [{"type": "random-picker"}],
                    "schedulingProfiles": [
                        {"name": "a", "plugins": []},
                        {"name": "b", "plugins": []},
                    ],
                },
            )
        )


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "policy.yaml"
    path.write_text(text, encoding="utf-8")
    return f"p={path}"


PD_POLICY = """
plugins:
  - {type: prefix-cache-scorer, parameters: {maxPrefixBlocksToMatch: 64}}
  - {type: queue-scorer}
  - {type: max-score-picker}
pdParameters:
  decode:
    prefix-cache-scorer: {lruCapacityPerServer: 1000}
"""


def test_pd_parameters_set_one_side_of_the_pd_variant_only(tmp_path: Path) -> None:
    registry = harness_registry()
    policy = resolve_policy(_write(tmp_path, PD_POLICY))
    assert "pdParameters" not in policy.document
    aggregated = {p.name: p.params for p in policy.config(registry).plugins}
    default_lru = aggregated["prefix-cache-scorer"].lruCapacityPerServer
    assert aggregated["prefix-cache-scorer"].maxPrefixBlocksToMatch == 64
    assert default_lru != 1000
    variant = {p.name: p.params for p in pd_variant(policy).config(registry).plugins}
    decode, prefill = variant["decode-prefix-cache-scorer"], variant["prefill-prefix-cache-scorer"]
    assert (decode.maxPrefixBlocksToMatch, decode.lruCapacityPerServer) == (64, 1000)
    assert (prefill.maxPrefixBlocksToMatch, prefill.lruCapacityPerServer) == (64, default_lru)
    assert variant["decode-queue-scorer"] == variant["prefill-queue-scorer"]


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ("pdParameters: [1]", "must map a side"),
        ("pdParameters: {middle: {}}", "unknown side 'middle'"),
        ("pdParameters: {decode: [1]}", "must map plugin names"),
        ("pdParameters: {decode: {queue-scorer: {}}}", "non-empty mapping"),
    ],
)
def test_malformed_pd_parameters_are_named(tmp_path: Path, section: str, message: str) -> None:
    text = "plugins:\n  - {type: queue-scorer}\n  - {type: max-score-picker}\n" + section
    with pytest.raises(ConfigError, match=message):
        resolve_policy(_write(tmp_path, text))


def test_pd_parameters_for_a_missing_plugin_fail_the_pd_variant(tmp_path: Path) -> None:
    policy = resolve_policy(
        _write(tmp_path, PD_POLICY.replace("prefix-cache-scorer: {lru", "kv-scorer: {lru"))
    )
    with pytest.raises(ConfigError, match="kv-scorer the policy does not have"):
        pd_variant(policy)


def test_the_service_does_not_take_the_harness_pd_key(tmp_path: Path) -> None:
    document = yaml.safe_load(PD_POLICY)
    with pytest.raises(ConfigError, match="pdParameters"):
        Policy("raw", document).config(harness_registry())


PROFILES = Path(__file__).parents[3] / "benchmarks" / "profiles"


def _parsed(item: str) -> tuple[Any, list[tuple[str, str, Any]]]:
    config = resolve_policy(item).config(harness_registry())
    return config.profiles, [(p.name, p.type, p.params) for p in config.plugins]


def _one_changed_plugin(item: str, base_item: str) -> tuple[str, Any, Any]:
    """The one plugin whose parameters differ between a policy and its base (which must have
    the same profiles and plugins otherwise): its type, the base's and the policy's params."""
    profiles, plugins = _parsed(item)
    base_profiles, base_plugins = _parsed(base_item)
    assert profiles == base_profiles
    changed = [(a, b) for a, b in zip(base_plugins, plugins, strict=True) if a != b]
    assert len(changed) == 1
    (_, kind, before), (_, _, after) = changed[0]
    return kind, before, after


@pytest.mark.parametrize("path", sorted(PROFILES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_profile_builds(path: Path) -> None:
    profiles, plugins = _parsed(f"{path.stem}={path}")
    assert profiles and plugins
    pd_config = pd_variant(resolve_policy(f"{path.stem}={path}")).config(harness_registry())
    assert [p.name for p in pd_config.profiles] == ["decode", "prefill"]


def test_the_pd_8k_profile_is_the_32k_one_aggregated_and_the_8k_one_under_pd() -> None:
    registry = harness_registry()

    def policy(name: str) -> Policy:
        return resolve_policy(f"{name}={PROFILES / name}.yaml")

    both = policy("calibrated-latency-15-full-yield-free-16-pd-8k")
    aggregated = policy("calibrated-latency-15-full-yield-free-16")
    pd_only = policy("calibrated-latency-15-decode-8k-full-yield-free-16")
    assert both.config(registry).plugins == aggregated.config(registry).plugins

    def pd(p: Policy) -> tuple[Any, Any]:
        config = pd_variant(p).config(registry)
        return config.plugins, config.profiles

    assert pd(both) == pd(pd_only)
    assert pd(both) != pd(aggregated)


def test_the_confirmed_candidate_is_the_built_in_default() -> None:
    # The stored judgements of the candidate (results/candidates/blocking-decode-8k/) are the
    # present default's: the file must not drift from it. It is the default before it
    # (saturated-above-2.yaml) with the prefix scorer's fullYield and the latency estimate's
    # calibration, weight, decode threshold and blocking cost, and nothing else; that one is
    # seeding-decode-scaled.yaml with saturatedAbove 1 on saturated-miss-excess-2.yaml's latency
    # estimate (test_the_one_option_candidates_...); the default before that
    # (decode-excess-64.yaml) is it without decodeSpeedScaled, and so on back to
    # capped-whole.yaml, which is cached-scale-2.yaml with cappedMatchIsWhole.
    confirmed = (
        PROFILES / "calibrated-latency-15-decode-8k-full-yield-free-16-blocking-1-unsaturated.yaml"
    )
    assert _parsed(f"c={confirmed}") == _parsed("kv-picker")
    previous = f"s={PROFILES / 'saturated-above-2.yaml'}"
    assert _parsed(previous) != _parsed("kv-picker")
    (profile,), plugins = _parsed("kv-picker")
    (before_profile,), before_plugins = _parsed(previous)
    weights = {e.plugin_ref: e.weight for e in profile.entries}
    before_weights = {e.plugin_ref: e.weight for e in before_profile.entries}
    assert {k: v for k, v in weights.items() if before_weights[k] != v} == {
        "predicted-latency-scorer": 1.5
    }
    changed = {
        b[1]: {f: getattr(b[2], f) for f in vars(b[2]) if getattr(a[2], f) != getattr(b[2], f)}
        for a, b in zip(before_plugins, plugins, strict=True)
        if a != b
    }
    assert changed == {
        "prefix-cache-scorer": {"fullYield": 64, "fullYieldFree": 16},
        "predicted-latency-scorer": {
            "decodeMinPromptTokens": 8192,
            "prefillCalibration": True,
            "blockingCost": 1.0,
            "blockingUnsaturated": True,
        },
    }
    kind, before, after = _one_changed_plugin(
        previous, f"p={PROFILES / 'seeding-decode-scaled.yaml'}"
    )
    saturated = {"saturatedMissCost": 2.0, "missExcess": True, "saturatedAbove": 1}
    assert kind == "predicted-latency-scorer"
    assert replace(before, **saturated) == after != before
    capped_profiles, capped_plugins = _parsed(f"w={PROFILES / 'capped-whole.yaml'}")
    before_profiles, before_plugins = _parsed(f"c={PROFILES / 'cached-scale-2.yaml'}")
    assert capped_profiles == before_profiles
    changed = [(a, b) for a, b in zip(before_plugins, capped_plugins, strict=True) if a != b]
    assert [(a[1], a[2].cappedMatchIsWhole, b[2].cappedMatchIsWhole) for a, b in changed] == [
        ("prefix-cache-scorer", False, True)
    ]


def test_the_cached_scale_candidate_was_the_default_before_it() -> None:
    # The profiles of the defaults before cached-scale-2.yaml differ from it by one parameter
    # each (cachedScale for promptScale, then promptScale, then ownDecode), and then by one
    # scorer.
    default_profiles, default_plugins = _parsed(f"c={PROFILES / 'cached-scale-2.yaml'}")
    prompt_profiles, prompt_plugins = _parsed(f"p={PROFILES / 'prompt-scale.yaml'}")
    own_profiles, own_plugins = _parsed(f"o={PROFILES / 'own-decode.yaml'}")
    recent_profiles, recent_plugins = _parsed(f"r={PROFILES / 'recent-work.yaml'}")
    assert prompt_profiles == own_profiles == recent_profiles == default_profiles

    def one_change(before: list[Any], after: list[Any]) -> tuple[Any, Any]:
        changed = [(a, b) for a, b in zip(before, after, strict=True) if a != b]
        assert len(changed) == 1
        (_, kind, old), (_, _, new) = changed[0]
        assert kind == "active-request-scorer"
        return old, new

    before, after = one_change(prompt_plugins, default_plugins)
    assert (before.promptScale, before.cachedScale) == (2, 0)
    assert (after.promptScale, after.cachedScale) == (0, 2)
    assert replace(after, promptScale=2, cachedScale=0) == before
    before, after = one_change(own_plugins, prompt_plugins)
    assert (before.promptScale, after.promptScale) == (0, 2)
    assert replace(after, promptScale=0) == before
    before, after = one_change(recent_plugins, own_plugins)
    assert (before.ownDecode, after.ownDecode) == (False, True)
    assert replace(after, ownDecode=False) == before
    _, before_plugins = _parsed(f"b={PROFILES / 'default-before-recent-work.yaml'}")
    assert [p for p in recent_plugins if p[1] != "recent-work-scorer"] == before_plugins


@pytest.mark.parametrize(
    ("name", "base", "plugin", "option", "off", "on"),
    [
        (
            "queue-progress-1",
            "cached-scale-2",
            "predicted-latency-scorer",
            "queueProgress",
            0.0,
            1.0,
        ),
        (
            "queue-progress-half",
            "cached-scale-2",
            "predicted-latency-scorer",
            "queueProgress",
            0.0,
            0.5,
        ),
        (
            "capped-match",
            "cached-scale-2",
            "active-request-scorer",
            "cappedMatchIsWhole",
            False,
            True,
        ),
        ("free-load-8k", "cached-scale-2", "active-request-scorer", "freeLoad", 0.0, 8192.0),
        ("free-load-16k", "cached-scale-2", "active-request-scorer", "freeLoad", 0.0, 16384.0),
        ("cached-scale-8", "cached-scale-2", "active-request-scorer", "cachedScale", 2.0, 8.0),
        ("cached-scale-16", "cached-scale-2", "active-request-scorer", "cachedScale", 2.0, 16.0),
        (
            "capped-whole",
            "cached-scale-2",
            "prefix-cache-scorer",
            "cappedMatchIsWhole",
            False,
            True,
        ),
        ("capped-whole-decode-4", "capped-whole", "predicted-latency-scorer", "decodeTokens", 0, 4),
        (
            "seeding-decode-scaled",
            "decode-excess-64",
            "recent-work-scorer",
            "decodeSpeedScaled",
            False,
            True,
        ),
        (
            "capped-whole-decode-16",
            "capped-whole",
            "predicted-latency-scorer",
            "decodeTokens",
            0,
            16,
        ),
        (
            "latency-band-1",
            "seeding-decode-scaled",
            "active-request-scorer",
            "latencyBand",
            0.0,
            1.0,
        ),
        (
            "latency-band-05",
            "seeding-decode-scaled",
            "active-request-scorer",
            "latencyBand",
            0.0,
            0.5,
        ),
        (
            "saturated-miss-cost-05",
            "seeding-decode-scaled",
            "predicted-latency-scorer",
            "saturatedMissCost",
            0.0,
            0.5,
        ),
        (
            "saturated-miss-cost-1",
            "seeding-decode-scaled",
            "predicted-latency-scorer",
            "saturatedMissCost",
            0.0,
            1.0,
        ),
        (
            "saturated-miss-excess-1",
            "saturated-miss-cost-1",
            "predicted-latency-scorer",
            "missExcess",
            False,
            True,
        ),
        (
            "saturated-miss-excess-2",
            "saturated-miss-excess-1",
            "predicted-latency-scorer",
            "saturatedMissCost",
            1.0,
            2.0,
        ),
        (
            "saturated-above-2",
            "saturated-miss-excess-2",
            "predicted-latency-scorer",
            "saturatedAbove",
            0,
            1,
        ),
        (
            "saturated-above-4",
            "saturated-above-2",
            "predicted-latency-scorer",
            "saturatedMissCost",
            2.0,
            4.0,
        ),
        (
            "light-band-w2-01",
            "light-band-01",
            "active-request-scorer",
            "loadWindowSeconds",
            10.0,
            2.0,
        ),
        (
            "light-band-w2-005",
            "light-band-005",
            "active-request-scorer",
            "loadWindowSeconds",
            10.0,
            2.0,
        ),
    ],
)
def test_the_one_option_candidates_are_their_base_with_that_option(
    name: str, base: str, plugin: str, option: str, off: object, on: object
) -> None:
    # results/candidates/<name>/ judges each as its base (cached-scale-2.yaml, the default it
    # was judged against, or another profile of benchmarks/profiles/) plus that one option.
    kind, before, after = _one_changed_plugin(
        f"q={PROFILES / (name + '.yaml')}",
        base if base == "kv-picker" else f"b={PROFILES / (base + '.yaml')}",
    )
    assert kind == plugin
    assert (getattr(before, option), getattr(after, option)) == (off, on)
    assert replace(after, **{option: off}) == before


@pytest.mark.parametrize(("name", "load"), [("light-band-01", 0.1), ("light-band-005", 0.05)])
def test_the_light_band_candidates_are_the_default_with_a_band_below_a_load(
    name: str, load: float
) -> None:
    # results/candidates/light-load-band/ judges each as seeding-decode-scaled.yaml with
    # active-request-scorer's latencyBand 1 applied below a load, counted over 64 slots.
    kind, before, after = _one_changed_plugin(
        f"q={PROFILES / (name + '.yaml')}", f"b={PROFILES / 'seeding-decode-scaled.yaml'}"
    )
    assert kind == "active-request-scorer"
    options = {"latencyBand": 1.0, "latencyBandLoad": load, "maxNumSeqs": 64}
    assert {k: getattr(after, k) for k in options} == options
    assert replace(before, **options) == after


@pytest.mark.parametrize("tokens", [64, 150])
def test_the_decode_excess_candidates_are_capped_whole_with_the_long_prompt_decode_term(
    tokens: int,
) -> None:
    # results/candidates/decode-excess/ judges each as profiles/capped-whole.yaml with the
    # latency estimate's decode term over ``tokens`` output tokens, in excess, from 32,768
    # prompt tokens, and nothing else.
    kind, before, after = _one_changed_plugin(
        f"q={PROFILES / f'decode-excess-{tokens}.yaml'}", f"b={PROFILES / 'capped-whole.yaml'}"
    )
    assert kind == "predicted-latency-scorer"
    options = {"decodeTokens": tokens, "decodeMinPromptTokens": 32768, "decodeExcess": True}
    assert {k: getattr(after, k) for k in options} == options
    assert replace(before, **options) == after


def test_the_calibrated_70b_profile_is_its_default_with_the_70b_timing_constants() -> None:
    # results/candidates/calibrated-70b/ measures what the default's 8B constants cost on the
    # 70B cells, measured when the default was prompt-scale.yaml: the file must be that default
    # but for the latency estimate's four constants, and those must be the 70B timing
    # profile's (to the rounding written in the file).
    kind, default_params, params = _one_changed_plugin(
        f"c={PROFILES / 'calibrated-70b.yaml'}", f"p={PROFILES / 'prompt-scale.yaml'}"
    )
    assert kind == "predicted-latency-scorer"
    constants = (
        "prefillTokensPerSecond",
        "attentionCrossoverTokens",
        "stepSeconds",
        "kvReadTokensPerSecond",
    )
    assert replace(params, **{k: getattr(default_params, k) for k in constants}) == default_params
    model = TIMING_PROFILES["llama-3.1-70b-h100-tp4"]
    expected = {
        "prefillTokensPerSecond": 1 / model.prefill_s_per_token,
        "attentionCrossoverTokens": model.prefill_s_per_token / model.attention_s_per_token_pair,
        "stepSeconds": model.step_base_s,
        "kvReadTokensPerSecond": 1 / model.kv_read_s_per_token,
    }
    for name, value in expected.items():
        assert getattr(params, name) == pytest.approx(value, rel=0.005), name


@pytest.mark.parametrize(
    ("name", "weight"), [("recent-work-weight-0", 0.0), ("recent-work-weight-025", 0.25)]
)
def test_the_seeding_weight_candidates_change_only_that_weight(name: str, weight: float) -> None:
    # results/candidates/seeding-weight/ judges each as decode-excess-64.yaml (the default it
    # was judged against) with recent-work-scorer's weight changed from 0.5, and nothing else.
    profiles, plugins = _parsed(f"q={PROFILES / (name + '.yaml')}")
    base_profiles, base_plugins = _parsed(f"b={PROFILES / 'decode-excess-64.yaml'}")
    assert plugins == base_plugins
    ((profile,), (base,)) = (profiles, base_profiles)
    weights = {e.plugin_ref: e.weight for e in profile.entries}
    base_weights = {e.plugin_ref: e.weight for e in base.entries}
    assert base_weights["recent-work-scorer"] == 0.5
    assert weights == {**base_weights, "recent-work-scorer": weight}


def test_the_combined_candidate_is_its_two_candidates_together() -> None:
    # results/candidates/saturated-pending-yield/ judges it as the default of its time
    # (seeding-decode-scaled.yaml) with pending-yield-decode.yaml's prefix scorer and
    # saturated-above-2.yaml's latency estimate, each of which differs from it in that one plugin
    # only.
    base = f"b={PROFILES / 'seeding-decode-scaled.yaml'}"
    profiles, plugins = _parsed(f"c={PROFILES / 'saturated-pending-yield.yaml'}")
    yield_kind, _, yield_params = _one_changed_plugin(
        f"y={PROFILES / 'pending-yield-decode.yaml'}", base
    )
    saturated_kind, _, saturated_params = _one_changed_plugin(
        f"s={PROFILES / 'saturated-above-2.yaml'}", base
    )
    default_profiles, default_plugins = _parsed(base)
    assert (yield_kind, saturated_kind) == ("prefix-cache-scorer", "predicted-latency-scorer")
    assert profiles == default_profiles
    by_kind = {kind: params for (_, kind, params) in plugins}
    default_by_kind = {kind: params for (_, kind, params) in default_plugins}
    assert by_kind.pop("prefix-cache-scorer") == yield_params
    assert by_kind.pop("predicted-latency-scorer") == saturated_params
    del default_by_kind["prefix-cache-scorer"], default_by_kind["predicted-latency-scorer"]
    assert by_kind == default_by_kind
    assert [(name, kind) for name, kind, _ in plugins] == [
        (name, kind) for name, kind, _ in default_plugins
    ]
