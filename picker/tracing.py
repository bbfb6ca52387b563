"""Optional OpenTelemetry tracing of the routing path (``tracing:`` in the config).

Off unless configured, and then free: nothing here is imported by the request path, the
director and the ext_proc handler hold ``None`` instead of a tracer and test it once per stage.
When configured (``pip install 'kv-picker[tracing]'``), each request routed through ext_proc
gets one span tree, continuing the W3C trace context (``traceparent``, ``tracestate``) of the
request's headers, and the destination request carries the context on to the model server:

```
kv-picker.request  (SERVER, parent: the client's traceparent; attributes: model, outcome)
  ├── parse        body -> typed request
  ├── prepare      plugins' async work (tokenization, index prefetch), when there is any
  ├── schedule     candidates, admission, filters -> scorers -> picker of every profile
  └── pick         the destination's accounting (slot, queued prefill); endpoint attribute
```

The tracer provider is the picker's own (not the process-global one): sampler
``ParentBased(TraceIdRatioBased(sampleRatio))``, a batch processor, and the OTLP/gRPC exporter
(``opentelemetry-exporter-otlp-proto-grpc``) or the console exporter.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, Any, Literal

from kv_picker.decode import Range
from kv_picker.errors import ConfigError

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer


@dataclass(frozen=True)
class TracingConfig:
    """``tracing``: OpenTelemetry spans for the routing path (off when the section is absent)."""

    service_name: str = "kv-picker"
    exporter: Literal["otlp", "console"] = "otlp"
    endpoint: str = "http://localhost:4317"
    sample_ratio: Annotated[float, Range(ge=0, le=1)] = 1.0
    insecure: bool = True


class RequestTrace:
    """The spans of one request. Spans are started and ended explicitly: the ext_proc handler
    is a state machine whose stages end in later messages, not in one ``with`` block."""

    __slots__ = ("_context", "_propagator", "_root", "_tracer")

    def __init__(self, tracer: Tracer, propagator: Any, headers: Mapping[str, str]) -> None:
        from opentelemetry.trace import SpanKind, set_span_in_context

        self._tracer = tracer
        self._propagator = propagator
        parent = propagator.extract(headers)
        self._root = tracer.start_span("kv-picker.request", context=parent, kind=SpanKind.SERVER)
        self._context = set_span_in_context(self._root)

    def start(self, name: str) -> Span:
        """A child span of the request's; the caller ends it."""
        return self._tracer.start_span(name, context=self._context)

    def carrier(self) -> dict[str, str]:
        """The trace context headers (``traceparent``, ...) to send on to the endpoint."""
        headers: dict[str, str] = {}
        self._propagator.inject(headers, context=self._context)
        return headers

    def set(self, key: str, value: str) -> None:
        self._root.set_attribute(key, value)

    def fail(self, span: Span | None, error: BaseException) -> None:
        """Mark ``span`` (when given) and the request's span as failed by ``error``."""
        from opentelemetry.trace import Status, StatusCode

        for target in (span, self._root):
            if target is not None:
                target.record_exception(error)
                target.set_status(Status(StatusCode.ERROR, str(error)))
        if span is not None:
            span.end()

    def end(self) -> None:
        self._root.end()


class RequestTracer:
    """Starts a :class:`RequestTrace` per request; exists only when tracing is configured."""

    def __init__(self, tracer: Tracer, provider: Any = None) -> None:
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.tracer = tracer
        self.provider = provider
        self._propagator = TraceContextTextMapPropagator()

    def start(self, headers: Mapping[str, str]) -> RequestTrace:
        return RequestTrace(self.tracer, self._propagator, headers)

    def shutdown(self) -> None:
        """Flush and stop the exporter (the provider is the picker's own)."""
        if self.provider is not None:
            self.provider.shutdown()

    @classmethod
    def from_config(cls, config: TracingConfig) -> RequestTracer:
        """Build the picker's tracer provider and exporter.

        Raises:
            ConfigError: the OpenTelemetry packages the config needs are not installed.
        """
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
            from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
        except ImportError as exc:
            raise ConfigError(
                f"tracing: needs opentelemetry-sdk (pip install 'kv-picker[tracing]'): {exc}"
            ) from exc
        exporter: Any
        if config.exporter == "console":
            exporter = ConsoleSpanExporter()
        else:
            try:
                from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import (
                    OTLPSpanExporter,
                )
            except ImportError as exc:
                raise ConfigError(
                    "tracing.exporter: otlp needs opentelemetry-exporter-otlp-proto-grpc"
                ) from exc
            exporter = OTLPSpanExporter(endpoint=config.endpoint, insecure=config.insecure)
        provider = TracerProvider(
            resource=Resource.create({"service.name": config.service_name}),
            sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)),
        )
        provider.add_span_processor(BatchSpanProcessor(exporter))
        return cls(provider.get_tracer("kv_picker"), provider)
