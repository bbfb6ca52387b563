"""Fail-open that still serves: SIGKILL the picker under load through real Envoy.

FailOpen (failure_mode_allow and the fallback route to the pool's endpoints, see
kv_picker_bench.localstack.envoy_bootstrap) must lose nothing but the requests in flight at the
kill; FailClose must answer 5xx at once, never hang. Both pools must use the picker again once
it is back.
"""

from __future__ import annotations

import pytest

from kv_picker_bench.faults.scenarios import DETECTION_S, kill_picker_under_load


@pytest.mark.parametrize("body_mode", ["FULL_DUPLEX_STREAMED", "BUFFERED"])
def test_fail_open_serves_through_envoy_while_the_picker_is_dead(body_mode: str) -> None:
    run = kill_picker_under_load("FailOpen", body_mode, load_s=1.5)
    assert run["requests_while_down"] > 50
    assert run["served_while_down"] == run["requests_while_down"]
    # Lost: only requests whose ext_proc stream was open when the picker died.
    assert run["lost_started_after_detection"] == 0, (run, DETECTION_S)
    assert run["trap_hits"] == 0  # a client-written destination is never reached
    assert run["forged_status"] == 200  # ... and that request is served by the pool instead
    assert run["max_latency_ms"] < 10_000
    assert 0 <= run["picker_back_s"] < 10


def test_fail_close_answers_5xx_at_once_and_never_hangs() -> None:
    run = kill_picker_under_load("FailClose", "FULL_DUPLEX_STREAMED", load_s=1.5)
    assert run["requests_while_down"] > 50
    assert run["served_while_down"] == 0
    assert run["max_latency_while_down_ms"] < 1000
    assert run["max_latency_ms"] < 10_000
    assert run["forged_status"] >= 500 and run["trap_hits"] == 0
    assert 0 <= run["picker_back_s"] < 10
