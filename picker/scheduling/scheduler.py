"""The scheduler: builds plugins from a validated config and runs profiles.

```
request, candidates
   │ profile handler decides which profiles run (single, P/D, ...)
   ▼
 profile: filters ──> scorers (clamp [0,1] × weight, summed) ──> picker ──> ProfileResult
   │
   ▼
 post-pick hooks (e.g. record blocks sent, for the approximate prefix index)
```

Everything here is synchronous: there is no ``await`` between a parsed request and its pick.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kv_picker.config import PickerConfig
from kv_picker.errors import ConfigError, SaturatedError
from kv_picker.metrics import PickerMetrics
from kv_picker.scheduling.context import BuildContext
from kv_picker.scheduling.framework import (
    FILTERING_KINDS,
    SCORING_KINDS,
    CollectsMetrics,
    Endpoint,
    LLMRequest,
    PeerPick,
    PluginGauge,
    PostPick,
    Prepare,
    ProfileHandler,
    ProfileResult,
    PromptLanded,
    ReadsPlugins,
    RequiresProfiles,
    ResponseHeaders,
    SchedulingResult,
    SharesLandings,
    SharesPicks,
    SharesState,
)
from kv_picker.scheduling.registry import Registry

_perf = time.perf_counter


@dataclass(slots=True)
class _Step:
    plugin: Any
    weight: float
    type_name: str


class Profile:
    """Filters, weighted scorers and one picker, run in that order."""

    def __init__(
        self,
        name: str,
        filters: Sequence[_Step],
        scorers: Sequence[_Step],
        picker: _Step,
        metrics: PickerMetrics | None,
    ) -> None:
        self.name = name
        self.filters = list(filters)
        self.scorers = list(scorers)
        self.picker = picker
        self._timers: dict[str, Any] = {}
        if metrics is not None:
            for step in (*self.filters, *self.scorers, picker):
                self._timers[step.plugin.name] = metrics.plugin_seconds.labels(
                    name, step.plugin.name, step.type_name
                )

    def run(
        self, request: LLMRequest, candidates: list[Endpoint], explain: bool = False
    ) -> ProfileResult:
        timers = self._timers
        for step in self.filters:
            start = _perf()
            candidates = step.plugin.filter(request, candidates)
            if timers:
                timers[step.plugin.name].observe(_perf() - start)
            if not candidates:
                raise SaturatedError(
                    f"no endpoints available for the request: filter {step.plugin.name!r} "
                    f"of profile {self.name!r} removed every candidate"
                )
        count = len(candidates)
        totals = [0.0] * count
        scores = [0.0] * count
        breakdown: dict[str, list[float]] | None = {} if explain else None
        for step in self.scorers:
            start = _perf()
            step.plugin.score(request, candidates, scores)
            weight = step.weight
            for i in range(count):
                score = scores[i]
                if score > 1.0:
                    score = 1.0
                elif not score > 0.0:  # also maps NaN to 0
                    score = 0.0
                totals[i] += score * weight
                if breakdown is None:
                    scores[i] = 0.0
                else:
                    scores[i] = score
            if breakdown is not None:
                breakdown[step.plugin.name] = scores
                scores = [0.0] * count
            if timers:
                timers[step.plugin.name].observe(_perf() - start)
        start = _perf()
        targets = self.picker.plugin.pick(request, candidates, totals)
        if timers:
            timers[self.picker.plugin.name].observe(_perf() - start)
        return ProfileResult(targets, candidates, totals, breakdown)


class Scheduler:
    """Plugins built from one config; swapped as a whole on reload.

    Attributes:
        plugins: every built plugin by name.
        shared_keys: the shared resources this build uses (the rest are released when it is
            adopted; see :mod:`kv_picker.scheduling.context`).
    """

    def __init__(
        self,
        config: PickerConfig,
        registry: Registry,
        ctx: BuildContext,
        metrics: PickerMetrics | None = None,
    ) -> None:
        self.config = config
        self._metrics = metrics
        ctx = ctx.for_build()
        plugins: dict[str, Any] = {}
        types: dict[str, str] = {}
        for plugin_config in config.plugins:
            plugins[plugin_config.name] = registry.build(
                plugin_config.type, plugin_config.name, plugin_config.params, ctx
            )
            types[plugin_config.name] = plugin_config.type

        def implicit(type_name: str) -> Any:
            # A step the config left implicit (max-score-picker, single-profile-handler).
            if type_name not in plugins:
                params = registry.parse_params(type_name, None, type_name)
                plugins[type_name] = registry.build(type_name, type_name, params, ctx)
                types[type_name] = type_name
            return plugins[type_name]

        self.profiles: dict[str, Profile] = {}
        for profile_config in config.profiles:
            filters: list[_Step] = []
            scorers: list[_Step] = []
            picker: _Step | None = None
            for entry in profile_config.entries:
                plugin = plugins.get(entry.plugin_ref) or implicit(entry.plugin_ref)
                type_name = types[entry.plugin_ref]
                step = _Step(plugin, entry.weight, type_name)
                kind = registry.kind(type_name)
                if kind == "picker":
                    picker = step
                elif kind in FILTERING_KINDS or kind in SCORING_KINDS:
                    if kind in FILTERING_KINDS:
                        filters.append(step)
                    if kind in SCORING_KINDS:
                        scorers.append(step)
                else:  # parse_config refuses it; keep the invariant explicit
                    raise ConfigError(f"{entry.plugin_ref!r} is a {kind}, not a profile step")
            if picker is None:  # parse_config guarantees one; keep the invariant explicit
                raise ConfigError(f"profile {profile_config.name!r} has no picker")
            self.profiles[profile_config.name] = Profile(
                profile_config.name, filters, scorers, picker, metrics
            )
        handler = plugins[config.handler] if config.handler else implicit("single-profile-handler")
        if not isinstance(handler, ProfileHandler):
            raise ConfigError(f"plugin {config.handler!r} is not a profile handler")
        self.handler: ProfileHandler = handler
        for plugin_name, plugin in plugins.items():
            if isinstance(plugin, RequiresProfiles):
                missing = [p for p in plugin.required_profiles() if p not in self.profiles]
                if missing:
                    raise ConfigError(
                        f"plugin {plugin_name!r}: needs scheduling profile(s) "
                        f"{', '.join(missing)}; defined: {', '.join(self.profiles)}"
                    )
        for plugin in plugins.values():
            if isinstance(plugin, ReadsPlugins):
                plugin.bind_plugins(plugins)
        self._profile_names = tuple(self.profiles)
        self._post_pick = [p for p in plugins.values() if isinstance(p, PostPick)]
        self._landed = [p for p in plugins.values() if isinstance(p, PromptLanded)]
        self.preparers: list[Prepare] = [p for p in plugins.values() if isinstance(p, Prepare)]
        self._response_header_plugins = [
            p for p in plugins.values() if isinstance(p, ResponseHeaders)
        ]
        self._metric_plugins: list[tuple[str, CollectsMetrics]] = [
            (name, p) for name, p in plugins.items() if isinstance(p, CollectsMetrics)
        ]
        self._sharing: list[tuple[str, SharesPicks]] = [
            (name, p) for name, p in plugins.items() if isinstance(p, SharesPicks)
        ]
        self._sharing_by_name = dict(self._sharing)
        self._peer_landed = [p for _, p in self._sharing if isinstance(p, SharesLandings)]
        self._stateful = {n: p for n, p in plugins.items() if isinstance(p, SharesState)}
        self.plugins = plugins
        self.shared_keys = ctx.used_shared

    def shared_picks(self, request: LLMRequest) -> list[tuple[str, Sequence[int]]]:
        """(plugin name, keys) of the pick records other worker processes must learn."""
        shared: list[tuple[str, Sequence[int]]] = []
        for name, plugin in self._sharing:
            keys = plugin.pick_keys(request)
            if keys:
                shared.append((name, keys))
        return shared

    def export_states(self, addresses: Mapping[int, str]) -> dict[str, dict[str, list[int]]]:
        """Every ``SharesState`` plugin's state, by plugin name (for a worker started again)."""
        return {name: plugin.export_state(addresses) for name, plugin in self._stateful.items()}

    def import_states(
        self, states: Mapping[str, Mapping[str, Sequence[int]]], ids: Mapping[str, int]
    ) -> int:
        """Learn another worker's :meth:`export_states` (plugins this build lacks skipped);
        returns the keys learned."""
        learned = 0
        for name, state in states.items():
            plugin = self._stateful.get(name)
            if plugin is not None:
                learned += plugin.import_state(state, ids)
        return learned

    def record_peer_picks(
        self, records: Sequence[tuple[str, Sequence[int]]], pick: PeerPick
    ) -> None:
        """Record another worker's pick: each named plugin's keys, sent to its endpoints.

        A name this build does not know, or a plugin that shares nothing, is skipped (workers
        may be a config reload apart)."""
        sharing = self._sharing_by_name
        for name, keys in records:
            plugin = sharing.get(name)
            if plugin is not None:
                plugin.record_peer_pick(pick, keys)

    def peer_prompt_landed(self, landing: str) -> None:
        """Another worker's disaggregated request has landed at its destination (the
        :attr:`~kv_picker.scheduling.framework.PeerPick.landing` of its pick)."""
        for plugin in self._peer_landed:
            plugin.record_peer_landing(landing)

    def prompt_landed(self, request: LLMRequest, result: SchedulingResult) -> None:
        """A disaggregated request's prompt has reached its destination (see
        :class:`~kv_picker.scheduling.framework.PromptLanded`)."""
        for plugin in self._landed:
            plugin.on_prompt_landed(request, result)

    def response_headers(self, request: LLMRequest, endpoint: Endpoint) -> list[tuple[str, str]]:
        """Headers plugins add to the response (e.g. a session token naming ``endpoint``)."""
        headers: list[tuple[str, str]] = []
        for plugin in self._response_header_plugins:
            headers.extend(plugin.response_headers(request, endpoint))
        return headers

    def plugin_gauges(self) -> list[tuple[str, PluginGauge]]:
        """(plugin name, gauge) for every gauge the plugins report."""
        return [
            (name, gauge)
            for name, plugin in self._metric_plugins
            for gauge in plugin.collect_metrics()
        ]

    def schedule(
        self,
        request: LLMRequest,
        candidates: list[Endpoint],
        explain: bool = False,
        record: bool = True,
    ) -> SchedulingResult:
        """Pick endpoints for a request.

        Args:
            request: the parsed request.
            candidates: endpoints that may serve it.
            explain: keep every scorer's clamped scores in the result.
            record: run the post-pick hooks (e.g. the approximate index records the blocks
                sent); False for a dry run.

        Raises:
            SaturatedError: every candidate was filtered out.
        """
        start = _perf()
        profiles = self.profiles

        def run_profile(
            profile_name: str, request: LLMRequest, candidates: list[Endpoint]
        ) -> ProfileResult:
            return profiles[profile_name].run(request, candidates, explain)

        result = self.handler.schedule(request, candidates, self._profile_names, run_profile)
        if record:
            for hook in self._post_pick:
                hook.on_pick(request, result)
        if self._metrics is not None:
            self._metrics.scheduling_seconds.observe(_perf() - start)
        return result
