"""Plugin registry: an explicit table from type name to plugin class.

Every plugin class has the same skeleton:

```python
class QueueScorer:
    type_name = "queue-scorer"

    @dataclass(frozen=True)
    class Params:              # read by kv_picker.decode: unknown keys and wrong types are errors
        ...

    def __init__(self, name: str, params: Params, ctx: BuildContext) -> None: ...
    def score(self, request, candidates, out) -> None: ...   # its kind's method
```

Its kind (filter, scorer, picker or profile handler) comes from the Protocol it implements
(:func:`~kv_picker.scheduling.framework.kind_of`), decided once when the class is registered: a
class that implements no kind, or several, is refused. A class may also redirect a deprecated
spelling to another type with ``redirect(parameters) -> (type_name, parameters) | None``
(e.g. ``prefix-cache-scorer`` with ``mode: precise`` -> ``precise-prefix-cache-scorer``).

Third-party plugins may be added through the ``kv_picker.plugins`` entry-point group; each
entry point names a plugin class.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from typing import Any

from kv_picker.decode import decode
from kv_picker.errors import ConfigError
from kv_picker.scheduling.context import AnyPlugin, BuildContext
from kv_picker.scheduling.framework import PluginKind, kind_of

log = logging.getLogger(__name__)

PluginClass = type  # a class with type_name, Params and __init__(name, params, ctx)

ENTRY_POINT_GROUP = "kv_picker.plugins"


class Registry:
    """Type name -> plugin class, with each class's kind."""

    def __init__(self, classes: Iterable[PluginClass] = ()) -> None:
        self._classes: dict[str, PluginClass] = {}
        self._kinds: dict[str, PluginKind] = {}
        for cls in classes:
            self.add(cls)

    def add(self, cls: PluginClass) -> None:
        """Register a plugin class.

        Raises:
            ConfigError: no type name or Params dataclass, a duplicate type, or a class that
                implements no plugin kind (or several).
        """
        type_name = getattr(cls, "type_name", None)
        if not isinstance(type_name, str) or not type_name:
            raise ConfigError(f"plugin class {cls.__name__} has no type_name")
        if not dataclasses.is_dataclass(getattr(cls, "Params", None)):
            raise ConfigError(f"plugin class {cls.__name__} has no Params dataclass")
        if type_name in self._classes:
            raise ConfigError(f"plugin type {type_name!r} is registered twice")
        kind = kind_of(cls)
        self._classes[type_name] = cls
        self._kinds[type_name] = kind

    def known(self) -> list[str]:
        return sorted(self._classes)

    def get(self, type_name: str) -> PluginClass:
        cls = self._classes.get(type_name)
        if cls is None:
            raise ConfigError(
                f"unknown plugin type {type_name!r}; known types: {', '.join(self.known())}"
            )
        return cls

    def kind(self, type_name: str) -> PluginKind:
        """The kind of a registered type."""
        self.get(type_name)
        return self._kinds[type_name]

    def parse_params(self, type_name: str, raw: Any, where: str) -> Any:
        """Decode a plugin's ``parameters`` strictly into its Params dataclass."""
        cls: Any = self.get(type_name)
        return decode(cls.Params, raw, f"{where}.parameters")

    def parse_plugin(self, type_name: str, raw: Any, where: str) -> tuple[str, Any]:
        """The type (after any redirect) and decoded parameters of a declared plugin.

        Raises:
            ConfigError: unknown type or bad parameters, naming ``where``.
        """
        try:
            cls: Any = self.get(type_name)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        redirect = getattr(cls, "redirect", None)
        target = redirect(raw) if redirect is not None else None
        if target is not None:
            new_type, raw = target
            log.warning("%s: %s is deprecated here; use type %s", where, type_name, new_type)
            type_name = new_type
        return type_name, self.parse_params(type_name, raw, where)

    def build(self, type_name: str, name: str, params: Any, ctx: BuildContext) -> AnyPlugin:
        cls = self.get(type_name)
        try:
            plugin: AnyPlugin = cls(name, params, ctx)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"plugin {name!r} ({type_name}): {exc}") from exc
        return plugin
