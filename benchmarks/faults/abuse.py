"""Scenarios that send what no well-behaved client sends: malformed HTTP requests through Envoy
(bad-inputs) and a misbehaving ext_proc client straight at the picker's gRPC port (grpc-abuse).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import aiohttp
import grpc
import yarl
from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kv_picker.wire import DROPPED_REASON_HEADER
from kv_picker_bench.client import SERVED_BY_HEADER
from kv_picker_bench.faults import probes
from kv_picker_bench.faults.inputs import BadRequest, generate
from kv_picker_bench.faults.probes import MB
from kv_picker_bench.faults.report import ScenarioResult
from kv_picker_bench.faults.suite import MAX_BODY_BYTES, Sizes, scenario, stack
from kv_picker_bench.localstack import LocalStack, envoy_bootstrap, free_port

# No answer within this long is a hang.
ANSWER_TIMEOUT_S = 15.0

# -- bad inputs through Envoy -------------------------------------------------------------------


@dataclass(frozen=True)
class Answer:
    """What one malformed request got back."""

    family: str
    status: int  # 0: the connection closed without an answer
    from_endpoint: bool  # the simulated endpoint answered (the picker routed it)
    reason: str  # the picker's dropped-reason header
    hung: bool = False
    error: str = ""

    @property
    def gateway_500(self) -> bool:
        return self.status == 500 and not self.from_endpoint

    @property
    def undocumented_5xx(self) -> bool:
        return self.status > 500 and not self.from_endpoint and not self.reason


async def _chunks(body: bytes) -> AsyncIterator[bytes]:
    half = len(body) // 2
    yield body[:half]
    yield body[half:]


async def _send_framed(session: aiohttp.ClientSession, base_url: str, case: BadRequest) -> Answer:
    headers = {} if case.content_type is None else {"content-type": case.content_type}
    skip = ("Content-Type",) if case.content_type is None else ()
    data: bytes | AsyncIterator[bytes] = (
        _chunks(case.body) if case.framing == "chunked" else case.body
    )
    async with session.request(
        case.method,
        yarl.URL(base_url + case.path, encoded=True),
        data=data,
        headers=headers,
        skip_auto_headers=skip,
    ) as response:
        await response.read()
        return Answer(
            case.family,
            response.status,
            SERVED_BY_HEADER in response.headers,
            response.headers.get(DROPPED_REASON_HEADER, ""),
        )


async def _send_cut(host: str, port: int, case: BadRequest) -> Answer:
    """Announce more body than is sent, then half-close: the upload was cut."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        head = f"{case.method} {case.path} HTTP/1.1\r\nhost: {host}:{port}\r\n"
        if case.content_type is not None:
            head += f"content-type: {case.content_type}\r\n"
        if case.framing == "cut-chunked":
            head += "transfer-encoding: chunked\r\n\r\n"
            # A chunk announced longer than what follows, and no last chunk.
            payload = f"{len(case.body) + 17:x}\r\n".encode() + case.body
        else:
            head += f"content-length: {len(case.body) + 17}\r\n\r\n"
            payload = case.body
        writer.write(head.encode() + payload)
        await writer.drain()
        writer.write_eof()
        data = await reader.read(4096)
        if not data:
            return Answer(case.family, 0, False, "")
        status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else -1
        lowered = data.lower()
        return Answer(
            case.family,
            status,
            SERVED_BY_HEADER.encode() in lowered,
            "x" if DROPPED_REASON_HEADER.encode() in lowered else "",
        )
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def send_cases(base_url: str, cases: Sequence[BadRequest], connections: int) -> list[Answer]:
    """Send every case over ``connections`` workers; every answer has a timeout."""
    url = yarl.URL(base_url)
    host, port = url.host or "127.0.0.1", url.port or 80
    answers: list[Answer] = []
    next_index = 0
    timeout = aiohttp.ClientTimeout(total=ANSWER_TIMEOUT_S)
    connector = aiohttp.TCPConnector(limit=connections)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def worker() -> None:
            nonlocal next_index
            while next_index < len(cases):
                case = cases[next_index]
                next_index += 1
                try:
                    if case.framing.startswith("cut"):
                        answer = await asyncio.wait_for(
                            _send_cut(host, port, case), ANSWER_TIMEOUT_S
                        )
                    else:
                        answer = await _send_framed(session, base_url, case)
                except TimeoutError:
                    answer = Answer(case.family, 0, False, "", hung=True, error="timeout")
                except (aiohttp.ClientError, OSError, ValueError) as exc:
                    # Envoy may close on a request it refuses to parse: not a hang, not a 500.
                    answer = Answer(case.family, 0, False, "", error=type(exc).__name__)
                answers.append(answer)

        await asyncio.gather(*(worker() for _ in range(connections)))
    return answers


def _second_envoy(local: LocalStack, body_mode: str) -> str:
    port, admin = free_port(), free_port()
    bootstrap = envoy_bootstrap(port, admin, local.picker_grpc_port, body_mode)
    local.launch_envoy(f"envoy-{body_mode.lower()}", bootstrap, admin)
    return f"http://127.0.0.1:{port}"


def bad_inputs(sizes: Sizes) -> ScenarioResult:
    """Hypothesis-generated malformed requests through Envoy, in both body modes, at one
    picker: no 500, no hang, the picker alive and its /metrics readable after each mode."""
    with scenario("bad-inputs") as result, stack(sims=2) as local:
        picker = local.picker
        assert picker is not None
        urls = {"streamed": local.url, "buffered": _second_envoy(local, "BUFFERED")}
        started = time.monotonic()
        cases = generate(sizes.bad_input_cases, MAX_BODY_BYTES, seed=0)
        result.figures["generate_s"] = round(time.monotonic() - started, 1)
        result.figures["cases_per_mode"] = len(cases)
        families = Counter(c.family for c in cases)
        result.figures["families"] = len(families)
        for mode, url in urls.items():
            started = time.monotonic()
            answers = asyncio.run(send_cases(url, cases, sizes.bad_input_connections))
            elapsed = time.monotonic() - started
            statuses = Counter(a.status for a in answers)
            gateway_500 = [a for a in answers if a.gateway_500]
            other_5xx = [a for a in answers if a.undocumented_5xx]
            hung = [a for a in answers if a.hung]
            reading = probes.read_picker(local.picker_metrics_port)
            result.figures.update(
                {
                    f"{mode} sent": len(answers),
                    f"{mode} cases_per_s": round(len(answers) / elapsed, 1),
                    f"{mode} 4xx": sum(n for s, n in statuses.items() if 400 <= s < 500),
                    f"{mode} 2xx": sum(n for s, n in statuses.items() if 200 <= s < 300),
                    f"{mode} closed_without_answer": statuses.get(0, 0) - len(hung),
                    f"{mode} endpoint_5xx": sum(
                        1 for a in answers if a.status >= 500 and a.from_endpoint
                    ),
                    f"{mode} gateway_500": len(gateway_500),
                    f"{mode} undocumented_5xx": len(other_5xx),
                    f"{mode} hung": len(hung),
                }
            )
            result.check(f"{mode}: every case answered or closed", len(answers) == len(cases))
            result.check(f"{mode}: no 500", not gateway_500)
            result.check(f"{mode}: no other 5xx without a documented reason", not other_5xx)
            result.check(f"{mode}: no hang", not hung)
            result.check(f"{mode}: picker alive", picker.alive())
            result.check(f"{mode}: /metrics answers 200", reading.status == 200)
            closed = Counter(a.family for a in answers if a.status == 0 and not a.hung)
            if closed:
                result.notes.append(f"{mode}: closed without an answer, by family {dict(closed)}")
            if gateway_500 or other_5xx:
                worst = Counter(a.family for a in gateway_500 + other_5xx)
                result.notes.append(f"{mode}: 5xx by family {dict(worst)}")
        settled = probes.wait_in_flight_zero(local.picker_metrics_port)
        result.check("in-flight gauges back to 0", settled is not None)
        result.figures["picker_rss_mb"] = round(probes.rss_bytes(picker.process.pid) / MB, 1)
    return result


# -- gRPC abuse ---------------------------------------------------------------------------------

_Mode = processing_mode_pb2.ProcessingMode
_BODY = b'{"model": "sim-model", "prompt": "abuse", "max_tokens": 2}'


def _headers(mode: int, end_of_stream: bool = False) -> pb.ProcessingRequest:
    header_map = base_pb2.HeaderMap(
        headers=[
            base_pb2.HeaderValue(key=":path", raw_value=b"/v1/completions"),
            base_pb2.HeaderValue(key=":method", raw_value=b"POST"),
        ]
    )
    return pb.ProcessingRequest(
        request_headers=pb.HttpHeaders(headers=header_map, end_of_stream=end_of_stream),
        protocol_config=pb.ProtocolConfiguration(request_body_mode=mode, response_body_mode=mode),
    )


def _body(data: bytes, end_of_stream: bool) -> pb.ProcessingRequest:
    return pb.ProcessingRequest(request_body=pb.HttpBody(body=data, end_of_stream=end_of_stream))


_MENU: tuple[pb.ProcessingRequest, ...] = (
    _headers(_Mode.FULL_DUPLEX_STREAMED),
    _headers(_Mode.BUFFERED),
    _headers(_Mode.STREAMED),
    _headers(_Mode.FULL_DUPLEX_STREAMED, end_of_stream=True),
    _body(_BODY, True),
    _body(_BODY[:10], False),
    _body(b"\xff\xfe garbage", True),
    pb.ProcessingRequest(request_trailers=pb.HttpTrailers()),
    pb.ProcessingRequest(response_headers=pb.HttpHeaders()),
    pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: x\n\n", end_of_stream=False)),
    pb.ProcessingRequest(response_body=pb.HttpBody(body=b"", end_of_stream=True)),
    pb.ProcessingRequest(response_trailers=pb.HttpTrailers()),
    pb.ProcessingRequest(),  # no message at all
)


async def _sequence(
    stub: pb_grpc.ExternalProcessorStub, messages: Sequence[pb.ProcessingRequest]
) -> bool:
    """Send ``messages``, end the stream, read to the end. False if the server hung."""
    call = stub.Process(timeout=ANSWER_TIMEOUT_S)
    try:
        for message in messages:
            await call.write(message)
        await call.done_writing()
        async for _ in call:
            pass
        return True
    except grpc.aio.AioRpcError as error:
        return error.code() != grpc.StatusCode.DEADLINE_EXCEEDED
    except asyncio.InvalidStateError:  # the server ended the stream before we were done
        return True


async def _abandon(stub: pb_grpc.ExternalProcessorStub, routed: bool) -> None:
    """Open a stream, send part of a request (or a whole one, so it is routed), walk away."""
    call = stub.Process(timeout=ANSWER_TIMEOUT_S)
    await call.write(_headers(_Mode.FULL_DUPLEX_STREAMED))
    await call.write(_body(_BODY if routed else _BODY[:20], routed))
    if routed:
        await call.read()  # the pick: the request holds an in-flight slot now
    await asyncio.sleep(0)
    call.cancel()


async def _big_body(stub: pb_grpc.ExternalProcessorStub, total_bytes: int, chunk_bytes: int) -> str:
    """Stream ``total_bytes`` of body without end of stream; what the server answered."""
    call = stub.Process(timeout=60.0)
    chunk = b"x" * chunk_bytes
    sent = 0
    answer = "nothing"
    try:
        await call.write(_headers(_Mode.FULL_DUPLEX_STREAMED))
        while sent < total_bytes:
            await call.write(_body(chunk, False))
            sent += chunk_bytes
        await call.done_writing()
    except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
        pass  # the server ended the stream: read why
    try:
        async for response in call:
            if response.HasField("immediate_response"):
                answer = str(response.immediate_response.status.code)
    except grpc.aio.AioRpcError as error:
        answer = error.code().name
    return answer


async def _one_big_message(stub: pb_grpc.ExternalProcessorStub, total_bytes: int) -> str:
    """A buffered body of ``total_bytes`` in one message (over the gRPC message limit)."""
    call = stub.Process(timeout=60.0)
    try:
        await call.write(_headers(_Mode.BUFFERED))
        await call.write(_body(b"x" * total_bytes, True))
        await call.done_writing()
        async for response in call:
            if response.HasField("immediate_response"):
                return str(response.immediate_response.status.code)
        return "nothing"
    except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as error:
        return error.code().name if isinstance(error, grpc.aio.AioRpcError) else "closed"


async def _garbage(port: int, payload: bytes) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(payload)
    with contextlib.suppress(OSError):
        await writer.drain()
        await asyncio.wait_for(reader.read(1024), 2.0)
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()


async def _abuse(port: int, sizes: Sizes, rss: list[int], pid: int) -> dict[str, object]:
    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=options) as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)
        rng = random.Random(12)
        ended = 0
        for _ in range(sizes.grpc_sequences):
            messages = [rng.choice(_MENU) for _ in range(rng.randint(1, 8))]
            ended += await _sequence(stub, messages)
        rss.append(probes.rss_bytes(pid))
        for i in range(sizes.grpc_abandoned_streams):
            await _abandon(stub, routed=i % 2 == 0)
        rss.append(probes.rss_bytes(pid))
        big = await _big_body(stub, sizes.grpc_body_bytes, 1024 * 1024)
        rss.append(probes.rss_bytes(pid))
        one = await _one_big_message(stub, sizes.grpc_body_bytes)
        rss.append(probes.rss_bytes(pid))
        for payload in (b"GET / HTTP/1.1\r\nhost: x\r\n\r\n", random.Random(3).randbytes(4096)):
            await _garbage(port, payload)
        health = health_pb2_grpc.HealthStub(channel)
        reply = await health.Check(
            health_pb2.HealthCheckRequest(service="envoy.service.ext_proc.v3.ExternalProcessor"),
            timeout=5.0,
        )
        normal = await _sequence(stub, [_headers(_Mode.FULL_DUPLEX_STREAMED), _body(_BODY, True)])
        return {
            "sequences_ended": ended,
            "big_body_answer": big,
            "big_message_answer": one,
            "serving_after": reply.status == health_pb2.HealthCheckResponse.SERVING,
            "normal_after": normal,
        }


def grpc_abuse(sizes: Sizes) -> ScenarioResult:
    """A misbehaving client on the picker's gRPC port: random out-of-order message sequences,
    abandoned streams (routed or not), a body far over the limit without end of stream, one
    message over the gRPC limit, garbage bytes. The server stays up, answers health checks, and
    its RSS returns within 10 MB of the baseline."""
    with scenario("grpc-abuse") as result, stack(sims=2, start_envoy=False) as local:
        picker = local.picker
        assert picker is not None
        pid = picker.process.pid
        port = local.picker_metrics_port
        # Warm the picker's code paths first: the baseline is a serving process's, not a cold one's.
        warm = asyncio.run(_warm(local.picker_grpc_port))
        baseline = probes.rss_bytes(pid)
        samples: list[int] = []
        outcome = asyncio.run(_abuse(local.picker_grpc_port, sizes, samples, pid))
        gc.collect()
        settled = probes.wait_in_flight_zero(port)
        after = probes.wait_for(
            lambda: probes.rss_bytes(pid) - baseline < 10 * MB, 10.0, interval_s=0.5
        )
        rss_after = probes.rss_bytes(pid)
        result.figures.update(
            sequences=sizes.grpc_sequences,
            sequences_ended=outcome["sequences_ended"],  # type: ignore[dict-item]
            abandoned_streams=sizes.grpc_abandoned_streams,
            big_body_mb=sizes.grpc_body_bytes // MB,
            big_body_answer=str(outcome["big_body_answer"]),
            big_message_answer=str(outcome["big_message_answer"]),
            rss_baseline_mb=round(baseline / MB, 1),
            rss_peak_mb=round(max(samples, default=0) / MB, 1),
            rss_after_mb=round(rss_after / MB, 1),
            warm_streams=warm,
        )
        result.check(
            "every out-of-order sequence ended (no hang)",
            outcome["sequences_ended"] == sizes.grpc_sequences,
        )
        result.check(
            "a body over the limit without end of stream gets 413",
            outcome["big_body_answer"] == "413",
        )
        result.check("the server stays up", picker.alive())
        result.check("health: SERVING after the abuse", bool(outcome["serving_after"]))
        result.check("a normal stream is routed after the abuse", bool(outcome["normal_after"]))
        result.check("in-flight back to 0 (abandoned streams released)", settled is not None)
        result.check("RSS back within 10 MB of the baseline", after is not None)
    return result


async def _warm(port: int, count: int = 200) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = pb_grpc.ExternalProcessorStub(channel)
        for _ in range(count):
            await _sequence(stub, [_headers(_Mode.FULL_DUPLEX_STREAMED), _body(_BODY, True)])
    return count
