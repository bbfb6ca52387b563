"""Kubernetes discovery: the endpoints of an InferencePool (or a label selector) and its pods.

What becomes an endpoint (as the reference EPP, ``gie-llmd.md`` §6.3): a pod the selector
matches, whose ``Ready`` condition is True, that has an IP and no ``deletionTimestamp``; one
endpoint per (pod IP, target port), labelled with the pod's labels (``llm-d.ai/role``,
``kv-picker.io/hardware-class``, ...), its instance the pod's uid (a pod re-created with a
reused IP is a new endpoint: nothing it inherits from the old one's index entries). A pod
annotated ``llm-d.ai/active-ports`` (or ``inference.networking.k8s.io/active-ports``:
``"8000,8001"``) serves only those of the target ports. A pod that turns NotReady or starts
terminating leaves the store at the event: it takes no new requests, and requests already
routed to it finish (they hold their endpoint, see :meth:`EndpointStore.set_endpoints`).

The pool is read from ``inference.networking.k8s.io/v1`` by default, or, with
``inferencePoolGroup: inference.networking.x-k8s.io``, from the older ``v1alpha2`` API that
pools made by the Gateway API Inference Extension before its 1.0 still use: the same pods and
ports, spelled ``spec.selector: {app: vllm}`` and ``spec.targetPortNumber: 8000``.

```
 thread "k8s-pool" (with inferencePool)            thread "k8s-pods"
   list inferencepools name=POOL                     list pods labelSelector=<pool selector>
   watch from its resourceVersion                    watch from its resourceVersion
     │ pool spec: selector, targetPorts                │ pods: uid, IP, Ready, deleting, labels
     └──────── loop.call_soon_threadsafe ─────────────┘
                          │ the event loop: pool + pod table -> endpoint specs (coalesced)
                          └─> EndpointStore.set_endpoints(...) -> indexes, KV events, metrics
                                                               follow (on_removed, on_change)
```

Every watch follows the same rules (:class:`_ListWatch`)::

    list                  everything the selection holds now, at a resourceVersion (rv)
    watch from rv         ADDED / MODIFIED / DELETED applied one by one; rv follows each event
    BOOKMARK              rv moves on, nothing else changes (a reconnect needs no relist)
    410 Gone              (ERROR event or HTTP status) rv is too old: list again
    stream ended          (the server's timeoutSeconds) watch again from rv at once
    stream broke, error   watch again from rv after a backoff that doubles from backoffInitial
                          up to backoffMax (jittered), reset once a stream delivers again
    selector changed      (the pool's) list again with the new selector

Why the official ``kubernetes`` client, and why threads: it is the Kubernetes project's own
client, released with each Kubernetes minor version, and it carries what a client must get
right and we should not rewrite: kubeconfig parsing (contexts, exec and auth plugins, client
certificates), in-cluster service-account credentials with token refresh, TLS to the API
server, and the typed request builders for pods and custom resources. Its API is synchronous
(urllib3), so each watch runs in a thread of its own and only hands parsed results to the
event loop with ``call_soon_threadsafe``: the loop never waits on the API server and never
parses its JSON. The library's own ``Watch`` helper is not used for the stream: it retries a
410 once with the same (expired) resourceVersion, and builds a model object per event; the
loop here reads the lines itself (with the library's line splitter) and keeps raw dicts. The
newer asyncio flavour of the client (``kubernetes.aio``, since 37.0) would spare the threads,
but it parses on the loop and is young; the threads cost two blocked sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import random
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, TypeGuard

from kv_picker.config import KubernetesDiscoveryConfig
from kv_picker.endpoint import EndpointSpec
from kv_picker.errors import ConfigError
from kv_picker.metrics import PickerMetrics
from kv_picker.state.endpoints import EndpointStore

log = logging.getLogger(__name__)

POOL_GROUP = "inference.networking.k8s.io"
POOL_VERSION = "v1"
# The group the Gateway API Inference Extension served InferencePools from before its v1
# (``inferencePoolGroup: inference.networking.x-k8s.io``), and that group's last version.
ALPHA_POOL_GROUP = "inference.networking.x-k8s.io"
ALPHA_POOL_VERSION = "v1alpha2"
POOL_VERSIONS = {POOL_GROUP: POOL_VERSION, ALPHA_POOL_GROUP: ALPHA_POOL_VERSION}
POOL_PLURAL = "inferencepools"
ACTIVE_PORTS_ANNOTATIONS = ("llm-d.ai/active-ports", "inference.networking.k8s.io/active-ports")
POOLS = "inferencepools"
PODS = "pods"
_EVENT_TYPES = ("ADDED", "MODIFIED", "DELETED", "BOOKMARK", "ERROR")
_CONNECT_TIMEOUT_S = 5.0
# A watch stream idle for longer than its timeoutSeconds plus this is taken for dead.
_WATCH_READ_GRACE_S = 30.0


# -- what the API objects say -----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class PodView:
    """What discovery reads from a pod."""

    uid: str
    name: str
    ip: str | None
    ready: bool
    terminating: bool
    labels: Mapping[str, str]
    active_ports: frozenset[int] | None  # None: every target port

    @classmethod
    def from_object(cls, obj: Mapping[str, Any]) -> PodView:
        """Read a pod object (a dict of the API's JSON).

        Raises:
            ValueError: the object has no uid or name.
        """
        metadata = obj.get("metadata") or {}
        status = obj.get("status") or {}
        uid, name = metadata.get("uid"), metadata.get("name")
        if not isinstance(uid, str) or not isinstance(name, str):
            raise ValueError("pod without metadata.uid or metadata.name")
        ready = any(
            isinstance(c, Mapping) and c.get("type") == "Ready" and c.get("status") == "True"
            for c in status.get("conditions") or ()
        )
        labels = metadata.get("labels") or {}
        annotations = metadata.get("annotations") or {}
        ip = status.get("podIP")
        return cls(
            uid=uid,
            name=name,
            ip=ip if isinstance(ip, str) and ip else None,
            ready=ready,
            terminating=metadata.get("deletionTimestamp") is not None,
            labels={str(k): str(v) for k, v in labels.items()},
            active_ports=_active_ports(annotations),
        )

    @property
    def serving(self) -> bool:
        """It may take new requests: Ready, with an IP, not terminating."""
        return self.ready and self.ip is not None and not self.terminating


def _active_ports(annotations: Mapping[str, Any]) -> frozenset[int] | None:
    for name in ACTIVE_PORTS_ANNOTATIONS:
        value = annotations.get(name)
        if isinstance(value, str):
            ports = {int(p) for p in value.split(",") if p.strip().isdigit()}
            return frozenset(ports)
    return None


@dataclass(frozen=True, slots=True)
class PoolSpec:
    """What discovery reads from an InferencePool: which pods, which ports."""

    selector: Mapping[str, str]
    target_ports: tuple[int, ...]

    @classmethod
    def from_object(cls, obj: Mapping[str, Any], version: str = POOL_VERSION) -> PoolSpec:
        """Read an InferencePool of API ``version``.

        ``v1`` (``inference.networking.k8s.io``): the pods are ``spec.selector.matchLabels``,
        the ports ``spec.targetPorts[].number`` (1 to 8). ``v1alpha2``
        (``inference.networking.x-k8s.io``): the pods are ``spec.selector``, a plain label map,
        and the one port is ``spec.targetPortNumber``.

        Raises:
            ValueError: the selector is missing, empty or not a label map, or the ports are
                missing or invalid.
        """
        spec = obj.get("spec") or {}
        alpha = version == ALPHA_POOL_VERSION
        selector = spec.get("selector")
        if alpha:
            labels, where = selector, "spec.selector"
        else:
            labels = selector.get("matchLabels") if isinstance(selector, Mapping) else None
            where = "spec.selector.matchLabels"
        if not isinstance(labels, Mapping) or not labels:
            raise ValueError(f"{where} is missing or empty")
        if not all(isinstance(v, str) for v in labels.values()):
            raise ValueError(f"{where} must map label names to string values")
        ports: list[int] = []
        if alpha:
            port = spec.get("targetPortNumber")
            if port is None:
                raise ValueError("spec.targetPortNumber is missing")
            if not _valid_port(port):
                raise ValueError(f"spec.targetPortNumber: bad port {port!r}")
            ports.append(port)
        else:
            for entry in spec.get("targetPorts") or ():
                number = entry.get("number") if isinstance(entry, Mapping) else None
                if not _valid_port(number) or number in ports:
                    raise ValueError(f"spec.targetPorts: bad or repeated port {number!r}")
                ports.append(number)
            if not ports:
                raise ValueError("spec.targetPorts is missing or empty")
        return cls({str(k): v for k, v in labels.items()}, tuple(ports))

    def label_selector(self) -> str:
        """The selector as a ``labelSelector`` query (``k=v,...``)."""
        return ",".join(f"{k}={v}" for k, v in sorted(self.selector.items()))

    def selects(self, labels: Mapping[str, str]) -> bool:
        return all(labels.get(k) == v for k, v in self.selector.items())


def _valid_port(number: Any) -> TypeGuard[int]:
    return isinstance(number, int) and not isinstance(number, bool) and 0 < number < 65536


def endpoint_specs(pods: Iterable[PodView], pool: PoolSpec) -> list[EndpointSpec]:
    """The endpoints of the serving pods the pool selects: one per (pod IP, target port).

    Two serving pods never share an IP in a cluster; should they (a misconfigured network),
    the address goes to the pod first by name, and the other is logged.
    """
    specs: dict[str, EndpointSpec] = {}
    owners: dict[str, str] = {}
    for pod in sorted(pods, key=lambda p: p.name):
        if not pod.serving or not pool.selects(pod.labels):
            continue
        assert pod.ip is not None
        host = f"[{pod.ip}]" if ":" in pod.ip else pod.ip
        for port in pool.target_ports:
            if pod.active_ports is not None and port not in pod.active_ports:
                continue
            address = f"{host}:{port}"
            if address in specs:
                log.warning("pods %s and %s both serve %s", owners[address], pod.name, address)
                continue
            specs[address] = EndpointSpec(address, pod.labels, pod.uid)
            owners[address] = pod.name
    return list(specs.values())


# -- one list-then-watch, in a thread ----------------------------------------------------------


class _Gone(Exception):
    """The watch's resourceVersion expired (410)."""


class _Restart(Exception):
    """The selection changed: list again."""


class ListCall(Protocol):
    """A client call that lists or watches a collection (``list_namespaced_pod`` and the like,
    with the namespace and kind bound)."""

    def __call__(self, **kwargs: Any) -> Any: ...


@dataclass(frozen=True, slots=True)
class Backoff:
    """Capped exponential backoff with jitter (each delay drawn from [d/2, d])."""

    initial_s: float
    max_s: float

    def delay_s(self, attempt: int, rng: random.Random) -> float:
        delay = min(self.max_s, self.initial_s * 2.0 ** min(attempt, 30))
        return delay * (0.5 + rng.random() / 2)


Message = tuple[str, Any]  # ("reset", [objects]) or ("ADDED"|"MODIFIED"|"DELETED", object)


class _ListWatch:
    """Lists then watches one collection in a thread of its own (see the module docstring).

    Args:
        resource: ``pods`` or ``inferencepools`` (for logs and metrics).
        call: the client's list function for the collection.
        selection: the current query (``label_selector``, ``field_selector``), or None while
            there is nothing to watch; read at each (re)list.
        parse: raw object -> what the loop gets (runs in the thread).
        deliver: hands a message to the loop (thread-safe).
        backoff: delays between failed attempts.
        watch_timeout_s: ``timeoutSeconds`` of each watch request.
        list_timeout_s: bound on a list request.
    """

    def __init__(
        self,
        resource: str,
        call: ListCall,
        selection: Callable[[], Mapping[str, str] | None],
        parse: Callable[[Mapping[str, Any]], Any],
        deliver: Callable[[Message], None],
        metrics: PickerMetrics,
        backoff: Backoff,
        watch_timeout_s: float,
        list_timeout_s: float,
    ) -> None:
        self.resource = resource
        self._call = call
        self._selection = selection
        self._parse = parse
        self._deliver = deliver
        self._backoff = backoff
        self._watch_timeout_s = watch_timeout_s
        self._list_timeout_s = list_timeout_s
        self._restarts = {
            reason: metrics.discovery_restarts.labels(resource, reason)
            for reason in ("gone", "dropped", "error", "ended", "changed")
        }
        self._events = metrics.discovery_events
        self._lock = threading.Lock()
        self._response: Any = None  # the urllib3 response being read
        self._stopped = threading.Event()
        self._wake = threading.Event()
        self._restart = False
        self._rng = random.Random()
        self.resource_version: str | None = None
        self.lists = 0
        self.watches = 0
        self._thread = threading.Thread(target=self._run, name=f"k8s-{resource}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Ask the thread to end; a blocked read is cut by shutting its socket."""
        self._stopped.set()
        self._wake.set()
        self._cut()

    def join(self, timeout_s: float) -> bool:
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def restart(self) -> None:
        """The selection changed: end the current stream and list again."""
        with self._lock:
            self._restart = True
        self._wake.set()
        self._cut()

    def _cut(self) -> None:
        with self._lock:
            response = self._response
        if response is not None:
            with contextlib.suppress(Exception):
                response.shutdown()

    # -- the thread -------------------------------------------------------------------------

    def _run(self) -> None:
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        failures = 0
        while not self._stopped.is_set():
            with self._lock:
                restarting, self._restart = self._restart, False
            if restarting:
                self.resource_version = None
                self._restarts["changed"].inc()
            selection = self._selection()
            if selection is None:
                self.resource_version = None
                self._wake.wait()
                self._wake.clear()
                continue
            try:
                if self.resource_version is None:
                    self._list(selection)
                    failures = 0
                delivered = self._watch(selection)
                if delivered:
                    failures = 0
                self._restarts["ended"].inc()
                continue
            except _Gone:
                log.info("watch of %s: resourceVersion expired (410), listing again", self.resource)
                self.resource_version = None
                self._restarts["gone"].inc()
                continue
            except _Restart:
                continue
            except ApiException as exc:
                if exc.status == 410:
                    self.resource_version = None
                    self._restarts["gone"].inc()
                    continue
                reason, message = "error", f"HTTP {exc.status} {exc.reason}"
            except (HTTPError, OSError, ValueError) as exc:
                reason, message = "dropped", str(exc) or type(exc).__name__
            if self._stopped.is_set():
                break
            with self._lock:
                if self._restart:
                    continue
            delay_s = self._backoff.delay_s(failures, self._rng)
            failures += 1
            self._restarts[reason].inc()
            log.warning("watch of %s failed (%s); again in %.2fs", self.resource, message, delay_s)
            if self._wake.wait(delay_s):
                self._wake.clear()

    def _open(self, **kwargs: Any) -> Any:
        response = self._call(_preload_content=False, **kwargs)
        with self._lock:
            self._response = response
            cut = self._restart or self._stopped.is_set()
        if cut:
            response.shutdown()
        return response

    def _close(self, response: Any, reuse: bool) -> None:
        with self._lock:
            self._response = None
        with contextlib.suppress(Exception):
            if not reuse:  # a stream may have been cut half-read: the connection is done
                response.close()
            response.release_conn()

    def _list(self, selection: Mapping[str, str]) -> None:
        response = self._open(
            **selection, _request_timeout=(_CONNECT_TIMEOUT_S, self._list_timeout_s)
        )
        try:
            body = json.loads(response.data)
        finally:
            self._close(response, reuse=True)
        self._check_restart()
        self.lists += 1
        objects = [self._parse_or_skip(item) for item in body.get("items") or ()]
        self.resource_version = str((body.get("metadata") or {}).get("resourceVersion") or "")
        self._deliver(("reset", [o for o in objects if o is not None]))

    def _watch(self, selection: Mapping[str, str]) -> bool:
        """Read one watch stream to its end. Returns whether it delivered anything."""
        from kubernetes.watch.watch import iter_resp_lines

        timeout_s = int(self._watch_timeout_s)
        response = self._open(
            **selection,
            watch=True,
            resource_version=self.resource_version,
            allow_watch_bookmarks=True,
            timeout_seconds=timeout_s,
            _request_timeout=(_CONNECT_TIMEOUT_S, timeout_s + _WATCH_READ_GRACE_S),
        )
        self.watches += 1
        delivered = False
        try:
            for line in iter_resp_lines(response):
                if not line:
                    continue
                self._check_restart()
                event = json.loads(line)
                kind, obj = event.get("type"), event.get("object") or {}
                self._events.labels(self.resource, kind if kind in _EVENT_TYPES else "other").inc()
                if kind == "ERROR":
                    code = obj.get("code")
                    if code == 410:
                        raise _Gone
                    from kubernetes.client.exceptions import ApiException

                    raise ApiException(status=code, reason=obj.get("message"))
                version = (obj.get("metadata") or {}).get("resourceVersion")
                if kind == "BOOKMARK":
                    if version:
                        self.resource_version = str(version)
                    delivered = True
                    continue
                if kind not in ("ADDED", "MODIFIED", "DELETED"):
                    continue
                parsed = self._parse_or_skip(obj)
                if version:
                    self.resource_version = str(version)
                if parsed is not None:
                    self._deliver((kind, parsed))
                delivered = True
        except Exception:
            self._check_restart()
            if self._stopped.is_set():
                return delivered
            raise
        finally:
            self._close(response, reuse=False)
        self._check_restart()
        return delivered

    def _check_restart(self) -> None:
        with self._lock:
            if self._restart:
                raise _Restart

    def _parse_or_skip(self, obj: Mapping[str, Any]) -> Any:
        try:
            return self._parse(obj)
        except (ValueError, TypeError, AttributeError) as exc:
            name = (obj.get("metadata") or {}).get("name") if isinstance(obj, Mapping) else None
            log.warning("ignoring %s object %s: %s", self.resource, name, exc)
            return None


# -- the discovery ----------------------------------------------------------------------------


def load_api_client(settings: KubernetesDiscoveryConfig) -> Any:
    """A ``kubernetes.client.ApiClient`` with the credentials the settings lead to:
    ``kubeconfig`` when given, else the pod's service account, else the default kubeconfig.

    Raises:
        ConfigError: no credentials found, or a kubeconfig that cannot be used.
    """
    from kubernetes import client, config
    from kubernetes.config.config_exception import ConfigException

    configuration = client.Configuration()
    try:
        if settings.kubeconfig is not None:
            config.load_kube_config(
                config_file=settings.kubeconfig, client_configuration=configuration
            )
        else:
            try:
                config.load_incluster_config(client_configuration=configuration)
            except ConfigException:
                config.load_kube_config(client_configuration=configuration)
    except (ConfigException, OSError, ValueError, TypeError) as exc:
        where = settings.kubeconfig or "in-cluster service account or default kubeconfig"
        raise ConfigError(f"discovery.kubernetes: no usable credentials ({where}): {exc}") from exc
    return client.ApiClient(configuration)


class KubernetesDiscovery:
    """Keeps the endpoint store equal to what the Kubernetes API says (module docstring).

    Args:
        settings: ``discovery.kubernetes``.
        store: the endpoints to keep.
        metrics: watch events and restarts are counted here.
        api_client: a ``kubernetes.client.ApiClient`` (default: from the settings'
            credentials, loaded by :meth:`connect`).
    """

    def __init__(
        self,
        settings: KubernetesDiscoveryConfig,
        store: EndpointStore,
        metrics: PickerMetrics,
        api_client: Any = None,
    ) -> None:
        self.settings = settings
        self.store = store
        self.metrics = metrics
        self._api_client = api_client
        self.pool: PoolSpec | None = None
        if settings.selector is not None:
            self.pool = PoolSpec(dict(settings.selector), tuple(settings.target_ports))
        self.pods: dict[str, PodView] = {}
        self.synced = asyncio.Event()
        self._pods_listed = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._publish_pending = False
        self._watches: list[_ListWatch] = []
        self._pod_watch: _ListWatch | None = None
        self.changes = 0

    @property
    def description(self) -> str:
        s = self.settings
        if s.inference_pool is not None:
            name = f"InferencePool {s.namespace}/{s.inference_pool}"
            group = self.pool_group
            return name if group == POOL_GROUP else f"{name} ({group}/{POOL_VERSIONS[group]})"
        return f"pods {s.namespace}/{PoolSpec(dict(s.selector or {}), ()).label_selector()}"

    @property
    def pool_group(self) -> str:
        """The API group the InferencePool is read from."""
        return self.settings.inference_pool_group or POOL_GROUP

    async def connect(self) -> None:
        """Load credentials (in a thread: it reads files, may run an exec plugin).

        Raises:
            ConfigError: no usable credentials.
        """
        if self._api_client is None:
            self._api_client = await asyncio.to_thread(load_api_client, self.settings)

    async def run(self) -> None:
        """Watch until cancelled; the threads are stopped on the way out."""
        await self.connect()
        from kubernetes import client

        self._loop = asyncio.get_running_loop()
        settings = self.settings
        backoff = Backoff(settings.backoff_initial_s, settings.backoff_max_s)
        core = client.CoreV1Api(self._api_client)
        self._pod_watch = _ListWatch(
            PODS,
            lambda **kw: core.list_namespaced_pod(settings.namespace, **kw),
            self._pod_selection,
            PodView.from_object,
            self._from_thread(self._on_pods),
            self.metrics,
            backoff,
            settings.watch_timeout_s,
            settings.timeout_s,
        )
        self._watches = [self._pod_watch]
        if settings.inference_pool is not None:
            custom = client.CustomObjectsApi(self._api_client)
            by_name = {"field_selector": f"metadata.name={settings.inference_pool}"}
            group = self.pool_group
            version = POOL_VERSIONS[group]
            self._watches.append(
                _ListWatch(
                    POOLS,
                    lambda **kw: custom.list_namespaced_custom_object(
                        group, version, settings.namespace, POOL_PLURAL, **kw
                    ),
                    lambda: by_name,
                    functools.partial(_parse_pool, version=version),
                    self._from_thread(self._on_pools),
                    self.metrics,
                    backoff,
                    settings.watch_timeout_s,
                    settings.timeout_s,
                )
            )
        log.info("Kubernetes discovery: watching %s", self.description)
        for watch in self._watches:
            watch.start()
        try:
            await asyncio.Event().wait()  # until cancelled
        finally:
            await self._stop()

    async def _stop(self) -> None:
        for watch in self._watches:
            watch.stop()
        for watch in self._watches:
            if not await asyncio.to_thread(watch.join, 5.0):
                log.warning("watch thread of %s did not stop in time", watch.resource)
        self._watches = []
        if self._api_client is not None:
            with contextlib.suppress(Exception):
                self._api_client.close()

    def watch_stats(self) -> dict[str, tuple[int, int, str | None]]:
        """Per resource: (lists, watches, resourceVersion) so far."""
        return {w.resource: (w.lists, w.watches, w.resource_version) for w in self._watches}

    # -- thread -> loop -----------------------------------------------------------------------

    def _from_thread(self, handler: Callable[[Message], None]) -> Callable[[Message], None]:
        loop = self._loop
        assert loop is not None

        def deliver(message: Message) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed: we are stopping
                loop.call_soon_threadsafe(handler, message)

        return deliver

    def _pod_selection(self) -> Mapping[str, str] | None:
        pool = self.pool  # read from the thread: a reference swap on the loop, never a mutation
        if pool is None:
            return None
        return {"label_selector": pool.label_selector()}

    # -- on the loop --------------------------------------------------------------------------

    def _on_pools(self, message: Message) -> None:
        kind, payload = message
        if kind == "reset":
            pool: PoolSpec | _InvalidPool | None = payload[0] if payload else None
            if pool is None:
                log.warning("%s not found: no endpoints until it exists", self.description)
        elif kind == "DELETED":
            log.warning("%s deleted: no endpoints until it exists again", self.description)
            pool = None
        else:
            pool = payload
        if isinstance(pool, _InvalidPool):
            # A bad edit should not empty a serving pool: keep what was valid.
            log.error("%s: %s; keeping the last valid spec", self.description, pool.problem)
            if self.pool is None:
                self._mark_synced()
            return
        self._set_pool(pool)

    def _set_pool(self, pool: PoolSpec | None) -> None:
        previous = self.pool
        if pool == previous:
            if not self._pods_listed and pool is None:
                self._mark_synced()
            return
        self.pool = pool
        if pool is not None:
            log.info(
                "%s: selector %s, target ports %s",
                self.description,
                pool.label_selector(),
                ",".join(map(str, pool.target_ports)),
            )
        if previous is None or pool is None or pool.selector != previous.selector:
            # Pods the new selector no longer matches go now; those it adds come with the
            # relist.
            self._pods_listed = False
            if pool is None:
                self.pods.clear()
            if self._pod_watch is not None:
                self._pod_watch.restart()
        if pool is None:
            self._mark_synced()
        self._schedule_publish()

    def _on_pods(self, message: Message) -> None:
        kind, payload = message
        if kind == "reset":
            self.pods = {pod.uid: pod for pod in payload}
            self._pods_listed = True
            self._mark_synced()
        elif kind == "DELETED":
            self.pods.pop(payload.uid, None)
        else:
            previous = self.pods.get(payload.uid)
            self.pods[payload.uid] = payload
            if previous is not None and previous.serving != payload.serving:
                state = "serving" if payload.serving else "not serving"
                why = " (terminating)" if payload.terminating else ""
                log.info("pod %s %s%s", payload.name, state, why)
        self._schedule_publish()

    def _mark_synced(self) -> None:
        if not self.synced.is_set():
            self.synced.set()

    def _schedule_publish(self) -> None:
        # Events that arrive together (a relist, a burst) cost one pass over the pods.
        if not self._publish_pending and self._loop is not None:
            self._publish_pending = True
            self._loop.call_soon(self._publish)

    def _publish(self) -> None:
        self._publish_pending = False
        pool = self.pool
        specs = [] if pool is None else endpoint_specs(self.pods.values(), pool)
        before = set(self.store.by_address)
        self.store.set_endpoints(specs)
        after = set(self.store.by_address)
        if before != after:
            self.changes += 1
            added, removed = sorted(after - before), sorted(before - after)
            log.info(
                "discovered endpoints: %d (+%s -%s)",
                len(after),
                ",".join(added) or "none",
                ",".join(removed) or "none",
            )


@dataclass(frozen=True, slots=True)
class _InvalidPool:
    """An InferencePool whose spec cannot be used (the last valid one stays in force)."""

    problem: str


def _parse_pool(obj: Mapping[str, Any], version: str = POOL_VERSION) -> PoolSpec | _InvalidPool:
    try:
        return PoolSpec.from_object(obj, version)
    except ValueError as exc:
        return _InvalidPool(str(exc))
