"""recent-work-scorer: prefer endpoints that computed less prefill lately, so new contexts
spread over the pool instead of settling where the first ones did.

Type: ``recent-work-scorer``

Formula, per candidate endpoint ``e`` of hardware class ``c``:

```
T(e), P(e) = uncached prompt tokens and their attention work (n * (k + n/2) for n tokens after
             k cached) that this picker sent to e to be computed, each pick's decayed by
             exp(-age / 30 s)
w(e)       = (T(e) + P(e) / attentionCrossoverTokens) / c.prefill_speed
span       = idleShare * max(max_e' w(e'), fullScale)
score(e)   = max(0, 1 - w(e) / span)                       (1 for all when no one worked)
```

Why: sessions come back to the endpoint that holds their context, so where a new context is
placed decides where its later turns' work goes. At light load nothing else tells endpoints
apart: nothing is queued or in flight when a request arrives, and the prefix scorer prefers
the endpoints that already hold a shared system prompt. New sessions then keep landing on the
first endpoints used, and a pool can leave endpoints idle for a whole replay while the busy
ones queue. The decayed work is the rate at which an endpoint's contexts bring it work; a
request whose context is cached elsewhere still goes there (the prefix and latency scorers
outweigh this one at a small weight), a request that would be computed almost from scratch
anywhere goes where the recent work is least.

Inputs: the picker's own accounting of the work it sent (from the pick; under P/D at the
prefill endpoint), including picks of the other workers of ``kv-picker serve --workers N``;
the endpoint's hardware-class label (no label: speed 1).

Parameters (defaults): ``attentionCrossoverTokens`` (20500; the context length at which a
token's attention costs as much as its linear layers, as in ``predicted-latency-scorer``; 0 =
count tokens only), ``fullScale`` (0: relative to the busiest candidate), in tokens at speed 1
over the 30-second window: with it, a difference counts in full only once the busiest
candidate has worked that much; ``idleShare`` (1): below 1, only the endpoints that did less
than that share of the busiest one's work score above 0, so the scorer seeds endpoints left
idle and says nothing among a pool that is busy everywhere; ``decodeSpeedScaled`` (false):
multiplies each score by the endpoint's decode speed over the fastest candidate's, so an idle
slow endpoint (an L4 next to H100s) is seeded only in proportion to what it delivers: a
session placed there keeps coming back, and decodes there at its speed; ``matchScaled``
(false): multiplies every score by the share of the prompt that no candidate holds (1 - the best
candidate's cached tokens / the prompt's, from the prefix scorer, which must run first), so the
scorer seeds with new contexts only, and a request whose context is cached somewhere is left to
the prefix, latency and in-flight scorers.

In the built-in default, at weight 0.5 with
``idleShare`` 0.25 next to the other scorers: chosen on the tuning families, it passed 122 of
136 tuning cells and 117 of 136 held-out ones over three draws pooled (the default before it:
121 and 116) and took the worst cell from 2.21x the best TTFT mean to 1.87x; light-load
``agentic`` on P/D went from 2.21x to 1.0x (``benchmarks/RESULTS.md`` section 1). The default
also sets ``decodeSpeedScaled``: on the mixed H100/A100/L4 pool, seeded L4s finished a run's
last requests late; scaled, the default kept its pass counts on draws 1-3 and passed 191
cells against 189 on draws 19-21, with 3.4% more output throughput over the cells
(geometric mean) and its worst throughput cell from 0.58x the best to 0.92x.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, ClassVar

from kv_picker.decode import NonNegative, Range
from kv_picker.endpoint import Endpoint
from kv_picker.scheduling.context import BuildContext
from kv_picker.scheduling.framework import LLMRequest
from kv_picker.scheduling.signals import cached_tokens, prompt_tokens


@dataclass(frozen=True)
class RecentWorkParams:
    attentionCrossoverTokens: Annotated[float, NonNegative] = 20_500.0
    fullScale: Annotated[float, NonNegative] = 0.0
    idleShare: Annotated[float, Range(gt=0, le=1)] = 1.0
    decodeSpeedScaled: bool = False
    matchScaled: bool = False


class RecentWorkScorer:
    type_name: ClassVar[str] = "recent-work-scorer"
    Params = RecentWorkParams

    def __init__(self, name: str, params: RecentWorkParams, ctx: BuildContext) -> None:
        self.name = name
        self._store = ctx.store
        self._hardware = ctx.hardware
        crossover = params.attentionCrossoverTokens
        self._pair_weight = 1.0 / crossover if crossover > 0 else 0.0
        self._scale = params.fullScale
        self._share = params.idleShare
        self._decode_scaled = params.decodeSpeedScaled
        self._match_scaled = params.matchScaled
        self._speed: list[float] = []
        self._work: list[float] = []

    def work(self, endpoint: Endpoint, now: float | None = None) -> float:
        """``w(e)``: the endpoint's recent prefill work in tokens at speed 1, as of ``now``
        (default: the store's clock)."""
        tokens, pairs = self._store.recent_prefill(endpoint.id, now)
        speed = self._hardware.of(endpoint.labels).prefill_speed
        return (tokens + pairs * self._pair_weight) / speed

    def score(self, request: LLMRequest, candidates: Sequence[Endpoint], out: list[float]) -> None:
        work = self._work
        work.clear()
        now = self._store.now()
        for endpoint in candidates:
            work.append(self.work(endpoint, now))
        span = max(max(work), self._scale) * self._share
        for i, w in enumerate(work):
            out[i] = max(0.0, 1.0 - w / span) if span > 0.0 else 1.0
        if self._decode_scaled:
            speed = self._speed
            speed.clear()
            for endpoint in candidates:
                speed.append(self._hardware.of(endpoint.labels).decode_speed)
            fastest = max(speed)
            for i, s in enumerate(speed):
                out[i] *= s / fastest
        if self._match_scaled:
            prompt = prompt_tokens(request)
            if prompt > 0.0:
                held = max(cached_tokens(request, endpoint.id) for endpoint in candidates)
                new = max(0.0, 1.0 - held / prompt)
                for i in range(len(work)):
                    out[i] *= new
