"""Past admission.maxPendingRequests, or after waiting too long in front of the picker, a
request gets a fast 503 through real Envoy."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from kv_picker.wire import DROPPED_REASON_HEADER
from kv_picker_bench.localstack import LocalStack, http_get
from tests.integration.conftest import post

BODY = {"model": "sim-model", "prompt": "hello " * 100, "max_tokens": 2}


@pytest.fixture(scope="module", params=["FULL_DUPLEX_STREAMED", "BUFFERED"])
def bounded(request: pytest.FixtureRequest) -> Iterator[LocalStack]:
    with LocalStack(
        sims=2,
        body_mode=request.param,
        time_scale=0.02,
        picker_config={"admission": {"maxPendingRequests": 1}},
    ) as local:
        yield local


def sample(stack: LocalStack, name: str) -> float:
    """The value of an unlabelled sample in the picker's /metrics."""
    text = http_get(f"http://127.0.0.1:{stack.picker_metrics_port}/metrics")[1].decode()
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"no {name} in /metrics")


def pending(stack: LocalStack) -> float:
    return sample(stack, "kv_picker_requests_pending")


def test_a_request_past_the_bound_is_shed_and_the_held_one_still_served(
    bounded: LocalStack,
) -> None:
    body = json.dumps(BODY).encode()
    with socket.create_connection(("127.0.0.1", bounded.envoy_port), timeout=30) as held:
        # A chunked upload that stops half-way: its headers reached the picker, its body not.
        held.sendall(
            b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"transfer-encoding: chunked\r\n\r\n"
            + f"{len(body[:40]):x}\r\n".encode()
            + body[:40]
            + b"\r\n"
        )
        deadline = time.monotonic() + 10
        while pending(bounded) < 1:
            assert time.monotonic() < deadline, "the held request never reached the picker"
            time.sleep(0.02)
        started = time.monotonic()
        shed = post(bounded.url + "/v1/completions", BODY)
        assert shed.status == 503, shed.body
        assert shed.headers[DROPPED_REASON_HEADER] == "overloaded"
        assert json.loads(shed.body)["error"]["type"] == "service_unavailable"
        assert time.monotonic() - started < 2.0  # answered at once, not queued
        # The held request completes and is served.
        rest = body[40:]
        held.sendall(f"{len(rest):x}\r\n".encode() + rest + b"\r\n0\r\n\r\n")
        reply = b""
        while b"\r\n\r\n" not in reply:
            chunk = held.recv(65536)
            assert chunk, "connection closed before the reply"
            reply += chunk
        assert reply.startswith(b"HTTP/1.1 200"), reply[:200]
    assert post(bounded.url + "/v1/completions", BODY).status == 200
    assert pending(bounded) == 0


def queue_delay_count(stack: LocalStack) -> float:
    return sample(stack, "kv_picker_request_queue_delay_seconds_count")


def test_requests_that_waited_before_reaching_a_stalled_picker_are_shed() -> None:
    """Envoy stamps x-request-start (over any client value); the picker sheds what waited."""
    config = {"admission": {"queueDelayTarget": "5ms"}}
    with LocalStack(sims=2, time_scale=0.02, picker_config=config) as local:
        url = local.url + "/v1/completions"
        for _ in range(3):
            assert post(url, BODY).status == 200
        # A client's own stamp is replaced by Envoy's: it would not parse, yet it is measured.
        assert post(url, BODY, headers={"x-request-start": "t=soon"}).status == 200
        assert queue_delay_count(local) == 4
        assert local.picker is not None
        pid = local.picker.process.pid
        replies: list[int | str] = []

        def send() -> None:
            reply = post(url, BODY)
            replies.append(
                reply.status
                if reply.status == 200
                else reply.headers.get(DROPPED_REASON_HEADER, str(reply.status))
            )

        os.kill(pid, signal.SIGSTOP)  # the picker stalls: requests queue in front of it
        try:
            senders = [threading.Thread(target=send) for _ in range(4)]
            for sender in senders:
                sender.start()
            time.sleep(0.6)
        finally:
            os.kill(pid, signal.SIGCONT)
        for sender in senders:
            sender.join(30)
        # Each waited over half a second, past the 100 ms interval: shed, not served late.
        assert replies == ["overloaded"] * 4
        time.sleep(0.3)
        assert [post(url, BODY).status for _ in range(3)] == [200] * 3
