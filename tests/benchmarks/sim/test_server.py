"""Tests of the simulated endpoint over HTTP (in-process server, aiohttp client)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from multidict import CIMultiDictProxy
from prometheus_client.parser import text_string_to_metric_families

from kv_picker_bench.sim import ENDPOINT_HEADER, SimEndpoint, SimEndpointConfig, start_sim_endpoint

StartEndpoint = Callable[..., Awaitable[SimEndpoint]]

MODEL = "sim-model"
LONG_PROMPT = " ".join(f"word{i % 37}" for i in range(300))


async def post(
    client: aiohttp.ClientSession, endpoint: SimEndpoint, path: str, body: Any
) -> tuple[int, Any, CIMultiDictProxy[str]]:
    async with client.post(endpoint.url + path, json=body) as response:
        return response.status, await response.json(), response.headers


async def post_sse(
    client: aiohttp.ClientSession, endpoint: SimEndpoint, path: str, body: Any
) -> list[str]:
    async with client.post(endpoint.url + path, json=body) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        assert response.headers[ENDPOINT_HEADER] == endpoint.address
        text = await response.text()
    assert text.endswith("\n\n")
    events = text.split("\n\n")[:-1]
    assert all(event.startswith("data: ") for event in events)
    return [event[len("data: ") :] for event in events]


async def scrape(client: aiohttp.ClientSession, endpoint: SimEndpoint) -> dict[str, float]:
    async with client.get(endpoint.url + "/metrics") as response:
        assert response.status == 200
        text = await response.text()
    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name
            if "finished_reason" in sample.labels:
                key += f"[{sample.labels['finished_reason']}]"
            if sample.name.endswith("_bucket"):
                continue
            samples[key] = sample.value
    return samples


# ------------------------------------------------------------------------------ completions


async def test_completion_non_streaming(
    endpoint: SimEndpoint, client: aiohttp.ClientSession
) -> None:
    status, body, headers = await post(
        client,
        endpoint,
        "/v1/completions",
        {"model": MODEL, "prompt": "Hello there", "max_tokens": 5},
    )
    assert status == 200
    assert headers[ENDPOINT_HEADER] == f"127.0.0.1:{endpoint.port}"
    assert body["object"] == "text_completion"
    assert body["id"].startswith("cmpl-")
    assert body["model"] == MODEL
    assert isinstance(body["created"], int)
    (choice,) = body["choices"]
    assert choice["finish_reason"] == "length"
    assert len(choice["text"].split()) == 5
    usage = body["usage"]
    assert usage["completion_tokens"] == 5
    assert usage["prompt_tokens"] == 2
    assert usage["total_tokens"] == 7
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}


async def test_default_max_tokens_is_16(
    endpoint: SimEndpoint, client: aiohttp.ClientSession
) -> None:
    status, body, _ = await post(
        client,
        endpoint,
        "/v1/completions",
        {"model": MODEL, "prompt": ["one prompt"], "ignore_eos": True},
    )
    assert status == 200
    assert body["usage"]["completion_tokens"] == 16


@pytest.mark.parametrize("prompt", [[101, 102, 103], [[101, 102, 103]]])
async def test_completion_accepts_token_ids(
    endpoint: SimEndpoint, client: aiohttp.ClientSession, prompt: list[Any]
) -> None:
    status, body, _ = await post(
        client, endpoint, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1}
    )
    assert status == 200
    assert body["usage"]["prompt_tokens"] == 3


async def test_repeated_prompt_reports_cached_tokens(
    endpoint: SimEndpoint, client: aiohttp.ClientSession
) -> None:
    request = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 2}
    _, first, _ = await post(client, endpoint, "/v1/completions", request)
    _, second, _ = await post(client, endpoint, "/v1/completions", request)
    prompt_tokens = first["usage"]["prompt_tokens"]
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert (
        second["usage"]["prompt_tokens_details"]["cached_tokens"] == (prompt_tokens - 1) // 16 * 16
    )

    metrics = await scrape(client, endpoint)
    assert metrics["vllm:prefix_cache_queries_total"] == 2 * prompt_tokens
    assert metrics["vllm:prefix_cache_hits_total"] == (prompt_tokens - 1) // 16 * 16
    assert metrics["vllm:prompt_tokens_total"] == 2 * prompt_tokens
    assert metrics["vllm:generation_tokens_total"] == 4
    assert metrics["vllm:request_success_total[length]"] == 2
    assert metrics["vllm:time_to_first_token_seconds_count"] == 2
    assert metrics["vllm:e2e_request_latency_seconds_count"] == 2
    assert metrics["vllm:num_requests_running"] == 0
    assert metrics["vllm:num_requests_waiting"] == 0
    assert metrics["vllm:kv_cache_usage_perc"] == 0.0


async def test_reset_prefix_cache(endpoint: SimEndpoint, client: aiohttp.ClientSession) -> None:
    request = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 1}
    await post(client, endpoint, "/v1/completions", request)
    async with client.post(endpoint.url + "/reset_prefix_cache") as response:
        assert response.status == 200
    _, body, _ = await post(client, endpoint, "/v1/completions", request)
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_cache_salt_isolates(endpoint: SimEndpoint, client: aiohttp.ClientSession) -> None:
    request = {"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 1, "cache_salt": "a"}
    await post(client, endpoint, "/v1/completions", request)
    _, other, _ = await post(client, endpoint, "/v1/completions", {**request, "cache_salt": "b"})
    _, same, _ = await post(client, endpoint, "/v1/completions", request)
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert same["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


async def test_completion_streaming(endpoint: SimEndpoint, client: aiohttp.ClientSession) -> None:
    events = await post_sse(
        client,
        endpoint,
        "/v1/completions",
        {"model": MODEL, "prompt": "Hi", "max_tokens": 4, "stream": True},
    )
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) == 4
    assert all(c["object"] == "text_completion" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None, None, None, "length"]
    assert all("usage" not in c for c in chunks)


async def test_completion_streaming_with_usage(
    endpoint: SimEndpoint, client: aiohttp.ClientSession
) -> None:
    events = await post_sse(
        client,
        endpoint,
        "/v1/completions",
        {
            "model": MODEL,
            "prompt": "Hi there",
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert events[-1] == "[DONE]"
    usage_chunk = json.loads(events[-2])
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 3
    assert usage_chunk["usage"]["prompt_tokens"] == 2
    assert usage_chunk["usage"]["total_tokens"] == 5
    assert json.loads(events[-3])["choices"][0]["finish_reason"] == "length"


# ------------------------------------------------------------------------------------ chat


async def test_chat_non_streaming(endpoint: SimEndpoint, client: aiohttp.ClientSession) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "What is a KV cache?"}]},
    ]
    status, body, headers = await post(
        client,
        endpoint,
        "/v1/chat/completions",
        {"model": MODEL, "messages": messages, "max_completion_tokens": 6, "max_tokens": 99},
    )
    assert status == 200
    assert headers[ENDPOINT_HEADER] == endpoint.address
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-")
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant"
    assert len(choice["message"]["content"].split()) == 6
    assert choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 6


async def test_chat_streaming(endpoint: SimEndpoint, client: aiohttp.ClientSession) -> None:
    events = await post_sse(
        client,
        endpoint,
        "/v1/chat/completions",
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 3,
            "stream": True,
            "stream_options": {"include_usage": True},
        },
    )
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    token_chunks = chunks[1:-1]
    assert len(token_chunks) == 3
    assert token_chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 3


async def test_multi_turn_chat_hits_the_cache(
    endpoint: SimEndpoint, client: aiohttp.ClientSession
) -> None:
    turn1 = [{"role": "user", "content": LONG_PROMPT}]
    _, first, _ = await post(
        client, endpoint, "/v1/chat/completions", {"model": MODEL, "messages": turn1}
    )
    answer = first["choices"][0]["message"]["content"]
    turn2 = [*turn1, {"role": "assistant", "content": answer}, {"role": "user", "content": "More?"}]
    _, second, _ = await post(
        client, endpoint, "/v1/chat/completions", {"model": MODEL, "messages": turn2}
    )
    assert (
        second["usage"]["prompt_tokens_details"]["cached_tokens"]
        >= first["usage"]["prompt_tokens"] - 16
    )


# ---------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("path", "body", "status"),
    [
        ("/v1/completions", b"{not json", 400),
        ("/v1/completions", b"\xff\xfe", 400),
        ("/v1/completions", b"[1, 2]", 400),
        ("/v1/completions", b'{"prompt": "hi"}', 400),
        ("/v1/completions", b'{"model": "sim-model"}', 400),
        ("/v1/completions", b'{"model": "sim-model", "prompt": ""}', 400),
        ("/v1/completions", b'{"model": "sim-model", "prompt": ["a", "b"]}', 400),
        ("/v1/completions", b'{"model": "sim-model", "prompt": [1, "a"]}', 400),
        ("/v1/completions", b'{"model": "sim-model", "prompt": [99999999]}', 400),
        ("/v1/completions", b'{"model": "sim-model", "prompt": "a", "max_tokens": 0}', 400),
        ("/v1/completions", b'{"model": "sim-model", "prompt": "a", "max_tokens": "3"}', 400),
        ("/v1/completions", b'{"model": "sim-model", "prompt": "a", "stream": "yes"}', 400),
        ("/v1/completions", b'{"model": "sim-model", "prompt": "a", "n": 2}', 400),
        ("/v1/completions", b'{"model": "sim-model", "prompt": "a", "cache_salt": 5}', 400),
        ("/v1/completions", b'{"model": "sim-model", "prompt": "a", "max_tokens": 40000}', 400),
        ("/v1/completions", b'{"model": "other-model", "prompt": "a"}', 404),
        ("/v1/chat/completions", b'{"model": "sim-model"}', 400),
        ("/v1/chat/completions", b'{"model": "sim-model", "messages": []}', 400),
        ("/v1/chat/completions", b'{"model": "sim-model", "messages": [{"content": "x"}]}', 400),
        (
            "/v1/chat/completions",
            b'{"model": "sim-model", "messages": [{"role": "user", "content": 7}]}',
            400,
        ),
        (
            "/v1/chat/completions",
            b'{"model": "nope", "messages": [{"role": "user", "content": "x"}]}',
            404,
        ),
    ],
)
async def test_bad_requests_get_openai_errors(
    endpoint: SimEndpoint, client: aiohttp.ClientSession, path: str, body: bytes, status: int
) -> None:
    async with client.post(
        endpoint.url + path, data=body, headers={"Content-Type": "application/json"}
    ) as response:
        assert response.status == status
        assert response.headers[ENDPOINT_HEADER] == endpoint.address
        error = (await response.json())["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert error["code"] == status
    assert error["type"] == ("NotFoundError" if status == 404 else "BadRequestError")
    # Nothing was left behind in the engine.
    assert endpoint.engine.num_waiting == endpoint.engine.num_running == 0


async def test_unknown_route_still_names_the_endpoint(
    endpoint: SimEndpoint, client: aiohttp.ClientSession
) -> None:
    async with client.get(endpoint.url + "/no/such/path") as response:
        assert response.status == 404
        assert response.headers[ENDPOINT_HEADER] == endpoint.address


# ----------------------------------------------------------------------- transfer encoding


async def test_chunked_request_body_from_client(
    endpoint: SimEndpoint, client: aiohttp.ClientSession
) -> None:
    payload = json.dumps({"model": MODEL, "prompt": LONG_PROMPT, "max_tokens": 2}).encode()

    async def pieces() -> AsyncIterator[bytes]:
        for start in range(0, len(payload), 100):
            yield payload[start : start + 100]
            await asyncio.sleep(0)

    async with client.post(
        endpoint.url + "/v1/completions",
        data=pieces(),
        headers={"Content-Type": "application/json"},
    ) as response:
        assert response.status == 200
        body = await response.json()
    assert body["usage"]["completion_tokens"] == 2


async def test_chunked_request_body_on_the_wire(endpoint: SimEndpoint) -> None:
    # Written by hand so the request is certainly chunked (as Envoy sends it upstream).
    payload = json.dumps({"model": MODEL, "prompt": "chunked hello", "max_tokens": 3}).encode()
    reader, writer = await asyncio.open_connection(endpoint.host, endpoint.port)
    try:
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: sim\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
        )
        for start in range(0, len(payload), 7):
            piece = payload[start : start + 7]
            writer.write(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), timeout=10)
    finally:
        writer.close()
        await writer.wait_closed()
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert f"{ENDPOINT_HEADER}: {endpoint.address}".lower().encode() in head.lower()
    assert json.loads(body)["usage"]["completion_tokens"] == 3


# ---------------------------------------------------------------------------- other routes


async def test_health_models_and_metrics(
    start_endpoint: StartEndpoint, client: aiohttp.ClientSession
) -> None:
    endpoint = await start_endpoint(
        role="decode", hardware_class="A100", lora_modules=("adapter-a",), num_gpu_blocks=500
    )
    async with client.get(endpoint.url + "/health") as response:
        assert response.status == 200
        assert response.headers[ENDPOINT_HEADER] == endpoint.address
    async with client.get(endpoint.url + "/v1/models") as response:
        models = await response.json()
    ids = [m["id"] for m in models["data"]]
    assert ids == [MODEL, "adapter-a"]
    assert models["data"][0]["kv_picker_sim"]["role"] == "decode"
    assert models["data"][1]["parent"] == MODEL

    status, _, _ = await post(
        client, endpoint, "/v1/completions", {"model": "adapter-a", "prompt": "hi", "max_tokens": 1}
    )
    assert status == 200

    async with client.get(endpoint.url + "/metrics") as response:
        text = await response.text()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    (config_sample,) = families["vllm:cache_config_info"].samples
    assert config_sample.value == 1
    assert config_sample.labels["block_size"] == "16"
    assert config_sample.labels["num_gpu_blocks"] == "500"
    assert config_sample.labels["enable_prefix_caching"] == "True"
    assert config_sample.labels["prefix_caching_hash_algo"] == "xxhash"
    (info,) = families["kv_picker_sim_info"].samples
    assert info.labels["role"] == "decode"
    assert info.labels["hardware_class"] == "A100"
    (usage,) = families["vllm:kv_cache_usage_perc"].samples
    assert usage.labels == {"model_name": MODEL, "engine": "0"}
    assert "vllm:lora_requests_info" in families
    assert families["vllm:time_to_first_token_seconds"].type == "histogram"
    assert families["vllm:prefix_cache_hits"].type == "counter"


async def test_gauges_show_load_while_requests_run(
    start_endpoint: StartEndpoint, client: aiohttp.ClientSession
) -> None:
    endpoint = await start_endpoint(max_num_seqs=2)
    request = {"model": MODEL, "prompt": "load", "max_tokens": 200}
    tasks = [
        asyncio.create_task(post(client, endpoint, "/v1/completions", request)) for _ in range(5)
    ]
    try:
        for _ in range(200):
            metrics = await scrape(client, endpoint)
            if metrics["vllm:num_requests_waiting"] > 0:
                break
            await asyncio.sleep(0.005)
        assert metrics["vllm:num_requests_running"] == 2
        assert metrics["vllm:num_requests_waiting"] == 3
        assert 0 < metrics["vllm:kv_cache_usage_perc"] <= 1
        results = await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
    assert all(status == 200 for status, _, _ in results)
    metrics = await scrape(client, endpoint)
    assert metrics["vllm:request_success_total[length]"] == 5
    assert metrics["vllm:request_queue_time_seconds_count"] == 5


async def test_many_concurrent_requests_all_complete(
    start_endpoint: StartEndpoint, client: aiohttp.ClientSession
) -> None:
    endpoint = await start_endpoint(max_num_seqs=4, num_gpu_blocks=64)
    shared = LONG_PROMPT[:600]
    requests = [
        {
            "model": MODEL,
            "prompt": f"{shared} question {i}",
            "max_tokens": 1 + i % 7,
            "stream": i % 2 == 0,
        }
        for i in range(24)
    ]

    async def send(request: dict[str, Any]) -> int:
        async with client.post(endpoint.url + "/v1/completions", json=request) as response:
            assert response.status == 200
            if request["stream"]:
                events = (await response.text()).split("\n\n")[:-1]
                assert events[-1] == "data: [DONE]"
                return len(events) - 1
            return int((await response.json())["usage"]["completion_tokens"])

    counts = await asyncio.gather(*(send(r) for r in requests))
    assert counts == [r["max_tokens"] for r in requests]
    assert endpoint.engine.cache.hits_tokens > 0
    assert endpoint.engine.cache.usage == 0.0


async def test_client_disconnect_aborts_the_request(
    endpoint: SimEndpoint, client: aiohttp.ClientSession
) -> None:
    request = {"model": MODEL, "prompt": "long one", "max_tokens": 5000, "stream": True}
    async with client.post(endpoint.url + "/v1/completions", json=request) as response:
        assert response.status == 200
        await response.content.readline()
        assert endpoint.engine.num_running == 1
        response.close()
    for _ in range(400):
        if endpoint.engine.num_running == 0:
            break
        await asyncio.sleep(0.005)
    assert endpoint.engine.num_running == 0
    assert endpoint.engine.cache.usage == 0.0
    metrics = await scrape(client, endpoint)
    assert metrics["vllm:request_success_total[abort]"] == 1


async def test_stop_ends_in_flight_requests_promptly(client: aiohttp.ClientSession) -> None:
    endpoint = await start_sim_endpoint(SimEndpointConfig(time_scale=0.01))
    try:
        request = {"model": MODEL, "prompt": "slow", "max_tokens": 30_000}
        task = asyncio.create_task(post(client, endpoint, "/v1/completions", request))
        for _ in range(200):
            if endpoint.engine.num_running:
                break
            await asyncio.sleep(0.005)
    finally:
        await asyncio.wait_for(endpoint.stop(), timeout=5)
    try:
        status, body, _ = await asyncio.wait_for(task, timeout=5)
    except aiohttp.ClientError:
        pass  # the connection was closed under the request: also a prompt end
    else:
        assert status == 503
        assert body["error"]["code"] == 503
    await endpoint.stop()  # idempotent


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="role"):
        SimEndpointConfig(role="router")
    with pytest.raises(ValueError, match="time_scale"):
        SimEndpointConfig(time_scale=0)
    with pytest.raises(ValueError, match="hardware class"):
        SimEndpointConfig(hardware_class="TPU")
    with pytest.raises(ValueError):
        SimEndpointConfig(block_size=0)


async def test_time_scale_maps_model_time_to_wall_time(
    start_endpoint: StartEndpoint, client: aiohttp.ClientSession
) -> None:
    time_scale = 0.05
    endpoint = await start_endpoint(time_scale=time_scale)
    loop = asyncio.get_running_loop()
    started = loop.time()
    status, body, _ = await post(
        client,
        endpoint,
        "/v1/completions",
        {"model": MODEL, "prompt": "Hello there", "max_tokens": 20},
    )
    wall_s = loop.time() - started
    assert status == 200
    assert body["usage"]["prompt_tokens"] == 2
    # Model time: one prefill step of the 2 prompt tokens, then 19 decode steps, each reading
    # the KV of the prompt and the outputs so far.
    timing, hardware = endpoint.engine.config.timing, endpoint.engine.config.hardware
    ttft_s = timing.step_duration_s(hardware, 1, [(2, 0)])
    expected_model_s = ttft_s + sum(
        timing.step_duration_s(hardware, 1, decode_context_tokens=2 + k) for k in range(1, 20)
    )
    metrics = await scrape(client, endpoint)
    # Metrics report model time, exactly, whatever the event loop's jitter.
    assert metrics["vllm:e2e_request_latency_seconds_sum"] == pytest.approx(expected_model_s)
    assert metrics["vllm:time_to_first_token_seconds_sum"] == pytest.approx(ttft_s)
    # Wall time is model time times the scale, never less.
    assert wall_s >= expected_model_s * time_scale * 0.95
