"""Real KV events move routing: simulated endpoints publish over ZMQ, kv-picker (precise mode)
subscribes, and requests through real Envoy go where the blocks really are."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kv_picker_bench.localstack import LocalStack, SimSpec
from tests.integration.conftest import post

TOKENIZER = str(Path(__file__).resolve().parents[2] / "benchmarks" / "tokenizer")
PRECISE = {
    "plugins": [
        {"type": "prefix-cache-scorer", "parameters": {"mode": "precise", "tokenizer": TOKENIZER}},
        {"type": "max-score-picker"},
    ],
}
SERVED_BY = "x-kv-picker-sim-endpoint"


@pytest.fixture(scope="module")
def stack() -> Iterator[LocalStack]:
    # Endpoint 1 speaks the newer map encoding, the others the older array encoding.
    sims = [SimSpec(), SimSpec(extra_args=("--kv-events-encoding", "map")), SimSpec()]
    with LocalStack(
        sims=sims, picker_config=PRECISE, time_scale=0.02, kv_events=True, tokenizer=TOKENIZER
    ) as local:
        yield local


def picker_sample(stack: LocalStack, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(stack.picker_metrics_text()):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return float(sample.value)
    return 0.0


def wait_until(check: object, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        time.sleep(0.05)


def prompt(topic: str) -> str:
    return f"Context about {topic}. " + "the cache block token prefix route pick queue " * 30


def test_blocks_an_endpoint_reports_attract_requests(stack: LocalStack) -> None:
    for target, topic in ((2, "alpha"), (1, "bravo")):
        text = prompt(topic)
        body = {"model": stack.model, "prompt": text, "max_tokens": 2}
        before = picker_sample(stack, "kv_picker_kv_events_applied_total", kind="stored")
        # Sent to the endpoint directly: only its KV events can tell the picker.
        direct = post(f"http://{stack.sim_addresses[target]}/v1/completions", body)
        assert direct.status == 200
        wait_until(
            lambda before=before: (
                picker_sample(stack, "kv_picker_kv_events_applied_total", kind="stored") > before
            )
        )
        for _ in range(4):
            reply = post(stack.url + "/v1/completions", body)
            assert reply.status == 200
            assert reply.headers[SERVED_BY] == stack.sim_addresses[target]
            assert reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_chat_blocks_match_through_the_chat_template(stack: LocalStack) -> None:
    messages = [
        {"role": "system", "content": prompt("charlie")},
        {"role": "user", "content": "Which endpoint holds this?"},
    ]
    body = {"model": stack.model, "messages": messages, "max_tokens": 2}
    assert post(f"http://{stack.sim_addresses[0]}/v1/chat/completions", body).status == 200
    wait_until(lambda: picker_sample(stack, "kv_picker_kv_index_blocks") > 0)
    deadline = time.monotonic() + 10
    while True:  # the event may still be in flight
        reply = post(stack.url + "/v1/chat/completions", body)
        assert reply.status == 200
        if reply.headers[SERVED_BY] == stack.sim_addresses[0] or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert reply.headers[SERVED_BY] == stack.sim_addresses[0]


def test_reset_and_restart_take_blocks_out_of_the_index(stack: LocalStack) -> None:
    text = prompt("delta")
    body = {"model": stack.model, "prompt": text, "max_tokens": 2}
    assert post(f"http://{stack.sim_addresses[2]}/v1/completions", body).status == 200
    wait_until(lambda: picker_sample(stack, "kv_picker_kv_index_blocks") > 0)
    blocks_before = picker_sample(stack, "kv_picker_kv_index_blocks")
    cleared = picker_sample(stack, "kv_picker_kv_events_applied_total", kind="cleared")
    assert post(f"http://{stack.sim_addresses[2]}/reset_prefix_cache", b"").status == 200
    wait_until(
        lambda: picker_sample(stack, "kv_picker_kv_events_applied_total", kind="cleared") > cleared
    )
    assert picker_sample(stack, "kv_picker_kv_index_blocks") < blocks_before
    # Endpoint 1 holds blocks; a restart of its process empties its cache.
    held = picker_sample(stack, "kv_picker_kv_index_blocks")
    assert post(f"http://{stack.sim_addresses[1]}/v1/completions", body).status == 200
    wait_until(lambda: picker_sample(stack, "kv_picker_kv_index_blocks") > held)
    with_endpoint_1 = picker_sample(stack, "kv_picker_kv_index_blocks")
    stack.restart_sim(1)
    # The picker saw the publisher go away: what endpoint 1 held is gone from the index.
    wait_until(lambda: picker_sample(stack, "kv_picker_kv_index_blocks") < with_endpoint_1)
    assert picker_sample(stack, "kv_picker_kv_index_blocks") <= held
    assert picker_sample(stack, "kv_picker_kv_events_malformed_total") == 0


def test_precise_vs_approx_benchmark_smoke() -> None:
    from kv_picker_bench.precise_vs_approx import format_rows, run

    rows = run(quick=True, endpoints=2, requests_per_phase=(12, 6, 12))
    assert [(r.policy, r.phase) for r in rows] == [
        (policy, phase)
        for policy in ("approximate", "precise")
        for phase in ("warm", "down+restart", "back")
    ]
    assert all(r.requests and 0 <= r.hit_ratio <= 1 for r in rows if r.phase != "down+restart")
    assert "hit ratio precise / approx" in format_rows(rows)
