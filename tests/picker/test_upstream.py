"""llm-d's newer EndpointPickerConfig shapes load as kv-picker's (kv_picker.upstream)."""

import copy
import logging
from typing import Any

import pytest
import yaml

from kv_picker.config import parse_config, parse_config_text
from kv_picker.errors import ConfigError
from kv_picker.plugins import builtin_registry
from kv_picker.upstream import translate
from tests.fakes import make_request, make_scheduler, make_store

HEADER = "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\n"

# The profiles of llm-d's guides, their content as shipped (profile lists in YAML's flow style).
TIERED = (
    HEADER
    + """
plugins:
- type: approx-prefix-cache-producer
  name: cpu-prefix-cache-producer
  parameters:
    autoTune: false
    lruCapacityPerServer: 1000
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
  name: gpu-prefix-cache-scorer
- type: prefix-cache-scorer
  name: cpu-prefix-cache-scorer
  parameters:
    producer: cpu-prefix-cache-producer
schedulingProfiles:
- name: default
  plugins: [{pluginRef: queue-scorer, weight: 2},
    {pluginRef: kv-cache-utilization-scorer, weight: 2.0},
    {pluginRef: gpu-prefix-cache-scorer, weight: 1.0},
    {pluginRef: cpu-prefix-cache-scorer, weight: 1.0}]
"""
)

PD = (
    HEADER
    + """
plugins:
- type: disagg-headers-handler
- type: always-disagg-pd-decider
- type: disagg-profile-handler
  parameters:
    deciderPluginName: always-disagg-pd-decider
- type: prefill-filter
- type: decode-filter
- type: prefix-cache-scorer
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: active-request-scorer
- type: max-score-picker
schedulingProfiles:
- name: prefill
  plugins: [{pluginRef: prefill-filter}, {pluginRef: prefix-cache-scorer, weight: 3},
    {pluginRef: queue-scorer, weight: 2}, {pluginRef: kv-cache-utilization-scorer, weight: 2},
    {pluginRef: max-score-picker}]
- name: decode
  plugins: [{pluginRef: decode-filter}, {pluginRef: active-request-scorer, weight: 2},
    {pluginRef: prefix-cache-scorer, weight: 3}, {pluginRef: max-score-picker}]
"""
)

DP_AWARE = (
    HEADER
    + """
plugins:
- type: prefix-based-pd-decider
- type: prefill-header-handler
- type: prefill-filter
- type: decode-filter
- type: prefix-cache-scorer
- type: active-request-scorer
- type: queue-scorer
- type: pd-profile-handler
  parameters:
    threshold: 0
    hashBlockSize: 5
schedulingProfiles:
- name: prefill
  plugins: [{pluginRef: prefill-filter}, {pluginRef: prefix-cache-scorer, weight: 3},
    {pluginRef: active-request-scorer, weight: 2}, {pluginRef: queue-scorer, weight: 2}]
- name: decode
  plugins: [{pluginRef: decode-filter}, {pluginRef: active-request-scorer, weight: 1},
    {pluginRef: queue-scorer, weight: 1}]
"""
)

FLOW_CONTROL = (
    HEADER
    + """
featureGates:
- flowControl
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
- type: round-robin-fairness-policy
- type: fcfs-ordering-policy
- type: concurrency-detector
  parameters:
    maxConcurrency: 132
    concurrencyMode: requests
    headroom: 0.0
schedulingProfiles:
- name: default
  plugins: [{pluginRef: queue-scorer, weight: 2},
    {pluginRef: kv-cache-utilization-scorer, weight: 2},
    {pluginRef: prefix-cache-scorer, weight: 3}]
saturationDetector:
  pluginRef: concurrency-detector
flowControl:
  maxBytes: "10Gi"
  maxRequests: "1k"
"""
)

REGISTRY = builtin_registry(include_entry_points=False)


def _load(text: str) -> Any:
    return parse_config_text(text, REGISTRY)


def _plugin(config: Any, name: str) -> Any:
    (plugin,) = [p for p in config.plugins if p.name == name]
    return plugin


def test_tiered_prefix_cache_scorer_reads_its_producers_parameters() -> None:
    config = _load(TIERED)
    assert [p.type for p in config.plugins].count("approx-prefix-cache-producer") == 0
    cpu = _plugin(config, "cpu-prefix-cache-scorer").params
    gpu = _plugin(config, "gpu-prefix-cache-scorer").params
    assert cpu.lruCapacityPerServer == 1000
    # The producer's defaults: 131,072 tokens to match in blocks of 16 tokens (64 characters).
    assert (cpu.blockSizeChars, cpu.maxPrefixBlocksToMatch) == (64, 8192)
    assert (gpu.lruCapacityPerServer, gpu.maxPrefixBlocksToMatch) == (31250, 256)


def test_producer_block_size_in_tokens_and_tokens_to_match() -> None:
    text = TIERED.replace(
        "    autoTune: false\n",
        "    autoTune: false\n    blockSizeTokens: 64\n    maxPrefixTokensToMatch: 32768\n",
    ).replace(
        "    producer: cpu-prefix-cache-producer",
        "    prefixMatchInfoProducerName: cpu-prefix-cache-producer",
    )
    cpu = _plugin(_load(text), "cpu-prefix-cache-scorer").params
    assert (cpu.blockSizeChars, cpu.maxPrefixBlocksToMatch) == (256, 512)
    # The older scorer hashed by itself: its own blockSize (characters) and autoTune load.
    older = _load(
        "plugins:\n- type: prefix-cache-scorer\n  parameters: {autoTune: false, blockSize: 128,"
        " maxPrefixBlocksToMatch: 64, lruCapacityPerServer: 500}\n"
    )
    params = older.plugins[0].params
    assert (params.blockSizeChars, params.maxPrefixBlocksToMatch) == (128, 64)
    assert params.lruCapacityPerServer == 500


def test_disagg_profile_handler_with_always_decider_disaggregates_every_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING):
        config = _load(PD)
    handler = _plugin(config, config.handler)
    assert handler.type == "pd-profile-handler" and handler.params.always
    assert "disagg-headers-handler is accepted and not built" in caplog.text
    document = yaml.safe_load(PD)
    store = make_store(
        4,
        labels=[{"llm-d.ai/role": role} for role in ("prefill", "prefill", "decode", "decode")],
    )
    scheduler = make_scheduler(document, store)
    prefill_pool = {e.address for e in store.all()[:2]}
    for i in range(6):
        result = scheduler.schedule(make_request(f"short prompt {i} " * 3), store.all())
        assert result.prefill_endpoint is not None
        assert result.prefill_endpoint.address in prefill_pool
        assert result.destination.address not in prefill_pool


def test_prefix_based_decider_and_nested_parameters() -> None:
    text = PD.replace(
        "- type: always-disagg-pd-decider\n",
        "- type: prefix-based-pd-decider\n  name: long-prompts\n"
        "  parameters: {nonCachedTokens: 2048, promptTokens: 4096}\n",
    ).replace(
        "    deciderPluginName: always-disagg-pd-decider\n",
        "    profiles: {decode: decode, prefill: prefill}\n    deciders: {prefill: long-prompts}\n",
    )
    params = _plugin(_load(text), "disagg-profile-handler").params
    assert (params.always, params.nonCachedTokens, params.minPromptTokens) == (False, 2048, 4096)
    # No decider: P/D is off, as upstream.
    off = PD.replace("  parameters:\n    deciderPluginName: always-disagg-pd-decider\n", "")
    params = _plugin(_load(off), "disagg-profile-handler").params
    assert (params.always, params.nonCachedTokens) == (False, 0)


def test_older_pd_profile_handler_threshold_is_in_characters() -> None:
    config = _load(DP_AWARE)
    assert _plugin(config, "pd-profile-handler").params.always  # threshold 0: always
    text = DP_AWARE.replace("threshold: 0", "threshold: 1000")
    params = _plugin(_load(text), "pd-profile-handler").params
    assert (params.always, params.nonCachedTokens) == (False, 250)
    # Without a threshold, the declared prefix-based-pd-decider is the default one (upstream).
    text = DP_AWARE.replace(
        "- type: prefix-based-pd-decider\n",
        "- type: prefix-based-pd-decider\n  parameters: {nonCachedTokens: 512}\n",
    )
    text = text.replace("    threshold: 0\n", "")
    params = _plugin(_load(text), "pd-profile-handler").params
    assert (params.always, params.nonCachedTokens) == (False, 512)


def test_flow_control_and_data_layer_plugins_are_not_built(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING):
        config = _load(FLOW_CONTROL)
    assert [p.type for p in config.plugins] == [
        "queue-scorer",
        "kv-cache-utilization-scorer",
        "prefix-cache-scorer",
    ]
    for kind in ("round-robin-fairness-policy", "fcfs-ordering-policy", "concurrency-detector"):
        assert f"{kind} is accepted and not built" in caplog.text
    text = FLOW_CONTROL.replace(
        "- type: fcfs-ordering-policy\n",
        "- type: fcfs-ordering-policy\n- type: metrics-data-source\n"
        "  parameters: {scheme: http, path: /vllm/metrics, insecureSkipVerify: true}\n",
    )
    assert _load(text).metrics.path == "/vllm/metrics"
    # The picker's own metrics section wins.
    assert _load(text + "metrics: {path: /metrics}\n").metrics.path == "/metrics"
    # The models data layer: the picker reads the adapters from the metrics.
    models = FLOW_CONTROL.replace(
        "- type: fcfs-ordering-policy\n",
        "- type: fcfs-ordering-policy\n- type: models-data-source\n"
        "  parameters: {scheme: http, path: /v1/models}\n- type: model-server-protocol-models\n",
    )
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert [p.type for p in _load(models).plugins] == [p.type for p in config.plugins]
    for kind in ("models-data-source", "model-server-protocol-models"):
        assert f"{kind} is accepted and not built" in caplog.text


@pytest.mark.parametrize(
    ("text", "fragments"),
    [
        (
            PD.replace(
                "    deciderPluginName: always-disagg-pd-decider\n",
                "    deciders: {prefill: always-disagg-pd-decider, encode: always-disagg-pd-decider}\n",
            ),
            ["disagg-profile-handler", "encode stage"],
        ),
        (
            PD.replace(
                "    deciderPluginName: always-disagg-pd-decider\n",
                "    stageOrder: prefill-first\n",
            ),
            ["stageOrder", "decode-first"],
        ),
        (
            PD.replace(
                "    deciderPluginName: always-disagg-pd-decider\n",
                "    deciderPluginName: always-disagg-pd-decider\n    profiles: {decode: decode}\n",
            ),
            ["cannot be mixed"],
        ),
        (
            PD.replace("deciderPluginName: always-disagg-pd-decider", "deciderPluginName: nobody"),
            ["decider 'nobody' is not declared"],
        ),
        (
            DP_AWARE.replace("hashBlockSize: 5", "primaryPort: 8200"),
            ["primaryPort", "data-parallel"],
        ),
        (
            FLOW_CONTROL.replace(
                "- type: fcfs-ordering-policy\n",
                "- type: fcfs-ordering-policy\n- type: metrics-data-source\n"
                "  parameters: {scheme: https}\n",
            ),
            ["metrics-data-source", "scheme", "plain HTTP"],
        ),
        (
            TIERED.replace("producer: cpu-prefix-cache-producer", "producer: gpu-cache"),
            ["cpu-prefix-cache-scorer", "no plugin named 'gpu-cache'"],
        ),
        (
            TIERED.replace(
                "type: approx-prefix-cache-producer", "type: precise-prefix-cache-producer"
            ),
            ["precise-prefix-cache-producer", "use precise-prefix-cache-scorer"],
        ),
        (
            TIERED.replace("lruCapacityPerServer: 1000", "lruCapacity: 1000"),
            ["cpu-prefix-cache-producer", "unknown field(s) lruCapacity"],
        ),
        (
            TIERED.replace("lruCapacityPerServer: 1000", "blockSizeTokens: -1"),
            ["blockSizeTokens", "positive number"],
        ),
    ],
)
def test_what_has_no_counterpart_is_refused_with_the_reason(
    text: str, fragments: list[str]
) -> None:
    with pytest.raises(ConfigError) as info:
        _load(text)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_translation_leaves_the_document_as_it_was() -> None:
    for text in (TIERED, PD, DP_AWARE, FLOW_CONTROL):
        document = yaml.safe_load(text)
        before = copy.deepcopy(document)
        translate(document)
        parse_config(document, REGISTRY)
        assert document == before
    # A malformed document is left for the validator to name.
    assert translate({"plugins": "queue-scorer"}) == ({"plugins": "queue-scorer"}, [])
    with pytest.raises(ConfigError, match="plugins"):
        parse_config({"plugins": "queue-scorer"}, REGISTRY)
