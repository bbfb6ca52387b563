"""Pods come and go in the (fake) Kubernetes API while requests flow through real Envoy and
kv-picker to simulated endpoints.

Every simulated endpoint listens on 127.0.0.1 with a port of its own, so every pod has the IP
127.0.0.1 and the pool lists all their ports; each pod's ``llm-d.ai/active-ports`` annotation
names its own, so (pod IP, target port) is one endpoint per pod. A pod re-created with a
reused IP is a new pod (new uid) at the same address.

What must hold:
- no request fails except those sent to an endpoint that was killed (cut in flight, or routed
  to it in the moment between its death and the picker noticing);
- once the picker's endpoint set has dropped a pod that stopped serving (NotReady,
  terminating, killed), no request sent after that is routed to it; and the picker drops it
  within one watch event of the change (bounded here by 1 s; the measured times are printed
  and recorded as test properties).
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest

from kv_picker.api import admin_pb2, admin_pb2_grpc
from kv_picker_bench.localstack import LocalStack, envoy_bootstrap, free_port
from kv_picker_bench.sim.kube_api import FakeKubeApi
from kv_picker_bench.workloads import words
from tests.integration.conftest import post

NS = "llm"
APP = {"app": "vllm"}
ACTIVE_PORTS = "llm-d.ai/active-ports"
SERVED_BY = "x-kv-picker-sim-endpoint"
UPSTREAM = "x-upstream-host"
WORKERS = 4
# One watch event reaches the picker in milliseconds; the bound leaves room for a loaded CI.
MAX_EVENT_TO_ROUTING_S = 1.0


@dataclass
class Outcome:
    sent_s: float
    ended_s: float
    status: int
    served_by: str
    upstream: str


@dataclass
class Traffic:
    """Worker threads sending requests through Envoy until stopped (bounded in time)."""

    url: str
    outcomes: list[Outcome] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self, max_s: float = 40.0) -> None:
        deadline = time.monotonic() + max_s
        for worker in range(WORKERS):
            thread = threading.Thread(target=self._work, args=(worker, deadline), daemon=True)
            thread.start()
            self.threads.append(thread)

    def _work(self, worker: int, deadline: float) -> None:
        rng = random.Random(worker)
        while not self.stop.is_set() and time.monotonic() < deadline:
            body = {"model": "sim-model", "prompt": words(rng, 60), "max_tokens": 6}
            sent = time.monotonic()
            reply = post(self.url + "/v1/completions", body, timeout_s=10.0)
            outcome = Outcome(
                sent,
                time.monotonic(),
                reply.status,
                reply.headers.get(SERVED_BY, ""),
                reply.headers.get(UPSTREAM, ""),
            )
            with self.lock:
                self.outcomes.append(outcome)

    def finish(self) -> list[Outcome]:
        self.stop.set()
        for thread in self.threads:
            thread.join(15.0)
        return list(self.outcomes)


class PickerView:
    """Polls the picker's Admin ListEndpoints: when did each address become routable (in the
    store and ready) or stop being so."""

    def __init__(self, admin_port: int) -> None:
        self._channel = grpc.insecure_channel(f"127.0.0.1:{admin_port}")
        self._stub = admin_pb2_grpc.AdminStub(self._channel)
        self.changes: list[tuple[float, frozenset[str]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        last: frozenset[str] | None = None
        while not self._stop.is_set():
            reply = self._stub.ListEndpoints(admin_pb2.ListEndpointsRequest(), timeout=5)
            now = time.monotonic()
            routable = frozenset(e.address for e in reply.endpoints if e.ready)
            if routable != last:
                self.changes.append((now, routable))
                last = routable
            time.sleep(0.002)

    def when(self, condition: Callable[[frozenset[str]], bool], after_s: float) -> float | None:
        """The first time after ``after_s`` that the routable set met ``condition``."""
        previous: tuple[float, frozenset[str]] | None = None
        for at, routable in self.changes:
            if at >= after_s and condition(routable):
                # Already true before after_s: it held at after_s.
                if previous is not None and previous[0] < after_s and condition(previous[1]):
                    return after_s
                return at
            previous = (at, routable)
        return None

    def wait(self, condition: Callable[[frozenset[str]], bool], after_s: float, what: str) -> float:
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            at = self.when(condition, after_s)
            if at is not None:
                return at
            time.sleep(0.005)
        raise AssertionError(f"the picker never saw {what}: {self.changes[-3:]}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
        self._channel.close()


@pytest.fixture(scope="module")
def kube() -> Iterator[FakeKubeApi]:
    with FakeKubeApi(namespace=NS) as api:
        yield api


def start_stack(kube: FakeKubeApi, workdir: Path) -> LocalStack:
    kubeconfig = kube.write_kubeconfig(workdir / "kubeconfig")
    discovery = {
        "kubernetes": {
            "namespace": NS,
            "inferencePool": "pool",
            "kubeconfig": str(kubeconfig),
            "backoffInitial": "20ms",
            "backoffMax": "500ms",
        }
    }
    stack = LocalStack(
        sims=4,
        picker_config={"metrics": {"scrapeInterval": "50ms"}},
        time_scale=0.05,
        discovery=discovery,
        workdir=workdir / "stack",
    )
    try:
        stack.start_sims()
        ports = [int(a.rsplit(":", 1)[1]) for a in stack.sim_addresses]
        kube.apply_pool("pool", APP, ports)
        for i in range(3):  # the fourth pod joins later
            kube.add_pod(f"p{i}", "127.0.0.1", APP, annotations={ACTIVE_PORTS: str(ports[i])})
        stack.start_picker(min_ready=3)
        # Envoy as the stack starts it, plus the upstream host on every response, local
        # replies for upstream failures included, so that a failure names its endpoint.
        stack.envoy_port, stack.envoy_admin_port = free_port(), free_port()
        bootstrap = envoy_bootstrap(
            stack.envoy_port, stack.envoy_admin_port, stack.picker_grpc_port
        )
        listener = bootstrap["static_resources"]["listeners"][0]
        manager = listener["filter_chains"][0]["filters"][0]["typed_config"]
        manager["route_config"]["virtual_hosts"][0]["response_headers_to_add"] = [
            {"header": {"key": UPSTREAM, "value": "%UPSTREAM_HOST%"}}
        ]
        stack.envoy = stack.launch_envoy("envoy", bootstrap, stack.envoy_admin_port)
    except BaseException:
        stack.close()
        raise
    return stack


def test_pods_churn_while_requests_flow(
    kube: FakeKubeApi, tmp_path: Path, record_property: Callable[[str, Any], None]
) -> None:
    stack = start_stack(kube, tmp_path)
    view = PickerView(stack.picker_admin_port)
    traffic = Traffic(stack.url)
    address = stack.sim_addresses
    ports = [int(a.rsplit(":", 1)[1]) for a in address]
    delays_ms: dict[str, float] = {}
    # Per address: windows (from, to) in which it must not be routed to, and kill times.
    forbidden: dict[str, list[tuple[float, float]]] = {a: [] for a in address}
    killed_at: dict[str, float] = {}

    def timed(name: str, event_s: float, seen_s: float) -> None:
        delays_ms[name] = round((seen_s - event_s) * 1000, 1)

    try:
        traffic.start()
        time.sleep(0.8)  # every endpoint warm

        # 1. A new pod: created NotReady (no traffic), then Ready.
        kube.add_pod("p3", "127.0.0.1", APP, ready=False, annotations={ACTIVE_PORTS: str(ports[3])})
        time.sleep(0.3)
        assert address[3] not in view.changes[-1][1]
        event = time.monotonic()
        kube.set_pod_ready("p3", True)
        timed("pod Ready -> routable", event, view.wait(lambda r: address[3] in r, event, "p3"))
        time.sleep(0.6)

        # 2. NotReady: no new requests; the process lives on, so its in-flight ones finish.
        event = time.monotonic()
        kube.set_pod_ready("p1", False)
        gone = view.wait(lambda r: address[1] not in r, event, "p1 NotReady")
        timed("pod NotReady -> not routed", event, gone)
        time.sleep(0.6)
        event = time.monotonic()
        kube.set_pod_ready("p1", True)
        back = view.wait(lambda r: address[1] in r, event, "p1 Ready again")
        forbidden[address[1]].append((gone, event))
        time.sleep(0.6)

        # 3. Graceful deletion: terminating, drained, then killed and removed.
        event = time.monotonic()
        kube.terminate_pod("p2")
        terminated = view.wait(lambda r: address[2] not in r, event, "p2 terminating")
        timed("pod terminating -> not routed", event, terminated)
        time.sleep(0.5)  # its in-flight requests finish (a preStop delay)
        killed_at[address[2]] = time.monotonic()
        stack.stop_sim(2)
        kube.remove_pod("p2")
        time.sleep(0.4)

        # 4. A crash: killed first, marked NotReady by the API a moment later.
        killed_at[address[0]] = event = time.monotonic()
        stack.stop_sim(0)
        time.sleep(0.2)
        kube.set_pod_ready("p0", False)
        gone = view.wait(lambda r: address[0] not in r, event, "p0 killed")
        timed("endpoint killed -> not routed (scrape or watch)", event, gone)
        forbidden[address[0]].append((gone, float("inf")))
        time.sleep(0.4)

        # 5. p2 re-created: a new pod with the old IP (and port), a new process behind it.
        stack.restart_sim(2)
        event = time.monotonic()
        kube.add_pod("p2b", "127.0.0.1", APP, annotations={ACTIVE_PORTS: str(ports[2])})
        again = view.wait(lambda r: address[2] in r, event, "p2b")
        timed("re-created pod (reused IP) -> routable", event, again)
        forbidden[address[2]].append((terminated, event))
        time.sleep(0.8)
    finally:
        outcomes = traffic.finish()
        view.close()
        stack.close()

    served = {a: [o for o in outcomes if o.served_by == a] for a in address}
    print("\nevent -> routing change (ms):", json.dumps(delays_ms, indent=1))
    print(f"requests: {len(outcomes)}, by endpoint:", {a: len(s) for a, s in served.items()})
    for name, delay_ms in delays_ms.items():
        record_property(name, delay_ms)
    assert all(delay_ms / 1000 < MAX_EVENT_TO_ROUTING_S for delay_ms in delays_ms.values())

    # Traffic reached the pods while they served, including the added and re-created ones.
    assert any(o.sent_s > back for o in served[address[1]])
    assert any(o.sent_s > again for o in served[address[2]])
    assert served[address[3]]

    # Nothing routed to a pod after the picker dropped it: a request sent after the drop was
    # seen and answered before the pod came back was picked while it was out.
    for a, windows in forbidden.items():
        for start, end in windows:
            late = [o for o in served[a] if start < o.sent_s and o.ended_s < end]
            assert not late, (
                f"{len(late)} requests sent to {a} (pod {address.index(a)}) after it was dropped "
                f"at {start:.3f} (until {end:.3f}): {late[:3]}; the picker's view around then: "
                f"{[(round(at, 3), sorted(r)) for at, r in view.changes if abs(at - start) < 1]}"
            )

    # Failures only on killed endpoints, and only from their death on.
    failures = [o for o in outcomes if o.status != 200]
    for o in failures:
        assert o.upstream in killed_at, f"a request failed on {o.upstream or 'no endpoint'}: {o}"
        assert o.ended_s >= killed_at[o.upstream]
    in_flight = sum(1 for o in failures if o.sent_s < killed_at[o.upstream])
    print(
        f"failed: {len(failures)} of {len(outcomes)}, all on killed endpoints: {in_flight} sent "
        f"before the kill began, {len(failures) - in_flight} after it, before the picker noticed"
    )
    record_property("requests", len(outcomes))
    record_property("failed requests", len(failures))
