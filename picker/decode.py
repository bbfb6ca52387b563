"""One declarative decoder: YAML-shaped data -> frozen dataclasses, with errors that name the
path to the field.

Every part of the config goes through :func:`decode`: the top-level sections
(:mod:`kv_picker.config`) and every plugin's ``parameters`` (each plugin's ``Params``). A
dataclass describes its YAML shape with its fields:

```python
@dataclass(frozen=True)
class MetricsSection:
    scrape_interval_s: Duration = field(default=0.1, metadata=key("scrapeInterval"))
    path: Annotated[str, Check(lambda p: p.startswith("/"), "must start with '/'")] = "/metrics"

    def validate(self) -> None:        # optional: rules across fields; raise ValueError
        ...
```

- YAML names: a field's ``metadata=key("name", aliases=(...))``, else its Python name in
  camelCase (``max_body_bytes`` -> ``maxBodyBytes``). Aliases are older or upstream spellings
  accepted too (``hashBlockSize`` for ``blockSizeChars``).
- Types: ``bool``, ``int``, ``float`` (an int is accepted), ``str``, :data:`Duration`
  (seconds: a number, or ``"100ms"``, ``"2s"``, ``"1m30s"``), ``Literal[...]``, ``X | None``,
  ``tuple[T, ...]``, ``list[T]``, ``Mapping[str, T]``, nested dataclasses, ``Any`` (kept as
  is). ``bool`` is never taken for a number.
- Constraints: ``Annotated[T, Range(...)]``, ``Annotated[T, Check(predicate, message)]``.
- Unknown keys are errors that list the known ones; a field without a default is required.

Errors are :class:`~kv_picker.errors.ConfigError` with the path, e.g.
``server.grpcPort: expected an integer, got '9002'``.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

from kv_picker.errors import ConfigError

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Range:
    """Bounds on a number (each optional)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None

    def check(self, value: float) -> str | None:
        if self.ge is not None and not value >= self.ge:
            return f"must be >= {_number(self.ge)}"
        if self.gt is not None and not value > self.gt:
            return f"must be > {_number(self.gt)}"
        if self.le is not None and not value <= self.le:
            return f"must be <= {_number(self.le)}"
        if self.lt is not None and not value < self.lt:
            return f"must be < {_number(self.lt)}"
        return None


@dataclass(frozen=True, slots=True)
class Check:
    """A predicate on the decoded value, with the message to give when it fails."""

    predicate: Callable[[Any], bool]
    message: str


class _DurationMarker:
    """Marks a float field as a duration in seconds (see :data:`Duration`)."""


class _TextMarker:
    """Marks a str field that also takes a number, kept as its text (see :data:`Text`)."""


Duration = Annotated[float, _DurationMarker()]
"""Seconds: a number, or a string such as ``100ms``, ``2s``, ``1.5m``, ``1m30s``, ``1h``."""

Text = Annotated[str, _TextMarker()]
"""A string; a number is accepted and kept as its text (``hashSeed: 42`` is ``"42"``)."""

NonNegative = Range(ge=0)
Positive = Range(gt=0)
Port = Range(ge=0, le=65535)

_NAME_KEY = "kv_picker.key"
_ALIASES_KEY = "kv_picker.aliases"
_INTERNAL_KEY = "kv_picker.internal"


def key(name: str, aliases: tuple[str, ...] = ()) -> dict[str, Any]:
    """Field metadata: the field's YAML name and accepted aliases."""
    return {_NAME_KEY: name, _ALIASES_KEY: aliases}


def aliases(*names: str) -> dict[str, Any]:
    """Field metadata: other accepted YAML names (the field keeps its own)."""
    return {_ALIASES_KEY: names}


INTERNAL: dict[str, Any] = {_INTERNAL_KEY: True}
"""Field metadata: not a YAML field (filled in by the code that builds the object)."""


class FieldError(ValueError):
    """Raised by a ``validate()`` method to blame one field (named by its YAML name)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def yaml_name(field: dataclasses.Field[Any]) -> str:
    """The YAML name of a dataclass field."""
    name = field.metadata.get(_NAME_KEY)
    if isinstance(name, str):
        return name
    head, *rest = field.name.split("_")
    return head + "".join(part[:1].upper() + part[1:] for part in rest)


def field_names(cls: type) -> list[str]:
    """YAML names of a dataclass's fields, in order."""
    return [yaml_name(f) for f in dataclasses.fields(cls) if not f.metadata.get(_INTERNAL_KEY)]


_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|us|µs|ns|s|m|h)")
_UNIT_S = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration_s(value: Any, where: str) -> float:
    """Seconds from a number (seconds) or a duration string (``100ms``, ``1m30s``).

    Raises:
        ConfigError: naming ``where``.
    """
    if isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip()
        parts = _DURATION_PART.findall(text)
        if re.fullmatch(r"\d+(?:\.\d+)?", text):
            seconds = float(text)
        elif parts and "".join(n + u for n, u in parts) == text:
            seconds = sum(float(n) * _UNIT_S[u] for n, u in parts)
        else:
            raise ConfigError(
                f"{where}: expected a duration such as 100ms, 2s or 1.5, got {value!r}"
            )
    else:
        raise ConfigError(f"{where}: expected a duration such as 100ms, 2s or 1.5, got {value!r}")
    if not 0 <= seconds < float("inf"):  # also refuses NaN
        raise ConfigError(f"{where}: expected a duration >= 0, got {value!r}")
    return seconds


def decode(cls: type[T], raw: Any, where: str) -> T:
    """Decode ``raw`` (from YAML) into the dataclass ``cls``.

    Args:
        cls: a dataclass following the module docstring's rules.
        raw: the YAML value (None means an empty mapping).
        where: the path of ``raw`` in the document, for errors.

    Raises:
        ConfigError: the first problem found, naming its path.
    """
    value: T = _decode(cls, {} if raw is None else raw, where)
    return value


def _join(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def _decode_dataclass(cls: type, raw: Any, where: str) -> Any:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where or 'config'}: expected a mapping, got {_show(raw)}")
    hints = typing.get_type_hints(cls, include_extras=True)
    fields = [f for f in dataclasses.fields(cls) if f.init and not f.metadata.get(_INTERNAL_KEY)]
    by_name: dict[str, dataclasses.Field[Any]] = {}
    for f in fields:
        by_name[yaml_name(f)] = f
        for alias in f.metadata.get(_ALIASES_KEY, ()):
            by_name[alias] = f
    unknown = sorted(str(k) for k in raw if k not in by_name)
    if unknown:
        known = ", ".join(yaml_name(f) for f in fields) or "none"
        raise ConfigError(
            f"{where or 'config'}: unknown field(s) {', '.join(unknown)}; known: {known}"
        )
    values: dict[str, Any] = {}
    for raw_key, raw_value in raw.items():
        f = by_name[raw_key]
        if f.name in values:
            raise ConfigError(f"{_join(where, str(raw_key))}: given twice (under an alias)")
        values[f.name] = _decode(hints[f.name], raw_value, _join(where, str(raw_key)))
    for f in fields:
        missing = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if missing and f.name not in values:
            raise ConfigError(f"{_join(where, yaml_name(f))}: required")
    try:
        result = cls(**values)
        validate = getattr(result, "validate", None)
        if validate is not None:
            validate()
    except FieldError as exc:
        raise ConfigError(f"{_join(where, exc.field)}: {exc}") from exc
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where or 'config'}: {exc}") from exc
    return result


def _decode(annotation: Any, raw: Any, where: str) -> Any:
    origin = typing.get_origin(annotation)
    if origin is Annotated:
        base, *extras = typing.get_args(annotation)
        if any(isinstance(e, _DurationMarker) for e in extras):
            value = parse_duration_s(raw, where)
        elif any(isinstance(e, _TextMarker) for e in extras):
            if isinstance(raw, int | float) and not isinstance(raw, bool):
                raw = str(raw)
            value = _decode(base, raw, where)
        else:
            value = _decode(base, raw, where)
        for extra in extras:
            problem = None
            if isinstance(extra, Range):
                problem = extra.check(value)
            elif isinstance(extra, Check) and not extra.predicate(value):
                problem = extra.message
            if problem:
                raise ConfigError(f"{where}: {problem}, got {_show(raw)}")
        return value
    if dataclasses.is_dataclass(annotation) and isinstance(annotation, type):
        return _decode_dataclass(annotation, raw, where)
    if annotation is Any:
        return raw
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if raw is None and type(None) in args:
            return None
        options = [a for a in args if a is not type(None)]
        errors: list[str] = []
        for option in options:
            try:
                return _decode(option, raw, where)
            except ConfigError as exc:
                errors.append(str(exc))
        # An option that got past the value's shape (its error names a field inside) is the
        # one the author meant; else the first option's error.
        inside = [e for e in errors if e.startswith((f"{where}.", f"{where}["))]
        raise ConfigError(inside[0] if inside else errors[0])
    if origin is typing.Literal:
        if raw in args and not isinstance(raw, bool):
            return raw
        choices = ", ".join(str(a) for a in args)
        raise ConfigError(f"{where}: must be one of {choices}, got {_show(raw)}")
    if annotation is bool:
        if isinstance(raw, bool):
            return raw
        raise ConfigError(f"{where}: expected true/false, got {_show(raw)}")
    if annotation is int:
        if isinstance(raw, int) and not isinstance(raw, bool):
            return raw
        raise ConfigError(f"{where}: expected an integer, got {_show(raw)}")
    if annotation is float:
        if isinstance(raw, int | float) and not isinstance(raw, bool):
            return float(raw)
        raise ConfigError(f"{where}: expected a number, got {_show(raw)}")
    if annotation is str:
        if isinstance(raw, str):
            return raw
        raise ConfigError(f"{where}: expected a string, got {_show(raw)}")
    if origin in (tuple, list):
        if not isinstance(raw, list | tuple):
            raise ConfigError(f"{where}: expected a list, got {_show(raw)}")
        item_type = args[0] if args else Any
        items = [_decode(item_type, v, f"{where}[{i}]") for i, v in enumerate(raw)]
        return tuple(items) if origin is tuple else items
    if origin in (dict, Mapping) or annotation in (dict, Mapping) or origin is typing.Mapping:
        if not isinstance(raw, Mapping):
            raise ConfigError(f"{where}: expected a mapping, got {_show(raw)}")
        key_type, value_type = args if args else (Any, Any)
        return {
            _decode(key_type, k, where): _decode(value_type, v, _member(where, k))
            for k, v in raw.items()
        }
    raise TypeError(f"{where}: the decoder does not know type {annotation!r}")


_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _member(where: str, name: Any) -> str:
    """The path of a mapping's member: ``a.b``, or ``a['10.0.0.1:80']`` for other keys."""
    if isinstance(name, str) and _IDENTIFIER.fullmatch(name):
        return f"{where}.{name}"
    return f"{where}[{name!r}]"


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
