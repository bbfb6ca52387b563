"""The built-in plugins, as one explicit table, and the registry that holds them.

A type is available by name only if its class is listed here (or comes from an entry point of
the ``kv_picker.plugins`` group). The table lives above both ``scheduling/`` and ``scorers/``
so that neither imports the other's plugins.
"""

from __future__ import annotations

from importlib.metadata import entry_points

from kv_picker.errors import ConfigError
from kv_picker.scheduling.filters import BUILTIN_FILTERS
from kv_picker.scheduling.handlers import BUILTIN_PROFILE_HANDLERS
from kv_picker.scheduling.pickers import BUILTIN_PICKERS
from kv_picker.scheduling.registry import ENTRY_POINT_GROUP, Registry
from kv_picker.scorers import BUILTIN_SCORERS, BUILTIN_STATE_FILTERS

BUILTIN_PLUGINS = (
    *BUILTIN_SCORERS,
    *BUILTIN_PICKERS,
    *BUILTIN_FILTERS,
    *BUILTIN_STATE_FILTERS,
    *BUILTIN_PROFILE_HANDLERS,
)


def builtin_registry(include_entry_points: bool = True) -> Registry:
    """Registry with every built-in plugin (and entry-point plugins when asked)."""
    registry = Registry(BUILTIN_PLUGINS)
    if include_entry_points:
        for entry_point in entry_points(group=ENTRY_POINT_GROUP):
            try:
                registry.add(entry_point.load())
            except Exception as exc:
                raise ConfigError(f"plugin entry point {entry_point.name!r}: {exc}") from exc
    return registry
