"""The queue-delay gate: parsing the gateway's stamp, and CoDel's rule on the waits."""

from __future__ import annotations

import json
import time

import pytest
from envoy.extensions.filters.http.ext_proc.v3.processing_mode_pb2 import ProcessingMode as Mode

from kv_picker.admission import QueueDelayGate, parse_request_start
from kv_picker.handlers.extproc import RequestStream
from kv_picker.wire import DROPPED_REASON_HEADER
from tests.fakes import make_director
from tests.picker.handlers.test_extproc_stream import (
    BODY,
    body_message,
    destination,
    headers_message,
    run,
)

TARGET, INTERVAL = 0.005, 0.1
GATE_ON = {"admission": {"queueDelayTarget": "5ms"}}


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("t=1796073198448231", 1796073198.448231),  # Envoy's %START_TIME(%s%6f)%
        ("1796073198448", 1796073198.448),  # milliseconds
        ("t=1796073198.5", 1796073198.5),  # seconds
        (" t=1796073198 ", 1796073198.0),
    ],
)
def test_the_stamp_is_read_in_any_unit(value: str, seconds: float) -> None:
    assert parse_request_start(value) == pytest.approx(seconds, abs=1e-6)


@pytest.mark.parametrize("value", ["", "t=", "soon", "t=-5", "0", "nan", "inf", "1" * 40])
def test_a_stamp_that_is_not_a_time_is_ignored(value: str) -> None:
    assert parse_request_start(value) is None


def test_a_burst_passes_while_there_is_no_standing_queue() -> None:
    gate = QueueDelayGate()
    now = 1000.0
    assert gate.admit(0.0, now, TARGET, INTERVAL)
    # Within the interval, waits up to the interval pass (a burst drains).
    assert gate.admit(0.08, now + 0.01, TARGET, INTERVAL)
    assert not gate.admit(0.15, now + 0.02, TARGET, INTERVAL)  # past the interval: shed
    # The interval's smallest wait was 0: no standing queue in the next one either.
    assert gate.admit(0.05, now + 0.11, TARGET, INTERVAL) and not gate.overloaded


def test_a_standing_queue_sheds_what_waited_past_the_target() -> None:
    gate = QueueDelayGate()
    now = 1000.0
    for step in range(10):  # one interval where every request waited 20 ms or more
        assert gate.admit(0.02 + step * 0.001, now + step * 0.01, TARGET, INTERVAL)
    now += 0.1
    assert not gate.admit(0.02, now, TARGET, INTERVAL) and gate.overloaded
    assert gate.admit(0.004, now + 0.01, TARGET, INTERVAL)  # under the target: admitted
    assert not gate.admit(0.006, now + 0.02, TARGET, INTERVAL)
    # A queue held just under the target is still a queue: the state holds.
    now += 0.1
    assert not gate.admit(0.006, now, TARGET, INTERVAL) and gate.overloaded
    assert gate.admit(0.002, now + 0.01, TARGET, INTERVAL)  # well under it: drained
    # The next interval lets bursts through again.
    assert gate.admit(0.05, now + 0.1, TARGET, INTERVAL) and not gate.overloaded


def test_an_idle_gap_ends_the_overload() -> None:
    gate = QueueDelayGate()
    for step in range(5):
        gate.admit(0.03, 1000.0 + step * 0.02, TARGET, INTERVAL)
    assert not gate.admit(0.03, 1000.1, TARGET, INTERVAL)
    # Nothing for a second: the interval that ended long ago says nothing about now.
    assert gate.admit(0.03, 1001.5, TARGET, INTERVAL) and not gate.overloaded


@pytest.mark.parametrize("offset_s", [-7.5, 0.0, 12.25])
def test_the_clock_offset_between_gateway_and_picker_drops_out(offset_s: float) -> None:
    """Waits are ages less the smallest age seen lately: a constant offset changes nothing."""
    gate = QueueDelayGate()
    now = 5000.0
    waits = []
    for queued in [0.0, 0.002, 0.0005, 0.03, 0.001]:
        now += 0.01
        waits.append(gate.wait_s(now - queued - offset_s, now))
        assert waits[-1] >= 0
    assert waits == pytest.approx([0.0, 0.002, 0.0005, 0.03, 0.001], abs=1e-9)


def test_the_offset_floor_forgets_an_old_minimum() -> None:
    gate = QueueDelayGate()
    assert gate.wait_s(100.0 - 1.0, 100.0) == 0.0  # the smallest age so far: 1 s
    assert gate.wait_s(110.0 - 3.0, 110.0) == pytest.approx(2.0)
    assert gate.wait_s(140.0 - 3.0, 140.0) == pytest.approx(2.0)  # still within the minute
    assert gate.wait_s(175.0 - 3.0, 175.0) == pytest.approx(0.0)  # the 1 s floor forgotten
    assert gate.wait_s(400.0 - 5.0, 400.0) == pytest.approx(0.0)  # after a long gap: anew


def stamped(age_s: float, mode: int = Mode.FULL_DUPLEX_STREAMED):  # type: ignore[no-untyped-def]
    started_us = int((time.time() - age_s) * 1e6)
    return headers_message(mode=mode, extra=[("x-request-start", f"t={started_us}")])


@pytest.mark.parametrize("mode", [Mode.FULL_DUPLEX_STREAMED, Mode.BUFFERED])
def test_a_request_that_waited_too_long_is_refused_before_its_body(mode: int) -> None:
    director = make_director(GATE_ON)  # 5 ms target, the default 100 ms interval
    served = RequestStream(director)
    run(served, stamped(0.0, mode))  # sets the offset floor: this one did not wait
    assert destination(run(served, body_message(BODY))[0])
    late = RequestStream(director)
    (refused,) = run(late, stamped(0.5, mode))  # waited half a second: past the interval
    immediate = refused.immediate_response
    assert immediate.status.code == 503 and late.closed
    reasons = {h.header.key: h.header.raw_value for h in immediate.headers.set_headers}
    assert reasons[DROPPED_REASON_HEADER] == b"overloaded"
    message = json.loads(immediate.body)["error"]["message"]
    assert "waited" in message and "queueDelayTarget" in message
    assert director.pending == 0
    registry = director.metrics.registry
    assert registry.get_sample_value("kv_picker_request_queue_delay_seconds_count") == 2.0
    assert (
        registry.get_sample_value(
            "kv_picker_requests_total", {"model": "", "outcome": "overloaded"}
        )
        == 1.0
    )


def test_without_a_stamp_or_with_the_gate_off_nothing_is_shed() -> None:
    director = make_director({"admission": {"queueDelayTarget": 0}})
    run(RequestStream(director), stamped(0.0))
    stream = RequestStream(director)
    assert run(stream, stamped(30.0)) == []  # measured, not shed
    assert destination(run(stream, body_message(BODY))[0])
    assert (
        director.metrics.registry.get_sample_value("kv_picker_request_queue_delay_seconds_count")
        == 2.0
    )
    unstamped = RequestStream(make_director(GATE_ON))
    assert run(unstamped, headers_message()) == []
    assert destination(run(unstamped, body_message(BODY))[0])


def test_the_gate_is_off_by_default() -> None:
    director = make_director()
    assert director.config.admission.queue_delay_target_s == 0
    run(RequestStream(director), stamped(0.0))
    stream = RequestStream(director)
    assert run(stream, stamped(0.5)) == []  # waited half a second: measured, not shed
    assert destination(run(stream, body_message(BODY))[0])


def test_the_gate_outlives_a_reload() -> None:
    director = make_director()
    gate = director.queue_gate
    director.swap(director.config, director.scheduler)
    assert director.queue_gate is gate


@pytest.mark.parametrize("age_s", [-3600.0, 900.0])
def test_a_stamp_far_from_the_pickers_clock_is_ignored(age_s: float) -> None:
    """A stamp minutes away is no arrival time (a forged one, a broken clock): it must not move
    the offset floor, or every later request would look as if it had waited that long."""
    director = make_director(GATE_ON)
    run(RequestStream(director), stamped(age_s))
    registry = director.metrics.registry
    assert registry.get_sample_value("kv_picker_request_queue_delay_seconds_count") == 0.0
    stream = RequestStream(director)
    assert run(stream, stamped(0.0)) == []
    assert destination(run(stream, body_message(BODY))[0])
