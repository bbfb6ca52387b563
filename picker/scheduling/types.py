"""Contracts between the framework and its plugins.

A request is scheduled once per profile. A profile runs its filters in order, asks every scorer
for a score in [0,1] per candidate, clamps, multiplies by the profile's weight and sums, then
hands the totals to its picker. A profile handler decides which profiles run and which one is
primary (its pick is where Envoy sends the request).

Plugins are small: they never see weights, clamping or timing, which live in the framework.
"""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, runtime_checkable

from kv_picker.state.endpoints import Endpoint, EndpointStore
from kv_picker.state.hardware import HardwareTable

if TYPE_CHECKING:
    from kv_picker.state.kv_index import KVBlockIndex
    from kv_picker.state.redis_index import RedisKVIndex


@dataclass(slots=True)
class LLMRequest:
    """One parsed inference request.

    Attributes:
        request_id: from ``x-request-id`` or generated.
        model: the model named in the body.
        target_model: the model the pool should serve (after a rewrite header), the base
            model when ``model`` names a LoRA adapter.
        lora_adapter: the adapter, when ``model`` names one the pool declares.
        path: request path without the query string.
        kind: ``completions``, ``chat`` or ``other``.
        prompt: text used for prefix hashing (the chat messages rendered as text).
        stream: the client asked for a streamed (SSE) response.
        cache_salt: tenant isolation for prefix caching.
        headers: request headers, lower-cased names.
        priority: admission priority; negative means sheddable.
        body_size_bytes: size of the request body.
        body: the decoded JSON body (precise prefix matching tokenizes chat messages with the
            model's chat template, and uses the token ids a completion sent).
        state: per-request scratch space for plugins (e.g. the prefix keys computed by a
            scorer and recorded after the pick).
    """

    request_id: str
    model: str
    target_model: str
    path: str
    kind: str
    prompt: str
    stream: bool = False
    cache_salt: str | None = None
    lora_adapter: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    priority: int = 0
    body_size_bytes: int = 0
    state: dict[str, Any] = field(default_factory=dict)
    body: Mapping[str, Any] | None = None


@dataclass(slots=True)
class ProfileResult:
    """What one profile picked, best first, with the scores that led there."""

    targets: list[Endpoint]
    candidates: Sequence[Endpoint]
    totals: list[float]
    # scorer name -> clamped per-candidate scores; filled only when explaining.
    breakdown: dict[str, list[float]] | None = None


@dataclass(slots=True)
class SchedulingResult:
    """All profiles' results; the primary profile's targets are the destination."""

    primary_profile: str
    profile_results: dict[str, ProfileResult]

    @property
    def primary(self) -> ProfileResult:
        return self.profile_results[self.primary_profile]


@dataclass(slots=True)
class BuildContext:
    """What plugin factories may use: shared state, the clock and a seeded generator."""

    store: EndpointStore
    rng: random.Random
    clock: Callable[[], float]
    metrics_staleness_s: float
    # State that outlives one config (e.g. a prefix index kept across a reload), by key.
    shared: dict[str, Any] = field(default_factory=dict)
    hardware: HardwareTable = field(default_factory=HardwareTable)
    # The precise KV-block index fed by KV events (None when the config has no KV events).
    kv_index: KVBlockIndex | RedisKVIndex | None = None


class Plugin(Protocol):
    """Every plugin has a registry type name and an instance name (default: the type)."""

    type_name: ClassVar[str]
    name: str


@runtime_checkable
class Filter(Plugin, Protocol):
    def filter(self, request: LLMRequest, candidates: list[Endpoint]) -> list[Endpoint]:
        """Return the candidates that may serve the request (a new list or the same one)."""
        ...


@runtime_checkable
class Scorer(Plugin, Protocol):
    def score(self, request: LLMRequest, candidates: Sequence[Endpoint], out: list[float]) -> None:
        """Write a score in [0,1] for ``candidates[i]`` into ``out[i]`` (preset to 0)."""
        ...


@runtime_checkable
class Picker(Plugin, Protocol):
    def pick(
        self, request: LLMRequest, candidates: Sequence[Endpoint], totals: Sequence[float]
    ) -> list[Endpoint]:
        """Choose endpoints, best first (at least one when candidates are non-empty)."""
        ...


@runtime_checkable
class Prepare(Plugin, Protocol):
    def prepare(self, request: LLMRequest) -> Awaitable[None] | None:
        """Start async work the request needs before the synchronous schedule.

        Returns an awaitable the caller awaits before scheduling (e.g. tokenizing a long prompt
        on a thread pool, fetching index entries from a shared backend), or None when there is
        nothing to wait for (the common case: no coroutine is created). The work must not raise;
        whatever it could not do means "no signal" in the plugin's scores.
        """
        ...


@runtime_checkable
class PostPick(Plugin, Protocol):
    def on_pick(self, request: LLMRequest, result: SchedulingResult) -> None:
        """Called once after a successful schedule (e.g. to record blocks sent)."""
        ...


class ProfileRunner(Protocol):
    """What a profile handler gets to run one profile."""

    def __call__(
        self, profile_name: str, request: LLMRequest, candidates: list[Endpoint]
    ) -> ProfileResult: ...


@runtime_checkable
class ProfileHandler(Plugin, Protocol):
    def schedule(
        self,
        request: LLMRequest,
        candidates: list[Endpoint],
        profile_names: Sequence[str],
        run_profile: ProfileRunner,
    ) -> SchedulingResult:
        """Run the profiles this request needs and name the primary one."""
        ...


AnyPlugin = Filter | Scorer | Picker | ProfileHandler
