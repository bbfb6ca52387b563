"""``kv-picker bench overhead --output-tokens``: the streamed-response figures and the prompts."""

from __future__ import annotations

import math

import pytest

from kv_picker.wire import DESTINATION_HEADER
from kv_picker_bench.client import Outcome
from kv_picker_bench.overhead import MODES, PATHS, prompt_seed, prompts, stream_figures


def _outcome(ttft_s: float, gaps_s: tuple[float, ...], tokens: int, status: int = 200) -> Outcome:
    return Outcome(status, ttft_s, 1.0, completion_tokens=tokens, gaps_s=gaps_s)


def test_stream_figures_pool_the_gaps_and_divide_the_cpu_by_the_tokens() -> None:
    outcomes = [
        _outcome(0.100, (0.010,) * 9, 10),
        _outcome(0.200, (0.010,) * 9, 10),
        _outcome(0.300, (0.010,) * 8 + (0.090,), 10),
        _outcome(5.0, (9.0,), 10, status=503),  # failed: counted nowhere
    ]
    figures = stream_figures(outcomes, (0.003, 0.0015))
    assert figures.output_tokens == 30
    assert figures.ttft_p50_ms == pytest.approx(200.0)
    assert figures.ttft_p99_ms == pytest.approx(300.0)
    # 27 gaps: 26 of 10 ms and one of 90 ms, which is the p99 (nearest rank 27 of 27).
    assert figures.gap_p50_ms == pytest.approx(10.0)
    assert figures.gap_p99_ms == pytest.approx(90.0)
    # 3 ms and 1.5 ms of CPU over 30 tokens.
    assert figures.ext_proc_cpu_us_per_token == pytest.approx(100.0)
    assert figures.envoy_cpu_us_per_token == pytest.approx(50.0)


def test_stream_figures_without_cpu_or_tokens_have_no_cpu_figure() -> None:
    assert stream_figures([_outcome(0.1, (0.01,), 2)], None).ext_proc_cpu_us_per_token is None
    empty = stream_figures([_outcome(0.1, (), 0)], (1.0, 1.0))
    assert empty.ext_proc_cpu_us_per_token is None and math.isnan(empty.gap_p50_ms)


def test_streamed_batches_get_fresh_prompts_and_one_token_batches_the_same() -> None:
    batches = [
        (mode, connections, path, round_index)
        for mode in MODES
        for connections in (1, 16)
        for path in PATHS
        for round_index in (-1, 0, 1)
    ]
    streamed = {prompt_seed(*batch, stream=True) for batch in batches}
    assert len(streamed) == len(batches)
    for connections in (1, 16):
        one_token = {prompt_seed(m, connections, p, r, stream=False) for m, _, p, r in batches}
        assert one_token == {connections}


def test_prompts_stream_exactly_the_tokens_asked_and_direct_names_its_endpoint() -> None:
    addresses = ["10.0.0.1:8000", "10.0.0.2:8000"]
    direct = prompts("direct", 7, 3, 50, 5, addresses)
    picker = prompts("picker", 7, 3, 50, 5, addresses)
    assert [r.headers.get(DESTINATION_HEADER) for r in direct] == [
        addresses[0],
        addresses[1],
        addresses[0],
    ]
    assert all(DESTINATION_HEADER not in r.headers for r in picker)
    assert [r.body for r in direct] == [r.body for r in picker]
    body = picker[0].body
    assert body["stream"] is True and body["ignore_eos"] is True
    assert body["max_tokens"] == 5 and body["stream_options"] == {"include_usage": True}
    one = prompts("floor", 7, 1, 50, 1, addresses)[0].body
    assert one["stream"] is False and "stream_options" not in one
