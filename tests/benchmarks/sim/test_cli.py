"""Tests of the simulated endpoint's command line (a real subprocess, signals, exit codes)."""

from __future__ import annotations

import json
import selectors
import signal
import socket
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from kv_picker_bench.sim import (
    ENDPOINT_HEADER,
    SimEndpointConfig,
    build_parser,
    config_from_args,
    main,
)
from kv_picker_bench.sim.timing import DEFAULT_TIMING, LLAMA_70B_H100_TP4, TIMING_PROFILES

REPO_ROOT = Path(__file__).resolve().parents[3]


def _start(*args: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kv_picker_bench.sim", "--port", "0", "--time-scale", "0.01", *args],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        if not selector.select(timeout=15):
            proc.kill()
            proc.communicate()
            raise AssertionError("no ready line within 15 s")
    line = proc.stdout.readline()
    assert line.startswith("ready http://127.0.0.1:"), line
    return proc, line.split()[1]


def _stop(proc: subprocess.Popen[str], signum: int) -> int:
    proc.send_signal(signum)
    try:
        return proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        if proc.stderr is not None:
            proc.stderr.close()


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_process_serves_and_exits_cleanly_on_signal(signum: int) -> None:
    proc, url = _start("--role", "prefill", "--hardware-class", "L4", "--model", "m1")
    try:
        body = json.dumps({"model": "m1", "prompt": "hello", "max_tokens": 3}).encode()
        request = urllib.request.Request(
            url + "/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 200
            assert response.headers[ENDPOINT_HEADER] == url.removeprefix("http://")
            assert json.load(response)["usage"]["completion_tokens"] == 3
        with urllib.request.urlopen(url + "/metrics", timeout=10) as response:
            text = response.read().decode()
        assert 'role="prefill"' in text
        assert 'hardware_class="L4"' in text
    finally:
        code = _stop(proc, signum)
    assert code == 0


def test_parser_defaults() -> None:
    args = build_parser().parse_args(["--port", "8000"])
    assert (args.host, args.port, args.model, args.role) == ("127.0.0.1", 8000, "sim-model", "both")
    assert (args.hardware_class, args.time_scale, args.block_size) == ("H100", 1.0, 16)
    assert args.num_gpu_blocks is None
    assert args.max_num_seqs == 64
    assert args.seed == 0
    config = config_from_args(args)
    assert config.timing == DEFAULT_TIMING.name
    assert config.engine_config().timing is DEFAULT_TIMING
    assert config.kv_bytes_per_token == DEFAULT_TIMING.kv_bytes_per_token


def test_timing_flag_picks_the_profile_and_its_kv_size(capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser().parse_args(["--port", "0", "--timing", LLAMA_70B_H100_TP4.name])
    config = config_from_args(args)
    assert config.engine_config().timing is LLAMA_70B_H100_TP4
    assert config.kv_bytes_per_token == 327_680
    args = build_parser().parse_args(
        ["--port", "0", "--timing", LLAMA_70B_H100_TP4.name, "--kv-bytes-per-token", "5"]
    )
    assert config_from_args(args).kv_bytes_per_token == 5
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert all(name in text for name in TIMING_PROFILES)
    with pytest.raises(ValueError, match="unknown timing profile"):
        SimEndpointConfig(timing="llama-3.1-8b-tpu")


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--port", "1", "--role", "router"],
        ["--port", "1", "--time-scale", "0"],
        ["--port", "1", "--hardware-class", "TPU"],
        ["--port", "1", "--timing", "llama-3.1-8b-tpu"],
        ["--port", "1", "--block-size", "-4"],
        ["--port", "99999"],
    ],
)
def test_bad_arguments_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as excinfo:
        main(argv)
    assert excinfo.value.code == 2
    assert "error" in capsys.readouterr().err


def test_port_in_use_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["--port", str(port)]) == 1
    assert "cannot listen" in capsys.readouterr().err
