"""Configuration: the external YAML schema -> a validated, frozen internal config.

The file follows the EndpointPickerConfig schema of the Gateway API Inference Extension and
llm-d (``plugins`` and ``schedulingProfiles``), so their configs port over, plus kv-picker's own
sections:

```yaml
apiVersion: kv-picker.io/v1alpha1        # or llm-d.ai/v1alpha1, inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
server: {grpcPort: 9002, metricsPort: 9090, host: 0.0.0.0, maxBodyBytes: 8388608,
         tls: {certPath: ..., keyPath: ...}}
endpoints:                               # static discovery
- address: 10.0.0.7:8000
  labels: {llm-d.ai/role: both}
models:                                  # optional: when set, other models get 404
- name: meta-llama/Llama-3.1-8B-Instruct
  loraAdapters: [sql-lora]
metrics: {scrapeInterval: 100ms, stalenessThreshold: 2s, timeout: 1s, path: /metrics}
kvEvents:                                # vLLM KV events, for prefix-cache-scorer mode: precise
  mode: connect                          # connect: one SUB socket per endpoint; bind: one SUB
  publisherPort: 5557                    #   socket the publishers connect to (kvEvents.bind)
  replayPort: 5558                       # optional: each endpoint's replay (ROUTER) socket
  endpoints: {10.0.0.7:8000: {publisher: tcp://10.0.0.7:5557, replay: tcp://10.0.0.7:5558}}
  topicFilter: ""                        # ZMQ prefix subscription; topics kv@<endpoint>@<model>
  model: ""                              # model of events whose topic names none
index: {backend: memory, blockSizeTokens: 16, keys: dual, maxBlocks: 4000000}
       # backend redis: url, keyPrefix, timeout; keys strict: hashAlgo, hashSeed (IndexConfig)
seed: 0                                  # random tie-breaks are repeatable
plugins: [{type: ..., name: ..., parameters: {...}}]
schedulingProfiles: [{name: default, plugins: [{pluginRef: ..., weight: 2}]}]
```

Loading is two-phase: :func:`parse_config` checks everything (schema, plugin types, strict
parameters, references) and returns a frozen :class:`PickerConfig`, naming the file, plugin and
field in every error; building plugins happens later and cannot fail on input.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from kv_picker.admission import AdmissionConfig
from kv_picker.errors import ConfigError
from kv_picker.scheduling.registry import Registry
from kv_picker.state.endpoints import EndpointSpec, split_address
from kv_picker.state.hardware import (
    BUILTIN_HARDWARE_CLASSES,
    DEFAULT_CLASS,
    HardwareClass,
    HardwareTable,
)

log = logging.getLogger(__name__)

API_VERSIONS = (
    "kv-picker.io/v1alpha1",
    "llm-d.ai/v1alpha1",
    "inference.networking.x-k8s.io/v1alpha1",
)
KIND = "EndpointPickerConfig"

# Sections of the upstream schema that this picker accepts and does not act on.
IGNORED_SECTIONS = (
    "featureGates",
    "dataLayer",
    "flowControl",
    "requestHandler",
    "saturationDetector",
    "parser",
)
_OWN_SECTIONS = (
    "apiVersion",
    "kind",
    "server",
    "endpoints",
    "models",
    "metrics",
    "seed",
    "plugins",
    "schedulingProfiles",
    "admission",
    "objectives",
    "hardware",
    "kvEvents",
    "index",
)

# The built-in default: the GIE default's scorers (prefix, queue, kv-utilization) plus the
# picker's own in-flight count, with prefix 3 and each load signal 1. Scraped queue depth lags by
# a scrape interval; without a signal that moves on every pick, a burst whose requests share only
# a first block (every request of the Mooncake conversation trace does) would all land on
# whichever endpoint saw that block first. Against GIE's prefix 3 / queue 2 / kv 2, the lighter
# load weights keep a group's requests together unless the load gap is real (the README has the
# measurement: hit ratio 0.90 vs 0.66 on the demo workload, lower TTFT p90).
DEFAULT_PLUGINS: tuple[Mapping[str, Any], ...] = (
    {"type": "prefix-cache-scorer"},
    {"type": "queue-scorer"},
    {"type": "kv-cache-utilization-scorer"},
    {"type": "active-request-scorer"},
    {"type": "max-score-picker"},
)
DEFAULT_PROFILE: Mapping[str, Any] = {
    "name": "default",
    "plugins": [
        {"pluginRef": "prefix-cache-scorer", "weight": 3},
        {"pluginRef": "queue-scorer", "weight": 1},
        {"pluginRef": "kv-cache-utilization-scorer", "weight": 1},
        {"pluginRef": "active-request-scorer", "weight": 1},
        {"pluginRef": "max-score-picker"},
    ],
}


@dataclass(frozen=True)
class TLSConfig:
    cert_path: str
    key_path: str


@dataclass(frozen=True)
class ServerConfig:
    host: str = "0.0.0.0"
    grpc_port: int = 9002
    metrics_port: int = 9090
    max_body_bytes: int = 8 * 1024 * 1024
    tls: TLSConfig | None = None


@dataclass(frozen=True)
class MetricsConfig:
    scrape_interval_s: float = 0.1
    staleness_s: float = 2.0
    timeout_s: float = 1.0
    path: str = "/metrics"


@dataclass(frozen=True)
class ModelConfig:
    name: str
    lora_adapters: tuple[str, ...] = ()
    priority: int = 0


@dataclass(frozen=True)
class PluginConfig:
    name: str
    type: str
    params: Any


@dataclass(frozen=True)
class ProfileEntry:
    plugin_ref: str
    weight: float


@dataclass(frozen=True)
class ProfileConfig:
    name: str
    entries: tuple[ProfileEntry, ...]


@dataclass(frozen=True)
class KVEventSourceConfig:
    """Where one endpoint publishes its KV events (``kvEvents.endpoints[address]``)."""

    publisher: str
    replay: str | None = None


@dataclass(frozen=True)
class KVEventsConfig:
    """``kvEvents``: how the picker receives vLLM KV events.

    In ``connect`` mode (vLLM's default ``tcp://*:5557`` binds on every pod) the picker opens
    one SUB socket per endpoint: ``endpoints[address].publisher`` when listed, else
    ``tcp://<endpoint host>:<publisherPort>``; replays likewise from ``endpoints[..].replay`` or
    ``replayPort``. In ``bind`` mode the picker binds ``bind`` and endpoints' publishers connect
    to it; the topic ``kv@<endpoint>@<model>`` names the endpoint.
    """

    mode: str = "connect"
    bind: str = "tcp://0.0.0.0:5557"
    publisher_port: int = 5557
    replay_port: int | None = None
    endpoints: tuple[tuple[str, KVEventSourceConfig], ...] = ()
    topic_filter: str = ""
    model: str = ""
    replay_timeout_s: float = 2.0
    catch_up: bool = True


@dataclass(frozen=True)
class IndexConfig:
    """``index``: the precise KV-block index.

    ``blockSizeTokens`` must equal vLLM's ``--block-size``. ``keys: dual`` computes the index's
    own keys from the events' token ids (any vLLM hash algorithm and seed); ``keys: strict``
    uses vLLM's block hashes, which needs ``hashAlgo`` (``--prefix-caching-hash-algo``) and
    ``hashSeed`` (``PYTHONHASHSEED``) equal on every pod. Bounds: ``maxBlocks`` (endpoint,
    block) entries in total (measured: about 150 bytes each in memory when endpoints share
    prefixes, 250 when every block is distinct; about 90 in Redis), and per endpoint its
    ``num_gpu_blocks`` when scraped, else ``capacityBlocksPerEndpoint``.
    """

    backend: str = "memory"
    url: str = "redis://127.0.0.1:6379/0"
    key_prefix: str = "kv-picker"
    block_size_tokens: int = 16
    keys: str = "dual"
    hash_algo: str = "sha256"
    hash_seed: str = "0"
    capacity_blocks_per_endpoint: int = 500_000
    max_blocks: int = 4_000_000
    timeout_s: float = 0.05
    retry_interval_s: float = 1.0


@dataclass(frozen=True)
class PickerConfig:
    """Validated configuration; every field has passed its checks."""

    source: str = "<built-in default>"
    server: ServerConfig = field(default_factory=ServerConfig)
    endpoints: tuple[EndpointSpec, ...] = ()
    models: tuple[ModelConfig, ...] = ()
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    seed: int | None = None
    plugins: tuple[PluginConfig, ...] = ()
    profiles: tuple[ProfileConfig, ...] = ()
    handler: str = ""
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    hardware_classes: tuple[HardwareClass, ...] = ()
    default_hardware_class: str = DEFAULT_CLASS
    kv_events: KVEventsConfig | None = None
    index: IndexConfig = field(default_factory=IndexConfig)


def hardware_table(config: PickerConfig) -> HardwareTable:
    """The hardware table a config describes (built-in classes plus its own)."""
    return HardwareTable(
        {c.name: c for c in config.hardware_classes}, config.default_hardware_class
    )


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m)?\s*$")


def parse_duration_s(value: Any, where: str) -> float:
    """Seconds from a number (seconds) or a string such as ``100ms``, ``2s``, ``1m``."""
    if isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str) and (match := _DURATION.match(value)):
        seconds = (
            float(match.group(1)) * {"ms": 0.001, "s": 1.0, "m": 60.0, None: 1.0}[match.group(2)]
        )
    else:
        raise ConfigError(f"{where}: expected a duration such as 100ms, 2s or 1.5, got {value!r}")
    if seconds <= 0:
        raise ConfigError(f"{where}: must be positive, got {value!r}")
    return seconds


class _Reader:
    """Typed access to one mapping of the YAML document, naming the path in errors."""

    def __init__(self, data: Any, where: str, known: tuple[str, ...]) -> None:
        if not isinstance(data, Mapping):
            raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
        unknown = sorted(str(k) for k in data if k not in known)
        if unknown:
            raise ConfigError(
                f"{where}: unknown field(s) {', '.join(unknown)}; known: {', '.join(known)}"
            )
        self.data = data
        self.where = where

    def get(self, key: str, kind: type | tuple[type, ...], default: Any) -> Any:
        value = self.data.get(key, default)
        if value is default:
            return value
        if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
            raise ConfigError(f"{self.where}.{key}: expected {_kind_name(kind)}, got {value!r}")
        if not isinstance(value, kind):
            raise ConfigError(f"{self.where}.{key}: expected {_kind_name(kind)}, got {value!r}")
        return value

    def port(self, key: str, default: int) -> int:
        value: int = self.get(key, int, default)
        if not 0 <= value < 65536:
            raise ConfigError(f"{self.where}.{key}: port must be 0..65535, got {value}")
        return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    names = {
        int: "an integer",
        float: "a number",
        str: "a string",
        bool: "true/false",
        list: "a list",
        dict: "a mapping",
        Mapping: "a mapping",
    }
    return " or ".join(names.get(k, k.__name__) for k in kinds)


def load_config(path: str | Path, registry: Registry) -> PickerConfig:
    """Read and validate a config file.

    Raises:
        ConfigError: naming the file and the offending plugin or field.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror or exc}") from exc
    return parse_config_text(text, registry, source=str(path))


def parse_config_text(text: str, registry: Registry, source: str = "<text>") -> PickerConfig:
    try:
        document = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML: {exc}") from exc
    if document is None:
        document = {}
    try:
        return parse_config(document, registry, source)
    except ConfigError as exc:
        message = str(exc)
        if message.startswith(source):
            raise
        raise ConfigError(f"{source}: {message}") from exc


def parse_config(document: Any, registry: Registry, source: str = "<dict>") -> PickerConfig:
    """Phase one: validate a decoded document completely."""
    top = _Reader(document, "config", _OWN_SECTIONS + IGNORED_SECTIONS)
    api_version = top.get("apiVersion", str, None)
    if api_version is not None and api_version not in API_VERSIONS:
        raise ConfigError(
            f"apiVersion: {api_version!r} is not supported; use one of {', '.join(API_VERSIONS)}"
        )
    kind = top.get("kind", str, None)
    if kind is not None and kind != KIND:
        raise ConfigError(f"kind: expected {KIND}, got {kind!r}")
    for section in IGNORED_SECTIONS:
        if section in document:
            log.warning("%s: section %r is accepted for compatibility and ignored", source, section)

    seed = top.get("seed", int, None)
    raw_plugins = top.get("plugins", list, None)
    raw_profiles = top.get("schedulingProfiles", list, None)
    if raw_plugins is None:
        raw_plugins = list(DEFAULT_PLUGINS)
        if raw_profiles is None:
            raw_profiles = [DEFAULT_PROFILE]
    plugins = _parse_plugins(raw_plugins, registry)
    profiles, handler = _parse_profiles(raw_profiles, plugins, registry)
    models = _parse_models(top.get("models", list, []))
    hardware_classes, default_class = _parse_hardware(top.get("hardware", Mapping, {}))
    kv_events = _parse_kv_events(top.get("kvEvents", Mapping, None))
    index = _parse_index(top.get("index", Mapping, {}))
    _check_precise_prefix(plugins, kv_events, index)
    return PickerConfig(
        kv_events=kv_events,
        index=index,
        source=source,
        server=_parse_server(top.get("server", Mapping, {})),
        endpoints=_parse_endpoints(top.get("endpoints", list, [])),
        models=models,
        metrics=_parse_metrics(top.get("metrics", Mapping, {})),
        seed=seed,
        plugins=plugins,
        profiles=profiles,
        handler=handler,
        admission=_parse_admission(
            top.get("admission", Mapping, {}), top.get("objectives", list, []), models
        ),
        hardware_classes=hardware_classes,
        default_hardware_class=default_class,
    )


def _parse_server(raw: Any) -> ServerConfig:
    reader = _Reader(raw, "server", ("host", "grpcPort", "metricsPort", "maxBodyBytes", "tls"))
    defaults = ServerConfig()
    tls = None
    raw_tls = reader.get("tls", Mapping, None)
    if raw_tls is not None:
        tls_reader = _Reader(raw_tls, "server.tls", ("certPath", "keyPath"))
        cert_path = tls_reader.get("certPath", str, None)
        key_path = tls_reader.get("keyPath", str, None)
        if not cert_path or not key_path:
            raise ConfigError("server.tls: both certPath and keyPath are required")
        tls = TLSConfig(cert_path, key_path)
    max_body_bytes = reader.get("maxBodyBytes", int, defaults.max_body_bytes)
    if max_body_bytes <= 0:
        raise ConfigError(f"server.maxBodyBytes: must be positive, got {max_body_bytes}")
    return ServerConfig(
        host=reader.get("host", str, defaults.host),
        grpc_port=reader.port("grpcPort", defaults.grpc_port),
        metrics_port=reader.port("metricsPort", defaults.metrics_port),
        max_body_bytes=max_body_bytes,
        tls=tls,
    )


def _parse_endpoints(raw: list[Any]) -> tuple[EndpointSpec, ...]:
    specs = []
    seen: set[str] = set()
    for i, item in enumerate(raw):
        where = f"endpoints[{i}]"
        reader = _Reader(item, where, ("address", "labels"))
        address = reader.get("address", str, None)
        if not address:
            raise ConfigError(f"{where}.address: required (ip:port)")
        try:
            split_address(address)
        except ValueError as exc:
            raise ConfigError(f"{where}.address: {exc}") from None
        if address in seen:
            raise ConfigError(f"{where}.address: {address} is listed twice")
        seen.add(address)
        labels = reader.get("labels", Mapping, {})
        for key, value in labels.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise ConfigError(f"{where}.labels: keys and values must be strings ({key!r})")
        specs.append(EndpointSpec(address, dict(labels)))
    return tuple(specs)


def _parse_models(raw: list[Any]) -> tuple[ModelConfig, ...]:
    models = []
    for i, item in enumerate(raw):
        where = f"models[{i}]"
        if isinstance(item, str):
            models.append(ModelConfig(item))
            continue
        reader = _Reader(item, where, ("name", "loraAdapters", "priority"))
        name = reader.get("name", str, None)
        if not name:
            raise ConfigError(f"{where}.name: required")
        adapters = reader.get("loraAdapters", list, [])
        if not all(isinstance(a, str) and a for a in adapters):
            raise ConfigError(f"{where}.loraAdapters: must be a list of names")
        priority = reader.get("priority", int, 0)
        models.append(ModelConfig(name, tuple(adapters), priority))
    return tuple(models)


def _parse_metrics(raw: Any) -> MetricsConfig:
    reader = _Reader(raw, "metrics", ("scrapeInterval", "stalenessThreshold", "timeout", "path"))
    defaults = MetricsConfig()

    def duration(key: str, default: float) -> float:
        value = reader.data.get(key)
        return default if value is None else parse_duration_s(value, f"metrics.{key}")

    path = reader.get("path", str, defaults.path)
    if not path.startswith("/"):
        raise ConfigError(f"metrics.path: must start with '/', got {path!r}")
    return MetricsConfig(
        scrape_interval_s=duration("scrapeInterval", defaults.scrape_interval_s),
        staleness_s=duration("stalenessThreshold", defaults.staleness_s),
        timeout_s=duration("timeout", defaults.timeout_s),
        path=path,
    )


def _parse_admission(
    raw: Any, raw_objectives: list[Any], models: tuple[ModelConfig, ...]
) -> AdmissionConfig:
    reader = _Reader(
        raw,
        "admission",
        (
            "queueDepthThreshold",
            "kvCacheUtilThreshold",
            "metricsStalenessThreshold",
            "priorityHeader",
        ),
    )
    defaults = AdmissionConfig()
    queue = reader.get("queueDepthThreshold", (int, float), defaults.queue_depth_threshold)
    kv = reader.get("kvCacheUtilThreshold", (int, float), defaults.kv_cache_util_threshold)
    if not queue > 0:
        raise ConfigError(f"admission.queueDepthThreshold: must be > 0, got {queue}")
    if not 0 < kv <= 1:
        raise ConfigError(f"admission.kvCacheUtilThreshold: must be in (0, 1], got {kv}")
    staleness = raw.get("metricsStalenessThreshold")
    header = reader.get("priorityHeader", str, defaults.priority_header)
    if not header or header != header.lower():
        raise ConfigError("admission.priorityHeader: must be a lower-case header name")
    objectives: dict[str, int] = {}
    for i, item in enumerate(raw_objectives):
        where = f"objectives[{i}]"
        objective = _Reader(item, where, ("name", "priority"))
        name = objective.get("name", str, None)
        if not name:
            raise ConfigError(f"{where}.name: required")
        if name in objectives:
            raise ConfigError(f"{where}.name: objective {name!r} is defined twice")
        objectives[name] = objective.get("priority", int, 0)
    priorities: dict[str, int] = {}
    for model in models:
        for name in (model.name, *model.lora_adapters):
            priorities[name] = model.priority
    return AdmissionConfig(
        queue_depth_threshold=float(queue),
        kv_cache_util_threshold=float(kv),
        staleness_s=None
        if staleness is None
        else parse_duration_s(staleness, "admission.metricsStalenessThreshold"),
        priority_header=header,
        objectives=objectives,
        model_priorities=priorities,
    )


def _parse_hardware(raw: Any) -> tuple[tuple[HardwareClass, ...], str]:
    reader = _Reader(raw, "hardware", ("defaultClass", "classes"))
    classes = []
    names: set[str] = set()
    for i, item in enumerate(reader.get("classes", list, [])):
        where = f"hardware.classes[{i}]"
        entry = _Reader(item, where, ("name", "prefillSpeed", "decodeSpeed", "kvCapacity"))
        name = entry.get("name", str, None)
        if not name:
            raise ConfigError(f"{where}.name: required")
        if name in names:
            raise ConfigError(f"{where}.name: class {name!r} is defined twice")
        names.add(name)
        values = []
        for key in ("prefillSpeed", "decodeSpeed", "kvCapacity"):
            value = entry.get(key, (int, float), None)
            if value is None or not value > 0:
                raise ConfigError(f"{where}.{key}: required, a number > 0")
            values.append(float(value))
        classes.append(HardwareClass(name, *values))
    default_class = reader.get("defaultClass", str, DEFAULT_CLASS)
    if default_class not in names and default_class not in BUILTIN_HARDWARE_CLASSES:
        raise ConfigError(
            f"hardware.defaultClass: unknown class {default_class!r}; known: "
            f"{', '.join(sorted({*BUILTIN_HARDWARE_CLASSES, *names}))}"
        )
    return tuple(classes), default_class


def _parse_plugins(raw: list[Any], registry: Registry) -> tuple[PluginConfig, ...]:
    plugins: list[PluginConfig] = []
    names: set[str] = set()
    for i, item in enumerate(raw):
        reader = _Reader(item, f"plugins[{i}]", ("name", "type", "parameters"))
        type_name = reader.get("type", str, None)
        if not type_name:
            raise ConfigError(f"plugins[{i}].type: required")
        name = reader.get("name", str, None) or type_name
        where = f"plugins[{i}] ({name})"
        try:
            registry.get(type_name)
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        if name in names:
            raise ConfigError(f"{where}: plugin name {name!r} is used twice")
        names.add(name)
        params = registry.parse_params(type_name, name, item.get("parameters"))
        plugins.append(PluginConfig(name, type_name, params))
    return tuple(plugins)


def plugin_kind(cls: type) -> str:
    """``filter``, ``scorer``, ``picker`` or ``handler``, from the methods a class has."""
    for method, kind in (
        ("schedule", "handler"),
        ("pick", "picker"),
        ("score", "scorer"),
        ("filter", "filter"),
    ):
        if callable(getattr(cls, method, None)):
            return kind
    return "other"


def _parse_profiles(
    raw: list[Any] | None, plugins: tuple[PluginConfig, ...], registry: Registry
) -> tuple[tuple[ProfileConfig, ...], str]:
    kinds = {p.name: plugin_kind(registry.get(p.type)) for p in plugins}
    handlers = [name for name, kind in kinds.items() if kind == "handler"]
    if len(handlers) > 1:
        raise ConfigError(f"plugins: only one profile handler allowed, got {', '.join(handlers)}")
    if raw is None:
        # No profiles: one `default` profile with every filter, scorer and picker declared.
        raw = [
            {
                "name": "default",
                "plugins": [{"pluginRef": p.name} for p in plugins if kinds[p.name] != "handler"],
            }
        ]
    if not raw:
        raise ConfigError("schedulingProfiles: at least one profile is required")
    profiles = []
    profile_names: set[str] = set()
    default_picker = next((n for n, k in kinds.items() if k == "picker"), None)
    for i, item in enumerate(raw):
        reader = _Reader(item, f"schedulingProfiles[{i}]", ("name", "plugins"))
        name = reader.get("name", str, None)
        if not name:
            raise ConfigError(f"schedulingProfiles[{i}].name: required")
        if name in profile_names:
            raise ConfigError(f"schedulingProfiles[{i}].name: profile {name!r} is defined twice")
        profile_names.add(name)
        entries: list[ProfileEntry] = []
        pickers = 0
        for j, ref in enumerate(reader.get("plugins", list, [])):
            where = f"schedulingProfiles[{i}] ({name}).plugins[{j}]"
            ref_reader = _Reader(ref, where, ("pluginRef", "weight"))
            plugin_ref = ref_reader.get("pluginRef", str, None)
            if not plugin_ref:
                raise ConfigError(f"{where}.pluginRef: required")
            if plugin_ref not in kinds:
                raise ConfigError(
                    f"{where}.pluginRef: no plugin named {plugin_ref!r}; "
                    f"declared: {', '.join(kinds) or 'none'}"
                )
            kind = kinds[plugin_ref]
            if kind == "handler":
                raise ConfigError(
                    f"{where}: {plugin_ref!r} is a profile handler, not a profile step"
                )
            weight = ref_reader.get("weight", (int, float), 1.0)
            if weight < 0:
                raise ConfigError(f"{where}.weight: must be >= 0, got {weight}")
            if kind != "scorer" and "weight" in ref:
                log.warning("%s: weight on %s %r has no effect", where, kind, plugin_ref)
            pickers += kind == "picker"
            entries.append(ProfileEntry(plugin_ref, float(weight)))
        if pickers > 1:
            raise ConfigError(f"schedulingProfiles[{i}] ({name}): more than one picker")
        if pickers == 0:
            if default_picker is None:
                entries.append(ProfileEntry("max-score-picker", 1.0))
            else:
                entries.append(ProfileEntry(default_picker, 1.0))
        profiles.append(ProfileConfig(name, tuple(entries)))
    handler = handlers[0] if handlers else ""
    if not handler and len(profiles) > 1 and "default" not in profile_names:
        raise ConfigError(
            "schedulingProfiles: several profiles need a profile handler plugin "
            "(or a profile named 'default' for single-profile-handler)"
        )
    return tuple(profiles), handler


_ZMQ_SCHEMES = ("tcp://", "ipc://", "inproc://")
_REDIS_SCHEMES = ("redis://", "rediss://", "valkey://", "valkeys://", "unix://")


def _zmq_address(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.startswith(_ZMQ_SCHEMES):
        raise ConfigError(
            f"{where}: expected a ZMQ address such as tcp://10.0.0.7:5557, got {value!r}"
        )
    return value


def _parse_kv_events(raw: Any) -> KVEventsConfig | None:
    if raw is None:
        return None
    reader = _Reader(
        raw,
        "kvEvents",
        (
            "mode",
            "bind",
            "publisherPort",
            "replayPort",
            "endpoints",
            "topicFilter",
            "model",
            "replayTimeout",
            "catchUp",
        ),
    )
    defaults = KVEventsConfig()
    mode = reader.get("mode", str, defaults.mode)
    if mode not in ("connect", "bind"):
        raise ConfigError(f"kvEvents.mode: must be connect or bind, got {mode!r}")
    ports = {}
    for key, default in (("publisherPort", defaults.publisher_port), ("replayPort", None)):
        value = reader.get(key, int, default)
        if value is not None and not 0 < value < 65536:
            raise ConfigError(f"kvEvents.{key}: port must be 1..65535, got {value}")
        ports[key] = value
    endpoints = []
    for address, entry in reader.get("endpoints", Mapping, {}).items():
        where = f"kvEvents.endpoints[{address!r}]"
        try:
            split_address(str(address))
        except ValueError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        entry_reader = _Reader(entry, where, ("publisher", "replay"))
        publisher = _zmq_address(entry_reader.get("publisher", str, None), f"{where}.publisher")
        replay = entry_reader.get("replay", str, None)
        if replay is not None:
            _zmq_address(replay, f"{where}.replay")
        endpoints.append((str(address), KVEventSourceConfig(publisher, replay)))
    timeout = raw.get("replayTimeout")
    return KVEventsConfig(
        mode=mode,
        bind=_zmq_address(reader.get("bind", str, defaults.bind), "kvEvents.bind"),
        publisher_port=ports["publisherPort"],
        replay_port=ports["replayPort"],
        endpoints=tuple(endpoints),
        topic_filter=reader.get("topicFilter", str, defaults.topic_filter),
        model=reader.get("model", str, defaults.model),
        replay_timeout_s=defaults.replay_timeout_s
        if timeout is None
        else parse_duration_s(timeout, "kvEvents.replayTimeout"),
        catch_up=reader.get("catchUp", bool, defaults.catch_up),
    )


def _parse_index(raw: Any) -> IndexConfig:
    from kv_picker.state.block_keys import HASH_ALGOS

    reader = _Reader(
        raw,
        "index",
        (
            "backend",
            "url",
            "keyPrefix",
            "blockSizeTokens",
            "keys",
            "hashAlgo",
            "hashSeed",
            "capacityBlocksPerEndpoint",
            "maxBlocks",
            "timeout",
            "retryInterval",
        ),
    )
    defaults = IndexConfig()
    backend = reader.get("backend", str, defaults.backend)
    if backend not in ("memory", "redis"):
        raise ConfigError(f"index.backend: must be memory or redis, got {backend!r}")
    url = reader.get("url", str, defaults.url)
    if not url.startswith(_REDIS_SCHEMES):
        raise ConfigError(
            f"index.url: expected redis://, rediss://, valkey:// or unix://, got {url!r}"
        )
    keys = reader.get("keys", str, defaults.keys)
    if keys not in ("dual", "strict"):
        raise ConfigError(f"index.keys: must be dual or strict, got {keys!r}")
    hash_algo = reader.get("hashAlgo", str, defaults.hash_algo)
    if hash_algo not in HASH_ALGOS:
        raise ConfigError(
            f"index.hashAlgo: must be one of {', '.join(HASH_ALGOS)}, got {hash_algo!r}"
        )
    hash_seed = reader.get("hashSeed", (str, int), defaults.hash_seed)
    counts = {}
    for key, default in (
        ("blockSizeTokens", defaults.block_size_tokens),
        ("capacityBlocksPerEndpoint", defaults.capacity_blocks_per_endpoint),
        ("maxBlocks", defaults.max_blocks),
    ):
        value = reader.get(key, int, default)
        if value < 1:
            raise ConfigError(f"index.{key}: must be >= 1, got {value}")
        counts[key] = value
    key_prefix = reader.get("keyPrefix", str, defaults.key_prefix)
    if not key_prefix:
        raise ConfigError("index.keyPrefix: must not be empty")

    def duration(key: str, default: float) -> float:
        value = raw.get(key)
        return default if value is None else parse_duration_s(value, f"index.{key}")

    return IndexConfig(
        backend=backend,
        url=url,
        key_prefix=key_prefix,
        block_size_tokens=counts["blockSizeTokens"],
        keys=keys,
        hash_algo=hash_algo,
        hash_seed=str(hash_seed),
        capacity_blocks_per_endpoint=counts["capacityBlocksPerEndpoint"],
        max_blocks=counts["maxBlocks"],
        timeout_s=duration("timeout", defaults.timeout_s),
        retry_interval_s=duration("retryInterval", defaults.retry_interval_s),
    )


def _check_precise_prefix(
    plugins: tuple[PluginConfig, ...], kv_events: KVEventsConfig | None, index: IndexConfig
) -> None:
    """Precise prefix matching needs an event source, or a shared index others write."""
    for i, plugin in enumerate(plugins):
        if getattr(plugin.params, "mode", None) != "precise":
            continue
        if kv_events is None and index.backend != "redis":
            raise ConfigError(
                f"plugins[{i}] ({plugin.name}): mode precise needs a kvEvents section (where the "
                "endpoints publish KV events), or index.backend: redis to read a shared index"
            )
