"""Pinning the local stack's processes to CPUs: a router on CPUs of its own (``bench live
--router-cpus``), the endpoints and the client on the rest."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from kv_picker_bench.harness.args import UsageError
from kv_picker_bench.harness.live import split_cpus
from kv_picker_bench.localstack import ManagedProcess

linux = pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="Linux only")
ALLOWED = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []

# Prints its own CPUs and, after starting a thread and a child, theirs: all three inherit.
REPORT = """
import os, subprocess, sys, threading
seen = {}
thread = threading.Thread(target=lambda: seen.update(t=sorted(os.sched_getaffinity(0))))
thread.start(); thread.join()
child = subprocess.run([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"],
                       capture_output=True, text=True).stdout.strip()
print("cpus", sorted(os.sched_getaffinity(0)), seen["t"], child, flush=True)
"""


def _report(process: ManagedProcess) -> str:
    deadline = time.monotonic() + 30
    while "cpus" not in process.log_tail() and time.monotonic() < deadline:
        time.sleep(0.02)
    return process.log_tail().strip()


@linux
@pytest.mark.skipif(len(ALLOWED) < 2, reason="needs two CPUs")
def test_a_process_started_on_cpus_runs_there_with_its_threads_and_children(
    tmp_path: Path,
) -> None:
    before = os.sched_getaffinity(0)
    last = ALLOWED[-1]
    pinned = ManagedProcess(
        "pinned", [sys.executable, "-c", REPORT], tmp_path / "p.log", cpus={last}
    )
    free = ManagedProcess("free", [sys.executable, "-c", REPORT], tmp_path / "f.log")
    try:
        assert _report(pinned) == f"cpus [{last}] [{last}] [{last}]"
        assert _report(free) == f"cpus {ALLOWED} {ALLOWED} {ALLOWED}"
    finally:
        pinned.stop()
        free.stop()
    assert os.sched_getaffinity(0) == before  # the starting thread is back where it was


@linux
def test_router_cpus_are_checked_and_leave_the_rest_to_the_endpoints() -> None:
    assert split_cpus(None) == (None, None)
    everything = ",".join(map(str, ALLOWED))
    for text, message in [
        ("one", "expected CPU numbers"),
        ("", "may run on CPUs"),
        (str(max(ALLOWED) + 1000), "may run on CPUs"),
        (everything, "leaves no CPU for the endpoints and the client"),
    ]:
        with pytest.raises(UsageError, match=message):
            split_cpus(text)
    if len(ALLOWED) >= 2:
        assert split_cpus(f"{ALLOWED[0]}") == (frozenset({ALLOWED[0]}), frozenset(ALLOWED[1:]))
