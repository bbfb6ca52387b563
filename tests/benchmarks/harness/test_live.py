"""Tiny live and peer replays: real processes on 127.0.0.1, a few dozen requests, seconds.

Peer routers install from the package index into their own virtual environments (reference
peers.md §1.1); these tests find them through ``$VLLM_ROUTER_BIN`` / ``$SGLANG_ROUTER_BIN`` or
PATH and are skipped, saying so, when they are absent.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from kv_picker_bench.harness.live import (
    live_picker_config,
    live_scrape_model_s,
    live_scrape_wall_s,
    offline_counterpart,
    router_binary,
    trace_requests,
)
from kv_picker_bench.harness.live import main as live_main
from kv_picker_bench.harness.matrix import cell_workload
from kv_picker_bench.harness.peers import main as peers_main
from kv_picker_bench.harness.policies import harness_registry, resolve_policy
from kv_picker_bench.harness.report import summarize
from kv_picker_bench.harness.simulator import run_policy, uniform_cluster
from kv_picker_bench.harness.traces import (
    CacheNamespaces,
    Trace,
    TraceRequest,
    parse_trace_spec,
    prompt_text,
)
from kv_picker_bench.localstack import envoy_binary

TINY = "shared-prefix:groups=3,users=2,context=300,question=40,output=12,requests=24,rate=20"
COMMON = ["--trace", TINY, "--endpoints", "2", "--num-gpu-blocks", "400", "--quiet"]


def _children() -> set[int]:
    found = subprocess.run(
        ["pgrep", "-P", str(os.getpid())], capture_output=True, text=True, check=False
    )
    return {int(pid) for pid in found.stdout.split()}


def _have_envoy() -> bool:
    try:
        envoy_binary()
    except FileNotFoundError:
        return False
    return True


@pytest.mark.skipif(not _have_envoy(), reason="no Envoy binary (the dev extra ships one)")
def test_live_replay_through_envoy_and_kv_picker(tmp_path: Path) -> None:
    before = _children()
    out = tmp_path / "live"
    argv = [*COMMON, "--policy", "kv-picker", "--policy", "random", "--out", str(out)]
    assert live_main(argv) == 0
    document = json.loads((out / "results.json").read_text())
    assert document["mode"] == "live"
    for name in ("kv-picker", "random"):
        metrics = document["policies"][name]
        assert metrics["ok"] == 24 and metrics["errors"] == 0
        assert metrics["ttft_s"]["p50"] > 0
        assert sum(metrics["extra"]["served_per_endpoint"]) == 24
        assert 0 < metrics["hit_ratio"] <= document["bounds"]["unbounded"] + 1e-9
        # The CPU each part used while the requests ran: the router here is the picker and
        # Envoy; the endpoints served every request; the client sent them.
        extra = metrics["extra"]
        for key in ("router_cpu_s", "endpoints_cpu_s", "client_cpu_s"):
            assert extra[key] > 0
        assert extra["picker_first_bytes"] == 24  # full responses: every first byte seen
        shares = extra["router_cpu_s.kv-picker"] + extra["router_cpu_s.envoy"]
        assert shares == pytest.approx(extra["router_cpu_s"], abs=0.01)
    report = (out / "results.md").read_text()
    assert report.count("| kv-picker | 24 |") == 1
    assert "| policy | router | simulated endpoints | client | wall s |" in report
    assert " (kv-picker " in report and " + envoy " in report
    assert report.count("\n| random | ") == 3  # its latency, CPU and live-against-offline rows
    # At the default time scale (0.05) the picker's 50 ms of wall time between scrapes are a
    # second of model time, and the report says so, with the offline flag that matches it.
    assert document["picker_scrape_interval_s"] == {"wall": 0.05, "model": pytest.approx(1.0)}
    assert "scrape every 1000 ms" in report and "`--scrape-interval 1000ms`" in report
    # The offline counterpart: both policies replayed offline at that period, compared.
    offline = document["offline"]
    assert offline["scrape_interval_s"] == {"kv-picker": 1.0, "random": 1.0}
    assert set(offline["policies"]) == {"kv-picker", "random"}
    for name in ("kv-picker", "random"):
        assert offline["policies"][name]["ok"] == 24
        live_ratio = document["policies"][name]["hit_ratio"]
        offline_ratio = offline["policies"][name]["hit_ratio"]
        # (the JSON keeps six decimals)
        assert offline["hit_ratio_difference"][name] == pytest.approx(
            offline_ratio / live_ratio - 1, abs=1e-5
        )
    assert sorted(offline["order"]["ttft_mean"]["live"]) == ["kv-picker", "random"]
    assert "## Live against offline" in report
    assert "Hit ratios: the largest difference is " in report
    assert _children() <= before  # every process stopped


def test_live_rejects_harness_only_policies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [*COMMON, "--policy", "round-robin", "--out", str(tmp_path / "x")]
    assert live_main(argv) == 2
    assert "live mode runs the service's plugins only" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("router", "policy"), [("vllm-router", "round_robin"), ("sglang-router", "cache_aware")]
)
def test_peer_replay(router: str, policy: str, tmp_path: Path) -> None:
    if router_binary(router) is None:
        pytest.skip(
            f"{router} not installed: pip install {router} into its own venv and set "
            f"{'VLLM' if router == 'vllm-router' else 'SGLANG'}_ROUTER_BIN"
        )
    before = _children()
    out = tmp_path / "peers"
    assert peers_main([*COMMON, "--peer", f"{router}:{policy}", "--out", str(out)]) == 0
    metrics = json.loads((out / "results.json").read_text())["policies"][f"{router}:{policy}"]
    assert metrics["ok"] == 24 and metrics["errors"] == 0
    assert sum(metrics["extra"]["served_per_endpoint"]) == 24
    assert metrics["extra"]["router_cpu_s"] > 0  # the peer router's own process
    assert _children() <= before


def test_peers_without_the_routers_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv("VLLM_ROUTER_BIN", raising=False)
    argv = [*COMMON, "--peer", "vllm-router:round_robin", "--out", str(tmp_path / "x")]
    assert peers_main(argv) == 2
    assert "peer router(s) not found: vllm-router" in capsys.readouterr().err


def test_trace_requests_name_the_adapter_and_send_the_salt() -> None:
    namespaces = CacheNamespaces()
    names = [(None, None), ("sql", None), (None, "tenant-a"), ("sql", "tenant-b")]
    requests = [
        TraceRequest(
            i, 0.5 * i, 40, 8, namespaces.apply([1, 2, 3], lora, salt), lora=lora, salt=salt
        )
        for i, (lora, salt) in enumerate(names)
    ]
    sent = trace_requests(Trace("t", 16, requests), "base-model")
    assert [arrival_s for arrival_s, _ in sent] == [0.0, 0.5, 1.0, 1.5]
    bodies = [http.body for _, http in sent]
    assert [b["model"] for b in bodies] == ["base-model", "sql", "base-model", "sql"]
    assert [b.get("cache_salt") for b in bodies] == [None, None, "tenant-a", "tenant-b"]
    assert len({b["prompt"] for b in bodies}) == 1  # the same text: only the names differ
    assert bodies[0]["prompt"] == prompt_text(requests[0], 16)


def test_the_live_scrape_period_is_reported_in_model_time() -> None:
    # Below the 50 ms floor the wall period stays 50 ms, so in model time it grows as the
    # time scale shrinks; above it, the model-time period is the one asked for.
    assert live_scrape_wall_s(0.05, 0.25) == 0.05
    assert live_scrape_model_s(0.05, 0.25) == pytest.approx(0.2)
    assert live_scrape_model_s(0.05, 0.5) == pytest.approx(0.1)
    assert live_scrape_wall_s(0.4, 0.5) == pytest.approx(0.2)
    assert live_scrape_model_s(0.4, 0.5) == pytest.approx(0.4)
    document = live_picker_config(resolve_policy("kv-picker"), 0.05, 0.25)
    assert document["metrics"] == {"scrapeInterval": "50ms"}


def test_the_offline_counterpart_scrapes_as_each_live_picker_did() -> None:
    trace = parse_trace_spec(TINY)
    cluster = uniform_cluster(2, num_gpu_blocks=400)
    policies = [resolve_policy("kv-picker"), resolve_policy("random")]
    documents = [live_picker_config(p, cluster.scrape_interval_s, 0.25) for p in policies]
    # A policy that sets its own period keeps it live: 100 ms of wall time, 400 of model time.
    documents[1] = {**documents[1], "metrics": {"scrapeInterval": "100ms"}}
    registry = harness_registry()
    # Stand-ins for the live figures: the same policies offline at the default period, with
    # the order of the two swapped by hand so that the comparison has something to find.
    live = [
        summarize(run_policy(trace, cluster, p.config(registry), registry, p.name, seed=0), cluster)
        for p in policies
    ]
    live[0].ttft_s["mean"], live[1].ttft_s["mean"] = 1e9, 0.0
    counterpart = offline_counterpart(trace, cluster, policies, documents, live, 0.25, 0)
    assert counterpart.scrape_interval_s == {
        "kv-picker": pytest.approx(0.2),
        "random": pytest.approx(0.4),
    }
    assert [m.policy for m in counterpart.rows] == ["kv-picker", "random"]
    for row, live_row in zip(counterpart.rows, live, strict=True):
        assert row.ok == len(trace.requests)
        assert counterpart.hit_ratio_difference[row.policy] == pytest.approx(
            row.hit_ratio / live_row.hit_ratio - 1
        )
    assert counterpart.order["ttft_mean"]["live"] == ["random", "kv-picker"]
    offline_order = counterpart.order["ttft_mean"]["offline"]
    assert counterpart.same_order["ttft_mean"] == (offline_order == ["random", "kv-picker"])


@pytest.mark.skipif(not _have_envoy(), reason="no Envoy binary (the dev extra ships one)")
def test_live_with_lean_responses_routes_and_replays_offline_the_same_way(tmp_path: Path) -> None:
    out = tmp_path / "lean"
    argv = [*COMMON, "--policy", "kv-picker", "--responses", "lean", "--out", str(out)]
    assert live_main(argv) == 0
    document = json.loads((out / "results.json").read_text())
    assert document["responses"] == "lean"
    metrics = document["policies"]["kv-picker"]
    assert metrics["ok"] == 24 and metrics["errors"] == 0
    assert metrics["hit_ratio"] > 0
    assert document["offline"]["policies"]["kv-picker"]["ok"] == 24
    assert "no chunk (`lean`)" in (out / "results.md").read_text()
    assert metrics["extra"]["picker_first_bytes"] == 0  # Envoy sent it no response chunk


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--responses", "none"], "argument --responses: invalid choice: 'none'"),
        (["--time-scale", "0"], "--time-scale must be a positive number"),
        (["--time-scale", "nan"], "--time-scale must be a positive number"),
    ],
    ids=["responses", "zero time scale", "nan time scale"],
)
def test_live_refuses_bad_flags_before_starting_anything(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _children()
    try:
        code = live_main([*COMMON, "--policy", "kv-picker", *extra])
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code
    assert code == 2
    assert message in capsys.readouterr().err
    assert _children() <= before


CELL = "zipf-prefix/0.3/small4/llama-3.1-70b-h100-tp4"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--cell", CELL, "--trace", TINY], "give one of --trace and --cell"),
        ([], "give one of --trace and --cell"),
        (["--cell", CELL, "--endpoints", "2"], "the cluster; drop --endpoints"),
        (["--cell", CELL, "--load", "2", "--timing", "legacy"], "drop --load, --timing"),
        (["--trace", TINY, "--family-seed", "2"], "--family-seed draws a matrix family"),
        (["--cell", "long-doc-qa/0.3/pd/llama-3.1-8b-h100"], "the pd cluster runs offline only"),
        (["--cell", "nope/0.3/small4/llama-3.1-8b-h100"], "unknown family 'nope'"),
        (["--cell", "zipf-prefix/0/small4/llama-3.1-8b-h100"], "the load must be a positive"),
    ],
    ids=["both", "neither", "cluster", "load and timing", "seed alone", "pd", "family", "load"],
)
def test_live_refuses_a_bad_cell_before_starting_anything(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _children()
    assert live_main(["--quiet", "--policy", "kv-picker", *argv]) == 2
    assert message in capsys.readouterr().err
    assert _children() <= before


def test_a_cell_is_the_matrix_draw_at_its_load() -> None:
    cell, trace, config, load = cell_workload(CELL, 2)
    assert cell.label == "zipf-prefix / 0.3 / small4 / llama-3.1-70b-h100-tp4"
    assert load.binding == pytest.approx(0.3, rel=1e-6)  # decode binds on this cell
    assert load.prefill < load.decode
    assert len(config.endpoints) == 4
    assert config.timing.name == "llama-3.1-70b-h100-tp4"
    _, other, _, _ = cell_workload(CELL, 3)
    assert [r.input_tokens for r in trace.requests] != [r.input_tokens for r in other.requests]
    _, faster, _, doubled = cell_workload(CELL.replace("/0.3/", "/0.6/"), 2)
    assert doubled.prefill == pytest.approx(2 * load.prefill, rel=1e-6)
    assert doubled.binding == pytest.approx(0.6, rel=1e-6)
    assert [r.input_tokens for r in faster.requests] == [r.input_tokens for r in trace.requests]


@pytest.mark.skipif(not _have_envoy(), reason="no Envoy binary (the dev extra ships one)")
def test_live_replays_the_first_requests_of_a_matrix_cell(tmp_path: Path) -> None:
    out = tmp_path / "cell"
    argv = ["--cell", CELL, "--family-seed", "2", "--first", "12", "--policy", "kv-picker",
            "--quiet", "--no-plots", "--out", str(out)]  # fmt: skip
    assert live_main(argv) == 0
    document = json.loads((out / "results.json").read_text())
    _, trace, _, load = cell_workload(CELL, 2)
    assert document["cell"] == {
        "cell": "zipf-prefix / 0.3 / small4 / llama-3.1-70b-h100-tp4",
        "draw": 2,
        "requests": len(trace.requests),
        "prefill_load": pytest.approx(load.prefill, abs=1e-6),
        "decode_load": pytest.approx(load.decode, abs=1e-6),
    }
    assert document["trace"]["requests"] == 12
    assert len(document["cluster"]["endpoints"]) == 4
    assert document["cluster"]["timing"]["profile"] == "llama-3.1-70b-h100-tp4"
    metrics = document["policies"]["kv-picker"]
    assert metrics["ok"] == 12 and metrics["errors"] == 0
    report = (out / "results.md").read_text()
    whole = len(trace.requests)
    assert (
        f"draw 2 (`kv-picker bench matrix --family-seed 2`), {whole} requests (the first 12)"
        in (report)
    )


@pytest.mark.skipif(not _have_envoy(), reason="no Envoy binary (the dev extra ships one)")
@pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs two CPUs (Linux)",
)
def test_live_with_the_router_on_cpus_of_its_own(tmp_path: Path) -> None:
    before = os.sched_getaffinity(0)
    router = max(before)
    out = tmp_path / "pinned"
    argv = [*COMMON, "--policy", "kv-picker", "--router-cpus", str(router), "--out", str(out)]
    assert live_main(argv) == 0
    document = json.loads((out / "results.json").read_text())
    assert document["router_cpus"] == [router]
    rest_cpus = sorted(before - {router})
    assert document["process_cpus"]["kv-picker"] == {"router": [router], "endpoints": rest_cpus}
    assert document["policies"]["kv-picker"]["ok"] == 24
    rest = ",".join(str(c) for c in rest_cpus)
    assert (
        f"on {router}; the endpoints and the client on {rest}." in (out / "results.md").read_text()
    )
    assert os.sched_getaffinity(0) == before
