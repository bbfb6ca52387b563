"""LoRA affinity, session affinity and shedding, through real Envoy and simulated endpoints."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter

from kv_picker_bench.client import replay
from kv_picker_bench.localstack import LocalStack, SimSpec
from kv_picker_bench.workloads import WorkloadRequest
from tests.integration.conftest import post

SERVED_BY = "x-kv-picker-sim-endpoint"


def completion(prompt: str, model: str = "sim-model", **extra: object) -> dict[str, object]:
    return {"model": model, "prompt": prompt, "max_tokens": 4, **extra}


def wait_for(stack: LocalStack, text: str, what: str) -> None:
    assert stack.picker is not None
    stack.picker.wait_until(lambda: text in stack.picker_metrics_text(), 15.0, what)


def test_session_affinity_keeps_a_session_on_one_endpoint() -> None:
    config = {"plugins": [{"type": "session-affinity-scorer"}, {"type": "max-score-picker"}]}
    with LocalStack(sims=3, picker_config=config, time_scale=0.02) as stack:
        first = post(stack.url + "/v1/completions", completion("hello"))
        assert first.status == 200
        token = first.headers["x-session-token"]
        home = first.headers[SERVED_BY]
        for i in range(8):
            reply = post(
                stack.url + "/v1/completions",
                completion(f"turn {i}"),
                headers={"x-session-token": token},
            )
            assert reply.status == 200
            assert reply.headers[SERVED_BY] == home
            assert reply.headers["x-session-token"] == token
        spread = {
            post(stack.url + "/v1/completions", completion(f"other {i}")).headers[SERVED_BY]
            for i in range(12)
        }
        assert len(spread) > 1


def test_lora_affinity_follows_loaded_adapters() -> None:
    lora = ("--lora-modules", "sql-lora", "chat-lora", "--max-loras", "1")
    config = {
        # Declared adapters: a request for an adapter no endpoint runs yet still prefers room.
        "models": [{"name": "sim-model", "loraAdapters": ["sql-lora", "chat-lora"]}],
        "plugins": [{"type": "lora-affinity-scorer"}],
        "metrics": {"scrapeInterval": "50ms"},
    }
    with LocalStack(
        sims=[SimSpec(extra_args=lora), SimSpec(extra_args=lora)],
        picker_config=config,
        time_scale=0.05,
    ) as stack:
        first_address, _ = stack.sim_addresses
        # Keep sql-lora running on the first endpoint with a long request sent to it directly.
        long_request = completion("long job", model="sql-lora", max_tokens=4000)
        worker = threading.Thread(
            target=post,
            args=(f"http://{first_address}/v1/completions", long_request),
            kwargs={"timeout_s": 60},
            daemon=True,
        )
        worker.start()
        try:
            # Wait until the endpoint reports the adapter running, and the picker has scraped it.
            stack.picker.wait_until(  # type: ignore[union-attr]
                lambda: stack.sim_metrics()[first_address].get("vllm:num_requests_running") == 1,
                15.0,
                "the long sql-lora request to run",
            )
            time.sleep(0.3)  # several 50 ms scrape intervals
            served: Counter[str] = Counter()
            for i in range(6):
                reply = post(stack.url + "/v1/completions", completion(f"q{i}", model="sql-lora"))
                assert reply.status == 200, reply.body
                served[reply.headers[SERVED_BY]] += 1
            assert served == {first_address: 6}
            # chat-lora: the first endpoint is full (max_lora 1), the other has room.
            other = post(stack.url + "/v1/completions", completion("c", model="chat-lora"))
            assert other.headers[SERVED_BY] != first_address
        finally:
            worker.join(timeout=60)


def test_saturation_sheds_only_sheddable_requests() -> None:
    config = {
        "admission": {"queueDepthThreshold": 1},
        "objectives": [{"name": "batch", "priority": -1}],
        "metrics": {"scrapeInterval": "50ms"},
    }
    busy = ("--max-num-seqs", "1")
    with LocalStack(
        sims=[SimSpec(extra_args=busy), SimSpec(extra_args=busy)],
        picker_config=config,
        time_scale=0.05,
    ) as stack:
        load = [
            WorkloadRequest("/v1/completions", completion(f"load {i}", max_tokens=1500))
            for i in range(8)
        ]

        async def scenario() -> tuple[list[int], list[int]]:
            background = asyncio.create_task(replay(stack.url, load, concurrency=8, timeout_s=60))
            # Wait until the picker has scraped both endpoints queueing behind the burst.
            assert stack.picker is not None
            await asyncio.to_thread(
                stack.picker.wait_until,
                lambda: queued(stack) == 2,
                15.0,
                "both endpoints to show a queue",
            )
            shed = await asyncio.to_thread(
                post,
                stack.url + "/v1/completions",
                completion("batch job"),
                {"x-llm-d-inference-objective": "batch"},
            )
            critical = await asyncio.to_thread(
                post, stack.url + "/v1/completions", completion("important")
            )
            outcomes = await background
            return [shed.status, critical.status], [o.status for o in outcomes]

        statuses, load_statuses = asyncio.run(scenario())
        assert statuses == [429, 200]
        assert set(load_statuses) == {200}
        text = stack.picker_metrics_text()
        assert 'kv_picker_admission_decisions_total{decision="shed"} 1.0' in text
        # The burst is over: the same sheddable request is admitted again.
        assert (
            post(
                stack.url + "/v1/completions",
                completion("later"),
                {"x-llm-d-inference-objective": "batch"},
            ).status
            == 200
        )


def queued(stack: LocalStack) -> int:
    """Endpoints whose scraped queue is non-empty, per the picker's own metrics."""
    count = 0
    for line in stack.picker_metrics_text().splitlines():
        if line.startswith("kv_picker_endpoint_requests_waiting{"):
            count += float(line.rsplit(" ", 1)[1]) >= 1
    return count


def test_llm_d_optimized_baseline_config_routes_through_envoy() -> None:
    """llm-d's later optimized-baseline plugin list, as its guide ships it: a shared prompt stays
    on the endpoint holding it, distinct prompts spread, and the in-flight tokens the filter's
    gate reads go back to 0 once the requests have answered."""
    config = {
        "apiVersion": "llm-d.ai/v1alpha1",
        "kind": "EndpointPickerConfig",
        "plugins": [
            {"type": "token-load-scorer"},
            {"type": "inflight-load-producer"},
            {
                "type": "approx-prefix-cache-producer",
                "parameters": {"maxPrefixTokensToMatch": 40960},
            },
            {
                "type": "prefix-cache-affinity-filter",
                "parameters": {
                    "affinityThreshold": 0.8,
                    "maxTokensInFlightPenalty": 286720,
                    "maxTTFTPenaltyMs": 0,
                },
            },
        ],
        "schedulingProfiles": [
            {
                "name": "default",
                "plugins": [
                    {"pluginRef": "prefix-cache-affinity-filter"},
                    {"pluginRef": "token-load-scorer"},
                ],
            }
        ],
    }
    with LocalStack(sims=3, picker_config=config, time_scale=0.02) as stack:
        shared = "You are a support agent for ACME. " * 60
        served = Counter(
            post(stack.url + "/v1/completions", completion(f"{shared}\nQ{i}")).headers[SERVED_BY]
            for i in range(8)
        )
        assert len(served) == 1, served
        distinct = Counter(
            post(stack.url + "/v1/completions", completion(f"topic {i} " * 80)).headers[SERVED_BY]
            for i in range(18)
        )
        assert len(distinct) >= 2, distinct
        wait_for(
            stack,
            'kv_picker_affinity_filter_narrowed{plugin="prefix-cache-affinity-filter"} 7.0',
            "the filter to have kept 7 requests home",
        )

        def drained() -> bool:  # the gauge follows the store at each scrape (every 100 ms)
            queued = [
                float(line.rsplit(" ", 1)[1])
                for line in stack.picker_metrics_text().splitlines()
                if line.startswith("kv_picker_endpoint_queued_prefill_tokens{")
            ]
            return len(queued) == 3 and not any(queued)

        assert stack.picker is not None
        stack.picker.wait_until(drained, 15.0, "no prefill tokens left in flight")
