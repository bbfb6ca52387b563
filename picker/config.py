"""Configuration: the external YAML schema -> a validated, frozen internal config.

The file follows the EndpointPickerConfig schema of the Gateway API Inference Extension and
llm-d (``plugins`` and ``schedulingProfiles``), so their configs port over, plus kv-picker's own
sections:

```yaml
apiVersion: kv-picker.io/v1alpha1        # or llm-d.ai/v1alpha1, inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
server: {grpcPort: 9002, metricsPort: 9090, host: 0.0.0.0, maxBodyBytes: 8388608, shutdownDelay: 0s,
         drainTimeout: 5s,
         tls: {certPath: ..., keyPath: ..., clientCAPath: ...},   # clientCAPath: mutual TLS
         admin: {host: 127.0.0.1, port: 9004, tls: {...}}}       # kvpicker.v1.Admin
endpoints:                               # static discovery
- address: 10.0.0.7:8000
  labels: {llm-d.ai/role: both}
discovery:                               # or Kubernetes discovery (not with endpoints)
  kubernetes: {namespace: llm, inferencePool: vllm-pool}
  # or {namespace: llm, selector: {app: vllm}, targetPorts: [8000]}; kubeconfig: PATH
models:                                  # optional: when set, other models get 404
- name: meta-llama/Llama-3.1-8B-Instruct
  loraAdapters: [sql-lora]
metrics: {scrapeInterval: 100ms, stalenessThreshold: 2s, timeout: 1s, path: /metrics,
          scraper: process}                # process: fetch and parse in a child process;
                                           #   inline: on the picker's event loop
kvEvents:                                # vLLM KV events, for precise-prefix-cache-scorer
  mode: connect                          # connect: one SUB socket per endpoint; bind: one SUB
  publisherPort: 5557                    #   socket the publishers connect to (kvEvents.bind)
  replayPort: 5558                       # optional: each endpoint's replay (ROUTER) socket
  dataParallelBasePort: 8000             # optional: endpoints on 8000+r are DP rank r (events
                                         #   at publisherPort+r, replays at replayPort+r)
  endpoints: {10.0.0.7:8000: {publisher: tcp://10.0.0.7:5557, replay: tcp://10.0.0.7:5558}}
  topicFilter: ""                        # ZMQ prefix subscription; topics kv@<endpoint>@<model>
  model: ""                              # model of events whose topic names none
index: {backend: memory, blockSizeTokens: 16, keys: dual, maxBlocks: 4000000,
        tierWeights: {gpu: 1.0, cpu: 0.8, storage: 0.5}}
       # backend redis: url, keyPrefix, timeout; keys strict: hashAlgo, hashSeed (IndexConfig)
seed: 0                                  # random tie-breaks are repeatable
requestLog: {path: /var/log/kv-picker/requests.jsonl, maxBytes: 67108864, backups: 3,
             salt: ..., blockTokens: 512}   # optional: a replayable trace of what was routed
tracing: {exporter: otlp, endpoint: http://otel-collector:4317, sampleRatio: 0.1,
          serviceName: kv-picker}          # optional: OpenTelemetry spans (kv_picker.tracing)
plugins: [{type: ..., name: ..., parameters: {...}}]
schedulingProfiles: [{name: default, plugins: [{pluginRef: ..., weight: 2}]}]
```

Loading is two-phase: :func:`parse_config` checks everything (schema, plugin types, strict
parameters, references) and returns a frozen :class:`PickerConfig`, naming the file, plugin and
field in every error; building plugins happens later. Every section is a dataclass read by the
one declarative decoder (:mod:`kv_picker.decode`); plugin parameters are read by the same
decoder from each plugin's ``Params`` (:mod:`kv_picker.scheduling.registry`), so this module
knows no plugin's parameters.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, Literal

import yaml

from kv_picker import upstream
from kv_picker.admission import AdmissionConfig
from kv_picker.decode import (
    Check,
    Duration,
    FieldError,
    NonNegative,
    Port,
    Positive,
    Range,
    Text,
    decode,
    key,
)
from kv_picker.endpoint import EndpointSpec, split_address
from kv_picker.errors import ConfigError
from kv_picker.scheduling.framework import SCORING_KINDS, PluginKind
from kv_picker.scheduling.registry import Registry
from kv_picker.state.block_events import DEFAULT_TIER_WEIGHTS, Tiers
from kv_picker.state.block_keys import HASH_ALGOS
from kv_picker.state.compact_ledger import LedgerLayout
from kv_picker.state.hardware import (
    BUILTIN_HARDWARE_CLASSES,
    DEFAULT_CLASS,
    HardwareClass,
    HardwareTable,
)
from kv_picker.tracing import TracingConfig

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

# The built-in default, chosen on the tuning families of the routing matrix
# (`kv-picker bench matrix`; benchmarks/RESULTS.md names the split and gives the numbers):
#
# - predicted-latency-scorer (1.5): one estimate of time to first token per endpoint, from the
#   prefill work queued there (tokens and attention, counted by the picker from the pick to the
#   first byte), this prompt's uncached part, the engine's step and KV-read costs, the wait for a
#   free sequence slot past maxNumSeqs (64: set it to the engines' --max-num-seqs), and the
#   endpoint's hardware class, its prefill seconds scaled by the pool's own prefill speed as
#   learned from the prefills the picker sees end (prefillCalibration: a 70B pool is ranked by
#   its own speed, not an 8B model's); for a prompt of at least 8,192 tokens it also counts its
#   first 64 decode steps, each reading the KV in flight there, as what they exceed at the
#   candidate where they are cheapest (decodeTokens, decodeMinPromptTokens, decodeExcess), so
#   the endpoint holding a long context stops looking free once the contexts it already decodes
#   slow its steps (without it, questions about long documents stayed with their holders at
#   high load and output throughput fell to 0.72 of the best); once every candidate has
#   prefills waiting behind the one it computes (saturatedAbove 1), a candidate that would
#   compute more of the prompt than the best-cached one also pays 2 x the fewest waiting x those
#   extra seconds (saturatedMissCost 2, missExcess): past saturation every later request waits
#   for a prompt computed again, so a cached request stays with its holder unless the queues
#   differ by more than that; below saturation, a candidate also pays for the requests that
#   will arrive there while it computes this prompt and wait behind it (blockingCost 1, from the
#   rate of requests this picker sent there lately; blockingUnsaturated: past saturation the
#   miss cost prices that wait already). Weight 1.5: its estimate decides between endpoints
#   whose in-flight decode differs little;
# - active-request-scorer (2), counting the prompt tokens in flight (the KV each decode step
#   reads) per unit of the endpoint's decode speed: it spreads decode load, which decides TTFT
#   once batches fill and which the TTFT estimate cannot see coming; below 8,192 tokens in
#   flight on the busiest candidate (fullScale: about half a millisecond of KV read per decode
#   step for an 8B model on an H100) differences count only in proportion, so an idle pool
#   keeps affinity; with ownDecode, a candidate slower than the fastest also counts the request
#   being placed at its decode speed (the extra decode it would cost there), so an idle L4 next
#   to H100s is no longer the best place for a long prompt; on a pool of one class it changes
#   nothing; with cachedScale 2 the damping scale is also at least twice the prompt tokens the
#   best-matching candidate holds, so a question leaves the endpoint that holds its context
#   only for a difference in flight of about twice what moving would recompute (a few short
#   requests no longer outweigh a 30,000-token cache hit), while a long prompt nobody holds
#   spreads like a short one (promptScale 2, the default before it, damped by the whole
#   prompt: measured alike, benchmarks/RESULTS.md section 1);
# - prefix-cache-scorer (1): the matched share of the prompt, for affinity where the others tie
#   (the latency estimate already counts cached tokens as free). It matches up to 2,048 blocks
#   (about 32,000 tokens), not the upstream 256 (about 4,000): the latency estimate takes its
#   cached tokens from this match, and with 256 a 25,000-token agent context cached on one
#   endpoint looked almost as slow there as anywhere else, so in-flight spreading moved it;
#   with cappedMatchIsWhole, an endpoint matching all 2,048 blocks of a longer prompt counts as
#   holding the whole prompt (a cached context is cached whole), where the rest of it used to
#   count as uncached and overstated that endpoint's TTFT 3-25 times; with fullYield 64 (the
#   engines' --max-num-seqs) a holder with every slot taken by this picker's requests scores 0
#   while a candidate has 16 slots free (fullYieldFree): in a burst that fills a hot prefix's
#   holders, a request waited there seconds for a slot where an endpoint with room computes the
#   prefix again sooner;
# - recent-work-scorer (0.5, idleShare 0.25): endpoints that computed under a quarter of the
#   busiest candidate's prefill work over the last ~30 s score above 0, so at light load new
#   contexts seed endpoints that would otherwise stay idle while sessions keep returning to the
#   first endpoints used (on the matrix's P/D pool, agent loops at 0.3 load went from 2.21x the
#   best TTFT mean to 1.0x); among endpoints all busy it says nothing. Its scores are scaled by
#   each endpoint's decode speed over the fastest candidate's (decodeSpeedScaled), so an idle L4
#   next to H100s is seeded at about a tenth of the weight: seeded L4s decoded a run's last
#   requests about eleven times slower (on the matrix's mixed pool, 3.4% more output throughput
#   over the cells of draws 19-21, judged by a rule written first; same on one class).
#
# The prefill calibration, the latency weight 1.5, the decode term from 8,192 tokens, fullYield and
# the blocking cost joined it together, chosen on draws 58-66 of the matrix and confirmed on
# draws 67-69 by a rule written before they ran (210 pooled cells against the default before it's
# 205, TTFT mean 0.966 and p90 0.958 of its figures, its worst TTFT mean cell 1.54x the best
# against 2.24x; profiles/calibrated-latency-15-decode-8k-full-yield-free-16-blocking-1-
# unsaturated.yaml, the default before it profiles/saturated-above-2.yaml).
# Before the slot term, in-flight spreading had weight 3: it was the only signal of an endpoint
# whose slots were full, and it gave up cache hits on lightly loaded pools.
# The previous default (prefix 3, queue 1, kv-utilization 1, active requests 1) piled every
# request sharing a system prompt onto one endpoint: on chat sessions it was up to 200x slower
# than the best policy in the matrix.
DEFAULT_PLUGINS: tuple[Mapping[str, Any], ...] = (
    {
        "type": "prefix-cache-scorer",
        "parameters": {
            "maxPrefixBlocksToMatch": 2048,
            "cappedMatchIsWhole": True,
            "fullYield": 64,
            "fullYieldFree": 16,
        },
    },
    {
        "type": "predicted-latency-scorer",
        "parameters": {
            "maxNumSeqs": 64,
            "decodeTokens": 64,
            "decodeMinPromptTokens": 8192,
            "decodeExcess": True,
            "saturatedMissCost": 2,
            "missExcess": True,
            "saturatedAbove": 1,
            "prefillCalibration": True,
            "blockingCost": 1,
            "blockingUnsaturated": True,
        },
    },
    {
        "type": "active-request-scorer",
        "parameters": {
            "unit": "tokens",
            "perHardware": True,
            "fullScale": 8192,
            "ownDecode": True,
            "cachedScale": 2,
        },
    },
    {"type": "recent-work-scorer", "parameters": {"idleShare": 0.25, "decodeSpeedScaled": True}},
    {"type": "max-score-picker"},
)
DEFAULT_PROFILE: Mapping[str, Any] = {
    "name": "default",
    "plugins": [
        {"pluginRef": "prefix-cache-scorer", "weight": 1},
        {"pluginRef": "predicted-latency-scorer", "weight": 1.5},
        {"pluginRef": "active-request-scorer", "weight": 2},
        {"pluginRef": "recent-work-scorer", "weight": 0.5},
        {"pluginRef": "max-score-picker"},
    ],
}


def _not_empty(value: str) -> bool:
    return bool(value)


NonEmpty = Check(_not_empty, "must not be empty")

# -- sections ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class TLSConfig:
    """TLS on a gRPC port, from files that are re-read when they change (:mod:`kv_picker.tls`).

    ``clientCAPath`` turns on mutual TLS: a client must present a certificate signed by one of
    that file's CAs (the gateway's), else the handshake fails.
    """

    cert_path: Annotated[str, NonEmpty]
    key_path: Annotated[str, NonEmpty]
    client_ca_path: Annotated[str, NonEmpty] | None = field(
        default=None, metadata=key("clientCAPath", aliases=("clientCaPath",))
    )


@dataclass(frozen=True)
class AdminConfig:
    """``server.admin``: the ``kvpicker.v1.Admin`` API (Explain, ListEndpoints) on a port of its
    own, apart from the ext_proc port every gateway reaches. It shows endpoint state and runs
    the scheduler on any body, so it listens on loopback unless told otherwise
    (``kubectl port-forward`` reaches it there)."""

    enabled: bool = True
    host: str = "127.0.0.1"
    port: Annotated[int, Port] = 9004
    tls: TLSConfig | None = None


@dataclass(frozen=True)
class ServerConfig:
    host: str = "0.0.0.0"
    grpc_port: Annotated[int, Port] = 9002
    metrics_port: Annotated[int, Port] = 9090
    max_body_bytes: Annotated[int, Positive] = 8 * 1024 * 1024
    tls: TLSConfig | None = None
    admin: AdminConfig = field(default_factory=AdminConfig)
    # On SIGTERM: report NOT_SERVING this long while still serving, so gateways that health-check
    # the picker stop sending before it stops taking streams; then drain.
    shutdown_delay_s: Annotated[Duration, NonNegative] = field(
        default=0.0, metadata=key("shutdownDelay")
    )
    # Then: refuse new streams and let open ones finish for at most this long before cancelling
    # them. A stream lasts as long as its response, so a response still running at the end is
    # cut: keep shutdownDelay + drainTimeout under the pod's terminationGracePeriodSeconds.
    drain_timeout_s: Annotated[Duration, Positive] = field(
        default=5.0, metadata=key("drainTimeout")
    )


def _absolute_path(path: str) -> bool:
    return path.startswith("/")


@dataclass(frozen=True)
class MetricsConfig:
    scrape_interval_s: Annotated[Duration, Positive] = field(
        default=0.1, metadata=key("scrapeInterval")
    )
    staleness_s: Annotated[Duration, Positive] = field(
        default=2.0, metadata=key("stalenessThreshold")
    )
    timeout_s: Annotated[Duration, Positive] = field(default=1.0, metadata=key("timeout"))
    path: Annotated[str, Check(_absolute_path, "must start with '/'")] = "/metrics"
    scraper: Literal["process", "inline"] = "process"


@dataclass(frozen=True)
class ModelConfig:
    name: Annotated[str, NonEmpty]
    lora_adapters: tuple[Annotated[str, NonEmpty], ...] = ()
    priority: int = 0


@dataclass(frozen=True)
class PluginConfig:
    """A declared plugin, its parameters decoded by its class (phase one)."""

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


_ZMQ_SCHEMES = ("tcp://", "ipc://", "inproc://")
_REDIS_SCHEMES = ("redis://", "rediss://", "valkey://", "valkeys://", "unix://")


def _zmq_address(value: str) -> bool:
    return value.startswith(_ZMQ_SCHEMES)


ZmqAddress = Annotated[
    str, Check(_zmq_address, "expected a ZMQ address such as tcp://10.0.0.7:5557")
]


@dataclass(frozen=True)
class KVEventSourceConfig:
    """Where one endpoint publishes its KV events (``kvEvents.endpoints[address]``)."""

    publisher: ZmqAddress
    replay: ZmqAddress | None = None


@dataclass(frozen=True)
class KVEventsConfig:
    """``kvEvents``: how the picker receives vLLM KV events.

    In ``connect`` mode (vLLM's default ``tcp://*:5557`` binds on every pod) the picker opens
    one SUB socket per endpoint: ``endpoints[address].publisher`` when listed, else
    ``tcp://<endpoint host>:<publisherPort>``; replays likewise from ``endpoints[..].replay`` or
    ``replayPort``. In ``bind`` mode the picker binds ``bind`` and endpoints' publishers connect
    to it; the topic ``kv@<endpoint>@<model>`` names the endpoint.

    Data parallelism: vLLM runs one publisher per data-parallel rank and offsets its port (and
    its replay port) by the rank. When each rank serves on its own port (rank 0 on
    ``dataParallelBasePort``, rank r on that port + r, e.g. an InferencePool's ``targetPorts``),
    each rank is an endpoint of its own, and connect mode reads rank r's events from
    ``publisherPort + r`` (replays from ``replayPort + r``). Bind mode does not follow ranks
    (their publishers would connect to the bind port + rank): list their addresses under
    ``endpoints`` in connect mode instead.
    """

    mode: Literal["connect", "bind"] = "connect"
    bind: ZmqAddress = "tcp://0.0.0.0:5557"
    publisher_port: Annotated[int, Range(ge=1, le=65535)] = 5557
    replay_port: Annotated[int, Range(ge=1, le=65535)] | None = None
    data_parallel_base_port: Annotated[int, Range(ge=1, le=65535)] | None = None
    endpoints: Mapping[str, KVEventSourceConfig] = field(default_factory=dict)
    topic_filter: str = ""
    model: str = ""
    replay_timeout_s: Annotated[Duration, Positive] = field(
        default=2.0, metadata=key("replayTimeout")
    )
    catch_up: bool = True

    def validate(self) -> None:
        for address in self.endpoints:
            try:
                split_address(address)
            except ValueError as exc:
                raise FieldError(f"endpoints[{address!r}]", str(exc)) from None


def _redis_url(value: str) -> bool:
    return value.startswith(_REDIS_SCHEMES)


def _hash_algo(value: str) -> bool:
    return value in HASH_ALGOS


@dataclass(frozen=True)
class IndexConfig:
    """``index``: the precise KV-block index.

    ``blockSizeTokens`` must equal vLLM's ``--block-size``. ``keys: dual`` computes the index's
    own keys from the events' token ids (any vLLM hash algorithm and seed); ``keys: strict``
    uses vLLM's block hashes, which needs ``hashAlgo`` (``--prefix-caching-hash-algo``) and
    ``hashSeed`` (``PYTHONHASHSEED``) equal on every pod. Bounds: ``maxBlocks`` (endpoint,
    tier, group, block) entries in total (measured with ``ledger: compact``: about 55 bytes
    each in memory when endpoints share prefixes, 150 when every block is distinct; 155 and 250
    with ``ledger: dict``; about 45 in Redis), and per
    endpoint and tier: the GPU tier its ``num_gpu_blocks`` when scraped, else (and other tiers)
    ``capacityBlocksPerEndpoint``.

    ``tierWeights``: the media indexed (vLLM's ``medium``: ``GPU``, ``CPU``, ``STORAGE``, any
    case; none means GPU) and what a block held there weighs in the precise score, in (0, 1].
    Media not listed are not indexed; ``gpu`` is required. Replicas sharing a Redis index must
    list the same names.

    ``ledger``: how each picker keeps its engine hash → key entries (both backends keep them
    in process): ``compact`` numpy logs (:mod:`kv_picker.state.compact_ledger`), or ``dict``,
    ordered dicts, three times the memory per entry and a little faster to apply events to.
    """

    backend: Literal["memory", "redis"] = "memory"
    url: Annotated[str, Check(_redis_url, "expected redis://, rediss://, valkey:// or unix://")] = (
        "redis://127.0.0.1:6379/0"
    )
    key_prefix: Annotated[str, NonEmpty] = "kv-picker"
    block_size_tokens: Annotated[int, Range(ge=1)] = 16
    keys: Literal["dual", "strict"] = "dual"
    hash_algo: Annotated[str, Check(_hash_algo, f"must be one of {', '.join(HASH_ALGOS)}")] = (
        "sha256"
    )
    hash_seed: Text = "0"
    tier_weights: Mapping[str, Annotated[float, Range(gt=0, le=1)]] = field(
        default_factory=lambda: dict(DEFAULT_TIER_WEIGHTS)
    )
    capacity_blocks_per_endpoint: Annotated[int, Range(ge=1)] = 500_000
    max_blocks: Annotated[int, Range(ge=1)] = 4_000_000
    ledger: LedgerLayout = "compact"
    timeout_s: Annotated[Duration, Positive] = field(default=0.05, metadata=key("timeout"))
    retry_interval_s: Annotated[Duration, Positive] = field(
        default=1.0, metadata=key("retryInterval")
    )

    def validate(self) -> None:
        try:
            Tiers(self.tier_weights)
        except ValueError as exc:
            raise FieldError("tierWeights", str(exc)) from None


@dataclass(frozen=True)
class RequestLogConfig:
    """``requestLog``: a Mooncake-format trace of the requests the picker routed (off when the
    section is absent; :mod:`kv_picker.request_log`).

    Files rotate by size: ``path`` is the newest, then ``path.1`` ... ``path.<backups>``; each
    file exceeds ``maxBytes`` only when one row alone does. ``salt`` keys the block ids: a long
    random string, kept secret, the same on replicas whose logs should share ids (default: a
    random salt per process; either is logged as a fingerprint only). ``blockTokens`` is the trace's block size;
    Mooncake traces, and the harness's Mooncake reader, use 512.
    """

    path: Annotated[str, NonEmpty]
    max_bytes: Annotated[int, Range(ge=1)] = 64 * 1024 * 1024
    backups: Annotated[int, Range(ge=0)] = 3
    salt: Annotated[Text, NonEmpty] | None = None
    block_tokens: Annotated[int, Range(ge=1)] = 512


MAX_TARGET_PORTS = 8  # the InferencePool CRD's bound on spec.targetPorts


@dataclass(frozen=True)
class KubernetesDiscoveryConfig:
    """``discovery.kubernetes``: endpoints from the Kubernetes API
    (:mod:`kv_picker.sources.kubernetes`).

    Either ``inferencePool`` (an InferencePool in ``namespace``, whose selector and target
    ports are followed as they change) or a ``selector`` (matchLabels) with ``targetPorts`` (1 to
    8 ports, as the InferencePool allows). ``inferencePoolGroup`` is the pool's API group, as the
    reference EPP's ``--pool-group``: ``inference.networking.k8s.io`` (the default, the ``v1``
    API) or ``inference.networking.x-k8s.io`` (the older ``v1alpha2`` API, whose pools have a
    plain label map for ``selector`` and one ``targetPortNumber``).
    Credentials: ``kubeconfig`` when given, else the pod's service account, else the default
    kubeconfig (``$KUBECONFIG`` or ``~/.kube/config``). ``watchTimeout`` is how long one watch
    request may last before it is renewed from its resourceVersion; a stream that breaks is
    watched again after a backoff doubling from ``backoffInitial`` up to ``backoffMax``;
    ``timeout`` bounds list requests.
    """

    namespace: Annotated[str, NonEmpty]
    inference_pool: Annotated[str, NonEmpty] | None = None
    inference_pool_group: (
        Literal["inference.networking.k8s.io", "inference.networking.x-k8s.io"] | None
    ) = None
    selector: Mapping[str, str] | None = None
    target_ports: tuple[Annotated[int, Range(ge=1, le=65535)], ...] = ()
    kubeconfig: Annotated[str, NonEmpty] | None = None
    watch_timeout_s: Annotated[Duration, Range(ge=1)] = field(
        default=300.0, metadata=key("watchTimeout")
    )
    backoff_initial_s: Annotated[Duration, Positive] = field(
        default=0.2, metadata=key("backoffInitial")
    )
    backoff_max_s: Annotated[Duration, Positive] = field(default=30.0, metadata=key("backoffMax"))
    timeout_s: Annotated[Duration, Positive] = field(default=10.0, metadata=key("timeout"))

    def validate(self) -> None:
        if self.backoff_max_s < self.backoff_initial_s:
            raise FieldError("backoffMax", "must be >= backoffInitial")
        if (self.inference_pool is None) == (self.selector is None):
            raise FieldError(
                "inferencePool", "give either inferencePool or selector (with targetPorts)"
            )
        if self.inference_pool_group is not None and self.inference_pool is None:
            raise FieldError("inferencePoolGroup", "applies to inferencePool only")
        if self.inference_pool is not None:
            if self.target_ports:
                raise FieldError(
                    "targetPorts", "comes from the InferencePool; give it only with selector"
                )
            return
        if not self.selector:
            raise FieldError("selector", "must name at least one label (it would select every pod)")
        if not 1 <= len(self.target_ports) <= MAX_TARGET_PORTS:
            raise FieldError("targetPorts", f"give 1 to {MAX_TARGET_PORTS} ports with selector")
        if len(set(self.target_ports)) != len(self.target_ports):
            raise FieldError("targetPorts", "a port is listed twice")


@dataclass(frozen=True)
class DiscoveryConfig:
    """``discovery``: where endpoints come from when they are not listed in ``endpoints``."""

    kubernetes: KubernetesDiscoveryConfig


@dataclass(frozen=True)
class PickerConfig:
    """Validated configuration; every field has passed its checks."""

    source: str = "<built-in default>"
    server: ServerConfig = field(default_factory=ServerConfig)
    endpoints: tuple[EndpointSpec, ...] = ()
    discovery: DiscoveryConfig | None = None
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
    request_log: RequestLogConfig | None = None
    tracing: TracingConfig | None = None


def hardware_table(config: PickerConfig) -> HardwareTable:
    """The hardware table a config describes (built-in classes plus its own)."""
    return HardwareTable(
        {c.name: c for c in config.hardware_classes}, config.default_hardware_class
    )


# -- the document -----------------------------------------------------------------------------


def _address(value: str) -> bool:
    return bool(value)


@dataclass(frozen=True)
class _EndpointEntry:
    address: Annotated[str, Check(_address, "required (ip:port)")]
    labels: Mapping[str, str] = field(default_factory=dict)

    def validate(self) -> None:
        try:
            split_address(self.address)
        except ValueError as exc:
            raise FieldError("address", str(exc)) from None


@dataclass(frozen=True)
class _PluginEntry:
    type: Annotated[str, NonEmpty]
    name: str = ""
    parameters: Any = None


@dataclass(frozen=True)
class _ProfileRef:
    plugin_ref: Annotated[str, NonEmpty]
    weight: Annotated[float, Range(ge=0)] | None = None


@dataclass(frozen=True)
class _ProfileEntry:
    name: Annotated[str, NonEmpty]
    plugins: tuple[_ProfileRef, ...] = ()


@dataclass(frozen=True)
class _Objective:
    name: Annotated[str, NonEmpty]
    priority: int = 0


@dataclass(frozen=True)
class _HardwareClassEntry:
    name: Annotated[str, NonEmpty]
    prefill_speed: Annotated[float, Positive]
    decode_speed: Annotated[float, Positive]
    kv_capacity: Annotated[float, Positive]


@dataclass(frozen=True)
class _Hardware:
    default_class: str = DEFAULT_CLASS
    classes: tuple[_HardwareClassEntry, ...] = ()


def _api_version(value: str) -> bool:
    return value in API_VERSIONS


def _kind(value: str) -> bool:
    return value == KIND


@dataclass(frozen=True)
class _Document:
    api_version: (
        Annotated[str, Check(_api_version, f"not supported; use one of {', '.join(API_VERSIONS)}")]
        | None
    ) = None
    kind: Annotated[str, Check(_kind, f"expected {KIND}")] | None = None
    server: ServerConfig = field(default_factory=ServerConfig)
    endpoints: tuple[_EndpointEntry, ...] = ()
    discovery: DiscoveryConfig | None = None
    models: tuple[ModelConfig | Annotated[str, NonEmpty], ...] = ()
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    seed: int | None = None
    plugins: tuple[_PluginEntry, ...] | None = None
    scheduling_profiles: tuple[_ProfileEntry, ...] | None = None
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    objectives: tuple[_Objective, ...] = ()
    hardware: _Hardware = field(default_factory=_Hardware)
    kv_events: KVEventsConfig | None = None
    index: IndexConfig = field(default_factory=IndexConfig)
    request_log: RequestLogConfig | None = None
    tracing: TracingConfig | None = None
    # Upstream sections accepted for compatibility and ignored (a warning names them).
    feature_gates: Any = None
    data_layer: Any = None
    flow_control: Any = None
    request_handler: Any = None
    saturation_detector: Any = None
    parser: Any = None


# -- loading ----------------------------------------------------------------------------------


def read_config_text(path: str | Any) -> str:
    """A config file's text.

    Raises:
        ConfigError: unreadable or not UTF-8, naming the file.
    """
    from pathlib import Path

    path = Path(path)
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text: {exc}") from exc


def load_config(path: str | Any, registry: Registry) -> PickerConfig:
    """Read and validate a config file.

    Raises:
        ConfigError: naming the file and the offending plugin or field.
    """
    from pathlib import Path

    return parse_config_text(read_config_text(path), registry, source=str(Path(path)))


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
    document, notes = upstream.translate(document)
    for note in notes:
        log.warning("%s: %s", source, note)
    doc = decode(_Document, document, "")
    for section in IGNORED_SECTIONS:
        if isinstance(document, Mapping) and section in document:
            log.warning("%s: section %r is accepted for compatibility and ignored", source, section)
    raw_plugins: tuple[Any, ...]
    if doc.plugins is None:
        raw_plugins = tuple(decode(_PluginEntry, p, "plugins") for p in DEFAULT_PLUGINS)
        raw_profiles = doc.scheduling_profiles
        if raw_profiles is None:
            raw_profiles = (decode(_ProfileEntry, DEFAULT_PROFILE, "schedulingProfiles"),)
    else:
        raw_plugins, raw_profiles = doc.plugins, doc.scheduling_profiles
    plugins = _plugins(raw_plugins, registry)
    profiles, handler = _profiles(raw_profiles, plugins, registry)
    models = tuple(m if isinstance(m, ModelConfig) else ModelConfig(m) for m in doc.models)
    if doc.discovery is not None and doc.endpoints:
        raise ConfigError(
            "endpoints: static endpoints and discovery.kubernetes cannot be used together "
            "(discovery owns the endpoint set); remove one of them"
        )
    return PickerConfig(
        source=source,
        server=doc.server,
        endpoints=_endpoints(doc.endpoints),
        discovery=doc.discovery,
        models=models,
        metrics=doc.metrics,
        seed=doc.seed,
        plugins=plugins,
        profiles=profiles,
        handler=handler,
        admission=_admission(doc.admission, doc.objectives, models),
        hardware_classes=_hardware_classes(doc.hardware),
        default_hardware_class=doc.hardware.default_class,
        kv_events=doc.kv_events,
        index=doc.index,
        request_log=doc.request_log,
        tracing=doc.tracing,
    )


def _endpoints(entries: tuple[_EndpointEntry, ...]) -> tuple[EndpointSpec, ...]:
    seen: set[str] = set()
    for i, entry in enumerate(entries):
        if entry.address in seen:
            raise ConfigError(f"endpoints[{i}].address: {entry.address} is listed twice")
        seen.add(entry.address)
    return tuple(EndpointSpec(e.address, dict(e.labels)) for e in entries)


def _admission(
    section: AdmissionConfig, objectives: tuple[_Objective, ...], models: tuple[ModelConfig, ...]
) -> AdmissionConfig:
    by_name: dict[str, int] = {}
    for i, objective in enumerate(objectives):
        if objective.name in by_name:
            raise ConfigError(
                f"objectives[{i}].name: objective {objective.name!r} is defined twice"
            )
        by_name[objective.name] = objective.priority
    priorities: dict[str, int] = {}
    for model in models:
        for name in (model.name, *model.lora_adapters):
            priorities[name] = model.priority
    return replace(section, objectives=by_name, model_priorities=priorities)


def _hardware_classes(section: _Hardware) -> tuple[HardwareClass, ...]:
    classes: list[HardwareClass] = []
    names: set[str] = set()
    for i, entry in enumerate(section.classes):
        if entry.name in names:
            raise ConfigError(f"hardware.classes[{i}].name: class {entry.name!r} is defined twice")
        names.add(entry.name)
        classes.append(
            HardwareClass(entry.name, entry.prefill_speed, entry.decode_speed, entry.kv_capacity)
        )
    if section.default_class not in names and section.default_class not in BUILTIN_HARDWARE_CLASSES:
        raise ConfigError(
            f"hardware.defaultClass: unknown class {section.default_class!r}; known: "
            f"{', '.join(sorted({*BUILTIN_HARDWARE_CLASSES, *names}))}"
        )
    return tuple(classes)


def _plugins(entries: tuple[_PluginEntry, ...], registry: Registry) -> tuple[PluginConfig, ...]:
    plugins: list[PluginConfig] = []
    names: set[str] = set()
    for i, entry in enumerate(entries):
        name = entry.name or entry.type
        where = f"plugins[{i}] ({name})"
        type_name, params = registry.parse_plugin(entry.type, entry.parameters, where)
        if name in names:
            raise ConfigError(f"{where}: plugin name {name!r} is used twice")
        names.add(name)
        plugins.append(PluginConfig(name, type_name, params))
    return tuple(plugins)


def _profiles(
    raw: tuple[_ProfileEntry, ...] | None, plugins: tuple[PluginConfig, ...], registry: Registry
) -> tuple[tuple[ProfileConfig, ...], str]:
    kinds: dict[str, PluginKind] = {p.name: registry.kind(p.type) for p in plugins}
    handlers = [name for name, kind in kinds.items() if kind == "profile-handler"]
    if len(handlers) > 1:
        raise ConfigError(f"plugins: only one profile handler allowed, got {', '.join(handlers)}")
    if raw is None:
        # No profiles: one `default` profile with every filter, scorer and picker declared.
        refs = tuple(_ProfileRef(p.name) for p in plugins if kinds[p.name] != "profile-handler")
        raw = (_ProfileEntry("default", refs),)
    if not raw:
        raise ConfigError("schedulingProfiles: at least one profile is required")
    profiles: list[ProfileConfig] = []
    profile_names: set[str] = set()
    default_picker = next((n for n, k in kinds.items() if k == "picker"), None)
    for i, profile in enumerate(raw):
        name = profile.name
        if name in profile_names:
            raise ConfigError(f"schedulingProfiles[{i}].name: profile {name!r} is defined twice")
        profile_names.add(name)
        entries: list[ProfileEntry] = []
        pickers = 0
        for j, ref in enumerate(profile.plugins):
            where = f"schedulingProfiles[{i}] ({name}).plugins[{j}]"
            kind = kinds.get(ref.plugin_ref)
            if kind is None:
                raise ConfigError(
                    f"{where}.pluginRef: no plugin named {ref.plugin_ref!r}; "
                    f"declared: {', '.join(kinds) or 'none'}"
                )
            if kind == "profile-handler":
                raise ConfigError(
                    f"{where}: {ref.plugin_ref!r} is a profile handler, not a profile step"
                )
            if kind not in SCORING_KINDS and ref.weight is not None:
                log.warning("%s: weight on %s %r has no effect", where, kind, ref.plugin_ref)
            pickers += kind == "picker"
            entries.append(ProfileEntry(ref.plugin_ref, 1.0 if ref.weight is None else ref.weight))
        if pickers > 1:
            raise ConfigError(f"schedulingProfiles[{i}] ({name}): more than one picker")
        if pickers == 0:
            entries.append(ProfileEntry(default_picker or "max-score-picker", 1.0))
        profiles.append(ProfileConfig(name, tuple(entries)))
    handler = handlers[0] if handlers else ""
    if not handler and len(profiles) > 1 and "default" not in profile_names:
        raise ConfigError(
            "schedulingProfiles: several profiles need a profile handler plugin "
            "(or a profile named 'default' for single-profile-handler)"
        )
    return tuple(profiles), handler
