"""active-request-scorer: prefer endpoints with fewer requests in flight from this picker.

Type: ``active-request-scorer``

Formula: with ``n`` = requests routed to the endpoint and not yet finished (counted by the
picker itself, so it moves on every pick, not on every scrape; under P/D a request counts at its
prefill endpoint too, until its first byte), or their prompt tokens (the KV their decode steps
read: at the decode endpoint only) with ``unit: tokens``, divided by the endpoint's relative
decode speed when ``perHardware`` (an A100 decodes 0.61 as fast as an H100, so 6 requests there
weigh like 10 on an H100), and ``max_n`` the largest among the candidates:
``n <= idleThreshold`` -> 1.0, else ``1 - n / max(max_n, fullScale, promptScale * r)``, ``r``
the prompt tokens of the request being placed. Relative to the busiest candidate rather than
min-max, so one request more than a neighbour costs a little, not everything; and with
``fullScale``, a difference counts in full only once the busiest candidate holds that much, so
on a lightly loaded pool a few requests in flight do not outweigh a cache hit.

With ``promptScale`` (``unit: tokens`` only) the scale also grows with the request: a
difference counts in full only once the busiest candidate holds ``promptScale`` times its prompt.
Moving a 40,000-token question off the endpoint that holds its document recomputes 40,000 tokens
elsewhere; with ``promptScale: 2`` that happens for a difference in flight of that order (here
80,000 tokens), not for the first document-sized request in flight, while a short request still
spreads at ``fullScale``. Without it, one long context in flight exceeds an 8,192-token
``fullScale`` and every long question after it is spread as if the pool were busy.

``cachedScale`` (``unit: tokens`` only) grows the scale with what moving would lose instead: a
difference counts in full only once the busiest candidate holds ``cachedScale`` times the prompt
tokens the best-matching candidate already holds for the request (from the prefix scorer, which
must run first; 0 when none ran). A long prompt that nobody holds (a new document) spreads at
``fullScale`` like a short one, since it costs the same prefill wherever it goes, while a
question about a cached document stays near it. When both are set the larger scale counts.
The prefix scorer looks up at most ``maxPrefixBlocksToMatch`` blocks (2,048 in the built-in
default, about 32,800 tokens), so for a longer prompt the holder's share is capped there: a
question about a 60,000-token document cached whole counts 32,800 tokens held, unless the
prefix scorer's own ``cappedMatchIsWhole`` is set (the built-in default sets it), which
publishes such a match as the whole prompt to every reader. With this scorer's
``cappedMatchIsWhole``, a best match that covers every block looked up, with prompt left past
them, counts the whole prompt as held (a cached context is usually cached whole). On the
routing matrix it passed one held-out cell more on draws 1-3 and the same cells on draws 13-15,
with a worse worst throughput cell (``benchmarks/RESULTS.md`` section 1): the default does not
set it.
The built-in default sets ``cachedScale: 2`` in place of ``promptScale: 2``: on the routing
matrix it passed as many pooled tuning cells (123) and, on three draws no choice had seen, as
many pooled cells (203 of 240) with no worse worst cell (``benchmarks/RESULTS.md`` section 1).
At 8 it kept agent contexts and long documents with their holders at light load on small
pools, and lost on draws no choice had seen (197 of 240 pooled cells, a worse worst cell);
16 passed fewer tuning cells still.

Why: scraped queue depth lags by a scrape interval. In a burst, a prefix-affine request stream
would keep landing on one endpoint until its queue shows up in ``/metrics``; the in-flight count
reacts at once and spreads the burst.

Inputs: the picker's in-flight accounting (incremented at the pick, decremented when the
response ends or the stream closes).
With ``perHardware`` and ``ownDecode``, each candidate also counts the request being placed, beyond
what it would count on the fastest candidate: ``+ r * (1 / speed(e) - 1 / fastest)``, with ``r``
its prompt tokens (``unit: tokens``; the KV each of its own decode steps reads) or 1
(``unit: requests``). On a pool of one hardware class that term is 0 for every candidate and
nothing changes. On a mixed pool an idle slow endpoint stops looking like the best place for
any request: an L4 decodes about eleven times slower than an H100 (``kv_picker.state.hardware``),
so a 40,000-token document placed on an idle L4 counts like 400,000 tokens in flight on an
H100, while a short chat request there still counts as little and can use the spare capacity.
Without it the slow endpoint's score is 1 whenever it is idle, whatever it is about to be given.
The built-in default sets it: on the routing matrix's mixed pool it passed 77 cells against 76
pooled over three draws no choice had seen, with output throughput 1.08x and TTFT mean 0.97x
the default's without it over the pool's 240 cell draws of draws 1-3, at a cost on shared
prefixes past the pool's decode capacity (``benchmarks/RESULTS.md`` section 1).

``stepTokens`` (0: off; needs ``ownDecode``) also charges a candidate slower than the fastest for
the fixed part of its decode steps (the model's weights read each step), in the same
token-equivalents: ``+ stepTokens * (1 / speed(e) - 1 / fastest)``, with ``stepTokens`` that fixed
cost on the fastest class in KV tokens (``predicted-latency-scorer``'s ``stepSeconds x
kvReadTokensPerSecond``: 0.0065 s x 17.6M tokens/s = 114,400 for an 8B model on an H100). The
busiest candidate's load without it still sets the span, so the charge pushes a slow endpoint's
score down (to 0 once it exceeds the span) without flattening the others' spread. Why: an idle
L4 counts as free, yet each of its decode steps takes about eleven times an H100's whatever it
holds; short requests sent there finish long after the rest (on the routing matrix's mixed pool,
``tenants`` at 0.9 load with the 70B, draw 2: the last of them 65 s after the start against 15 s
without the L4s). Measured, not in the built-in default (``benchmarks/RESULTS.md`` section 1).

Parameters: ``idleThreshold`` (0): an endpoint with at most this many requests (or tokens) in
flight counts as idle; ``unit`` (requests, or tokens); ``perHardware`` (false); ``fullScale``
(0: always relative to the busiest candidate), in the unit's terms; ``ownDecode`` (false; only
with ``perHardware``); ``charsPerToken`` (4.0: the prompt's length when no tokenizer ran);
``promptScale`` (0: off; needs ``unit: tokens``); ``cachedScale`` (0: off; needs ``unit: tokens``);
``cappedMatchIsWhole`` (false; needs ``cachedScale``); ``freeLoad`` (0: off), in the unit's
terms; ``latencyBand`` (0: off; reads ``predicted-latency-scorer``'s estimate);
``latencyBandLoad`` (0: off; at most 1; needs ``latencyBand``); ``latencyBandSlack`` (0, in
seconds; needs ``latencyBand``); ``latencyBandMinTokens`` (0: off; needs ``latencyBand``);
``latencyBandPromptTokens`` (0: off; needs ``latencyBand``); ``heldIsFree`` (false; needs
``unit: tokens``); ``heldPendingOnly`` (false; needs ``heldIsFree``);
``heldMinTokens`` (0; needs ``heldIsFree``);
``lightCachedScale`` (0: off; needs ``cachedScale`` and ``lightLoad``); ``lightLoad`` (0; at most 1);
``loadWindowSeconds`` (10);
``maxNumSeqs`` (0: the load counts pending prefills only).

``latencyBand`` (0: off): a candidate whose predicted time to first token exceeds
``1 + latencyBand`` times the least among the candidates scores 0, so in-flight spreading
moves a request only among endpoints the latency estimate finds within that band of the
fastest. The estimate is ``predicted-latency-scorer``'s ranking cost (with its decode excess
and miss cost), which it publishes for the plugins after it; the scorer must run first in the
same profile, and without it this option does nothing. It answers a failure of the two
signals added together: on agent loops at light load on four endpoints, the in-flight count
alone moved requests whose context one endpoint held to endpoints predicted three times slower
to the first token, which then prefilled the context again. On the routing matrix's tuning half
it passed 114 cells at 1 and 108 at 0.5 against the default's 124 (``benchmarks/RESULTS.md``
section 1): spreading against the estimate pays on most cells, and the default does not set it.

``latencyBandLoad`` (0: the band always applies) applies ``latencyBand`` only while the
candidates are lightly loaded: their load is a moving average (over ``loadWindowSeconds``, 10)
of the larger of the share of candidates with a prefill pending (sent by this picker and not yet
answered) and, with ``maxNumSeqs`` set, the candidates' requests in flight over ``maxNumSeqs``
slots each (set it to the engines' ``--max-num-seqs``). Below the threshold the band applies;
at or above it, the scorer spreads as without the band. Two kinds of pool never apply it: a P/D
decode pool (candidates labelled ``llm-d.ai/role: decode``), whose prompts the prefill pool
computes, so an estimate of prefill there does not say where a decode should run; and, with
``perHardware``, a pool of mixed decode speeds, where the estimate's time to the first token
would keep a request on a slow endpoint holding its context. The
reason: the in-flight count places new contexts over the pool and relieves a holder before its
queue shows, which pays from the routing matrix's 0.3 load up; on a pool that is mostly idle it
moves requests off the endpoint holding their context for nothing (at load 0.05, chat on four
endpoints: 122 moves recomputing a third of the run's uncached tokens, the latency estimate
against nearly all of them). Judged over five loads (0.05 and the matrix's four) with the band
at 1, ``maxNumSeqs`` 64 and thresholds 0.1 and 0.05, it passed more cells than the default on
every draw set, with a 4-6% lower TTFT mean at 0.05, but on the tuning families 0.5-0.8%
higher at the standard loads on each of the three draw sets that judged it, more than the
judgement's own noise (``benchmarks/RESULTS.md`` section 1): the default does not set it.

``latencyBandSlack`` (0 s) widens the band by an absolute margin: a candidate keeps its score
while its predicted cost is within ``max((1 + latencyBand) * fastest, fastest + slack)``. Where
prompts are short, every time to a first token is tens of milliseconds and the relative band
alone zeroes the in-flight vote for any endpoint that would compute a few thousand tokens again;
a new agent session then goes where its agent's system prompt is cached, and sessions pile up
there. With a slack, a move that costs less than that many seconds is left to the in-flight
count, and one that would compute a long context again is still barred. On the routing
matrix's tuning half (draws 1-3, with ``latencyBandLoad`` 1 and slacks of 0.05, 0.1 and 0.2 s)
it lowered ``agentic``'s TTFT mean by 11-13% at the 0.3 load and passed 121, 119 and 122 pooled
cells against the default's 124 (``benchmarks/RESULTS.md`` section 1): the default does not set
it.

``latencyBandMinTokens`` (0: every request) applies ``latencyBand`` only to a request of which
some candidate already holds at least this many prompt tokens (the prefix scorer's match, which
must run first): the requests a move would make compute a long context again, where the
latency estimate's verdict is seconds of prefill, while shorter contexts keep spreading as
without the band. Not set in the built-in default.

``latencyBandPromptTokens`` (0: every request) applies ``latencyBand`` only to a request whose
prompt has at least this many tokens, held anywhere or not. Besides the moves
``latencyBandMinTokens`` bars, it keeps a new long document (cached nowhere) off an endpoint
whose queued prefill the estimate puts past the band, where the in-flight count, which sees
the KV in flight but not the queue, may prefer it: at light load on four endpoints a document
placed behind another document's prefill waited for both. Judged with
``predicted-latency-scorer``'s ``prefillCalibration`` (``benchmarks/RESULTS.md`` section 1): at
32,768 tokens, 253 pooled cells against the default's 249 on draws 1-3 and 206 against 202 on
draws 52-54, not confirmed for a worse worst TTFT p90 cell (long documents at light load on
four endpoints); at 16,384 tokens, 202 against 207 on draws 55-57, not confirmed: on
``agentic``, whose contexts grow past the threshold, it passed 25 cells against 28 with lower
throughput (a higher hit ratio, a longer makespan). Not set in the built-in default.

``heldIsFree`` (``unit: tokens`` only) counts each candidate's tokens in flight less the prompt
tokens it already holds for the request being placed (the prefix scorer's match, which must run
first). A question that arrives while its document is still being prefilled on the holder
then sees the holder as idle as the endpoints that would prefill the whole document again,
since the work it would wait for there is the work it needs; with several of the context's
requests in flight, the holder counts all but one copy. With ``heldPendingOnly`` the tokens
subtracted are at most the candidate's prompt tokens still waiting for their prefill there (the
picker's own count): the holder is relieved only while it is computing a context, as when a
document's first questions arrive together, and counts as without the option once it is cached.
With ``heldMinTokens`` N, either applies only to a request of which some candidate holds at
least N prompt tokens. None of the three is set in the built-in default.

``freeLoad``: each endpoint's first ``freeLoad`` of load (after ``perHardware`` and
``ownDecode``) weighs nothing: the score is ``1 - max(0, n - freeLoad) / span``, with ``span``
taken over the loads so reduced. On a lightly loaded pool, where every endpoint holds less than
that in flight, the scorer leaves the choice to the others (the prefix match, the latency
estimate); past it, differences count as without it. Not set in the built-in default.

``lightCachedScale`` (0: off; needs ``cachedScale`` and ``lightLoad``) replaces ``cachedScale``
while the candidates are lightly loaded: below ``lightLoad`` (0-1) of the load ``latencyBandLoad``
reads (the moving average over ``loadWindowSeconds`` of the larger of the share of candidates
with a prefill pending and, with ``maxNumSeqs``, the share of their sequence slots in use),
sampled at the requests some candidate holds context for; never on a P/D decode pool, nor,
with ``perHardware``, on a pool of mixed decode speeds. A larger scale keeps requests with
the endpoint holding their context at light load, where spreading them costs a prefill again
for little, and leaves the spreading ``cachedScale`` gives where the pool is busy, where a
fixed larger scale piled
work on holders (``cachedScale`` 8 on the routing matrix: 197 pooled cells against 203 on draws
13-15). At 8 below 0.25 it passed one pooled cell more than the default on each half of the
matrix's draws 1-3 with a lower TTFT on average, but on the held-out half its worst TTFT p90
cell was 1.50x the best against 1.30x (long documents at 0.6 load on 16 H100s, where the
measured load is often under 0.25), so the built-in default does not set it
(``benchmarks/RESULTS.md`` section 1).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal

from kv_picker.decode import NonNegative, Positive, Range
from kv_picker.endpoint import ROLE_LABEL, Endpoint
from kv_picker.scheduling.context import BuildContext
from kv_picker.scheduling.framework import LLMRequest
from kv_picker.scheduling.signals import (
    DEFAULT_CHARS_PER_TOKEN,
    PREDICTED_COST,
    PREFIX_MATCH,
    PrefixMatch,
    prompt_tokens,
)

# Loads read by endpoint id: the store's arrays, or a few candidates' (heldIsFree).
InFlight = Sequence[float] | dict[int, float]


@dataclass(frozen=True)
class ActiveRequestParams:
    idleThreshold: Annotated[int, NonNegative] = 0
    unit: Literal["requests", "tokens"] = "requests"
    perHardware: bool = False
    fullScale: Annotated[float, NonNegative] = 0.0
    ownDecode: bool = False
    stepTokens: Annotated[float, NonNegative] = 0.0
    charsPerToken: Annotated[float, Positive] = DEFAULT_CHARS_PER_TOKEN
    promptScale: Annotated[float, NonNegative] = 0.0
    cachedScale: Annotated[float, NonNegative] = 0.0
    lightCachedScale: Annotated[float, NonNegative] = 0.0
    lightLoad: Annotated[float, Range(ge=0.0, le=1.0)] = 0.0
    cappedMatchIsWhole: bool = False
    freeLoad: Annotated[float, NonNegative] = 0.0
    latencyBand: Annotated[float, NonNegative] = 0.0
    latencyBandLoad: Annotated[float, Range(ge=0.0, le=1.0)] = 0.0
    latencyBandSlack: Annotated[float, NonNegative] = 0.0
    latencyBandMinTokens: Annotated[float, NonNegative] = 0.0
    latencyBandPromptTokens: Annotated[float, NonNegative] = 0.0
    heldIsFree: bool = False
    heldPendingOnly: bool = False
    heldMinTokens: Annotated[float, NonNegative] = 0.0
    loadWindowSeconds: Annotated[float, Positive] = 10.0
    maxNumSeqs: Annotated[int, NonNegative] = 0


class ActiveRequestScorer:
    type_name: ClassVar[str] = "active-request-scorer"
    Params = ActiveRequestParams

    def __init__(self, name: str, params: ActiveRequestParams, ctx: BuildContext) -> None:
        self.name = name
        store = ctx.store
        self._in_flight: Sequence[float] = (
            store.in_flight_tokens if params.unit == "tokens" else store.in_flight
        )
        self._idle = params.idleThreshold
        self._scale = params.fullScale
        self._free = params.freeLoad
        self._hardware = ctx.hardware if params.perHardware else None
        if params.ownDecode and not params.perHardware:
            raise ValueError("ownDecode needs perHardware: true")
        if params.stepTokens and not params.ownDecode:
            raise ValueError("stepTokens needs ownDecode: true")
        self._own = params.ownDecode
        self._step_tokens = params.stepTokens
        self._prompt_scale = params.promptScale
        if params.promptScale > 0 and params.unit != "tokens":
            raise ValueError("promptScale needs unit: tokens (it scales by the prompt's tokens)")
        self._cached_scale = params.cachedScale
        if params.cachedScale > 0 and params.unit != "tokens":
            raise ValueError("cachedScale needs unit: tokens (it scales by cached prompt tokens)")
        if params.cappedMatchIsWhole and not params.cachedScale:
            raise ValueError(
                "cappedMatchIsWhole needs cachedScale (it changes what counts as held)"
            )
        self._capped_whole = params.cappedMatchIsWhole
        self._light_scale = params.lightCachedScale
        self._light_load = params.lightLoad
        if bool(params.lightCachedScale) != bool(params.lightLoad):
            raise ValueError("lightCachedScale and lightLoad go together (a scale, and below what)")
        if params.lightCachedScale and not params.cachedScale:
            raise ValueError("lightCachedScale needs cachedScale (it replaces it at light load)")
        self._band = 1.0 + params.latencyBand if params.latencyBand > 0 else 0.0
        self._tokens = params.unit == "tokens"
        self._chars_per_token = params.charsPerToken
        self._loads: list[float] = []
        self._speeds: list[float] = []
        self._band_load = params.latencyBandLoad
        if params.latencyBandLoad and not params.latencyBand:
            raise ValueError("latencyBandLoad needs latencyBand (it says when the band applies)")
        self._slack_s = params.latencyBandSlack
        if params.latencyBandSlack and not params.latencyBand:
            raise ValueError("latencyBandSlack needs latencyBand (it widens the band)")
        self._held_free = params.heldIsFree
        if params.heldIsFree and params.unit != "tokens":
            raise ValueError("heldIsFree needs unit: tokens (it subtracts held prompt tokens)")
        self._held_pending = params.heldPendingOnly
        self._held_min = params.heldMinTokens
        if params.heldMinTokens and not params.heldIsFree:
            raise ValueError("heldMinTokens needs heldIsFree (it says which requests it is for)")
        if params.heldPendingOnly and not params.heldIsFree:
            raise ValueError("heldPendingOnly needs heldIsFree (it limits what is subtracted)")
        self._band_tokens = params.latencyBandMinTokens
        if params.latencyBandMinTokens and not params.latencyBand:
            raise ValueError(
                "latencyBandMinTokens needs latencyBand (it says which requests the band is for)"
            )
        self._band_prompt = params.latencyBandPromptTokens
        if params.latencyBandPromptTokens and not params.latencyBand:
            raise ValueError(
                "latencyBandPromptTokens needs latencyBand (it says which requests the band is for)"
            )
        self._window_s = params.loadWindowSeconds
        self._store = store
        self._seqs = params.maxNumSeqs
        self._busy = 0.0  # the load's moving average, from the first sample on
        self._busy_s = -1.0  # when it was last sampled (-1: never)

    def score(self, request: LLMRequest, candidates: Sequence[Endpoint], out: list[float]) -> None:
        self._score(request, candidates, out)
        if (
            self._band
            and (not self._band_load or self._band_applies(candidates))
            and (not self._band_tokens or self._held(request, candidates) >= self._band_tokens)
            and (
                not self._band_prompt
                or prompt_tokens(request, self._chars_per_token) >= self._band_prompt
            )
        ):
            self._outside_band(request, candidates, out)

    def _held(self, request: LLMRequest, candidates: Sequence[Endpoint]) -> float:
        """The most prompt tokens a candidate holds for the request (0 with no prefix match)."""
        match = request.state.get(PREFIX_MATCH)
        if not isinstance(match, PrefixMatch):
            return 0.0
        return float(match.most_cached_tokens([endpoint.id for endpoint in candidates]))

    def _band_applies(self, candidates: Sequence[Endpoint]) -> bool:
        """latencyBandLoad: the band applies on a pool that prefills, below that load."""
        return self._lightly_loaded(candidates, self._band_load)

    def _lightly_loaded(self, candidates: Sequence[Endpoint], threshold: float) -> bool:
        """Whether the candidates are a pool of one decode speed that prefills, loaded below
        ``threshold`` (the moving average of :meth:`_pool_load`)."""
        if any(e.labels.get(ROLE_LABEL) == "decode" for e in candidates):
            return False  # a P/D decode pool: its prompts are computed by the prefill pool
        hardware = self._hardware
        if hardware is not None:
            speed = hardware.of(candidates[0].labels).decode_speed
            if any(hardware.of(e.labels).decode_speed != speed for e in candidates):
                return False  # mixed hardware: a first token is not the whole of a request
        return self._pool_load(candidates) < threshold

    def _pool_load(self, candidates: Sequence[Endpoint]) -> float:
        """The candidates' load, a moving average over loadWindowSeconds (see the module
        docstring)."""
        store = self._store
        queued = store.prefill_requests
        busy = sum(1 for e in candidates if queued[e.id]) / len(candidates)
        if self._seqs:
            running = store.in_flight
            busy = max(
                busy, sum(running[e.id] for e in candidates) / (self._seqs * len(candidates))
            )
        now = store.now()
        if self._busy_s < 0.0:
            self._busy = busy
        else:
            keep = math.exp(-max(0.0, now - self._busy_s) / self._window_s)
            self._busy = busy + keep * (self._busy - busy)
        self._busy_s = now
        return self._busy

    def _outside_band(
        self, request: LLMRequest, candidates: Sequence[Endpoint], out: list[float]
    ) -> None:
        """latencyBand: 0 for every candidate the latency estimate puts past the band."""
        published = request.state.get(PREDICTED_COST)
        if not isinstance(published, tuple):
            return
        scored, predictions = published
        costs = {endpoint.id: cost for endpoint, cost in zip(scored, predictions, strict=True)}
        known = [costs[e.id] for e in candidates if e.id in costs]
        if not known:
            return
        fastest = min(known)
        limit = max(self._band * fastest, fastest + self._slack_s)
        for i, endpoint in enumerate(candidates):
            cost = costs.get(endpoint.id)
            if cost is not None and cost > limit:
                out[i] = 0.0

    def _score(self, request: LLMRequest, candidates: Sequence[Endpoint], out: list[float]) -> None:
        in_flight: InFlight = self._in_flight
        if self._held_free:
            in_flight = self._less_held(request, candidates, in_flight)
        hardware = self._hardware
        free = self._free
        if hardware is None:
            busiest = max(in_flight[e.id] for e in candidates)
            span = self._span(request, candidates, max(0.0, busiest - free))
            idle = self._idle
            for i, endpoint in enumerate(candidates):
                count = in_flight[endpoint.id]
                over = count - free
                # over > 0 implies span >= busiest - free >= over > 0.
                out[i] = 1.0 if count <= idle or over <= 0.0 else 1.0 - over / span
            return
        loads = self._loads
        loads.clear()
        slow: list[float] = []
        if self._own:
            speeds = self._speeds
            speeds.clear()
            for endpoint in candidates:
                speeds.append(hardware.of(endpoint.labels).decode_speed)
            fastest = 1.0 / max(speeds)
            own = prompt_tokens(request, self._chars_per_token) if self._tokens else 1.0
            for endpoint, speed in zip(candidates, speeds, strict=True):
                # 1/speed - 1/fastest is exactly 0 where speed is the fastest's.
                loads.append(in_flight[endpoint.id] / speed + own * (1.0 / speed - fastest))
            if self._step_tokens:
                # stepTokens: a slower class's fixed step counts beyond the span (which the
                # loads without it set), so it lowers that endpoint without flattening the rest.
                step = self._step_tokens
                slow = [step * (1.0 / speed - fastest) for speed in speeds]
        else:
            for endpoint in candidates:
                loads.append(in_flight[endpoint.id] / hardware.of(endpoint.labels).decode_speed)
        span = self._span(request, candidates, max(0.0, max(loads) - free))
        idle = self._idle
        for i, load in enumerate(loads):
            extra = slow[i] if slow else 0.0
            over = load + extra - free
            if (load <= idle and not extra) or over <= 0.0:
                out[i] = 1.0
            else:
                out[i] = max(0.0, 1.0 - over / span)

    def _less_held(
        self, request: LLMRequest, candidates: Sequence[Endpoint], in_flight: InFlight
    ) -> InFlight:
        """heldIsFree: each candidate's tokens in flight less the prompt tokens it holds for
        this request, by endpoint id (unchanged without a prefix match)."""
        match = request.state.get(PREFIX_MATCH)
        if not isinstance(match, PrefixMatch) or not match.matched_blocks:
            return in_flight
        if self._held_min and self._held(request, candidates) < self._held_min:
            return in_flight
        reduced: dict[int, float] = {}
        pending = self._store.prefill_tokens if self._held_pending else None
        for endpoint in candidates:
            count = in_flight[endpoint.id]
            free = min(count, match.cached_tokens(endpoint.id))
            if pending is not None:
                free = min(free, pending[endpoint.id])
            reduced[endpoint.id] = count - free
        return reduced

    def _span(self, request: LLMRequest, candidates: Sequence[Endpoint], busiest: float) -> float:
        """The load that counts in full: the busiest candidate's, or the damping scales."""
        span = max(busiest, self._scale)
        if self._prompt_scale > 0:
            span = max(span, self._prompt_scale * prompt_tokens(request, self._chars_per_token))
        if self._cached_scale > 0:
            match = request.state.get(PREFIX_MATCH)
            if not isinstance(match, PrefixMatch):
                return span  # no prefix scorer ran: nothing counts as held
            held = match.most_cached_tokens([endpoint.id for endpoint in candidates])
            if (
                self._capped_whole
                and held > 0
                and match.capped
                and held >= match.total_blocks * match.block_tokens
            ):
                # The holder has every block that was looked up; a cached context is
                # cached as a whole, so moving would recompute the whole prompt.
                held = max(held, prompt_tokens(request, self._chars_per_token))
            scale = self._cached_scale
            if (
                held > 0
                and self._light_scale
                and self._lightly_loaded(candidates, self._light_load)
            ):
                scale = self._light_scale
            span = max(span, scale * held)
        return span
