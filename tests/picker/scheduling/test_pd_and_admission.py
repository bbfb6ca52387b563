import asyncio
import json

import pytest
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from kv_picker.endpoint import ROLE_LABEL
from kv_picker.errors import BadRequestError, ConfigError, SaturatedError
from kv_picker.handlers.extproc import RequestStream
from kv_picker.peers import PeerSync
from kv_picker.scheduling.signals import PREFIX_MATCH
from tests.fakes import ManualClock, make_director, make_request, make_scheduler, make_store
from tests.picker.handlers.test_extproc_stream import body_message, headers_message, run

PD_CONFIG = {
    "plugins": [
        {"type": "decode-filter"},
        {"type": "prefill-filter"},
        {"type": "prefix-cache-scorer", "parameters": {"blockSizeChars": 64}},
        {"type": "queue-scorer"},
        {
            "type": "pd-profile-handler",
            "parameters": {"nonCachedTokens": 200, "minPromptTokens": 50},
        },
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
ROLES = [{ROLE_LABEL: "prefill"}, {ROLE_LABEL: "decode"}, {ROLE_LABEL: "decode"}, {}]


def test_long_uncached_prompt_is_disaggregated_then_cached_one_is_not() -> None:
    store = make_store(4, labels=ROLES)
    scheduler = make_scheduler(PD_CONFIG, store)
    prompt = "long shared document " * 100  # ~500 tokens by estimate
    first_request = make_request(prompt)
    first = scheduler.schedule(first_request, store.all())
    assert first.primary_profile == "decode"
    assert first.primary.targets[0].labels.get(ROLE_LABEL) != "prefill"
    assert first.profile_results["prefill"].targets[0].labels[ROLE_LABEL] == "prefill"
    # Its KV has not reached the decode endpoint yet: the same prompt again is disaggregated
    # too, rather than served there as cached and computed again on a decode endpoint.
    early = scheduler.schedule(make_request(prompt + " asked early"), store.all())
    assert early.prefill_profile == "prefill"
    # Once it has landed, the decode endpoint holds it: nothing long is left to prefill.
    scheduler.prompt_landed(first_request, first)
    second_request = make_request(prompt + " and one more question")
    second = scheduler.schedule(second_request, store.all())
    assert "prefill" not in second.profile_results
    assert second.destination is first.destination
    assert second_request.state[PREFIX_MATCH].matched_blocks


def test_with_record_destination_at_pick_a_pd_destination_holds_the_prompt_at_once() -> None:
    plugins = [dict(p) for p in PD_CONFIG["plugins"]]  # type: ignore[union-attr]
    plugins[2] = {
        "type": "prefix-cache-scorer",
        "parameters": {"blockSizeChars": 64, "recordDestinationAt": "pick"},
    }
    store = make_store(4, labels=ROLES)
    scheduler = make_scheduler({**PD_CONFIG, "plugins": plugins}, store)
    prompt = "long shared document " * 100
    first = scheduler.schedule(make_request(prompt), store.all())
    assert first.prefill_profile == "prefill"
    second = scheduler.schedule(make_request(prompt + " asked early"), store.all())
    assert "prefill" not in second.profile_results
    assert second.destination is first.destination


def test_short_prompt_is_not_disaggregated() -> None:
    store = make_store(4, labels=ROLES)
    scheduler = make_scheduler(PD_CONFIG, store)
    assert (
        "prefill" not in scheduler.schedule(make_request("short " * 5), store.all()).profile_results
    )


def test_no_prefill_pool_falls_back_to_aggregated() -> None:
    store = make_store(2, labels=[{ROLE_LABEL: "decode"}, {}])
    scheduler = make_scheduler(PD_CONFIG, store)
    result = scheduler.schedule(make_request("long " * 400), store.all())
    assert list(result.profile_results) == ["decode"]


def test_pd_handler_needs_its_profiles() -> None:
    config = {**PD_CONFIG, "schedulingProfiles": PD_CONFIG["schedulingProfiles"][:1]}
    with pytest.raises(ConfigError, match="prefill"):
        make_scheduler(config, make_store(2))


def test_prefiller_header_set_and_client_value_replaced() -> None:
    director = make_director(PD_CONFIG, store=make_store(4, labels=ROLES))
    body = json.dumps({"model": "m", "prompt": "document " * 300}).encode()
    out = run(
        RequestStream(director),
        headers_message(extra=[("x-prefiller-host-port", "6.6.6.6:1")]),
        body_message(body),
    )
    mutation = out[0].request_headers.response.header_mutation
    headers = {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}
    assert headers["x-prefiller-host-port"] == "10.0.0.1:8000"
    assert headers["x-gateway-destination-endpoint"] in {
        "10.0.0.2:8000",
        "10.0.0.3:8000",
        "10.0.0.4:8000",
    }
    assert "x-prefiller-host-port" not in mutation.remove_headers
    # The prompt's prefill work is queued on the prefill endpoint, not on the decode one.
    store = director.store
    assert store.prefill_tokens[store.by_address["10.0.0.1:8000"].id] == pytest.approx(2700 / 4)
    assert store.prefill_tokens[store.by_address[headers["x-gateway-destination-endpoint"]].id] == 0


@pytest.mark.parametrize("first_byte", [True, False])
def test_a_disaggregated_request_is_in_flight_at_its_prefill_endpoint_until_the_first_byte(
    first_byte: bool,
) -> None:
    director = make_director(PD_CONFIG, store=make_store(4, labels=ROLES))
    store = director.store
    body = json.dumps({"model": "m", "prompt": "document " * 300}).encode()
    stream = RequestStream(director)
    out = run(stream, headers_message(), body_message(body))
    mutation = out[0].request_headers.response.header_mutation
    headers = {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}
    prefill = store.by_address[headers["x-prefiller-host-port"]].id
    decode = store.by_address[headers["x-gateway-destination-endpoint"]].id
    assert (store.in_flight[prefill], store.in_flight[decode]) == (1, 1)
    # The prompt's tokens count where decode steps will read them.
    assert (store.in_flight_tokens[prefill], store.in_flight_tokens[decode]) == (0.0, 2700 / 4)
    (scorer,) = [p for p in director.scheduler.plugins.values() if hasattr(p, "index")]
    assert scorer.index.held(decode) == []  # its KV is not there yet
    if first_byte:  # the prefill leg is over; the decode endpoint still holds the request
        run(stream, pb.ProcessingRequest(response_body=pb.HttpBody(body=b"{")))
        assert (store.in_flight[prefill], store.in_flight[decode]) == (0, 1)
        assert scorer.index.held(decode) == scorer.index.held(prefill) != []  # landed
    stream.close()  # the response ended, or the client went away before any byte
    assert sum(store.in_flight) == 0 and sum(store.in_flight_tokens) == 0.0
    assert sum(store.prefill_requests) == 0
    assert scorer.index.held(decode) == scorer.index.held(prefill)  # the end lands it too


ADMISSION = {
    "objectives": [{"name": "batch", "priority": -1}, {"name": "vip", "priority": 5}],
    "models": [{"name": "m"}, {"name": "cheap", "priority": -2}],
}


def test_priority_sources() -> None:
    director = make_director(ADMISSION)
    admission = director.admission
    assert admission.priority(make_request(headers={"x-llm-d-inference-objective": "batch"})) == -1
    assert admission.priority(make_request(headers={"x-gateway-inference-objective": "vip"})) == 5
    assert admission.priority(make_request(headers={"x-kv-picker-priority": "-3"})) == -3
    assert admission.priority(make_request(model="cheap")) == -2
    assert admission.priority(make_request()) == 0
    with pytest.raises(BadRequestError):
        admission.priority(make_request(headers={"x-kv-picker-priority": "high"}))


def test_saturation_sheds_only_sheddable() -> None:
    clock = ManualClock()
    store = make_store(2, waiting=[10, 0], kv_usage=[0.2, 0.9], clock=clock)
    director = make_director(ADMISSION, store=store)
    assert director.admission.saturation(store.all()) == pytest.approx((2.0 + 0.9 / 0.8) / 2)
    sheddable = make_request(headers={"x-llm-d-inference-objective": "batch"})
    with pytest.raises(SaturatedError) as info:
        director.route(sheddable)
    assert info.value.status == 429 and "sheddable" in info.value.message
    assert director.route(make_request()).endpoint
    store.update_metrics(store.all()[0].id, waiting=0, running=0, kv_usage=0.1)
    store.update_metrics(store.all()[1].id, waiting=1, running=0, kv_usage=0.1)
    assert director.route(make_request(headers={"x-llm-d-inference-objective": "batch"})).endpoint
    clock.advance(60)  # every scrape stale: unknown load counts as saturated
    with pytest.raises(SaturatedError):
        director.route(make_request(headers={"x-llm-d-inference-objective": "batch"}))
    exposition = director.metrics.exposition().decode()
    assert 'kv_picker_admission_decisions_total{decision="shed"} 2.0' in exposition


@pytest.mark.parametrize(
    ("document", "fragment"),
    [
        ({"admission": {"queueDepthThreshold": 0}}, "queueDepthThreshold"),
        ({"admission": {"kvCacheUtilThreshold": 1.5}}, "kvCacheUtilThreshold"),
        ({"admission": {"bogus": 1}}, "bogus"),
        ({"objectives": [{"name": "a"}, {"name": "a"}]}, "twice"),
        ({"objectives": [{"priority": 1}]}, "objectives[0].name"),
        ({"models": [{"name": "m", "priority": "high"}]}, "priority"),
        ({"hardware": {"defaultClass": "TPU"}}, "defaultClass"),
        ({"hardware": {"classes": [{"name": "X", "prefillSpeed": 1}]}}, "decodeSpeed"),
        (
            {
                "hardware": {
                    "classes": [
                        {"name": "X", "prefillSpeed": -1, "decodeSpeed": 1, "kvCapacity": 1}
                    ]
                }
            },
            "prefillSpeed",
        ),
    ],
)
def test_bad_admission_and_hardware_config(document: dict[str, object], fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        make_director(document)


async def test_another_worker_records_a_pd_destination_once_the_prompt_landed(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """serve --workers: one worker's disaggregated request teaches the other worker's prefix
    index the prefill endpoint at the pick and the destination at the first byte, over the
    workers' real sockets."""
    directors = [make_director(PD_CONFIG, store=make_store(4, labels=ROLES)) for _ in range(2)]
    syncs = []
    for index, director in enumerate(directors):
        sync = PeerSync(
            director.store,
            lambda records, pick, d=director: d.scheduler.record_peer_picks(records, pick),
            tmp_path,
            index,
            2,
            heartbeat_s=0.05,
        )
        sync.on_landed = lambda landing, d=director: d.scheduler.peer_prompt_landed(landing)
        director.peers = sync
        syncs.append(sync)
        sync.start()
    tasks = [asyncio.create_task(sync.run()) for sync in syncs]

    async def until(check) -> None:  # type: ignore[no-untyped-def]
        for _ in range(500):
            if check():
                return
            await asyncio.sleep(0.01)
        raise AssertionError("condition not met in time")

    try:
        await until(lambda: 1 in syncs[0].peers and 0 in syncs[1].peers)
        body = json.dumps({"model": "m", "prompt": "document " * 300}).encode()
        stream = RequestStream(directors[0])
        out = run(stream, headers_message(), body_message(body))
        mutation = out[0].request_headers.response.header_mutation
        headers = {h.header.key: h.header.raw_value.decode() for h in mutation.set_headers}
        other = directors[1].store
        prefill = other.by_address[headers["x-prefiller-host-port"]].id
        decode = other.by_address[headers["x-gateway-destination-endpoint"]].id
        (scorer,) = [p for p in directors[1].scheduler.plugins.values() if hasattr(p, "index")]
        await until(lambda: scorer.index.held(prefill) != [])
        await asyncio.sleep(0.1)  # what else the pick sent has arrived too
        assert scorer.index.held(decode) == []  # its KV is not there yet
        run(stream, pb.ProcessingRequest(response_body=pb.HttpBody(body=b"{")))
        await until(lambda: scorer.index.held(decode) != [])
        assert scorer.index.held(decode) == scorer.index.held(prefill)
        stream.close()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for sync in syncs:
            sync.close()
