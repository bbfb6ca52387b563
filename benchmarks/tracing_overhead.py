"""``kv-picker bench tracing``: what OpenTelemetry tracing costs per request, off and on.

The picker's own request path, in process: an ext_proc stream (request headers with a
``traceparent``, a completions body, response headers and body, stream end) through the real
handler, director and default profile over 8 endpoints, with nothing on the network, so that
the difference between the variants is the tracing and nothing else:

- ``off``: no ``tracing`` section (the director holds no tracer; OpenTelemetry not imported);
- ``on``: every request sampled, spans handed to a batch processor whose exporter discards them
  (the export itself runs on the processor's thread, off the request path);
- ``on, unsampled``: ``sampleRatio: 0`` (spans are created but not recorded).

Each variant runs ``--rounds`` rounds of ``--requests`` requests, interleaved, and reports the
median per-request time of its rounds.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Sequence
from typing import Any

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from kv_picker.config import parse_config
from kv_picker.director import Director
from kv_picker.endpoint import EndpointSpec
from kv_picker.handlers.extproc import RequestStream
from kv_picker.metrics import PickerMetrics
from kv_picker.plugins import builtin_registry
from kv_picker.scheduling.context import BuildContext
from kv_picker.scheduling.scheduler import Scheduler
from kv_picker.state.endpoints import EndpointStore
from kv_picker.tracing import RequestTracer

NUM_ENDPOINTS = 8
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def build_director(tracer: RequestTracer | None) -> Director:
    store = EndpointStore(time.monotonic)
    store.set_endpoints(EndpointSpec(f"10.0.0.{i + 1}:8000", {}) for i in range(NUM_ENDPOINTS))
    for endpoint in store.all():
        store.update_metrics(endpoint.id, waiting=0.0, running=0.0, kv_usage=0.0)
    registry = builtin_registry(include_entry_points=False)
    config = parse_config({"seed": 0}, registry)
    ctx = BuildContext(store, random.Random(0), store.now, metrics_staleness_s=3600.0)
    metrics = PickerMetrics()
    director = Director(config, store, Scheduler(config, registry, ctx, metrics), ctx.rng, metrics)
    director.tracer = tracer
    return director


def sdk_tracer(sample_ratio: float) -> RequestTracer:
    """A tracer whose spans go through a batch processor to an exporter that drops them."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        SpanExporter,
        SpanExportResult,
    )
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    class Discard(SpanExporter):
        def export(self, spans: Any) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    # The incoming traceparent is sampled; ParentBased would follow it, so the ratio decides
    # only when it is the root: unsampled runs use a plain ratio sampler.
    sampler = (
        ParentBased(TraceIdRatioBased(sample_ratio))
        if sample_ratio > 0
        else TraceIdRatioBased(sample_ratio)
    )
    provider = TracerProvider(sampler=sampler)
    provider.add_span_processor(BatchSpanProcessor(Discard(), max_queue_size=1 << 17))
    return RequestTracer(provider.get_tracer("bench"), provider)


def messages(i: int) -> list[pb.ProcessingRequest]:
    mode = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
    headers = base_pb2.HeaderMap(
        headers=[
            base_pb2.HeaderValue(key=":path", raw_value=b"/v1/completions"),
            base_pb2.HeaderValue(key=":method", raw_value=b"POST"),
            base_pb2.HeaderValue(key="traceparent", raw_value=TRACEPARENT.encode()),
        ]
    )
    body = json.dumps(
        {"model": "m", "prompt": f"tenant {i % 16} " + "shared system prompt " * 100}
    ).encode()
    response_headers = base_pb2.HeaderMap(
        headers=[base_pb2.HeaderValue(key="content-type", raw_value=b"application/json")]
    )
    return [
        pb.ProcessingRequest(
            request_headers=pb.HttpHeaders(headers=headers),
            protocol_config=pb.ProtocolConfiguration(
                request_body_mode=mode, response_body_mode=mode
            ),
        ),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=True)),
        pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=response_headers)),
        pb.ProcessingRequest(
            response_body=pb.HttpBody(
                body=b'{"usage": {"completion_tokens": 4}}', end_of_stream=True
            )
        ),
    ]


def run_round(director: Director, requests: Sequence[list[pb.ProcessingRequest]]) -> float:
    """Seconds per request over one round."""
    started = time.perf_counter()
    for stream_messages in requests:
        stream = RequestStream(director)
        for message in stream_messages:
            for _ in stream.handle(message):
                pass
        stream.close()
    return (time.perf_counter() - started) / len(requests)


def measure(requests: int, rounds: int) -> dict[str, float]:
    """Median microseconds per request by variant."""
    variants = {
        "off": build_director(None),
        "on": build_director(sdk_tracer(1.0)),
        "on, unsampled": build_director(sdk_tracer(0.0)),
    }
    prepared = [messages(i) for i in range(requests)]
    for director in variants.values():  # warm-up: caches, code paths, allocator
        run_round(director, prepared[: min(200, requests)])
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, director in variants.items():
            samples[name].append(run_round(director, prepared))
    for director in variants.values():
        if director.tracer is not None:
            director.tracer.shutdown()
    return {name: statistics.median(values) * 1e6 for name, values in samples.items()}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kv-picker bench tracing", description=__doc__)
    parser.add_argument("--requests", type=int, default=2000, help="requests per round")
    parser.add_argument("--rounds", type=int, default=7, help="rounds per variant")
    args = parser.parse_args(argv)
    results = measure(args.requests, args.rounds)
    off = results["off"]
    print("| tracing | µs per request (median of rounds) | vs off |")
    print("|---|---|---|")
    for name, micros in results.items():
        print(f"| {name} | {micros:.1f} | {micros - off:+.1f} µs ({micros / off - 1:+.1%}) |")
    return 0
