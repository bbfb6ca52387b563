"""Readings of a running process and of the picker's /metrics, for the fault suite and the soak.

Process figures come from ``/proc`` (Linux): the resident set and the open file descriptors of
one pid. Picker figures come from its Prometheus exposition, parsed once per reading.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from kv_picker_bench.localstack import http_get

MB = 1024 * 1024


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` in bytes (0 when the process is gone)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return 0
    return 0


def open_fds(pid: int) -> int:
    """Open file descriptors of ``pid`` (0 when the process is gone)."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


@dataclass(frozen=True)
class PickerReading:
    """One scrape of the picker's /metrics."""

    status: int
    samples: dict[str, float]  # "name{label=value,...}" and bare names -> value

    def value(self, name: str, default: float = 0.0) -> float:
        return self.samples.get(name, default)

    def total(self, prefix: str) -> float:
        """Sum of every sample whose key starts with ``prefix`` (all label sets of a metric)."""
        return sum(v for k, v in self.samples.items() if k.startswith(prefix))


def read_picker(metrics_port: int, timeout_s: float = 2.0) -> PickerReading:
    """Scrape ``/metrics``; a status of 0 means no answer at all."""
    try:
        status, body = http_get(f"http://127.0.0.1:{metrics_port}/metrics", timeout_s)
    except OSError:
        return PickerReading(0, {})
    samples: dict[str, float] = {}
    if status == 200:
        for family in text_string_to_metric_families(body.decode("utf-8")):
            for sample in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                key = f"{sample.name}{{{labels}}}" if labels else sample.name
                samples[key] = sample.value
    return PickerReading(status, samples)


def in_flight(reading: PickerReading) -> float:
    """Requests the picker counts as routed and not finished: the larger of its total gauge
    and the sum of the per-endpoint gauges (updated at each scrape of the endpoints)."""
    return max(
        reading.value("kv_picker_requests_running"),
        reading.total("kv_picker_endpoint_in_flight_requests"),
    )


def wait_for(check: Callable[[], bool], timeout_s: float, interval_s: float = 0.05) -> float | None:
    """Seconds until ``check()`` held, or None when it did not within ``timeout_s``."""
    started = time.monotonic()
    deadline = started + timeout_s
    while True:
        if check():
            return time.monotonic() - started
        if time.monotonic() >= deadline:
            return None
        time.sleep(interval_s)


def wait_in_flight_zero(metrics_port: int, timeout_s: float = 10.0) -> float | None:
    """Seconds until the picker's in-flight gauge reads 0 (None: it did not)."""
    return wait_for(lambda: in_flight(read_picker(metrics_port)) == 0.0, timeout_s)
