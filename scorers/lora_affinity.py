"""lora-affinity-scorer: prefer endpoints that already have the request's LoRA adapter loaded.

Type: ``lora-affinity-scorer``

Formula, for the request's adapter ``a`` (the adapter named as the model; the model itself when
the pool declares no adapters): ``a`` running on the endpoint -> 1.0; else the endpoint has room
to load another adapter (``running + waiting < max_lora``) -> 0.8; else ``a`` is waiting there
-> 0.6; else 0. The adapter is the one the pool's ``models`` declare the requested model to be;
without declarations, a model that some candidate reports as a running or waiting adapter. Any
other request is for a base model and scores 1.0 everywhere (no preference).

Inputs: scraped ``vllm:lora_requests_info`` (labels ``running_lora_adapters``,
``waiting_lora_adapters``, ``max_lora``; the newest series wins). Endpoints that export no LoRA
information score 0 for adapter requests.
Parameters: none.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from kv_picker.endpoint import Endpoint
from kv_picker.scheduling.context import BuildContext
from kv_picker.scheduling.framework import LLMRequest


@dataclass(frozen=True)
class LoraAffinityParams:
    pass


class LoraAffinityScorer:
    type_name: ClassVar[str] = "lora-affinity-scorer"
    Params = LoraAffinityParams

    def __init__(self, name: str, params: LoraAffinityParams, ctx: BuildContext) -> None:
        self.name = name
        self._store = ctx.store

    def score(self, request: LLMRequest, candidates: Sequence[Endpoint], out: list[float]) -> None:
        store = self._store
        adapter = request.lora_adapter
        if adapter is None:
            model = request.model
            if not any(
                (lora := store.lora[e.id]) is not None
                and (model in lora.running or model in lora.waiting)
                for e in candidates
            ):
                for i in range(len(candidates)):
                    out[i] = 1.0
                return
            adapter = model
        for i, endpoint in enumerate(candidates):
            lora = store.lora[endpoint.id]
            if lora is None:
                continue
            if adapter in lora.running:
                out[i] = 1.0
            elif len(lora.running) + len(lora.waiting) < lora.max_lora:
                out[i] = 0.8
            elif adapter in lora.waiting:
                out[i] = 0.6
