"""Routing policies of the benchmark: the baselines, as scheduling plugins and configs.

Why plugins: every policy of a comparison has to run through the same scheduling code and the
same config format as the service, so a baseline that the service's scorers cannot express
(round robin, SGLang's cache-aware router, Dynamo's cost function) is written here as a
plugin with the service's contracts (Picker, PostPick) and registered next to
the built-ins in the harness's registry only. Each named policy is then an
EndpointPickerConfig document:

| policy | config | where the rule comes from |
|---|---|---|
| `random` | `random-picker` | uniform |
| `round-robin` | `round-robin-picker` | strict rotation over the ready endpoints |
| `least-queue` | `queue-scorer` + `max-score-picker` | fewest scraped waiting requests, ties random |
| `gie-default` | approximate `prefix-cache-scorer` 3 (a P/D destination recorded at the pick, as upstream), `queue-scorer` 2, `kv-cache-utilization-scorer` 2 | the Gateway API Inference Extension's default profile |
| `sglang-cache-aware` | `sglang-cache-aware-picker` | sgl-router's `cache_aware` policy (reference/vllm-kv.md §6.2, peers.md §2.1) |
| `dynamo-cost` | `dynamo-cost-picker` | Dynamo's KV router cost function (reference/vllm-kv.md §6.1) |
| `kv-picker` | the built-in default (no plugins given) | kv-picker's own profile |
| `llm-d-default` | approximate `prefix-cache-scorer` 3, `queue-scorer` 2, `kv-cache-utilization-scorer` 2, `no-hit-lru-scorer` 2 | llm-d's "optimized baseline" profile (named, not one of `baselines`: the stored matrices ran without it) |
| `llm-d-affinity` | `prefix-cache-affinity-filter` + `token-load-scorer` over the approximate producer's match, every parameter at its default | llm-d's later "optimized baseline" (named, not one of `baselines`, as `llm-d-default`) |

Plugins (harness registry only):

- ``round-robin-picker``: ``candidates[n % len(candidates)]`` for the n-th pick.
- ``sglang-cache-aware-picker`` (parameters ``cacheThreshold`` 0.3, ``balanceAbsThreshold``
  64, ``balanceRelThreshold`` 1.5, ``blockSizeChars`` 64, ``maxTreeSizeChars`` 2**26): loads
  are the router's own in-flight counts. If ``max - min > abs and max > rel * min``, the least
  loaded endpoint (first on ties, as sgl-router's code does). Else the longest prefix match of
  the prompt *text* among endpoints it was sent to; if ``matched_chars / prompt_chars >
  cacheThreshold``, that endpoint (least loaded among equal matches), else the least loaded.
  The text is recorded for the chosen endpoint after every pick. The radix tree is
  approximated by chained hashes of ``blockSizeChars``-character blocks (a match is counted in
  whole blocks); ``maxTreeSizeChars`` is the per-endpoint budget, evicted LRU.
- ``dynamo-cost-picker`` (``overlapScoreWeight`` 1.0, ``temperature`` 0.0, ``useKvEvents``
  true, ``approxCapacityBlocks`` 16384): for each endpoint ``w``, ``overlap_w`` = leading
  blocks of the request it holds (from KV events, or from its own past picks when
  ``useKvEvents`` is false), ``prefill_blocks_w = (pending prefill tokens routed to w +
  input_tokens - overlap_w * block_size) / block_size``, ``decode_blocks_w`` = blocks of the
  requests in flight on ``w`` plus this one's; cost ``= weight * prefill_blocks_w +
  decode_blocks_w``. Temperature 0 takes the cheapest (ties random); above 0 it samples
  ``p_w ∝ exp(-(cost_w / (max - min)) / T)``.

The Dynamo-style picker also follows the simulator's side inputs (KV events, first token,
finish: :class:`~kv_picker_bench.harness.simulator.KVEventSubscriber` and
:class:`~kv_picker_bench.harness.simulator.RequestObserver`), as Dynamo's router follows its
workers' events and its own response streams.

P/D runs wrap any policy with :func:`pd_variant`: the service's ``pd-profile-handler`` over a
``decode`` and a ``prefill`` profile, each with its own copy of the policy's plugins behind its
role filter. A harness plugin whose type the service's registry also has is left out (the
service's wins). Each copy of a harness picker books a request (its loads, its prefix record)
on the endpoint its own profile picked (:func:`placed_by`): the prefill copy on the prefill
endpoint, released at the first token, the decode copy on the destination. A policy file may
set ``pdParameters`` (a harness key, read here and not passed to the service): per side
(``decode``, ``prefill``) and plugin name, parameters that side's copy takes over the shared
ones, as a production P/D config sets each profile's plugins apart::

    pdParameters:
      decode:
        predicted-latency-scorer: {decodeMinPromptTokens: 8192}
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import yaml

from kv_picker.config import DEFAULT_PLUGINS, DEFAULT_PROFILE, PickerConfig, parse_config
from kv_picker.endpoint import Endpoint
from kv_picker.errors import ConfigError
from kv_picker.plugins import builtin_registry
from kv_picker.scheduling.context import BuildContext
from kv_picker.scheduling.framework import LLMRequest, SchedulingResult
from kv_picker.scheduling.registry import Registry
from kv_picker.scheduling.signals import PROMPT_TOKENS
from kv_picker.state.approx_index import ApproximatePrefixIndex
from kv_picker.state.hashing import chain_keys, chain_root
from kv_picker.state.prefix_runs import leading_runs, mask_of
from kv_picker_bench.harness.simulator import (
    BLOCK_KEYS_STATE,
    ClusterConfig,
    SimulationResult,
    run_policy,
)
from kv_picker_bench.harness.traces import Trace

# ------------------------------------------------------------------------------ plugins


def picked_key(name: str) -> str:
    """The request-state key under which the harness picker ``name`` keeps the endpoint it
    picked. A P/D policy runs a copy of the picker in each profile, on the same request, so
    each copy keeps its own pick."""
    return f"{name}.picked"


def placed_by(name: str, request: LLMRequest, result: SchedulingResult) -> tuple[int, bool] | None:
    """Where the picker ``name`` placed ``request``: the endpoint it picked, and whether that
    endpoint only prefills it (the P/D handler's prefill endpoint); None when its pick is not
    where the request went (its profile did not run, or the handler did not use it).

    Every copy of a picker sees every pick's whole result; each must book the request on the
    endpoint its own profile picked. Booked on the destination, a prefill copy's loads land
    on decode endpoints, never on the prefill endpoints it ranks, and it sees its own pool as
    idle whatever it sent there."""
    endpoint_id = request.state.get(picked_key(name))
    if endpoint_id is None:
        return None
    if endpoint_id == result.destination.id:
        return endpoint_id, False
    prefill = result.prefill_endpoint
    if prefill is not None and endpoint_id == prefill.id:
        return endpoint_id, True
    return None


@dataclass(frozen=True)
class RoundRobinParams:
    pass


class RoundRobinPicker:
    type_name: ClassVar[str] = "round-robin-picker"
    Params = RoundRobinParams

    def __init__(self, name: str, params: RoundRobinParams, ctx: BuildContext) -> None:
        self.name = name
        self._next = 0

    def pick(
        self, request: LLMRequest, candidates: Sequence[Endpoint], totals: Sequence[float]
    ) -> list[Endpoint]:
        index = self._next % len(candidates)
        self._next += 1
        return [candidates[index]]


@dataclass(frozen=True)
class SGLangCacheAwareParams:
    cacheThreshold: float = 0.3
    balanceAbsThreshold: int = 64
    balanceRelThreshold: float = 1.5
    blockSizeChars: int = 64
    maxTreeSizeChars: int = 2**26

    def validate(self) -> None:
        if not 0.0 <= self.cacheThreshold <= 1.0:
            raise ValueError("parameter 'cacheThreshold' must be in [0, 1]")
        if self.balanceAbsThreshold < 0 or self.balanceRelThreshold < 1.0:
            raise ValueError("balanceAbsThreshold must be >= 0 and balanceRelThreshold >= 1")
        if self.blockSizeChars < 1 or self.maxTreeSizeChars < self.blockSizeChars:
            raise ValueError("blockSizeChars must be >= 1 and maxTreeSizeChars >= blockSizeChars")


_SGLANG_KEYS = "sglang.keys"


class SGLangCacheAwarePicker:
    type_name: ClassVar[str] = "sglang-cache-aware-picker"
    Params = SGLangCacheAwareParams

    def __init__(self, name: str, params: SGLangCacheAwareParams, ctx: BuildContext) -> None:
        self.name = name
        self.params = params
        self._in_flight = ctx.store.in_flight
        self.index = ApproximatePrefixIndex(params.maxTreeSizeChars // params.blockSizeChars)
        ctx.store.on_removed(self.index.remove_endpoint)
        self._runs: list[int] = []
        self.cache_decisions = 0
        self.balance_decisions = 0

    def _keys(self, request: LLMRequest) -> list[int]:
        keys: list[int] | None = request.state.get(_SGLANG_KEYS)
        if keys is None:
            root = chain_root(request.target_model, request.lora_adapter, request.cache_salt)
            keys = chain_keys(request.prompt.text.encode(), root, self.params.blockSizeChars)
            request.state[_SGLANG_KEYS] = keys
        return keys

    def _least_loaded(self, candidates: Sequence[Endpoint]) -> Endpoint:
        in_flight = self._in_flight
        return min(candidates, key=lambda e: in_flight[e.id])  # first on ties

    def pick(
        self, request: LLMRequest, candidates: Sequence[Endpoint], totals: Sequence[float]
    ) -> list[Endpoint]:
        chosen = self._choose(request, candidates)
        request.state[picked_key(self.name)] = chosen.id
        return [chosen]

    def _choose(self, request: LLMRequest, candidates: Sequence[Endpoint]) -> Endpoint:
        params = self.params
        in_flight = self._in_flight
        loads = [in_flight[e.id] for e in candidates]
        high, low = max(loads), min(loads)
        if high - low > params.balanceAbsThreshold and high > low * params.balanceRelThreshold:
            self.balance_decisions += 1
            return self._least_loaded(candidates)
        keys = self._keys(request)
        runs = self._runs
        best = self.index.runs(keys, mask_of(candidates), runs) if keys else 0
        prompt_chars = len(request.prompt.text)
        if best and prompt_chars:
            match_rate = best * params.blockSizeChars / prompt_chars
            if match_rate > params.cacheThreshold:
                self.cache_decisions += 1
                matched = [e for e in candidates if runs[e.id] == best]
                return self._least_loaded(matched)
        self.balance_decisions += 1
        return self._least_loaded(candidates)

    def on_pick(self, request: LLMRequest, result: SchedulingResult) -> None:
        placed = placed_by(self.name, request, result)
        keys = self._keys(request)
        if placed is not None and keys:
            self.index.record(placed[0], keys)


class EventBlockIndex:
    """Which endpoints hold which blocks, from KV events (stored / removed)."""

    def __init__(self) -> None:
        self.holders: dict[int, int] = {}

    def stored(self, endpoint_id: int, keys: Sequence[int]) -> None:
        bit = 1 << endpoint_id
        holders = self.holders
        for key in keys:
            holders[key] = holders.get(key, 0) | bit

    def removed(self, endpoint_id: int, keys: Sequence[int]) -> None:
        keep = ~(1 << endpoint_id)
        holders = self.holders
        for key in keys:
            remaining = holders.get(key, 0) & keep
            if remaining:
                holders[key] = remaining
            else:
                holders.pop(key, None)

    def runs(self, keys: Sequence[int], candidate_mask: int, runs_out: list[int]) -> int:
        """Each candidate's leading run into ``runs_out`` (by endpoint id); returns the best."""
        return leading_runs(keys, candidate_mask, runs_out, self.holders)


@dataclass(frozen=True)
class DynamoCostParams:
    overlapScoreWeight: float = 1.0
    temperature: float = 0.0
    useKvEvents: bool = True
    blockSize: int = 16
    approxCapacityBlocks: int = 16384

    def validate(self) -> None:
        if self.overlapScoreWeight < 0 or self.temperature < 0:
            raise ValueError("overlapScoreWeight and temperature must be >= 0")
        if self.blockSize < 1 or self.approxCapacityBlocks < 1:
            raise ValueError("blockSize and approxCapacityBlocks must be >= 1")


@dataclass(slots=True)
class _Active:
    endpoint_id: int
    blocks: int
    prefill_tokens: int
    prefill_only: bool = False  # a P/D prefill endpoint's leg: it ends at the first token


class DynamoCostPicker:
    type_name: ClassVar[str] = "dynamo-cost-picker"
    Params = DynamoCostParams

    def __init__(self, name: str, params: DynamoCostParams, ctx: BuildContext) -> None:
        self.name = name
        self.params = params
        self._rng = ctx.rng
        self.events = EventBlockIndex() if params.useKvEvents else None
        self.approx = (
            None if params.useKvEvents else ApproximatePrefixIndex(params.approxCapacityBlocks)
        )
        self._runs: list[int] = []
        self._active_blocks: dict[int, int] = {}
        self._prefill_tokens: dict[int, int] = {}
        self._requests: dict[str, _Active] = {}
        self._new_tokens_key = f"{name}.new_tokens"

    # KV events (the simulator delivers them to subscribers)
    def on_blocks_stored(self, endpoint_id: int, block_keys: Sequence[int]) -> None:
        if self.events is not None:
            self.events.stored(endpoint_id, block_keys)

    def on_blocks_removed(self, endpoint_id: int, block_keys: Sequence[int]) -> None:
        if self.events is not None:
            self.events.removed(endpoint_id, block_keys)

    def _keys(self, request: LLMRequest) -> list[int]:
        keys: list[int] | None = request.state.get(BLOCK_KEYS_STATE)
        if keys is None:  # no tokens: stand in 4-character tokens of the prompt text
            root = chain_root(request.target_model, request.lora_adapter, request.cache_salt)
            keys = chain_keys(request.prompt.text.encode(), root, 4 * self.params.blockSize)
            request.state[BLOCK_KEYS_STATE] = keys
        return keys

    def _input_tokens(self, request: LLMRequest) -> int:
        tokens = request.state.get(PROMPT_TOKENS)
        return int(tokens) if tokens is not None else max(1, len(request.prompt.text) // 4)

    def pick(
        self, request: LLMRequest, candidates: Sequence[Endpoint], totals: Sequence[float]
    ) -> list[Endpoint]:
        params = self.params
        keys = self._keys(request)
        index = self.events if self.events is not None else self.approx
        assert index is not None  # one of the two, by useKvEvents
        runs = self._runs
        index.runs(keys, mask_of(candidates), runs)  # no keys: every run is 0
        block_size = params.blockSize
        input_tokens = self._input_tokens(request)
        request_blocks = -(-input_tokens // block_size)
        costs = []
        for endpoint in candidates:
            new_tokens = input_tokens - runs[endpoint.id] * block_size
            prefill_blocks = (self._prefill_tokens.get(endpoint.id, 0) + new_tokens) / block_size
            decode_blocks = self._active_blocks.get(endpoint.id, 0) + request_blocks
            costs.append(params.overlapScoreWeight * prefill_blocks + decode_blocks)
        high, low = max(costs), min(costs)
        if params.temperature > 0 and high > low:
            span = high - low
            weights = [math.exp(-(c - low) / span / params.temperature) for c in costs]
            point = self._rng.random() * sum(weights)
            for endpoint, weight in zip(candidates, weights, strict=True):
                point -= weight
                if point < 0:
                    chosen = endpoint
                    break
            else:
                chosen = candidates[-1]
        else:
            tied = [e for e, c in zip(candidates, costs, strict=True) if c == low]
            chosen = tied[0] if len(tied) == 1 else tied[self._rng.randrange(len(tied))]
        request.state[picked_key(self.name)] = chosen.id
        request.state[self._new_tokens_key] = input_tokens - runs[chosen.id] * block_size
        return [chosen]

    def on_pick(self, request: LLMRequest, result: SchedulingResult) -> None:
        placed = placed_by(self.name, request, result)
        if placed is None:
            return
        endpoint_id, prefill_only = placed
        blocks = -(-self._input_tokens(request) // self.params.blockSize)
        new_tokens = int(request.state.get(self._new_tokens_key, 0))
        self._requests[request.request_id] = _Active(endpoint_id, blocks, new_tokens, prefill_only)
        self._active_blocks[endpoint_id] = self._active_blocks.get(endpoint_id, 0) + blocks
        self._prefill_tokens[endpoint_id] = self._prefill_tokens.get(endpoint_id, 0) + new_tokens
        if self.approx is not None:
            self.approx.record(endpoint_id, self._keys(request))

    # request progress (the router sees the response stream)
    def on_first_token(self, request: LLMRequest, endpoint_id: int) -> None:
        active = self._requests.get(request.request_id)
        if active is None:
            return
        if active.prefill_tokens:
            self._prefill_tokens[active.endpoint_id] -= active.prefill_tokens
            active.prefill_tokens = 0
        if active.prefill_only:  # the prefill endpoint's part is over: it holds nothing more
            self._release(request)

    def on_finished(self, request: LLMRequest, endpoint_id: int) -> None:
        self._release(request)

    def _release(self, request: LLMRequest) -> None:
        active = self._requests.pop(request.request_id, None)
        if active is None:
            return
        self._active_blocks[active.endpoint_id] -= active.blocks
        if active.prefill_tokens:
            self._prefill_tokens[active.endpoint_id] -= active.prefill_tokens


HARNESS_PLUGINS = (RoundRobinPicker, SGLangCacheAwarePicker, DynamoCostPicker)


def harness_registry() -> Registry:
    """The service's registry plus the harness's baseline plugins (built-ins win on a clash)."""
    registry = builtin_registry()
    known = set(registry.known())
    for cls in HARNESS_PLUGINS:
        if cls.type_name not in known:
            registry.add(cls)
    return registry


# ----------------------------------------------------------------------------- policies


def _single(
    *steps: tuple[str, float | None], params: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    plugins: list[dict[str, Any]] = []
    refs: list[dict[str, Any]] = []
    for type_name, weight in steps:
        plugin: dict[str, Any] = {"type": type_name}
        if params and type_name in params:
            plugin["parameters"] = dict(params[type_name])
        plugins.append(plugin)
        refs.append(
            {"pluginRef": type_name}
            if weight is None
            else {"pluginRef": type_name, "weight": weight}
        )
    return {"plugins": plugins, "schedulingProfiles": [{"name": "default", "plugins": refs}]}


# Upstream's approximate prefix index records a P/D destination at the pick, before the
# prompt's KV has reached it; the baselines that stand for upstream's profiles keep that.
_AT_PICK = {"prefix-cache-scorer": {"recordDestinationAt": "pick"}}

BASELINES: dict[str, dict[str, Any]] = {
    "random": _single(("random-picker", None)),
    "round-robin": _single(("round-robin-picker", None)),
    "least-queue": _single(("queue-scorer", 1), ("max-score-picker", None)),
    "gie-default": _single(
        ("prefix-cache-scorer", 3),
        ("queue-scorer", 2),
        ("kv-cache-utilization-scorer", 2),
        ("max-score-picker", None),
        params=_AT_PICK,
    ),
    "sglang-cache-aware": _single(("sglang-cache-aware-picker", None)),
    "dynamo-cost": _single(("dynamo-cost-picker", None)),
    "kv-picker": {},
}
"""Named policies; ``kv-picker`` is the service's built-in default profile."""

DEFAULT_POLICIES = tuple(BASELINES)

NAMED_POLICIES: dict[str, dict[str, Any]] = {
    **BASELINES,
    "llm-d-default": _single(
        ("prefix-cache-scorer", 3),
        ("queue-scorer", 2),
        ("kv-cache-utilization-scorer", 2),
        ("no-hit-lru-scorer", 2),
        ("max-score-picker", None),
        params=_AT_PICK,
    ),
    # llm-d's later optimized baseline, in llm-d's own shape (translated on load: the
    # producer becomes the prefix scorer the filter reads, in no profile). Its
    # inflight-load-producer is left out: the picker counts in-flight load itself, and the
    # note that says so would repeat for every cell.
    "llm-d-affinity": {
        "plugins": [
            # Upstream's producer takes no recordDestinationAt: under P/D this one records a
            # destination once the prompt's KV has landed, as the picker's own scorer does.
            {"type": "approx-prefix-cache-producer"},
            {
                "type": "prefix-cache-affinity-filter",
                # Named (upstream's default), so that each P/D side reads its own copy.
                "parameters": {"prefixMatchInfoProducerName": "approx-prefix-cache-producer"},
            },
            {"type": "token-load-scorer"},
        ],
        "schedulingProfiles": [
            {
                "name": "default",
                "plugins": [
                    {"pluginRef": "prefix-cache-affinity-filter"},
                    {"pluginRef": "token-load-scorer"},
                ],
            }
        ],
    },
}
"""Every policy known by name: the baselines, and policies that ``baselines`` leaves out so that
the stored matrices, which ran without them, stay what their commands say."""

# Plugin types known not to read the prompt text: a policy made only of these skips building
# the (long) prompt string per request. Unknown types are assumed to read it.
_TEXT_FREE_TYPES = frozenset(
    {
        "random-picker",
        "max-score-picker",
        "weighted-random-picker",
        "round-robin-picker",
        "queue-scorer",
        "running-requests-size-scorer",
        "no-hit-lru-scorer",
        "kv-cache-utilization-scorer",
        "active-request-scorer",
        "dynamo-cost-picker",
        "single-profile-handler",
        "pd-profile-handler",
        "decode-filter",
        "prefill-filter",
        "by-label",
    }
)


@dataclass(frozen=True)
class Policy:
    """A named routing policy: an EndpointPickerConfig document.

    Attributes:
        name: Name in reports.
        document: The decoded config (plugins, schedulingProfiles, ...).
        source: ``baseline`` or the file it was read from.
        pd_parameters: Per P/D side (``decode``, ``prefill``) and plugin name, parameters that
            side's copy takes in :func:`pd_variant`; unused on aggregated clusters.
    """

    name: str
    document: Mapping[str, Any] = field(default_factory=dict)
    source: str = "baseline"
    pd_parameters: Mapping[str, Mapping[str, Mapping[str, Any]]] = field(default_factory=dict)

    def config(self, registry: Registry) -> PickerConfig:
        """Validate the document (as the service would).

        Raises:
            ConfigError: naming the policy, plugin and field.
        """
        try:
            return parse_config(dict(self.document), registry, source=f"policy {self.name}")
        except ConfigError as exc:
            message = str(exc)
            if message.startswith(f"policy {self.name}"):
                raise
            raise ConfigError(f"policy {self.name} ({self.source}): {message}") from exc

    @property
    def needs_prompt(self) -> bool:
        plugins = self.document.get("plugins")
        if plugins is None:
            return True
        return not all(
            isinstance(p, Mapping) and p.get("type") in _TEXT_FREE_TYPES for p in plugins
        )

    def replay(
        self,
        trace: Trace,
        cluster: ClusterConfig,
        seed: int = 0,
        progress: Callable[[int], None] | None = None,
    ) -> SimulationResult:
        """Run this policy over ``trace`` on the simulated ``cluster`` (the harness registry).

        Raises:
            ConfigError: If the policy's config is invalid.
        """
        registry = harness_registry()
        return run_policy(
            trace,
            cluster,
            self.config(registry),
            registry,
            self.name,
            seed=seed,
            progress=progress,
            needs_prompt=self.needs_prompt,
        )


def resolve_policy(item: str) -> Policy:
    """A policy from a baseline name, ``NAME=FILE.yaml`` or ``FILE.yaml``.

    Raises:
        ConfigError: unknown name, unreadable file or invalid YAML.
    """
    if item in NAMED_POLICIES:
        return Policy(item, NAMED_POLICIES[item])
    name, sep, path_text = item.partition("=")
    if not sep:
        path_text = item
        name = Path(item).stem
    path = Path(path_text)
    if not path.exists():
        raise ConfigError(
            f"policy {item!r}: not a named policy ({', '.join(NAMED_POLICIES)}) and no file "
            f"{path_text!r}"
        )
    try:
        document = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot read policy config: {exc}") from exc
    if not isinstance(document, Mapping):
        raise ConfigError(f"{path}: a policy config must be a mapping")
    document = dict(document)
    pd_parameters = _pd_parameters(document.pop(PD_PARAMETERS_KEY, {}), path)
    return Policy(name, document, str(path), pd_parameters)


PD_PARAMETERS_KEY = "pdParameters"
PD_SIDES = ("decode", "prefill")


def _pd_parameters(value: Any, path: Path) -> dict[str, dict[str, dict[str, Any]]]:
    """The ``pdParameters`` section: side -> plugin name -> parameters (shape checked here; the
    plugins and their parameters are checked when :func:`pd_variant` builds the config)."""
    where = f"{path}: {PD_PARAMETERS_KEY}"
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{where} must map a side ({', '.join(PD_SIDES)}) to plugins")
    sides: dict[str, dict[str, dict[str, Any]]] = {}
    for side, plugins in value.items():
        if side not in PD_SIDES:
            raise ConfigError(f"{where}: unknown side {side!r}; known: {', '.join(PD_SIDES)}")
        if not isinstance(plugins, Mapping):
            raise ConfigError(f"{where}.{side} must map plugin names to parameters")
        sides[side] = {}
        for plugin, parameters in plugins.items():
            if not isinstance(parameters, Mapping) or not parameters:
                raise ConfigError(
                    f"{where}.{side}.{plugin} must be a non-empty mapping of parameters"
                )
            sides[side][str(plugin)] = dict(parameters)
    return sides


def resolve_policies(items: Sequence[str]) -> list[Policy]:
    """Policies from CLI items; ``baselines`` (or nothing) means every named policy."""
    policies: list[Policy] = []
    for item in items or ["baselines"]:
        if item in ("baselines", "all"):
            policies.extend(Policy(name, BASELINES[name]) for name in DEFAULT_POLICIES)
        else:
            policies.append(resolve_policy(item))
    names = [p.name for p in policies]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError(f"policy names must be unique; repeated: {', '.join(duplicates)}")
    return policies


# Parameters that name another plugin of the policy (the one whose output a plugin reads).
_REFERENCE_PARAMETERS = ("prefixMatchInfoProducerName", "producer", "prefixPluginName")


def _side_references(parameters: Any, names: list[str], side: str) -> Any:
    """``parameters`` with each reference to one of the policy's plugins (``names``) turned to
    that plugin's copy on ``side``, so a side's plugins read their own side's."""
    if not isinstance(parameters, Mapping):
        return parameters
    return {
        key: f"{side}-{value}" if key in _REFERENCE_PARAMETERS and value in names else value
        for key, value in parameters.items()
    }


def pd_variant(policy: Policy, non_cached_tokens: int = 1) -> Policy:
    """The same policy for a P/D cluster, under the service's ``pd-profile-handler``.

    A ``decode`` and a ``prefill`` profile each get their own copy of the policy's plugins
    (``decode-<name>``, ``prefill-<name>``) behind their role filter, so stateful pickers keep
    separate state per side, as peer routers keep separate prefill and decode policies; a
    parameter naming another of its plugins (``prefixMatchInfoProducerName``, ``producer``,
    ``prefixPluginName``) names that plugin's copy on the same side. The
    handler disaggregates when at least ``non_cached_tokens`` prompt tokens are not cached on
    the chosen decode endpoint (as the decode profile's prefix scorer sees it). The policy's
    ``pd_parameters`` are laid over each side's copies.

    Raises:
        ConfigError: more than one profile, or ``pd_parameters`` naming a plugin the policy
            does not have.
    """
    document = dict(policy.document)
    plugins = [dict(p) for p in document.get("plugins", DEFAULT_PLUGINS)]
    names = [p.get("name") or p["type"] for p in plugins]
    for side, overrides in policy.pd_parameters.items():
        missing = sorted(set(overrides) - set(names))
        if missing:
            raise ConfigError(
                f"policy {policy.name}: {PD_PARAMETERS_KEY}.{side} names plugin(s) "
                f"{', '.join(missing)} the policy does not have; it has {', '.join(names)}"
            )
    profiles = document.get("schedulingProfiles")
    if profiles is None:
        profiles = [DEFAULT_PROFILE] if "plugins" not in document else None
    if profiles is None:
        refs = [{"pluginRef": p.get("name") or p["type"]} for p in plugins]
    else:
        if len(profiles) != 1:
            raise ConfigError(f"policy {policy.name}: a P/D variant needs exactly one profile")
        refs = [dict(r) for r in profiles[0]["plugins"]]
    copies: list[dict[str, Any]] = []
    profiles_out = []
    for side, role_filter in (("decode", "decode-filter"), ("prefill", "prefill-filter")):
        overrides = policy.pd_parameters.get(side, {})
        for plugin, name in zip(plugins, names, strict=True):
            copy = {**plugin, "name": f"{side}-{name}"}
            parameters = _side_references(plugin.get("parameters"), names, side)
            if parameters is not None:
                copy["parameters"] = parameters
            if name in overrides:
                copy["parameters"] = {**(copy.get("parameters") or {}), **overrides[name]}
            copies.append(copy)
        side_refs = [{**ref, "pluginRef": f"{side}-{ref['pluginRef']}"} for ref in refs]
        profiles_out.append({"name": side, "plugins": [{"pluginRef": role_filter}, *side_refs]})
    copies += [
        {"type": "decode-filter"},
        {"type": "prefill-filter"},
        {
            "type": "pd-profile-handler",
            "parameters": {"nonCachedTokens": max(1, non_cached_tokens)},
        },
    ]
    document["plugins"] = copies
    document["schedulingProfiles"] = profiles_out
    return Policy(policy.name, document, policy.source)
