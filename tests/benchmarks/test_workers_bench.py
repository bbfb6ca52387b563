"""``kv-picker bench workers``: its setups, its table, the exchange measurement and a tiny run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kv_picker_bench.workers_bench import (
    Result,
    Setup,
    cpu_seconds,
    exchange_cost,
    format_results,
    main,
    parse_setup,
    process_tree,
    run,
)

CPU = min(os.sched_getaffinity(0))


def test_setups_are_parsed_and_checked() -> None:
    assert parse_setup(f"2@{CPU}") == Setup(2, (CPU,))
    for bad in ("0@0", "2@", "x@0", f"1@{max(os.sched_getaffinity(0)) + 1}"):
        with pytest.raises(ValueError):
            parse_setup(bad)


def test_the_table_divides_by_one_worker_on_one_core() -> None:
    rows = [
        Result("1 worker, 1 core", 16, 100, 0, 10.0, 20.0, 200.0, None, None, 1, [0], 1.0),
        Result("2 workers, 2 cores", 16, 100, 0, 10.0, 20.0, 300.0, None, None, 2, [0, 1], 1.5),
    ]
    table = format_results(rows)
    assert "| 2 workers, 2 cores | 16 | 300 | 1.50 |" in table


def test_a_process_trees_cpu_time_grows_with_its_work() -> None:
    pid = os.getpid()
    assert pid in process_tree(pid)
    before = cpu_seconds(pid)
    total = 0
    for i in range(3_000_000):
        total += i
    assert cpu_seconds(pid) > before


@pytest.mark.parametrize("keys", [250, 2048])
def test_the_exchange_is_measured_on_real_sockets(keys: int) -> None:
    row = exchange_cost(rate=200, seconds=1.5, keys_per_pick=keys)
    assert row["keys_per_pick"] == keys
    assert row["requests"] >= 250
    # Every pick, first byte and end reached the receiver (and its snapshots are extra).
    assert row["messages_received"] >= 3 * row["requests"] - 3 * 17
    assert row["cpu_us_per_request"] > 0


def test_a_pick_without_keys_is_refused(capsys) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(SystemExit) as exit_info:
        main(["--exchange", "100", "--exchange-keys", "0"])
    assert exit_info.value.code == 2
    assert "--exchange-keys must be positive" in capsys.readouterr().err


def test_a_tiny_run_routes_through_one_and_two_workers(tmp_path: Path) -> None:
    results = run(
        [Setup(1, (CPU,)), Setup(2, (CPU,))],
        connections=[2],
        requests=12,
        rounds=1,
        endpoints=2,
        prompt_tokens=400,
        out_dir=tmp_path,
    )
    assert [(r.workers, r.errors, r.requests) for r in results] == [(1, 0, 12), (2, 0, 12)]
    # CPU time comes in clock ticks (10 ms): a dozen requests may not reach one.
    assert all(0 <= r.picker_cpu_ms_per_request < 1000 for r in results)
    assert "| 2 workers, 1 core | 2 |" in (tmp_path / "workers.md").read_text()
