"""A fake Kubernetes API server: pods and InferencePools, listed and watched over real HTTP.

No Kubernetes API server runs where this project is built and tested, so discovery is tested
against this one: a small threaded HTTP server on 127.0.0.1 that speaks the part of the API
protocol a list-then-watch client uses, for the real ``kubernetes`` client library to talk to
through a generated kubeconfig (:meth:`FakeKubeApi.write_kubeconfig`).

```
GET /api/v1/namespaces/{ns}/pods[/{name}]
GET /apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools[/{name}]
GET /apis/inference.networking.x-k8s.io/v1alpha2/namespaces/{ns}/inferencepools[/{name}]
    labelSelector      k=v, k==v, k!=v, k, !k  (comma: all of them)
    fieldSelector      metadata.name=..., metadata.namespace=...
    watch=true         chunked stream of JSON lines {"type": ..., "object": ...}
    resourceVersion    watch: events after it; unset or "0": ADDED for every object first
    allowWatchBookmarks  BOOKMARK events (on send_bookmarks() and every bookmark_interval_s)
    timeoutSeconds     the stream ends cleanly after that long
```

Resource versions count every change on the server (etcd's revision). Changes are kept in a
history until :meth:`FakeKubeApi.compact`; a watch from a resourceVersion older than the
compacted one gets what the real API server sends: status 200, one ``ERROR`` event carrying a
``Status`` with code 410 (Expired), and the end of the stream (``gone_as_status=True``
answers HTTP 410 instead, as some proxies do). A change that moves an object into a watch's
label selection is sent as ``ADDED``, out of it as ``DELETED``.

Tests drive it from any thread: :meth:`~FakeKubeApi.add_pod`, :meth:`~FakeKubeApi.update_pod`
(readiness, IP, labels, annotations), :meth:`~FakeKubeApi.terminate_pod` (graceful deletion:
``deletionTimestamp`` set), :meth:`~FakeKubeApi.remove_pod`, :meth:`~FakeKubeApi.apply_pool`,
:meth:`~FakeKubeApi.delete_pool`, and the failures: :meth:`~FakeKubeApi.drop_watches` (streams
cut mid-flight), :meth:`~FakeKubeApi.hold_watches` (new watches wait),
:meth:`~FakeKubeApi.compact` (old resourceVersions expire), :meth:`~FakeKubeApi.send_bookmarks`.
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import yaml

POOL_GROUP = "inference.networking.k8s.io"
POOL_VERSION = "v1"
ALPHA_POOL_GROUP = "inference.networking.x-k8s.io"
ALPHA_POOL_VERSION = "v1alpha2"
PODS = "pods"
POOLS = "inferencepools"
# The older API's pools are another resource (another CRD), named as kubectl names it.
ALPHA_POOLS = f"inferencepools.{ALPHA_POOL_GROUP}"
_KINDS = {
    PODS: ("v1", "Pod"),
    POOLS: (f"{POOL_GROUP}/{POOL_VERSION}", "InferencePool"),
    ALPHA_POOLS: (f"{ALPHA_POOL_GROUP}/{ALPHA_POOL_VERSION}", "InferencePool"),
}
_POOL_RESOURCES = {POOL_GROUP: POOLS, ALPHA_POOL_GROUP: ALPHA_POOLS}
_PREFIXES = {
    "/api/v1/namespaces/": PODS,
    f"/apis/{POOL_GROUP}/{POOL_VERSION}/namespaces/": POOLS,
    f"/apis/{ALPHA_POOL_GROUP}/{ALPHA_POOL_VERSION}/namespaces/": ALPHA_POOLS,
}


class SelectorError(ValueError):
    """A label or field selector this server does not understand (HTTP 400)."""


def _label_matcher(selector: str) -> Callable[[Mapping[str, str]], bool]:
    """Equality-based label selector (the set-based ``in``/``notin`` forms are not served)."""
    terms: list[tuple[str, str, str]] = []  # (op, key, value)
    for raw in filter(None, (term.strip() for term in selector.split(","))):
        if "!=" in raw:
            key, _, value = raw.partition("!=")
            terms.append(("!=", key.strip(), value.strip()))
        elif "=" in raw:
            key, _, value = raw.partition("==") if "==" in raw else raw.partition("=")
            terms.append(("=", key.strip(), value.strip()))
        elif raw.startswith("!"):
            terms.append(("!", raw[1:].strip(), ""))
        elif " " in raw or "(" in raw:
            raise SelectorError(f"unsupported label selector term {raw!r}")
        else:
            terms.append(("exists", raw, ""))

    def matches(labels: Mapping[str, str]) -> bool:
        for op, key, value in terms:
            if op == "=" and labels.get(key) != value:
                return False
            if op == "!=" and labels.get(key) == value:
                return False
            if op == "exists" and key not in labels:
                return False
            if op == "!" and key in labels:
                return False
        return True

    return matches


def _field_matcher(selector: str) -> Callable[[Mapping[str, Any]], bool]:
    wanted: list[tuple[str, str]] = []
    for raw in filter(None, (term.strip() for term in selector.split(","))):
        key, sep, value = raw.partition("=")
        if not sep or key not in ("metadata.name", "metadata.namespace"):
            raise SelectorError(f"unsupported field selector {raw!r}")
        wanted.append((key.removeprefix("metadata."), value.lstrip("=")))

    def matches(obj: Mapping[str, Any]) -> bool:
        metadata = obj.get("metadata", {})
        return all(metadata.get(key) == value for key, value in wanted)

    return matches


@dataclass(frozen=True, slots=True)
class _Change:
    """One change in the history: the object before (None: created) and after (for a
    deletion, its last state at the deletion's resourceVersion)."""

    resource_version: int
    resource: str
    namespace: str
    old: dict[str, Any] | None
    new: dict[str, Any]
    deleted: bool = False


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """A request the server answered (for tests' assertions)."""

    method: str
    path: str
    query: Mapping[str, str]
    watch: bool
    time_s: float  # time.monotonic() at arrival


@dataclass(slots=True)
class _Watch:
    """What a watch stream needs to know about the server's signals since it started."""

    resource: str
    drop_generation: int
    bookmark_generation: int
    socket: socket.socket | None = None


def _timestamp() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


@dataclass
class FakeKubeApi:
    """The fake API server. Use as a context manager, or :meth:`start` / :meth:`stop`.

    Args:
        namespace: the default namespace of the helpers and the kubeconfig.
        token: bearer token every request must carry (written into the kubeconfig).
        bookmark_interval_s: send a BOOKMARK this often on watches that allow them (None:
            only on :meth:`send_bookmarks`).
        gone_as_status: answer a watch from an expired resourceVersion with HTTP 410 rather
            than a 410 ERROR event in a 200 stream.
    """

    namespace: str = "default"
    token: str = "fake-token"
    bookmark_interval_s: float | None = None
    gone_as_status: bool = False
    port: int = 0
    requests: deque[RequestRecord] = field(default_factory=lambda: deque(maxlen=10_000))

    def __post_init__(self) -> None:
        self._cond = threading.Condition()
        self._objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self._history: list[_Change] = []
        self._resource_version = 1
        self._compacted = 0  # a watch from before this resourceVersion is expired
        self._drop_generation = 0
        self._bookmark_generation = 0
        self._watches: list[_Watch] = []
        self._watch_gate = threading.Event()
        self._watch_gate.set()
        self._failures: list[int] = []  # statuses for the next requests
        self._stopping = False
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle --------------------------------------------------------------------------

    def __enter__(self) -> FakeKubeApi:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> None:
        """Serve on 127.0.0.1 (``port`` 0: a free one, stored in :attr:`port`)."""
        api = self

        class Handler(_Handler):
            server_api = api

        server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        server.daemon_threads = True
        self.port = server.server_address[1]
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        """End every stream and stop serving."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._watch_gate.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def write_kubeconfig(self, path: str | Path) -> Path:
        """A kubeconfig for this server (plain HTTP, the bearer token, the default namespace)."""
        path = Path(path)
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
            "users": [{"name": "fake", "user": {"token": self.token}}],
            "contexts": [
                {
                    "name": "fake",
                    "context": {"cluster": "fake", "user": "fake", "namespace": self.namespace},
                }
            ],
            "current-context": "fake",
        }
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return path

    # -- state ------------------------------------------------------------------------------

    @property
    def resource_version(self) -> int:
        with self._cond:
            return self._resource_version

    def num_watches(self, resource: str | None = None) -> int:
        """Watch streams open now (of ``resource``: ``pods`` or ``inferencepools``)."""
        with self._cond:
            return sum(1 for w in self._watches if resource is None or w.resource == resource)

    def get(self, resource: str, name: str, namespace: str | None = None) -> dict[str, Any]:
        """A copy of one object (KeyError when absent)."""
        with self._cond:
            return json.loads(
                json.dumps(self._objects[(resource, namespace or self.namespace, name)])
            )

    def _commit(
        self, resource: str, namespace: str, name: str, new: dict[str, Any] | None
    ) -> dict[str, Any] | None:
        """Store (or delete, ``new`` None) an object as one change; the caller holds the lock."""
        key = (resource, namespace, name)
        old = self._objects.get(key)
        self._resource_version += 1
        rv = str(self._resource_version)
        if new is None:
            if old is None:
                raise KeyError(f"{resource} {namespace}/{name} does not exist")
            del self._objects[key]
            gone = json.loads(json.dumps(old))
            gone["metadata"]["resourceVersion"] = rv
            change = _Change(self._resource_version, resource, namespace, old, gone, deleted=True)
            self._history.append(change)
            self._cond.notify_all()
            return None
        new["metadata"]["resourceVersion"] = rv
        self._objects[key] = new
        self._history.append(_Change(self._resource_version, resource, namespace, old, new))
        self._cond.notify_all()
        return json.loads(json.dumps(new))

    def _modify(
        self,
        resource: str,
        name: str,
        namespace: str | None,
        change: Callable[[dict[str, Any]], None],
    ) -> dict[str, Any]:
        namespace = namespace or self.namespace
        with self._cond:
            current = self._objects.get((resource, namespace, name))
            if current is None:
                raise KeyError(f"{resource} {namespace}/{name} does not exist")
            updated = json.loads(json.dumps(current))
            change(updated)
            result = self._commit(resource, namespace, name, updated)
            assert result is not None
            return result

    # -- pods -------------------------------------------------------------------------------

    def add_pod(
        self,
        name: str,
        ip: str | None,
        labels: Mapping[str, str] | None = None,
        *,
        ready: bool = True,
        annotations: Mapping[str, str] | None = None,
        namespace: str | None = None,
    ) -> dict[str, Any]:
        """Create a running pod (``ip`` None: not scheduled yet). Returns the object."""
        namespace = namespace or self.namespace
        pod: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "uid": str(uuid.uuid4()),
                "labels": dict(labels or {}),
                "annotations": dict(annotations or {}),
                "creationTimestamp": _timestamp(),
            },
            "spec": {"containers": [{"name": "vllm", "image": "vllm/vllm-openai"}]},
            "status": {"phase": "Running" if ip else "Pending"},
        }
        _set_ip(pod, ip)
        _set_ready(pod, ready)
        with self._cond:
            if (PODS, namespace, name) in self._objects:
                raise KeyError(f"pod {namespace}/{name} exists")
            result = self._commit(PODS, namespace, name, pod)
            assert result is not None
            return result

    def update_pod(
        self,
        name: str,
        *,
        ready: bool | None = None,
        ip: str | None = "",
        labels: Mapping[str, str] | None = None,
        annotations: Mapping[str, str] | None = None,
        namespace: str | None = None,
    ) -> dict[str, Any]:
        """Change a pod's readiness, IP (None: none; "": unchanged), labels or annotations."""

        def change(pod: dict[str, Any]) -> None:
            if ready is not None:
                _set_ready(pod, ready)
            if ip != "":
                _set_ip(pod, ip)
            if labels is not None:
                pod["metadata"]["labels"] = dict(labels)
            if annotations is not None:
                pod["metadata"]["annotations"] = dict(annotations)

        return self._modify(PODS, name, namespace, change)

    def set_pod_ready(self, name: str, ready: bool, namespace: str | None = None) -> dict[str, Any]:
        return self.update_pod(name, ready=ready, namespace=namespace)

    def terminate_pod(self, name: str, namespace: str | None = None) -> dict[str, Any]:
        """Graceful deletion begins: ``deletionTimestamp`` is set; the pod is still Ready, as
        until its containers stop. :meth:`remove_pod` ends it."""

        def change(pod: dict[str, Any]) -> None:
            pod["metadata"]["deletionTimestamp"] = _timestamp()
            pod["metadata"]["deletionGracePeriodSeconds"] = 30

        return self._modify(PODS, name, namespace, change)

    def remove_pod(self, name: str, namespace: str | None = None) -> None:
        """The pod object is gone (a DELETED event)."""
        with self._cond:
            self._commit(PODS, namespace or self.namespace, name, None)

    # -- InferencePools ---------------------------------------------------------------------

    def apply_pool(
        self,
        name: str,
        selector: Mapping[str, str],
        target_ports: Sequence[int],
        namespace: str | None = None,
        group: str = POOL_GROUP,
    ) -> dict[str, Any]:
        """Create or update an InferencePool: ``inference.networking.k8s.io/v1``, or with
        ``group=ALPHA_POOL_GROUP`` the older ``v1alpha2`` (at most one target port: its
        ``targetPortNumber``; none leaves it out, an invalid pool)."""
        namespace = namespace or self.namespace
        resource = _POOL_RESOURCES[group]
        spec: dict[str, Any]
        if resource == POOLS:
            spec = {
                "selector": {"matchLabels": dict(selector)},
                "targetPorts": [{"number": port} for port in target_ports],
                "endpointPickerRef": {
                    "kind": "Service",
                    "name": "kv-picker",
                    "port": {"number": 9002},
                },
            }
        else:
            if len(target_ports) > 1:
                raise ValueError("a v1alpha2 InferencePool has one target port")
            spec = {
                "selector": dict(selector),
                "extensionRef": {"kind": "Service", "name": "kv-picker", "portNumber": 9002},
            }
            if target_ports:
                spec["targetPortNumber"] = target_ports[0]
        with self._cond:
            current = self._objects.get((resource, namespace, name))
            if current is None:
                pool: dict[str, Any] = {
                    "apiVersion": _KINDS[resource][0],
                    "kind": "InferencePool",
                    "metadata": {
                        "name": name,
                        "namespace": namespace,
                        "uid": str(uuid.uuid4()),
                        "creationTimestamp": _timestamp(),
                        "generation": 1,
                    },
                    "spec": spec,
                }
            else:
                pool = json.loads(json.dumps(current))
                pool["spec"] = spec
                pool["metadata"]["generation"] = pool["metadata"].get("generation", 1) + 1
            result = self._commit(resource, namespace, name, pool)
            assert result is not None
            return result

    def delete_pool(self, name: str, namespace: str | None = None, group: str = POOL_GROUP) -> None:
        resource = _POOL_RESOURCES[group]
        with self._cond:
            self._commit(resource, namespace or self.namespace, name, None)

    # -- failures ---------------------------------------------------------------------------

    def compact(self) -> int:
        """Forget the history: a watch from a resourceVersion before now gets 410 Gone.

        Returns:
            The current resourceVersion (a watch from it is still served).
        """
        with self._cond:
            self._compacted = self._resource_version
            self._history.clear()
            return self._resource_version

    def drop_watches(self) -> None:
        """Cut every open watch stream mid-flight (no end chunk): the connection resets."""
        with self._cond:
            self._drop_generation += 1
            for watch in self._watches:
                if watch.socket is not None:
                    with contextlib.suppress(OSError):
                        watch.socket.shutdown(socket.SHUT_RDWR)
            self._cond.notify_all()

    @contextlib.contextmanager
    def hold_watches(self) -> Iterator[None]:
        """While inside, new watch requests wait before they are answered."""
        self._watch_gate.clear()
        try:
            yield
        finally:
            self._watch_gate.set()

    def fail_requests(self, count: int, status: int = 500) -> None:
        """Answer the next ``count`` requests with ``status`` (an API server in trouble)."""
        with self._cond:
            self._failures.extend([status] * count)

    def _take_failure(self) -> int | None:
        with self._cond:
            return self._failures.pop(0) if self._failures else None

    def send_bookmarks(self) -> None:
        """A BOOKMARK at the current resourceVersion on every watch that allows them."""
        with self._cond:
            self._bookmark_generation += 1
            self._cond.notify_all()

    # -- serving (handler threads) ----------------------------------------------------------

    def _list(
        self, resource: str, namespace: str, label: Callable[..., bool], fields: Callable[..., bool]
    ) -> dict[str, Any]:
        with self._cond:
            items = [
                json.loads(json.dumps(obj))
                for (kind, ns, _), obj in sorted(self._objects.items())
                if kind == resource and ns == namespace and _selected(obj, label, fields)
            ]
            version = self._resource_version
        api_version, kind = _KINDS[resource]
        for item in items:  # items of a list carry no kind of their own
            item.pop("apiVersion", None)
            item.pop("kind", None)
        return {
            "apiVersion": api_version,
            "kind": f"{kind}List",
            "metadata": {"resourceVersion": str(version)},
            "items": items,
        }

    def _watch(
        self,
        handler: _Handler,
        resource: str,
        namespace: str,
        label: Callable[..., bool],
        fields: Callable[..., bool],
        since: str | None,
        bookmarks: bool,
        timeout_s: float | None,
    ) -> None:
        """Serve one watch stream until it times out, is dropped, or the server stops."""
        self._watch_gate.wait()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        start = since or "0"
        if not start.isdigit():
            handler.send_json(
                HTTPStatus.BAD_REQUEST, _status(400, "BadRequest", "bad resourceVersion")
            )
            return
        with self._cond:
            expired = start != "0" and int(start) < self._compacted
            if expired and self.gone_as_status:
                message = f"too old resource version: {start} ({self._compacted})"
                handler.send_json(HTTPStatus.GONE, _status(410, "Expired", message))
                return
            watch = _Watch(
                resource, self._drop_generation, self._bookmark_generation, handler.connection
            )
            self._watches.append(watch)
            if start == "0":
                cursor = self._resource_version
                initial = [
                    {"type": "ADDED", "object": json.loads(json.dumps(obj))}
                    for (kind, ns, _), obj in sorted(self._objects.items())
                    if kind == resource and ns == namespace and _selected(obj, label, fields)
                ]
            else:
                cursor = int(start)
                initial = []
        try:
            handler.start_stream()
            if expired:
                message = f"too old resource version: {start} ({self._compacted})"
                handler.send_line({"type": "ERROR", "object": _status(410, "Expired", message)})
                handler.end_stream()
                return
            for event in initial:
                handler.send_line(event)
            last_bookmark = time.monotonic()
            while True:
                with self._cond:
                    while True:
                        if self._stopping or watch.drop_generation != self._drop_generation:
                            raise _Dropped
                        pending = [c for c in self._history if c.resource_version > cursor]
                        now = time.monotonic()
                        bookmark_due = bookmarks and (
                            watch.bookmark_generation != self._bookmark_generation
                            or (
                                self.bookmark_interval_s is not None
                                and now - last_bookmark >= self.bookmark_interval_s
                            )
                        )
                        if pending or bookmark_due or (deadline is not None and now >= deadline):
                            break
                        if handler.peer_closed():
                            raise _Dropped
                        wait_s = 0.2 if deadline is None else min(0.2, deadline - now)
                        if self.bookmark_interval_s is not None and bookmarks:
                            wait_s = min(wait_s, self.bookmark_interval_s)
                        self._cond.wait(max(0.001, wait_s))
                    events = []
                    for change in pending:
                        cursor = change.resource_version
                        if change.resource == resource and change.namespace == namespace:
                            event = _event_for(change, label, fields)
                            if event is not None:
                                events.append(event)
                    if bookmark_due:
                        cursor = max(cursor, self._resource_version)
                        watch.bookmark_generation = self._bookmark_generation
                        api_version, kind = _KINDS[resource]
                        events.append(
                            {
                                "type": "BOOKMARK",
                                "object": {
                                    "apiVersion": api_version,
                                    "kind": kind,
                                    "metadata": {"resourceVersion": str(cursor)},
                                },
                            }
                        )
                        last_bookmark = now
                for event in events:
                    handler.send_line(event)
                if not events and deadline is not None and time.monotonic() >= deadline:
                    handler.end_stream()
                    return
        except _Dropped:
            handler.abort()
        except OSError:
            handler.close_connection = True
        finally:
            with self._cond:
                self._watches.remove(watch)


class _Dropped(Exception):
    pass


def _selected(
    obj: Mapping[str, Any], label: Callable[..., bool], fields: Callable[..., bool]
) -> bool:
    return label(obj.get("metadata", {}).get("labels") or {}) and fields(obj)


def _event_for(
    change: _Change, label: Callable[..., bool], fields: Callable[..., bool]
) -> dict[str, Any] | None:
    """The event a watch with these selectors sees for one change (None: nothing)."""
    was = change.old is not None and _selected(change.old, label, fields)
    if change.deleted:
        return {"type": "DELETED", "object": change.new} if was else None
    now = _selected(change.new, label, fields)
    if now:
        return {"type": "MODIFIED" if was else "ADDED", "object": change.new}
    return {"type": "DELETED", "object": change.new} if was else None


def _set_ip(pod: dict[str, Any], ip: str | None) -> None:
    status = pod["status"]
    if ip:
        status["podIP"] = ip
        status["podIPs"] = [{"ip": ip}]
        status["phase"] = "Running"
    else:
        status.pop("podIP", None)
        status.pop("podIPs", None)


def _set_ready(pod: dict[str, Any], ready: bool) -> None:
    value = "True" if ready else "False"
    now = _timestamp()
    pod["status"]["conditions"] = [
        {"type": "PodScheduled", "status": "True", "lastTransitionTime": now},
        {"type": "ContainersReady", "status": value, "lastTransitionTime": now},
        {"type": "Ready", "status": value, "lastTransitionTime": now},
    ]


class _Handler(BaseHTTPRequestHandler):
    """One connection; list and get answered whole, watches streamed in chunks."""

    protocol_version = "HTTP/1.1"
    server_api: FakeKubeApi

    def log_message(self, format: str, *args: Any) -> None:
        pass  # tests read FakeKubeApi.requests instead

    def do_GET(self) -> None:
        api = self.server_api
        parts = urlsplit(self.path)
        query = {key: values[-1] for key, values in parse_qs(parts.query).items()}
        watch = query.get("watch", "").lower() in ("true", "1")
        api.requests.append(RequestRecord("GET", parts.path, query, watch, time.monotonic()))
        if self.headers.get("Authorization", "") != f"Bearer {api.token}":
            self.send_json(HTTPStatus.UNAUTHORIZED, _status(401, "Unauthorized", "Unauthorized"))
            return
        failure = api._take_failure()
        if failure is not None:
            status = HTTPStatus(failure)
            self.send_json(status, _status(failure, status.phrase.replace(" ", ""), "injected"))
            return
        route = _route(parts.path)
        if route is None:
            self.send_json(HTTPStatus.NOT_FOUND, _status(404, "NotFound", f"no route {parts.path}"))
            return
        resource, namespace, name = route
        try:
            label = _label_matcher(query.get("labelSelector", ""))
            fields = _field_matcher(query.get("fieldSelector", ""))
        except SelectorError as exc:
            self.send_json(HTTPStatus.BAD_REQUEST, _status(400, "BadRequest", str(exc)))
            return
        if name is not None:
            try:
                obj = api.get(resource, name, namespace)
            except KeyError:
                message = f'{resource} "{name}" not found'
                self.send_json(HTTPStatus.NOT_FOUND, _status(404, "NotFound", message))
                return
            self.send_json(HTTPStatus.OK, obj)
            return
        if watch:
            timeout = query.get("timeoutSeconds")
            api._watch(
                self,
                resource,
                namespace,
                label,
                fields,
                query.get("resourceVersion"),
                query.get("allowWatchBookmarks", "").lower() == "true",
                float(timeout) if timeout else None,
            )
            return
        self.send_json(HTTPStatus.OK, api._list(resource, namespace, label, fields))

    def send_json(self, status: HTTPStatus, body: Mapping[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def start_stream(self) -> None:
        self.send_response(HTTPStatus.OK)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        self.wfile.flush()

    def send_line(self, event: Mapping[str, Any]) -> None:
        data = json.dumps(event).encode() + b"\n"
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def end_stream(self) -> None:
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()
        self.close_connection = True

    def peer_closed(self) -> bool:
        """The client went away (it closed its end; a watch client sends nothing else)."""
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and not self.connection.recv(1, socket.MSG_PEEK)
        except (OSError, ValueError):
            return True

    def abort(self) -> None:
        """Cut the connection without ending the chunked body."""
        self.close_connection = True
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)


def _route(path: str) -> tuple[str, str, str | None] | None:
    """(resource, namespace, name or None) of an API path this server serves."""
    for prefix, resource in _PREFIXES.items():
        if path.startswith(prefix):
            parts = path[len(prefix) :].strip("/").split("/")
            plural = resource.split(".", 1)[0]
            if len(parts) == 2 and parts[1] == plural:
                return resource, parts[0], None
            if len(parts) == 3 and parts[1] == plural:
                return resource, parts[0], parts[2]
    return None
