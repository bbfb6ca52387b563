"""``kv-picker tune``: windows, search spaces, the score, and whole runs on tiny traces.

Whole runs use the command's own entry point in this process (one worker) or real worker
processes (two workers, against a journal file or a real Valkey server), and read the study
back through Optuna to check what the command reports.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grimp
import optuna
import pytest
import yaml
from optuna.trial import TrialState

from kv_picker.config import DEFAULT_PROFILE, load_config, parse_config
from kv_picker.errors import ConfigError
from kv_picker.plugins import builtin_registry
from kv_picker_bench.harness.cli import replay_main
from kv_picker_bench.harness.policies import harness_registry
from kv_picker_bench.harness.space import (
    DEFAULT_SPACE,
    DEFAULT_SPACE_SOURCE,
    FixedChooser,
    Space,
    load_space,
)
from kv_picker_bench.harness.traces import TraceError, parse_trace_spec, write_kv_picker_jsonl
from kv_picker_bench.harness.tune import (
    Objective,
    TuneSetup,
    WindowResult,
    fail_stale_trials,
    gain,
    host_id,
    main,
    open_storage,
    remaining_trials,
    score,
    window_score,
)
from kv_picker_bench.harness.windows import parse_held_out, split_windows
from kv_picker_bench.valkey import ValkeyServer
from tests.benchmarks.harness.conftest import make_trace, small_cluster
from tests.picker.test_cli import ROOT, kv_picker

CHAT = "chat:sessions=30,turns=3"
SHARED = "shared-prefix:groups=6,users=3,context=600,question=60,output=24,requests=300,rate=20"
# Trials of about 0.3 s: long enough to catch one running, or for two workers to share them.
LONGER = "shared-prefix:groups=8,users=4,context=600,question=60,output=24,requests=2400,rate=40"
CLUSTER = ["--endpoints", "3", "--num-gpu-blocks", "400"]
TUNING = {1, 2, 4, 5}  # --windows 6 --held-out every:3


def run(*argv: str) -> int:
    return main(["--quiet", *argv])


def study_of(storage: str, name: str = "tune") -> optuna.Study:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.load_study(study_name=name, storage=open_storage(storage))


def states(study: optuna.Study) -> dict[str, int]:
    found: dict[str, int] = {}
    for trial in study.get_trials(deepcopy=False):
        found[trial.state.name] = found.get(trial.state.name, 0) + 1
    return found


# ------------------------------------------------------------------------------ windows


@pytest.mark.parametrize(
    ("spec", "count", "expected"),
    [
        ("every:3", 6, {3, 6}),
        ("every:2", 5, {2, 4}),
        ("last:2", 6, {5, 6}),
        ("2, 5", 6, {2, 5}),
        ("last:9", 3, None),  # every window
        ("every:1", 4, None),
        ("every:7", 6, None),  # no window
        ("7", 6, None),
        ("0,1", 6, None),
        ("sometimes", 6, None),
        ("every:x", 6, None),
        ("every:3", 1, None),
    ],
)
def test_held_out_rules(spec: str, count: int, expected: set[int] | None) -> None:
    if expected is None:
        with pytest.raises(ValueError, match=r"held-out|windows"):
            parse_held_out(spec, count)
    else:
        assert parse_held_out(spec, count) == expected


def test_windows_split_time_evenly_and_start_cold() -> None:
    rows = [(t, 32, 4, [t]) for t in (10, 11, 12, 19, 25, 26, 27, 28, 40)]
    trace = make_trace([(float(a), n, o, ids) for a, n, o, ids in rows])
    windows = split_windows(trace, 3, frozenset({3}))
    assert [(w.start_s, w.end_s) for w in windows] == [(10, 20), (20, 30), (30, 40)]
    assert [len(w.trace.requests) for w in windows] == [4, 4, 1]  # the last arrival is kept
    assert [w.held_out for w in windows] == [False, False, True]
    assert [r.arrival_s for r in windows[1].trace.requests] == [0, 1, 2, 3]
    assert [r.index for r in windows[1].trace.requests] == [0, 1, 2, 3]


def test_an_empty_window_is_named() -> None:
    trace = make_trace([(0.0, 32, 4, [1]), (1.0, 32, 4, [2]), (10.0, 32, 4, [3])])
    with pytest.raises(TraceError, match=r"window 2 of 3 \(3s\.\.7s\) has no request"):
        split_windows(trace, 3, frozenset({3}))
    with pytest.raises(TraceError, match="at once"):
        split_windows(make_trace([(5.0, 32, 4, [1]), (5.0, 32, 4, [2])]), 2, frozenset({2}))


# ------------------------------------------------------------------------------ spaces


def default_space(base: dict[str, Any] | None = None) -> Space:
    registry = harness_registry()
    return load_space(DEFAULT_SPACE, DEFAULT_SPACE_SOURCE, base or {}, "base", registry)


def test_the_default_space_starts_from_the_built_in_default() -> None:
    space = default_space()
    assert space.base_values is not None
    assert space.base_values["prefix-cache-scorer.weight"] == 1
    assert space.base_values["active-request-scorer.weight"] == 2
    assert space.base_values["active-request-scorer.fullScale"] == 8192
    assert space.base_values["recent-work-scorer.weight"] == 0.5
    assert space.base_values["recent-work-scorer.idleShare"] == 0.25
    assert space.base_values["queue-scorer.enabled"] is False
    assert "queue-scorer.weight" not in space.base_values
    assert space.base_values["active-request-scorer.ownDecode"] is True
    assert space.base_values["predicted-latency-scorer.decodeTokens"] == 64
    assert space.base_values["predicted-latency-scorer.decodeMinPromptTokens"] == 8192
    assert space.base_values["predicted-latency-scorer.decodeExcess"] is True
    assert space.base_values["predicted-latency-scorer.saturatedMissCost"] == 2
    assert space.base_values["predicted-latency-scorer.missExcess"] is True
    assert space.base_values["predicted-latency-scorer.saturatedAbove"] == 1
    assert space.base_values["predicted-latency-scorer.prefillCalibration"] is True
    assert space.base_values["predicted-latency-scorer.blockingCost"] == 1
    assert space.base_values["predicted-latency-scorer.blockingUnsaturated"] is True
    assert space.base_values["prefix-cache-scorer.fullYieldFree"] == 16
    assert space.base_values["prefix-cache-scorer.cappedMatchIsWhole"] is True
    assert space.base_values["active-request-scorer.promptScale"] == 0
    assert space.base_values["active-request-scorer.cachedScale"] == 2
    document, chosen = space.build(FixedChooser(space.base_values))
    assert chosen == space.base_values
    registry = harness_registry()
    built = parse_config(document, registry)
    default = parse_config({}, registry)
    assert built.profiles == default.profiles
    assert [(p.name, p.type, p.params) for p in built.plugins] == [
        (p.name, p.type, p.params) for p in default.plugins
    ]


def test_an_optional_scorer_goes_in_before_the_picker_with_its_parameters() -> None:
    space = default_space()
    assert space.base_values is not None
    params = {
        **space.base_values,
        "queue-scorer.enabled": True,
        "queue-scorer.weight": 2.5,
        "predicted-latency-scorer.queuedRequestSeconds": 0.3,
        "prefix-cache-scorer.weight": 0.0,
    }
    document, _ = space.build(FixedChooser(params))
    refs = document["schedulingProfiles"][0]["plugins"]
    assert [r["pluginRef"] for r in refs][-2:] == ["queue-scorer", "max-score-picker"]
    assert refs[-2]["weight"] == 2.5
    assert {"pluginRef": "prefix-cache-scorer", "weight": 0.0} in refs
    (latency,) = [p for p in document["plugins"] if p["type"] == "predicted-latency-scorer"]
    assert latency["parameters"]["queuedRequestSeconds"] == 0.3
    parse_config(document, harness_registry())


def test_a_parameter_given_under_an_alias_is_replaced_not_doubled() -> None:
    base = {
        "plugins": [
            {"type": "prefix-cache-scorer", "parameters": {"hashBlockSize": 32}},
            {"type": "max-score-picker"},
        ]
    }
    space = load_space(
        "- {plugin: prefix-cache-scorer, parameter: blockSizeChars, choices: [32, 128]}",
        "space.yaml",
        base,
        "base.yaml",
        harness_registry(),
    )
    assert space.base_values == {"prefix-cache-scorer.blockSizeChars": 32}
    document, _ = space.build(FixedChooser({"prefix-cache-scorer.blockSizeChars": 128}))
    assert document["plugins"][0]["parameters"] == {"blockSizeChars": 128}
    parse_config(document, harness_registry())


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "dimensions:\n- plugin: queue-scorer\n  weight: {low: 0, high: lots}\n",
            "space.yaml:3: dimensions[0].weight.high: expected a number, got 'lots'",
        ),
        (
            "- plugin: queue-scorer\n  weight: {low: 0, high: 4}\n"
            "- plugin: prefix-cache-scorer\n  parameter: blockSize\n  low: 8\n  high: 64\n",
            "space.yaml:4: dimensions[1].parameter: prefix-cache-scorer has no parameter "
            "'blockSize'; known: blockSizeChars",
        ),
        (
            "- {plugin: max-score-picker, weight: {low: 0, high: 1}}",
            "dimensions[0].weight: max-score-picker is a picker; only scorers have weights",
        ),
        (
            "- {plugin: prefix-cache-scorer, parameter: blockSizeChars, low: 0, high: 64}",
            "dimensions[0].low: prefix-cache-scorer refuses blockSizeChars=0: must be >= 1",
        ),
        (
            "- {plugin: prefix-cache-scorer, parameter: blockSizeChars, low: 8.5, high: 64}",
            "dimensions[0].low: blockSizeChars is an integer",
        ),
        (
            "- {plugin: hardware-class-scorer, parameter: phase, choices: [prefill, decode]}",
            "dimensions[0].plugin: hardware-class-scorer is not in the base profile",
        ),
        ("- {plugin: queue-scorer, weight: {low: 0, high: 1, step: 0.3}}", "step: must divide"),
        ("- {plugin: queue-scorer, weight: {low: 0, high: 1, log: true}}", "low: must be > 0"),
        ("- {plugin: queue-scorer, weight: {low: 2, high: 1}}", "high: must be >= low"),
        ("- {plugin: queue-scorer, weight: {low: 0, high: 1}, low: 3}", "low: belongs under"),
        ("- {plugin: queue-scorer}", "give either weight"),
        ("- {plugin: nope, weight: {low: 0, high: 1}}", "'nope' is neither a plugin"),
        ("- {plugin: prefix-cache-scorer, parameter: mode, low: 1, high: 2}", "not a number"),
        (
            "- {plugin: queue-scorer, weight: {low: 0, high: 1}}\n"
            "- {plugin: queue-scorer, weight: {low: 0, high: 2}}",
            "space.yaml:2: dimensions[1]: repeats dimensions[0]",
        ),
        ("dimensions: []", "dimensions: must list at least one"),
        ("[", "not valid YAML"),
    ],
)
def test_a_bad_space_file_names_line_and_field(text: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_space(text, "space.yaml", {}, "base", harness_registry())
    assert message in str(caught.value)
    assert str(caught.value).startswith("space.yaml")


def test_a_base_with_two_profiles_is_refused() -> None:
    base = {
        "plugins": [{"type": "queue-scorer"}, {"type": "single-profile-handler"}],
        "schedulingProfiles": [
            {"name": "default", "plugins": [{"pluginRef": "queue-scorer"}]},
            {"name": "other", "plugins": [{"pluginRef": "queue-scorer"}]},
        ],
    }
    with pytest.raises(ConfigError, match="one profile; the base has 2"):
        default_space(base)


# ------------------------------------------------------------------------------ the score


def result(mean: float, p90: float, tps: float = 100.0, ok: int = 10) -> WindowResult:
    return WindowResult(10, ok, mean, p90, p90 * 2, tps, 1000, 500)


def test_the_score_is_one_for_the_reference_and_penalises_lost_throughput() -> None:
    reference = result(1.0, 2.0)
    assert window_score(reference, reference) == 1.0
    assert window_score(result(0.5, 1.0), reference) == pytest.approx(0.5)
    assert window_score(result(0.5, 2.0), reference) == pytest.approx(math.sqrt(0.5))
    # Within the 1% tolerance: no penalty; past it, about 10% per extra 1% lost.
    assert window_score(result(1.0, 2.0, tps=99.5), reference) == 1.0
    assert window_score(result(1.0, 2.0, tps=98.0), reference) == pytest.approx((0.99 / 0.98) ** 10)
    assert window_score(result(1.0, 2.0, ok=9), reference) == pytest.approx((0.99 / 0.9) ** 10)
    assert window_score(result(math.nan, math.nan, ok=0), reference) == math.inf
    windows = {1: result(0.5, 1.0), 2: result(2.0, 4.0)}
    assert score(windows, {1: reference, 2: reference}) == pytest.approx(1.0)


def test_gain_pools_hit_ratios_and_averages_ratios_geometrically() -> None:
    reference = {1: result(1.0, 2.0), 2: result(4.0, 8.0)}
    candidate = {1: result(0.5, 1.0), 2: result(2.0, 4.0)}
    found = gain(candidate, reference)
    assert found.windows == (1, 2) and found.requests == 20
    assert found.ttft_mean == pytest.approx(0.5) and found.ttft_p99 == pytest.approx(0.5)
    assert found.throughput == pytest.approx(1.0)
    assert found.hit_ratio == found.reference_hit_ratio == 0.5


# ------------------------------------------------------------------------------ runs


def test_a_run_writes_a_servable_config_and_judges_it_on_held_out_windows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run"
    assert run("--trace", CHAT, *CLUSTER, "--trials", "5", "--workers", "1", "--out", str(out)) == 0
    printed = capsys.readouterr().out
    assert (
        "| vs the built-in default | tuning windows (1, 2, 4, 5) | held-out windows (3, 6) |"
        in (printed)
    )
    report = json.loads((out / "report.json").read_text())
    study = study_of(str(out / "study.journal"))
    trials = study.get_trials(deepcopy=False)
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 5
    # Trial 0 is the base, the built-in default itself: it scores exactly 1.
    assert trials[0].value == 1.0
    best = min(t.value for t in trials if t.value is not None)
    assert report["best"]["score"] == pytest.approx(best, abs=1e-6) and best <= 1.0
    # The search never replays a held-out window; the report does, for the best trial only.
    assert all({int(n) for n in t.user_attrs["windows"]} == TUNING for t in trials)
    assert set(report["best"]["held_out"]["windows"]) == {3, 6}
    assert {n for n, w in report["windows"].items() if w["held_out"]} == {"3", "6"}
    assert report["best"]["tuning"]["score"] == pytest.approx(report["best"]["score"])
    for name in ("tuned.yaml", "report.md", "command.txt"):
        assert (out / name).stat().st_size > 0
    assert (out / "command.txt").read_text().startswith("kv-picker tune --quiet --trace chat:")
    # The service accepts the config as it is, and so does the replay command.
    config = load_config(out / "tuned.yaml", builtin_registry())
    assert config.profiles[0].name == "default"
    tuned = yaml.safe_load((out / "tuned.yaml").read_text())
    assert tuned["kind"] == "EndpointPickerConfig"
    refs = {r["pluginRef"]: r.get("weight") for r in tuned["schedulingProfiles"][0]["plugins"]}
    assert refs["prefix-cache-scorer"] == report["best"]["params"]["prefix-cache-scorer.weight"]
    replay = tmp_path / "replay"
    argv = ["--trace", CHAT, *CLUSTER, "--quiet", "--no-plots", "--jobs", "1"]
    argv += ["--policy", f"tuned={out / 'tuned.yaml'}", "--out", str(replay)]
    assert replay_main(argv) == 0
    assert "tuned" in json.loads((replay / "results.json").read_text())["loads"]["1"]["policies"]


def test_a_custom_base_and_space_keep_the_base_s_other_sections(tmp_path: Path) -> None:
    base = tmp_path / "base.yaml"
    base.write_text(
        yaml.safe_dump(
            {
                "metrics": {"scrapeInterval": "200ms"},
                "plugins": [
                    {"type": "prefix-cache-scorer", "name": "prefix"},
                    {"type": "queue-scorer"},
                    {"type": "max-score-picker"},
                ],
                "schedulingProfiles": [
                    {
                        "name": "default",
                        "plugins": [
                            {"pluginRef": "prefix", "weight": 2},
                            {"pluginRef": "queue-scorer", "weight": 1},
                            {"pluginRef": "max-score-picker"},
                        ],
                    }
                ],
            }
        )
    )
    space = tmp_path / "space.yaml"
    space.write_text(
        "dimensions:\n"
        "- {plugin: prefix, weight: {low: 1, high: 4, step: 1}}\n"
        "- {plugin: queue-scorer, weight: {low: 0.5, high: 2, log: true}}\n"
        "- {plugin: prefix, parameter: lruCapacityPerServer, low: 64, high: 65536, log: true}\n"
    )
    out = tmp_path / "run"
    argv = ["--trace", CHAT, *CLUSTER, "--trials", "3", "--workers", "1", "--out", str(out)]
    assert run(*argv, "--base", str(base), "--space", str(space)) == 0
    tuned = yaml.safe_load((out / "tuned.yaml").read_text())
    assert tuned["metrics"] == {"scrapeInterval": "200ms"}
    assert [p.get("name") for p in tuned["plugins"]] == ["prefix", None, None]
    capacity = tuned["plugins"][0]["parameters"]["lruCapacityPerServer"]
    assert isinstance(capacity, int) and 64 <= capacity <= 65536
    report = json.loads((out / "report.json").read_text())
    assert set(report["best"]["params"]) == {
        "prefix.weight",
        "queue-scorer.weight",
        "prefix.lruCapacityPerServer",
    }
    # Trial 0 is the base (its parameter at the plugin's default), not the built-in default.
    base_params = {
        "prefix.weight": 2.0,
        "queue-scorer.weight": 1.0,
        "prefix.lruCapacityPerServer": 31250,
    }
    assert report["trials"][0]["params"] == report["best"]["base_params"] == base_params
    assert report["trials"][0]["score"] != 1.0


def test_a_mooncake_request_log_tunes_and_a_bad_row_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # What the service's request log holds: Mooncake JSONL (ms, 512-token block ids).
    log = tmp_path / "requests.jsonl"
    rows = [
        {
            "timestamp": 250 * i,
            "input_length": 1200,
            "output_length": 16,
            "hash_ids": [i % 5, 100 + i % 5, 1000 + i],
        }
        for i in range(120)
    ]
    log.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "run"
    argv = ["--trace", str(log), *CLUSTER, "--trials", "3", "--workers", "1", "--out", str(out)]
    assert run(*argv) == 0
    report = json.loads((out / "report.json").read_text())
    assert report["setup"]["trace"]["requests"] == 120 and report["complete"] == 3
    rows[7]["output_length"] = "many"
    log.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert run(*argv[:-1], str(tmp_path / "bad")) == 2
    assert f"{log}:8: field 'output_length'" in capsys.readouterr().err


def test_one_worker_and_a_seed_reproduce_the_run(tmp_path: Path) -> None:
    outputs = []
    for name in ("a", "b"):
        out = tmp_path / name
        argv = ["--trace", SHARED, *CLUSTER, "--trials", "7", "--workers", "1", "--seed", "3"]
        assert run(*argv, "--out", str(out)) == 0
        report = json.loads((out / "report.json").read_text())
        history = [(t["params"], t["score"]) for t in report["trials"]]
        outputs.append(((out / "tuned.yaml").read_text(), report["best"]["params"], history))
    assert outputs[0] == outputs[1]
    # Past TPE's random start-up trials (4 for 7 trials), and the trials differ from each other.
    assert len({json.dumps(params, sort_keys=True) for params, _ in outputs[0][2]}) == 7


def test_a_rerun_continues_the_study_up_to_the_total(tmp_path: Path) -> None:
    out = tmp_path / "run"
    common = ["--trace", CHAT, *CLUSTER, "--workers", "1", "--out", str(out)]
    assert run(*common, "--trials", "3") == 0
    first = json.loads((out / "report.json").read_text())
    assert first["complete"] == 3
    assert run(*common, "--trials", "5") == 0
    study = study_of(str(out / "study.journal"))
    assert [t.number for t in study.get_trials(states=(TrialState.COMPLETE,))] == [0, 1, 2, 3, 4]
    assert json.loads((out / "report.json").read_text())["complete"] == 5
    assert run(*common, "--trials", "5") == 0  # nothing left to run: the report again
    assert len(study_of(str(out / "study.journal")).get_trials()) == 5


def test_a_killed_run_resumes_and_its_lost_trial_is_run_again(tmp_path: Path) -> None:
    out = tmp_path / "run"
    journal = str(out / "study.journal")
    common = ["--trace", LONGER, *CLUSTER, "--workers", "1", "--out", str(out), "--quiet"]
    errors = tmp_path / "stderr.txt"
    with errors.open("wb") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "kv_picker", "tune", *common, "--trials", "200"],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            start_new_session=True,
        )
    try:
        # Killed in the middle of a trial, after a few completed.
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, errors.read_text()
            assert time.monotonic() < deadline, "no trial completed in time"
            time.sleep(0.05)
            if not Path(journal).exists():
                continue
            try:
                trials = study_of(journal).get_trials(deepcopy=False)
            except KeyError:
                continue  # the study is being created
            complete = sum(t.state == TrialState.COMPLETE for t in trials)
            running = [t for t in trials if t.state == TrialState.RUNNING]
            if complete >= 3 and running and running[0].user_attrs.get("pid") == process.pid:
                # Past the trial's first writes, into its replays: a kill during a write would
                # leave the journal's lock behind, which the next run waits out (30 s).
                time.sleep(0.1)
                break
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)
    before = states(study_of(journal))
    total = before["COMPLETE"] + 2
    assert run(*common, "--trials", str(total)) == 0
    after = states(study_of(journal))
    assert after["COMPLETE"] == total
    # The trial the kill interrupted was failed (its process is gone), not left running.
    assert before["RUNNING"] == 1 and after["FAIL"] == 1 and "RUNNING" not in after


def test_trials_whose_worker_is_gone_are_failed(tmp_path: Path) -> None:
    storage = open_storage(str(tmp_path / "study.journal"))
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name="s", storage=storage)
    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait()
    alive, dead_here, silent = study.ask(), study.ask(), study.ask()
    for trial, pid, beat in (
        (alive, os.getpid(), time.time()),
        (dead_here, finished.pid, time.time()),
        (silent, 1, time.time() - 600),  # elsewhere: judged by its heartbeat
    ):
        trial.set_user_attr("host", host_id() if trial is not silent else "other/host")
        trial.set_user_attr("pid", pid)
        trial.set_user_attr("heartbeat", beat)
    assert remaining_trials(study, 5) == 2
    assert fail_stale_trials(study, storage, stale_after_s=60) == 2
    assert [t.state for t in study.get_trials()] == [
        TrialState.RUNNING,
        TrialState.FAIL,
        TrialState.FAIL,
    ]
    assert remaining_trials(study, 5) == 4


def test_a_trial_past_the_budget_is_pruned(tmp_path: Path) -> None:
    spec = str(tmp_path / "study.journal")
    storage = open_storage(spec)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name="s", storage=storage)
    for _ in range(2):
        study.tell(study.ask(), 1.0)
    setup = TuneSetup(
        windows=(),
        cluster=small_cluster(),
        space=default_space(),
        seed=0,
        pd_threshold=None,
        storage=spec,
        study="s",
        trials=2,
        stale_after_s=60.0,
        quiet=True,
        fingerprint="-",
    )
    # Two workers asked for a trial at once, and the other one got the last slot.
    late = study.ask()
    with pytest.raises(optuna.TrialPruned):
        Objective(setup, storage, {}, "w")(late)
    assert "over the trial budget" in study.get_trials()[-1].user_attrs["note"]


def test_a_study_refuses_another_setup(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    common = ["--trace", CHAT, "--trials", "2", "--workers", "1", "--out", str(out)]
    assert run(*common, *CLUSTER) == 0
    assert run(*common, "--endpoints", "4", "--num-gpu-blocks", "400") == 2
    error = capsys.readouterr().err
    assert "made for another setup (differs in: cluster)" in error
    # The same requests under another name (a copy on another machine) are the same trace.
    original = tmp_path / "chat.jsonl"
    write_kv_picker_jsonl(parse_trace_spec(CHAT), original)
    copy = tmp_path / "elsewhere" / "renamed.jsonl"
    copy.parent.mkdir()
    shutil.copy(original, copy)
    files = ["--trials", "2", "--workers", "1", *CLUSTER, "--study", "files"]
    assert run("--trace", str(original), *files, "--out", str(out)) == 0
    assert run("--trace", str(copy), *files, "--out", str(out)) == 0
    assert run("--trace", str(copy), "--first", "80", *files, "--out", str(out)) == 2
    assert "(differs in: trace, windows)" in capsys.readouterr().err


def test_usage_errors_exit_2_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    space = tmp_path / "space.yaml"
    space.write_text("- plugin: queue-scorer\n  weight: {low: 0, high: -1}\n")
    common = ["--trace", CHAT, *CLUSTER, "--out", str(tmp_path / "x")]
    cases = [
        (["--space", str(space)], f"{space}:2: dimensions[0].weight.high: must be >= 0"),
        (["--held-out", "every:1"], "holds out every window"),
        (["--windows", "1"], "need at least 2"),
        (["--storage", "postgresql://db/x"], "expected redis://HOST:PORT/DB"),
        (["--trials", "0"], "--trials must be >= 1"),
        (["--base", str(tmp_path / "missing.yaml")], "no file"),
    ]
    for extra, message in cases:
        assert run(*common, *extra) == 2, extra
        assert message in capsys.readouterr().err, extra


@pytest.fixture(scope="module")
def valkey() -> Iterator[ValkeyServer]:
    with ValkeyServer() as server:
        yield server


def test_two_worker_processes_share_one_study_in_valkey(
    tmp_path: Path, valkey: ValkeyServer, capsys: pytest.CaptureFixture[str]
) -> None:
    # LONGER's trials are long enough that neither process takes them all before the other
    # has started.
    common = ["--trace", LONGER, *CLUSTER, "--storage", valkey.url, "--study", "s1"]
    assert run(*common, "--trials", "10", "--workers", "2", "--out", str(tmp_path / "a")) == 0
    study = study_of(valkey.url, "s1")
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    assert len(complete) == 10
    workers = {t.user_attrs["worker"] for t in complete}
    assert len(workers) == 2, workers
    assert {t.user_attrs["pid"] for t in complete}.isdisjoint({os.getpid()})
    # Nothing of it on disk: the journal lives in Valkey only.
    assert not (tmp_path / "a" / "study.journal").exists()
    assert json.loads((tmp_path / "a" / "report.json").read_text())["complete"] == 10
    # Another machine's worker joins the same study with the same flags, and adds to it.
    capsys.readouterr()
    assert run(*common, "--trials", "12", "--workers", "1", "--worker-only") == 0
    assert "holds 12 complete trials" in capsys.readouterr().out
    assert len(study_of(valkey.url, "s1").get_trials(states=(TrialState.COMPLETE,))) == 12
    # With another trace, the study is refused rather than mixed.
    other = ["--trace", CHAT, *CLUSTER, "--storage", valkey.url, "--study", "s1"]
    assert run(*other, "--trials", "12", "--worker-only") == 2


def test_the_command_is_registered_and_prints_its_space() -> None:
    listing = kv_picker("--help", timeout_s=30)
    assert "tune" in listing.stdout
    printed = kv_picker("tune", "--print-space", timeout_s=30)
    assert printed.returncode == 0 and printed.stdout == DEFAULT_SPACE
    default_profile_weights = {r["pluginRef"]: r.get("weight") for r in DEFAULT_PROFILE["plugins"]}
    space = load_space(printed.stdout, "printed", {}, "base", harness_registry())
    assert space.base_values is not None
    for name, weight in default_profile_weights.items():
        if weight is not None:
            assert space.base_values[f"{name}.weight"] == weight


def test_tune_imports_no_other_command() -> None:
    # Like the replay and live commands, it shares their flags through args only.
    graph = grimp.build_graph("kv_picker_bench", cache_dir=None)
    for other in ("cli", "live", "peers", "replay", "sweep"):
        chain = graph.find_shortest_chain(
            importer="kv_picker_bench.harness.tune", imported=f"kv_picker_bench.harness.{other}"
        )
        assert chain is None, " -> ".join(chain)
    assert graph.direct_import_exists(
        importer="kv_picker_bench.harness.tune", imported="kv_picker_bench.harness.args"
    )


def test_a_base_with_per_side_pd_parameters_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = tmp_path / "base.yaml"
    base.write_text(
        "plugins:\n  - {type: queue-scorer}\n  - {type: max-score-picker}\n"
        "pdParameters: {decode: {queue-scorer: {x: 1}}}\n"
    )
    argv = ["--trace", CHAT, *CLUSTER, "--trials", "1", "--workers", "1"]
    assert run(*argv, "--out", str(tmp_path / "run"), "--base", str(base)) == 2
    assert "pdParameters (per-side P/D parameters) are not tuned" in capsys.readouterr().err
    assert not (tmp_path / "run" / "report.json").exists()
