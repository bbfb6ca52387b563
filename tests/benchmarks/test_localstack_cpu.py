"""CPU accounting of the local stack's processes: a managed process is counted with everything
it started, so a live report can say what each router cost the shared host."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from kv_picker_bench.localstack import ManagedProcess, sessions_cpu_s

# A parent that starts a child burning about 0.4 s of CPU, waits for it, then burns as much
# itself and sleeps until stopped: the session's count must hold both.
BURN = """
import subprocess, sys, time
def burn(seconds):
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass
child = subprocess.Popen([sys.executable, "-c", "import time\\n"
    "end = time.process_time() + 0.4\\nwhile time.process_time() < end: pass"])
child.wait()
burn(0.4)
print("burnt", flush=True)
time.sleep(60)
"""


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="CPU accounting reads /proc (Linux)")
def test_a_session_counts_the_process_and_the_children_it_reaped(tmp_path: Path) -> None:
    process = ManagedProcess("burner", [sys.executable, "-c", BURN], tmp_path / "burner.log")
    try:
        deadline = time.monotonic() + 60
        while "burnt" not in process.log_tail() and time.monotonic() < deadline:
            assert process.alive(), process.log_tail()
            time.sleep(0.05)
        counted = sessions_cpu_s([process.process.pid])
        assert counted is not None
        assert 0.75 <= counted[process.process.pid] < 30
        # Another session (this test's own) is not mixed in, and an unknown one counts 0.
        assert sessions_cpu_s([2**22 + 7]) == {2**22 + 7: 0.0}
    finally:
        process.stop()
