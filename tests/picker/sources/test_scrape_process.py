"""The child-process scraper: same results as scraping inline, a child that follows the endpoint
set, restarts when killed and never outlives the picker."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable

import pytest
from aiohttp import web

from kv_picker.endpoint import EndpointSpec
from kv_picker.metrics import PickerMetrics
from kv_picker.sources import scrape_process
from kv_picker.sources.scrape_process import ProcessScraper
from kv_picker.state.endpoints import EndpointStore

pytestmark = pytest.mark.timeout(60)


def exposition(waiting: int, running: int, kv: float) -> str:
    return (
        "# TYPE vllm:num_requests_running gauge\n"
        f'vllm:num_requests_running{{engine="0",model_name="m"}} {running}\n'
        "# TYPE vllm:num_requests_waiting gauge\n"
        f'vllm:num_requests_waiting{{engine="0",model_name="m"}} {waiting}\n'
        "# TYPE vllm:kv_cache_usage_perc gauge\n"
        f'vllm:kv_cache_usage_perc{{engine="0",model_name="m"}} {kv}\n'
        "# TYPE vllm:cache_config_info gauge\n"
        'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="2048"} 1.0\n'
        "# TYPE vllm:lora_requests_info gauge\n"
        'vllm:lora_requests_info{max_lora="4",running_lora_adapters="a,b",'
        'waiting_lora_adapters="c"} 17.0\n'
    )


class Endpoints:
    """Two HTTP servers on loopback: ``good`` serves an exposition it can change, ``bad`` 500."""

    def __init__(self) -> None:
        self.state = (3, 2, 0.25)
        self.runners: list[web.AppRunner] = []
        self.good = self.bad = ""

    async def start(self) -> None:
        async def good(request: web.Request) -> web.Response:
            return web.Response(text=exposition(*self.state))

        async def bad(request: web.Request) -> web.Response:
            return web.Response(status=500, text="broken")

        addresses = []
        for handler in (good, bad):
            app = web.Application()
            app.router.add_get("/metrics", handler)
            runner = web.AppRunner(app, access_log=None)
            await runner.setup()
            site = web.TCPSite(runner, "127.0.0.1", 0)
            await site.start()
            self.runners.append(runner)
            port = runner.addresses[0][1]
            addresses.append(f"127.0.0.1:{port}")
        self.good, self.bad = addresses

    async def stop(self) -> None:
        for runner in self.runners:
            await runner.cleanup()


@pytest.fixture
async def endpoints() -> AsyncIterator[Endpoints]:
    served = Endpoints()
    await served.start()
    yield served
    await served.stop()


async def wait_for(check: Callable[[], bool], what: str, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); it has exited all the same.
    with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as stat:
        return stat.read().split()[2] != "Z"
    return True


async def test_the_child_scrapes_into_the_store_and_follows_the_endpoint_set(
    endpoints: Endpoints,
) -> None:
    store = EndpointStore(time.monotonic)
    metrics = PickerMetrics()
    down = "127.0.0.1:9"  # discard port: nothing listens
    store.set_endpoints([EndpointSpec(a) for a in (endpoints.good, endpoints.bad, down)])
    good, bad, dead = (store.by_address[a] for a in (endpoints.good, endpoints.bad, down))
    store.set_ready(bad.id, True)  # so that its failure shows
    scraper = ProcessScraper(store, metrics, 0.05, 1.0)
    task = asyncio.create_task(scraper.run())
    try:
        store.request_done(good.id, 2.5)  # the picker's own measure, exported at each scrape
        added = time.monotonic()
        store.add_recent_prefill(good.id, 4096.0, 0.0)
        await wait_for(lambda: store.ready[good.id], "the good endpoint scraped")
        await wait_for(
            lambda: (
                metrics.registry.get_sample_value(
                    "kv_picker_endpoint_request_seconds", {"endpoint": endpoints.good}
                )
                == 2.5
            ),
            "the request duration exported",
        )
        recent = metrics.registry.get_sample_value(
            "kv_picker_endpoint_recent_prefill_tokens", {"endpoint": endpoints.good}
        )
        # Decayed by exp(-age / 30 s) at the scrape that exported it, at most this long after.
        oldest = 4096.0 * math.exp(-(time.monotonic() - added) / 30.0)
        assert recent is not None and oldest <= recent <= 4096.0
        assert (store.waiting[good.id], store.running[good.id]) == (3.0, 2.0)
        assert store.kv_usage[good.id] == 0.25 and store.num_gpu_blocks[good.id] == 2048
        lora = store.lora[good.id]
        assert lora is not None and lora.running == {"a", "b"} and lora.max_lora == 4
        await wait_for(lambda: not store.ready[bad.id], "the failing endpoint marked down")
        errors = metrics.scrape_errors
        await wait_for(
            lambda: (
                errors.labels(endpoints.bad).__dict__["_value"].get() > 0
                and errors.labels(down).__dict__["_value"].get() > 0
            ),
            "scrape errors counted",
        )
        assert not store.ready[dead.id]
        await wait_for(lambda: scraper.rounds >= 3, "rounds reported")

        # The set changes: results for the endpoint that left no longer land anywhere.
        store.set_endpoints([EndpointSpec(endpoints.good)])
        endpoints.state = (7, 1, 0.5)
        await wait_for(lambda: store.waiting[good.id] == 7.0, "a new reading")
        assert store.get(bad.id) is None or store.get(bad.id) is not bad

        # Killed, it is replaced and scraping goes on.
        pid = scraper.child_pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        await wait_for(lambda: scraper.children_started == 2, "a new child", 10.0)
        endpoints.state = (9, 1, 0.5)
        await wait_for(lambda: store.waiting[good.id] == 9.0, "scrapes after the restart")
        pid = scraper.child_pid
        assert pid is not None
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert not alive(pid)  # stopping the scraper ends its child


async def test_reload_settings_reach_the_child(endpoints: Endpoints) -> None:
    store = EndpointStore(time.monotonic)
    store.set_endpoints([EndpointSpec(endpoints.good)])
    scraper = ProcessScraper(store, PickerMetrics(), 0.05, 1.0, path="/nothing-here")
    task = asyncio.create_task(scraper.run())
    try:
        (good,) = store.all()
        await wait_for(lambda: scraper.rounds >= 2, "rounds")
        assert not store.ready[good.id]  # 404 on that path
        scraper.configure(0.05, 1.0, "/metrics")  # what PickerApp.reload does
        await wait_for(lambda: store.ready[good.id], "the new path used")
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def test_the_child_exits_when_the_picker_goes_away() -> None:
    with subprocess.Popen(
        [sys.executable, "-m", scrape_process.__name__],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    ) as child:
        assert child.stdin is not None and child.stdout is not None
        child.stdin.write(b'[0.05, 1.0, "/metrics", [[1, "127.0.0.1:9"]]]\n')
        child.stdin.flush()
        assert child.stdout.readline().startswith(b"[1, ")  # it scraped (and failed)
        child.stdin.close()  # what the picker's death does to the pipe
        assert child.wait(timeout=30) == 0
