"""Search spaces of ``kv-picker tune``: which weights and scorer parameters a tuning run varies.

A space is a list of *dimensions* applied to a *base profile*: an EndpointPickerConfig with one
scheduling profile (``--base FILE.yaml``; by default the built-in default profile of
:mod:`kv_picker.config`). Each candidate the tuner tries is the base with every dimension set
to one value, so whatever the base says beyond plugins and profiles (server, metrics,
admission, ...) is kept as it is, and the best candidate is a complete, servable config.

A space file (``--space FILE.yaml``) is YAML, a mapping with ``dimensions`` or the list alone;
``kv-picker tune --print-space`` prints the built-in one (:data:`DEFAULT_SPACE`) as a start:

```yaml
dimensions:
- plugin: active-request-scorer         # a plugin's name in the base, or its type
  weight: {low: 0, high: 4, step: 0.25}
- plugin: queue-scorer                  # not in the base: added to the profile when tried
  weight: {low: 0.25, high: 8, log: true, optional: true}    # optional: also tried left out
- plugin: prefix-cache-scorer
  parameter: blockSizeChars
  choices: [32, 64, 128]
- plugin: predicted-latency-scorer
  parameter: queuedRequestSeconds
  low: 0.01
  high: 1.0
  log: true                             # sampled evenly in log space; step: a grid instead
```

Rules, checked before any replay (errors name the file, the line and the field):

- ``weight`` dimensions apply to scorers only. ``optional: true`` adds a yes/no choice: "no"
  leaves a plugin the base lacks out of the candidate, and sets a plugin the base has to weight
  0 (it still runs, so the signals it publishes for other plugins, such as the prefix match the
  latency scorer reads, stay). Under ``max-score-picker`` only the ratios of the weights
  matter: doubling every weight picks the same endpoints.
- ``parameter`` dimensions name a field of the plugin's parameters (as the config spells it).
  Integer fields take integer bounds and are sampled as integers; non-numeric fields need
  ``choices``. Both bounds and every choice must be values the plugin accepts.
- A plugin the base lacks needs a ``weight`` dimension (that is what adds it); its parameter
  dimensions are only tried while it is in.
- ``step`` must divide ``high - low``, and cannot be combined with ``log``.

Candidate values come from a :class:`Chooser` (the tuner's adapter of an Optuna trial,
:class:`FixedChooser` for a finished trial's parameters, or :class:`RandomChooser` for profiles
drawn evenly from the space, as ``kv-picker bench matrix --sample`` draws them), so this module
knows no optimizer.
Parameter names in a trial are ``<plugin>.weight``, ``<plugin>.enabled`` and
``<plugin>.<parameter>``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import random
import re
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Protocol

import yaml

from kv_picker.config import DEFAULT_PLUGINS, DEFAULT_PROFILE
from kv_picker.decode import (
    Check,
    FieldError,
    NonNegative,
    Positive,
    aliases,
    decode,
    yaml_name,
)
from kv_picker.errors import ConfigError
from kv_picker.scheduling.framework import SCORING_KINDS
from kv_picker.scheduling.registry import Registry

DEFAULT_SPACE = """\
# The built-in search space of `kv-picker tune`: the weights of the built-in default profile's
# four scorers, two scraped load signals it leaves out (tried in and out), and the parameters
# that change which endpoint wins (active-request-scorer's fullScale trades spreading for cache
# affinity on a lightly loaded pool, its cachedScale the same in proportion to what moving a
# request would recompute, its promptScale in proportion to the request's size; its ownDecode matters on mixed hardware only,
# as does recent-work-scorer's decodeSpeedScaled, which seeds slow idle endpoints less;
# predicted-latency-scorer's decodeTokens trades time to first token for spreading the decode of
# long contexts, for prompts past decodeMinPromptTokens, counted in excess of the cheapest
# candidate's with decodeExcess (the default: 64 tokens from 8,192, in excess), its
# saturatedMissCost prices a miss once every endpoint has a queue (in excess of the best-cached
# candidate's with missExcess, counting only the requests waiting behind the prefill in progress
# with saturatedAbove 1; the default: 2, in excess, above 1), its prefillCalibration ranks a pool
# by its own measured prefill speed, its blockingCost prices the requests that will wait behind
# this prompt's prefill (only below saturation with blockingUnsaturated; the default: 1, on, on);
# prefix-cache-scorer's fullYieldFree sets how many free slots a candidate needs before a full
# holder yields to it (its fullYield stays the base's: it is the engines' --max-num-seqs, a fact
# of the deployment, not a choice); its maxPrefixBlocksToMatch above the default's 2048 lets the
# latency estimate see long cached documents whole, which keeps their questions with them, and
# its cappedMatchIsWhole does so without hashing further, counting a match that reached the limit
# as the whole prompt).
# predicted-latency-scorer's prefillTokensPerSecond is left out on purpose: when
# the picker sent all the queued work itself, as in a replay, the rate cancels out of its
# ranking.
dimensions:
- {plugin: prefix-cache-scorer, weight: {low: 0, high: 8, step: 0.25}}
- {plugin: predicted-latency-scorer, weight: {low: 0, high: 8, step: 0.25}}
- {plugin: active-request-scorer, weight: {low: 0, high: 8, step: 0.25}}
- {plugin: recent-work-scorer, weight: {low: 0, high: 4, step: 0.25}}
- {plugin: queue-scorer, weight: {low: 0.25, high: 4, step: 0.25, optional: true}}
- {plugin: kv-cache-utilization-scorer, weight: {low: 0.25, high: 4, step: 0.25, optional: true}}
- plugin: active-request-scorer
  parameter: fullScale
  choices: [0, 4096, 8192, 16384, 32768, 65536, 131072, 262144]
- {plugin: recent-work-scorer, parameter: idleShare, choices: [0.1, 0.25, 0.5, 1.0]}
- {plugin: recent-work-scorer, parameter: decodeSpeedScaled, choices: [true, false]}
- {plugin: prefix-cache-scorer, parameter: blockSizeChars, choices: [32, 64, 128, 256]}
- plugin: prefix-cache-scorer
  parameter: maxPrefixBlocksToMatch
  choices: [64, 128, 256, 512, 1024, 2048, 4096, 8192]
- {plugin: prefix-cache-scorer, parameter: cappedMatchIsWhole, choices: [false, true]}
- {plugin: predicted-latency-scorer, parameter: queuedRequestSeconds, low: 0.01, high: 1.0,
   log: true}
- {plugin: predicted-latency-scorer, parameter: decodeTokens, choices: [0, 4, 16, 64, 256]}
- plugin: predicted-latency-scorer
  parameter: decodeMinPromptTokens
  choices: [0, 8192, 16384, 32768, 65536]
- {plugin: predicted-latency-scorer, parameter: decodeExcess, choices: [true, false]}
- {plugin: predicted-latency-scorer, parameter: saturatedMissCost, choices: [0, 1, 2, 4]}
- {plugin: predicted-latency-scorer, parameter: missExcess, choices: [false, true]}
- {plugin: predicted-latency-scorer, parameter: saturatedAbove, choices: [0, 1, 2]}
- {plugin: predicted-latency-scorer, parameter: prefillCalibration, choices: [true, false]}
- {plugin: predicted-latency-scorer, parameter: blockingCost, choices: [0, 0.5, 1, 2]}
- {plugin: predicted-latency-scorer, parameter: blockingUnsaturated, choices: [true, false]}
- {plugin: prefix-cache-scorer, parameter: fullYieldFree, choices: [1, 4, 16, 32]}
- {plugin: active-request-scorer, parameter: ownDecode, choices: [true, false]}
- {plugin: active-request-scorer, parameter: promptScale, choices: [0, 1, 2, 4, 8]}
- {plugin: active-request-scorer, parameter: cachedScale, choices: [0, 1, 2, 4, 8]}
"""
"""The built-in space, in the space file format (``kv-picker tune --print-space``)."""

DEFAULT_SPACE_SOURCE = "<built-in space>"

# The field metadata key under which kv_picker.decode keeps a field's other accepted names.
_ALIASES_KEY = next(iter(aliases()))

# -- the file ---------------------------------------------------------------------------------


def _not_empty(value: str) -> bool:
    return bool(value)


def _on_grid(span: float, step: float) -> bool:
    """Whether ``step`` divides ``span`` (up to rounding of decimal fractions)."""
    count = span / step
    return math.isclose(count, round(count), rel_tol=0.0, abs_tol=1e-9)


_SCALAR_TYPES = (bool, int, float, str, type(None))


@dataclass(frozen=True)
class WeightSpec:
    """A weight dimension's range (``weight:`` in the file)."""

    low: Annotated[float, NonNegative]
    high: Annotated[float, NonNegative]
    log: bool = False
    step: Annotated[float, Positive] | None = None
    optional: bool = False

    def validate(self) -> None:
        _check_range(self.low, self.high, self.log, self.step)


@dataclass(frozen=True)
class DimensionSpec:
    """One dimension as the file gives it (see the module docstring)."""

    plugin: Annotated[str, Check(_not_empty, "must not be empty")]
    weight: WeightSpec | None = None
    parameter: str | None = None
    low: int | float | None = None
    high: int | float | None = None
    log: bool = False
    step: Annotated[int | float, Positive] | None = None
    choices: tuple[Any, ...] | None = None

    def validate(self) -> None:
        if (self.weight is None) == (self.parameter is None):
            raise FieldError("parameter", "give either weight: {low, high} or parameter: NAME")
        if self.weight is not None:
            for name in ("low", "high", "step", "choices"):
                if getattr(self, name) is not None:
                    raise FieldError(name, "belongs under weight: in a weight dimension")
            if self.log:
                raise FieldError("log", "belongs under weight: in a weight dimension")
            return
        if self.choices is not None:
            for name in ("low", "high", "step"):
                if getattr(self, name) is not None:
                    raise FieldError(name, "give either choices or low and high, not both")
            if not self.choices:
                raise FieldError("choices", "must not be empty")
            for index, choice in enumerate(self.choices):
                if not isinstance(choice, _SCALAR_TYPES):
                    raise FieldError(f"choices[{index}]", "must be a number, a string or a bool")
            if len(set(map(repr, self.choices))) != len(self.choices):
                raise FieldError("choices", "must not repeat a value")
            return
        if self.low is None or self.high is None:
            raise FieldError("low" if self.low is None else "high", "required (or give choices)")
        _check_range(self.low, self.high, self.log, self.step)


def _check_range(low: float, high: float, log: bool, step: float | None) -> None:
    if high < low:
        raise FieldError("high", f"must be >= low ({low:g})")
    if log and low <= 0:
        raise FieldError("low", "must be > 0 with log: true")
    if step is not None:
        if log:
            raise FieldError("step", "cannot be combined with log: true")
        if not _on_grid(high - low, step):
            raise FieldError("step", f"must divide high - low ({high - low:g})")


@dataclass(frozen=True)
class SpaceFile:
    """A space file: its dimensions."""

    dimensions: tuple[DimensionSpec, ...]

    def validate(self) -> None:
        if not self.dimensions:
            raise FieldError("dimensions", "must list at least one dimension")


# -- the resolved space -----------------------------------------------------------------------


@dataclass(frozen=True)
class Dimension:
    """One dimension, resolved against the base profile and the plugin registry.

    Attributes:
        name: The trial parameter's name (``<plugin>.weight`` or ``<plugin>.<parameter>``).
        plugin: The plugin's name in the candidate document.
        plugin_type: The plugin's type.
        parameter: The parameter's name as the config spells it; ``None`` for a weight.
        low: Lower bound (``None`` with choices).
        high: Upper bound (``None`` with choices).
        log: Sample evenly in log space.
        step: Grid step, if any.
        integer: Sample integers.
        choices: The values to choose from, if not a range.
        optional: A weight that may also be left out (see the module docstring).
        aliases: Other names the parameter's field accepts (an older or upstream spelling in
            the base is replaced, not doubled).
    """

    name: str
    plugin: str
    plugin_type: str
    parameter: str | None
    low: float | None = None
    high: float | None = None
    log: bool = False
    step: float | None = None
    integer: bool = False
    choices: tuple[Any, ...] | None = None
    optional: bool = False
    aliases: tuple[str, ...] = ()

    @property
    def enabled_name(self) -> str:
        """The trial parameter that says whether an optional plugin is in."""
        return f"{self.plugin}.enabled"

    def contains(self, value: Any) -> bool:
        """Whether ``value`` is one this dimension can produce."""
        if self.choices is not None:
            return any(
                c == value and isinstance(c, bool) == isinstance(value, bool) for c in self.choices
            )
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        assert self.low is not None and self.high is not None  # a range, by construction
        if self.integer and not isinstance(value, int):
            return False
        if not self.low <= value <= self.high:
            return False
        return self.step is None or _on_grid(value - self.low, self.step)


class Chooser(Protocol):
    """Where a candidate's values come from (an optimizer's trial, or fixed values)."""

    def enabled(self, dimension: Dimension) -> bool:
        """Whether the optional plugin of a weight dimension is in."""

    def value(self, dimension: Dimension) -> Any:
        """The dimension's value."""


class FixedChooser:
    """Values from a mapping of trial parameter names (e.g. a finished trial's ``params``).

    Args:
        params: Trial parameter name -> value.
    """

    def __init__(self, params: Mapping[str, Any]) -> None:
        self.params = params

    def enabled(self, dimension: Dimension) -> bool:
        return bool(self.params[dimension.enabled_name])

    def value(self, dimension: Dimension) -> Any:
        return self.params[dimension.name]


class RandomChooser:
    """Values drawn evenly from each dimension with a seeded generator: a choice among the
    choices, a range evenly (in log space with ``log``, on the grid with ``step``, integers for
    integer fields), an optional plugin in or out with even odds.

    Args:
        rng: The generator (``random.Random(seed)``): the same seed draws the same values.
    """

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def enabled(self, dimension: Dimension) -> bool:
        return self.rng.random() < 0.5

    def value(self, dimension: Dimension) -> Any:
        rng = self.rng
        if dimension.choices is not None:
            return dimension.choices[rng.randrange(len(dimension.choices))]
        assert dimension.low is not None and dimension.high is not None  # a range
        low, high = dimension.low, dimension.high
        if dimension.step is not None:
            value = low + dimension.step * rng.randint(0, round((high - low) / dimension.step))
            return round(value) if dimension.integer else round(value, 12)
        if dimension.log:
            value = math.exp(rng.uniform(math.log(low), math.log(high)))
        else:
            value = rng.uniform(low, high)
        if dimension.integer:
            return min(int(high), max(int(low), round(value)))
        return value


@dataclass(frozen=True)
class Space:
    """A base profile and the dimensions that vary it.

    Attributes:
        base: The base document with its plugins and its one profile spelled out.
        dimensions: Weight dimensions first, then parameter dimensions (an optional plugin's
            parameters are only chosen while it is in).
        source: Where the dimensions came from (a file or the built-in space).
        base_source: Where the base came from (a file or the built-in default).
        base_values: The base's own value of every dimension, as trial parameters, or
            ``None`` when the base lies outside the space.
        picker: The picker of the base profile, if it lists one (new scorers go before it).
    """

    base: Mapping[str, Any]
    dimensions: tuple[Dimension, ...]
    source: str
    base_source: str
    base_values: Mapping[str, Any] | None
    picker: str | None = None

    def build(self, chooser: Chooser) -> tuple[dict[str, Any], dict[str, Any]]:
        """One candidate: the base with every dimension set.

        Args:
            chooser: Gives each dimension's value.

        Returns:
            The candidate document and the trial parameters it was built from.
        """
        document = copy.deepcopy(dict(self.base))
        plugins: list[dict[str, Any]] = document["plugins"]
        refs: list[dict[str, Any]] = document["schedulingProfiles"][0]["plugins"]
        entries = {_plugin_name(p): p for p in plugins}
        chosen: dict[str, Any] = {}
        left_out: set[str] = set()
        for dimension in self.dimensions:
            if dimension.plugin in left_out:
                continue
            if dimension.parameter is None:
                weight = 0.0
                on = True
                if dimension.optional:
                    on = chooser.enabled(dimension)
                    chosen[dimension.enabled_name] = on
                if on:
                    weight = chooser.value(dimension)
                    chosen[dimension.name] = weight
                elif dimension.plugin not in entries:
                    left_out.add(dimension.plugin)
                    continue
                self._set_weight(plugins, refs, entries, dimension, weight)
            else:
                value = chooser.value(dimension)
                chosen[dimension.name] = value
                entry = entries[dimension.plugin]
                parameters = dict(entry.get("parameters") or {})
                for alias in dimension.aliases:
                    parameters.pop(alias, None)
                parameters[dimension.parameter] = value
                entry["parameters"] = parameters
        return document, chosen

    def _set_weight(
        self,
        plugins: list[dict[str, Any]],
        refs: list[dict[str, Any]],
        entries: dict[str, dict[str, Any]],
        dimension: Dimension,
        weight: float,
    ) -> None:
        if dimension.plugin not in entries:
            entry = {"type": dimension.plugin_type}
            plugins.append(entry)
            entries[dimension.plugin] = entry
        for ref in refs:
            if ref["pluginRef"] == dimension.plugin:
                ref["weight"] = weight
                return
        # A new scorer goes after the others, before the picker: scorers run in order, and
        # some read what an earlier one published (the latency scorer reads the prefix match).
        position = len(refs)
        for index, ref in enumerate(refs):
            if ref["pluginRef"] == self.picker:
                position = index
                break
        refs.insert(position, {"pluginRef": dimension.plugin, "weight": weight})

    def describe(self) -> list[dict[str, Any]]:
        """The dimensions as plain data, for reports and the study's setup record."""
        return [dataclasses.asdict(d) for d in self.dimensions]


def _plugin_name(entry: Mapping[str, Any]) -> str:
    return str(entry.get("name") or entry["type"])


# -- loading ----------------------------------------------------------------------------------


def normalize_base(document: Mapping[str, Any], registry: Registry) -> dict[str, Any]:
    """The base with its plugins and its single scheduling profile spelled out.

    Mirrors :func:`kv_picker.config.parse_config`'s defaults: no ``plugins`` means the
    built-in default plugins and profile; plugins without ``schedulingProfiles`` mean one
    profile of every plugin but the profile handler.

    Raises:
        ConfigError: If the base has more than one scheduling profile.
    """
    base = copy.deepcopy(dict(document))
    if base.get("plugins") is None:
        plugins = [dict(p) for p in DEFAULT_PLUGINS]
        profiles = base.get("schedulingProfiles") or [copy.deepcopy(dict(DEFAULT_PROFILE))]
    else:
        plugins = [dict(p) for p in base["plugins"]]
        profiles = base.get("schedulingProfiles")
        if profiles is None:
            refs = [
                {"pluginRef": _plugin_name(p)}
                for p in plugins
                if registry.kind(str(p["type"])) != "profile-handler"
            ]
            profiles = [{"name": "default", "plugins": refs}]
    if len(profiles) != 1:
        raise ConfigError(
            f"schedulingProfiles: tuning varies one profile; the base has {len(profiles)}"
        )
    profile = dict(profiles[0])
    profile["plugins"] = [dict(ref) for ref in profile.get("plugins") or ()]
    base["plugins"] = plugins
    base["schedulingProfiles"] = [profile]
    return base


_PATH_PART = re.compile(r"\.?([^.\[\]:]+)|\[(\d+)\]")


def _line_of(text: str, path: str) -> int | None:
    """The 1-based line of the YAML node at ``path`` (``dimensions[2].weight.low``), or of
    the deepest node on the way to it."""
    try:
        node = yaml.compose(text)
    except yaml.YAMLError:
        return None
    if node is None:
        return None
    line = node.start_mark.line + 1
    for name, index in _PATH_PART.findall(path):
        if isinstance(node, yaml.SequenceNode) and name == "dimensions":
            continue  # the file may be the list alone
        if isinstance(node, yaml.MappingNode) and name:
            found = next((v for k, v in node.value if k.value == name), None)
        elif isinstance(node, yaml.SequenceNode) and index and int(index) < len(node.value):
            found = node.value[int(index)]
        else:
            found = None
        if found is None:
            break
        node = found
        line = node.start_mark.line + 1
    return line


def load_space(
    text: str, source: str, base: Mapping[str, Any], base_source: str, registry: Registry
) -> Space:
    """Reads a space file and resolves it against the base profile.

    Args:
        text: The space file's text.
        source: Its name in errors (a path, or :data:`DEFAULT_SPACE_SOURCE`).
        base: The base EndpointPickerConfig document (already validated).
        base_source: Where the base came from, for reports.
        registry: The plugin registry candidates are checked against.

    Raises:
        ConfigError: ``SOURCE:LINE: FIELD: problem`` for the first problem found.
    """
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from exc
    if isinstance(raw, list):
        raw = {"dimensions": raw}
    try:
        specs = decode(SpaceFile, raw, "").dimensions
        return resolve_space(specs, base, registry, source, base_source)
    except ConfigError as exc:
        message = str(exc)
        path = message.partition(": ")[0]
        line = _line_of(text, path) if raw is not None else None
        raise ConfigError(
            f"{source}:{line}: {message}" if line else f"{source}: {message}"
        ) from exc


def _field_type(params_cls: type, field_name: str) -> Any:
    """The field's type without ``Annotated`` and ``| None``."""
    hint = typing.get_type_hints(params_cls, include_extras=True)[field_name]
    while True:
        origin = typing.get_origin(hint)
        if origin is Annotated:
            hint = typing.get_args(hint)[0]
        elif origin in (typing.Union, types.UnionType):
            options = [a for a in typing.get_args(hint) if a is not type(None)]
            if len(options) != 1:
                return hint
            hint = options[0]
        else:
            return hint


def _check_value(
    registry: Registry, plugin_type: str, parameter: str, value: Any, where: str
) -> None:
    """Raises a ConfigError at ``where`` unless the plugin accepts ``value`` for ``parameter``."""
    try:
        registry.parse_params(plugin_type, {parameter: value}, "")
    except ConfigError as exc:
        problem = str(exc).split(": ", 1)[-1]
        raise ConfigError(
            f"{where}: {plugin_type} refuses {parameter}={value!r}: {problem}"
        ) from exc


def resolve_space(
    specs: Sequence[DimensionSpec],
    base_document: Mapping[str, Any],
    registry: Registry,
    source: str = DEFAULT_SPACE_SOURCE,
    base_source: str = "built-in default",
) -> Space:
    """Checks the dimensions against the base and the registry (see the module docstring).

    Raises:
        ConfigError: naming the dimension (``dimensions[i].field``) and the problem.
    """
    base = normalize_base(base_document, registry)
    entries = {_plugin_name(p): p for p in base["plugins"]}
    by_type: dict[str, list[str]] = {}
    for name, entry in entries.items():
        by_type.setdefault(str(entry["type"]), []).append(name)
    weights: list[Dimension] = []
    parameters: list[tuple[int, Dimension]] = []
    seen: dict[str, int] = {}
    for index, spec in enumerate(specs):
        where = f"dimensions[{index}]"
        name, plugin_type = _resolve_plugin(spec.plugin, entries, by_type, registry, where)
        kind = registry.kind(plugin_type)
        if spec.weight is not None:
            if kind not in SCORING_KINDS:
                raise ConfigError(f"{where}.weight: {name} is a {kind}; only scorers have weights")
            dimension = Dimension(
                f"{name}.weight",
                name,
                plugin_type,
                None,
                low=spec.weight.low,
                high=spec.weight.high,
                log=spec.weight.log,
                step=spec.weight.step,
                optional=spec.weight.optional,
            )
            weights.append(dimension)
        else:
            assert spec.parameter is not None  # validate() allows nothing else
            dimension = _parameter_dimension(spec, name, plugin_type, registry, where)
            parameters.append((index, dimension))
        if dimension.name in seen:
            raise ConfigError(f"{where}: repeats dimensions[{seen[dimension.name]}]")
        seen[dimension.name] = index
    weighted = {d.plugin for d in weights}
    for index, dimension in parameters:
        if dimension.plugin not in entries and dimension.plugin not in weighted:
            raise ConfigError(
                f"dimensions[{index}].plugin: {dimension.plugin} is not in the base profile; "
                "give it a weight dimension too, which adds it"
            )
    dimensions = (*weights, *(d for _, d in parameters))
    picker = next(
        (
            ref["pluginRef"]
            for ref in base["schedulingProfiles"][0]["plugins"]
            if ref["pluginRef"] in entries
            and registry.kind(str(entries[ref["pluginRef"]]["type"])) == "picker"
        ),
        None,
    )
    return Space(
        base,
        dimensions,
        source,
        base_source,
        _base_values(base, dimensions, registry),
        picker,
    )


def _resolve_plugin(
    plugin: str,
    entries: Mapping[str, Mapping[str, Any]],
    by_type: Mapping[str, list[str]],
    registry: Registry,
    where: str,
) -> tuple[str, str]:
    """(name in the candidate, type) of a dimension's ``plugin``: a name, else a type."""
    if plugin in entries:
        return plugin, str(entries[plugin]["type"])
    named = by_type.get(plugin, [])
    if len(named) > 1:
        raise ConfigError(
            f"{where}.plugin: the base has several {plugin} plugins; name one of {', '.join(named)}"
        )
    if named:
        return named[0], plugin
    try:
        registry.get(plugin)
    except ConfigError as exc:
        raise ConfigError(
            f"{where}.plugin: {plugin!r} is neither a plugin of the base profile "
            f"({', '.join(entries)}) nor a plugin type: {exc}"
        ) from None
    return plugin, plugin


def _parameter_dimension(
    spec: DimensionSpec, name: str, plugin_type: str, registry: Registry, where: str
) -> Dimension:
    plugin_cls: Any = registry.get(plugin_type)
    params_cls = plugin_cls.Params
    fields = {yaml_name(f): f for f in dataclasses.fields(params_cls)}
    assert spec.parameter is not None
    field = fields.get(spec.parameter)
    if field is None:
        raise ConfigError(
            f"{where}.parameter: {plugin_type} has no parameter {spec.parameter!r}; known: "
            f"{', '.join(fields) or 'none'}"
        )
    kind = _field_type(params_cls, field.name)
    numeric = kind in (int, float)
    if spec.choices is None and not numeric:
        raise ConfigError(
            f"{where}: {plugin_type}'s {spec.parameter} is not a number; give choices"
        )
    if spec.choices is not None:
        for index, choice in enumerate(spec.choices):
            _check_value(registry, plugin_type, spec.parameter, choice, f"{where}.choices[{index}]")
    else:
        for bound in ("low", "high"):
            value = getattr(spec, bound)
            if kind is int and not isinstance(value, int):
                raise ConfigError(f"{where}.{bound}: {spec.parameter} is an integer, got {value!r}")
            _check_value(registry, plugin_type, spec.parameter, value, f"{where}.{bound}")
        if kind is int and spec.step is not None and not isinstance(spec.step, int):
            raise ConfigError(f"{where}.step: {spec.parameter} is an integer, got {spec.step!r}")
    return Dimension(
        f"{name}.{spec.parameter}",
        name,
        plugin_type,
        spec.parameter,
        low=spec.low,
        high=spec.high,
        log=spec.log,
        step=spec.step,
        integer=kind is int,
        choices=spec.choices,
        aliases=tuple(field.metadata.get(_ALIASES_KEY, ())),
    )


def _base_values(
    base: Mapping[str, Any], dimensions: Sequence[Dimension], registry: Registry
) -> dict[str, Any] | None:
    """The base's own value of every dimension, or ``None`` if one lies outside the space."""
    entries = {_plugin_name(p): p for p in base["plugins"]}
    refs = {r["pluginRef"]: r for r in base["schedulingProfiles"][0]["plugins"]}
    values: dict[str, Any] = {}
    left_out: set[str] = set()
    for dimension in dimensions:
        if dimension.plugin in left_out:
            continue
        if dimension.parameter is None:
            present = dimension.plugin in refs
            if dimension.optional:
                values[dimension.enabled_name] = present
                if not present:
                    left_out.add(dimension.plugin)
                    continue
            elif not present:
                return None
            weight = refs[dimension.plugin].get("weight")
            value: Any = 1.0 if weight is None else float(weight)
        else:
            entry = entries[dimension.plugin]
            params = registry.parse_params(dimension.plugin_type, entry.get("parameters"), "")
            fields = {yaml_name(f): f.name for f in dataclasses.fields(params)}
            assert dimension.parameter is not None
            value = getattr(params, fields[dimension.parameter])
        if not dimension.contains(value):
            return None
        values[dimension.name] = value
    return values
