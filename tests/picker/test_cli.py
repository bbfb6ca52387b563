"""The command line, run as users run it: a real subprocess per command."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kv_picker_bench.localstack import ManagedProcess, free_port, http_get

ROOT = Path(__file__).resolve().parents[2]


def kv_picker(
    *args: str, timeout_s: float = 120, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kv_picker", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=env,
        check=False,
    )


def processes_with_marker(marker: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if marker.encode() in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def test_serve_rejects_a_bad_config_naming_file_and_plugin(tmp_path: Path) -> None:
    config = tmp_path / "picker.yaml"
    config.write_text(
        yaml.safe_dump({"plugins": [{"type": "queue-scorer", "parameters": {"depth": 3}}]})
    )
    result = kv_picker("serve", "--config", str(config), timeout_s=30)
    assert result.returncode == 2
    assert str(config) in result.stderr and "queue-scorer" in result.stderr
    assert "depth" in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--workers", "0"], "--workers must be at least 1"),
        (["--worker", "2/2", "--worker-dir", "/nonexistent"], "bad --worker"),
        (["--worker", "0/2"], "--worker-dir"),
        (["--workers", "2", "--worker-ports", "9100"], "1 ports for 2 workers"),
        (["--workers", "2", "--worker-ports", "9100,9100"], "distinct"),
        (["--worker-ports", "9100,9101"], "need --workers"),
        (["--recycle-rss", "500"], "need --workers"),
    ],
)
def test_serve_refuses_bad_worker_arguments(args: list[str], message: str) -> None:
    result = kv_picker("serve", *args, timeout_s=30)
    assert result.returncode == 2
    assert message in result.stderr


def test_help_texts() -> None:
    for args in (["--help"], ["serve", "--help"], ["explain", "--help"]):
        result = kv_picker(*args, timeout_s=30)
        assert result.returncode == 0, (args, result.stderr)
        assert "usage" in result.stdout.lower()
    # The benchmark package's commands are listed, reached through their entry points.
    listing = kv_picker("--help", timeout_s=30).stdout
    assert all(name in listing for name in ("demo", "sim-endpoint", "bench"))


def test_an_extension_command_that_cannot_load_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from importlib.metadata import EntryPoint

    from kv_picker.cli import EXIT_USAGE, cmd_extension

    missing = EntryPoint("ghost", "kv_picker_ghost.commands:ghost", "kv_picker.commands")
    assert cmd_extension(missing, []) == EXIT_USAGE
    assert "kv-picker ghost: cannot load kv_picker_ghost.commands:ghost" in capsys.readouterr().err


def test_the_service_command_line_runs_without_the_benchmark_package(tmp_path: Path) -> None:
    # As in the service image: the import of kv_picker_bench fails, serve and explain work.
    blocker = tmp_path / "kv_picker_bench.py"
    blocker.write_text("raise ImportError('not installed in this image')\n")
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    listing = kv_picker("--help", timeout_s=30, env=env)
    assert listing.returncode == 0 and "serve" in listing.stdout
    assert "not available" in listing.stdout  # the commands it would add say why
    demo = kv_picker("demo", timeout_s=30, env=env)
    assert demo.returncode == 2 and "kv-picker[bench]" in demo.stderr


def test_explain_shows_every_scorer_for_every_endpoint(tmp_path: Path) -> None:
    config = tmp_path / "picker.yaml"
    config.write_text(
        yaml.safe_dump(
            {"endpoints": [{"address": f"10.1.0.{i}:8000"} for i in (1, 2, 3)], "seed": 1}
        )
    )
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"model": "m", "prompt": "hello " * 100}))
    result = kv_picker("explain", "--config", str(config), "--request", str(request), timeout_s=30)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    (profile,) = report["profiles"]
    assert profile["name"] == "default" == report["primary_profile"]
    assert len(profile["candidates"]) == 3
    assert set(profile["candidates"][0]["scores"]) == {
        "prefix-cache-scorer",
        "predicted-latency-scorer",
        "active-request-scorer",
        "recent-work-scorer",
    }
    assert profile["picked"][0] == profile["candidates"][0]["address"]
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    failed = kv_picker("explain", "--config", str(config), "--request", str(bad), timeout_s=30)
    assert failed.returncode == 1 and "400" in failed.stderr


@pytest.mark.parametrize("event_loop", ["asyncio", "uvloop"])
def test_serve_runs_until_sigterm_and_exits_cleanly(tmp_path: Path, event_loop: str) -> None:
    config = tmp_path / "picker.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "server": {
                    "host": "127.0.0.1",
                    "grpcPort": 0,
                    "metricsPort": 0,
                    "admin": {"port": 0},
                },
                "endpoints": [{"address": "127.0.0.1:9"}],
            }
        )
    )
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kv_picker",
            "serve",
            "--event-loop",
            event_loop,
            "--config",
            str(config),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert process.stdout is not None
        for line in process.stdout:  # bounded: the process logs its start within seconds
            if "serving ext_proc" in line:
                break
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=15) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(5)
        if process.stdout is not None:
            process.stdout.close()


def test_explain_with_scrape_uses_live_endpoints_only(tmp_path: Path) -> None:
    port = free_port()
    sim = ManagedProcess(
        "sim",
        [sys.executable, "-m", "kv_picker_bench.sim", "--port", str(port)],
        tmp_path / "sim.log",
    )
    try:
        sim.wait_until(lambda: http_get(f"http://127.0.0.1:{port}/health")[0] == 200, 30, "health")
        dead = f"127.0.0.1:{free_port()}"
        config = tmp_path / "picker.yaml"
        config.write_text(
            yaml.safe_dump({"endpoints": [{"address": f"127.0.0.1:{port}"}, {"address": dead}]})
        )
        request = tmp_path / "request.json"
        request.write_text(json.dumps({"model": "sim-model", "prompt": "hi " * 50}))
        result = kv_picker(
            "explain", "--config", str(config), "--request", str(request), "--scrape", timeout_s=60
        )
        assert result.returncode == 0, result.stderr
        (profile,) = json.loads(result.stdout)["profiles"]
        assert [row["address"] for row in profile["candidates"]] == [f"127.0.0.1:{port}"]
    finally:
        sim.stop()


def test_explain_infers_the_chat_path(tmp_path: Path) -> None:
    config = tmp_path / "picker.yaml"
    config.write_text(yaml.safe_dump({"endpoints": [{"address": "10.1.0.1:8000"}]}))
    request = tmp_path / "chat.json"
    request.write_text(json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}))
    result = kv_picker("explain", "--config", str(config), "--request", str(request), timeout_s=30)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["kind"] == "chat"


def test_sigterm_reports_not_serving_and_keeps_serving_for_the_shutdown_delay(
    tmp_path: Path,
) -> None:
    import time

    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    port = free_port()
    config = tmp_path / "picker.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "server": {
                    "host": "127.0.0.1",
                    "grpcPort": port,
                    "metricsPort": 0,
                    "admin": {"port": 0},
                    "shutdownDelay": "1500ms",
                },
                "endpoints": [{"address": "127.0.0.1:9"}],
            }
        )
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "kv_picker", "serve", "--config", str(config)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )

    def health() -> int:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=5
            )
            return int(reply.status)

    try:
        assert process.stdout is not None
        for line in process.stdout:  # bounded: the process logs its readiness within seconds
            if "ready:" in line:  # (after a scrape's time: the only endpoint is unreachable)
                break
        assert health() == health_pb2.HealthCheckResponse.SERVING
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        # Still answering on its port (new streams are taken), but telling checkers to go away.
        assert health() == health_pb2.HealthCheckResponse.NOT_SERVING
        assert process.poll() is None
        assert process.wait(timeout=15) == 0
        assert time.monotonic() - signalled >= 1.5
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(5)
        if process.stdout is not None:
            process.stdout.close()
