"""``kv-picker serve --workers 2`` through real Envoy: both workers serve, they route as one
picker, a worker that dies is started again, and the supervisor takes its workers along."""

from __future__ import annotations

import asyncio
import http.client
import os
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kv_picker_bench.localstack import LocalStack, http_get
from tests.integration.conftest import post

SERVED_BY = "x-kv-picker-sim-endpoint"
ROUTED = "kv_picker_requests_total{model=sim-model,outcome=routed}"
CUT = -1  # a response whose body was cut off


def children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(p) for p in text.split()]


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return []


def workers_of(stack: LocalStack) -> dict[int, int]:
    """Worker index -> pid."""
    assert stack.picker is not None
    found = {}
    for pid in children(stack.picker.process.pid):
        argv = cmdline(pid)
        if "--worker" in argv:
            found[int(argv[argv.index("--worker") + 1].split("/")[0])] = pid
    return found


def worker_dir(stack: LocalStack) -> Path:
    argv = cmdline(next(iter(workers_of(stack).values())))
    return Path(argv[argv.index("--worker-dir") + 1])


def worker_samples(stack: LocalStack, index: int) -> dict[str, float]:
    """A worker's own /metrics (over its Unix socket), as name{labels} -> value."""

    async def get() -> str:
        connector = aiohttp.UnixConnector(path=str(worker_dir(stack) / f"worker-{index}.http"))
        async with (
            aiohttp.ClientSession(connector=connector) as session,
            session.get("http://worker/metrics") as response,
        ):
            return await response.text()

    return flatten(asyncio.run(get()))


def flatten(text: str) -> dict[str, float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}"] = s.value
    return out


def merged_samples(stack: LocalStack) -> dict[str, float]:
    return flatten(http_get(f"http://127.0.0.1:{stack.picker_metrics_port}/metrics")[1].decode())


def wait_for(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"no {what} after {timeout_s} s")
        time.sleep(0.05)


def burst(stack: LocalStack, count: int, tag: str) -> list[int]:
    """``count`` requests at once (32 connections), each with a prompt of its own."""

    def one(i: int) -> int:
        prompt = f"{tag} request {i}: " + "words of a long prompt " * 200
        body = {"model": "sim-model", "prompt": prompt, "max_tokens": 40}
        try:
            return post(stack.url + "/v1/completions", body).status
        except (http.client.IncompleteRead, ConnectionError):
            # A response whose body the picker streamed (the GIE contract) is cut when that
            # picker dies: Envoy resets the stream after the status was sent.
            return CUT

    with ThreadPoolExecutor(32) as pool:
        return list(pool.map(one, range(count)))


# Routing on the prefix alone: a request whose prefix an endpoint was sent goes there, whatever
# the load; one whose prefix no worker knows goes to a random endpoint.
PREFIX_ONLY = {"plugins": [{"type": "prefix-cache-scorer"}]}


@pytest.fixture(scope="module")
def stack() -> Iterator[LocalStack]:
    with LocalStack(
        sims=4, picker_config=PREFIX_ONLY, picker_args=["--workers", "2"], time_scale=0.05
    ) as local:
        yield local


def test_both_workers_serve_and_learn_each_others_picks(stack: LocalStack) -> None:
    statuses = burst(stack, 64, "learn")
    assert statuses == [200] * 64
    served = [worker_samples(stack, i).get(ROUTED, 0) for i in range(2)]
    # Envoy balances the streams over the workers' own ports by least requests.
    assert all(count >= 16 for count in served), served
    assert sum(served) == 64
    merged = merged_samples(stack)
    assert merged[ROUTED] == 64
    assert merged["kv_picker_workers{state=up}"] == 2
    assert [merged[f"kv_picker_worker_requests_total{{worker={i}}}"] for i in range(2)] == served

    # Each worker's approximate index holds every pick, its own and the other's.
    key = "kv_picker_prefix_index_keys{plugin=prefix-cache-scorer}"
    wait_for(
        lambda: worker_samples(stack, 0)[key] == worker_samples(stack, 1)[key],
        5.0,
        "equal approximate indexes",
    )
    assert worker_samples(stack, 0)[key] >= 64  # at least one block per distinct prompt
    # Nothing is left in flight in either worker's view once all requests ended.
    for i in range(2):
        in_flight = [v for k, v in worker_samples(stack, i).items()
                     if k.startswith("kv_picker_endpoint_in_flight_requests")]  # fmt: skip
        wait_for(lambda i=i: sum(  # type: ignore[misc]
            v for k, v in worker_samples(stack, i).items()
            if k.startswith("kv_picker_endpoint_in_flight_requests")) == 0, 5.0,
            f"worker {i}'s in-flight gauges back at 0 (were {in_flight})")  # fmt: skip


def test_a_prefix_stays_on_one_endpoint_whichever_worker_routes_it(stack: LocalStack) -> None:
    """Sequential requests sharing a long prefix, each on a new Envoy connection: both workers
    route some of them, and all go where the first went."""
    prefix = "a system prompt shared by this conversation " * 150
    before = [worker_samples(stack, i).get(ROUTED, 0) for i in range(2)]
    served_by = set()
    # Keep the other Envoy connections busy so consecutive requests use different ones.
    with ThreadPoolExecutor(16) as background:
        noise = background.submit(burst, stack, 96, "noise")
        for i in range(24):
            body = {"model": "sim-model", "prompt": prefix + f" turn {i}", "max_tokens": 2}
            reply = post(stack.url + "/v1/completions", body)
            assert reply.status == 200
            served_by.add(reply.headers[SERVED_BY])
        assert noise.result() == [200] * 96
    after = [worker_samples(stack, i).get(ROUTED, 0) for i in range(2)]
    assert all(a > b for a, b in zip(after, before, strict=True))
    assert len(served_by) == 1, served_by


def test_the_endpoints_see_one_pickers_scrape_rate(stack: LocalStack) -> None:
    """Each worker scrapes every endpoint half as often and shares what it read."""

    def scrapes() -> float:
        return sum(m["kv_picker_sim_metrics_scrapes_total"] for m in stack.sim_metrics().values())

    before, started = scrapes(), time.monotonic()
    time.sleep(3.0)
    per_endpoint_s = (scrapes() - before - 4) / 4 / (time.monotonic() - started)  # 4 reads ours
    # The config's 100 ms interval: 10 scrapes a second, not 20 (each worker at 100 ms).
    assert 5 <= per_endpoint_s <= 14, per_endpoint_s
    # And every worker holds fresh signals of every endpoint.
    for i in range(2):
        assert worker_samples(stack, i)["kv_picker_endpoints{state=ready}"] == 4


def test_a_config_change_reaches_every_worker(stack: LocalStack) -> None:
    key = "kv_picker_config_reloads_total{result=applied}"
    before = merged_samples(stack)[key]
    # Same routing, another spelling: the file changes, so each worker reloads it.
    stack.write_picker_config({**PREFIX_ONLY, "seed": 3})
    wait_for(lambda: merged_samples(stack)[key] == before + 2, 10.0, "a reload in each worker")
    assert all(worker_samples(stack, i)[key] >= 1 for i in range(2))
    assert burst(stack, 8, "after-reload") == [200] * 8


def test_a_killed_worker_is_started_again(stack: LocalStack) -> None:
    """Killed under load: only the streams it held fail (Envoy ejects its port at once, the
    other worker takes the rest), and the supervisor starts it again."""
    old = workers_of(stack)
    with ThreadPoolExecutor(1) as background:
        load = background.submit(burst, stack, 400, "kill")
        time.sleep(0.5)
        os.kill(old[0], signal.SIGKILL)
        statuses = load.result()
    failed = [s for s in statuses if s != 200]
    assert set(failed) <= {500, CUT}
    assert len(failed) <= 32 + 4, len(failed)  # at most the 32 in flight, and a few more
    wait_for(lambda: workers_of(stack).get(0, old[0]) != old[0], 10.0, "new worker 0")
    url = f"http://127.0.0.1:{stack.picker_metrics_port}/readyz"
    wait_for(lambda: http_get(url)[0] == 200, 20.0, "ready again")
    assert workers_of(stack)[1] == old[1]
    # The new worker starts with a copy of what the other learned, not an empty index.
    key = "kv_picker_prefix_index_keys{plugin=prefix-cache-scorer}"
    learned = worker_samples(stack, 1)[key]
    assert learned > 0
    wait_for(lambda: worker_samples(stack, 0).get(key) == learned, 5.0, "a copy of the index")
    assert burst(stack, 32, "after-restart") == [200] * 32
    assert merged_samples(stack)["kv_picker_worker_restarts_total{}"] == 1


def test_recycled_workers_lose_no_request() -> None:
    """Workers recycled for their memory (a limit they all pass), one at a time, under load:
    each drains behind Envoy's health checks, so not one request fails; and the merged counters
    keep what the recycled workers counted (they never go down)."""
    args = ["--workers", "2", "--recycle-rss", "1", "--recycle-min-uptime", "2"]
    with LocalStack(sims=4, picker_config=PREFIX_ONLY, picker_args=args, time_scale=0.05) as local:
        statuses: list[int] = []
        routed: list[float] = []
        recycles = 0.0
        # Under load until two workers were recycled (each waits out its minimum uptime, then
        # drains and starts again: seconds on a slow machine); bounded.
        deadline = time.monotonic() + 45.0
        while recycles < 2 and time.monotonic() < deadline:
            statuses += burst(local, 32, "recycle")
            samples = merged_samples(local)
            routed.append(samples.get(ROUTED, 0.0))
            recycles = samples.get("kv_picker_worker_recycles_total{}", 0.0)
        assert recycles >= 2, recycles
        assert statuses == [200] * len(statuses), sorted(set(statuses))
        assert routed == sorted(routed), routed
        # Every request was routed once; a recycled worker's last few may go uncounted.
        assert 0.95 * len(statuses) <= routed[-1] <= len(statuses), (routed[-1], len(statuses))


def test_a_picker_started_again_behind_envoy_serves_at_once() -> None:
    # The live benchmark starts a picker per policy behind one Envoy. Envoy health-checks the
    # workers' ports and ejects a port that refused a connection during the restart; the stack
    # must not hand over before Envoy sees the workers again, or the first requests get 500s.
    with LocalStack(sims=2, picker_args=["--workers", "2"], time_scale=0.05) as local:
        assert burst(local, 8, "before") == [200] * 8
        local.start_picker()
        assert local.envoy_sees_picker_healthy()
        assert burst(local, 32, "after") == [200] * 32


@pytest.fixture
def own_stack() -> Iterator[LocalStack]:
    with LocalStack(sims=2, picker_args=["--workers", "2"], start_envoy=False) as local:
        yield local


def test_sigterm_drains_and_stops_every_worker(own_stack: LocalStack) -> None:
    assert own_stack.picker is not None
    pids = list(workers_of(own_stack).values())
    assert len(pids) == 2
    own_stack.picker.process.send_signal(signal.SIGTERM)  # the supervisor alone
    assert own_stack.picker.process.wait(20) == 0
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids)


def test_a_killed_supervisor_takes_its_workers_along(own_stack: LocalStack) -> None:
    assert own_stack.picker is not None
    pids = list(workers_of(own_stack).values())
    own_stack.picker.process.send_signal(signal.SIGKILL)
    own_stack.picker.process.wait(5)
    wait_for(
        lambda: not any(Path(f"/proc/{pid}").exists() and _running(pid) for pid in pids),
        10.0,
        "workers gone",
    )


def _running(pid: int) -> bool:
    """Alive and not a zombie (an orphan is reaped by init, or by whoever adopted it)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"
