"""kv-picker bench moves: the picks away from the endpoint holding a request's context."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from kv_picker.errors import ConfigError
from kv_picker_bench.harness.matrix import parse_cell
from kv_picker_bench.harness.moves import find_moves, main, markdown
from kv_picker_bench.harness.policies import resolve_policy

CELL = "long-doc-qa/0.3/small4/llama-3.1-8b-h100"


def _policy(tmp_path: Path, name: str, document: dict[str, object]) -> str:
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(document))
    return f"{name}={path}"


def _blind(tmp_path: Path, scorer: str) -> str:
    """A policy matching 4 prefix blocks, then ``scorer``."""
    plugins = [
        {"type": "prefix-cache-scorer", "parameters": {"maxPrefixBlocksToMatch": 4}},
        {"type": scorer},
        {"type": "max-score-picker"},
    ]
    return _policy(tmp_path, "blind", {"plugins": plugins})


def test_a_spreading_policy_moves_requests_off_their_documents_and_the_default_fewer(
    tmp_path: Path,
) -> None:
    spread = _policy(
        tmp_path,
        "spread",
        {"plugins": [{"type": "active-request-scorer"}, {"type": "max-score-picker"}]},
    )
    report = find_moves(CELL, resolve_policy(spread), min_tokens=4096, quick=True)
    assert report.moves, "spreading by requests in flight alone ignores where documents are"
    for move in report.moves:
        assert move.holder != move.pick
        assert move.holder_tokens - move.pick_tokens >= 4096
        assert move.holder_tokens <= move.prompt_tokens
        # The only scorer chose the pick: it scored it at least as high as the holder.
        assert set(move.margins) == {"active-request-scorer"}
        assert move.margins["active-request-scorer"] >= 0
    assert report.recomputed == sum(m.holder_tokens - m.pick_tokens for m in report.moves)
    assert [v.scorer for v in report.votes] == ["active-request-scorer"]
    default = find_moves(CELL, resolve_policy("kv-picker"), min_tokens=4096, quick=True)
    assert len(default.moves) < len(report.moves)
    assert {v.scorer for v in default.votes} == {
        "prefix-cache-scorer", "predicted-latency-scorer", "active-request-scorer",
        "recent-work-scorer",
    }  # fmt: skip
    # The prefix scorer never votes to leave the endpoint holding more of the prompt...
    prefix = next(v for v in default.votes if v.scorer == "prefix-cache-scorer")
    assert prefix.margin_sum <= 0


def test_a_short_prefix_match_shows_as_moves_the_picker_could_not_see(tmp_path: Path) -> None:
    # Matching 4 blocks (about 64 tokens), the picker sees almost nothing of a document it holds.
    blind = _blind(tmp_path, "active-request-scorer")
    report = find_moves(CELL, resolve_policy(blind), min_tokens=4096, quick=True)
    assert report.moves
    assert all(m.seen_at_holder < m.holder_tokens for m in report.moves)
    assert report.unseen == len(report.moves)


def test_the_latency_estimate_is_set_against_the_ttft_measured_at_each_pick(
    tmp_path: Path,
) -> None:
    # The estimate counts a prompt's blocks past the match limit as uncached: with a 4-block
    # limit, a question whose whole document is cached at the pick is predicted as a prefill of
    # the document, and measured as a short one.
    blind = _blind(tmp_path, "predicted-latency-scorer")
    report = find_moves(CELL, resolve_policy(blind), min_tokens=4096, quick=True)
    groups = {c.group: c for c in report.calibration}
    assert sum(c.requests for c in report.calibration) == report.requests
    capped = groups["match capped at the pick"]
    assert capped.requests > 0
    assert capped.ratio_median < 0.5
    assert capped.measured_mean_s < capped.predicted_mean_s
    for c in report.calibration:
        assert 0 < c.ratio_p10 <= c.ratio_median <= c.ratio_p90
    # Matching the default's 2,048 blocks, the same cell's documents are seen whole.
    default = find_moves(CELL, resolve_policy("kv-picker"), min_tokens=4096, quick=True)
    seen = {c.group: c.requests for c in default.calibration}
    assert seen.get("match capped at the pick", 0) < capped.requests
    text = markdown(default, "kv-picker bench moves ...", 3)
    assert "| match capped at the pick |" in text or "| neither |" in text
    # A policy without the estimate has nothing to set against.
    spread = _policy(
        tmp_path,
        "spread",
        {"plugins": [{"type": "active-request-scorer"}, {"type": "max-score-picker"}]},
    )
    bare = find_moves(CELL, resolve_policy(spread), min_tokens=4096, quick=True)
    assert bare.calibration == []
    assert "The latency estimate against" not in markdown(bare, "kv-picker bench moves ...", 3)


def test_the_command_writes_its_report_and_refuses_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert main([CELL, "--quick", "--top", "3", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert text == (out / "moves.md").read_text()
    data = json.loads((out / "moves.json").read_text())
    assert data["policy"] == "kv-picker" and data["cell"] == CELL.replace("/", " / ")
    assert f"**{len(data['moves'])} moves**" in text
    assert data["recomputed"] == sum(m["recomputed"] for m in data["moves"])
    for argv, message in (
        (["long-doc-qa/0.3/small4"], "expected family/load/cluster/timing"),
        (["nope/0.3/small4/llama-3.1-8b-h100"], "unknown family 'nope'; known: conversation"),
        (["long-doc-qa/0.3/small5/llama-3.1-8b-h100"], "unknown cluster 'small5'"),
        (["long-doc-qa/0.3/small4/gpt"], "unknown timing profile 'gpt'"),
        (["long-doc-qa/-1/small4/llama-3.1-8b-h100"], "the load must be a positive number"),
        (["long-doc-qa/nan/small4/llama-3.1-8b-h100"], "the load must be a positive number"),
        (["chat/0.3/pd/llama-3.1-8b-h100"], "the matrix has no pd cell for chat"),
        ([CELL, "--min-tokens", "0"], "--min-tokens must be at least 1"),
        ([CELL, "--top", "-1"], "--top must be at least 0"),
        ([CELL, "--policy", "no-such-policy"], "not a named policy"),
    ):
        assert main([*argv, "--quick"]) == 2, argv
        assert message in capsys.readouterr().err, argv


def test_the_pd_pool_is_examined_under_the_pd_handler_at_its_decode_endpoints() -> None:
    report = find_moves("long-doc-qa/0.9/pd/llama-3.1-8b-h100", resolve_policy("kv-picker"),
                        min_tokens=1024, quick=True)  # fmt: skip
    assert report.disaggregated is not None
    assert 0 < report.disaggregated <= report.requests
    # The scorers voting are the decode profile's (the primary one under the P/D handler).
    assert report.votes and all(v.scorer.startswith("decode-") for v in report.votes)
    assert sum(c.requests for c in report.calibration) == report.requests
    text = markdown(report, "kv-picker bench moves ...", 3)
    assert f"P/D: {report.disaggregated} of the {report.requests} requests" in text
    single = find_moves(CELL, resolve_policy("kv-picker"), min_tokens=4096, quick=True)
    assert single.disaggregated is None and "P/D:" not in markdown(single, "...", 3)


def test_cells_are_read_as_the_matrix_writes_them() -> None:
    assert parse_cell("long-doc-qa / 0.3 / small4 / llama-3.1-70b-h100-tp4") == (
        "long-doc-qa",
        0.3,
        "small4",
        "llama-3.1-70b-h100-tp4",
    )
    with pytest.raises(ConfigError, match="unknown family"):
        parse_cell("x/1/small4/llama-3.1-8b-h100")
