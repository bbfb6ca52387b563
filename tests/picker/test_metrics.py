"""No request can make /metrics fail or grow without bound: every label a request can reach."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from kv_picker.handlers.extproc import RequestStream
from kv_picker.metrics import MAX_LABEL_CHARS, MAX_MODEL_LABELS, PickerMetrics, label_value
from tests.fakes import make_director, make_store
from tests.picker.handlers.test_extproc_stream import body_message, headers_message, run

# What a hostile client can put in a string: lone surrogates (escaped in JSON), control
# characters, the exposition's own escapes, separators, bidi overrides, a megabyte, and
# valid non-ASCII text (which must survive as it is).
HOSTILE = (
    "\ud800",
    "a\udfffb",
    "nul\x00byte",
    "line\nbreak",
    "carriage\rreturn",
    'quote"and\\backslash',
    "para\u2029graph",
    "bidi\u202eoverride",
    "x" * 1_000_000,
    "é模型🙂",
)

# Every label name of every metric, by where its values come from. A new label must be added
# here, and if a request can reach it, through PickerMetrics.model_label or a fixed vocabulary.
FROM_REQUESTS = {"model"}
FROM_CONFIG_OR_FIXED = {
    "outcome",  # routed / passthrough / disaggregated / an error class's reason
    "profile",
    "plugin",
    "type",
    "endpoint",  # addresses from the config or discovery, never from a request
    "state",
    "decision",
    "result",
    "kind",
    "reason",
    "cause",
    "operation",
    "resource",  # the Kubernetes kinds discovery watches (pods, inferencepools)
    "port",  # which TLS port reloaded its certificates (grpc, admin)
}


def label_names(metrics: PickerMetrics) -> set[str]:
    names: set[str] = set()
    for collector in list(metrics.registry._collector_to_names):
        names.update(getattr(collector, "_labelnames", ()))
    return names


def check_exposition(metrics: PickerMetrics) -> dict[str, set[str]]:
    """Render and parse /metrics; every label value printable and bounded. Label -> values."""
    text = metrics.exposition().decode("utf-8")
    values: dict[str, set[str]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            for name, value in sample.labels.items():
                assert value.isprintable(), (name, value[:40])
                assert len(value) <= MAX_LABEL_CHARS, (name, len(value))
                values.setdefault(name, set()).add(value)
    return values


def test_every_label_is_classified_by_its_source() -> None:
    director = make_director()
    assert label_names(director.metrics) == FROM_REQUESTS | FROM_CONFIG_OR_FIXED


@pytest.mark.parametrize("text", HOSTILE)
def test_label_value_is_printable_bounded_and_keeps_valid_text(text: str) -> None:
    value = label_value(text)
    assert value.isprintable() and len(value) <= MAX_LABEL_CHARS
    value.encode("utf-8")  # no lone surrogate left
    if text.isprintable() and len(text) <= MAX_LABEL_CHARS:
        assert value == text


def _send(director, body: dict[str, object], path: str, extra=()) -> None:  # type: ignore[no-untyped-def]
    stream = RequestStream(director)
    raw = json.dumps(body).encode()  # JSON escapes lone surrogates as \\udXXX
    run(stream, headers_message(path=path, extra=extra), body_message(raw))
    stream.close()


@pytest.mark.parametrize("text", HOSTILE)
def test_every_request_source_of_a_label_leaves_metrics_readable(text: str) -> None:
    declared = {"models": [{"name": "m", "loraAdapters": ["lora-a"]}]}
    for director in (make_director(), make_director(declared)):
        header_safe = text.encode("utf-8", "replace").decode("utf-8")[:1000]
        header_safe = header_safe.replace("\n", " ").replace("\r", " ")
        completions = {"model": text, "prompt": "hi", "cache_salt": text}
        _send(director, completions, "/v1/completions")
        _send(director, {"model": text, "prompt": [text]}, "/v1/completions")
        chat = {"model": text, "messages": [{"role": text, "content": text}]}
        _send(director, chat, "/v1/chat/completions")
        _send(director, {"model": text, "input": text}, "/v1/embeddings")
        _send(director, {"model": "m", "prompt": text}, "/v1/" + header_safe[:50])
        extra = [
            ("x-llm-d-model-name-rewrite", header_safe),
            ("x-gateway-inference-objective", header_safe),
            ("x-request-id", header_safe),
        ]
        _send(director, {"model": "m", "prompt": "hi"}, "/v1/completions", extra)
        # The parser rejects what cannot be encoded; the label must not rely on it.
        endpoint = director.store.all()[0]
        director._take(endpoint, text, "routed", 0.0, director.store.now())
        stream = RequestStream(director)
        stream.model = text
        run(stream, headers_message(), body_message(b"{not json"))
        values = check_exposition(director.metrics)
        if text.isprintable() and len(text) <= MAX_LABEL_CHARS:
            assert text in values["model"]  # a valid name is exported as it is


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300))
def test_any_model_name_gives_a_readable_exposition(model: str) -> None:
    metrics = PickerMetrics()
    metrics.requests.labels(metrics.model_label(model), "routed").inc()
    values = check_exposition(metrics)
    assert len(values["model"]) == 1


def test_distinct_hostile_models_are_capped() -> None:
    director = make_director(store=make_store(2))
    for i in range(3 * MAX_MODEL_LABELS):
        director._take(
            director.store.all()[0], f"\ud800{i}" + "y" * 200, "routed", 0.0, director.store.now()
        )
    values = check_exposition(director.metrics)
    assert len(values["model"]) <= MAX_MODEL_LABELS + 1
