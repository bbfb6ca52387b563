"""Contracts between the scheduling framework and its plugins.

A request is scheduled once per profile. A profile runs its filters in order, asks every scorer
for a score in [0,1] per candidate, clamps, multiplies by the profile's weight and sums, then
hands the totals to its picker. A profile handler decides which profiles run, which one is
primary (its pick is where Envoy sends the request) and which one, if any, picked the prefill
endpoint.

Plugins are small: they never see weights, clamping or timing, which live in the framework.

A plugin is of exactly one *kind*, decided by :func:`kind_of` from the Protocol its class
implements, and may add *capabilities*:

```
kinds (exactly one)          capabilities (any)
  Filter          filter()     Prepare           prepare()            async work before the pick
  Scorer          score()      PostPick          on_pick()            after a successful pick
                               PromptLanded      on_prompt_landed()   a P/D prompt's KV arrived
  Picker          pick()       ResponseHeaders   response_headers()   headers on the response
  ProfileHandler  schedule()   RequiresProfiles  required_profiles()  profiles that must exist
                               CollectsMetrics   collect_metrics()    gauges for /metrics
                               ReadsPlugins      bind_plugins()       other plugins it reads
```

The one combination allowed is Filter and Scorer together, the kind ``filter-scorer``, as a
plugin of the Gateway API Inference Extension may be both (llm-d's ``context-length-aware``):
a profile that lists it runs it among its filters and among its scorers, its weight on the
score.

This module is the bottom of the scheduling layer: it imports nothing from ``state/``,
``scorers/`` or the service around it (a test enforces it), so a plugin written against it
depends on the contracts only.
"""

from __future__ import annotations

from collections.abc import Awaitable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

from kv_picker.endpoint import Endpoint, EndpointId
from kv_picker.errors import ConfigError
from kv_picker.request import ChatMessage, LLMRequest, Prompt

__all__ = [
    "FILTERING_KINDS",
    "SCORING_KINDS",
    "ChatMessage",
    "CollectsMetrics",
    "Endpoint",
    "EndpointId",
    "Filter",
    "LLMRequest",
    "Picker",
    "PluginGauge",
    "PluginKind",
    "PostPick",
    "Prepare",
    "ProfileHandler",
    "ProfileResult",
    "ProfileRunner",
    "Prompt",
    "PromptLanded",
    "ReadsPlugins",
    "RequiresProfiles",
    "ResponseHeaders",
    "SchedulingResult",
    "Scorer",
    "kind_of",
]


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
    """All profiles' results.

    Attributes:
        primary_profile: the profile whose first target is the destination.
        profile_results: every profile that ran, by name.
        prefill_profile: the profile that picked a separate prefill endpoint (P/D), named by
            the profile handler; None when the request is served aggregated.
        signals: the plugins' per-request signals (``LLMRequest.state``, e.g. the prefix
            match) as scheduling left them; kept only when explaining, since a routed request
            drops them.
    """

    primary_profile: str
    profile_results: dict[str, ProfileResult]
    prefill_profile: str | None = None
    signals: dict[str, Any] | None = None

    @property
    def primary(self) -> ProfileResult:
        return self.profile_results[self.primary_profile]

    @property
    def destination(self) -> Endpoint:
        """Where Envoy sends the request."""
        return self.profile_results[self.primary_profile].targets[0]

    @property
    def prefill_endpoint(self) -> Endpoint | None:
        """The endpoint that computes the prompt when it is not the destination (P/D)."""
        if self.prefill_profile is None:
            return None
        result = self.profile_results.get(self.prefill_profile)
        if result is None or not result.targets:
            return None
        return result.targets[0]


# -- kinds ------------------------------------------------------------------------------------


@runtime_checkable
class Filter(Protocol):
    def filter(self, request: LLMRequest, candidates: list[Endpoint]) -> list[Endpoint]:
        """Return the candidates that may serve the request (a new list or the same one)."""
        ...


@runtime_checkable
class Scorer(Protocol):
    def score(self, request: LLMRequest, candidates: Sequence[Endpoint], out: list[float]) -> None:
        """Write a score in [0,1] for ``candidates[i]`` into ``out[i]`` (preset to 0)."""
        ...


@runtime_checkable
class Picker(Protocol):
    def pick(
        self, request: LLMRequest, candidates: Sequence[Endpoint], totals: Sequence[float]
    ) -> list[Endpoint]:
        """Choose endpoints, best first (at least one when candidates are non-empty)."""
        ...


class ProfileRunner(Protocol):
    """What a profile handler gets to run one profile."""

    def __call__(
        self, profile_name: str, request: LLMRequest, candidates: list[Endpoint]
    ) -> ProfileResult: ...


@runtime_checkable
class ProfileHandler(Protocol):
    def schedule(
        self,
        request: LLMRequest,
        candidates: list[Endpoint],
        profile_names: Sequence[str],
        run_profile: ProfileRunner,
    ) -> SchedulingResult:
        """Run the profiles this request needs; name the primary (and prefill) profile."""
        ...


# -- capabilities -----------------------------------------------------------------------------


@runtime_checkable
class Prepare(Protocol):
    def prepare(self, request: LLMRequest) -> Awaitable[None] | None:
        """Start async work the request needs before the synchronous schedule.

        Returns an awaitable the caller awaits before scheduling (e.g. tokenizing a long prompt
        on a thread pool, fetching index entries from a shared backend), or None when there is
        nothing to wait for (the common case: no coroutine is created). The work must not raise;
        whatever it could not do means "no signal" in the plugin's scores.
        """
        ...


@runtime_checkable
class PostPick(Protocol):
    def on_pick(self, request: LLMRequest, result: SchedulingResult) -> None:
        """Called once after a successful schedule (e.g. to record blocks sent)."""
        ...


@runtime_checkable
class PromptLanded(Protocol):
    def on_prompt_landed(self, request: LLMRequest, result: SchedulingResult) -> None:
        """A disaggregated request's prompt has been computed at its prefill endpoint and its
        KV has reached the destination: the first response byte came, or the prefill's end was
        learned otherwise (the endpoint's first-token count, the request's end). Called once
        per request the P/D handler disaggregated, after its :meth:`PostPick.on_pick`; the
        request's prompt and scratch state are gone by then. Until this call the destination
        does not hold the prompt's blocks: a request sent there meanwhile would compute them
        again."""
        ...


@runtime_checkable
class SharesPicks(Protocol):
    """A plugin whose pick records must reach the picker's other worker processes.

    With ``kv-picker serve --workers N`` each worker schedules its own share of the requests;
    what a pick teaches a plugin (the blocks an endpoint was just sent) is sent to the other
    workers as this plugin's keys and recorded there, so the workers route as one picker.
    """

    def pick_keys(self, request: LLMRequest) -> Sequence[int] | None:
        """The keys :meth:`PostPick.on_pick` recorded for ``request`` (None: nothing)."""
        ...

    def record_peer_pick(self, pick: PeerPick, keys: Sequence[int]) -> None:
        """Record what another worker's pick sent to its endpoints, as ``on_pick`` would
        (what a disaggregated request's destination will hold waits for
        :meth:`SharesLandings.record_peer_landing`, where ``on_pick`` waits for
        ``on_prompt_landed``)."""
        ...


@dataclass(frozen=True, slots=True)
class PeerPick:
    """Another worker's pick, in this worker's endpoint ids (None: an endpoint this worker
    does not know, e.g. one it has not discovered yet)."""

    destination: EndpointId | None
    prefill: EndpointId | None = None
    """A separate prefill endpoint (disaggregated), None when the destination computes it."""
    landing: str | None = None
    """Names the later :meth:`SharesLandings.record_peer_landing` of a disaggregated pick
    (apart from this worker's own requests)."""

    @property
    def ids(self) -> list[EndpointId]:
        """The endpoints this worker knows that the pick sent the request to."""
        return [i for i in (self.destination, self.prefill) if i is not None]


@runtime_checkable
class SharesLandings(Protocol):
    """A ``SharesPicks`` plugin that records a disaggregated request's destination once its
    prompt's KV has landed there (``PromptLanded``), for another worker's picks too."""

    def record_peer_landing(self, landing: str) -> None:
        """Another worker's disaggregated request (its :attr:`PeerPick.landing`) has landed
        at its destination."""
        ...


@runtime_checkable
class SharesState(Protocol):
    """A plugin whose learned state a worker started again copies from another worker.

    A worker that restarts would otherwise begin with nothing of what the picks before it
    taught (``SharesPicks`` only carries picks made while it runs).
    """

    def export_state(self, addresses: Mapping[int, str]) -> dict[str, list[int]]:
        """What this plugin learned, by endpoint address (``addresses``: endpoint id ->
        address), each list oldest first."""
        ...

    def import_state(self, state: Mapping[str, Sequence[int]], ids: Mapping[str, int]) -> int:
        """Learn another worker's exported state (``ids``: address -> endpoint id, endpoints
        this worker does not know skipped); returns the keys learned."""
        ...


@runtime_checkable
class ResponseHeaders(Protocol):
    def response_headers(self, request: LLMRequest, endpoint: Endpoint) -> list[tuple[str, str]]:
        """Headers to add to the response of ``request`` served by ``endpoint``."""
        ...


@runtime_checkable
class RequiresProfiles(Protocol):
    def required_profiles(self) -> tuple[str, ...]:
        """Scheduling profiles that must exist for this plugin to work (checked at load)."""
        ...


@runtime_checkable
class ReadsPlugins(Protocol):
    def bind_plugins(self, plugins: Mapping[str, object]) -> None:
        """Called once every plugin of the config is built, with all of them by name: keep
        the ones this plugin reads (``prefix-cache-affinity-filter`` reads the prefix match
        of a prefix scorer before the scorers run).

        Raises:
            ConfigError: a plugin it needs is missing or of the wrong type.
        """
        ...


@dataclass(frozen=True, slots=True)
class PluginGauge:
    """One value a plugin reports on ``/metrics``, labelled there with the plugin's name.

    Attributes:
        name: the metric's full name (``kv_picker_`` prefix).
        documentation: its help text.
        value: the current value.
    """

    name: str
    documentation: str
    value: float


@runtime_checkable
class CollectsMetrics(Protocol):
    def collect_metrics(self) -> Iterable[PluginGauge]:
        """Current values of the plugin's own gauges (called on every scrape of ``/metrics``)."""
        ...


# -- kind_of ----------------------------------------------------------------------------------

PluginKind = Literal["filter", "scorer", "filter-scorer", "picker", "profile-handler"]
FILTERING_KINDS: frozenset[PluginKind] = frozenset({"filter", "filter-scorer"})
"""The kinds a profile runs among its filters."""
SCORING_KINDS: frozenset[PluginKind] = frozenset({"scorer", "filter-scorer"})
"""The kinds a profile runs among its scorers: the ones a weight applies to."""

_KINDS: tuple[tuple[PluginKind, type], ...] = (
    ("filter", Filter),
    ("scorer", Scorer),
    ("picker", Picker),
    ("profile-handler", ProfileHandler),
)


def kind_of(cls: type) -> PluginKind:
    """The one kind a plugin class implements (``filter-scorer`` for a filter that scores).

    Raises:
        ConfigError: the class implements no kind, or more than one other than a filter and a
            scorer.
    """
    kinds = [kind for kind, protocol in _KINDS if issubclass(cls, protocol)]
    if len(kinds) == 1:
        return kinds[0]
    if kinds == ["filter", "scorer"]:
        return "filter-scorer"
    methods = ", ".join(f"{protocol.__name__}.{kind_method(kind)}()" for kind, protocol in _KINDS)
    if not kinds:
        raise ConfigError(f"plugin class {cls.__name__} implements no plugin kind ({methods})")
    raise ConfigError(f"plugin class {cls.__name__} implements several kinds: {', '.join(kinds)}")


def kind_method(kind: PluginKind) -> str:
    """The method that makes a class a plugin of ``kind``."""
    return {"filter": "filter", "scorer": "score", "picker": "pick"}.get(kind, "schedule")
