"""Envoy configurations kv-picker cannot route well with: it says so, in its metrics and log."""

from __future__ import annotations

import copy
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

from kv_picker_bench.localstack import LocalStack, free_port
from kv_picker_bench.overhead import _http_filters, mode_bootstrap
from tests.integration.conftest import post


def _sample(stack: LocalStack, name: str) -> float:
    """The picker's sample ``name`` (no labels), or the sum of its labelled samples."""
    url = f"http://127.0.0.1:{stack.picker_metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith((name + " ", name + "{"))
    )


def _settled(stack: LocalStack, name: str, value: float, timeout_s: float = 10.0) -> float:
    """The sample ``name`` once it equals ``value``, or after ``timeout_s``: the picker may
    handle a stream's end just after the client has the response's last byte."""
    deadline = time.monotonic() + timeout_s
    while (current := _sample(stack, name)) != value and time.monotonic() < deadline:
        time.sleep(0.05)
    return current


IN_FLIGHT = "kv_picker_endpoint_in_flight_requests"
UNSEEN = "kv_picker_responses_unseen_total"


def test_streams_without_responses_are_counted_and_logged() -> None:
    with LocalStack(sims=2, time_scale=0.01, start_envoy=False) as stack:
        # Request bodies full duplex, responses not sent to the processor at all.
        port, admin = free_port(), free_port()
        stack.launch_envoy("envoy-no-responses", mode_bootstrap("streamed", port, admin,
                           stack.picker_grpc_port), admin)  # fmt: skip
        body = {"model": "sim-model", "prompt": "tell me a story", "max_tokens": 4}
        for _ in range(3):
            reply = post(f"http://127.0.0.1:{port}/v1/completions", body)
            assert reply.status == 200, reply.body
        assert _settled(stack, UNSEEN, 3) == 3
        assert stack.picker is not None
        log = stack.picker.log_tail()
        assert log.count("no part of the responses") == 1, log
        # The stack's own Envoy configuration sends the responses: nothing more is counted.
        gateway, gateway_admin = free_port(), free_port()
        stack.launch_envoy("envoy-gie", mode_bootstrap("gie", gateway, gateway_admin,
                           stack.picker_grpc_port), gateway_admin)  # fmt: skip
        assert post(f"http://127.0.0.1:{gateway}/v1/completions", body).status == 200
        assert _settled(stack, IN_FLIGHT, 0) == 0
        assert _sample(stack, UNSEEN) == 3


def test_a_filter_in_observability_mode_is_ignored_not_routed() -> None:
    with LocalStack(sims=2, time_scale=0.01, start_envoy=False) as stack:
        port, admin = free_port(), free_port()
        bootstrap = mode_bootstrap("gie", port, admin, stack.picker_grpc_port)
        filters = _http_filters(bootstrap)
        (routing,) = [f for f in filters if f["name"] == "envoy.filters.http.ext_proc"]
        # A second ext_proc filter, after the routing one, that only observes: every request
        # and response message, sent without waiting for (and dropping) the picker's replies.
        observer = copy.deepcopy(routing)
        observer["typed_config"]["observability_mode"] = True
        observer["typed_config"]["processing_mode"].update(
            request_body_mode="STREAMED", response_body_mode="STREAMED"
        )
        filters.insert(filters.index(routing) + 1, observer)
        stack.launch_envoy("envoy-observer", bootstrap, admin)
        body = {"model": "sim-model", "prompt": "tell me a story", "max_tokens": 4, "stream": True}
        for _ in range(3):
            reply = post(f"http://127.0.0.1:{port}/v1/completions", body)
            assert reply.status == 200, reply.body
            assert reply.body.rstrip().endswith(b"data: [DONE]")
        assert _settled(stack, "kv_picker_observability_streams_total", 3) == 3
        # Each request was routed once, by the routing filter, and released at its end (which
        # the picker may handle just after the client has the last byte).
        assert _sample(stack, "kv_picker_picks_total") == 3
        assert _settled(stack, IN_FLIGHT, 0) == 0
        assert stack.picker is not None
        assert stack.picker.log_tail().count("in observability_mode") == 1


def test_response_trailers_alone_keep_the_request_in_flight_to_its_end() -> None:
    """``lean``: no response chunk reaches the picker, yet it sees each response end."""
    with LocalStack(sims=2, time_scale=1.0, start_envoy=False) as stack:
        ports = {mode: (free_port(), free_port()) for mode in ("lean", "streamed")}
        for mode, (port, admin) in ports.items():
            bootstrap = mode_bootstrap(mode, port, admin, stack.picker_grpc_port)
            stack.launch_envoy(f"envoy-{mode}", bootstrap, admin)
        in_flight: dict[str, list[float]] = {}
        for mode, (port, _) in ports.items():
            # About 1.4 s of decoding (200 steps of the 8B profile) after a short prefill.
            body = {"model": "sim-model", "prompt": "a story", "max_tokens": 200,
                    "ignore_eos": True, "stream": True}  # fmt: skip
            with ThreadPoolExecutor(1) as pool:
                reply = pool.submit(post, f"http://127.0.0.1:{port}/v1/completions", body)
                seen: list[float] = []
                while not reply.done() and len(seen) < 200:
                    seen.append(_sample(stack, IN_FLIGHT))
                    time.sleep(0.05)
                assert reply.result().status == 200
            in_flight[mode] = seen
        assert max(in_flight["lean"]) == 1, in_flight
        # Without the trailers, Envoy ends the stream once the request is routed.
        assert max(in_flight["streamed"][4:]) == 0, in_flight
        assert _settled(stack, IN_FLIGHT, 0) == 0


QUEUED_PREFILL = "kv_picker_endpoint_queued_prefill_tokens"


def test_without_response_bodies_the_scraped_first_token_count_ends_the_prefill() -> None:
    """``lean``: the picker sees no first byte, yet the request's prefill stops counting as
    queued work once a scrape shows the endpoint's first-token count grew, while the request
    itself stays in flight to its end."""
    with LocalStack(sims=1, time_scale=1.0, start_envoy=False) as stack:
        port, admin = free_port(), free_port()
        stack.launch_envoy("envoy-lean", mode_bootstrap("lean", port, admin,
                           stack.picker_grpc_port), admin)  # fmt: skip
        # A prompt of about 4,000 uncached tokens (0.4 s of prefill, four scrapes), then about
        # 1.4 s of decoding.
        body = {"model": "sim-model", "prompt": "tell me a long story " * 800, "max_tokens": 200,
                "ignore_eos": True, "stream": True}  # fmt: skip
        samples: list[tuple[float, float]] = []
        with ThreadPoolExecutor(1) as pool:
            reply = pool.submit(post, f"http://127.0.0.1:{port}/v1/completions", body)
            while not reply.done() and len(samples) < 400:
                samples.append((_sample(stack, IN_FLIGHT), _sample(stack, QUEUED_PREFILL)))
                time.sleep(0.02)
            assert reply.result().status == 200
        in_flight = [queued for flying, queued in samples if flying == 1]
        assert in_flight, samples
        # Queued right after the pick (the scrape before the first token) ...
        assert in_flight[0] > 0, samples
        # ... and no longer once a scrape counted the first token, long before the end.
        assert in_flight[-1] == 0, samples
        assert sum(1 for queued in in_flight if queued == 0) > len(in_flight) // 2, samples
        assert _settled(stack, IN_FLIGHT, 0) == 0
        # A configuration the picker can route with: not counted as a problem, said once.
        assert _sample(stack, UNSEEN) == 0
        assert stack.picker is not None
        log = stack.picker.log_tail()
        assert "no part of the responses" not in log
        assert log.count("response headers but no response body") == 1, log
