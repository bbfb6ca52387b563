"""prefix-cache-affinity-filter: keep a request on the endpoints that hold its prompt, until
they are too loaded.

Type: ``prefix-cache-affinity-filter`` (llm-d's filter of that name, whose configs load
unchanged; its parameters of every released shape are read). A filter: it narrows the
candidates, and the profile's scorers choose among the ones it keeps.

```
fewer than 2 candidates, or affinityThreshold <= 0         keep all
with probability explorationProbability                    keep all (exploration)
sticky = candidates holding at least affinityThreshold of the prompt's blocks
no sticky candidate                                         keep all
a load gate breaks (below)                                  keep all
the in-flight request gate breaks (below)                   sticky + the non-sticky within the
                                                            TTFT penalty
otherwise                                                   sticky
```

The match is the prefix scorer's (``prefix-cache-scorer`` or ``precise-prefix-cache-scorer``:
the one named by ``prefixMatchInfoProducerName``, else the one declared), looked up before the
scorers run; the share held is matched blocks / blocks looked up, as llm-d's.

Load gates, each only while some candidate is not sticky. An endpoint's *in-flight tokens* are
the uncached prompt tokens this picker sent it that have not reached their first token (what
llm-d's ``inflight-load-producer`` counts; the picker keeps this count itself):

- TTFT gate (``maxTTFTPenaltyMs`` > 0): an endpoint's TTFT is its in-flight tokens /
  ``peakPrefillThroughput``; it breaks when the least on a sticky endpoint exceeds the least on a
  non-sticky one by more than ``maxTTFTPenaltyMs``.
- Token gate (``maxTokensInFlightPenalty`` > 0, an earlier shape of the same gate in tokens): it
  breaks when the fewest in-flight tokens on a sticky endpoint exceed the fewest on a
  non-sticky one by more than that.
- In-flight request gate (``maxInFlightRequestsDelta`` > 0; needs ``maxTTFTPenaltyMs``): the
  non-sticky endpoints where this request's TTFT (its uncached tokens added) is within
  ``maxTTFTPenaltyMs`` of its best on a sticky one join the sticky ones when the fewest requests
  in flight on a sticky endpoint exceed the fewest on those by more than the delta.

``ttftSource: latencyPredictor`` (llm-d's trained latency predictor) is refused: not built here.
Counts of narrowed and of load-broken requests are on ``/metrics``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

from kv_picker.endpoint import Endpoint
from kv_picker.errors import ConfigError
from kv_picker.scheduling.context import BuildContext
from kv_picker.scheduling.framework import LLMRequest, PluginGauge
from kv_picker.scheduling.signals import PrefixMatch

PREFIX_SCORERS = ("prefix-cache-scorer", "precise-prefix-cache-scorer")
_SOURCES = ("prefillThroughput", "latencyPredictor")


class _PrefixMatcher(Protocol):
    type_name: ClassVar[str]

    def match(self, request: LLMRequest, candidates: Sequence[Endpoint]) -> PrefixMatch | None: ...


@dataclass(frozen=True)
class PrefixAffinityParams:
    affinityThreshold: float = 0.80
    explorationProbability: float = 0.0
    maxTTFTPenaltyMs: float = 18000.0
    ttftSource: str = "prefillThroughput"
    peakPrefillThroughput: float = 15928.0
    maxTokensInFlightPenalty: float = 0.0
    maxInFlightRequestsDelta: int = 0
    # The plugin whose match is read (llm-d's producer; after translation, the prefix scorer
    # of that name). The other two producers' names are accepted from llm-d configs.
    prefixMatchInfoProducerName: str = ""
    latencyPredictionInfoProducerName: str = ""
    inFlightLoadProducerName: str = ""

    def validate(self) -> None:
        if not 0.0 <= self.affinityThreshold <= 1.0:
            raise ValueError("parameter 'affinityThreshold' must be in [0, 1]")
        if not 0.0 <= self.explorationProbability <= 1.0:
            raise ValueError("parameter 'explorationProbability' must be in [0, 1]")
        if self.maxTTFTPenaltyMs < 0 or self.maxTokensInFlightPenalty < 0:
            raise ValueError(
                "parameters 'maxTTFTPenaltyMs' and 'maxTokensInFlightPenalty' must be >= 0"
            )
        if self.maxInFlightRequestsDelta < 0:
            raise ValueError("parameter 'maxInFlightRequestsDelta' must be >= 0")
        if self.maxInFlightRequestsDelta and not self.maxTTFTPenaltyMs:
            raise ValueError("maxTTFTPenaltyMs must be > 0 when maxInFlightRequestsDelta is set")
        if self.ttftSource not in _SOURCES:
            raise ValueError(f"parameter 'ttftSource' must be one of {', '.join(_SOURCES)}")
        if self.ttftSource == "latencyPredictor":
            raise ValueError(
                "ttftSource 'latencyPredictor' reads llm-d's trained latency predictor, which is "
                "not built here; use prefillThroughput (in-flight tokens / peakPrefillThroughput)"
            )
        if self.peakPrefillThroughput < 0 or (
            self.maxTTFTPenaltyMs and not self.peakPrefillThroughput > 0
        ):
            raise ValueError("parameter 'peakPrefillThroughput' must be > 0 with maxTTFTPenaltyMs")


class PrefixCacheAffinityFilter:
    type_name: ClassVar[str] = "prefix-cache-affinity-filter"
    Params = PrefixAffinityParams

    def __init__(self, name: str, params: PrefixAffinityParams, ctx: BuildContext) -> None:
        self.name = name
        self.params = params
        self._store = ctx.store
        self._rng = ctx.rng
        self._matcher: _PrefixMatcher | None = None
        self.narrowed = 0  # requests kept on their sticky endpoints
        self.broken = 0  # requests a load gate let go to any candidate

    def bind_plugins(self, plugins: Mapping[str, object]) -> None:
        named = self.params.prefixMatchInfoProducerName
        if named:
            found = plugins.get(named)
            if getattr(found, "type_name", None) not in PREFIX_SCORERS:
                raise ConfigError(
                    f"plugin {self.name!r}: prefixMatchInfoProducerName {named!r} names no "
                    f"{' or '.join(PREFIX_SCORERS)} (or approx-prefix-cache-producer)"
                )
        else:
            matchers = [
                p for p in plugins.values() if getattr(p, "type_name", None) in PREFIX_SCORERS
            ]
            if len(matchers) != 1:
                raise ConfigError(
                    f"plugin {self.name!r}: reads the prefix match of one "
                    f"{' or '.join(PREFIX_SCORERS)}; {len(matchers)} are declared (name one in "
                    "prefixMatchInfoProducerName)"
                )
            found = matchers[0]
        self._matcher = found  # type: ignore[assignment]

    def filter(self, request: LLMRequest, candidates: list[Endpoint]) -> list[Endpoint]:
        params = self.params
        if len(candidates) <= 1 or params.affinityThreshold <= 0:
            return candidates
        if params.explorationProbability and self._rng.random() < params.explorationProbability:
            return candidates
        assert self._matcher is not None, "bind_plugins was not called"
        match = self._matcher.match(request, candidates)
        if match is None:
            return candidates
        need = params.affinityThreshold * match.total_blocks
        held = match.matched_blocks
        sticky = [e for e in candidates if held.get(e.id, 0) >= need]
        if not sticky:
            return candidates
        if len(sticky) == len(candidates):
            self.narrowed += 1
            return sticky
        others = [e for e in candidates if held.get(e.id, 0) < need]
        queued = self._store.prefill_tokens
        least_sticky = min(queued[e.id] for e in sticky)
        least_other = min(queued[e.id] for e in others)
        peak = params.peakPrefillThroughput
        if params.maxTTFTPenaltyMs and (
            (least_sticky - least_other) / peak * 1000.0 > params.maxTTFTPenaltyMs
        ):
            self.broken += 1
            return candidates
        if params.maxTokensInFlightPenalty and (
            least_sticky - least_other > params.maxTokensInFlightPenalty
        ):
            self.broken += 1
            return candidates
        if params.maxInFlightRequestsDelta:
            within = self._within_penalty(match, sticky, others)
            if within:
                in_flight = self._store.in_flight
                fewest_sticky = min(in_flight[e.id] for e in sticky)
                fewest_within = min(in_flight[e.id] for e in within)
                if fewest_sticky - fewest_within > params.maxInFlightRequestsDelta:
                    self.broken += 1
                    return sticky + within
        self.narrowed += 1
        return sticky

    def _within_penalty(
        self, match: PrefixMatch, sticky: list[Endpoint], others: list[Endpoint]
    ) -> list[Endpoint]:
        """The non-sticky endpoints where this request's TTFT is within the penalty of its
        best on a sticky one (its uncached blocks added to each endpoint's in-flight tokens)."""
        queued = self._store.prefill_tokens
        held = match.matched_blocks
        block = match.block_tokens
        total = match.total_blocks
        peak_ms = self.params.peakPrefillThroughput / 1000.0

        def ttft_ms(endpoint: Endpoint) -> float:
            uncached = (total - held.get(endpoint.id, 0)) * block
            return (queued[endpoint.id] + uncached) / peak_ms

        best = min(ttft_ms(e) for e in sticky)
        return [e for e in others if ttft_ms(e) - best <= self.params.maxTTFTPenaltyMs]

    def collect_metrics(self) -> Iterable[PluginGauge]:
        yield PluginGauge(
            "kv_picker_affinity_filter_narrowed",
            "Requests prefix-cache-affinity-filter kept on the endpoints holding their prompt.",
            float(self.narrowed),
        )
        yield PluginGauge(
            "kv_picker_affinity_filter_load_broken",
            "Requests for which a load gate of prefix-cache-affinity-filter kept endpoints "
            "not holding their prompt.",
            float(self.broken),
        )
