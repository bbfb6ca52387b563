"""P/D disaggregation in the simulated endpoints: prefill leg, KV transfer, local decode."""

from __future__ import annotations

import aiohttp
import pytest

from kv_picker_bench.localstack import free_port
from kv_picker_bench.sim import SimEndpointConfig, start_sim_endpoint
from kv_picker_bench.sim.engine import EngineConfig, SimEngine

PROMPT = "a long shared document about caches " * 200  # ~1,500 tokens


def test_engine_transferred_tokens_skip_prefill_and_are_cached() -> None:
    prompt = list(range(200, 200 + 1600))

    def ttft(transferred: int) -> tuple[float, int]:
        engine = SimEngine(EngineConfig())
        engine.add_request("r", prompt, 2, now_s=0.0, num_transferred_tokens=transferred)
        now, first = 0.0, None
        while engine.has_work:
            result = engine.step(now)
            now = result.end_s
            if first is None and result.tokens:
                first = now
        assert first is not None
        return first, engine.num_cached_prompt_tokens(prompt)

    local_ttft, local_cached = ttft(0)
    pulled_ttft, pulled_cached = ttft(len(prompt))
    assert pulled_ttft < local_ttft / 5  # only the last token is computed here
    assert pulled_cached == local_cached == 1600


async def test_decode_endpoint_runs_the_prefill_leg_elsewhere() -> None:
    common = {"time_scale": 0.01, "kv_transfer_gbps": 100.0}
    prefill = await start_sim_endpoint(SimEndpointConfig(role="prefill", **common))
    decode = await start_sim_endpoint(SimEndpointConfig(role="decode", **common))
    try:
        async with aiohttp.ClientSession() as session:
            body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 8}
            headers = {"x-prefiller-host-port": prefill.address}
            async with session.post(
                f"{decode.url}/v1/completions", json=body, headers=headers
            ) as reply:
                assert reply.status == 200
                assert reply.headers["x-kv-picker-sim-endpoint"] == decode.address
                document = await reply.json()
        timing = document["kv_picker_sim"]
        assert document["usage"]["completion_tokens"] == 8
        assert timing["prefill_endpoint"] == prefill.address
        assert timing["prefill_leg_error"] is None
        tokens = document["usage"]["prompt_tokens"]
        assert timing["transferred_tokens"] == tokens
        expected_transfer_s = tokens * 131_072 / (100e9 / 8)
        assert timing["transfer_s"] == pytest.approx(expected_transfer_s)
        assert timing["ttft_s"] >= timing["prefill_leg_s"] + timing["transfer_s"]
        assert prefill.metrics.pd_legs == {"prefill": 1, "decode": 0}
        assert decode.metrics.pd_legs == {"prefill": 0, "decode": 1}
        assert decode.metrics.transferred_blocks == -(-tokens // 16)
        # The decode endpoint now holds the prompt's blocks: a second pull sends almost nothing
        # (only the last, partial block, which is never cached).
        async with (
            aiohttp.ClientSession() as session,
            session.post(f"{decode.url}/v1/completions", json=body, headers=headers) as reply,
        ):
            again = (await reply.json())["kv_picker_sim"]
        assert again["transfer_s"] < timing["transfer_s"] / 50
        assert decode.metrics.transferred_blocks <= -(-tokens // 16) + 1
    finally:
        await decode.stop()
        await prefill.stop()


async def test_streamed_request_carries_timing_and_dead_prefiller_falls_back() -> None:
    decode = await start_sim_endpoint(SimEndpointConfig(role="decode", time_scale=0.01))
    try:
        async with aiohttp.ClientSession() as session:
            body = {"model": "sim-model", "prompt": PROMPT, "max_tokens": 4, "stream": True}
            headers = {"x-prefiller-host-port": f"127.0.0.1:{free_port()}"}
            async with session.post(
                f"{decode.url}/v1/completions", json=body, headers=headers
            ) as reply:
                assert reply.status == 200
                text = (await reply.read()).decode()
        assert text.rstrip().endswith("data: [DONE]")
        assert '"prefill_leg_error": "Client' in text
        assert decode.metrics.pd_leg_failures == 1
        assert decode.metrics.pd_legs["decode"] == 0
    finally:
        await decode.stop()
