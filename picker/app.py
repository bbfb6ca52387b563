"""Wiring: config -> state, plugins, servers and background tasks; graceful stop.

```
PickerApp.start()
  ├── gRPC server (grpc.aio): ext_proc + grpc.health.v1, optional TLS or mutual TLS (files
  │     re-read when they change, see kv_picker.tls)
  ├── admin gRPC server: kvpicker.v1.Admin on its own port (loopback by default), optional TLS
  ├── HTTP server (aiohttp): /metrics (Prometheus), /healthz
  ├── KubernetesDiscovery task (with discovery.kubernetes): pool + pods -> EndpointStore
  ├── MetricsScraper task: endpoints' /metrics -> EndpointStore (fetched and parsed in a
  │     child process by default: sources/scrape_process.py)
  ├── KVEventSubscriber task (with kvEvents): endpoints' KV events -> precise KV index
  ├── KV index task (any backend; Redis: batched writes, outage detection and resync)
  ├── request log writer thread (with requestLog): routed requests -> Mooncake JSONL files
  ├── span exporter thread (with tracing): OpenTelemetry spans of the routing path
  ├── config watcher task (when loaded from a file): reload on change, keep the old on error
  └── PeerSync task (as one of serve --workers' processes): picks and counts exchanged with the
        other workers (kv_picker.peers); HTTP then on a Unix socket the supervisor reads
```

Endpoints come from the config's static ``endpoints`` list or from Kubernetes discovery, never
both. A reload applies a new static list; with discovery it keeps the discovered endpoints
(the watch owns them), and a change of ``discovery`` itself takes effect on restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
from aiohttp import web
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kv_picker.admin import add_admin_service
from kv_picker.config import PickerConfig, TLSConfig, hardware_table, load_config
from kv_picker.director import Director
from kv_picker.endpoint import Endpoint
from kv_picker.errors import ConfigError
from kv_picker.handlers.extproc import ExternalProcessor
from kv_picker.metrics import PickerMetrics
from kv_picker.peers import PeerSync
from kv_picker.plugins import builtin_registry
from kv_picker.request_log import RequestLog
from kv_picker.scheduling.context import BuildContext
from kv_picker.scheduling.registry import Registry
from kv_picker.scheduling.scheduler import Scheduler
from kv_picker.sources.kubernetes import KubernetesDiscovery
from kv_picker.sources.kv_wiring import build_kv_index, build_subscriber
from kv_picker.sources.scrape_process import ProcessScraper
from kv_picker.sources.scraper import EndpointSignals, MetricsScraper
from kv_picker.state.endpoints import EndpointStore
from kv_picker.tls import CertificateFiles
from kv_picker.tracing import RequestTracer
from kv_picker.wire import HEALTH_SERVICES
from kv_picker.workers import WorkerSpec

log = logging.getLogger(__name__)


class PickerApp:
    """The kv-picker service.

    Args:
        config: validated config.
        registry: plugin registry (built-ins by default).
        config_path: when set, the file is watched and reloaded on change.
        clock: monotonic clock in seconds.
    """

    def __init__(
        self,
        config: PickerConfig,
        registry: Registry | None = None,
        config_path: str | Path | None = None,
        clock: Callable[[], float] = time.monotonic,
        reload_interval_s: float = 1.0,
        worker: WorkerSpec | None = None,
    ) -> None:
        self.worker = worker
        if worker is not None:
            config = worker.apply(config)
        self.registry = registry or builtin_registry()
        self.config_path = Path(config_path) if config_path else None
        self.reload_interval_s = reload_interval_s
        self.metrics = PickerMetrics()
        self.store = EndpointStore(clock)
        # An endpoint that leaves takes its per-endpoint series along (a churning pool must not
        # grow the exposition).
        self.store.on_change(self._endpoints_changed)
        self.store.set_endpoints(config.endpoints)
        self.discovery = (
            KubernetesDiscovery(config.discovery.kubernetes, self.store, self.metrics)
            if config.discovery is not None
            else None
        )
        seed = config.seed if config.seed is not None else int.from_bytes(os.urandom(8), "big")
        # The precise KV index outlives config reloads; its settings take effect on restart.
        self.kv_index = build_kv_index(config, self.store, self.metrics)
        self.kv_subscriber = build_subscriber(config, self.store, self.kv_index, self.metrics)
        self._kv_evictions_exported = 0
        self.ctx = BuildContext(
            store=self.store,
            rng=random.Random(seed),
            clock=clock,
            metrics_staleness_s=config.metrics.staleness_s,
            hardware=hardware_table(config),
            kv_index=self.kv_index,
        )
        scheduler = Scheduler(config, self.registry, self.ctx, self.metrics)
        # Like the KV index, the request log keeps its settings until a restart.
        self.request_log = (
            RequestLog.from_config(config.request_log, self.metrics.registry, clock)
            if config.request_log is not None
            else None
        )
        self.director = Director(
            config, self.store, scheduler, self.ctx.rng, self.metrics, self.request_log
        )
        if config.tracing is not None:  # OpenTelemetry is imported only then
            self.director.tracer = RequestTracer.from_config(config.tracing)
        self.metrics.collect_plugin_gauges(lambda: self.director.scheduler.plugin_gauges())
        self.metrics.pending.set_function(lambda: self.director.pending)
        scraper_class = ProcessScraper if config.metrics.scraper == "process" else MetricsScraper
        # Workers share their scrapes (kv_picker.peers): each scrapes N times less often.
        self._scrape_spread = worker.count if worker is not None else 1
        self.scraper = scraper_class(
            self.store,
            self.metrics,
            config.metrics.scrape_interval_s * self._scrape_spread,
            config.metrics.timeout_s,
            config.metrics.path,
        )
        self.grpc_port = 0
        self.admin_port = 0
        self.metrics_port = 0
        self._grpc_server: grpc.aio.Server | None = None
        self._admin_server: grpc.aio.Server | None = None
        self._health: health.aio.HealthServicer | None = None
        self.ready = False  # the pool is known (see _become_ready)
        self.draining = False
        self._http_runner: web.AppRunner | None = None
        self.peers: PeerSync | None = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._config_mtime_ns = self._mtime_ns()

    @property
    def config(self) -> PickerConfig:
        return self.director.config

    async def start(self) -> None:
        """Start serving.

        Raises:
            ConfigError: discovery found no usable Kubernetes credentials.
        """
        config = self.config
        if self.discovery is not None:  # fail before serving anything
            await self.discovery.connect()
        if self.request_log is not None:  # before the first stream can be routed
            self.request_log.start()
        # A buffered body arrives in one message; accept up to twice the body limit (the buffer
        # limit the reference Envoy config sets) so an oversized body gets our JSON 413 rather
        # than a gRPC error that Envoy turns into a bare 500.
        message_limit = 2 * config.server.max_body_bytes + (1 << 20)
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", message_limit),
                ("grpc.max_send_message_length", message_limit),
            ]
        )
        pb_grpc.add_ExternalProcessorServicer_to_server(ExternalProcessor(self.director), server)
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reloads = self.metrics.tls_reloads
        self.grpc_port = _bind(
            server,
            config.server.host,
            config.server.grpc_port,
            config.server.tls,
            lambda result: reloads.labels("grpc", result).inc(),
        )
        worker = self.worker
        if worker is not None and worker.own_port:  # this worker's alone (--worker-ports)
            _bind(server, config.server.host, worker.own_port, config.server.tls,
                  lambda result: reloads.labels("grpc", result).inc())  # fmt: skip
        await server.start()
        self._grpc_server = server
        # Alive at once; ready (and routable for a health-checking gateway) once the pool is
        # known: see _become_ready.
        for service in HEALTH_SERVICES:
            await self._health.set(
                service,
                health_pb2.HealthCheckResponse.SERVING
                if service == "liveness"
                else health_pb2.HealthCheckResponse.NOT_SERVING,
            )
        admin = config.server.admin
        if admin.enabled:
            admin_server = grpc.aio.server(
                options=[
                    ("grpc.max_receive_message_length", message_limit),
                    ("grpc.max_send_message_length", message_limit),
                ]
            )
            add_admin_service(admin_server, self.director)
            self.admin_port = _bind(
                admin_server,
                admin.host,
                admin.port,
                admin.tls,
                lambda result: reloads.labels("admin", result).inc(),
            )
            await admin_server.start()
            self._admin_server = admin_server

        app = web.Application()
        app.router.add_get("/metrics", self._metrics_handler)
        app.router.add_get("/healthz", self._healthz_handler)
        app.router.add_get("/readyz", self._readyz_handler)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        if worker is None:
            site: web.BaseSite = web.TCPSite(runner, config.server.host, config.server.metrics_port)
        else:  # the supervisor serves the port and asks each worker here
            site = web.UnixSite(runner, str(worker.http_socket()))
        await site.start()
        self._http_runner = runner
        bound = [address for address in runner.addresses if isinstance(address, tuple)]
        self.metrics_port = int(bound[0][1]) if bound else config.server.metrics_port

        if worker is not None:
            director = self.director
            self.peers = PeerSync(
                self.store,
                lambda records, pick: director.scheduler.record_peer_picks(records, pick),
                worker.directory,
                worker.index,
                worker.count,
            )
            self.peers.start()
            director.peers = self.peers
            self.scraper.share = self.peers.scraped
            self.peers.on_scrape = self._peer_scraped
            self.peers.on_landed = lambda landing: director.scheduler.peer_prompt_landed(landing)
            store = self.store
            self.peers.export_state = lambda: director.scheduler.export_states(
                {e.id: e.address for e in store.all()}
            )
            self.peers.load_state = lambda states: director.scheduler.import_states(
                states, {address: e.id for address, e in store.by_address.items()}
            )
            self._tasks.append(asyncio.create_task(self.peers.run(), name="peers"))

        if self.discovery is not None:
            self._tasks.append(asyncio.create_task(self.discovery.run(), name="discovery"))
        self._tasks.append(asyncio.create_task(self.scraper.run(), name="metrics-scraper"))
        if self.kv_index is not None:
            self._tasks.append(asyncio.create_task(self.kv_index.run(), name="kv-index"))
        if self.kv_subscriber is not None:
            self._tasks.append(asyncio.create_task(self.kv_subscriber.run(), name="kv-events"))
        if self.config_path is not None:
            self._tasks.append(asyncio.create_task(self._watch_config(), name="config-watcher"))
        self._tasks.append(asyncio.create_task(self._become_ready(), name="readiness"))
        log.info(
            "kv-picker serving ext_proc on %s:%d (%s), admin on %s, metrics on %s, %d endpoints",
            config.server.host,
            self.grpc_port,
            _security(config.server.tls),
            f"{admin.host}:{self.admin_port} ({_security(admin.tls)})" if admin.enabled else "off",
            f":{self.metrics_port}" if worker is None else worker.http_socket(),
            len(self.store),
        )

    async def _become_ready(self) -> None:
        """Report ready once the picker knows its pool: discovery has listed it (when on), and
        an endpoint answered a scrape or a scrape's time (timeout plus two intervals) has passed
        without one. Until then a gateway that health-checks the picker (or Kubernetes, through
        the readiness probe) sends it nothing, instead of requests it would answer 503 for want
        of a known endpoint. A pool that is down gets the picker's own 503s, with their reason,
        once that time has passed."""
        if self.discovery is not None:
            await self.discovery.synced.wait()
        metrics = self.config.metrics
        loop = asyncio.get_running_loop()
        deadline = loop.time() + metrics.timeout_s + 2 * metrics.scrape_interval_s
        while not self.store.ready_endpoints() and loop.time() < deadline:
            await asyncio.sleep(0.01)
        self.ready = True
        if self._health is not None:  # (ignored once draining)
            for service in HEALTH_SERVICES:
                await self._health.set(service, health_pb2.HealthCheckResponse.SERVING)
        log.info("ready: %d of %d endpoints ready", len(self.store.ready_endpoints()),
                 len(self.store))  # fmt: skip
        if self.peers is not None:
            # A worker started again: a copy of what the others learned, now that it knows its
            # endpoints (not before reporting ready: a gateway's health checks would eject it).
            await self.peers.fetch_state()

    async def drain(self, delay_s: float) -> None:
        """Report NOT_SERVING on the health service, and keep serving for ``delay_s``.

        A gateway that health-checks the picker (the FailOpen Envoy config does, every second)
        then stops opening streams to it before :meth:`stop` refuses them: a stream refused
        after its body was handed over fails with a 500 even with ``failure_mode_allow``.
        """
        self.draining = True
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        if delay_s > 0:
            log.info("not serving; stopping in %.1f s", delay_s)
            await asyncio.sleep(delay_s)

    async def stop(self, grace_s: float | None = None) -> None:
        """Stop accepting streams, let open ones finish (up to ``grace_s``; by default the
        config's ``server.drainTimeout``), cancel the rest, stop tasks."""
        if grace_s is None:
            grace_s = self.config.server.drain_timeout_s
        self.draining = True
        if self._health is not None:
            await self._health.enter_graceful_shutdown()
        if self._admin_server is not None:
            await self._admin_server.stop(0)
        if self._grpc_server is not None:
            await self._grpc_server.stop(grace_s)
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks.clear()
        if self.peers is not None:
            self.director.peers = None
            self.peers.close()
        if self.kv_index is not None:
            await self.kv_index.close()
        if self.request_log is not None:  # the streams have ended: their rows are queued
            await asyncio.to_thread(self.request_log.close)
        if self._http_runner is not None:
            await self._http_runner.cleanup()
        if self.director.tracer is not None:  # flush the last spans
            await asyncio.to_thread(self.director.tracer.shutdown)

    async def wait_ready(self, timeout_s: float = 10.0, min_ready: int = 1) -> None:
        """Wait until at least ``min_ready`` endpoints answered a scrape."""
        deadline = time.monotonic() + timeout_s
        while len(self.store.ready_endpoints()) < min_ready:
            if time.monotonic() > deadline:
                raise TimeoutError(f"fewer than {min_ready} endpoints ready after {timeout_s}s")
            await asyncio.sleep(0.02)

    # -- reload -----------------------------------------------------------------------------

    def _mtime_ns(self) -> int:
        if self.config_path is None:
            return 0
        try:
            return self.config_path.stat().st_mtime_ns
        except OSError:
            return 0

    async def _watch_config(self) -> None:
        while True:
            await asyncio.sleep(self.reload_interval_s)
            mtime = self._mtime_ns()
            if mtime and mtime != self._config_mtime_ns:
                self._config_mtime_ns = mtime
                self.reload()

    def reload(self) -> bool:
        """Re-read the config file; on any error keep the running config."""
        if self.config_path is None:
            return False
        try:
            config = load_config(self.config_path, self.registry)
            if self.worker is not None:
                config = self.worker.apply(config)
            scheduler = Scheduler(config, self.registry, self.ctx, self.metrics)
        except ConfigError as exc:
            log.error("config reload rejected, keeping the running config: %s", exc)
            self.metrics.config_reloads.labels("rejected").inc()
            return False
        if config.server != self.config.server:
            log.warning(
                "server settings changed in %s: they take effect on restart", self.config_path
            )
        if (
            config.kv_events != self.config.kv_events
            or config.index != self.config.index
            or config.request_log != self.config.request_log
            or config.tracing != self.config.tracing
        ):
            log.warning(
                "kvEvents, index, requestLog or tracing settings changed in %s: they take effect "
                "on restart",
                self.config_path,
            )
        if config.metrics != self.config.metrics:
            self.scraper.configure(
                config.metrics.scrape_interval_s * self._scrape_spread,
                config.metrics.timeout_s,
                config.metrics.path,
            )
            self.ctx.metrics_staleness_s = config.metrics.staleness_s
            if config.metrics.scraper != self.config.metrics.scraper:
                log.warning(
                    "metrics.scraper changed in %s: it takes effect on restart", self.config_path
                )
        if config.discovery != self.config.discovery:
            log.warning(
                "discovery settings changed in %s: they take effect on restart; the running "
                "endpoints stay",
                self.config_path,
            )
        elif self.discovery is None:
            self.store.set_endpoints(config.endpoints)
        self.director.swap(config, scheduler)
        # What the old config kept across reloads and the new one does not use goes now.
        self.ctx.shared.release_unused(scheduler.shared_keys)
        self.metrics.config_reloads.labels("applied").inc()
        log.info("config reloaded from %s", self.config_path)
        return True

    def _peer_scraped(self, address: str, signals: EndpointSignals | None, reason: str) -> None:
        """Another worker's scrape of ``address`` (it counted its own errors)."""
        endpoint = self.store.by_address.get(address)
        if endpoint is None:
            return
        if signals is None:
            self.scraper.failed(endpoint, reason, count_error=False)
        else:
            self.scraper.scraped(endpoint, signals)

    def _endpoints_changed(self, added: Sequence[Endpoint], removed: Sequence[Endpoint]) -> None:
        readded = {endpoint.address for endpoint in added}
        for endpoint in removed:
            if endpoint.address not in readded:
                self.metrics.forget_endpoint(endpoint.address)

    # -- HTTP -------------------------------------------------------------------------------

    async def _metrics_handler(self, request: web.Request) -> web.Response:
        self.metrics.asyncio_tasks.set(len(asyncio.all_tasks()))
        index = self.kv_index
        if index is not None:
            self.metrics.kv_index_blocks.set(index.num_blocks())
            num_keys = index.num_keys()
            if num_keys is not None:
                self.metrics.kv_index_keys.set(num_keys)
            evicted = index.num_evicted_blocks()
            self.metrics.kv_index_evictions.inc(evicted - self._kv_evictions_exported)
            self._kv_evictions_exported = evicted
        return web.Response(
            body=self.metrics.exposition(), content_type="text/plain", charset="utf-8"
        )

    async def _healthz_handler(self, request: web.Request) -> web.Response:
        ready = len(self.store.ready_endpoints())
        return web.json_response({"endpoints": len(self.store), "ready": ready})

    async def _readyz_handler(self, request: web.Request) -> web.Response:
        """200 once ready (see :meth:`_become_ready`) and not draining, else 503."""
        ready = self.ready and not self.draining
        body = {"ready": ready, "draining": self.draining, "endpoints": len(self.store),
                "endpointsReady": len(self.store.ready_endpoints())}  # fmt: skip
        return web.json_response(body, status=200 if ready else 503)


def _bind(
    server: grpc.aio.Server,
    host: str,
    port: int,
    tls: TLSConfig | None,
    on_reload: Callable[[str], None] | None = None,
) -> int:
    """Listen on ``host:port``, with TLS from files that are re-read when they change
    (:mod:`kv_picker.tls`) when configured; returns the port bound."""
    address = f"{host}:{port}"
    if tls is None:
        return int(server.add_insecure_port(address))
    credentials = CertificateFiles(tls, on_reload).credentials()
    return int(server.add_secure_port(address, credentials))


def _security(tls: TLSConfig | None) -> str:
    if tls is None:
        return "plaintext"
    return "mutual TLS" if tls.client_ca_path else "TLS"


async def serve(
    config_path: str | None, config: PickerConfig, worker: WorkerSpec | None = None
) -> None:
    """Run until SIGINT/SIGTERM (as one of ``serve --workers``' processes with ``worker``)."""
    import signal

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):  # before start: no window without a handler
        loop.add_signal_handler(sig, stop.set)
    app = PickerApp(config, config_path=config_path, worker=worker)
    await app.start()
    await stop.wait()
    log.info("shutting down")
    await app.drain(app.config.server.shutdown_delay_s)
    await app.stop()
