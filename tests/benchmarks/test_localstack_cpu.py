"""CPU accounting of the local stack's processes: a managed process is counted with everything
it started, so a live report can say what each router cost the shared host."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from kv_picker_bench.localstack import ManagedProcess, tree_cpu_s

# A parent that starts a child burning about 0.4 s of CPU and waits for it, starts another that
# burns as much and stays, burns as much itself, then sleeps until stopped: its count must hold
# all three (the reaped child through the parent's count of its children).
BURN = """
import subprocess, sys, time
BURNER = "import time\\nend = time.process_time() + 0.4\\nwhile time.process_time() < end: pass\\n"
subprocess.Popen([sys.executable, "-c", BURNER]).wait()
stays = subprocess.Popen([sys.executable, "-c", BURNER + "print('done', flush=True)\\n"
                          "time.sleep(60)"], stdout=subprocess.PIPE)
stays.stdout.readline()
end = time.process_time() + 0.4
while time.process_time() < end:
    pass
print("burnt", flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="CPU accounting reads /proc (Linux)")
def test_a_process_counts_with_its_children_reaped_or_alive(tmp_path: Path) -> None:
    process = ManagedProcess("burner", [sys.executable, "-c", BURN], tmp_path / "burner.log")
    try:
        deadline = time.monotonic() + 60
        while "burnt" not in process.log_tail() and time.monotonic() < deadline:
            assert process.alive(), process.log_tail()
            time.sleep(0.05)
        pid = process.process.pid
        counted = tree_cpu_s([pid])
        assert counted is not None
        assert 1.15 <= counted[pid] < 30
        # This test's own process holds the burner and its children below it...
        mine = tree_cpu_s([os.getpid()])
        assert mine is not None and mine[os.getpid()] >= counted[pid]
        # ...unless the burner is asked for too: each process counts once, under the nearest.
        both = tree_cpu_s([os.getpid(), pid])
        assert both is not None and both[pid] == pytest.approx(counted[pid], abs=0.05)
        assert both[os.getpid()] == pytest.approx(mine[os.getpid()] - counted[pid], abs=0.1)
        # A process that is not there counts 0.
        assert tree_cpu_s([2**22 + 7]) == {2**22 + 7: 0.0}
    finally:
        process.stop()
