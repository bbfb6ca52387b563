"""llm-d's newer EndpointPickerConfig shapes, said in kv-picker's own terms before validation.

llm-d's endpoint picker split some plugins in two: the prefix match is computed by a *producer*
(``approx-prefix-cache-producer``) that ``prefix-cache-scorer`` reads, and P/D disaggregation is
a profile handler (``disagg-profile-handler``, or ``pd-profile-handler``) that asks a *decider*
plugin (``always-disagg-pd-decider``, ``prefix-based-pd-decider``) whether to disaggregate, with
a headers handler to set ``x-prefiller-host-port``. Its guides' configs also declare data-layer
and flow-control plugins that kv-picker's own sections cover. So that those configs load
unchanged, :func:`translate` rewrites a document's ``plugins`` before they are validated:

| llm-d | here |
|---|---|
| ``approx-prefix-cache-producer`` P | its parameters move to each ``prefix-cache-scorer`` reading P (``prefixMatchInfoProducerName``, or ``producer``; none named: the producer named ``approx-prefix-cache-producer``, if declared; none declared: the scorer keeps its own defaults, not the producer's); P is not built |
| ``disagg-profile-handler`` + decider | ``pd-profile-handler`` with the decider's rule: ``always-disagg-pd-decider`` -> ``always``, ``prefix-based-pd-decider`` -> ``nonCachedTokens`` and ``minPromptTokens`` (its ``promptTokens``), no decider -> never |
| ``pd-profile-handler`` + ``deciderPluginName`` | the same (no ``deciderPluginName`` and a declared ``prefix-based-pd-decider``: that one, as upstream) |
| ``pd-profile-handler``'s older ``threshold`` (characters) | ``always`` at 0, else ``nonCachedTokens`` = threshold / ``charsPerToken`` (rounded up) |
| ``prefix-cache-affinity-filter`` reading producer P | the prefix scorer that took P over; none: P becomes a ``prefix-cache-scorer`` named P in no profile (the filter asks it for the match, it records the picks); no P and no prefix scorer declared: one is added with P's defaults, as upstream creates its default producer |
| headers handlers, data layer, flow control, ``token-producer``, ``inflight-load-producer`` | not built; the picker sets the header and counts in-flight load itself, and its sections cover the rest (one warning each) |

What has no counterpart here is refused with the reason: an encode stage, ``stageOrder:
prefill-first``, ``primaryPort`` (data-parallel port rewriting), a ``precise-prefix-cache-producer``
(use ``precise-prefix-cache-scorer``), metrics scraped over anything but plain HTTP or from
another port. A malformed entry is left as it is for the validator to name.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from kv_picker.errors import ConfigError

APPROX_PRODUCER = "approx-prefix-cache-producer"
PRECISE_PRODUCER = "precise-prefix-cache-producer"
DECIDERS = ("always-disagg-pd-decider", "prefix-based-pd-decider")
DEFAULT_DECIDER = "prefix-based-pd-decider"

# Plugin types whose work kv-picker does itself, from its own sections: not built.
NOT_BUILT: dict[str, str] = {
    "disagg-headers-handler": "pd-profile-handler sets x-prefiller-host-port itself",
    "prefill-header-handler": "pd-profile-handler sets x-prefiller-host-port itself",
    "metrics-data-source": "the picker scrapes every endpoint itself (the metrics section)",
    "core-metrics-extractor": "the picker reads vLLM's metric names itself",
    "endpoint-notification-source": "the picker follows the endpoint set itself",
    "models-data-source": (
        "the picker reads each endpoint's loaded adapters from vllm:lora_requests_info and the "
        "pool's models from the models section"
    ),
    "model-server-protocol-models": (
        "the picker reads each endpoint's loaded adapters from vllm:lora_requests_info and the "
        "pool's models from the models section"
    ),
    "inflight-load-producer": (
        "the picker counts each endpoint's requests in flight and their uncached prompt tokens "
        "itself (prefix-cache-affinity-filter and token-load-scorer read them)"
    ),
    "token-producer": (
        "prefix-cache-scorer hashes the prompt's text; precise-prefix-cache-scorer takes "
        "a tokenizer"
    ),
    "round-robin-fairness-policy": "flow control is the admission section here",
    "global-strict-fairness-policy": "flow control is the admission section here",
    "fcfs-ordering-policy": "flow control is the admission section here",
    "concurrency-detector": "saturation is the admission section here",
    "utilization-detector": "saturation is the admission section here",
}

# approx-prefix-cache-producer's parameters that have a counterpart on prefix-cache-scorer.
_PRODUCER_KEYS = frozenset(
    {
        "autoTune",
        "blockSize",
        "blockSizeTokens",
        "maxPrefixBlocksToMatch",
        "maxPrefixTokensToMatch",
        "lruCapacityPerServer",
    }
)
_PRODUCER_BLOCK_TOKENS = 16  # its blockSizeTokens default
_PRODUCER_MAX_TOKENS = 131072  # its maxPrefixTokensToMatch default
_CHARS_PER_TOKEN = 4


def translate(document: Any) -> tuple[Any, list[str]]:
    """The document with llm-d's newer plugin shapes rewritten (see the module docstring), and
    a note for each plugin not built. Raises ConfigError for what has no counterpart."""
    if not isinstance(document, Mapping):
        return document, []
    plugins = document.get("plugins")
    if not isinstance(plugins, list) or not all(isinstance(p, Mapping) for p in plugins):
        return document, []
    entries = [dict(p) for p in plugins]
    by_name = {_name(p): (i, p) for i, p in enumerate(entries)}
    notes: list[str] = []
    dropped: set[int] = set()
    document = dict(document)

    for i, entry in enumerate(entries):
        kind = entry.get("type")
        where = f"plugins[{i}] ({_name(entry)})"
        if kind == "metrics-data-source":
            document = _metrics_source(document, _params(entry, where), where)
        if kind in NOT_BUILT:
            dropped.add(i)
            notes.append(f"{where}: {kind} is accepted and not built: {NOT_BUILT[kind]}")
        elif kind == PRECISE_PRODUCER:
            raise ConfigError(
                f"{where}: {PRECISE_PRODUCER} is not supported; use precise-prefix-cache-scorer "
                "(with its tokenizer) and the kvEvents section"
            )

    read_by: dict[int, str] = {}  # producer index -> the prefix scorer that took it over
    for i, entry in enumerate(entries):
        if entry.get("type") == "prefix-cache-scorer":
            for producer_index in _read_producer(entry, by_name, i):
                dropped.add(producer_index)
                read_by.setdefault(producer_index, _name(entry))
        elif entry.get("type") in ("disagg-profile-handler", "pd-profile-handler"):
            dropped |= _pd_handler(entry, by_name, i)
    added = _affinity_producers(entries, by_name, dropped, read_by)
    # Producers and deciders nobody reads are not built either (upstream they would run for
    # nothing).
    for i, entry in enumerate(entries):
        if entry.get("type") in (APPROX_PRODUCER, *DECIDERS) and i not in dropped:
            dropped.add(i)
            notes.append(
                f"plugins[{i}] ({_name(entry)}): {entry['type']} is read by no plugin; not built"
            )
    kept = [p for i, p in enumerate(entries) if i not in dropped]
    if added and document.get("schedulingProfiles") is None:
        # Without profiles every declared plugin would join the default one: the scorers
        # made to hold the filters' match must not score.
        refs = [
            {"pluginRef": _name(p)}
            for p in kept
            if _name(p) not in added and p.get("type") not in _HANDLERS
        ]
        document["schedulingProfiles"] = [{"name": "default", "plugins": refs}]
    document["plugins"] = kept
    return document, notes


_HANDLERS = ("single-profile-handler", "pd-profile-handler", "disagg-profile-handler")


def _affinity_producers(
    entries: list[dict[str, Any]],
    by_name: Mapping[str, tuple[int, dict[str, Any]]],
    dropped: set[int],
    read_by: Mapping[int, str],
) -> set[str]:
    """Give each ``prefix-cache-affinity-filter`` the prefix scorer whose match it reads.

    Its producer (``prefixMatchInfoProducerName``, else ``approx-prefix-cache-producer``)
    when a prefix scorer took it over: that scorer. When none did: the producer becomes a
    ``prefix-cache-scorer`` of its name, which the filter asks for the match and which records
    the picks, in no profile. No producer and no prefix scorer declared: one is added with the
    producer's defaults, as upstream creates its default producer. Returns the names of the
    scorers made so."""
    made: set[str] = set()
    prefix_types = ("prefix-cache-scorer", "precise-prefix-cache-scorer")
    for i, entry in enumerate(entries):
        if entry.get("type") != "prefix-cache-affinity-filter":
            continue
        where = f"plugins[{i}] ({_name(entry)})"
        params = _params(entry, where)
        named = params.get("prefixMatchInfoProducerName") or APPROX_PRODUCER
        found = by_name.get(named)
        if found is None:
            declared = any(e.get("type") in prefix_types for e in entries) or made
            if named != APPROX_PRODUCER or declared:
                continue  # bound at build: a missing name is refused there, with the reason
            entries.append(
                {
                    "type": "prefix-cache-scorer",
                    "name": APPROX_PRODUCER,
                    "parameters": _producer_params({}, where),
                }
            )
            made.add(APPROX_PRODUCER)
            continue
        index, producer = found
        if producer.get("type") != APPROX_PRODUCER:
            continue  # a prefix scorer, bound by name; anything else is refused at build
        if index in read_by:
            params["prefixMatchInfoProducerName"] = read_by[index]
            entry["parameters"] = params
        else:  # read by no prefix scorer: it becomes one
            producer_where = f"plugins[{index}] ({named})"
            producer["parameters"] = _producer_params(
                _params(producer, producer_where), producer_where
            )
            producer["type"] = "prefix-cache-scorer"
            producer["name"] = named
            dropped.discard(index)
            made.add(named)
    return made


def _name(entry: Mapping[str, Any]) -> str:
    return str(entry.get("name") or entry.get("type"))


def _params(entry: Mapping[str, Any], where: str) -> dict[str, Any]:
    params = entry.get("parameters")
    if params is None:
        return {}
    if not isinstance(params, Mapping):
        raise ConfigError(f"{where}.parameters: expected a mapping")
    return dict(params)


def _metrics_source(document: dict[str, Any], params: dict[str, Any], where: str) -> dict[str, Any]:
    scheme = params.get("scheme", "http")
    if scheme != "http":
        raise ConfigError(
            f"{where}.parameters.scheme: {scheme!r} is not supported: the picker scrapes the "
            "endpoints' metrics over plain HTTP"
        )
    if params.get("port"):
        raise ConfigError(
            f"{where}.parameters.port: not supported: the picker scrapes each endpoint's "
            "metrics on its serving port"
        )
    path = params.get("path")
    metrics = document.get("metrics")
    if path is not None and not (isinstance(metrics, Mapping) and "path" in metrics):
        document["metrics"] = {**(metrics if isinstance(metrics, Mapping) else {}), "path": path}
    return document


def _read_producer(
    entry: dict[str, Any], by_name: Mapping[str, tuple[int, dict[str, Any]]], index: int
) -> set[int]:
    """Move the parameters of the producer ``entry`` reads onto it; the producer's index."""
    where = f"plugins[{index}] ({_name(entry)})"
    params = _params(entry, where)
    older = params.pop("producer", None)  # the older spelling
    named = params.pop("prefixMatchInfoProducerName", None) or older
    params = _hashing_params(params, where)  # the older scorer, which hashed by itself
    producer_name = named or APPROX_PRODUCER
    found = by_name.get(producer_name)
    if found is None:
        if named and named != APPROX_PRODUCER:
            raise ConfigError(
                f"{where}.parameters.prefixMatchInfoProducerName: no plugin named {named!r}"
            )
        # Upstream creates the default producer; here the scorer keeps its own defaults.
        if "parameters" in entry:
            entry["parameters"] = params
        return set()
    producer_index, producer = found  # a precise producer was refused by translate already
    if producer.get("type") != APPROX_PRODUCER:
        raise ConfigError(
            f"{where}.parameters.prefixMatchInfoProducerName: {producer_name!r} is a "
            f"{producer.get('type')}, not an {APPROX_PRODUCER}"
        )
    producer_where = f"plugins[{producer_index}] ({producer_name})"
    params = {**_producer_params(_params(producer, producer_where), producer_where), **params}
    entry["parameters"] = params
    return {producer_index}


def _producer_params(params: dict[str, Any], where: str) -> dict[str, Any]:
    unknown = sorted(set(params) - _PRODUCER_KEYS)
    if unknown:
        raise ConfigError(f"{where}.parameters: unknown field(s) {', '.join(unknown)}")
    if "maxPrefixTokensToMatch" not in params and "maxPrefixBlocksToMatch" not in params:
        params = {**params, "maxPrefixTokensToMatch": _PRODUCER_MAX_TOKENS}
    return _hashing_params(params, where)


def _hashing_params(params: dict[str, Any], where: str) -> dict[str, Any]:
    """The hashing parameters of a producer, or of an older prefix-cache-scorer, in
    prefix-cache-scorer's terms (blocks of characters); other keys are kept as they are."""
    translated = {k: v for k, v in params.items() if k not in _PRODUCER_KEYS}
    tokens = params.get("blockSizeTokens")
    if tokens is None and "blockSize" in params:  # the older spelling, in characters
        translated["blockSizeChars"] = params["blockSize"]
        tokens = _as_number(params["blockSize"], f"{where}.parameters.blockSize") / 4
    elif tokens is not None:
        tokens = _as_number(tokens, f"{where}.parameters.blockSizeTokens")
        translated["blockSizeChars"] = int(tokens * _CHARS_PER_TOKEN)
    block_tokens = tokens or _PRODUCER_BLOCK_TOKENS
    most_tokens = params.get("maxPrefixTokensToMatch")
    if most_tokens:
        most = _as_number(most_tokens, f"{where}.parameters.maxPrefixTokensToMatch")
        translated["maxPrefixBlocksToMatch"] = math.ceil(most / block_tokens)
    elif "maxPrefixBlocksToMatch" in params:
        translated["maxPrefixBlocksToMatch"] = params["maxPrefixBlocksToMatch"]
    elif most_tokens is not None:
        translated["maxPrefixBlocksToMatch"] = 0  # both 0: the whole prompt
    if "lruCapacityPerServer" in params:
        translated["lruCapacityPerServer"] = params["lruCapacityPerServer"]
    return translated


def _as_number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
        raise ConfigError(f"{where}: expected a positive number, got {value!r}")
    return float(value)


def _pd_handler(
    entry: dict[str, Any], by_name: Mapping[str, tuple[int, dict[str, Any]]], index: int
) -> set[int]:
    """Rewrite a disaggregation handler as pd-profile-handler; the decider's index read."""
    where = f"plugins[{index}] ({_name(entry)})"
    params = _params(entry, where)
    kind = entry["type"]
    decider: str | None = None
    if kind == "disagg-profile-handler":
        params, decider = _disagg_params(params, where)
    else:
        if params.pop("primaryPort", 0):
            raise ConfigError(
                f"{where}.parameters.primaryPort: data-parallel port rewriting is not supported"
            )
        for unused in ("prefixMatchInfoProducerName", "prefixPluginType", "prefixPluginName"):
            params.pop(unused, None)
        params.pop("hashBlockSize", None)  # the older estimate's block size: not needed here
        decider = params.pop("deciderPluginName", None)
        if "threshold" in params:
            threshold = params.pop("threshold")
            if threshold == 0:
                params["always"] = True
            else:
                chars = _as_number(threshold, f"{where}.parameters.threshold")
                per_token = params.get("charsPerToken", _CHARS_PER_TOKEN)
                params["nonCachedTokens"] = math.ceil(chars / per_token)
        elif decider is None and "nonCachedTokens" not in params and "always" not in params:
            # Upstream's default decider, when the config declares it.
            found = by_name.get(DEFAULT_DECIDER)
            if found is not None and found[1].get("type") == DEFAULT_DECIDER:
                decider = DEFAULT_DECIDER
    entry["name"] = _name(entry)  # keeps its own name (upstream: the type when none given)
    entry["type"] = "pd-profile-handler"
    read: set[int] = set()
    if decider:
        found = by_name.get(decider)
        if found is None or found[1].get("type") not in DECIDERS:
            raise ConfigError(
                f"{where}: decider {decider!r} is not declared as one of {', '.join(DECIDERS)}"
            )
        decider_index, decider_entry = found
        decider_where = f"plugins[{decider_index}] ({decider})"
        rule = _params(decider_entry, decider_where)
        if decider_entry["type"] == "always-disagg-pd-decider":
            if rule:
                raise ConfigError(f"{decider_where}.parameters: always-disagg-pd-decider has none")
            params["always"] = True
        else:
            unknown = sorted(set(rule) - {"nonCachedTokens", "promptTokens"})
            if unknown:
                raise ConfigError(
                    f"{decider_where}.parameters: unknown field(s) {', '.join(unknown)}"
                )
            params["nonCachedTokens"] = rule.get("nonCachedTokens", 0)
            if "promptTokens" in rule:
                params["minPromptTokens"] = rule["promptTokens"]
        read.add(decider_index)
    entry["parameters"] = params
    return read


def _disagg_params(params: dict[str, Any], where: str) -> tuple[dict[str, Any], str | None]:
    """disagg-profile-handler's nested or flat parameters -> pd-profile-handler's, and the
    prefill decider's name."""
    flat = {
        "decodeProfile",
        "prefillProfile",
        "encodeProfile",
        "prefillDeciderPluginName",
        "encodeDeciderPluginName",
        "deciderPluginName",
    }
    nested = {"profiles", "deciders", "stageOrder"}
    unknown = sorted(set(params) - flat - nested)
    if unknown:
        raise ConfigError(f"{where}.parameters: unknown field(s) {', '.join(unknown)}")
    if set(params) & flat and set(params) & nested:
        raise ConfigError(
            f"{where}.parameters: the nested (profiles, deciders) and the flat parameters "
            "cannot be mixed"
        )
    profiles = params.get("profiles") or {}
    deciders = params.get("deciders") or {}
    if not isinstance(profiles, Mapping) or not isinstance(deciders, Mapping):
        raise ConfigError(f"{where}.parameters: profiles and deciders are mappings")
    if params.get("stageOrder", "decode-first") != "decode-first":
        raise ConfigError(f"{where}.parameters.stageOrder: only decode-first is supported")
    if deciders.get("encode") or params.get("encodeDeciderPluginName"):
        raise ConfigError(f"{where}.parameters: an encode stage is not supported")
    translated = {
        "decodeProfile": profiles.get("decode") or params.get("decodeProfile") or "decode",
        "prefillProfile": profiles.get("prefill") or params.get("prefillProfile") or "prefill",
    }
    decider = (
        deciders.get("prefill")
        or params.get("prefillDeciderPluginName")
        or params.get("deciderPluginName")
    )
    return translated, decider
