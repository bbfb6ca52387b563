"""The admin API (kvpicker.v1.Admin) against a running picker behind real Envoy."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kv_picker.api import admin_pb2, admin_pb2_grpc
from kv_picker_bench.localstack import LocalStack
from kv_picker_bench.workloads import words
from tests.integration.conftest import post

ROOT = Path(__file__).resolve().parents[2]
PROMPT = "A long shared instruction block. " + words(random.Random(2), 400)


@pytest.fixture(scope="module")
def stack() -> Iterator[LocalStack]:
    with LocalStack(sims=3, time_scale=0.02) as local:
        yield local


def stub(stack: LocalStack) -> admin_pb2_grpc.AdminStub:
    channel = grpc.insecure_channel(f"127.0.0.1:{stack.picker_admin_port}")
    return admin_pb2_grpc.AdminStub(channel)


def explain(stack: LocalStack, body: dict[str, object]) -> admin_pb2.ExplainResponse:
    request = admin_pb2.ExplainRequest(body=json.dumps(body).encode())
    response: admin_pb2.ExplainResponse = stub(stack).Explain(request, timeout=10)
    return response


def prefix_scores(response: admin_pb2.ExplainResponse) -> dict[str, float]:
    (profile,) = response.profiles
    return {c.address: c.scores["prefix-cache-scorer"] for c in profile.candidates}


def test_explain_is_a_dry_run_and_sees_live_state(stack: LocalStack) -> None:
    body = {"model": "sim-model", "prompt": PROMPT + " first question", "max_tokens": 2}
    before = explain(stack, body)
    assert before.primary_profile == "default" and before.kind == "completions"
    assert set(prefix_scores(before).values()) == {0.0}
    # Asking again changes nothing: the dry run recorded no blocks.
    assert prefix_scores(explain(stack, body)) == prefix_scores(before)
    served = post(stack.url + "/v1/completions", body).headers["x-kv-picker-sim-endpoint"]
    follow_up = {**body, "prompt": PROMPT + " second question"}
    after = prefix_scores(explain(stack, follow_up))
    assert after[served] > 0.8
    assert all(score == 0.0 for address, score in after.items() if address != served)
    assert explain(stack, follow_up).profiles[0].picked == [served]


def test_explain_errors_map_to_grpc_codes(stack: LocalStack) -> None:
    with pytest.raises(grpc.RpcError) as info:
        stub(stack).Explain(admin_pb2.ExplainRequest(body=b"{nope"), timeout=10)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "400 bad-request" in (info.value.details() or "")


def test_list_endpoints(stack: LocalStack) -> None:
    response = stub(stack).ListEndpoints(admin_pb2.ListEndpointsRequest(), timeout=10)
    assert sorted(e.address for e in response.endpoints) == sorted(stack.sim_addresses)
    for endpoint in response.endpoints:
        assert endpoint.ready and 0 <= endpoint.metrics_age_seconds < 5
        assert endpoint.labels["llm-d.ai/role"] == "both"


def test_cli_explain_against_the_server(stack: LocalStack, tmp_path: Path) -> None:
    request = tmp_path / "body.json"
    request.write_text(
        json.dumps({"model": "sim-model", "messages": [{"role": "user", "content": "hi"}]})
    )
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kv_picker",
            "explain",
            "--server",
            f"127.0.0.1:{stack.picker_admin_port}",
            "--request",
            str(request),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["kind"] == "chat" and len(report["profiles"][0]["candidates"]) == 3


def test_the_admin_api_is_not_on_the_ext_proc_port(stack: LocalStack) -> None:
    channel = grpc.insecure_channel(f"127.0.0.1:{stack.picker_grpc_port}")
    with pytest.raises(grpc.RpcError) as info:
        admin_pb2_grpc.AdminStub(channel).ListEndpoints(
            admin_pb2.ListEndpointsRequest(), timeout=10
        )
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_generated_code_is_up_to_date(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools", reason="grpcio-tools is a dev dependency")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            "-I",
            str(ROOT / "proto"),
            f"--python_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            f"--pyi_out={tmp_path}",
            str(ROOT / "proto/kv_picker/api/admin.proto"),
        ],
        check=True,
        timeout=60,
    )
    for name in ("admin_pb2.py", "admin_pb2_grpc.py", "admin_pb2.pyi"):
        generated = _without_versions((tmp_path / "kv_picker/api" / name).read_text())
        assert generated == _without_versions((ROOT / "picker/api" / name).read_text()), (
            f"picker/api/{name} is stale: run `make proto`"
        )


def _without_versions(code: str) -> str:
    """Generated code less the generators' own versions (a patch release of grpcio-tools or
    protobuf changes them and nothing else); the code is stale only if the rest differs."""
    code = re.sub(r"GRPC_GENERATED_VERSION = '[^']*'", "GRPC_GENERATED_VERSION = ''", code)
    code = re.sub(r"# Protobuf Python Version: \S+", "# Protobuf Python Version:", code)
    return re.sub(
        r"(ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,)\s*\d+,\s*\d+,"
        r"\s*\d+,",
        r"\1",
        code,
    )


def test_the_version_lines_are_all_that_is_left_out() -> None:
    # Another generator version gives the same code; any other difference still shows.
    for name in ("admin_pb2.py", "admin_pb2_grpc.py"):
        ours = (ROOT / "picker/api" / name).read_text()
        other = re.sub(
            r"GRPC_GENERATED_VERSION = '[^']*'", "GRPC_GENERATED_VERSION = '9.9.9'", ours
        )
        other = re.sub(r"(Domain\.PUBLIC,\s*)\d+", r"\g<1>99", other)
        other = re.sub(r"Protobuf Python Version: \S+", "Protobuf Python Version: 99.0.0", other)
        assert other != ours
        assert _without_versions(other) == _without_versions(ours)
        assert _without_versions(ours + "changed = True\n") != _without_versions(ours)
