"""Smoke run of the KV-index benchmark (small sizes, Redis included)."""

from kv_picker_bench.kv_index_bench import format_result, run


def test_kv_index_benchmark_smoke() -> None:
    result = run(quick=True)
    ingestion = result["ingestion"]
    assert set(ingestion) == {
        "direct, decode and keys only (no index)",
        "direct, compact ledger",
        "zmq, compact ledger",
        "direct, dict ledger",
        "zmq, dict ledger",
    }
    assert all(row["block_events_per_s"] > 0 for row in ingestion.values())
    assert len({row["blocks"] for row in ingestion.values()}) == 1
    assert set(result["lookup_redis"]) == set(result["lookup_memory"])
    sizes = result["bytes_per_block"]
    # The numpy ledger holds an entry in a fraction of the ordered dicts' memory.
    for shape in ("shared_chains", "distinct_blocks"):
        compact = sizes[f"memory_{shape}_compact_ledger"]
        assert 0 < compact < sizes[f"memory_{shape}_dict_ledger"] - 50, sizes
    table = format_result(result)
    assert "| 500 | 64 |" in table and "redis_shared_chains" in table
