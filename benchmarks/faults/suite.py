"""The suite's settings: how big each scenario is (full and quick), the picker config it runs,
and the local stack each scenario starts."""

from __future__ import annotations

import contextlib
import time
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kv_picker.config import DEFAULT_PLUGINS, DEFAULT_PROFILE
from kv_picker_bench.faults.report import ScenarioResult
from kv_picker_bench.localstack import LocalStack

# A small body limit keeps the bodies "at and over the limit" cheap to send thousands of times.
MAX_BODY_BYTES = 256 * 1024
# Simulated model time runs 100x faster: the figures are the gateway's and the picker's.
TIME_SCALE = 0.01


@dataclass(frozen=True)
class Sizes:
    """How much each scenario does. :data:`FULL` is the documented run, :data:`QUICK` the
    subset the test suite runs."""

    load_requests: int = 20_000
    load_connections: int = 64
    kill_connections: int = 16
    kill_downtime_s: float = 2.0
    bad_input_cases: int = 10_000  # per body mode
    bad_input_connections: int = 16
    grpc_body_bytes: int = 50 * 1024 * 1024
    grpc_abandoned_streams: int = 200
    grpc_sequences: int = 500
    flood_prompts: int = 30_000
    flood_lru_blocks: int = 2_000
    flood_connections: int = 32
    valkey_outage_s: float = 10.0
    fail_open_load_s: float = 3.0


FULL = Sizes()
QUICK = Sizes(
    load_requests=600,
    load_connections=64,
    kill_downtime_s=1.0,
    bad_input_cases=250,
    grpc_body_bytes=12 * 1024 * 1024,
    grpc_abandoned_streams=40,
    grpc_sequences=60,
    flood_prompts=900,
    flood_lru_blocks=300,
    valkey_outage_s=1.5,
    fail_open_load_s=1.5,
)


def with_cases(sizes: Sizes, cases: int | None) -> Sizes:
    return sizes if cases is None else replace(sizes, bad_input_cases=cases)


def picker_config(lru_blocks: int | None = None, **sections: Any) -> dict[str, Any]:
    """The built-in default profile, spelled out so that its prefix index's LRU can be set,
    with the suite's body limit."""
    plugins = [dict(p) for p in DEFAULT_PLUGINS]
    if lru_blocks is not None:
        for plugin in plugins:
            if plugin["type"] == "prefix-cache-scorer":
                plugin["parameters"] = {"lruCapacityPerServer": lru_blocks}
    return {
        "server": {"maxBodyBytes": MAX_BODY_BYTES},
        "plugins": plugins,
        "schedulingProfiles": [dict(DEFAULT_PROFILE)],
        **sections,
    }


def stack(sims: int = 2, config: dict[str, Any] | None = None, **options: Any) -> LocalStack:
    """A local stack with the suite's config and time scale (not started)."""
    options.setdefault("time_scale", TIME_SCALE)
    options.setdefault("workdir_prefix", "kv-picker-faults-")
    return LocalStack(sims=sims, picker_config=config or picker_config(), **options)


@contextlib.contextmanager
def scenario(name: str, workdir: Path | None = None) -> Iterator[ScenarioResult]:
    """A result that times itself and records an exception as a failed check, not a crash."""
    result = ScenarioResult(name)
    started = time.monotonic()
    try:
        yield result
    except Exception as exc:  # a scenario that breaks is a finding, reported like the others
        result.check("scenario ran to its end", False)
        result.notes.append(f"{type(exc).__name__}: {exc}"[:2000])
        result.notes.append(traceback.format_exc(limit=4)[-2000:])
    finally:
        result.duration_s = round(time.monotonic() - started, 1)
        result.figures["duration_s"] = result.duration_s
