"""A stream whose picker host refuses the connection is retried on another host, through real
Envoy: the generated configs' ``retry_policy`` on the ext_proc ``grpc_service``.

The ext_proc cluster here lists the picker and a port nothing listens on, with no health checks
or ejection to hide the dead one, so least-request balancing sends about half the streams to
it. The same Envoy config with the retry policy removed shows what the test guards against."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest

from kv_picker_bench.localstack import LocalStack, envoy_bootstrap, free_port
from tests.integration.conftest import post


@pytest.fixture(scope="module")
def stack() -> Iterator[LocalStack]:
    with LocalStack(sims=2, time_scale=0.02, start_envoy=False) as local:
        yield local


def ext_proc_cluster(bootstrap: dict[str, Any]) -> dict[str, Any]:
    (cluster,) = [c for c in bootstrap["static_resources"]["clusters"] if c["name"] == "ext_proc"]
    return dict(cluster)


def ext_proc_service(bootstrap: dict[str, Any]) -> dict[str, Any]:
    manager = bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    (ext_proc,) = [f for f in manager["typed_config"]["http_filters"]
                   if f["name"] == "envoy.filters.http.ext_proc"]  # fmt: skip
    service: dict[str, Any] = ext_proc["typed_config"]["grpc_service"]
    return service


def statuses_through(stack: LocalStack, name: str, retry: bool, count: int) -> list[int]:
    """``count`` requests, one at a time, through an Envoy whose picker cluster has a dead host."""
    port, admin = free_port(), free_port()
    bootstrap = envoy_bootstrap(port, admin, stack.picker_grpc_port)
    assert "retry_policy" in ext_proc_service(bootstrap)  # what the project generates
    if not retry:
        bootstrap = copy.deepcopy(bootstrap)
        del ext_proc_service(bootstrap)["retry_policy"]
    endpoints = ext_proc_cluster(bootstrap)["load_assignment"]["endpoints"][0]["lb_endpoints"]
    dead = copy.deepcopy(endpoints[0])
    dead["endpoint"]["address"]["socket_address"]["port_value"] = free_port()  # nothing listens
    endpoints.append(dead)
    envoy = stack.launch_envoy(name, bootstrap, admin)
    try:
        statuses = []
        for i in range(count):
            body = {"model": "sim-model", "prompt": f"request {i} " * 20, "max_tokens": 2}
            statuses.append(post(f"http://127.0.0.1:{port}/v1/completions", body).status)
        return statuses
    finally:
        envoy.stop()
        stack.processes.remove(envoy)


def test_a_refused_picker_connection_is_retried_on_another_host(stack: LocalStack) -> None:
    assert statuses_through(stack, "envoy-retry", retry=True, count=100) == [200] * 100


def test_without_the_retry_a_refused_connection_is_the_clients_500(stack: LocalStack) -> None:
    """The control: the same cluster without the retry policy fails the streams sent to the
    dead host (each one with probability about one half, so 40 all succeeding is ~1e-12)."""
    statuses = statuses_through(stack, "envoy-no-retry", retry=False, count=40)
    assert set(statuses) == {200, 500}, statuses
