"""context-length-aware: llm-d's filter-and-scorer on the endpoints' context-length ranges."""

from __future__ import annotations

import logging
import re
from typing import Any, ClassVar

import pytest

from kv_picker.errors import ConfigError, SaturatedError
from kv_picker.scheduling.framework import kind_of
from kv_picker.scheduling.signals import PROMPT_TOKENS
from kv_picker.scorers.context_length import (
    DEFAULT_LABEL,
    ContextLengthAware,
    ContextLengthParams,
    parse_ranges,
    range_score,
)
from tests.fakes import make_context, make_request, make_scheduler, make_store, one_scorer_document

LABEL = DEFAULT_LABEL


def plugin(store: Any, **params: Any) -> ContextLengthAware:
    return ContextLengthAware("cl", ContextLengthParams(**params), make_context(store))


def prompt_of(tokens: int) -> str:
    """A prompt the character estimate counts as ``tokens`` tokens (4 characters each)."""
    return "abcd" * tokens


@pytest.mark.parametrize(
    ("value", "ranges"),
    [
        ("0-2048", ((0, 2048),)),
        (" 0 - 2048 , 8192-16384 ", ((0, 2048), (8192, 16384))),
        ("512-512", ((512, 512),)),
    ],
)
def test_ranges_parse(value: str, ranges: tuple[tuple[int, int], ...]) -> None:
    assert parse_ranges(value) == ranges


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        ("", "empty"),
        ("2048", "not 'min-max'"),
        ("0-1-2", "not 'min-max'"),
        ("-5-10", "not 'min-max'"),  # a negative bound
        ("a-10", "not an integer"),
        ("10-5", "min is above max"),
        ("0-2048,", "not 'min-max'"),
    ],
)
def test_bad_ranges_are_refused(value: str, problem: str) -> None:
    with pytest.raises(ValueError, match=re.escape(problem)):
        parse_ranges(value)


def test_the_score_prefers_narrow_ranges_with_headroom() -> None:
    # Inside [0, 2048] at 1,000 tokens: the width's share and the headroom's.
    assert range_score(1000, ((0, 2048),)) == pytest.approx(
        0.7 / (1 + 2048 / 10000) + 0.3 * 1048 / 2048
    )
    assert range_score(1000, ((1000, 1000),)) == 1.0
    assert range_score(1000, ((2000, 4000),)) == 0.0
    assert range_score(2048, ((0, 2048),)) == pytest.approx(0.7 / (1 + 2048 / 10000))
    # A narrower range beats a wider one; of several ranges the best that holds counts.
    assert range_score(1000, ((0, 4096),)) < range_score(1000, ((0, 2048),))
    assert range_score(1000, ((0, 100_000), (900, 1100))) == range_score(1000, ((900, 1100),))


def test_scores_per_endpoint_label() -> None:
    labels = [{}, {LABEL: "0-2048"}, {LABEL: "4096-131072"}, {LABEL: "oops"}, {LABEL: "1000-1000"}]
    store = make_store(5, labels=labels)
    out = [0.0] * 5
    plugin(store).score(make_request(prompt_of(1000)), store.all(), out)
    assert out == [
        0.5,
        pytest.approx(range_score(1000, ((0, 2048),))),
        0.0,
        0.0,
        1.0,
    ]


def test_the_filter_keeps_unlabelled_and_matching_endpoints_only_when_enabled() -> None:
    labels = [{}, {LABEL: "0-2048"}, {LABEL: "4096-131072"}, {LABEL: "oops"}]
    store = make_store(4, labels=labels)
    request = make_request(prompt_of(1000))
    assert plugin(store).filter(request, store.all()) == store.all()
    kept = plugin(store, enableFiltering=True).filter(request, store.all())
    assert [e.address for e in kept] == ["10.0.0.1:8000", "10.0.0.2:8000"]
    long = make_request(prompt_of(5000))
    kept = plugin(store, enableFiltering=True).filter(long, store.all())
    assert [e.address for e in kept] == ["10.0.0.1:8000", "10.0.0.3:8000"]


def test_an_exact_token_count_is_used_when_a_tokenizer_ran() -> None:
    store = make_store(2, labels=[{LABEL: "0-100"}, {LABEL: "101-200"}])
    request = make_request(prompt_of(150))  # 150 by the character estimate
    request.state[PROMPT_TOKENS] = 80  # what the tokenizer counted
    kept = plugin(store, enableFiltering=True).filter(request, store.all())
    assert [e.address for e in kept] == ["10.0.0.1:8000"]
    # The estimate rounds down, as llm-d's: 4 x 100 + 3 characters is 100 tokens.
    assert plugin(store).context_length(make_request("abcd" * 100 + "abc")) == 100


def test_a_bad_label_is_logged_once_per_value(caplog: pytest.LogCaptureFixture) -> None:
    store = make_store(3, labels=[{LABEL: "oops"}, {LABEL: "oops"}, {LABEL: "0-10"}])
    scorer = plugin(store)
    out = [0.0] * 3
    with caplog.at_level(logging.ERROR, logger="kv_picker.scorers.context_length"):
        for _ in range(5):
            scorer.score(make_request(prompt_of(5)), store.all(), out)
    assert len(caplog.records) == 1
    assert "oops" in caplog.records[0].getMessage()


def test_a_filter_and_a_scorer_at_once() -> None:
    assert kind_of(ContextLengthAware) == "filter-scorer"

    class FilterPicker:  # any other pair of kinds is still refused
        type_name: ClassVar[str] = "x"

        def filter(self, request: Any, candidates: Any) -> Any: ...

        def pick(self, request: Any, candidates: Any, scores: Any) -> Any: ...

    with pytest.raises(ConfigError, match="several kinds: filter, picker"):
        kind_of(FilterPicker)


# An llm-d config as its docs give it, with a second scorer: long prompts have their own pods.
LLM_D_CONFIG: dict[str, Any] = {
    "apiVersion": "inference.networking.x-k8s.io/v1alpha1",
    "kind": "EndpointPickerConfig",
    "plugins": [
        {
            "type": "context-length-aware",
            "parameters": {"label": LABEL, "enableFiltering": True},
        },
        {"type": "queue-scorer"},
        {"type": "max-score-picker"},
    ],
    "schedulingProfiles": [
        {
            "name": "default",
            "plugins": [
                {"pluginRef": "context-length-aware", "weight": 2},
                {"pluginRef": "queue-scorer", "weight": 1},
                {"pluginRef": "max-score-picker"},
            ],
        }
    ],
}


def test_an_llm_d_config_routes_by_length_through_the_scheduler() -> None:
    labels = [{LABEL: "0-4096"}, {LABEL: "0-4096"}, {LABEL: "4097-131072"}, {}]
    # The short pods are busy, the long pod idle: filtering, not load, keeps short prompts off
    # the long pod.
    store = make_store(4, labels=labels, waiting=[5, 3, 0, 9])
    scheduler = make_scheduler(LLM_D_CONFIG, store)
    short = scheduler.schedule(make_request(prompt_of(1000)), store.all(), explain=True)
    profile = short.profile_results["default"]
    assert [e.address for e in profile.candidates] == [
        "10.0.0.1:8000",
        "10.0.0.2:8000",
        "10.0.0.4:8000",
    ]
    assert profile.targets[0].address == "10.0.0.2:8000"  # the less busy short pod
    assert profile.breakdown is not None
    assert profile.breakdown["context-length-aware"][2] == 0.5  # unlabelled: neutral
    long = scheduler.schedule(make_request(prompt_of(20_000)), store.all())
    assert long.profile_results["default"].targets[0].address == "10.0.0.3:8000"


def test_a_request_no_endpoint_takes_names_the_filter() -> None:
    store = make_store(2, labels=[{LABEL: "0-100"}, {LABEL: "101-200"}])
    scheduler = make_scheduler(LLM_D_CONFIG, store)
    with pytest.raises(SaturatedError, match="filter 'context-length-aware'"):
        scheduler.schedule(make_request(prompt_of(500)), store.all())


def test_llm_d_tokenizer_settings_load_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    parameters = {
        "modelName": "meta-llama/Llama-3.1-8B-Instruct",
        "hfTokenizerConfig": {"enabled": True, "tokenizersCacheDir": "/tmp/tokenizers"},
    }
    store = make_store(2, labels=[{LABEL: "0-100"}, {}])
    with caplog.at_level(logging.WARNING, logger="kv_picker.scorers.context_length"):
        scheduler = make_scheduler(one_scorer_document("context-length-aware", parameters), store)
    assert "tokenizer settings are not loaded" in caplog.text
    result = scheduler.schedule(make_request(prompt_of(50)), store.all())
    assert result.profile_results["default"].targets[0].address == "10.0.0.1:8000"


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"label": ""}, "'label' must be specified"),
        ({"charsPerToken": 0}, "'charsPerToken' must be > 0"),
        ({"enableFiltering": "yes"}, "enableFiltering"),
        ({"mode": "filter"}, "unknown field"),
    ],
)
def test_bad_parameters_are_refused(parameters: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        make_scheduler(one_scorer_document("context-length-aware", parameters), make_store(2))
