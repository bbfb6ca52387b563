"""The service as a whole, in process: gRPC health, TLS, metrics exposition, config reload."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
from pathlib import Path

import aiohttp
import aiohttp.web
import grpc
import pytest
import yaml
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_pb
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kv_picker.api import admin_pb2, admin_pb2_grpc
from kv_picker.app import PickerApp
from kv_picker.config import AdminConfig, load_config
from kv_picker.plugins import builtin_registry
from kv_picker.wire import HEALTH_SERVICES
from tests.certificates import CertificateAuthority

REGISTRY = builtin_registry(include_entry_points=False)


def write_config(path: Path, **overrides: object) -> Path:
    document: dict[str, object] = {
        "server": {"host": "127.0.0.1", "grpcPort": 0, "metricsPort": 0, "admin": {"port": 0}},
        "endpoints": [{"address": "127.0.0.1:9"}],
        "metrics": {"scrapeInterval": "50ms"},
    }
    document.update(overrides)
    path.write_text(yaml.safe_dump(document))
    return path


async def wait_until_ready(app: PickerApp, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if app.ready:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the picker never became ready")


async def health_statuses(app: PickerApp) -> dict[str, int]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return {
            service: (
                await stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            ).status
            for service in HEALTH_SERVICES
        }


async def readyz(app: PickerApp) -> int:
    url = f"http://127.0.0.1:{app.metrics_port}/readyz"
    async with aiohttp.ClientSession() as session, session.get(url) as response:
        return response.status


SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def test_alive_at_once_and_ready_once_the_pool_is_known(tmp_path: Path) -> None:
    """With every endpoint unreachable the picker is ready after a scrape's time (timeout plus
    two intervals): it then answers requests with its own 503s rather than not at all."""
    path = write_config(tmp_path / "c.yaml", metrics={"scrapeInterval": "50ms", "timeout": "1s"})
    app = PickerApp(load_config(path, REGISTRY), REGISTRY)
    await app.start()
    try:
        statuses = await health_statuses(app)
        assert statuses.pop("liveness") == SERVING
        assert set(statuses.values()) == {NOT_SERVING}  # "", readiness, the ext_proc service
        assert await readyz(app) == 503
        await wait_until_ready(app)
        assert set((await health_statuses(app)).values()) == {SERVING}
        assert await readyz(app) == 200
        await app.drain(0)
        assert await readyz(app) == 503
        assert (await health_statuses(app))["readiness"] == NOT_SERVING
    finally:
        await app.stop(grace_s=0.5)


async def test_ready_as_soon_as_an_endpoint_answers(tmp_path: Path) -> None:
    async def metrics(request: aiohttp.web.Request) -> aiohttp.web.Response:
        return aiohttp.web.Response(
            text="vllm:num_requests_waiting 0\nvllm:num_requests_running 0\n"
            "vllm:kv_cache_usage_perc 0.1\n"
        )

    endpoint = aiohttp.web.Application()
    endpoint.router.add_get("/metrics", metrics)
    runner = aiohttp.web.AppRunner(endpoint)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    # A 30 s scrape timeout: were readiness waiting it out, this test would time out.
    path = write_config(
        tmp_path / "c.yaml",
        endpoints=[{"address": f"127.0.0.1:{port}"}],
        metrics={"scrapeInterval": "50ms", "timeout": "30s"},
    )
    app = PickerApp(load_config(path, REGISTRY), REGISTRY)
    await app.start()
    try:
        await wait_until_ready(app, timeout_s=10.0)
        assert len(app.store.ready_endpoints()) == 1
        assert set((await health_statuses(app)).values()) == {SERVING}
    finally:
        await app.stop(grace_s=0.5)
        await runner.cleanup()


async def test_the_admin_api_has_its_own_port_on_loopback(tmp_path: Path) -> None:
    assert load_config(write_config(tmp_path / "d.yaml", server={}), REGISTRY).server.admin == (
        AdminConfig(enabled=True, host="127.0.0.1", port=9004, tls=None)
    )
    app = PickerApp(load_config(write_config(tmp_path / "c.yaml"), REGISTRY), REGISTRY)
    await app.start()
    try:
        assert app.admin_port not in (0, app.grpc_port)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.admin_port}") as channel:
            reply = await admin_pb2_grpc.AdminStub(channel).ListEndpoints(
                admin_pb2.ListEndpointsRequest(), timeout=5
            )
            assert [e.address for e in reply.endpoints] == ["127.0.0.1:9"]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await admin_pb2_grpc.AdminStub(channel).ListEndpoints(
                    admin_pb2.ListEndpointsRequest(), timeout=5
                )
            assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        await app.stop(grace_s=0.5)


async def test_the_admin_api_can_be_turned_off(tmp_path: Path) -> None:
    server = {"host": "127.0.0.1", "grpcPort": 0, "metricsPort": 0, "admin": {"enabled": False}}
    app = PickerApp(load_config(write_config(tmp_path / "c.yaml", server=server), REGISTRY))
    await app.start()
    try:
        assert app.admin_port == 0
    finally:
        await app.stop(grace_s=0.5)


async def test_metrics_endpoint_and_unreachable_endpoint_not_ready(tmp_path: Path) -> None:
    path = write_config(tmp_path / "c.yaml")
    app = PickerApp(load_config(path, REGISTRY), REGISTRY)
    await app.start()
    try:
        async with aiohttp.ClientSession() as session:
            for _ in range(100):
                url = f"http://127.0.0.1:{app.metrics_port}/metrics"
                async with session.get(url) as response:
                    assert response.status == 200
                    text = await response.text()
                if 'kv_picker_endpoints{state="not_ready"} 1.0' in text:
                    break
                await asyncio.sleep(0.05)
            assert 'kv_picker_endpoints{state="not_ready"} 1.0' in text
            assert 'kv_picker_scrape_errors_total{endpoint="127.0.0.1:9"}' in text
            assert "kv_picker_scheduling_duration_seconds" in text
            async with session.get(f"http://127.0.0.1:{app.metrics_port}/healthz") as response:
                assert await response.json() == {"endpoints": 1, "ready": 0}
    finally:
        await app.stop(grace_s=0.5)


async def test_reload_applies_good_config_and_keeps_old_on_error(tmp_path: Path) -> None:
    path = write_config(tmp_path / "c.yaml")
    app = PickerApp(load_config(path, REGISTRY), REGISTRY, config_path=path)
    await app.start()
    try:
        write_config(
            path,
            endpoints=[{"address": "127.0.0.1:9"}, {"address": "127.0.0.1:10"}],
            plugins=[{"type": "random-picker"}],
        )
        assert app.reload()
        assert sorted(e.address for e in app.store.all()) == ["127.0.0.1:10", "127.0.0.1:9"]
        assert "random-picker" in app.director.scheduler.plugins
        path.write_text("plugins: [{type: no-such-scorer}]\n")
        assert not app.reload()
        assert "random-picker" in app.director.scheduler.plugins  # the old config stays
        assert len(app.store) == 2
        exposition = app.metrics.exposition().decode()
        assert 'kv_picker_config_reloads_total{result="rejected"} 1.0' in exposition
        assert 'kv_picker_config_reloads_total{result="applied"} 1.0' in exposition
    finally:
        await app.stop(grace_s=0.5)


async def test_config_file_change_is_picked_up_without_restart(tmp_path: Path) -> None:
    path = write_config(tmp_path / "c.yaml")
    app = PickerApp(load_config(path, REGISTRY), REGISTRY, config_path=path, reload_interval_s=0.05)
    await app.start()
    try:
        write_config(path, endpoints=[{"address": "127.0.0.1:11"}])
        for _ in range(100):
            if [e.address for e in app.store.all()] == ["127.0.0.1:11"]:
                break
            await asyncio.sleep(0.05)
        assert [e.address for e in app.store.all()] == ["127.0.0.1:11"]
    finally:
        await app.stop(grace_s=0.5)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command")
async def test_tls_serving(tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    path = write_config(
        tmp_path / "c.yaml",
        server={
            "host": "127.0.0.1",
            "grpcPort": 0,
            "metricsPort": 0,
            "tls": {"certPath": str(cert), "keyPath": str(key)},
            "admin": {"port": 0},
        },
    )
    app = PickerApp(load_config(path, REGISTRY), REGISTRY)
    await app.start()
    try:
        await wait_until_ready(app)
        credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        async with grpc.aio.secure_channel(f"127.0.0.1:{app.grpc_port}", credentials) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="readiness"), timeout=5
            )
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as plain:
            with pytest.raises(grpc.aio.AioRpcError):
                await health_pb2_grpc.HealthStub(plain).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=2
                )
    finally:
        await app.stop(grace_s=0.5)


async def test_admin_over_mutual_tls_and_explain_through_it(tmp_path: Path) -> None:
    ca = CertificateAuthority("admin CA")
    cert, key = ca.issue("kv-picker", server=True).write(tmp_path, "server")
    client_cert, client_key = ca.issue("sre", server=False).write(tmp_path, "client")
    ca_path = tmp_path / "ca.crt"
    ca_path.write_bytes(ca.cert_pem)
    tls = {"certPath": str(cert), "keyPath": str(key), "clientCAPath": str(ca_path)}
    server = {
        "host": "127.0.0.1",
        "grpcPort": 0,
        "metricsPort": 0,
        "admin": {"port": 0, "tls": tls},
    }
    app = PickerApp(load_config(write_config(tmp_path / "c.yaml", server=server), REGISTRY))
    await app.start()
    try:
        body = tmp_path / "body.json"
        body.write_text('{"model": "m", "prompt": "hello"}')
        base = ["explain", "--server", f"127.0.0.1:{app.admin_port}", "--request", str(body)]
        with_cert = [*base, "--tls-ca", str(ca_path)]
        with_cert += ["--tls-cert", str(client_cert), "--tls-key", str(client_key)]
        # Through: the picker itself answers (its one endpoint was never scraped, so 503).
        result = await asyncio.to_thread(run_cli, with_cert)
        assert "503 rejected-no-endpoints" in result.stderr
        for refused_args in ([*base, "--tls-ca", str(ca_path)], base):  # no client cert; plain
            refused = await asyncio.to_thread(run_cli, refused_args)
            assert refused.returncode == 1 and "503" not in refused.stderr, refused.stderr
    finally:
        await app.stop(grace_s=0.5)


def run_cli(args: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kv_picker", *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def test_not_ready_until_discovery_has_listed_the_pool(tmp_path: Path) -> None:
    class Discovery:  # stands in for KubernetesDiscovery: listed when the test says so
        def __init__(self) -> None:
            self.synced = asyncio.Event()

        async def connect(self) -> None:
            pass

        async def run(self) -> None:
            await asyncio.Event().wait()

    path = write_config(tmp_path / "c.yaml", metrics={"scrapeInterval": "50ms", "timeout": "200ms"})
    app = PickerApp(load_config(path, REGISTRY), REGISTRY)
    discovery = Discovery()
    app.discovery = discovery  # type: ignore[assignment]
    await app.start()
    try:
        await asyncio.sleep(1.0)  # well past a scrape's time (0.3 s)
        assert not app.ready
        assert (await health_statuses(app))["readiness"] == NOT_SERVING
        discovery.synced.set()
        await wait_until_ready(app, timeout_s=5.0)
        assert (await health_statuses(app))["readiness"] == SERVING
    finally:
        await app.stop(grace_s=0.5)


async def test_stop_waits_for_open_streams_up_to_the_drain_timeout(tmp_path: Path) -> None:
    """An ext_proc stream still open when the picker stops gets ``server.drainTimeout`` to
    finish; then it is cancelled and the picker stops."""
    server = {"host": "127.0.0.1", "grpcPort": 0, "metricsPort": 0, "admin": {"port": 0}}
    path = write_config(tmp_path / "c.yaml", server={**server, "drainTimeout": "400ms"})
    app = PickerApp(load_config(path, REGISTRY), REGISTRY)
    assert app.config.server.drain_timeout_s == 0.4
    await app.start()
    hold = asyncio.Event()  # the body never comes: the stream stays open until the picker ends it

    async def from_envoy():  # type: ignore[no-untyped-def]
        headers = base_pb2.HeaderMap(
            headers=[
                base_pb2.HeaderValue(key=":method", raw_value=b"POST"),
                base_pb2.HeaderValue(key=":path", raw_value=b"/v1/completions"),
                base_pb2.HeaderValue(key="content-type", raw_value=b"application/json"),
            ]
        )
        yield ext_pb.ProcessingRequest(
            request_headers=ext_pb.HttpHeaders(headers=headers, end_of_stream=False)
        )
        await hold.wait()

    stopped_after_s = -1.0
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.grpc_port}") as channel:
            process = channel.stream_stream(
                "/envoy.service.ext_proc.v3.ExternalProcessor/Process",
                request_serializer=ext_pb.ProcessingRequest.SerializeToString,
                response_deserializer=ext_pb.ProcessingResponse.FromString,
            )
            call = process(from_envoy())
            await call.wait_for_connection()
            await asyncio.sleep(0.2)  # the picker has the headers and waits for the body
            loop = asyncio.get_running_loop()
            started_s = loop.time()
            await app.stop()  # no grace given: the config's drainTimeout
            stopped_after_s = loop.time() - started_s
            with pytest.raises(grpc.aio.AioRpcError):
                async for _ in call:
                    pass
    finally:
        hold.set()
        if stopped_after_s < 0:  # failed before the stop under test
            await app.stop(grace_s=0.5)
    # It waited for the open stream, and not for the built-in 5 s.
    assert 0.35 <= stopped_after_s < 3.0
