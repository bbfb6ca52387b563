"""The ext_proc state machine, message by message (the real-Envoy tests are in integration/)."""

import json

import pytest
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_picker.endpoint import EndpointId
from kv_picker.handlers.extproc import RequestStream
from kv_picker.wire import BODY_CHUNK_LIMIT_BYTES, DROPPED_REASON_HEADER
from tests.fakes import make_director, make_store

Mode = processing_mode_pb2.ProcessingMode


def headers_message(
    path="/v1/completions",
    end_of_stream=False,
    extra=(),
    mode=Mode.FULL_DUPLEX_STREAMED,
    subset=None,
):  # type: ignore[no-untyped-def]
    header_map = base_pb2.HeaderMap(
        headers=[
            base_pb2.HeaderValue(key=":path", raw_value=path.encode()),
            base_pb2.HeaderValue(key=":method", raw_value=b"POST"),
            *[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in extra],
        ]
    )
    message = pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=header_map, end_of_stream=end_of_stream),
        protocol_config=pb.ProtocolConfiguration(request_body_mode=mode, response_body_mode=mode),
    )
    if subset is not None:
        hint = struct_pb2.Struct()
        hint.update({"x-gateway-destination-endpoint-subset": subset})
        message.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
    return message


def body_message(body: bytes, end_of_stream: bool = True) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=body, end_of_stream=end_of_stream))


def run(stream: RequestStream, *messages: pb.ProcessingRequest) -> list[pb.ProcessingResponse]:
    out = []
    for message in messages:
        out.extend(stream.handle(message))
    return out


def destination(response: pb.ProcessingResponse) -> str:
    common = (
        response.request_headers.response
        if response.HasField("request_headers")
        else response.request_body.response
    )
    assert common.clear_route_cache
    values = {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}
    meta = response.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    assert (
        meta["x-gateway-destination-endpoint"].string_value
        == values["x-gateway-destination-endpoint"]
    )
    return values["x-gateway-destination-endpoint"]


BODY = json.dumps({"model": "m", "prompt": "hello " * 50}).encode()


def test_full_duplex_holds_headers_then_routes_and_echoes_body() -> None:
    director = make_director()
    stream = RequestStream(director)
    assert run(stream, headers_message()) == []  # the headers reply waits for the body
    assert run(stream, body_message(BODY[:10], end_of_stream=False)) == []
    out = run(stream, body_message(BODY[10:]))
    assert out[0].HasField("request_headers")
    picked = destination(out[0])
    assert picked in {e.address for e in director.store.all()}
    chunks = [r.request_body.response.body_mutation.streamed_response for r in out[1:]]
    assert b"".join(c.body for c in chunks) == BODY and chunks[-1].end_of_stream
    endpoint = director.store.by_address[picked]
    assert director.store.in_flight[endpoint.id] == 1
    stream.close()
    assert director.store.in_flight[endpoint.id] == 0


def test_large_body_rechunked_under_limit() -> None:
    director = make_director()
    big = json.dumps({"model": "m", "prompt": "x" * 200_000}).encode()
    out = run(RequestStream(director), headers_message(), body_message(big))
    chunks = [r.request_body.response.body_mutation.streamed_response for r in out[1:]]
    assert len(chunks) == -(-len(big) // BODY_CHUNK_LIMIT_BYTES)
    assert all(len(c.body) <= BODY_CHUNK_LIMIT_BYTES for c in chunks)
    assert [c.end_of_stream for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert b"".join(c.body for c in chunks) == big


def test_buffered_mode_continues_headers_and_routes_on_body() -> None:
    director = make_director()
    stream = RequestStream(director)
    (first,) = run(stream, headers_message(mode=Mode.BUFFERED))
    assert first.HasField("request_headers")
    assert not first.request_headers.response.header_mutation.set_headers
    (second,) = run(stream, body_message(BODY))
    assert second.HasField("request_body")
    assert destination(second) in director.store.by_address


def test_bodyless_request_goes_to_a_ready_endpoint() -> None:
    director = make_director()
    (out,) = run(RequestStream(director), headers_message(path="/v1/models", end_of_stream=True))
    assert destination(out) in director.store.by_address


def test_client_headers_cannot_steer_or_inject() -> None:
    director = make_director(store=make_store(2))
    extra = [
        ("x-gateway-destination-endpoint", "6.6.6.6:1"),
        ("x-prefiller-host-port", "6.6.6.6:2"),
    ]
    out = run(RequestStream(director), headers_message(extra=extra), body_message(BODY))
    assert destination(out[0]) != "6.6.6.6:1"
    assert "x-prefiller-host-port" in out[0].request_headers.response.header_mutation.remove_headers


def test_subset_hint_restricts_and_empty_subset_is_503() -> None:
    director = make_director(store=make_store(4))
    for _ in range(20):
        out = run(
            RequestStream(director), headers_message(subset=["10.0.0.3:8000"]), body_message(BODY)
        )
        assert destination(out[0]) == "10.0.0.3:8000"
    (error,) = run(RequestStream(director), headers_message(subset=[]), body_message(BODY))
    assert error.immediate_response.status.code == 503


def test_metadata_after_the_pick_is_not_read_again(monkeypatch: pytest.MonkeyPatch) -> None:
    # Envoy may attach the metadata to every message; once routed, the stream ignores it.
    stream = RequestStream(make_director())
    run(stream, headers_message(subset=["10.0.0.3:8000"]), body_message(BODY))
    assert stream.endpoint is not None and stream.endpoint.address == "10.0.0.3:8000"
    decoded = []
    monkeypatch.setattr(
        "kv_picker.handlers.extproc.json_format.MessageToDict",
        lambda message: decoded.append(message) or {},
    )
    chunk = pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: {}\n\n"))
    chunk.metadata_context.CopyFrom(headers_message(subset=["10.0.0.1:8000"]).metadata_context)
    out = run(stream, chunk)
    assert len(out) == 1 and out[0].HasField("response_body")
    assert decoded == []
    assert stream.metadata == {"envoy.lb.subset_hint": {
        "x-gateway-destination-endpoint-subset": ["10.0.0.3:8000"]}}  # fmt: skip


@pytest.mark.parametrize(
    ("body", "status", "reason"),
    [
        (b"{oops", 400, "bad-request"),
        (b'{"prompt": "x"}', 400, "bad-request"),
        (b"", 400, "bad-request"),
    ],
)
def test_errors_are_immediate_json_responses(body: bytes, status: int, reason: str) -> None:
    stream = RequestStream(make_director())
    (out,) = run(stream, headers_message(), body_message(body))
    response = out.immediate_response
    assert response.status.code == status
    document = json.loads(response.body)
    assert document["error"]["code"] == status and document["error"]["message"]
    reasons = {h.header.key: h.header.raw_value.decode() for h in response.headers.set_headers}
    assert reasons["x-llm-d-request-dropped-reason"] == reason
    assert stream.closed


def test_body_over_limit_is_413_before_the_end() -> None:
    director = make_director({"server": {"maxBodyBytes": 1000}})
    stream = RequestStream(director)
    assert run(stream, headers_message(), body_message(b"x" * 600, end_of_stream=False)) == []
    (out,) = run(stream, body_message(b"x" * 600, end_of_stream=False))
    assert out.immediate_response.status.code == 413 and stream.closed


def test_no_ready_endpoint_is_503() -> None:
    store = make_store(2)
    for endpoint in store.all():
        store.set_ready(endpoint.id, False)
    (out,) = run(RequestStream(make_director(store=store)), headers_message(), body_message(BODY))
    assert out.immediate_response.status.code == 503


def test_response_sse_echoed_chunk_for_chunk_and_usage_read() -> None:
    director = make_director()
    stream = RequestStream(director)
    run(stream, headers_message(), body_message(BODY))
    response_headers = pb.ProcessingRequest(
        response_headers=pb.HttpHeaders(
            headers=base_pb2.HeaderMap(
                headers=[
                    base_pb2.HeaderValue(key=":status", raw_value=b"200"),
                    base_pb2.HeaderValue(key="content-type", raw_value=b"text/event-stream"),
                ]
            )
        )
    )
    (reply,) = run(stream, response_headers)
    assert reply.HasField("response_headers")
    events = [
        b'data: {"choices":[{"text":"a"}]}\n\n',
        b'data: {"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":2,'
        b'"prompt_tokens_details":{"cached_tokens":4}}}\n\ndata: [DONE]\n\n',
    ]
    echoed = []
    for i, event in enumerate(events):
        (out,) = run(
            stream,
            pb.ProcessingRequest(
                response_body=pb.HttpBody(body=event, end_of_stream=i == len(events) - 1)
            ),
        )
        echoed.append(out.response_body.response.body_mutation.streamed_response)
    assert [e.body for e in echoed] == events
    assert [e.end_of_stream for e in echoed] == [False, True]
    assert stream.finished
    assert director.metrics.cached_tokens._value.get() == 4
    assert sum(director.store.in_flight) == 0


def test_model_label_cardinality_is_capped() -> None:
    director = make_director()
    for i in range(150):
        body = json.dumps({"model": f"model-{i}", "prompt": "hi"}).encode()
        stream = RequestStream(director)
        run(stream, headers_message(), body_message(body))
        stream.close()
    exposition = director.metrics.exposition().decode()
    models = {
        line.split('model="')[1].split('"')[0]
        for line in exposition.splitlines()
        if line.startswith("kv_picker_requests_total{")
    }
    assert len(models) == 101 and "other" in models


def test_prefill_work_is_counted_until_the_first_response_byte() -> None:
    director = make_director()
    stream = RequestStream(director)
    out = run(stream, headers_message(), body_message(BODY))
    target = director.store.by_address[destination(out[0])]
    queued = director.store.prefill_tokens[target.id]
    assert queued == pytest.approx(len(json.loads(BODY)["prompt"]) / 4)
    assert director.store.prefill_requests[target.id] == 1
    run(stream, pb.ProcessingRequest(response_body=pb.HttpBody(body=b"{", end_of_stream=False)))
    assert director.store.prefill_tokens[target.id] == 0.0
    assert director.store.prefill_requests[target.id] == 0
    stream.close()
    assert director.store.in_flight[target.id] == 0


def test_prefill_work_released_when_the_stream_dies_first() -> None:
    director = make_director()
    stream = RequestStream(director)
    run(stream, headers_message(), body_message(BODY))
    stream.close()  # client went away before any response byte
    assert sum(director.store.prefill_tokens) == 0.0
    assert sum(director.store.prefill_requests) == 0


_MESSAGES = st.one_of(
    st.builds(
        lambda eos, mode: headers_message(end_of_stream=eos, mode=mode),
        st.booleans(),
        st.sampled_from([Mode.FULL_DUPLEX_STREAMED, Mode.BUFFERED, Mode.STREAMED, Mode.NONE]),
    ),
    st.builds(body_message, st.one_of(st.binary(max_size=64), st.just(BODY)), st.booleans()),
    st.just(pb.ProcessingRequest(request_trailers=pb.HttpTrailers())),
    st.just(pb.ProcessingRequest(response_headers=pb.HttpHeaders())),
    st.builds(
        lambda body, eos: pb.ProcessingRequest(
            response_body=pb.HttpBody(body=body, end_of_stream=eos)
        ),
        st.binary(max_size=64),
        st.booleans(),
    ),
    st.just(pb.ProcessingRequest(response_trailers=pb.HttpTrailers())),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(_MESSAGES, max_size=8))
def test_any_message_sequence_answers_without_raising_and_releases(
    messages: list[pb.ProcessingRequest],
) -> None:
    director = make_director()
    stream = RequestStream(director)
    for message in messages:
        for response in stream.handle(message):
            assert isinstance(response, pb.ProcessingResponse)
            assert response.WhichOneof("response") is not None
        if stream.closed:
            break
    stream.close()
    assert sum(director.store.in_flight) == 0
    assert sum(director.store.prefill_requests) == 0


@pytest.mark.parametrize("mode", [Mode.FULL_DUPLEX_STREAMED, Mode.BUFFERED])
def test_after_the_pick_the_stream_holds_nothing_of_the_body(mode: int) -> None:
    import gc
    import tracemalloc

    director = make_director()
    prompt = "a long shared context, " * 40_000  # about 1 MB
    big = json.dumps({"model": "m", "prompt": prompt}).encode()
    streams = []
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(10):
            stream = RequestStream(director)
            run(stream, headers_message(mode=mode), body_message(big))
            streams.append(stream)  # responses not started: each request is still open
        gc.collect()
        held = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert all(s.routed is not None and not s.body_chunks for s in streams)
    assert all(s.routed.request.prompt.text == "" for s in streams)  # type: ignore[union-attr]
    # Ten open requests of 1 MB each: kept bodies or prompts would be tens of megabytes.
    assert held < 2 * 1024 * 1024, held
    for stream in streams:
        stream.close()


def test_an_internal_error_sends_the_request_id_never_the_exception_text() -> None:
    director = make_director()

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("secret internal detail /etc/passwd")

    director.scheduler.schedule = broken  # type: ignore[method-assign]
    out = run(
        RequestStream(director),
        headers_message(extra=[("x-request-id", "req-42")]),
        body_message(BODY),
    )
    (response,) = out
    body = response.immediate_response.body.decode()
    assert response.immediate_response.status.code == 500
    assert "req-42" in body
    assert "secret" not in body and "RuntimeError" not in body


@pytest.mark.parametrize("mode", [Mode.FULL_DUPLEX_STREAMED, Mode.BUFFERED])
def test_past_the_pending_bound_a_request_is_refused_before_its_body(mode: int) -> None:
    director = make_director({"admission": {"maxPendingRequests": 2}})
    waiting = [RequestStream(director) for _ in range(2)]
    for stream in waiting:
        run(stream, headers_message(mode=mode))  # headers in, bodies still to come
    assert director.pending == 2
    shed = RequestStream(director)
    (refused,) = run(shed, headers_message(mode=mode))
    immediate = refused.immediate_response
    assert immediate.status.code == 503
    assert b"overloaded" in immediate.body and shed.closed
    reasons = {h.header.key: h.header.raw_value for h in immediate.headers.set_headers}
    assert reasons[DROPPED_REASON_HEADER] == b"overloaded"
    assert director.pending == 2  # the refused one never counted
    # A pick, an error or a closed stream each free a place.
    assert destination(run(waiting[0], body_message(BODY))[0])
    assert director.pending == 1
    run(waiting[1], body_message(b"{not json"))
    assert director.pending == 0
    late = RequestStream(director)
    run(late, headers_message(mode=mode))
    assert director.pending == 1
    late.close()
    late.close()
    assert director.pending == 0
    outcome = director.metrics.registry.get_sample_value(
        "kv_picker_requests_total", {"model": "", "outcome": "overloaded"}
    )
    assert outcome == 1.0


def test_no_pending_bound_when_it_is_zero() -> None:
    director = make_director({"admission": {"maxPendingRequests": 0}})
    streams = [RequestStream(director) for _ in range(600)]
    for stream in streams:
        assert run(stream, headers_message()) == []
    assert director.pending == 600


def test_a_protocol_error_without_a_request_id_still_names_one() -> None:
    director = make_director()
    stream = RequestStream(director)
    (response,) = run(stream, body_message(BODY))  # a body before any headers
    assert response.immediate_response.status.code == 500
    message = json.loads(response.immediate_response.body)["error"]["message"]
    assert f"(request id {stream.request_id})" in message
    assert len(stream.request_id) == 36  # made up here, a UUID, the same in the log line


def test_a_bug_in_parsing_is_a_500_with_the_request_id_only() -> None:
    director = make_director()

    def broken(*args: object, **kwargs: object) -> None:
        raise ValueError("Exceeds the limit (4300 digits) for integer string conversion")

    director.parse = broken  # type: ignore[method-assign]
    (response,) = run(
        RequestStream(director),
        headers_message(extra=[("x-request-id", "req-7")]),
        body_message(BODY),
    )
    body = response.immediate_response.body.decode()
    assert response.immediate_response.status.code == 500
    assert "req-7" in body and "4300" not in body and "ValueError" not in body


@pytest.mark.parametrize(
    "last",
    [
        pb.ProcessingRequest(response_body=pb.HttpBody(body=b"{}", end_of_stream=True)),
        pb.ProcessingRequest(response_trailers=pb.HttpTrailers()),
        pb.ProcessingRequest(response_headers=pb.HttpHeaders(end_of_stream=True)),
    ],
    ids=["last-body-chunk", "trailers", "headers-only"],
)
def test_the_picker_ends_the_stream_once_the_response_has_ended(
    last: pb.ProcessingRequest,
) -> None:
    """After the response's end Envoy sends nothing more; the servicer returns (sending its
    status) instead of waiting for Envoy to close the stream."""
    import asyncio

    from kv_picker.handlers.extproc import ExternalProcessor

    director = make_director()
    messages = [headers_message(), body_message(BODY)]
    if not last.HasField("response_headers"):
        messages.append(pb.ProcessingRequest(response_headers=pb.HttpHeaders()))
    messages.append(last)
    still_open = asyncio.Event()

    async def from_envoy():  # type: ignore[no-untyped-def]
        for message in messages:
            yield message
        await still_open.wait()  # Envoy has not closed its side yet
        raise AssertionError("the servicer read past the end of the response")

    async def serve() -> list[pb.ProcessingResponse]:
        replies = ExternalProcessor(director).Process(from_envoy(), None)
        return [reply async for reply in replies]

    replies = asyncio.run(asyncio.wait_for(serve(), 5))
    assert destination(replies[0])
    assert replies[-1].WhichOneof("response") in {
        "response_body",
        "response_trailers",
        "response_headers",
    }
    assert sum(director.store.in_flight) == 0  # finished, and released


def test_a_response_that_has_not_ended_keeps_the_stream_open() -> None:
    stream = RequestStream(make_director())
    run(stream, headers_message(), body_message(BODY))
    run(stream, pb.ProcessingRequest(response_headers=pb.HttpHeaders()))
    run(stream, pb.ProcessingRequest(response_body=pb.HttpBody(body=b"{", end_of_stream=False)))
    assert not stream.complete and not stream.finished


def test_streams_that_carry_no_response_are_counted_and_warned_of_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    director = make_director()

    def unseen() -> float | None:
        return director.metrics.registry.get_sample_value("kv_picker_responses_unseen_total")

    for _ in range(2):
        stream = RequestStream(director)
        message = headers_message()
        message.protocol_config.response_body_mode = Mode.NONE
        run(stream, message, body_message(BODY))
        stream.close()
    assert unseen() == 2
    warnings = [r for r in caplog.records if "response_body_mode NONE" in r.getMessage()]
    assert len(warnings) == 1 and warnings[0].levelname == "WARNING"
    # A stream that carries its response is not counted, whether or not it saw one.
    for messages in ([], [pb.ProcessingRequest(response_body=pb.HttpBody(end_of_stream=True))]):
        stream = RequestStream(director)
        run(stream, headers_message(), body_message(BODY), *messages)
        stream.close()
    assert unseen() == 2


def test_streams_with_response_headers_and_no_body_are_not_a_misconfiguration(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """lean: no response body, but the response's headers, and its end (the stream lasts to it
    with response trailers SEND); the prefill waits for the endpoint's first-token count
    instead of a first byte."""
    caplog.set_level("INFO", logger="kv_picker.handlers.extproc")
    director = make_director(store=make_store(1))
    director.store.update_metrics(
        EndpointId(0), waiting=0.0, running=0.0, kv_usage=0.0, first_tokens=7.0
    )
    streams = []
    for _ in range(2):
        stream = RequestStream(director)
        message = headers_message()
        message.protocol_config.response_body_mode = Mode.NONE
        run(stream, message, body_message(BODY))
        assert stream.routed is not None and stream.routed.prefilling
        streams.append(stream)
    director.store.update_metrics(
        EndpointId(0), waiting=0.0, running=0.0, kv_usage=0.0, first_tokens=8.0
    )
    assert [s.routed.prefilling for s in streams if s.routed] == [False, True]
    for stream in streams:
        run(stream, pb.ProcessingRequest(response_headers=pb.HttpHeaders()))
        stream.close()  # Envoy sends no trailers when the upstream has none: the stream ends
    assert director.store.in_flight[0] == 0 and director.store.prefill_requests[0] == 0
    assert director.metrics.registry.get_sample_value("kv_picker_responses_unseen_total") == 0
    messages = [r for r in caplog.records if "response_body_mode NONE" in r.getMessage()]
    assert [r.levelname for r in messages] == ["INFO"]


def test_an_observability_mode_stream_is_ignored_not_routed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    director = make_director()
    for _ in range(2):
        stream = RequestStream(director)
        messages = [headers_message(end_of_stream=True), body_message(BODY)]
        messages.append(pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: x\n\n")))
        for message in messages:
            message.observability_mode = True
        assert run(stream, *messages) == []
        stream.close()
    # Nothing was picked or counted in flight: the routing filter's stream does that.
    assert list(director.store.in_flight) == [0] * len(director.store)
    registry = director.metrics.registry
    assert registry.get_sample_value("kv_picker_observability_streams_total") == 2
    counted = [
        sample
        for family in registry.collect()
        if family.name in ("kv_picker_requests", "kv_picker_picks")
        for sample in family.samples
        if sample.name.endswith("_total") and sample.value > 0
    ]
    assert counted == []
    warnings = [r for r in caplog.records if "observability_mode" in r.getMessage()]
    assert len(warnings) == 1
