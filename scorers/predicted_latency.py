"""predicted-latency-scorer: one estimate of time to first token, from cache, load and hardware.

Type: ``predicted-latency-scorer``

Formula, per candidate endpoint ``e`` of hardware class ``c``:

```
uncached_tokens = prompt_tokens - cached_tokens(e)            # from the prefix scorer's match
prefill_s       = uncached_tokens / (prefillTokensPerSecond * c.prefill_speed)
queue_s         = pending(e) * queuedRequestSeconds / c.prefill_speed
pending(e)      = max(waiting(e), in_flight(e) - running(e))   # queued, by scrape or by our count
ttft(e)         = queue_s + prefill_s (+ transferSecondsPerToken * uncached_tokens under P/D)
score(e)        = min_e' ttft(e') / ttft(e)                   # the fastest candidate scores 1
```

How the inputs are measured: ``prompt_tokens`` is exact when a tokenizer ran, otherwise the
prompt's characters / 4; ``cached_tokens`` comes from the ``prefix-cache-scorer`` of the same
profile (list it before this scorer; without it nothing counts as cached); ``waiting`` and
``running`` are scraped from ``/metrics``; ``in_flight`` is the picker's own count; ``c`` comes
from the endpoint's hardware-class label. ``prefillTokensPerSecond`` is the H100-class prefill
rate and ``queuedRequestSeconds`` the mean prefill time of a queued request on H100: calibrate
both from the endpoints' ``vllm:request_prefill_time_seconds`` and prompt-token histograms.

Parameters (defaults): ``prefillTokensPerSecond`` (10000), ``queuedRequestSeconds`` (0.1),
``transferSecondsPerToken`` (0: no transfer term), ``charsPerToken`` (4.0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from picker.scheduling.signals import cached_tokens, prompt_tokens
from picker.scheduling.types import BuildContext, LLMRequest
from picker.state.endpoints import Endpoint

_FLOOR_S = 1e-6  # keeps the ratio finite when a candidate predicts no work at all


@dataclass(frozen=True)
class PredictedLatencyParams:
    prefillTokensPerSecond: float = 10_000.0
    queuedRequestSeconds: float = 0.1
    transferSecondsPerToken: float = 0.0
    charsPerToken: float = 4.0

    def validate(self) -> None:
        if not self.prefillTokensPerSecond > 0:
            raise ValueError("parameter 'prefillTokensPerSecond' must be > 0")
        if self.queuedRequestSeconds < 0 or self.transferSecondsPerToken < 0:
            raise ValueError("'queuedRequestSeconds' and 'transferSecondsPerToken' must be >= 0")
        if not self.charsPerToken > 0:
            raise ValueError("parameter 'charsPerToken' must be > 0")


class PredictedLatencyScorer:
    type_name: ClassVar[str] = "predicted-latency-scorer"
    Params = PredictedLatencyParams

    def __init__(self, name: str, params: PredictedLatencyParams, ctx: BuildContext) -> None:
        self.name = name
        self.params = params
        self._store = ctx.store
        self._hardware = ctx.hardware

    def predict_ttft_s(self, request: LLMRequest, endpoint: Endpoint) -> float:
        params, store = self.params, self._store
        hardware = self._hardware.of(endpoint.labels)
        uncached = max(
            0.0, prompt_tokens(request, params.charsPerToken) - cached_tokens(request, endpoint.id)
        )
        prefill_s = uncached / (params.prefillTokensPerSecond * hardware.prefill_speed)
        endpoint_id = endpoint.id
        pending = max(
            store.waiting[endpoint_id],
            store.in_flight[endpoint_id] - store.running[endpoint_id],
            0.0,
        )
        queue_s = pending * params.queuedRequestSeconds / hardware.prefill_speed
        return queue_s + prefill_s + params.transferSecondsPerToken * uncached

    def score(self, request: LLMRequest, candidates: Sequence[Endpoint], out: list[float]) -> None:
        predictions = [max(self.predict_ttft_s(request, e), _FLOOR_S) for e in candidates]
        best = min(predictions)
        for i, predicted in enumerate(predictions):
            out[i] = best / predicted
