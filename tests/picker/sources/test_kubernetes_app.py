"""Discovery inside the service: a discovered endpoint is scraped, feeds both indexes and the
metrics, takes KV events from ``tcp://<pod IP>:<publisherPort>``; once its pod stops serving it
leaves all of them while a request already routed there finishes; a reload keeps it.

One simulated endpoint runs in process on 127.0.0.1; its pod in the fake API points at it with
the ``llm-d.ai/active-ports`` annotation (every pod here shares the loopback IP).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml

from kv_picker.app import PickerApp
from kv_picker.config import load_config
from kv_picker.plugins import builtin_registry
from kv_picker.state.approx_index import ApproximatePrefixIndex
from kv_picker_bench.sim.endpoint import SimEndpoint, SimEndpointConfig, start_sim_endpoint
from kv_picker_bench.sim.kube_api import FakeKubeApi

REGISTRY = builtin_registry(include_entry_points=False)
NS = "llm"
APP = {"app": "vllm"}
ACTIVE_PORTS = "llm-d.ai/active-ports"


async def wait_for(condition: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.01)


@pytest.fixture
async def sim() -> AsyncIterator[SimEndpoint]:
    endpoint = await start_sim_endpoint(
        SimEndpointConfig(time_scale=0.01, kv_events_port=0, kv_events_replay_port=0)
    )
    try:
        yield endpoint
    finally:
        await endpoint.stop()


def write_config(path: Path, kube: FakeKubeApi, sim: SimEndpoint, **extra: Any) -> Path:
    assert sim.publisher is not None
    document = {
        "server": {"host": "127.0.0.1", "grpcPort": 0, "metricsPort": 0, "admin": {"port": 0}},
        "metrics": {"scrapeInterval": "50ms"},
        "discovery": {
            "kubernetes": {
                "namespace": NS,
                "inferencePool": "pool",
                "kubeconfig": str(kube.write_kubeconfig(path.parent / "kubeconfig")),
            }
        },
        "kvEvents": {
            "mode": "connect",
            "publisherPort": sim.publisher.port,
            "replayPort": sim.publisher.replay_port,
            "model": "sim-model",
        },
        "plugins": [{"type": "prefix-cache-scorer"}, {"type": "max-score-picker"}],
        **extra,
    }
    path.write_text(yaml.safe_dump(document))
    return path


async def exposition(app: PickerApp) -> str:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{app.metrics_port}/metrics") as response,
    ):
        return await response.text()


async def test_a_pod_that_stops_serving_leaves_indexes_metrics_and_kv_events(
    tmp_path: Path, sim: SimEndpoint
) -> None:
    address = f"127.0.0.1:{sim.port}"
    with FakeKubeApi(namespace=NS) as kube:
        kube.apply_pool("pool", APP, [sim.port])
        kube.add_pod("a", "127.0.0.1", APP, annotations={ACTIVE_PORTS: str(sim.port)})
        path = write_config(tmp_path / "picker.yaml", kube, sim)
        app = PickerApp(load_config(path, REGISTRY), REGISTRY, config_path=path)
        await app.start()
        try:
            await app.wait_ready(timeout_s=10.0)
            subscriber = app.kv_subscriber
            index = app.kv_index
            assert subscriber is not None and index is not None
            publisher = sim.publisher
            assert publisher is not None
            assert subscriber.receiving() == {address: f"tcp://127.0.0.1:{publisher.port}"}

            # The endpoint serves a prompt: its KV events reach the precise index.
            body = {"model": "sim-model", "prompt": "discovered pods cache blocks " * 40}
            async with (
                aiohttp.ClientSession() as session,
                session.post(f"http://{address}/v1/completions", json=body) as response,
            ):
                assert response.status == 200
            await wait_for(lambda: index.num_blocks() > 0, "KV events of the discovered pod")

            # Routed requests: one finished (the approximate index records it), one in flight.
            request = {**body, "max_tokens": 2}
            headers = {"content-type": "application/json"}
            done = await app.director.route_body(json.dumps(request).encode(), headers)
            done.finish()
            in_flight = await app.director.route_body(json.dumps(request).encode(), headers)
            assert in_flight.endpoint.address == address
            approximate = app.director.scheduler.plugins["prefix-cache-scorer"].index
            assert isinstance(approximate, ApproximatePrefixIndex)
            assert approximate.num_entries() > 0
            await wait_for(lambda: app.scraper.rounds > 2, "a few scrapes")
            text = await exposition(app)
            assert f'kv_picker_endpoint_requests_waiting{{endpoint="{address}"}}' in text
            assert f'endpoint="{address}",profile="default"' in text

            kube.set_pod_ready("a", False)
            await wait_for(lambda: len(app.store) == 0, "the NotReady pod's endpoint to leave")
            assert index.num_blocks() == 0
            assert approximate.num_entries() == 0
            await wait_for(lambda: subscriber.receiving() == {}, "its KV-event receiver to stop")
            text = await exposition(app)
            assert address not in text
            # The request routed before still finishes, and its accounting with it.
            in_flight.finish()
            assert app.metrics.running._value.get() == 0

            # Back to Ready: a new endpoint, scraped at once, events subscribed again.
            kube.set_pod_ready("a", True)
            await wait_for(lambda: len(app.store.ready_endpoints()) == 1, "the pod back")
            await wait_for(lambda: subscriber.receiving() != {}, "its KV events again")

            # A reload of the same file keeps what discovery found.
            path.write_text(path.read_text() + "\nseed: 7\n")
            assert app.reload()
            assert set(app.store.by_address) == {address}
        finally:
            await app.stop(grace_s=0.5)
        assert app.discovery is not None


async def test_static_endpoints_without_discovery_still_reload(tmp_path: Path) -> None:
    path = tmp_path / "picker.yaml"
    document: dict[str, Any] = {
        "server": {"host": "127.0.0.1", "grpcPort": 0, "metricsPort": 0, "admin": {"port": 0}},
        "endpoints": [{"address": "127.0.0.1:9"}],
    }
    path.write_text(yaml.safe_dump(document))
    app = PickerApp(load_config(path, REGISTRY), REGISTRY, config_path=path)
    assert app.discovery is None
    await app.start()
    try:
        document["endpoints"].append({"address": "127.0.0.1:10"})
        path.write_text(yaml.safe_dump(document))
        assert app.reload()
        assert set(app.store.by_address) == {"127.0.0.1:9", "127.0.0.1:10"}
        # Switching to discovery needs a restart: the running endpoints stay.
        document["discovery"] = {"kubernetes": {"namespace": NS, "inferencePool": "pool"}}
        del document["endpoints"]
        path.write_text(yaml.safe_dump(document))
        assert app.reload()
        assert set(app.store.by_address) == {"127.0.0.1:9", "127.0.0.1:10"}
    finally:
        await app.stop(grace_s=0.5)
