"""The supervisor's pieces (kv_picker.workers): merged metrics, each worker's config."""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kv_picker.config import load_config
from kv_picker.metrics import PickerMetrics
from kv_picker.plugins import builtin_registry
from kv_picker.workers import (
    MIN_WORKER_DRAIN_S,
    SALT_ENV,
    Supervisor,
    WorkerSpec,
    merge_expositions,
    parse_ports,
    parse_worker,
    worker_spec,
)


def exposition(requests: int, running: int, endpoint_waiting: float, latency_s: float) -> str:
    metrics = PickerMetrics(CollectorRegistry())
    metrics.requests.labels("m", "routed").inc(requests)
    metrics.running.set(running)
    metrics.endpoint_waiting.labels("10.0.0.1:8000").set(endpoint_waiting)
    metrics.request_seconds.observe(latency_s)
    return generate_latest(metrics.registry).decode()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_merged_metrics_sum_activity_and_keep_one_view_of_shared_state() -> None:
    a = exposition(requests=3, running=2, endpoint_waiting=4.0, latency_s=0.02)
    b = exposition(requests=5, running=1, endpoint_waiting=6.0, latency_s=3.0)
    merged = samples(merge_expositions([a, b]).decode())
    model = (("model", "m"), ("outcome", "routed"))
    assert merged[("kv_picker_requests_total", model)] == 8
    assert merged[("kv_picker_requests_running", ())] == 3  # each process's own: summed
    # Every worker scrapes the same endpoint: its signal is not doubled.
    assert merged[("kv_picker_endpoint_requests_waiting", (("endpoint", "10.0.0.1:8000"),))] == 6
    assert merged[("kv_picker_request_duration_seconds_count", ())] == 2
    assert merged[("kv_picker_request_duration_seconds_sum", ())] == pytest.approx(3.02)
    assert merged[("kv_picker_request_duration_seconds_bucket", (("le", "0.025"),))] == 1
    assert merged[("kv_picker_request_duration_seconds_bucket", (("le", "+Inf"),))] == 2
    created_a = samples(a)[("kv_picker_requests_created", model)]
    created_b = samples(b)[("kv_picker_requests_created", model)]
    assert merged[("kv_picker_requests_created", model)] == min(created_a, created_b)


def test_merging_one_exposition_changes_no_value() -> None:
    a = exposition(requests=3, running=2, endpoint_waiting=4.0, latency_s=0.02)
    assert samples(merge_expositions([a]).decode()) == samples(a)
    assert merge_expositions([]) == b""


def test_each_worker_runs_the_config_with_the_supervisors_ports(tmp_path: Path) -> None:
    path = tmp_path / "picker.yaml"
    path.write_text(
        "seed: 7\nserver: {grpcPort: 0, admin: {port: 0}}\n"
        "requestLog: {path: " + str(tmp_path / "requests.jsonl") + "}\n"
    )
    config = load_config(path, builtin_registry(include_entry_points=False))
    spec = WorkerSpec(1, 2, tmp_path, grpc_port=9102, admin_port=9104, salt="shared")
    applied = spec.apply(config)
    assert applied.server.grpc_port == 9102
    assert applied.server.admin.port == 9104
    assert applied.request_log is not None
    assert applied.request_log.path == str(tmp_path / "requests.jsonl") + ".worker-1"
    assert applied.request_log.salt == "shared"
    assert applied.seed == 8
    assert applied.server.shutdown_delay_s == MIN_WORKER_DRAIN_S  # the config's 0 raised
    assert spec.apply(applied.__class__()).request_log is None


@pytest.mark.parametrize("text", ["2/2", "-1/2", "x/2", "1", "1/"])
def test_a_bad_worker_argument_is_refused(text: str) -> None:
    with pytest.raises(ValueError):
        parse_worker(text)


def test_a_worker_argument_is_parsed() -> None:
    assert parse_worker("1/3") == (1, 3)


def test_a_worker_spec_needs_its_directory_and_reads_the_salt(tmp_path: Path) -> None:
    spec = worker_spec("1/2", str(tmp_path), 9102, 0, env={SALT_ENV: "s"})
    assert (spec.index, spec.count, spec.salt) == (1, 2, "s")
    assert spec.http_socket() == tmp_path / "worker-1.http"
    with pytest.raises(ValueError, match="worker-dir"):
        worker_spec("1/2", None, 9102, 0, env={})


def test_worker_ports_are_one_per_worker_and_distinct() -> None:
    assert parse_ports("9100, 9101", 2) == [9100, 9101]
    for bad in ("9100", "9100,9100", "0,1", "9100,x"):
        with pytest.raises(ValueError):
            parse_ports(bad, 2)


async def test_a_worker_past_the_memory_limit_is_recycled(tmp_path: Path) -> None:
    """Real worker processes; a limit every worker passes at once, a short minimum uptime."""
    path = tmp_path / "picker.yaml"
    path.write_text(
        "server: {host: 127.0.0.1, grpcPort: 0, metricsPort: 0, admin: {port: 0}}\n"
        "endpoints: [{address: '127.0.0.1:9'}]\n"
    )
    config = load_config(path, builtin_registry(include_entry_points=False))
    supervisor = Supervisor(config, str(path), 2, recycle_rss_bytes=1,
                            recycle_min_uptime_s=1.0, memory_check_s=0.2)  # fmt: skip
    await supervisor.start()
    try:
        for _ in range(100):
            if all(w.process is not None for w in supervisor.workers):
                break
            await asyncio.sleep(0.05)
        first = {w.index: w.process.pid for w in supervisor.workers if w.process}
        assert len(first) == 2

        def replaced(worker: Any) -> bool:
            # The count rises when the old process has exited; its replacement is being
            # started (an await) until ``process`` names a new one.
            process = worker.process
            return process is not None and process.pid != first[worker.index]

        for _ in range(200):
            done = [w for w in supervisor.workers if w.recycles]
            if sum(w.recycles for w in done) >= 2 and all(replaced(w) for w in done):
                break
            await asyncio.sleep(0.1)
        recycled = [w for w in supervisor.workers if w.recycles]
        assert recycled, "no worker was recycled"
        for worker in recycled:
            assert worker.process is not None and worker.process.pid != first[worker.index]
            assert worker.restarts == 0  # not counted as a crash
        # One at a time: never both stopping together.
        assert sum(w.recycling for w in supervisor.workers) <= 1
        url = f"http://127.0.0.1:{supervisor.metrics_port}/metrics"
        async with aiohttp.ClientSession() as session, session.get(url) as response:
            text = await response.text()
        assert "kv_picker_worker_recycles_total" in text
        assert 'kv_picker_worker_resident_memory_bytes{worker="0"}' in text
    finally:
        await supervisor.stop()
    assert all(w.process is None or w.process.returncode is not None for w in supervisor.workers)


def test_merged_counters_survive_a_worker_restart_and_a_missed_scrape(tmp_path: Path) -> None:
    """A restarted worker is not a counter reset to Prometheus: the old incarnation's counts
    stay in the sums (its gauges do not), as do the last counts of a worker that did not
    answer; a departed endpoint's series leave with it."""
    path = tmp_path / "picker.yaml"
    path.write_text("server: {host: 127.0.0.1, grpcPort: 0, metricsPort: 0, admin: {port: 0}}\n")
    config = load_config(path, builtin_registry(include_entry_points=False))
    supervisor = Supervisor(config, str(path), 2)

    def text(requests: int, running: int, picks: dict[str, int]) -> tuple[int, bytes]:
        metrics = PickerMetrics(CollectorRegistry())
        metrics.requests.labels("m", "routed").inc(requests)
        metrics.running.set(running)
        for endpoint, count in picks.items():
            metrics.picks.labels("default", endpoint).inc(count)
            metrics.endpoint_waiting.labels(endpoint).set(1)
        return 200, generate_latest(metrics.registry)

    def scrape(
        *answers: tuple[int, bytes] | None,
    ) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        replies = dict(enumerate(answers))

        async def ask(index: int, path: str) -> tuple[int, bytes] | None:
            assert path == "/metrics"
            return replies[index]

        supervisor._ask = ask  # type: ignore[method-assign]
        texts, carried = asyncio.run(supervisor._merged_counts())
        return samples(merge_expositions([*texts.values(), *carried]).decode())

    def set_pids(*pids: int) -> None:
        for worker, pid in zip(supervisor.workers, pids, strict=True):
            worker.process = SimpleNamespace(pid=pid, returncode=None)  # type: ignore[assignment]

    routed = ("kv_picker_requests_total", (("model", "m"), ("outcome", "routed")))
    running = ("kv_picker_requests_running", ())
    a, b = "10.0.0.1:8000", "10.0.0.2:8000"

    def picked(endpoint: str) -> tuple[str, tuple[tuple[str, str], ...]]:
        return ("kv_picker_picks_total", (("endpoint", endpoint), ("profile", "default")))

    set_pids(100, 200)
    first = scrape(text(5, 2, {a: 5}), text(3, 1, {a: 2, b: 1}))
    assert first[routed] == 8 and first[running] == 3
    # Worker 0 was recycled: its successor counts from 0, the sums do not go back.
    set_pids(101, 200)
    second = scrape(text(1, 1, {a: 1}), text(4, 1, {a: 2, b: 2}))
    assert second[routed] == 5 + 1 + 4 and second[running] == 2
    assert second[picked(a)] == 5 + 1 + 2
    # Worker 1 misses a scrape: its last counts stand (its gauges do not).
    third = scrape(text(2, 0, {a: 2}), None)
    assert third[routed] == 5 + 2 + 4 and third[running] == 0
    # Endpoint b left the pool: no worker has its series, so the old incarnations' go too.
    set_pids(101, 201)
    fourth = scrape(text(3, 0, {a: 3}), text(0, 0, {a: 1}))
    assert picked(b) not in fourth
    assert fourth[routed] == 5 + 4 + 3 + 0 and fourth[picked(a)] == 5 + 2 + 3 + 1
    supervisor.directory.rmdir()
