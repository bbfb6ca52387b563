"""An Envoy that sends kv-picker no responses: the picker says so, in its metrics and its log."""

from __future__ import annotations

import urllib.request

from kv_picker_bench.localstack import LocalStack, free_port
from kv_picker_bench.overhead import mode_bootstrap
from tests.integration.conftest import post


def _unseen(stack: LocalStack) -> float:
    url = f"http://127.0.0.1:{stack.picker_metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    (line,) = [x for x in text.splitlines() if x.startswith("kv_picker_responses_unseen_total ")]
    return float(line.split()[1])


def test_streams_without_responses_are_counted_and_logged() -> None:
    with LocalStack(sims=2, time_scale=0.01, start_envoy=False) as stack:
        # Request bodies full duplex, responses not sent to the processor at all.
        port, admin = free_port(), free_port()
        stack.launch_envoy("envoy-no-responses", mode_bootstrap("streamed", port, admin,
                           stack.picker_grpc_port), admin)  # fmt: skip
        body = {"model": "sim-model", "prompt": "tell me a story", "max_tokens": 4}
        for _ in range(3):
            reply = post(f"http://127.0.0.1:{port}/v1/completions", body)
            assert reply.status == 200, reply.body
        assert _unseen(stack) == 3
        assert stack.picker is not None
        log = stack.picker.log_tail()
        assert log.count("response_body_mode NONE") == 1, log
        # The stack's own Envoy configuration sends the responses: nothing more is counted.
        gateway, gateway_admin = free_port(), free_port()
        stack.launch_envoy("envoy-gie", mode_bootstrap("gie", gateway, gateway_admin,
                           stack.picker_grpc_port), gateway_admin)  # fmt: skip
        assert post(f"http://127.0.0.1:{gateway}/v1/completions", body).status == 200
        assert _unseen(stack) == 3
