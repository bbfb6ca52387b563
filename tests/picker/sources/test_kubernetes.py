"""Kubernetes discovery through the real ``kubernetes`` client against the fake API server.

The pods' IPs are loopback addresses that nothing listens on: no scraper runs here, the store
only holds them. Each test waits for what it expects with a bounded poll.
"""

from __future__ import annotations

import asyncio
import itertools
import re
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from kv_picker.config import KubernetesDiscoveryConfig
from kv_picker.decode import decode
from kv_picker.endpoint import EndpointId, EndpointSpec
from kv_picker.errors import ConfigError
from kv_picker.metrics import PickerMetrics
from kv_picker.sources.kubernetes import (
    Backoff,
    KubernetesDiscovery,
    PodView,
    PoolSpec,
    endpoint_specs,
)
from kv_picker.state.endpoints import EndpointStore
from kv_picker_bench.sim.kube_api import ALPHA_POOL_GROUP, ALPHA_POOLS, PODS, FakeKubeApi

NS = "llm"
APP = {"app": "vllm"}
ROLE = "llm-d.ai/role"
HARDWARE = "kv-picker.io/hardware-class"


@pytest.fixture
def kube() -> Iterator[FakeKubeApi]:
    with FakeKubeApi(namespace=NS) as api:
        yield api


# On a 2-core host shared with benchmark runs, the first sync (the Kubernetes client's import,
# the list) took more than 5 s; alone it takes well under one.
SYNC_TIMEOUT_S = 20.0


async def wait_for(
    condition: Callable[[], bool], what: str, timeout_s: float = SYNC_TIMEOUT_S
) -> float:
    """Poll until ``condition`` holds; returns the seconds it took (bounded generously: see
    ``SYNC_TIMEOUT_S``)."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        await asyncio.sleep(0.005)
    return time.monotonic() - start


def addresses(store: EndpointStore) -> set[str]:
    return set(store.by_address)


@asynccontextmanager
async def discovering(
    kube: FakeKubeApi, tmp_path: Path, store: EndpointStore | None = None, **settings: Any
) -> AsyncIterator[KubernetesDiscovery]:
    """Discovery running against ``kube``, synced; stopped (and checked stopped) on exit."""
    document = {
        "namespace": NS,
        "kubeconfig": str(kube.write_kubeconfig(tmp_path / "kubeconfig")),
        "backoffInitial": "20ms",
        "backoffMax": "200ms",
        **settings,
    }
    if "selector" not in document and "inferencePool" not in document:
        document["inferencePool"] = "pool"
    config = decode(KubernetesDiscoveryConfig, document, "discovery.kubernetes")
    discovery = KubernetesDiscovery(
        config, store if store is not None else EndpointStore(time.monotonic), PickerMetrics()
    )
    task = asyncio.create_task(discovery.run())
    try:
        await asyncio.wait_for(discovery.synced.wait(), SYNC_TIMEOUT_S)
        yield discovery
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not any(t.name.startswith("k8s-") for t in threading.enumerate())


async def watching(kube: FakeKubeApi, resource: str = PODS) -> None:
    """Wait until the discovery's watch of ``resource`` is open at the server."""
    await wait_for(lambda: kube.num_watches(resource) >= 1, f"a watch of {resource}")


def counter(discovery: KubernetesDiscovery, name: str, **labels: str) -> float:
    value = discovery.metrics.registry.get_sample_value(name, labels)
    return value or 0.0


# -- reading objects, no server -----------------------------------------------------------------


def pod_object(name: str, ip: str | None, *, ready: bool = True, **metadata: Any) -> dict[str, Any]:
    status: dict[str, Any] = {
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]
    }
    if ip:
        status["podIP"] = ip
    return {"metadata": {"name": name, "uid": f"uid-{name}", **metadata}, "status": status}


def test_which_pods_serve_and_their_endpoints() -> None:
    pool = PoolSpec(APP, (8000, 8001))
    pods = [
        PodView.from_object(pod_object("a", "127.0.0.11", labels={**APP, ROLE: "decode"})),
        PodView.from_object(pod_object("b", "127.0.0.12", ready=False, labels=APP)),
        PodView.from_object(pod_object("c", None, labels=APP)),
        PodView.from_object(
            pod_object("d", "127.0.0.14", labels=APP, deletionTimestamp="2026-01-01T00:00:00Z")
        ),
        PodView.from_object(pod_object("e", "127.0.0.15", labels={"app": "other"})),
        PodView.from_object(
            pod_object(
                "f",
                "fd00::7",
                labels=APP,
                annotations={"llm-d.ai/active-ports": "8001,9999"},
            )
        ),
    ]
    assert [p.serving for p in pods] == [True, False, False, False, True, True]
    specs = endpoint_specs(pods, pool)
    assert specs == [
        EndpointSpec("127.0.0.11:8000", {**APP, ROLE: "decode"}, "uid-a"),
        EndpointSpec("127.0.0.11:8001", {**APP, ROLE: "decode"}, "uid-a"),
        EndpointSpec("[fd00::7]:8001", APP, "uid-f"),
    ]


def test_two_pods_claiming_one_address_give_it_to_one() -> None:
    pods = [
        PodView.from_object(pod_object("b", "127.0.0.11", labels=APP)),
        PodView.from_object(pod_object("a", "127.0.0.11", labels=APP)),
    ]
    assert [s.instance for s in endpoint_specs(pods, PoolSpec(APP, (8000,)))] == ["uid-a"]


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ({"targetPorts": [{"number": 8000}]}, "matchLabels"),
        ({"selector": {"matchLabels": APP}}, "targetPorts"),
        ({"selector": {"matchLabels": APP}, "targetPorts": [{"number": 0}]}, "targetPorts"),
        (
            {"selector": {"matchLabels": APP}, "targetPorts": [{"number": 1}, {"number": 1}]},
            "repeated",
        ),
    ],
)
def test_a_malformed_pool_is_refused(spec: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        PoolSpec.from_object({"spec": spec})


def test_a_v1alpha2_pool_reads_as_the_same_pods_and_port() -> None:
    alpha = {"selector": APP, "targetPortNumber": 8000, "extensionRef": {"name": "epp"}}
    v1 = {"selector": {"matchLabels": APP}, "targetPorts": [{"number": 8000}]}
    assert PoolSpec.from_object({"spec": alpha}, "v1alpha2") == PoolSpec(APP, (8000,))
    assert PoolSpec.from_object({"spec": v1}, "v1") == PoolSpec(APP, (8000,))
    # Each version's shape is refused under the other: a pool is never half-read.
    with pytest.raises(ValueError, match=r"spec\.selector must map label names"):
        PoolSpec.from_object({"spec": v1}, "v1alpha2")
    with pytest.raises(ValueError, match=r"spec\.selector\.matchLabels is missing"):
        PoolSpec.from_object({"spec": alpha}, "v1")


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ({"targetPortNumber": 8000}, "spec.selector is missing or empty"),
        ({"selector": {}, "targetPortNumber": 8000}, "spec.selector is missing or empty"),
        (
            {"selector": {"matchLabels": APP}, "targetPortNumber": 8000},
            "spec.selector must map label names to string values",
        ),
        ({"selector": APP}, "spec.targetPortNumber is missing"),
        ({"selector": APP, "targetPortNumber": 0}, "bad port 0"),
        ({"selector": APP, "targetPortNumber": "8000"}, "bad port '8000'"),
        ({"selector": APP, "targetPortNumber": True}, "bad port True"),
    ],
)
def test_a_malformed_v1alpha2_pool_is_refused(spec: dict[str, Any], problem: str) -> None:
    with pytest.raises(ValueError, match=re.escape(problem)):
        PoolSpec.from_object({"spec": spec}, "v1alpha2")


def test_backoff_doubles_up_to_its_cap() -> None:
    import random

    backoff = Backoff(0.1, 1.0)
    rng = random.Random(0)
    delays = [backoff.delay_s(i, rng) for i in range(8)]
    for i, delay in enumerate(delays):
        nominal = min(1.0, 0.1 * 2**i)
        assert nominal / 2 <= delay <= nominal


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({"namespace": NS}, "discovery.kubernetes.inferencePool: give either"),
        (
            {"namespace": NS, "inferencePool": "p", "selector": APP},
            "discovery.kubernetes.inferencePool: give either",
        ),
        ({"namespace": NS, "selector": APP}, "discovery.kubernetes.targetPorts: give 1 to 8"),
        (
            {"namespace": NS, "selector": APP, "targetPorts": list(range(1, 10))},
            "discovery.kubernetes.targetPorts: give 1 to 8",
        ),
        (
            {"namespace": NS, "inferencePool": "p", "targetPorts": [8000]},
            "discovery.kubernetes.targetPorts: comes from the InferencePool",
        ),
        ({"namespace": "", "inferencePool": "p"}, "discovery.kubernetes.namespace"),
        (
            {"namespace": NS, "selector": {}, "targetPorts": [8000]},
            "discovery.kubernetes.selector: must name",
        ),
        (
            {"namespace": NS, "inferencePool": "p", "backoffInitial": "2s", "backoffMax": "1s"},
            "discovery.kubernetes.backoffMax",
        ),
        ({"namespace": NS, "inferencePool": "p", "pool": "x"}, "unknown field(s) pool"),
        (
            {"namespace": NS, "inferencePool": "p", "inferencePoolGroup": "inference.k8s.io"},
            "discovery.kubernetes.inferencePoolGroup",
        ),
        (
            {
                "namespace": NS,
                "selector": APP,
                "targetPorts": [8000],
                "inferencePoolGroup": "inference.networking.x-k8s.io",
            },
            "discovery.kubernetes.inferencePoolGroup: applies to inferencePool only",
        ),
    ],
)
def test_config_errors_name_the_field(document: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(message)):
        decode(KubernetesDiscoveryConfig, document, "discovery.kubernetes")


async def test_missing_credentials_are_a_config_error(tmp_path: Path) -> None:
    config = decode(
        KubernetesDiscoveryConfig,
        {"namespace": NS, "inferencePool": "p", "kubeconfig": str(tmp_path / "absent")},
        "discovery.kubernetes",
    )
    discovery = KubernetesDiscovery(config, EndpointStore(time.monotonic), PickerMetrics())
    with pytest.raises(ConfigError, match=r"discovery\.kubernetes: no usable credentials"):
        await discovery.connect()


# -- through the fake API server --------------------------------------------------------------


async def test_pool_pods_become_endpoints_with_their_labels(
    kube: FakeKubeApi, tmp_path: Path
) -> None:
    kube.apply_pool("pool", APP, [8000, 8001])
    labels = {**APP, ROLE: "prefill", HARDWARE: "A100"}
    a = kube.add_pod("a", "127.0.0.11", labels)
    kube.add_pod("b", "127.0.0.12", APP, ready=False)
    kube.add_pod("c", None, APP)
    kube.add_pod("other", "127.0.0.13", {"app": "other"})
    store = EndpointStore(time.monotonic)
    async with discovering(kube, tmp_path, store) as discovery:
        await wait_for(lambda: len(store) == 2, "pod a's two endpoints")
        await watching(kube)
        for address in ("127.0.0.11:8000", "127.0.0.11:8001"):
            endpoint = store.by_address[address]
            assert endpoint.labels == labels
            assert endpoint.instance == a["metadata"]["uid"]
        # The list and the watch asked for the pool's pods only, the watch with bookmarks and
        # from the list's resourceVersion.
        pod_requests = [r for r in kube.requests if r.path.endswith("/pods")]
        assert {r.query["labelSelector"] for r in pod_requests} == {"app=vllm"}
        watch = next(r for r in pod_requests if r.watch)
        assert watch.query["allowWatchBookmarks"] == "true"
        assert int(watch.query["resourceVersion"]) >= int(a["metadata"]["resourceVersion"])
        assert discovery.synced.is_set()


async def test_selector_mode_without_a_pool(kube: FakeKubeApi, tmp_path: Path) -> None:
    kube.add_pod("a", "127.0.0.11", APP)
    store = EndpointStore(time.monotonic)
    async with discovering(kube, tmp_path, store, selector=APP, targetPorts=[8000]):
        await wait_for(lambda: addresses(store) == {"127.0.0.11:8000"}, "the selected pod")
        assert not any(r.path.endswith("/inferencepools") for r in kube.requests)


async def test_readiness_termination_and_ip_follow_the_pod(
    kube: FakeKubeApi, tmp_path: Path
) -> None:
    kube.apply_pool("pool", APP, [8000])
    kube.add_pod("a", "127.0.0.11", APP)
    kube.add_pod("b", None, APP)
    store = EndpointStore(time.monotonic)
    removed: list[EndpointId] = []
    store.on_removed(removed.append)
    async with discovering(kube, tmp_path, store):
        await wait_for(lambda: addresses(store) == {"127.0.0.11:8000"}, "a")
        a_id = store.by_address["127.0.0.11:8000"].id
        kube.update_pod("b", ip="127.0.0.12")
        await wait_for(lambda: "127.0.0.12:8000" in store.by_address, "b once it has an IP")
        kube.set_pod_ready("a", False)
        await wait_for(lambda: addresses(store) == {"127.0.0.12:8000"}, "a gone when NotReady")
        assert removed == [a_id]
        kube.set_pod_ready("a", True)
        await wait_for(lambda: len(store) == 2, "a back when Ready")
        kube.terminate_pod("b")  # still Ready, but deleting: no new requests
        await wait_for(lambda: addresses(store) == {"127.0.0.11:8000"}, "b gone when terminating")
        kube.remove_pod("b")
        kube.update_pod("a", labels={**APP, ROLE: "decode"})
        await wait_for(
            lambda: store.by_address["127.0.0.11:8000"].labels.get(ROLE) == "decode",
            "a's new label",
        )
        assert len(removed) == 2  # a label change keeps the endpoint


async def test_a_reused_ip_is_a_new_endpoint(kube: FakeKubeApi, tmp_path: Path) -> None:
    kube.apply_pool("pool", APP, [8000])
    first = kube.add_pod("a", "127.0.0.11", APP)
    store = EndpointStore(time.monotonic)
    removed: list[EndpointId] = []
    store.on_removed(removed.append)
    async with discovering(kube, tmp_path, store):
        await wait_for(lambda: len(store) == 1, "a")
        old = store.by_address["127.0.0.11:8000"]
        kube.remove_pod("a")
        second = kube.add_pod("a2", "127.0.0.11", APP)
        await wait_for(
            lambda: (
                "127.0.0.11:8000" in store.by_address
                and store.by_address["127.0.0.11:8000"].instance == second["metadata"]["uid"]
            ),
            "the new pod at the old IP",
        )
        assert old.instance == first["metadata"]["uid"]
        assert removed == [old.id]
        assert store.by_address["127.0.0.11:8000"] is not old


async def test_active_ports_annotation_picks_target_ports(
    kube: FakeKubeApi, tmp_path: Path
) -> None:
    kube.apply_pool("pool", APP, [8000, 8001, 8002])
    kube.add_pod("a", "127.0.0.1", APP, annotations={"llm-d.ai/active-ports": "8000"})
    kube.add_pod(
        "b", "127.0.0.2", APP, annotations={"inference.networking.k8s.io/active-ports": "8001,8002"}
    )
    store = EndpointStore(time.monotonic)
    async with discovering(kube, tmp_path, store):
        await wait_for(
            lambda: addresses(store) == {"127.0.0.1:8000", "127.0.0.2:8001", "127.0.0.2:8002"},
            "each pod on its active ports",
        )


async def test_pool_selector_and_ports_change_at_runtime(kube: FakeKubeApi, tmp_path: Path) -> None:
    kube.apply_pool("pool", APP, [8000])
    kube.add_pod("a", "127.0.0.11", APP)
    kube.add_pod("b", "127.0.0.12", {"app": "next"})
    store = EndpointStore(time.monotonic)
    async with discovering(kube, tmp_path, store) as discovery:
        await wait_for(lambda: addresses(store) == {"127.0.0.11:8000"}, "a")
        kube.apply_pool("pool", APP, [8000, 9000])
        await wait_for(
            lambda: addresses(store) == {"127.0.0.11:8000", "127.0.0.11:9000"}, "the new port"
        )
        kube.apply_pool("pool", {"app": "next"}, [9000])
        await wait_for(lambda: addresses(store) == {"127.0.0.12:9000"}, "the new selector's pod")
        assert counter(
            discovery, "kv_picker_discovery_watch_restarts_total", resource=PODS, reason="changed"
        )
        # Events of the new selection arrive on the new watch.
        kube.add_pod("c", "127.0.0.13", {"app": "next"})
        await wait_for(lambda: "127.0.0.13:9000" in store.by_address, "c")
        kube.delete_pool("pool")
        await wait_for(lambda: len(store) == 0, "no endpoints without the pool")
        kube.apply_pool("pool", APP, [8000])
        await wait_for(lambda: addresses(store) == {"127.0.0.11:8000"}, "the pool again")


async def test_a_v1alpha2_pool_is_followed_when_its_group_is_named(
    kube: FakeKubeApi, tmp_path: Path
) -> None:
    # A pool made before GIE 1.0, next to a v1 pool of the same name with other pods: the
    # discovery reads the group it is told to, and only that one.
    kube.apply_pool("pool", APP, [8000], group=ALPHA_POOL_GROUP)
    kube.apply_pool("pool", {"app": "v1"}, [9000])
    kube.add_pod("a", "127.0.0.11", APP)
    kube.add_pod("b", "127.0.0.12", {"app": "v1"})
    store = EndpointStore(time.monotonic)
    async with discovering(kube, tmp_path, store, inferencePoolGroup=ALPHA_POOL_GROUP) as discovery:
        await wait_for(lambda: addresses(store) == {"127.0.0.11:8000"}, "the v1alpha2 pool's pod")
        assert discovery.description == (
            f"InferencePool {NS}/pool (inference.networking.x-k8s.io/v1alpha2)"
        )
        pool_paths = {r.path for r in kube.requests if "inferencepools" in r.path}
        assert pool_paths == {
            f"/apis/inference.networking.x-k8s.io/v1alpha2/namespaces/{NS}/inferencepools"
        }
        await watching(kube, ALPHA_POOLS)
        kube.apply_pool("pool", {"app": "v1"}, [9001], group=ALPHA_POOL_GROUP)
        await wait_for(lambda: addresses(store) == {"127.0.0.12:9001"}, "the edited selector")
        kube.apply_pool("pool", {"app": "v1"}, [], group=ALPHA_POOL_GROUP)  # no port: invalid
        await asyncio.sleep(0.2)
        assert addresses(store) == {"127.0.0.12:9001"}
        kube.delete_pool("pool", group=ALPHA_POOL_GROUP)
        await wait_for(lambda: len(store) == 0, "no endpoints without the pool")


async def test_an_invalid_pool_edit_keeps_the_last_valid_spec(
    kube: FakeKubeApi, tmp_path: Path
) -> None:
    kube.apply_pool("pool", APP, [8000])
    kube.add_pod("a", "127.0.0.11", APP)
    store = EndpointStore(time.monotonic)
    async with discovering(kube, tmp_path, store) as discovery:
        await wait_for(lambda: addresses(store) == {"127.0.0.11:8000"}, "a")
        kube.apply_pool("pool", APP, [])  # no target ports: not a usable pool
        kube.apply_pool("pool", APP, [8000, 8001])
        await wait_for(lambda: len(store) == 2, "the next valid spec")
        kube.apply_pool("pool", APP, [])
        await asyncio.sleep(0.2)
        assert discovery.pool == PoolSpec(APP, (8000, 8001)) and len(store) == 2


async def test_a_missing_pool_means_no_endpoints_until_it_exists(
    kube: FakeKubeApi, tmp_path: Path
) -> None:
    kube.add_pod("a", "127.0.0.11", APP)
    store = EndpointStore(time.monotonic)
    async with discovering(kube, tmp_path, store) as discovery:
        assert len(store) == 0 and discovery.pool is None
        kube.apply_pool("pool", APP, [8000])
        await wait_for(lambda: len(store) == 1, "the pool's pod once the pool exists")


@pytest.mark.parametrize("gone_as_status", [False, True], ids=["error-event", "http-410"])
async def test_an_expired_resource_version_relists(tmp_path: Path, gone_as_status: bool) -> None:
    with FakeKubeApi(namespace=NS, gone_as_status=gone_as_status) as kube:
        kube.apply_pool("pool", APP, [8000])
        kube.add_pod("a", "127.0.0.11", APP)
        kube.add_pod("b", "127.0.0.12", APP)
        store = EndpointStore(time.monotonic)
        async with discovering(kube, tmp_path, store) as discovery:
            await wait_for(lambda: len(store) == 2, "a and b")
            await watching(kube)
            lists = discovery.watch_stats()[PODS][0]
            with kube.hold_watches():
                kube.drop_watches()
                # Missed while disconnected, then the history is compacted past it.
                kube.remove_pod("a")
                kube.add_pod("c", "127.0.0.13", APP)
                kube.compact()
                await asyncio.sleep(0.1)
                assert len(store) == 2  # nothing seen yet
            await wait_for(
                lambda: addresses(store) == {"127.0.0.12:8000", "127.0.0.13:8000"},
                "the relisted state",
            )
            assert discovery.watch_stats()[PODS][0] == lists + 1
            assert counter(
                discovery, "kv_picker_discovery_watch_restarts_total", resource=PODS, reason="gone"
            )


async def test_a_dropped_stream_resumes_from_its_resource_version(
    kube: FakeKubeApi, tmp_path: Path
) -> None:
    kube.apply_pool("pool", APP, [8000])
    kube.add_pod("a", "127.0.0.11", APP)
    store = EndpointStore(time.monotonic)
    async with discovering(kube, tmp_path, store) as discovery:
        await wait_for(lambda: len(store) == 1, "a")
        await watching(kube)
        # The server sees the watch before the discovery's thread has counted it.
        await wait_for(lambda: discovery.watch_stats()[PODS][1] >= 1, "the watch counted")
        lists, watches, version = discovery.watch_stats()[PODS]
        kube.drop_watches()
        await wait_for(lambda: discovery.watch_stats()[PODS][1] > watches, "a new watch")
        assert discovery.watch_stats()[PODS][0] == lists  # no relist
        rewatch = [r for r in kube.requests if r.watch and r.path.endswith("/pods")][-1]
        assert rewatch.query["resourceVersion"] == version
        kube.add_pod("b", "127.0.0.12", APP)
        await wait_for(lambda: len(store) == 2, "b, on the resumed watch")
        assert counter(
            discovery, "kv_picker_discovery_watch_restarts_total", resource=PODS, reason="dropped"
        )


async def test_a_bookmark_spares_a_relist(kube: FakeKubeApi, tmp_path: Path) -> None:
    kube.apply_pool("pool", APP, [8000])
    kube.add_pod("a", "127.0.0.11", APP)
    store = EndpointStore(time.monotonic)
    async with discovering(kube, tmp_path, store) as discovery:
        await wait_for(lambda: len(store) == 1, "a")
        await watching(kube)
        lists = discovery.watch_stats()[PODS][0]
        for i in range(5):  # changes this watch does not see move the resourceVersion on
            kube.add_pod(f"x{i}", "127.0.0.20", {"app": "other"})
        kube.send_bookmarks()
        current = str(kube.resource_version)
        await wait_for(
            lambda: discovery.watch_stats()[PODS][2] == current, "the bookmark's resourceVersion"
        )
        kube.compact()  # the pre-bookmark resourceVersion would now be 410
        kube.drop_watches()
        kube.add_pod("b", "127.0.0.12", APP)
        await wait_for(lambda: len(store) == 2, "b")
        assert discovery.watch_stats()[PODS][0] == lists
        assert not counter(
            discovery, "kv_picker_discovery_watch_restarts_total", resource=PODS, reason="gone"
        )
        assert counter(
            discovery, "kv_picker_discovery_events_total", resource=PODS, type="BOOKMARK"
        )


async def test_api_errors_back_off_and_recover(kube: FakeKubeApi, tmp_path: Path) -> None:
    kube.add_pod("a", "127.0.0.11", APP)
    store = EndpointStore(time.monotonic)
    async with discovering(kube, tmp_path, store, selector=APP, targetPorts=[8000]) as discovery:
        await wait_for(lambda: len(store) == 1, "a")
        await watching(kube)
        kube.fail_requests(4, status=503)
        started = time.monotonic()
        kube.drop_watches()
        kube.add_pod("b", "127.0.0.12", APP)
        await wait_for(lambda: len(store) == 2, "b after the API recovers")
        attempts = [r.time_s for r in kube.requests if r.time_s >= started]
        assert len(attempts) >= 5
        gaps = [b - a for a, b in itertools.pairwise(attempts)][:4]
        # Delays doubling from 20 ms (capped at 200 ms), each drawn from [d/2, d]: after the
        # four failures at least 20+40+80+160 ms over two, 150 ms in all.
        assert sum(gaps) >= 0.15, gaps
        assert (
            counter(
                discovery, "kv_picker_discovery_watch_restarts_total", resource=PODS, reason="error"
            )
            == 4
        )


async def test_stop_ends_the_watch_threads_promptly(kube: FakeKubeApi, tmp_path: Path) -> None:
    kube.apply_pool("pool", APP, [8000])
    store = EndpointStore(time.monotonic)
    started = time.monotonic()
    async with discovering(kube, tmp_path, store, watchTimeout="5m"):
        await wait_for(lambda: kube.num_watches() == 2, "both watches open")
        started = time.monotonic()
    assert time.monotonic() - started < 2.0  # the blocked reads were cut, not timed out
    await wait_for(lambda: kube.num_watches() == 0, "the server to see the streams end")


async def test_the_server_ending_a_watch_is_renewed_at_once(
    kube: FakeKubeApi, tmp_path: Path
) -> None:
    kube.apply_pool("pool", APP, [8000])
    kube.add_pod("a", "127.0.0.11", APP)
    store = EndpointStore(time.monotonic)
    async with discovering(kube, tmp_path, store, watchTimeout="1s") as discovery:
        await wait_for(lambda: discovery.watch_stats()[PODS][1] >= 3, "renewed watches", 4.0)
        assert discovery.watch_stats()[PODS][0] == 1
        assert counter(
            discovery, "kv_picker_discovery_watch_restarts_total", resource=PODS, reason="ended"
        )
