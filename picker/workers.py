"""``kv-picker serve --workers N``: N picker processes on one port, and the supervisor that runs them.

One Python process schedules on one core. With ``--workers N`` the command becomes a supervisor
that starts N workers, each a whole picker (:class:`~kv_picker.app.PickerApp`):

```
supervisor (this module)                            server.metricsPort: /metrics /healthz /readyz
  ├── worker 0 ─┐ ext_proc + health on server.grpcPort, admin on server.admin.port, all bound
  ├── worker 1 ─┤ with SO_REUSEPORT: the kernel spreads new connections (Envoy's ext_proc
  └── ...      ─┘ streams ride them) over the workers
        │ each: its own KV-event subscriptions (every worker sees every endpoint), /metrics
        │ /healthz /readyz on a Unix socket in the run directory, and
        └ kv_picker.peers: its picks, in-flight counts, queued prefill and scrape results
          sent to the others (each scrapes every endpoint N times less often)
```

Routing stays that of one picker: what a pick teaches the approximate index and the speculative
holders, and the in-flight and prefill counts, reach the other workers within about a
millisecond (:mod:`kv_picker.peers`). The supervisor serves the metrics port: ``/metrics``
merges the workers' expositions into one (counters and histograms summed; gauges of the process
summed; gauges of the shared view, such as endpoint signals and index sizes, the largest of the
workers'), ``/readyz`` is ready when every worker is, ``/healthz`` reports the workers too.
Merged counters never go down: what a worker that exited (or was recycled) had counted at the
supervisor's last scrape of it stays in the sums, and a worker that misses a scrape counts as
its last answer, so a restart is not a counter reset to Prometheus (whose ``rate()`` would read
one as a burst of the whole remaining count).

With ``--worker-ports P1,...,PN`` worker i also listens on Pi alone, so that a gateway that
lists those ports as endpoints balances streams over the workers itself (Envoy's least-request
balancing, per stream) instead of relying on the kernel's spread of its few connections.

With ``--recycle-rss MB`` a worker whose resident memory passes MB is stopped (it drains) and
started again, one worker at a time: a bound on what a slow leak in a library (grpcio's, see
the README's soak) can cost a long-running pod.

A worker that exits unexpectedly is started again (after 1 s, doubling to 30 s while it keeps
failing); its peers drop its counts when it falls silent, and once ready it gets a copy of what
they learned (:mod:`kv_picker.peers`). SIGTERM or SIGINT is passed to every
worker, each drains as a single picker does, and the supervisor exits when they have. Workers
die with the supervisor (``PR_SET_PDEATHSIG``), so a killed supervisor leaves no process behind.

Costs of N workers: N times the KV-event subscriptions (and, with the Redis index backend, the
same writes from every worker) and the Kubernetes watches, N copies of the indexes, and each
pick, release, first byte and scrape applied by every other worker too.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import os
import secrets
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Container, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from kv_picker.config import PickerConfig

log = logging.getLogger(__name__)

SALT_ENV = "KV_PICKER_WORKER_SALT"
# Gauges of one process's own activity: the pod's figure is the workers' sum. Every other gauge
# describes state each worker holds a copy of (endpoint signals, index sizes, saturation): the
# largest copy is shown.
SUMMED_GAUGES = frozenset(
    {
        "kv_picker_requests_running",
        "kv_picker_requests_pending",
        "kv_picker_asyncio_tasks",
        "process_resident_memory_bytes",
        "process_virtual_memory_bytes",
        "process_open_fds",
    }
)
_RESTART_BACKOFF_S = (1.0, 30.0)
# A stopping worker (recycled, or the pod going away) reports NOT_SERVING this long before it
# refuses streams: a gateway health-checking each worker's port every second (the generated
# Envoy configs do) stops sending it streams first, so none is refused.
MIN_WORKER_DRAIN_S = 1.5
_COUNTS_REFRESH_S = 5.0  # how often the supervisor reads the workers' counts between scrapes
_HEALTHY_AFTER_S = 60.0  # a worker up this long starts its backoff again from the shortest


@dataclass(frozen=True)
class WorkerSpec:
    """What one worker is told by its supervisor (the hidden ``serve --worker`` arguments).

    Attributes:
        index: this worker's index, ``0 <= index < count``.
        count: the number of workers.
        directory: the supervisor's private run directory (peer sockets, HTTP sockets).
        grpc_port: the ext_proc port every worker binds (SO_REUSEPORT).
        admin_port: the admin port every worker binds (0: admin off).
        salt: the request log's salt when the config sets none (one for all workers, so
            their logs share block ids).
        own_port: a port of this worker's alone, beside the shared one (0: none), for a
            gateway that balances streams over the workers itself (``--worker-ports``).
    """

    index: int
    count: int
    directory: Path
    grpc_port: int
    admin_port: int
    salt: str | None = None
    own_port: int = 0

    def http_socket(self) -> Path:
        return http_socket(self.directory, self.index)

    def apply(self, config: PickerConfig) -> PickerConfig:
        """The config as this worker runs it: the supervisor's ports, a request-log file of
        its own (``<path>.worker-<index>``) with the shared salt, its own seed, and a drain
        delay of at least ``MIN_WORKER_DRAIN_S``."""
        server = config.server
        server = dataclasses.replace(
            server,
            grpc_port=self.grpc_port,
            admin=dataclasses.replace(server.admin, port=self.admin_port),
            shutdown_delay_s=max(server.shutdown_delay_s, MIN_WORKER_DRAIN_S),
        )
        request_log = config.request_log
        if request_log is not None:
            request_log = dataclasses.replace(
                request_log,
                path=f"{request_log.path}.worker-{self.index}",
                salt=request_log.salt or self.salt,
            )
        seed = config.seed + self.index if config.seed is not None else None
        return dataclasses.replace(config, server=server, request_log=request_log, seed=seed)


def http_socket(directory: Path, index: int) -> Path:
    """Where worker ``index`` serves /metrics, /healthz and /readyz."""
    return directory / f"worker-{index}.http"


def parse_worker(text: str) -> tuple[int, int]:
    """``INDEX/COUNT`` -> (index, count)."""
    index_text, _, count_text = text.partition("/")
    index, count = int(index_text), int(count_text)
    if not 0 <= index < count:
        raise ValueError(f"worker {text!r}: the index must be in [0, count)")
    return index, count


def _free_port(host: str) -> int:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    libc.prctl(pr_set_pdeathsig, signal.SIGTERM)


# -- metrics --------------------------------------------------------------------------------


def merge_expositions(texts: Iterable[str]) -> bytes:
    """The workers' Prometheus expositions as one (see the module docstring)."""
    families: dict[str, Metric] = {}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(
                    family.name, family.documentation, family.type, family.unit
                )
                values[family.name] = {}
            samples = values[family.name]
            for sample in family.samples:
                key = (sample.name, tuple(sorted(sample.labels.items())))
                old = samples.get(key)
                samples[key] = sample.value if old is None else _combine(family, sample.name,
                                                                         old, sample.value)  # fmt: skip
    for name, family in families.items():
        for (sample_name, labels), value in values[name].items():
            family.add_sample(sample_name, dict(labels), value)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families.values())))
    return generate_latest(registry)


_MONOTONIC_TYPES = frozenset({"counter", "histogram", "summary"})


def monotonic_part(text: str, endpoints: Container[str] | None = None) -> str:
    """The counters, histograms and summaries of an exposition (what must not go backwards),
    without the series of endpoints not in ``endpoints`` (None: all kept)."""
    kept = []
    for family in text_string_to_metric_families(text):
        if family.type not in _MONOTONIC_TYPES:
            continue
        if endpoints is not None:
            samples = [sample for sample in family.samples
                       if sample.labels.get("endpoint", "") in endpoints
                       or "endpoint" not in sample.labels]  # fmt: skip
            family.samples = samples
        kept.append(family)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(kept))
    return generate_latest(registry).decode()


def endpoint_labels(texts: Iterable[str]) -> set[str]:
    """The ``endpoint`` label values of expositions (the endpoints a picker knows now)."""
    found: set[str] = set()
    for text in texts:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                endpoint = sample.labels.get("endpoint")
                if endpoint is not None:
                    found.add(endpoint)
    return found


def requests_routed(text: str) -> float:
    """The sum of ``kv_picker_requests_total`` over its labels in one exposition."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("kv_picker_requests_total{"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _combine(family: Metric, sample_name: str, old: float, new: float) -> float:
    if sample_name.endswith("_created") or sample_name == "process_start_time_seconds":
        return min(old, new)
    if family.type == "gauge" and family.name not in SUMMED_GAUGES:
        if math.isnan(old):
            return new
        return old if new < old else new
    return old + new


class _Families(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self._families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self._families)


# -- the supervisor -------------------------------------------------------------------------


class _Worker:
    def __init__(self, index: int) -> None:
        self.index = index
        self.process: asyncio.subprocess.Process | None = None
        self.started_s = 0.0
        self.restarts = 0
        self.recycles = 0
        self.recycling = False  # told to stop for its memory: start it again at once
        self.backoff_s = _RESTART_BACKOFF_S[0]


class Supervisor:
    """Runs N workers and serves the merged metrics port (see the module docstring).

    Args:
        config: the validated config (its server section gives the ports).
        config_path: the config file the workers load and watch (None: the built-in default).
        workers: how many worker processes.
        worker_args: arguments passed on to each worker's ``serve`` (e.g. ``--event-loop``).
        log_level: the workers' ``--log-level``.
    """

    def __init__(
        self,
        config: PickerConfig,
        config_path: str | None,
        workers: int,
        worker_args: Sequence[str] = (),
        log_level: str = "info",
        worker_ports: Sequence[int] = (),
        recycle_rss_bytes: int = 0,
        recycle_min_uptime_s: float = 60.0,
        memory_check_s: float = 1.0,
    ) -> None:
        if workers < 2:
            raise ValueError("a supervisor needs at least 2 workers")
        self.recycle_rss_bytes = recycle_rss_bytes
        self.recycle_min_uptime_s = recycle_min_uptime_s
        self.memory_check_s = memory_check_s
        if worker_ports and len(worker_ports) != workers:
            raise ValueError(f"{len(worker_ports)} worker ports for {workers} workers")
        self.worker_ports = list(worker_ports)
        self.config = config
        self.config_path = config_path
        self.worker_args = list(worker_args)
        self.log_level = log_level
        self.workers = [_Worker(i) for i in range(workers)]
        server = config.server
        self.grpc_port = server.grpc_port or _free_port(server.host)
        admin = server.admin
        self.admin_port = (admin.port or _free_port(admin.host)) if admin.enabled else 0
        self.metrics_port = 0
        self.directory = Path(tempfile.mkdtemp(prefix="kv-picker-"))  # 0700
        self.salt = secrets.token_hex(16)
        self.stopping = False
        # Per worker index: (pid, last /metrics answer) of the incarnation last scraped; and
        # the counters of incarnations gone, merged (see the module docstring).
        self._last_seen: dict[int, tuple[int, str]] = {}
        self._retired = ""
        self._following: set[asyncio.Task[None]] = set()
        self._runner: web.AppRunner | None = None
        self._tasks: list[asyncio.Task[None]] = []

    # -- lifecycle --------------------------------------------------------------------------

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics_handler)
        app.router.add_get("/healthz", self._healthz_handler)
        app.router.add_get("/readyz", self._readyz_handler)
        runner = self._runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        server = self.config.server
        site = web.TCPSite(runner, server.host, server.metrics_port)
        await site.start()
        bound = [address for address in runner.addresses if isinstance(address, tuple)]
        self.metrics_port = int(bound[0][1]) if bound else server.metrics_port
        for worker in self.workers:
            self._tasks.append(
                asyncio.create_task(self._keep(worker), name=f"worker-{worker.index}")
            )
        if self.recycle_rss_bytes > 0:
            self._tasks.append(asyncio.create_task(self._watch_memory(), name="worker-memory"))
        self._tasks.append(asyncio.create_task(self._refresh_counts(), name="worker-counts"))
        log.info(
            "kv-picker supervisor: %d workers on ext_proc port %d, admin port %s, metrics on :%d",
            len(self.workers),
            self.grpc_port,
            self.admin_port or "off",
            self.metrics_port,
        )

    async def stop(self, timeout_s: float | None = None) -> None:
        """SIGTERM every worker, wait for them to drain, then clean up."""
        self.stopping = True
        server = self.config.server
        if timeout_s is None:  # the workers' drain delay, their grace, and a margin
            timeout_s = server.shutdown_delay_s + server.drain_timeout_s + 10.0
        for worker in self.workers:
            if worker.process is not None and worker.process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    worker.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for worker in self.workers:
            process = worker.process
            if process is None:
                continue
            try:
                await asyncio.wait_for(process.wait(), max(0.1, deadline - time.monotonic()))
            except TimeoutError:
                log.warning("worker %d did not stop in time: killed", worker.index)
                with contextlib.suppress(ProcessLookupError):
                    process.kill()
                await process.wait()
        tasks = [*self._tasks, *self._following]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self._runner is not None:
            await self._runner.cleanup()
        shutil.rmtree(self.directory, ignore_errors=True)

    def _argv(self, worker: _Worker) -> list[str]:
        argv = [sys.executable, "-m", "kv_picker", "--log-level", self.log_level, "serve",
                *self.worker_args, "--worker", f"{worker.index}/{len(self.workers)}",
                "--worker-dir", str(self.directory), "--grpc-port", str(self.grpc_port),
                "--admin-port", str(self.admin_port)]  # fmt: skip
        if self.worker_ports:
            argv += ["--worker-port", str(self.worker_ports[worker.index])]
        if self.config_path is not None:
            argv += ["--config", self.config_path]
        return argv

    async def _keep(self, worker: _Worker) -> None:
        """Run the worker; start it again when it exits while the supervisor is not stopping."""
        env = {**os.environ, SALT_ENV: self.salt}
        preexec = _die_with_parent if sys.platform == "linux" else None
        while not self.stopping:
            http_socket(self.directory, worker.index).unlink(missing_ok=True)
            worker.process = await asyncio.create_subprocess_exec(
                *self._argv(worker), env=env, preexec_fn=preexec, stdin=asyncio.subprocess.DEVNULL
            )
            worker.started_s = time.monotonic()
            code = await worker.process.wait()
            if self.stopping:
                return
            if worker.recycling:  # it drained as asked: its replacement starts now
                worker.recycling = False
                worker.recycles += 1
                continue
            up_s = time.monotonic() - worker.started_s
            if up_s >= _HEALTHY_AFTER_S:
                worker.backoff_s = _RESTART_BACKOFF_S[0]
            log.error("worker %d exited with %s after %.1f s; starting it again in %.0f s",
                      worker.index, code, up_s, worker.backoff_s)  # fmt: skip
            await asyncio.sleep(worker.backoff_s)
            worker.backoff_s = min(worker.backoff_s * 2, _RESTART_BACKOFF_S[1])
            worker.restarts += 1

    async def _watch_memory(self) -> None:
        """Recycle a worker whose resident memory passed ``recycle_rss_bytes``: SIGTERM (it
        drains as a stopping picker does), then a new one, which gets a copy of what the others
        learned. One at a time, only while every worker has been ready for two checks in a row
        (a replacement must be serving, and the gateway must have seen it healthy, before
        another worker stops), and none younger than ``recycle_min_uptime_s``."""
        ready_before = False
        while True:
            await asyncio.sleep(self.memory_check_s)
            if self.stopping or any(w.recycling for w in self.workers):
                ready_before = False
                continue
            answers = await self._ask_all("/readyz")
            ready_now = all(a is not None and a[0] == 200 for a in answers)
            steady, ready_before = ready_before and ready_now, ready_now
            if not steady:
                continue
            now = time.monotonic()
            over = []  # (resident bytes, worker) of those past the limit and old enough
            for worker in self.workers:
                process = worker.process
                if process is None or process.returncode is not None:
                    continue
                rss = resident_bytes(process.pid)
                if rss > self.recycle_rss_bytes and (
                    now - worker.started_s >= self.recycle_min_uptime_s
                ):
                    over.append((rss, worker))
            if over:
                rss, worker = max(over, key=lambda item: item[0])  # the largest first
                log.warning("worker %d holds %.0f MB (limit %.0f MB): recycling it",
                            worker.index, rss / 2**20, self.recycle_rss_bytes / 2**20)  # fmt: skip
                worker.recycling = True
                if worker.process is not None:
                    with contextlib.suppress(ProcessLookupError):
                        worker.process.send_signal(signal.SIGTERM)
                    follow = asyncio.create_task(self._follow_drain(worker))
                    self._following.add(follow)
                    follow.add_done_callback(self._following.discard)

    # -- HTTP -------------------------------------------------------------------------------

    async def _ask(self, index: int, path: str) -> tuple[int, bytes] | None:
        """GET a worker's path over its Unix socket (None: it did not answer)."""
        connector = aiohttp.UnixConnector(path=str(http_socket(self.directory, index)))
        try:
            async with (
                aiohttp.ClientSession(
                    connector=connector, timeout=aiohttp.ClientTimeout(total=2.0)
                ) as session,
                session.get(f"http://worker{path}") as response,
            ):
                return response.status, await response.read()
        except (aiohttp.ClientError, OSError, TimeoutError):
            return None

    async def _ask_all(self, path: str) -> list[tuple[int, bytes] | None]:
        return list(await asyncio.gather(*(self._ask(w.index, path) for w in self.workers)))

    # -- counters across worker incarnations ----------------------------------------------------

    def _pid(self, worker: _Worker) -> int:
        process = worker.process
        return process.pid if process is not None and process.returncode is None else -1

    def _note(self, worker: _Worker, pid: int, answer: tuple[int, bytes] | None) -> str | None:
        """Take a worker's /metrics answer, asked of incarnation ``pid``; retire the previous
        incarnation's last counts when it is gone. Returns the exposition, if it answered."""
        seen = self._last_seen.get(worker.index)
        if seen is not None and seen[0] != self._pid(worker):  # that incarnation is gone
            self._retired = monotonic_part(merge_expositions([self._retired, seen[1]]).decode())
            del self._last_seen[worker.index]
        if answer is None or answer[0] != 200 or pid != self._pid(worker):
            return None  # no answer, or one from an incarnation that ended meanwhile
        text = answer[1].decode()
        self._last_seen[worker.index] = (pid, text)
        return text

    async def _ask_counts(self, worker: _Worker) -> str | None:
        pid = self._pid(worker)
        return self._note(worker, pid, await self._ask(worker.index, "/metrics"))

    async def _refresh_counts(self) -> None:
        """Every few seconds, the workers' counts: what a worker that dies had counted is
        known to within this period, not only to the last scrape."""
        while True:
            await asyncio.sleep(_COUNTS_REFRESH_S)
            try:
                await asyncio.gather(*(self._ask_counts(worker) for worker in self.workers))
            except Exception:  # a worker's exposition we cannot parse: try again next time
                log.exception("reading the workers' counts failed")

    async def _follow_drain(self, worker: _Worker) -> None:
        """A recycled worker's counts, often, until it exits (it serves while it drains)."""
        pid = self._pid(worker)
        while pid != -1 and self._pid(worker) == pid:
            try:
                await self._ask_counts(worker)
            except Exception:
                log.exception("reading worker %d's counts failed", worker.index)
                return
            await asyncio.sleep(0.2)

    async def _merged_counts(self) -> tuple[dict[int, str], list[str]]:
        """Each worker's exposition that answered, and what keeps the sums from going down:
        the retired incarnations' counters and the last counters of a worker that did not
        answer."""
        answered = await asyncio.gather(*(self._ask_counts(worker) for worker in self.workers))
        texts: dict[int, str] = {}
        frozen: list[str] = []
        for worker, text in zip(self.workers, answered, strict=True):
            if text is not None:
                texts[worker.index] = text
            elif (seen := self._last_seen.get(worker.index)) is not None:
                frozen.append(monotonic_part(seen[1]))  # alive, late: its last counts stand
        if self._retired and texts:
            # An endpoint gone from the pool leaves the exposition (the workers drop its series).
            self._retired = monotonic_part(self._retired, endpoint_labels(texts.values()))
        return texts, [self._retired, *frozen]

    async def _metrics_handler(self, request: web.Request) -> web.Response:
        texts, carried = await self._merged_counts()
        up = len(texts)
        restarts = sum(worker.restarts for worker in self.workers)
        lines = [
            "# HELP kv_picker_workers Worker processes, by state (up: answered this scrape).",
            "# TYPE kv_picker_workers gauge",
            f'kv_picker_workers{{state="up"}} {up}',
            f'kv_picker_workers{{state="down"}} {len(self.workers) - up}',
            "# HELP kv_picker_worker_restarts_total Worker processes started again after they "
            "exited.",
            "# TYPE kv_picker_worker_restarts_total counter",
            f"kv_picker_worker_restarts_total {restarts}",
            "# HELP kv_picker_worker_recycles_total Workers stopped and started again because "
            "their resident memory passed --recycle-rss.",
            "# TYPE kv_picker_worker_recycles_total counter",
            f"kv_picker_worker_recycles_total {sum(w.recycles for w in self.workers)}",
            "# HELP kv_picker_worker_resident_memory_bytes Each worker's resident memory.",
            "# TYPE kv_picker_worker_resident_memory_bytes gauge",
        ]
        for worker in self.workers:
            process = worker.process
            if process is not None and process.returncode is None:
                lines.append(f'kv_picker_worker_resident_memory_bytes{{worker="{worker.index}"}} '
                             f"{resident_bytes(process.pid)}")  # fmt: skip
        lines += [
            "# HELP kv_picker_worker_requests_total Requests each worker routed since it started "
            "(how evenly the gateway's connections spread over the workers).",
            "# TYPE kv_picker_worker_requests_total counter",
        ]
        for index, text in sorted(texts.items()):
            lines.append(f'kv_picker_worker_requests_total{{worker="{index}"}} '
                         f"{requests_routed(text)}")  # fmt: skip
        body = merge_expositions([*texts.values(), *carried]) + ("\n".join(lines) + "\n").encode()
        return web.Response(body=body, content_type="text/plain", charset="utf-8")

    async def _healthz_handler(self, request: web.Request) -> web.Response:
        import json

        answers = await self._ask_all("/healthz")
        bodies = [json.loads(a[1]) for a in answers if a is not None and a[0] == 200]
        endpoints = max((b.get("endpoints", 0) for b in bodies), default=0)
        # An endpoint counts as ready when every worker has it: a worker that does not cannot
        # route the streams it is given.
        ready = 0
        if len(bodies) == len(self.workers):
            ready = min(body.get("ready", 0) for body in bodies)
        body = {"endpoints": endpoints, "ready": ready, "workers": len(self.workers),
                "workersUp": len(bodies)}  # fmt: skip
        return web.json_response(body)

    async def _readyz_handler(self, request: web.Request) -> web.Response:
        answers = await self._ask_all("/readyz")
        ready_workers = sum(1 for a in answers if a is not None and a[0] == 200)
        ready = not self.stopping and ready_workers == len(self.workers)
        body = {"ready": ready, "draining": self.stopping, "workers": len(self.workers),
                "workersReady": ready_workers}  # fmt: skip
        return web.json_response(body, status=200 if ready else 503)


async def supervise(supervisor: Supervisor) -> None:
    """Run the supervisor's workers until SIGINT/SIGTERM (see the module docstring)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await supervisor.start()
    await stop.wait()
    log.info("shutting down %d workers", len(supervisor.workers))
    await supervisor.stop()


def resident_bytes(pid: int) -> int:
    """A process's resident set size (Linux /proc; 0 when unknown)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def parse_ports(text: str, workers: int) -> list[int]:
    """``--worker-ports P1,...,PN``: one port per worker, distinct.

    Raises:
        ValueError: not N distinct ports in 1..65535.
    """
    ports = [int(part) for part in text.split(",") if part.strip()]
    if len(ports) != workers:
        raise ValueError(f"{len(ports)} ports for {workers} workers")
    if len(set(ports)) != len(ports) or not all(0 < port < 65536 for port in ports):
        raise ValueError("the ports must be distinct and in 1..65535")
    return ports


def worker_spec(
    worker: str,
    directory: str | None,
    grpc_port: int,
    admin_port: int,
    env: Mapping[str, str] | None = None,
    own_port: int = 0,
) -> WorkerSpec:
    """The spec of a worker from its hidden ``serve`` arguments (and the supervisor's salt in
    the environment).

    Raises:
        ValueError: a malformed ``--worker``, or no ``--worker-dir``.
    """
    index, count = parse_worker(worker)
    if not directory:
        raise ValueError("--worker needs --worker-dir")
    environment = os.environ if env is None else env
    return WorkerSpec(index, count, Path(directory), grpc_port, admin_port,
                      environment.get(SALT_ENV), own_port)  # fmt: skip
