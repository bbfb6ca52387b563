"""Prefill/decode disaggregation through real Envoy: picker -> decode endpoint -> prefill leg."""

from __future__ import annotations

import random
from typing import Any

import yaml

from kv_picker_bench.localstack import LocalStack, SimSpec
from kv_picker_bench.workloads import words
from tests.integration.conftest import post
from tests.picker.test_upstream import PD

PD_CONFIG = {
    "plugins": [
        {"type": "decode-filter"},
        {"type": "prefill-filter"},
        {"type": "prefix-cache-scorer"},
        {"type": "queue-scorer"},
        {"type": "pd-profile-handler", "parameters": {"nonCachedTokens": 256}},
    ],
    "schedulingProfiles": [
        {
            "name": "decode",
            "plugins": [
                {"pluginRef": "decode-filter"},
                {"pluginRef": "prefix-cache-scorer", "weight": 3},
                {"pluginRef": "queue-scorer"},
            ],
        },
        {
            "name": "prefill",
            "plugins": [{"pluginRef": "prefill-filter"}, {"pluginRef": "queue-scorer"}],
        },
    ],
}


def _disaggregated(reply: Any, prefill_address: str) -> dict[str, Any]:
    """The simulated endpoint's timing of a reply served by a decode endpoint whose prompt was
    computed at ``prefill_address``."""
    assert reply.status == 200, reply.body
    timing: dict[str, Any] = reply.json()["kv_picker_sim"]
    assert reply.headers["x-kv-picker-sim-endpoint"] != prefill_address
    assert timing["prefill_endpoint"] == prefill_address
    assert timing["prefill_leg_error"] is None
    return timing


def test_long_prompt_is_disaggregated_short_and_cached_ones_are_not() -> None:
    sims = [SimSpec(role="prefill"), SimSpec(role="decode"), SimSpec(role="decode")]
    with LocalStack(sims=sims, picker_config=PD_CONFIG, time_scale=0.02) as stack:
        prefill_address = stack.sim_addresses[0]
        document = "Reference manual. " + words(random.Random(4), 1500)

        long_reply = post(
            stack.url + "/v1/completions",
            {"model": "sim-model", "prompt": document, "max_tokens": 6},
        )
        timing = _disaggregated(long_reply, prefill_address)
        assert timing["transferred_tokens"] == long_reply.json()["usage"]["prompt_tokens"]
        assert long_reply.json()["usage"]["completion_tokens"] == 6

        short_reply = post(
            stack.url + "/v1/completions",
            {"model": "sim-model", "prompt": "What is 2+2?", "max_tokens": 3},
        )
        assert short_reply.status == 200
        assert short_reply.json()["kv_picker_sim"]["prefill_endpoint"] is None

        # The same document again: its decode endpoint holds it, so nothing long is uncached.
        cached_reply = post(
            stack.url + "/v1/completions",
            {"model": "sim-model", "prompt": document + " Summarise.", "max_tokens": 3},
        )
        assert cached_reply.status == 200
        assert cached_reply.json()["kv_picker_sim"]["prefill_endpoint"] is None
        assert (
            cached_reply.headers["x-kv-picker-sim-endpoint"]
            == long_reply.headers["x-kv-picker-sim-endpoint"]
        )

        legs = stack.sim_metrics()
        assert legs[prefill_address]["kv_picker_sim_pd_legs_total"] == 1.0
        text = stack.picker_metrics_text()
        assert 'outcome="disaggregated"' in text
        assert (
            f'kv_picker_picks_total{{endpoint="{prefill_address}",profile="prefill"}} 1.0' in text
        )


def test_llm_d_guide_pd_config_disaggregates_every_request_through_envoy() -> None:
    # llm-d's P/D guide config, unchanged: disagg-profile-handler asking always-disagg-pd-decider,
    # with its headers handler (not built here: the picker sets x-prefiller-host-port itself).
    sims = [SimSpec(role="prefill"), SimSpec(role="decode"), SimSpec(role="decode")]
    with LocalStack(sims=sims, picker_config=yaml.safe_load(PD), time_scale=0.02) as stack:
        prefill_address = stack.sim_addresses[0]
        for prompt in ("What is 2+2?", "Reference manual. " + words(random.Random(5), 300)):
            body = {"model": "sim-model", "prompt": prompt, "max_tokens": 3}
            _disaggregated(post(stack.url + "/v1/completions", body), prefill_address)
        assert stack.sim_metrics()[prefill_address]["kv_picker_sim_pd_legs_total"] == 2.0
