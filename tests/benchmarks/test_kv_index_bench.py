"""Smoke run of the KV-index benchmark (small sizes, Redis included)."""

from kv_picker_bench.kv_index_bench import format_result, run


def test_kv_index_benchmark_smoke() -> None:
    result = run(quick=True)
    assert result["ingestion"]["direct"]["block_events_per_s"] > 0
    assert result["ingestion"]["zmq"]["blocks"] == result["ingestion"]["direct"]["blocks"]
    assert set(result["lookup_redis"]) == set(result["lookup_memory"])
    assert 0 < result["bytes_per_block"]["memory_shared_chains"] < 1000
    table = format_result(result)
    assert "| 500 | 64 |" in table and "redis_shared_chains" in table
