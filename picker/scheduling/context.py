"""What plugin factories get: the state they may read, the clock, a seeded generator, and
resources that outlive one config.

Why shared resources have lifetimes: a config reload rebuilds every plugin, but some state must
survive it (the approximate prefix index, a loaded tokenizer): the rebuilt plugin gets the same
object back when its key is unchanged. State a new config no longer uses must go, with the
callbacks it registered, or every reload that changes a parameter leaks an index and a
subscription. So each build records the keys it used, and adopting a config releases the rest::

    build (config B)  ──get(key_b)──> created, key_b recorded by this build
    adopt B           ──release_unused({key_b})──> key_a released: subscriptions cancelled
    build fails       ──> nothing released; the running config keeps its resources
"""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from kv_picker.state.endpoints import EndpointStore
from kv_picker.state.hardware import HardwareTable

if TYPE_CHECKING:
    from kv_picker.state.kv_index import KVIndex

T = TypeVar("T")


class Cancellable(Protocol):
    """A registration that can be undone (e.g. :meth:`EndpointStore.on_removed`'s handle)."""

    def cancel(self) -> None: ...


class Lifetime:
    """The registrations a shared resource made; cancelled when the resource is released."""

    __slots__ = ("_held",)

    def __init__(self) -> None:
        self._held: list[Cancellable] = []

    def hold(self, registration: Cancellable) -> None:
        self._held.append(registration)

    def end(self) -> None:
        held, self._held = self._held, []
        for registration in held:
            registration.cancel()


class SharedResources:
    """Objects kept across config reloads, by key (see the module docstring)."""

    def __init__(self) -> None:
        self._entries: dict[Hashable, tuple[object, Lifetime]] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def get(
        self,
        key: Hashable,
        kind: type[T],
        create: Callable[[Lifetime], T],
        used: set[Hashable] | None = None,
    ) -> T:
        """The resource under ``key``, created by ``create`` when there is none.

        Args:
            key: what makes two plugins' resources interchangeable (owner, shape parameters).
            kind: the resource's type; an entry of another type under the key is replaced.
            create: builds the resource; registrations it makes go on the given lifetime.
            used: the current build's record of keys it uses.
        """
        if used is not None:
            used.add(key)
        entry = self._entries.get(key)
        if entry is not None and isinstance(entry[0], kind):
            return entry[0]
        if entry is not None:
            entry[1].end()
        lifetime = Lifetime()
        value = create(lifetime)
        self._entries[key] = (value, lifetime)
        return value

    def release_unused(self, keep: set[Hashable]) -> int:
        """Drop every resource whose key is not in ``keep``; returns how many were dropped."""
        dropped = [key for key in self._entries if key not in keep]
        for key in dropped:
            _, lifetime = self._entries.pop(key)
            lifetime.end()
        return len(dropped)


@dataclass(slots=True)
class BuildContext:
    """What plugin factories may use.

    Attributes:
        store: endpoint state (read; in-flight and queued-prefill counts belong to the director).
        rng: the seeded generator for every random choice.
        clock: monotonic clock in seconds.
        metrics_staleness_s: how old scraped signals may be before they count as saturated.
        hardware: the hardware-class table.
        kv_index: the precise KV-block index fed by KV events (None without an event source).
        shared: resources kept across config reloads (use :meth:`shared_resource`).
        used_shared: keys of shared resources the current build uses.
    """

    store: EndpointStore
    rng: random.Random
    clock: Callable[[], float]
    metrics_staleness_s: float
    hardware: HardwareTable = field(default_factory=HardwareTable)
    kv_index: KVIndex | None = None
    shared: SharedResources = field(default_factory=SharedResources)
    used_shared: set[Hashable] = field(default_factory=set)

    def for_build(self) -> BuildContext:
        """The same context with a fresh record of used shared resources (one per build)."""
        return replace(self, used_shared=set())

    def shared_resource(self, key: Hashable, kind: type[T], create: Callable[[Lifetime], T]) -> T:
        """:meth:`SharedResources.get`, recorded as used by this build."""
        return self.shared.get(key, kind, create, self.used_shared)


AnyPlugin = Any
"""A built plugin instance (its kind is checked by :func:`~kv_picker.scheduling.framework.kind_of`)."""
