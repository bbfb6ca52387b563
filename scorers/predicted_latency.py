"""predicted-latency-scorer: one estimate of time to first token, from cache, load and hardware.

Type: ``predicted-latency-scorer``

Formula, per candidate endpoint ``e`` of hardware class ``c``:

```
uncached_tokens = prompt_tokens - cached_tokens(e)            # from the prefix scorer's match
prefill_s       = uncached_tokens / (prefillTokensPerSecond * c.prefill_speed)
queue_s         = (queued_tokens(e) / prefillTokensPerSecond
                   + unknown_waiting(e) * queuedRequestSeconds) / c.prefill_speed
queued_tokens   = uncached prompt tokens this picker sent to e whose prefill has not finished
unknown_waiting = max(0, waiting(e) - requests behind queued_tokens)   # e.g. other replicas'
ttft(e)         = queue_s + prefill_s (+ transferSecondsPerToken * uncached_tokens under P/D)
score(e)        = min_e' ttft(e') / ttft(e)                   # the fastest candidate scores 1
```

Queued work is counted in tokens, not requests: a 100,000-token prompt ahead in the queue
delays a new request far more than a 1,000-token one.

How the inputs are measured: ``prompt_tokens`` is exact when a tokenizer ran, otherwise the
prompt's characters / 4; ``cached_tokens`` comes from the ``prefix-cache-scorer`` of the same
profile (list it before this scorer; without it nothing counts as cached); ``waiting`` and
``running`` are scraped from ``/metrics``; the queued tokens are the picker's own count (added
at the pick, removed at the request's first response byte); ``c`` comes from the endpoint's
hardware-class label. ``prefillTokensPerSecond`` is the H100-class prefill
rate and ``queuedRequestSeconds`` the mean prefill time of a queued request on H100: calibrate
both from the endpoints' ``vllm:request_prefill_time_seconds`` and prompt-token histograms.

Parameters (defaults): ``prefillTokensPerSecond`` (10000), ``queuedRequestSeconds`` (0.1),
``transferSecondsPerToken`` (0: no transfer term), ``charsPerToken`` (4.0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, ClassVar

from kv_picker.decode import NonNegative, Positive
from kv_picker.endpoint import Endpoint
from kv_picker.scheduling.context import BuildContext
from kv_picker.scheduling.framework import LLMRequest
from kv_picker.scheduling.signals import uncached_prompt_tokens

_FLOOR_S = 1e-6  # keeps the ratio finite when a candidate predicts no work at all


@dataclass(frozen=True)
class PredictedLatencyParams:
    prefillTokensPerSecond: Annotated[float, Positive] = 10_000.0
    queuedRequestSeconds: Annotated[float, NonNegative] = 0.1
    transferSecondsPerToken: Annotated[float, NonNegative] = 0.0
    charsPerToken: Annotated[float, Positive] = 4.0


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
        uncached = uncached_prompt_tokens(request, endpoint.id, params.charsPerToken)
        prefill_s = uncached / (params.prefillTokensPerSecond * hardware.prefill_speed)
        endpoint_id = endpoint.id
        unknown_waiting = max(0.0, store.waiting[endpoint_id] - store.prefill_requests[endpoint_id])
        queue_s = (
            store.prefill_tokens[endpoint_id] / params.prefillTokensPerSecond
            + unknown_waiting * params.queuedRequestSeconds
        ) / hardware.prefill_speed
        return queue_s + prefill_s + params.transferSecondsPerToken * uncached

    def score(self, request: LLMRequest, candidates: Sequence[Endpoint], out: list[float]) -> None:
        predictions = [max(self.predict_ttft_s(request, e), _FLOOR_S) for e in candidates]
        best = min(predictions)
        for i, predicted in enumerate(predictions):
            out[i] = best / predicted
