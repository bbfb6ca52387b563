"""Client -> real Envoy -> kv-picker (ext_proc) -> simulated vLLM endpoints."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter

from kv_picker_bench.client import replay
from kv_picker_bench.localstack import LocalStack, free_port
from kv_picker_bench.workloads import WorkloadRequest, words
from tests.integration.conftest import post

SERVED_BY = "x-kv-picker-sim-endpoint"


def completion(prompt: str, **extra: object) -> dict[str, object]:
    return {"model": "sim-model", "prompt": prompt, "max_tokens": 4, **extra}


def test_request_reaches_the_picked_endpoint_not_the_client_header(
    zone_stack: LocalStack,
) -> None:
    zone_a, _, zone_b = zone_stack.sim_addresses
    for i in range(6):
        reply = post(
            zone_stack.url + "/v1/completions",
            completion(f"q{i} " * 30),
            headers={"x-gateway-destination-endpoint": zone_a},
        )
        assert reply.status == 200, reply.body
        assert reply.headers[SERVED_BY] == zone_b
    metrics = zone_stack.picker_metrics_text()
    assert f'kv_picker_picks_total{{endpoint="{zone_b}",profile="default"}} 6.0' in metrics


def settle(stack: LocalStack, timeout_s: float = 10.0) -> None:
    """Wait until the picker's latest scrape of every endpoint shows nothing waiting or in
    flight. A scrape taken while the previous request waited in the engine says it is still
    waiting until the next scrape (every 100 ms); on a slow host the next request can be picked
    in between, and that queue, not the cache, decides where it goes."""
    gauges = ("kv_picker_endpoint_requests_waiting{", "kv_picker_endpoint_in_flight_requests{")
    deadline = time.monotonic() + timeout_s
    while True:
        busy = [
            line
            for line in stack.picker_metrics_text().splitlines()
            if line.startswith(gauges) and float(line.rsplit(" ", 1)[1]) != 0.0
        ]
        if not busy:
            return
        assert time.monotonic() < deadline, f"still busy after {timeout_s} s: {busy}"
        time.sleep(0.05)


def test_shared_prefix_sticks_distinct_prefixes_spread(stack: LocalStack) -> None:
    rng = random.Random(1)
    shared = "You are a support agent for ACME. " + words(rng, 600)
    served = set()
    for i in range(8):
        settle(stack)
        reply = post(stack.url + "/v1/completions", completion(f"{shared}\nQ{i}: {words(rng, 10)}"))
        assert reply.status == 200, reply.body
        served.add(reply.headers[SERVED_BY])
    assert len(served) == 1
    distinct = Counter()
    for i in range(24):
        reply = post(stack.url + "/v1/completions", completion(f"topic {i} " + words(rng, 300)))
        assert reply.status == 200
        distinct[reply.headers[SERVED_BY]] += 1
    assert len(distinct) >= 3


def test_streaming_responses_arrive_complete(stack: LocalStack) -> None:
    body = completion(
        "stream me " * 40, stream=True, max_tokens=12, stream_options={"include_usage": True}
    )
    reply = post(stack.url + "/v1/completions", body)
    assert reply.status == 200
    assert reply.headers["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in reply.body.decode().split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text_chunks = [c for c in chunks if c["choices"] and c["choices"][0].get("text")]
    assert len(text_chunks) == 12
    assert chunks[-1]["usage"]["completion_tokens"] == 12


def test_chat_completions_route(stack: LocalStack) -> None:
    body = {
        "model": "sim-model",
        "max_tokens": 3,
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": [{"type": "text", "text": "hello"}]},
        ],
    }
    reply = post(stack.url + "/v1/chat/completions", body)
    assert reply.status == 200, reply.body
    assert reply.json()["object"] == "chat.completion"


def test_large_body_passes_intact(stack: LocalStack) -> None:
    prompt = words(random.Random(5), 20_000)  # ~130 KB: three 62,000-byte chunks
    via_envoy = post(stack.url + "/v1/completions", completion(prompt))
    assert via_envoy.status == 200, via_envoy.body[:300]
    direct = post(f"http://{stack.sim_addresses[0]}/v1/completions", completion(prompt))
    assert via_envoy.json()["usage"]["prompt_tokens"] == direct.json()["usage"]["prompt_tokens"]


def test_malformed_and_missing_model_are_400(stack: LocalStack) -> None:
    bad = post(stack.url + "/v1/completions", b'{"model": "sim-model", "prompt": ')
    assert bad.status == 400
    assert bad.headers["x-llm-d-request-dropped-reason"] == "bad-request"
    assert "not valid JSON" in bad.json()["error"]["message"]
    missing = post(stack.url + "/v1/completions", {"prompt": "hi"})
    assert missing.status == 400 and "model" in missing.json()["error"]["message"]


def test_oversized_body_is_413(stack: LocalStack) -> None:
    reply = post(stack.url + "/v1/completions", completion("x" * (9 * 1024 * 1024)))
    assert reply.status == 413
    assert reply.json()["error"]["code"] == 413


def test_bodyless_request_passes_through(stack: LocalStack) -> None:
    reply = post(stack.url + "/v1/models", b"", method="GET")
    assert reply.status == 200
    assert reply.headers[SERVED_BY] in stack.sim_addresses


def test_concurrent_load_completes_without_errors(stack: LocalStack) -> None:
    rng = random.Random(3)
    requests = [
        WorkloadRequest("/v1/completions", completion(words(rng, 200), stream=bool(i % 2)))
        for i in range(60)
    ]
    outcomes = asyncio.run(replay(stack.url, requests, concurrency=12, timeout_s=60))
    assert [o.error for o in outcomes if not o.ok] == []
    # Envoy ends each ext_proc stream just after the client has its response: allow a moment
    # for every in-flight slot to be released.
    assert stack.picker is not None
    stack.picker.wait_until(
        lambda: "kv_picker_requests_running 0.0" in stack.picker_metrics_text(),
        10.0,
        "every in-flight request to be released",
    )


def test_no_ready_endpoint_is_503() -> None:
    dead = f"127.0.0.1:{free_port()}"
    with LocalStack(sims=0, extra_endpoints=[dead]) as local:
        reply = post(local.url + "/v1/completions", completion("hi"))
        assert reply.status == 503
        assert reply.headers["x-llm-d-request-dropped-reason"] == "rejected-no-endpoints"
        assert reply.json()["error"]["type"] == "service_unavailable"


def test_endpoint_that_dies_stops_receiving_traffic() -> None:
    with LocalStack(sims=2, time_scale=0.02) as local:
        victim = local.processes[0]
        victim_address = local.sim_addresses[0]
        victim.stop()
        # The next scrapes mark it not ready; requests then all go to the survivor.
        local.picker.wait_until(  # type: ignore[union-attr]
            lambda: 'kv_picker_endpoints{state="ready"} 1.0' in local.picker_metrics_text(),
            10.0,
            "the dead endpoint to be marked not ready",
        )
        for i in range(6):
            reply = post(local.url + "/v1/completions", completion(f"after {i} " * 20))
            assert reply.status == 200
            assert reply.headers["x-kv-picker-sim-endpoint"] != victim_address


def test_picker_down_gives_a_prompt_error_not_a_hang() -> None:
    with LocalStack(sims=1, time_scale=0.02) as local:
        assert local.picker is not None
        local.picker.stop()
        started = time.monotonic()
        reply = post(local.url + "/v1/completions", completion("anyone there?"), timeout_s=30)
        # failure_mode_allow is off (the reference config): Envoy answers with a 5xx at once.
        assert 500 <= reply.status < 600
        assert time.monotonic() - started < 15


def test_picker_on_uvloop_routes_through_envoy() -> None:
    with LocalStack(sims=2, time_scale=0.02, picker_args=("--event-loop", "uvloop")) as local:
        rng = random.Random(9)
        requests = [
            WorkloadRequest("/v1/completions", completion(words(rng, 100), stream=bool(i % 2)))
            for i in range(20)
        ]
        outcomes = asyncio.run(replay(local.url, requests, concurrency=4, timeout_s=60))
        assert [o.error for o in outcomes if not o.ok] == []
        assert {o.served_by for o in outcomes} <= set(local.sim_addresses)
