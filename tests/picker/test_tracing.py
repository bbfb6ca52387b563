"""OpenTelemetry tracing of the routing path: spans, the continued W3C trace context, and
nothing at all when tracing is off."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("opentelemetry.sdk", reason="the tracing extra is a dev dependency")

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)
from opentelemetry.trace import StatusCode

from kv_picker.config import parse_config
from kv_picker.errors import ConfigError
from kv_picker.handlers.extproc import RequestStream
from kv_picker.plugins import builtin_registry
from kv_picker.tracing import RequestTracer
from kv_picker_bench.tracing_overhead import measure
from tests.fakes import make_director
from tests.picker.handlers.test_extproc_stream import (
    body_message,
    destination,
    headers_message,
    run,
)

TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
PARENT_SPAN_ID = 0x00F067AA0BA902B7
TRACEPARENT = f"00-{TRACE_ID:032x}-{PARENT_SPAN_ID:016x}-01"
BODY = json.dumps({"model": "m", "prompt": "hello " * 50}).encode()


def traced_director() -> tuple[object, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    director = make_director()
    director.tracer = RequestTracer(provider.get_tracer("test"), provider)
    return director, exporter


def test_spans_continue_the_request_trace_context() -> None:
    director, exporter = traced_director()
    stream = RequestStream(director)  # type: ignore[arg-type]
    out = run(stream, headers_message(extra=[("traceparent", TRACEPARENT)]), body_message(BODY))
    picked = destination(out[0])
    stream.close()
    spans = {span.name: span for span in exporter.get_finished_spans()}
    assert set(spans) == {"kv-picker.request", "parse", "prepare", "schedule", "pick"}
    root = spans["kv-picker.request"]
    assert root.context.trace_id == TRACE_ID
    assert root.parent is not None and root.parent.span_id == PARENT_SPAN_ID
    for name in ("parse", "prepare", "schedule", "pick"):
        span = spans[name]
        assert span.context.trace_id == TRACE_ID
        assert span.parent is not None and span.parent.span_id == root.context.span_id
    order = [spans[n].start_time for n in ("parse", "prepare", "schedule", "pick")]
    assert order == sorted(order)
    assert spans["pick"].attributes["kv_picker.endpoint"] == picked
    assert root.attributes["kv_picker.model"] == "m"
    # The endpoint's request carries the trace on, as a child of the picker's request span.
    mutation = out[0].request_headers.response.header_mutation.set_headers
    sent = {h.header.key: h.header.raw_value.decode() for h in mutation}
    assert sent["traceparent"] == f"00-{TRACE_ID:032x}-{root.context.span_id:016x}-01"


def test_a_request_without_trace_context_starts_a_trace() -> None:
    director, exporter = traced_director()
    stream = RequestStream(director)  # type: ignore[arg-type]
    run(stream, headers_message(), body_message(BODY))
    stream.close()
    root = next(s for s in exporter.get_finished_spans() if s.name == "kv-picker.request")
    assert root.parent is None and root.context.trace_id != TRACE_ID


def test_a_failed_request_marks_its_spans() -> None:
    director, exporter = traced_director()
    stream = RequestStream(director)  # type: ignore[arg-type]
    out = run(stream, headers_message(extra=[("traceparent", TRACEPARENT)]), body_message(b"{"))
    assert out[0].immediate_response.status.code == 400
    stream.close()
    spans = {span.name: span for span in exporter.get_finished_spans()}
    assert set(spans) == {"kv-picker.request", "parse"}
    assert spans["parse"].status.status_code == StatusCode.ERROR
    assert spans["kv-picker.request"].status.status_code == StatusCode.ERROR
    assert spans["kv-picker.request"].attributes["kv_picker.outcome"] == "bad-request"


def test_tracing_off_needs_no_opentelemetry() -> None:
    # OpenTelemetry made unimportable (other libraries, e.g. redis, import it when present):
    # with tracing off the picker routes all the same, so its path never touches it.
    code = "\n".join(
        [
            "import sys",
            'sys.modules["opentelemetry"] = None',
            "from kv_picker.app import PickerApp",
            "from kv_picker.handlers.extproc import RequestStream",
            "from tests.fakes import make_director",
            "from tests.picker.handlers.test_extproc_stream import body_message, headers_message, run",
            "director = make_director()",
            "assert director.tracer is None",
            "stream = RequestStream(director)",
            f"headers = headers_message(extra=[('traceparent', {TRACEPARENT!r})])",
            'body = body_message(b\'{"model": "m", "prompt": "hi"}\')',
            "run(stream, headers, body)",
            "assert stream.routed is not None",
            "stream.close()",
        ]
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr


def test_config_section_and_exporters() -> None:
    registry = builtin_registry(include_entry_points=False)
    config = parse_config(
        {"tracing": {"exporter": "console", "sampleRatio": 0.25, "serviceName": "gw"}}, registry
    )
    assert config.tracing is not None and config.tracing.sample_ratio == 0.25
    tracer = RequestTracer.from_config(config.tracing)
    tracer.shutdown()
    with pytest.raises(ConfigError, match="sampleRatio"):
        parse_config({"tracing": {"sampleRatio": 2}}, registry)
    otlp = parse_config({"tracing": {}}, registry).tracing
    assert otlp is not None and otlp.exporter == "otlp"
    try:
        import opentelemetry.exporter.otlp.proto.grpc  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match="opentelemetry-exporter-otlp-proto-grpc"):
            RequestTracer.from_config(otlp)


def test_the_overhead_benchmark_runs() -> None:
    results = measure(requests=20, rounds=1)
    assert set(results) == {"off", "on", "on, unsampled"}
    assert all(micros > 0 for micros in results.values())
