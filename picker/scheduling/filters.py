"""Filters: drop candidates that must not serve a request.

| type | keeps | parameters |
|---|---|---|
| `by-label` | endpoints whose `label` is in `validValues` (unlabelled ones when `allowsNoLabel`) | `label`, `validValues`, `allowsNoLabel` (false) |
| `decode-filter` | `llm-d.ai/role` in decode/both, or no role label | none |
| `prefill-filter` | `llm-d.ai/role` = prefill (the label is required) | none |
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from kv_picker.endpoint import ROLE_LABEL, Endpoint
from kv_picker.scheduling.context import BuildContext
from kv_picker.scheduling.framework import LLMRequest


class _LabelFilter:
    def __init__(self, name: str, label: str, values: frozenset[str], allow_missing: bool) -> None:
        self.name = name
        self._label = label
        self._values = values
        self._allow_missing = allow_missing

    def filter(self, request: LLMRequest, candidates: list[Endpoint]) -> list[Endpoint]:
        label, values, allow_missing = self._label, self._values, self._allow_missing
        kept = []
        for endpoint in candidates:
            value = endpoint.labels.get(label)
            if (value is None and allow_missing) or (value is not None and value in values):
                kept.append(endpoint)
        return kept


@dataclass(frozen=True)
class ByLabelParams:
    label: str = ""
    validValues: list[str] = field(default_factory=list)
    allowsNoLabel: bool = False

    def validate(self) -> None:
        if not self.label:
            raise ValueError("parameter 'label' is required")


class ByLabelFilter(_LabelFilter):
    type_name: ClassVar[str] = "by-label"
    Params = ByLabelParams

    def __init__(self, name: str, params: ByLabelParams, ctx: BuildContext) -> None:
        super().__init__(name, params.label, frozenset(params.validValues), params.allowsNoLabel)


@dataclass(frozen=True)
class NoParams:
    pass


class DecodeFilter(_LabelFilter):
    type_name: ClassVar[str] = "decode-filter"
    Params = NoParams

    def __init__(self, name: str, params: NoParams, ctx: BuildContext) -> None:
        super().__init__(name, ROLE_LABEL, frozenset({"decode", "both"}), allow_missing=True)


class PrefillFilter(_LabelFilter):
    type_name: ClassVar[str] = "prefill-filter"
    Params = NoParams

    def __init__(self, name: str, params: NoParams, ctx: BuildContext) -> None:
        super().__init__(name, ROLE_LABEL, frozenset({"prefill"}), allow_missing=False)


BUILTIN_FILTERS = (ByLabelFilter, DecodeFilter, PrefillFilter)
