"""The ext_proc stream state machine: one gRPC stream per HTTP request.

Request direction, by the body mode Envoy announces in ``protocol_config``:

```
FULL_DUPLEX_STREAMED                         BUFFERED
headers  ──> (hold the reply)                headers ──> reply CONTINUE
body...  ──> buffer                          body (whole, one message)
body EOS ──> pick                                     ──> pick
        <── headers reply: destination,              <── body reply: destination header,
            clear_route_cache, metadata                  clear_route_cache, metadata
        <── body in ≤ 62,000-byte chunks
```

A request without a body (headers with end_of_stream) gets a random ready endpoint at once.
Any failure becomes an ``ImmediateResponse`` with a JSON error; every stream ends with a
response, so Envoy never waits on us. An unexpected exception is logged with the request id,
and the client gets the id, never the exception's text.

The request's life (admission, the pick, in-flight and queued-prefill accounting) belongs to
the :class:`~kv_picker.director.Director`; the stream holds the handle it returns
(:class:`~kv_picker.director.RoutedRequest`) and tells it the first byte and the end. Once the
pick is made the stream keeps nothing of the request body: the body is sent on (streamed mode)
and dropped, and the director drops the parsed prompt.

Response direction: headers are answered at once; body chunks are echoed one for one in
full-duplex mode (SSE chunks keep their boundaries) and acknowledged unchanged otherwise. Token
usage is read on the way past for metrics and the request log, and the end of the response
releases the endpoint's in-flight slot.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Iterator
from typing import Any

from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import json_format

from kv_picker.admission import parse_request_start
from kv_picker.director import Director, RoutedRequest
from kv_picker.endpoint import Endpoint
from kv_picker.errors import (
    BadRequestError,
    BodyTooLargeError,
    InternalError,
    OverloadedError,
    PickerError,
)
from kv_picker.handlers import responses
from kv_picker.handlers.usage import UsageReader
from kv_picker.request import LLMRequest
from kv_picker.tracing import RequestTrace
from kv_picker.wire import (
    DESTINATION_HEADER,
    PICKER_OWNED_HEADERS,
    PREFILLER_HEADER,
    REQUEST_ID_HEADER,
)

log = logging.getLogger(__name__)

_BodyMode = processing_mode_pb2.ProcessingMode
FULL_DUPLEX = _BodyMode.FULL_DUPLEX_STREAMED
NO_BODY = _BodyMode.NONE
# x-request-start stamps further than this from the picker's clock are ignored.
MAX_STAMP_AGE_S = 300.0
BUFFERED = _BodyMode.BUFFERED

NO_BODIES_WARNING = (
    "Envoy sends kv-picker no part of the responses (ext_proc processing_mode "
    "response_body_mode NONE, response_header_mode SKIP): with response_trailer_mode SKIP too, "
    "Envoy ends the stream as soon as the request is routed, so the picker stops counting the "
    "request as in flight then and sees neither its first byte nor its end nor its usage. Set "
    "response_header_mode SEND and response_body_mode FULL_DUPLEX_STREAMED (or STREAMED with a "
    "BUFFERED request body), or, to spare the picker the response chunks, response_body_mode "
    "NONE with response_header_mode SEND and response_trailer_mode SEND. Counted in "
    "kv_picker_responses_unseen_total."
)
LEAN_RESPONSES_INFO = (
    "Envoy sends kv-picker response headers but no response body (response_body_mode NONE): "
    "prefills end when the endpoint's scraped first-token count "
    "(vllm:time_to_first_token_seconds) shows it, or with the request where the endpoint exports "
    "none; the time-to-first-byte and token-usage histograms stay empty. This needs "
    "response_trailer_mode SEND, which keeps the stream to the response's end: with SKIP, Envoy "
    "ends it at the response headers, and the picker, which cannot tell, stops counting the "
    "request as in flight then."
)
OBSERVABILITY_WARNING = (
    "an Envoy ext_proc filter in observability_mode sends to kv-picker: Envoy drops the replies "
    "to such a filter, so its streams cannot route and are ignored. Route with a filter whose "
    "observability_mode is false. Counted in kv_picker_observability_streams_total."
)


class ExternalProcessor(pb_grpc.ExternalProcessorServicer):  # type: ignore[misc]
    """gRPC servicer for ``envoy.service.ext_proc.v3.ExternalProcessor``."""

    def __init__(self, director: Director) -> None:
        self.director = director

    async def Process(
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: Any
    ) -> AsyncIterator[pb.ProcessingResponse]:
        stream = RequestStream(self.director)
        try:
            async for message in request_iterator:
                for response in stream.handle(message):
                    yield response
                if stream.preparing is not None:
                    # Plugins' async work before the synchronous pick (see Director.prepare).
                    await stream.preparing
                    for response in stream.resume():
                        yield response
                if stream.closed or stream.complete:
                    # Ending the stream first, with our status, rather than waiting for Envoy to
                    # close it: when Envoy's filter goes away before the status is sent, grpcio's
                    # asyncio server fails that last batch and leaks its operations (about 100
                    # bytes a stream; grpc/grpc#43360).
                    return
        finally:
            stream.close()


class RequestStream:
    """State of one HTTP request as seen through ext_proc (sans I/O, easy to test)."""

    def __init__(self, director: Director) -> None:
        self.director = director
        self.metrics = director.metrics
        self.request_body_mode: int | None = None
        self.response_body_mode: int | None = None
        self.headers: dict[str, str] = {}
        self.headers_seen = False
        self.body_chunks: list[bytes] = []
        self.body_size_bytes = 0
        self.metadata: dict[str, Any] | None = None
        self.routed: RoutedRequest | None = None
        self.request: LLMRequest | None = None
        self.model = ""
        self.started_s = time.perf_counter()
        self.picked_s = 0.0
        self.first_byte_seen = False
        # Response headers came (whatever the body mode): the response has started.
        self.response_started = False
        self.usage: UsageReader | None = None
        self.closed = False
        self.finished = False
        # The response has ended (its last body chunk, its trailers, or headers ending it):
        # Envoy sends nothing more, and the picker ends the stream itself (see Process).
        self.complete = False
        # With tracing on (kv_picker.tracing): the request's spans, and the open prepare span.
        self.trace: RequestTrace | None = None
        self._prepare_span: Any = None
        # Set when the pick waits for Director.prepare: Process awaits it, then resume().
        self.preparing: Awaitable[None] | None = None
        self._resume_end_of_stream = True
        self._trailers_after_pick = False
        self._pending = False
        self._request_id: str | None = None
        # From an ext_proc filter in observability_mode (ignored: see handle).
        self.observed = False

    # -- dispatch -------------------------------------------------------------------------

    def handle(self, message: pb.ProcessingRequest) -> Iterator[pb.ProcessingResponse]:
        if message.observability_mode:
            # Envoy drops every reply to such a filter, so nothing here can route: the stream
            # is ignored, rather than counted as a request of its own next to the real one.
            if not self.observed:
                self.observed = True
                self._misconfigured(
                    self.metrics.observability_streams, "observability", OBSERVABILITY_WARNING
                )
            return
        if message.HasField("protocol_config"):
            self.request_body_mode = message.protocol_config.request_body_mode
            self.response_body_mode = message.protocol_config.response_body_mode
        # The metadata (a subset hint) only matters to the pick: once routed, a message that
        # carries it again is not decoded again.
        if self.routed is None and message.HasField("metadata_context"):
            self.metadata = json_format.MessageToDict(message.metadata_context).get(
                "filterMetadata", {}
            )
        kind = message.WhichOneof("request")
        try:
            if kind == "request_headers":
                yield from self._request_headers(message.request_headers)
            elif kind == "request_body":
                yield from self._request_body(message.request_body)
            elif kind == "request_trailers":
                yield from self._request_trailers()
            elif kind == "response_headers":
                yield from self._response_headers(message.response_headers)
            elif kind == "response_body":
                yield from self._response_body(message.response_body)
            elif kind == "response_trailers":
                self._finish()
                self.complete = True
                yield responses.CONTINUE_TRAILERS_RESPONSE
        except PickerError as error:
            yield self._fail(error)
        except Exception:  # never leave Envoy waiting on a bug
            yield self._fail(self._internal_error())

    @property
    def endpoint(self) -> Endpoint | None:
        """The destination, once routed."""
        return None if self.routed is None else self.routed.endpoint

    @property
    def prefill_endpoint(self) -> Endpoint | None:
        return None if self.routed is None else self.routed.prefill_endpoint

    @property
    def request_id(self) -> str:
        """The request's id: the parsed request's, else the header's, else one made up here
        (once), so that every error the client sees can be found in the logs."""
        if self.request is not None:
            return self.request.request_id
        request_id = self.headers.get(REQUEST_ID_HEADER, "")
        if not request_id:
            if self._request_id is None:
                self._request_id = str(uuid.uuid4())
            request_id = self._request_id
        return request_id

    def _internal_error(self) -> InternalError:
        """Log the exception being handled; the client gets the request id only."""
        log.exception("request %s: ext_proc stream failed", self.request_id)
        return InternalError(f"internal error (request id {self.request_id})")

    def close(self) -> None:
        """The gRPC stream ended (normally, or the client went away)."""
        self._leave_pending()
        self._finish()
        self.closed = True
        if self.trace is not None:
            if self._prepare_span is not None:
                self._prepare_span.end()
            self.trace.end()
            self.trace = None

    def _enter_pending(self) -> None:
        """Count this request as waiting for its pick, unless too many already wait."""
        director = self.director
        limit = director.config.admission.max_pending_requests
        if limit and director.pending >= limit:
            raise OverloadedError(
                f"kv-picker is overloaded: {director.pending} requests are waiting to be "
                "scheduled (admission.maxPendingRequests)"
            )
        director.pending += 1
        self._pending = True

    def _check_queue_delay(self) -> None:
        """Shed this request if it waited too long before reaching the picker (admission.py)."""
        config = self.director.config.admission
        raw = self.headers.get(config.request_start_header)
        if raw is None:
            return
        started_s = parse_request_start(raw)
        if started_s is None:
            return
        now_s = time.time()
        if abs(now_s - started_s) > MAX_STAMP_AGE_S:
            return  # not a stamp of this request's arrival: a clock that far off, or forged
        gate = self.director.queue_gate
        wait_s = gate.wait_s(started_s, now_s)
        self.metrics.queue_delay.observe(wait_s)
        target_s = config.queue_delay_target_s
        if target_s > 0 and not gate.admit(wait_s, now_s, target_s, config.queue_delay_interval_s):
            raise OverloadedError(
                f"kv-picker is overloaded: this request waited {wait_s * 1000:.1f} ms before the "
                f"picker saw it, while requests keep waiting longer than "
                f"admission.queueDelayTarget ({target_s * 1000:g} ms)"
            )

    def _leave_pending(self) -> None:
        if self._pending:
            self._pending = False
            self.director.pending -= 1

    # -- request direction ----------------------------------------------------------------

    def _request_headers(self, message: pb.HttpHeaders) -> Iterator[pb.ProcessingResponse]:
        if self.headers_seen:
            # One stream is one HTTP request: Envoy never sends its headers twice.
            raise InternalError("ext_proc protocol error: request headers received twice")
        self.headers_seen = True
        for header in message.headers.headers:
            value = (
                header.raw_value.decode("utf-8", "replace") if header.raw_value else header.value
            )
            self.headers[header.key.lower()] = value
        self._check_queue_delay()
        if self.director.tracer is not None and not message.end_of_stream:
            self.trace = self.director.tracer.start(self.headers)
        if message.end_of_stream:
            yield self._headers_pick(self._routed(self.director.route_bodyless(self.metadata)))
            return
        mode = self.request_body_mode
        if mode in (FULL_DUPLEX, BUFFERED, None):
            self._enter_pending()  # until the pick: the body is still to come
        if mode == FULL_DUPLEX:
            return  # hold the headers reply until the body has arrived
        if mode in (BUFFERED, None):
            yield responses.CONTINUE_HEADERS_REQUEST
            return
        # STREAMED / BUFFERED_PARTIAL: headers leave before the body; we cannot read it first.
        yield self._headers_pick(self._routed(self.director.route_bodyless(self.metadata)))

    def _request_body(self, message: pb.HttpBody) -> Iterator[pb.ProcessingResponse]:
        if not self.headers_seen:
            raise InternalError("ext_proc protocol error: request body before its headers")
        if self.routed is not None:  # streamed mode: already routed, let the body through
            yield responses.CONTINUE_BODY_REQUEST
            return
        if message.body:
            self.body_size_bytes += len(message.body)
            if self.body_size_bytes > self.director.max_body_bytes:
                raise BodyTooLargeError(
                    f"request body exceeds the limit of {self.director.max_body_bytes} bytes"
                )
            self.body_chunks.append(message.body)
        if message.end_of_stream or self.request_body_mode == BUFFERED:
            yield from self._route_body(end_of_stream=True)

    def _request_trailers(self) -> Iterator[pb.ProcessingResponse]:
        if self.routed is None and self.request_body_mode == FULL_DUPLEX:
            # Trailers end the body when the client sent them.
            yield from self._route_body(end_of_stream=False)
            if self.preparing is not None:
                self._trailers_after_pick = True  # answered in order, after the pick
                return
        yield responses.CONTINUE_TRAILERS_REQUEST

    def _route_body(self, end_of_stream: bool) -> Iterator[pb.ProcessingResponse]:
        body = b"".join(self.body_chunks)
        self.body_chunks = [body]
        if not body:
            raise BadRequestError("request body is empty")
        trace = self.trace
        if trace is None:
            request = self.director.parse(body, self.headers)
        else:
            span = trace.start("parse")
            try:
                request = self.director.parse(body, self.headers)
            except BaseException as error:
                trace.fail(span, error)
                raise
            span.end()
            trace.set("kv_picker.model", request.model)
            self._prepare_span = trace.start("prepare")
        self.model = request.model
        self.request = request
        self.preparing = self.director.prepare(request)
        if self.preparing is not None:
            self._resume_end_of_stream = end_of_stream
            return
        yield from self._pick(request, body, end_of_stream)

    def resume(self) -> Iterator[pb.ProcessingResponse]:
        """Finish routing once :attr:`preparing` is done (like :meth:`handle`, never raises)."""
        self.preparing = None
        if self._prepare_span is not None:
            self._prepare_span.end()
            self._prepare_span = None
        if self.request is None:
            return
        try:
            yield from self._pick(self.request, self.body_chunks[0], self._resume_end_of_stream)
            if self._trailers_after_pick:
                yield responses.CONTINUE_TRAILERS_REQUEST
        except PickerError as error:
            yield self._fail(error)
        except Exception:  # never leave Envoy waiting on a bug
            yield self._fail(self._internal_error())

    def _pick(
        self, request: LLMRequest, body: bytes, end_of_stream: bool
    ) -> Iterator[pb.ProcessingResponse]:
        if self._prepare_span is not None:  # nothing was awaited
            self._prepare_span.end()
            self._prepare_span = None
        routed = self._routed(self.director.route(request, self.metadata, trace=self.trace))
        # The body is all the stream still holds of the request: send it on, then let it go.
        self.body_chunks = []
        if self.request_body_mode == FULL_DUPLEX:
            yield self._headers_pick(routed, content_length=len(body))
            yield from responses.streamed_body(body, request=True, end_of_stream=end_of_stream)
        else:
            common = self._routing_common(routed, content_length=None)
            yield pb.ProcessingResponse(
                request_body=pb.BodyResponse(response=common),
                dynamic_metadata=responses.destination_metadata(routed.endpoint.address),
            )

    def _routing_common(
        self, routed: RoutedRequest, content_length: int | None
    ) -> pb.CommonResponse:
        set_headers = [(DESTINATION_HEADER, routed.endpoint.address)]
        if content_length is not None:
            set_headers.append(("content-length", str(content_length)))
        if routed.prefill_endpoint is not None:
            set_headers.append((PREFILLER_HEADER, routed.prefill_endpoint.address))
        if self.trace is not None:  # the model server's spans continue the request's trace
            set_headers += self.trace.carrier().items()
        set_names = {name for name, _ in set_headers}
        # Headers only the picker may set: drop whatever the client sent.
        remove = [h for h in PICKER_OWNED_HEADERS if h in self.headers and h not in set_names]
        return responses.routing_mutation(set_headers, remove)

    def _headers_pick(
        self, routed: RoutedRequest, content_length: int | None = None
    ) -> pb.ProcessingResponse:
        return pb.ProcessingResponse(
            request_headers=pb.HeadersResponse(
                response=self._routing_common(routed, content_length)
            ),
            dynamic_metadata=responses.destination_metadata(routed.endpoint.address),
        )

    def _routed(self, routed: RoutedRequest) -> RoutedRequest:
        self._leave_pending()
        self.routed = routed
        if self.response_body_mode == NO_BODY:
            routed.no_first_byte()  # the endpoint's first-token count will tell
        self.picked_s = time.perf_counter()
        return routed

    def _fail(self, error: PickerError) -> pb.ProcessingResponse:
        self._leave_pending()
        self.metrics.requests.labels(self.metrics.model_label(self.model), error.reason).inc()
        if self.trace is not None:
            self.trace.set("kv_picker.outcome", error.reason)
        if error.status >= 500:
            request_id = self.request_id
            if not isinstance(error, OverloadedError):
                # (Shed requests are counted, not logged: a log line each would add to the load.)
                log.warning("request %s failed: %s", request_id, error.message)
            if request_id not in error.message:
                # Our own words only (never an exception's), and the id to find the log line.
                error.message = f"{error.message} (request id {request_id})"
        self.closed = True
        return responses.immediate_error(error)

    # -- response direction ---------------------------------------------------------------

    def _response_headers(self, message: pb.HttpHeaders) -> Iterator[pb.ProcessingResponse]:
        content_type = ""
        for header in message.headers.headers:
            if header.key.lower() == "content-type":
                content_type = (
                    header.raw_value.decode("latin-1") if header.raw_value else header.value
                )
                break
        self.usage = UsageReader(streaming="text/event-stream" in content_type)
        self.response_started = True
        routed = self.routed
        extra = (
            self.director.response_headers(routed.request, routed.endpoint)
            if routed is not None and routed.request is not None
            else []
        )
        if extra:
            yield pb.ProcessingResponse(
                response_headers=pb.HeadersResponse(
                    response=pb.CommonResponse(
                        header_mutation=pb.HeaderMutation(
                            set_headers=[responses.header_option(k, v) for k, v in extra]
                        )
                    )
                )
            )
        else:
            yield responses.CONTINUE_HEADERS_RESPONSE
        if message.end_of_stream:
            self._finish()
            self.complete = True

    def _response_body(self, message: pb.HttpBody) -> Iterator[pb.ProcessingResponse]:
        if message.body and not self.first_byte_seen:
            self.first_byte_seen = True
            if self.routed is not None:  # a response byte means the prompt has been processed
                self.routed.first_byte()
            if self.picked_s:
                self.metrics.ttft_seconds.observe(time.perf_counter() - self.picked_s)
        if self.usage is not None and message.body:
            self.usage.feed(message.body)
        if self.response_body_mode == FULL_DUPLEX:
            yield pb.ProcessingResponse(
                response_body=pb.BodyResponse(
                    response=pb.CommonResponse(
                        body_mutation=pb.BodyMutation(
                            streamed_response=pb.StreamedBodyResponse(
                                body=message.body, end_of_stream=message.end_of_stream
                            )
                        )
                    )
                )
            )
        else:
            yield responses.CONTINUE_BODY_RESPONSE
        if message.end_of_stream:
            self._finish()
            self.complete = True

    def _misconfigured(self, counter: Any, kind: str, message: str) -> None:
        """Count a stream that Envoy's configuration keeps from routing well; log the first of
        each ``kind`` in this process as a warning."""
        counter.inc()
        warned = self.director.config_warnings
        if kind not in warned:
            warned.add(kind)
            log.warning(message)

    def _finish(self) -> None:
        # Only a routed request has anything to release; release it exactly once.
        routed = self.routed
        if self.finished or routed is None:
            return
        self.finished = True
        usage = self.usage.result() if self.usage is not None else None
        routed.finish(usage.completion_tokens if usage is not None else None)
        if self.response_body_mode == NO_BODY:
            if self.response_started:
                # Response headers, no body (lean): the trailers keep the stream to the
                # response's end. Said once, as a fact.
                if "lean" not in self.director.config_warnings:
                    self.director.config_warnings.add("lean")
                    log.info(LEAN_RESPONSES_INFO)
            else:
                # No response message: the stream ended when the request was routed.
                self._misconfigured(self.metrics.responses_unseen, "no-bodies", NO_BODIES_WARNING)
        metrics = self.metrics
        metrics.request_seconds.observe(time.perf_counter() - self.started_s)
        if usage is not None:
            if usage.prompt_tokens is not None:
                metrics.input_tokens.observe(usage.prompt_tokens)
            if usage.completion_tokens is not None:
                metrics.output_tokens.observe(usage.completion_tokens)
            if usage.cached_tokens:
                metrics.cached_tokens.inc(usage.cached_tokens)
