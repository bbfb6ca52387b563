"""Plugin registry: an explicit table from type name to plugin class.

Every plugin class has the same skeleton:

```python
class QueueScorer:
    type_name = "queue-scorer"

    @dataclass(frozen=True)
    class Params:              # strict: unknown keys and wrong types are config errors
        ...

    def __init__(self, name: str, params: Params, ctx: BuildContext) -> None: ...
```

Third-party plugins may be added through the ``kv_picker.plugins`` entry-point group; each
entry point names a plugin class.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Iterable, Mapping
from importlib.metadata import entry_points
from typing import Any

from kv_picker.errors import ConfigError
from kv_picker.scheduling.types import AnyPlugin, BuildContext

PluginClass = type  # a class with type_name, Params and __init__(name, params, ctx)

ENTRY_POINT_GROUP = "kv_picker.plugins"


class Registry:
    """Type name -> plugin class."""

    def __init__(self, classes: Iterable[PluginClass] = ()) -> None:
        self._classes: dict[str, PluginClass] = {}
        for cls in classes:
            self.add(cls)

    def add(self, cls: PluginClass) -> None:
        type_name = getattr(cls, "type_name", None)
        if not isinstance(type_name, str) or not type_name:
            raise ConfigError(f"plugin class {cls.__name__} has no type_name")
        if not dataclasses.is_dataclass(getattr(cls, "Params", None)):
            raise ConfigError(f"plugin class {cls.__name__} has no Params dataclass")
        if type_name in self._classes:
            raise ConfigError(f"plugin type {type_name!r} is registered twice")
        self._classes[type_name] = cls

    def known(self) -> list[str]:
        return sorted(self._classes)

    def get(self, type_name: str) -> PluginClass:
        cls = self._classes.get(type_name)
        if cls is None:
            raise ConfigError(
                f"unknown plugin type {type_name!r}; known types: {', '.join(self.known())}"
            )
        return cls

    def parse_params(self, type_name: str, plugin_name: str, raw: Any) -> Any:
        """Decode a plugin's ``parameters`` strictly into its Params dataclass."""
        cls: Any = self.get(type_name)
        return decode_params(cls.Params, raw, f"plugin {plugin_name!r}")

    def build(self, type_name: str, name: str, params: Any, ctx: BuildContext) -> AnyPlugin:
        cls = self.get(type_name)
        try:
            plugin: AnyPlugin = cls(name, params, ctx)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"plugin {name!r} ({type_name}): {exc}") from exc
        return plugin


def decode_params(params_cls: type, raw: Any, where: str) -> Any:
    """Build ``params_cls`` from a mapping, rejecting unknown keys and wrong types.

    The error names ``where`` (the plugin) and the field.
    """
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where}: parameters must be a mapping, got {type(raw).__name__}")
    hints = typing.get_type_hints(params_cls)
    fields = {f.name: f for f in dataclasses.fields(params_cls)}
    unknown = sorted(set(raw) - set(fields))
    if unknown:
        known = ", ".join(sorted(fields)) or "none"
        raise ConfigError(f"{where}: unknown parameter(s) {', '.join(unknown)}; known: {known}")
    values: dict[str, Any] = {}
    for key, value in raw.items():
        values[key] = _coerce(value, hints[key], f"{where}: parameter {key!r}")
    try:
        params = params_cls(**values)
        validate = getattr(params, "validate", None)
        if validate is not None:
            validate()
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from exc
    return params


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{where}: bad value {value!r}")
    if annotation is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if annotation is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if annotation is float:
        if isinstance(value, int | float) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{where}: expected a number, got {value!r}")
    if annotation is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{where}: expected a string, got {value!r}")
    if origin in (tuple, list):
        if not isinstance(value, list | tuple):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        item_type = args[0] if args else Any
        items = [_coerce(v, item_type, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin in (dict, Mapping) or annotation is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: expected a mapping, got {value!r}")
        key_type, value_type = args if args else (Any, Any)
        return {
            _coerce(k, key_type, where): _coerce(v, value_type, f"{where}.{k}")
            for k, v in value.items()
        }
    return value


def builtin_registry(include_entry_points: bool = True) -> Registry:
    """Registry with every built-in plugin (and entry-point plugins when asked)."""
    from kv_picker.scheduling.filters import BUILTIN_FILTERS
    from kv_picker.scheduling.handlers import BUILTIN_PROFILE_HANDLERS
    from kv_picker.scheduling.pickers import BUILTIN_PICKERS
    from kv_picker.scorers import BUILTIN_SCORERS

    registry = Registry(
        [*BUILTIN_SCORERS, *BUILTIN_PICKERS, *BUILTIN_FILTERS, *BUILTIN_PROFILE_HANDLERS]
    )
    if include_entry_points:
        for entry_point in entry_points(group=ENTRY_POINT_GROUP):
            try:
                registry.add(entry_point.load())
            except Exception as exc:
                raise ConfigError(f"plugin entry point {entry_point.name!r}: {exc}") from exc
    return registry
