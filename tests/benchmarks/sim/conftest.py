"""Fixtures for the simulated endpoint's tests: in-process endpoints and an HTTP client."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import aiohttp
import pytest

from kv_picker_bench.sim import SimEndpoint, SimEndpointConfig, start_sim_endpoint
from kv_picker_bench.sim.cache import StoredBlock

# Fast enough for tests (a 20 ms model step sleeps 0.2 ms) while keeping steps ordered in time.
TEST_TIME_SCALE = 0.01

StartEndpoint = Callable[..., Awaitable[SimEndpoint]]


@pytest.fixture
async def start_endpoint() -> AsyncIterator[StartEndpoint]:
    """Starts endpoints on 127.0.0.1 with free ports; stops them and checks for leaked tasks."""
    started: list[SimEndpoint] = []
    before = asyncio.all_tasks()

    async def start(**overrides: object) -> SimEndpoint:
        fields: dict[str, object] = {"port": 0, "time_scale": TEST_TIME_SCALE}
        fields.update(overrides)
        endpoint = await start_sim_endpoint(SimEndpointConfig(**fields))  # type: ignore[arg-type]
        started.append(endpoint)
        return endpoint

    yield start
    for endpoint in started:
        await endpoint.stop()
    await asyncio.sleep(0)
    leaked = [t for t in asyncio.all_tasks() - before - {asyncio.current_task()} if not t.done()]
    assert not leaked, f"tasks left running: {leaked}"


@pytest.fixture
async def endpoint(start_endpoint: StartEndpoint) -> SimEndpoint:
    """One endpoint with the default configuration (fast time scale)."""
    return await start_endpoint()


@pytest.fixture
async def client() -> AsyncIterator[aiohttp.ClientSession]:
    """An HTTP client with a bounded total timeout."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        yield session


@dataclass
class RecordingListener:
    """A cache listener that records every stored block, removed hash and clear."""

    stored: list[StoredBlock] = field(default_factory=list)
    removed: list[int] = field(default_factory=list)
    cleared: int = 0

    def on_stored(self, blocks: Sequence[StoredBlock]) -> None:
        self.stored.extend(blocks)

    def on_removed(self, block_hashes: Sequence[int]) -> None:
        self.removed.extend(block_hashes)

    def on_cleared(self) -> None:
        self.cleared += 1
