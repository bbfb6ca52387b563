"""Prefills whose end the gateway does not show (Envoy sends the picker no response body) end
when the endpoint's scraped first-token count says so: the oldest blind requests first, less
the prefill ends the picker learned of otherwise."""

from __future__ import annotations

import math
from typing import Any

import pytest

from kv_picker.director import Director, RoutedRequest
from kv_picker.endpoint import EndpointId, EndpointSpec
from tests.fakes import ManualClock, make_director, make_request, make_store

E0 = EndpointId(0)


def _director() -> Director:
    director = make_director(store=make_store(1))
    _scrape(director, 100.0)  # the count's baseline: growth is counted from here
    return director


def _scrape(director: Director, first_tokens: float | None) -> None:
    director.store.update_metrics(
        E0, waiting=0.0, running=0.0, kv_usage=0.0, first_tokens=first_tokens
    )


def _route(director: Director, blind: bool = True) -> RoutedRequest:
    routed = director.route(make_request(request_id=f"r{director.store.prefill_requests[0]}"))
    if blind:
        routed.no_first_byte()
    return routed


def _prefilling(*requests: RoutedRequest) -> list[bool]:
    return [r.prefilling for r in requests]


def test_the_count_ends_the_oldest_blind_prefills_first() -> None:
    director = _director()
    a, b, c = (_route(director) for _ in range(3))
    assert director.store.prefill_requests[0] == 3
    _scrape(director, 100.0)  # no first token yet
    assert _prefilling(a, b, c) == [True, True, True]
    _scrape(director, 102.0)
    assert _prefilling(a, b, c) == [False, False, True]
    assert director.store.prefill_requests[0] == 1
    # The snapshot of the picker's own queued requests is taken after the count is applied.
    assert director.store.scraped_prefill_requests[0] == 1
    _scrape(director, 103.0)
    assert _prefilling(c) == [False]
    assert director.store.prefill_requests[0] == 0
    assert director.store.prefill_tokens[0] == 0.0


def test_a_blind_request_that_finished_is_not_counted_twice() -> None:
    director = _director()
    a, b = _route(director), _route(director)
    a.finish()  # a short answer: its first token and its end before the next scrape
    _scrape(director, 101.0)  # that first token is a's, not b's
    assert _prefilling(b) == [True]
    _scrape(director, 102.0)
    assert _prefilling(b) == [False]


def test_first_bytes_seen_are_subtracted_even_when_the_count_lags() -> None:
    director = _director()
    seen, b, c = _route(director, blind=False), _route(director), _route(director)
    seen.first_byte()
    _scrape(director, 100.0)  # read before the engine counted it
    assert _prefilling(b, c) == [True, True]
    _scrape(director, 102.0)  # seen's first token and b's
    assert _prefilling(b, c) == [False, True]


def test_without_a_count_the_prefill_ends_with_the_request() -> None:
    director = make_director(store=make_store(1))
    _scrape(director, None)
    a = _route(director)
    _scrape(director, 5.0)
    _scrape(director, 9.0)  # the endpoint exports the count now; a was not waiting on it
    assert _prefilling(a) == [True]
    a.finish()
    assert director.store.prefill_requests[0] == 0


@pytest.mark.parametrize("garbage", [math.nan, math.inf, -math.inf])
def test_a_count_that_is_not_a_number_is_no_count(garbage: float) -> None:
    director = _director()
    a = _route(director)
    _scrape(director, garbage)
    assert _prefilling(a) == [True]
    assert director.store.first_tokens[0] == -1.0
    b = _route(director)  # no count to wait for: its prefill ends with it
    _scrape(director, 5.0)  # a count again, from here
    c = _route(director)
    _scrape(director, 6.0)
    assert _prefilling(a, b, c) == [False, True, True]  # the oldest first; b waits its end


def test_a_count_that_went_down_is_a_restart_not_first_tokens() -> None:
    director = _director()
    a = _route(director)
    _scrape(director, 3.0)
    assert _prefilling(a) == [True]
    _scrape(director, 4.0)
    assert _prefilling(a) == [False]


def test_sighted_requests_are_not_ended_by_the_count() -> None:
    director = _director()
    a = _route(director, blind=False)
    _scrape(director, 105.0)
    assert _prefilling(a) == [True]  # its own first byte will say


def test_a_request_sent_to_a_replaced_server_is_not_ended_by_its_successors_count() -> None:
    director = _director()
    old = _route(director)
    # A new pod at the same address (a new instance) takes the freed id; its count starts over.
    director.store.set_endpoints([EndpointSpec("10.0.0.1:8000", instance="pod-2")])
    assert director.store.get(E0) is not old.endpoint
    _scrape(director, 0.0)
    new = _route(director)
    _scrape(director, 1.0)
    assert _prefilling(old, new) == [True, False]
    assert director.store.prefill_requests[0] == 0


def test_first_tokens_of_other_pickers_requests_are_not_taken_for_its_own() -> None:
    """Another replica (or clients around the gateway) sends the endpoint as many requests:
    half its first tokens are this picker's, and a blind request waits for its half."""
    director = _director()
    count = 100.0
    for _ in range(10):  # a request of ours and one of the other's, answered between scrapes
        ours = _route(director)
        count += 2
        _scrape(director, count)
        assert _prefilling(ours) == [False]
    late = _route(director)
    _scrape(director, count + 1)  # the other's request, queued ahead of ours
    assert _prefilling(late) == [True]
    _scrape(director, count + 2)
    assert _prefilling(late) == [False]


def test_the_share_is_learned_again_for_a_new_endpoint() -> None:
    director = _director()
    count = 100.0
    for _ in range(10):  # half the first tokens there are this picker's
        _route(director)
        count += 2
        _scrape(director, count)
    director.store.set_endpoints([EndpointSpec("10.0.0.1:8000", instance="pod-2")])
    _scrape(director, 0.0)
    alone = _route(director)
    _scrape(director, 1.0)  # a new server: nothing says that others send there
    assert _prefilling(alone) == [False]


class _Peers:
    """Stands in for kv_picker.peers.PeerSync: records the prefill ends this worker sends."""

    def __init__(self) -> None:
        self.sent: list[tuple[Any, ...]] = []

    def picked(self, *args: Any) -> None:
        pass

    def released(self, *args: Any) -> None:
        pass

    def prefilled(self, *args: Any) -> None:
        self.sent.append(args)


def test_with_other_workers_a_worker_takes_its_share_of_the_count() -> None:
    director = _director()
    peers = _Peers()
    director.peers = peers  # type: ignore[assignment]
    a, b = _route(director), _route(director)
    # Another worker's two requests are queued there too (its picks, through kv_picker.peers).
    director.store.add_prefill(E0, 100.0)
    director.store.add_prefill(E0, 100.0)
    _scrape(director, 102.0)  # two first tokens over four queued prefills: one is this worker's
    assert _prefilling(a, b) == [False, True]
    assert len(peers.sent) == 1 and peers.sent[0][0] is a.endpoint  # the others learn of it
    _scrape(director, 103.0)  # a third of a first token (b over three queued): owed, not given
    assert _prefilling(b) == [True]
    _scrape(director, 106.0)
    assert _prefilling(b) == [False]


def test_a_share_just_under_whole_does_not_fall_behind() -> None:
    """A picker that sends most of an endpoint's requests ends one prefill per first token
    of its own, without the shortfall of each piling up."""
    director = _director()
    count = 100.0
    for _ in range(20):  # nineteen of every twenty first tokens are this picker's
        for _ in range(19):
            _route(director)
        count += 20
        _scrape(director, count)
    assert director.store.prefill_requests[0] == 0
    oldest = _route(director)
    for _ in range(10):  # one more always queued behind: the fraction carried stays
        newest = _route(director)
        count += 1
        _scrape(director, count)
        assert _prefilling(oldest, newest) == [False, True]
        oldest = newest


def test_only_a_first_byte_seen_gives_the_store_a_prefill_time() -> None:
    # The latency estimate's calibration reads prefill times from first bytes the picker saw,
    # never from prefill ends it inferred from a scrape or from the request's end.
    director = _director()
    store, clock = director.store, director.store._clock
    document = "x" * 4 * 6000  # 6,000 tokens, cached nowhere
    seen = director.route(make_request(document, request_id="seen"))
    clock.advance(1.25)  # type: ignore[attr-defined]
    seen.first_byte()
    assert [(s.tokens, s.seconds) for s in store.prefill_samples] == [(6000.0, 1.25)]
    blind = director.route(make_request(document + "y" * 4 * 6000, request_id="blind"))
    blind.no_first_byte()
    _scrape(director, 102.0)  # seen's first token and blind's: its prefill ends by the count
    assert not blind.prefilling
    ended = director.route(make_request("z" * 4 * 6000, request_id="ended"))
    ended.finish()
    assert store.prefill_sample_count == 1


def test_the_store_keeps_when_each_request_in_flight_was_picked() -> None:
    # predicted-latency-scorer's slotWait reads these: oldest first, each dropped once its
    # request ends (finishing twice drops nothing more), none of a replaced server's.
    clock = ManualClock(50.0)
    director = make_director(store=make_store(1, clock=clock))
    store = director.store
    a = _route(director, blind=False)
    clock.advance(1.0)
    b = _route(director, blind=False)
    clock.advance(1.0)
    c = director.route_bodyless(None)  # a request without a body holds a slot too
    assert store.picked_s[0] == [50.0, 51.0, 52.0]
    b.finish()
    b.finish()
    assert store.picked_s[0] == [50.0, 52.0]
    store.set_endpoints([EndpointSpec("10.0.0.1:8000", instance="pod-2")])
    assert store.picked_s[0] == []
    _scrape(director, 0.0)  # ready
    d = _route(director, blind=False)
    a.finish()  # sent to the old server: the new one's list is not touched
    c.finish()
    assert store.picked_s[0] == [52.0]
    d.finish()
    assert store.picked_s[0] == [] and store.in_flight[0] == 0
