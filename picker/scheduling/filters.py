"""Filters: drop candidates that must not serve a request.

| type | keeps | parameters |
|---|---|---|
| `by-label` | endpoints whose `label` is in `validValues` (unlabelled ones when `allowsNoLabel`) | `label`, `validValues`, `allowsNoLabel` (false) |
| `by-label-selector` | endpoints a Kubernetes label selector matches (llm-d's): every `matchLabels` pair and every `matchExpressions` requirement (`In`, `NotIn`: absent or not among `values`, `Exists`, `DoesNotExist`); an empty selector keeps all | `matchLabels`, `matchExpressions` |
| `decode-filter` | `llm-d.ai/role` in decode/both, or no role label | none |
| `prefill-filter` | `llm-d.ai/role` = prefill (the label is required) | none |
"""

from __future__ import annotations

from collections.abc import Mapping
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
class LabelRequirement:
    """One ``matchExpressions`` entry of a Kubernetes label selector."""

    key: str
    operator: str
    values: list[str] = field(default_factory=list)

    def validate(self) -> None:
        if not self.key:
            raise ValueError("matchExpressions: 'key' is required")
        if self.operator in ("In", "NotIn"):
            if not self.values:
                raise ValueError(f"matchExpressions[{self.key}]: {self.operator} needs values")
        elif self.operator in ("Exists", "DoesNotExist"):
            if self.values:
                raise ValueError(f"matchExpressions[{self.key}]: {self.operator} takes no values")
        else:
            raise ValueError(
                f"matchExpressions[{self.key}]: operator {self.operator!r} is not one of In, "
                "NotIn, Exists, DoesNotExist"
            )

    def matches(self, labels: Mapping[str, str]) -> bool:
        value = labels.get(self.key)
        if self.operator == "In":
            return value is not None and value in self.values
        if self.operator == "NotIn":
            return value is None or value not in self.values
        if self.operator == "Exists":
            return value is not None
        return value is None  # DoesNotExist


@dataclass(frozen=True)
class ByLabelSelectorParams:
    matchLabels: Mapping[str, str] = field(default_factory=dict)
    matchExpressions: list[LabelRequirement] = field(default_factory=list)

    def validate(self) -> None:
        for requirement in self.matchExpressions:
            requirement.validate()


class ByLabelSelectorFilter:
    type_name: ClassVar[str] = "by-label-selector"
    Params = ByLabelSelectorParams

    def __init__(self, name: str, params: ByLabelSelectorParams, ctx: BuildContext) -> None:
        self.name = name
        self._pairs = tuple(params.matchLabels.items())
        self._requirements = tuple(params.matchExpressions)

    def filter(self, request: LLMRequest, candidates: list[Endpoint]) -> list[Endpoint]:
        pairs, requirements = self._pairs, self._requirements
        return [
            endpoint
            for endpoint in candidates
            if all(endpoint.labels.get(k) == v for k, v in pairs)
            and all(r.matches(endpoint.labels) for r in requirements)
        ]


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


BUILTIN_FILTERS = (ByLabelFilter, ByLabelSelectorFilter, DecodeFilter, PrefillFilter)
