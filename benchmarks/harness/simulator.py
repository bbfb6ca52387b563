"""Offline cluster simulator: a trace replayed against N simulated endpoints in model time.

Why event-driven: a Python object per decode step per request would make a 12,000-request
trace over 16 endpoints take tens of minutes. With continuous batching every running sequence
advances one token per engine step, so an endpoint's state only changes at a few moments per
request (admission, prefill chunks, first token, finish). Between them the simulator jumps:

```
endpoint timeline    ┌prefill step┐┌prefill step┐┌─── decode-only stretch: k steps of d(n) ───┐
                     │ chunk ≤ 8192 ││ last chunk ││ jump to the step where the next sequence  │
arrival ─> waiting ─>│ + 1 token for ││ first token││ finishes (heap of finish counters), or to │
                     │ every decoder ││            ││ the step boundary after a new arrival      │
```

- ``counter`` counts an endpoint's steps; a decoding sequence finishes when the counter
  reaches its ``finish_counter``, so advancing k steps is O(1) and finding the next finish is a
  heap peek. Each step of a stretch is longer than the last by the KV read of one more token per
  sequence, so a stretch lasts an arithmetic sum. Prefill steps are simulated one by one, each
  chunk priced at its context position.
- Step duration, admission (FIFO; all blocks of prompt and output reserved up front; the last
  prompt token always recomputed), chunked prefill within ``max_num_batched_tokens``, a prompt
  block cached from the step that schedules its chunk (``ClusterConfig.cached_when``): the same
  rules as :mod:`kv_picker_bench.sim.engine`, with its :class:`~kv_picker_bench.sim.engine.TimingModel`
  and hardware classes, and the same :class:`~kv_picker_bench.sim.cache.PrefixCache` (exact block
  accounting, LRU eviction of unreferenced blocks, per-endpoint capacity).
- Routing goes through the service's own code: each policy is an EndpointPickerConfig document
  parsed by :func:`kv_picker.config.parse_config`, built into a
  :class:`~kv_picker.scheduling.scheduler.Scheduler`, and every request is routed by the
  service's :class:`~kv_picker.director.Director` (admission and shedding included). The
  simulator owns the clock handed to the :class:`~kv_picker.state.endpoints.EndpointStore` and
  the build context, writes scraped metrics into the store on a simulated scrape schedule (so
  scorers see values up to one interval old, like a real scrape), tells each request's handle
  its first token and its end (the director keeps the in-flight and queued-prefill counts), and
  delivers the caches' KV events (optionally delayed) to plugins that subscribe to them.
- P/D: when a policy's profile handler returns a ``prefill`` profile, the prompt runs on the
  prefill endpoint (one output token), then the decode endpoint admits the request, pulls the
  prompt KV it does not hold locally (``latency + bytes / bandwidth``) and decodes.
- Queued prefill work: the director counts each pick's uncached prompt tokens (as the policy's
  prefix scorer saw them) on the endpoint that runs the prefill (the prefill endpoint under
  P/D, else the destination), and the client's first token (or the request's end without one)
  takes them off again, exactly as in the service.

Deterministic: no randomness besides the policy's own generator, seeded per run.
"""

from __future__ import annotations

import heapq
import math
import random
import time
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, runtime_checkable

import xxhash

from kv_picker.config import PickerConfig, hardware_table
from kv_picker.director import Director, RoutedRequest
from kv_picker.endpoint import ROLE_LABEL, EndpointId, EndpointSpec
from kv_picker.errors import PickerError, SaturatedError
from kv_picker.metrics import PickerMetrics
from kv_picker.request import LLMRequest, Prompt
from kv_picker.scheduling.context import BuildContext
from kv_picker.scheduling.registry import Registry
from kv_picker.scheduling.scheduler import Scheduler
from kv_picker.scheduling.signals import PROMPT_TOKENS
from kv_picker.state.endpoints import EndpointStore
from kv_picker.state.hardware import HARDWARE_CLASS_LABEL
from kv_picker_bench.harness.traces import Trace, TraceRequest, prompt_text
from kv_picker_bench.sim.cache import PrefixCache, StoredBlock
from kv_picker_bench.sim.engine import CACHED_WHEN, HardwareClass, TimingModel, hardware_class
from kv_picker_bench.sim.timing import DEFAULT_TIMING

BLOCK_KEYS_STATE = "harness.block_keys"
"""``LLMRequest.state`` key: the request's engine block keys (what a tokenizer would give).

The exact prompt length goes under :data:`kv_picker.scheduling.signals.PROMPT_TOKENS`, as the
service's precise prefix scorer publishes it.
"""

DEFAULT_NUM_GPU_BLOCKS = 32_768
"""KV capacity of an H100-class simulated endpoint in the harness (524,288 tokens of 16)."""


# ------------------------------------------------------------------------------- config


@dataclass(frozen=True, slots=True)
class EndpointSetup:
    """One simulated endpoint.

    Attributes:
        role: ``both``, ``prefill`` or ``decode`` (the ``llm-d.ai/role`` label).
        hardware: Hardware class name (see :data:`kv_picker_bench.sim.engine.HARDWARE_CLASSES`).
        num_gpu_blocks: KV capacity in blocks; ``None`` scales the cluster default by the
            hardware class's ``kv_capacity``.
    """

    role: str = "both"
    hardware: str = "H100"
    num_gpu_blocks: int | None = None


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """The simulated cluster and the simulation's knobs.

    Attributes:
        endpoints: One entry per endpoint.
        block_size: Tokens per KV block (vLLM's ``--block-size``).
        num_gpu_blocks: Default KV capacity of an H100-class endpoint, in blocks.
        max_num_seqs: Most requests running at once per endpoint.
        max_num_batched_tokens: Token budget of one engine step (chunked prefill).
        max_model_len: Longest prompt plus output; longer requests get an error.
        timing: Timing profile of an H100-class endpoint (see :mod:`kv_picker_bench.sim.timing`),
            scaled per hardware class.
        scrape_interval_s: Period of the simulated metrics scrape.
        kv_event_delay_s: Delay between a cache change and its KV event reaching plugins.
        transfer_latency_s: Fixed cost of one P/D KV transfer.
        transfer_bytes_per_s: P/D KV transfer bandwidth.
        kv_bytes_per_token: KV size of one token (for P/D transfer time and volume).
        cache_output_blocks: Cache the blocks decode fills (prompt tail plus output) when a
            request finishes, as vLLM and the simulated endpoint do. Their keys come from the
            trace's ``output_ids`` when it has them (chat: the next turn hits them), else from
            the prompt (the simulated endpoint seeds its output tokens with the prompt, so equal
            prompts fill equal blocks).
        model: Model name put in requests.
        first_byte_seen: The picker sees each response's first byte, as through Envoy with
            response bodies sent to it (the GIE's configuration). False: it sees only each
            response's end, as with response trailers alone (``bench overhead --modes lean``),
            so a request's prefill stays queued in its accounting until the endpoint's
            scraped first-token count shows it ended (or the request ends).
        first_tokens_scraped: The scrape reports each endpoint's first-token count
            (vLLM's ``vllm:time_to_first_token_seconds_count``). False: as a server that
            exports none, so without first bytes a prefill stays queued until its request ends.
        cached_when: When a prompt block becomes a cache hit: ``scheduled``, from the step that
            schedules its prefill chunk, as vLLM v1 caches blocks when it allocates their slots
            (so a request admitted in the same step or later hits what a running one is
            computing); or ``computed``, once that step has ended, the model of the results
            measured before ``scheduled`` (see :mod:`kv_picker_bench.sim.engine`).
    """

    endpoints: tuple[EndpointSetup, ...]
    block_size: int = 16
    num_gpu_blocks: int = DEFAULT_NUM_GPU_BLOCKS
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    max_model_len: int = 131_072
    timing: TimingModel = DEFAULT_TIMING
    scrape_interval_s: float = 0.05
    kv_event_delay_s: float = 0.0
    transfer_latency_s: float = 0.001
    transfer_bytes_per_s: float = 25e9
    kv_bytes_per_token: int = 131_072
    cache_output_blocks: bool = True
    model: str = "sim-model"
    first_byte_seen: bool = True
    first_tokens_scraped: bool = True
    cached_when: str = "scheduled"

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise ValueError("the cluster needs at least one endpoint")
        for name in ("block_size", "num_gpu_blocks", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.cached_when not in CACHED_WHEN:
            raise ValueError(
                f"cached_when must be one of {', '.join(CACHED_WHEN)}, got {self.cached_when!r}"
            )
        if self.scrape_interval_s <= 0 or self.transfer_bytes_per_s <= 0:
            raise ValueError("scrape_interval_s and transfer_bytes_per_s must be positive")
        for i, endpoint in enumerate(self.endpoints):
            if endpoint.role not in ("both", "prefill", "decode"):
                raise ValueError(f"endpoint {i}: role must be both, prefill or decode")
            hardware_class(endpoint.hardware)

    def capacity_blocks(self, index: int) -> int:
        """KV capacity of endpoint ``index`` in blocks."""
        setup = self.endpoints[index]
        if setup.num_gpu_blocks is not None:
            return setup.num_gpu_blocks
        return max(1, round(self.num_gpu_blocks * hardware_class(setup.hardware).kv_capacity))

    @property
    def total_capacity_blocks(self) -> int:
        return sum(self.capacity_blocks(i) for i in range(len(self.endpoints)))

    def address(self, index: int) -> str:
        """The simulated ``ip:port`` of endpoint ``index``."""
        return f"10.{index // 62500}.{index // 250 % 250}.{index % 250 + 1}:8000"


def uniform_cluster(count: int, **overrides: Any) -> ClusterConfig:
    """``count`` identical H100 endpoints with role ``both``."""
    return ClusterConfig(endpoints=tuple(EndpointSetup() for _ in range(count)), **overrides)


# ------------------------------------------------------------------- plugin side inputs


@runtime_checkable
class KVEventSubscriber(Protocol):
    """A plugin that wants the endpoints' KV events (what a precise index consumes)."""

    def on_blocks_stored(self, endpoint_id: int, block_keys: Sequence[int]) -> None:
        """Blocks became cached on an endpoint."""

    def on_blocks_removed(self, endpoint_id: int, block_keys: Sequence[int]) -> None:
        """Blocks were evicted from an endpoint."""


@runtime_checkable
class RequestObserver(Protocol):
    """A plugin that follows its requests' progress (as a router sees the response stream)."""

    def on_first_token(self, request: LLMRequest, endpoint_id: int) -> None:
        """The request's first token reached the router."""

    def on_finished(self, request: LLMRequest, endpoint_id: int) -> None:
        """The request's response ended."""


# ------------------------------------------------------------------------------ results


OK = "ok"
REJECTED = "rejected"  # the endpoint refused it (too long for the model or the KV cache)
SHED = "shed"  # the picker refused it (429: every endpoint filtered out, or saturated)
ERROR = "error"  # the picker failed (500/503)


@dataclass(slots=True)
class RequestOutcome:
    """What happened to one trace request.

    Times are model seconds from the start of the trace; ``nan`` when not reached.
    """

    index: int
    arrival_s: float
    status: str = OK
    endpoint: int = -1
    prefill_endpoint: int = -1
    first_token_s: float = math.nan
    finish_s: float = math.nan
    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    transferred_tokens: int = 0
    detail: str = ""

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float:
        return self.finish_s - self.arrival_s

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first (nan for one-token outputs)."""
        if self.output_tokens <= 1:
            return math.nan
        return (self.finish_s - self.first_token_s) / (self.output_tokens - 1)


@dataclass(slots=True)
class EndpointStats:
    """Per-endpoint totals of one run."""

    requests: int = 0
    prompt_tokens: int = 0
    computed_prompt_tokens: int = 0
    output_tokens: int = 0
    busy_s: float = 0.0
    max_used_blocks: int = 0
    capacity_blocks: int = 0


@dataclass(slots=True)
class SimulationResult:
    """Everything one policy's run produced."""

    policy: str
    outcomes: list[RequestOutcome]
    endpoints: list[EndpointStats]
    makespan_s: float
    wall_s: float
    num_events: int
    num_schedule_calls: int
    extra: dict[str, Any] = field(default_factory=dict)


RouteObserver = Callable[[TraceRequest, RoutedRequest, list[int]], None]


# ------------------------------------------------------------------------------- engine


_IDLE, _STEP, _STRETCH = 0, 1, 2


@dataclass(slots=True)
class _Seq:
    """One sequence inside an engine (a request, or one leg of a P/D request)."""

    outcome: RequestOutcome
    request: LLMRequest | None
    trace_request: TraceRequest
    keys: list[int]
    prompt_tokens: int
    output_tokens: int
    num_blocks_total: int
    leg: int  # 0 aggregated, 1 prefill leg, 2 decode leg (KV comes from the prefill leg)
    decode_endpoint: int = -1
    computed: int = 0
    held: int = 0
    private: int = 0
    finish_counter: int = 0
    loading: bool = False


class _Engine:
    """The scheduling state of one endpoint (see the module docstring)."""

    __slots__ = (
        "cache",
        "counter",
        "decode_context",
        "decoding",
        "event_s",
        "first_tokens",
        "hardware",
        "id",
        "max_batched",
        "max_seqs",
        "mode",
        "num_running",
        "plan",
        "plan_prefill_tokens",
        "prefilling",
        "stats",
        "stretch_c0",
        "stretch_d",
        "stretch_dd",
        "stretch_steps",
        "stretch_t0",
        "version",
        "waiting",
    )

    def __init__(
        self, endpoint_id: int, config: ClusterConfig, capacity_blocks: int, listener: Any
    ) -> None:
        self.id = endpoint_id
        self.hardware: HardwareClass = hardware_class(config.endpoints[endpoint_id].hardware)
        self.cache = PrefixCache(capacity_blocks, listener)
        self.max_batched = config.max_num_batched_tokens
        self.max_seqs = config.max_num_seqs
        self.waiting: deque[_Seq] = deque()
        self.prefilling: deque[_Seq] = deque()
        self.decoding: list[tuple[int, int, _Seq]] = []
        # Sum over decoding of (context - counter): the contexts at counter c sum to this + n*c.
        self.decode_context = 0
        self.counter = 0
        self.num_running = 0
        self.mode = _IDLE
        self.plan: list[tuple[_Seq, int]] = []
        self.plan_prefill_tokens = 0
        self.stretch_t0 = 0.0
        self.stretch_c0 = 0
        self.stretch_d = 0.0
        self.stretch_dd = 0.0
        self.stretch_steps = 0
        self.event_s = math.inf
        self.version = 0
        self.stats = EndpointStats(capacity_blocks=capacity_blocks)
        # Requests given a first token (vllm:time_to_first_token_seconds's count).
        self.first_tokens = 0


class _KVEventRelay:
    """The cache listener of one endpoint: forwards block changes to subscribers."""

    __slots__ = ("_deliver", "_endpoint_id")

    def __init__(self, endpoint_id: int, deliver: Callable[[int, bool, list[int]], None]) -> None:
        self._endpoint_id = endpoint_id
        self._deliver = deliver

    def on_stored(self, blocks: Sequence[StoredBlock]) -> None:
        self._deliver(self._endpoint_id, True, [block.block_hash for block in blocks])

    def on_removed(self, block_hashes: Sequence[int]) -> None:
        self._deliver(self._endpoint_id, False, list(block_hashes))

    def on_cleared(self) -> None:  # resets never happen in a replay
        pass


class SimClock:
    """The model-time clock shared by the store, the plugins and the simulator."""

    __slots__ = ("now_s",)

    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


# ---------------------------------------------------------------------------- simulator


_EV_ENGINE, _EV_TRANSFER, _EV_KV = 0, 1, 2

# Decision counters some plugins keep (reported per run when present).
_PLUGIN_COUNTERS = (
    "cache_decisions",
    "balance_decisions",
    "disaggregated",
    "aggregated",
    "prefill_unavailable",
)


def block_keys(request: TraceRequest, block_tokens: int, block_size: int) -> list[int]:
    """Engine block keys of a request's full prompt blocks: ``id * per_id + j``.

    Equal ids give equal keys, and because trace ids are chained prefix hashes, a key names
    its block and everything before it, as a vLLM block hash does.
    """
    per_id = block_tokens // block_size
    num_full = request.input_tokens // block_size
    ids = request.hash_ids
    if per_id == 1:
        return ids[:num_full]
    offsets = range(per_id)
    keys = [hash_id * per_id + j for hash_id in ids for j in offsets]
    del keys[num_full:]
    return keys


def output_block_keys(request: TraceRequest, block_tokens: int, block_size: int) -> list[int]:
    """Keys of the full blocks decode fills after the prompt's (prompt tail plus output).

    From the trace's ``output_ids`` when it has them (a chat's next turn hits them); else
    derived from the prompt, because the simulated endpoint seeds its output tokens with the
    prompt, so equal prompts fill equal blocks on one endpoint. Those keys are negative and
    never match a prompt block.
    """
    first = request.input_tokens // block_size
    num_full = (request.input_tokens + request.output_tokens - 1) // block_size
    if num_full <= first:
        return []
    if request.output_ids is not None:
        tokens = request.input_tokens + request.output_tokens - 1
        filled = replace(request, input_tokens=tokens, hash_ids=request.output_ids)
        return block_keys(filled, block_tokens, block_size)[first:num_full]
    prompt = array("q", request.hash_ids).tobytes() + request.input_tokens.to_bytes(8, "little")
    base = -((xxhash.xxh3_64_intdigest(prompt) >> 24) << 24) - 1
    return [base - i for i in range(first, num_full)]


def _context_offset(seq: _Seq) -> int:
    """A decoding sequence's context (prompt plus outputs so far) at step counter 0.

    At counter ``c`` it has generated ``output_tokens - (finish_counter - c)`` tokens, so its
    context is this offset plus ``c``.
    """
    return seq.prompt_tokens + seq.output_tokens - seq.finish_counter


def _stretch_s(step_s: float, growth_s: float, steps: int) -> float:
    """Duration of ``steps`` decode steps, the first ``step_s`` long, each ``growth_s`` longer."""
    return steps * step_s + growth_s * steps * (steps - 1) / 2


def _stretch_steps_until(step_s: float, growth_s: float, elapsed_s: float) -> int:
    """The fewest steps of a stretch (see :func:`_stretch_s`) that last at least ``elapsed_s``."""
    if growth_s <= 0:
        return max(0, math.ceil(elapsed_s / step_s - 1e-9))
    # Positive root of growth/2 k^2 + (step - growth/2) k - elapsed = 0, in the form that does
    # not cancel when growth is tiny.
    linear = step_s - growth_s / 2
    root = 2 * elapsed_s / (linear + math.sqrt(linear * linear + 2 * growth_s * elapsed_s))
    return max(0, math.ceil(root - 1e-9))


class ClusterSimulator:
    """Replays one trace under one policy.

    Args:
        trace: The requests.
        config: The cluster.
        picker_config: The policy, validated by :func:`kv_picker.config.parse_config`.
        registry: Plugin registry (the service's built-ins plus the harness's baselines).
        policy: Name for results.
        seed: Seed of the policy's generator (ties, random pickers).
        progress: Called with the number of requests routed so far, now and then.
        needs_prompt: Build each request's prompt text (policies that never read it skip it).
        check_invariants: Check every cache's bookkeeping after every event (slow; tests).
        on_route: Called after every pick with the trace request, the routed request (routed
            with ``explain``, so its result keeps every scorer's scores) and, per endpoint,
            the leading blocks of the request's prompt it holds or is computing (the truth the
            picker estimates; ``kv-picker bench moves`` reads it).
    """

    def __init__(
        self,
        trace: Trace,
        config: ClusterConfig,
        picker_config: PickerConfig,
        registry: Registry,
        policy: str = "policy",
        seed: int = 0,
        progress: Callable[[int], None] | None = None,
        needs_prompt: bool = True,
        check_invariants: bool = False,
        on_route: RouteObserver | None = None,
    ) -> None:
        if trace.block_tokens % config.block_size:
            raise ValueError(
                f"the trace's {trace.block_tokens}-token blocks are not a multiple of the "
                f"engine's block size {config.block_size}"
            )
        self.trace = trace
        self.config = config
        self.policy = policy
        self.progress = progress
        self.needs_prompt = needs_prompt
        self.check_invariants = check_invariants
        self.on_route = on_route
        self.clock = SimClock()
        self.store = EndpointStore(self.clock)
        specs = []
        for i, setup in enumerate(config.endpoints):
            labels = {ROLE_LABEL: setup.role, HARDWARE_CLASS_LABEL: setup.hardware}
            specs.append(EndpointSpec(config.address(i), labels))
        self.store.set_endpoints(specs)
        # A fresh store hands out dense ids in order: endpoint id == engine index.
        if [e.id for e in self.store.all()] != list(range(len(specs))):
            raise AssertionError("endpoint ids are not dense")
        self.rng = random.Random(seed)
        ctx = BuildContext(
            self.store,
            self.rng,
            self.clock,
            picker_config.metrics.staleness_s,
            hardware=hardware_table(picker_config),
        )
        self.scheduler = Scheduler(picker_config, registry, ctx, None)
        # The service's request lifecycle: admission, the pick, in-flight and queued-prefill
        # accounting (its metrics go to a registry of the run's own).
        self.director = Director(
            picker_config, self.store, self.scheduler, self.rng, PickerMetrics()
        )
        plugins = list(self.scheduler.plugins.values())
        self.subscribers = [p for p in plugins if isinstance(p, KVEventSubscriber)]
        self.observers = [p for p in plugins if isinstance(p, RequestObserver)]
        self.engines = [
            _Engine(
                i,
                config,
                config.capacity_blocks(i),
                _KVEventRelay(i, self._kv_event) if self.subscribers else None,
            )
            for i in range(len(config.endpoints))
        ]
        self._heap: list[tuple[float, int, int, Any]] = []
        self._order = 0
        self._dirty: set[int] = set(range(len(self.engines)))
        self._last_scrape_s = -math.inf
        self._next_scrape_s = 0.0
        self._stamped_scrape_s = -math.inf
        self.num_events = 0
        self.outcomes: list[RequestOutcome] = []
        # Trace index -> the director's handle, from the pick until the request ends.
        self._routed: dict[int, RoutedRequest] = {}
        self._timing = config.timing

    # ------------------------------------------------------------------------- plumbing

    def _push(self, time_s: float, kind: int, payload: Any) -> None:
        self._order += 1
        heapq.heappush(self._heap, (time_s, self._order, kind, payload))

    def _schedule_engine(self, engine: _Engine, time_s: float) -> None:
        engine.version += 1
        engine.event_s = time_s
        self._push(time_s, _EV_ENGINE, (engine, engine.version))

    def _kv_event(self, endpoint_id: int, stored: bool, keys: list[int]) -> None:
        delay_s = self.config.kv_event_delay_s
        if delay_s > 0:
            self._push(self.clock.now_s + delay_s, _EV_KV, (endpoint_id, stored, keys))
        else:
            self._deliver_kv(endpoint_id, stored, keys)

    def _deliver_kv(self, endpoint_id: int, stored: bool, keys: list[int]) -> None:
        for subscriber in self.subscribers:
            if stored:
                subscriber.on_blocks_stored(endpoint_id, keys)
            else:
                subscriber.on_blocks_removed(endpoint_id, keys)

    def _scrape_until(self, time_s: float) -> None:
        """Take the scrape due at the last tick <= time_s (the state has not changed since)."""
        interval = self.config.scrape_interval_s
        if time_s < self._next_scrape_s:
            return
        tick_s = self._next_scrape_s + math.floor((time_s - self._next_scrape_s) / interval) * (
            interval
        )
        clock = self.clock
        saved_s = clock.now_s
        clock.now_s = tick_s
        store = self.store
        first_tokens = self.config.first_tokens_scraped
        for index in sorted(self._dirty):
            engine = self.engines[index]
            store.update_metrics(
                EndpointId(index),
                waiting=float(len(engine.waiting)),
                running=float(engine.num_running),
                kv_usage=engine.cache.usage,
                block_size_tokens=self.config.block_size,
                num_gpu_blocks=engine.cache.num_gpu_blocks,
                first_tokens=float(engine.first_tokens) if first_tokens else None,
            )
        clock.now_s = saved_s
        self._dirty.clear()
        self._last_scrape_s = tick_s
        self._next_scrape_s = tick_s + interval

    def _stamp_scrapes(self) -> None:
        # Clean endpoints were scraped too (nothing changed): refresh their scrape time.
        if self._stamped_scrape_s != self._last_scrape_s:
            scraped_s = self.store.scraped_s
            for endpoint_id in range(len(self.engines)):
                scraped_s[endpoint_id] = self._last_scrape_s
            self._stamped_scrape_s = self._last_scrape_s

    # ---------------------------------------------------------------------------- main

    def run(self) -> SimulationResult:
        """Replay the whole trace; returns once every request has finished or failed."""
        started = time.perf_counter()
        requests = self.trace.requests
        heap = self._heap
        clock = self.clock
        index = 0
        count = len(requests)
        schedule_calls = 0
        progress = self.progress
        while index < count or heap:
            arrival_s = requests[index].arrival_s if index < count else math.inf
            if heap and heap[0][0] <= arrival_s:
                time_s, _, kind, payload = heapq.heappop(heap)
                if kind == _EV_ENGINE:
                    engine, version = payload
                    if version != engine.version:
                        continue
                    self._scrape_until(time_s)
                    clock.now_s = time_s
                    self.num_events += 1
                    self._on_engine_event(engine, time_s)
                elif kind == _EV_TRANSFER:
                    self._scrape_until(time_s)
                    clock.now_s = time_s
                    self.num_events += 1
                    self._on_transfer_done(payload, time_s)
                else:
                    clock.now_s = time_s
                    self._deliver_kv(*payload)
                if self.check_invariants:
                    self._check()
                continue
            self._scrape_until(arrival_s)
            clock.now_s = arrival_s
            self.num_events += 1
            self._route(requests[index], arrival_s)
            schedule_calls += 1
            index += 1
            if self.check_invariants:
                self._check()
            if progress is not None and (index & 255) == 0:
                progress(index)
        if progress is not None:
            progress(count)
        makespan_s = 0.0
        for outcome in self.outcomes:
            if outcome.status == OK and outcome.finish_s > makespan_s:
                makespan_s = outcome.finish_s
        stats = [engine.stats for engine in self.engines]
        for engine in self.engines:
            if engine.num_running or engine.waiting:
                raise AssertionError(f"endpoint {engine.id} still has work after the replay")
        if self._routed:
            raise AssertionError(f"{len(self._routed)} requests never finished")
        if any(self.store.in_flight) or any(self.store.prefill_requests):
            raise AssertionError("in-flight or queued-prefill counts left after the replay")
        extra: dict[str, Any] = {}
        for plugin in self.scheduler.plugins.values():
            for counter in _PLUGIN_COUNTERS:
                value = getattr(plugin, counter, None)
                if isinstance(value, int):
                    extra[f"{plugin.name}.{counter}"] = value
        return SimulationResult(
            policy=self.policy,
            outcomes=sorted(self.outcomes, key=lambda o: o.index),
            endpoints=stats,
            makespan_s=makespan_s,
            wall_s=time.perf_counter() - started,
            num_events=self.num_events,
            num_schedule_calls=schedule_calls,
            extra=extra,
        )

    def _check(self) -> None:
        for engine in self.engines:
            cache = engine.cache
            cache.check_invariants()
            if cache.num_cached_blocks + cache.num_private_blocks > cache.num_gpu_blocks:
                raise AssertionError(f"endpoint {engine.id}: cache above capacity")
            if engine.num_running > engine.max_seqs:
                raise AssertionError(f"endpoint {engine.id}: more than max_num_seqs running")
            if self.store.in_flight[engine.id] < 0:
                raise AssertionError(f"endpoint {engine.id}: negative in-flight count")
        in_flight = [0] * len(self.engines)
        for routed in self._routed.values():
            in_flight[routed.endpoint.id] += 1
            if routed.prefill_endpoint is not None and routed.prefilling:
                in_flight[routed.prefill_endpoint.id] += 1
        if in_flight != self.store.in_flight[: len(self.engines)]:
            raise AssertionError("the store's in-flight counts differ from the open requests")

    # ------------------------------------------------------------------------- routing

    @staticmethod
    def _held_blocks(engine: _Engine, keys: Sequence[int]) -> int:
        """The leading blocks of ``keys`` that ``engine`` holds in its cache or is computing
        for a request whose prefill has not finished (those are cached once it has)."""
        held = engine.cache.lookup(keys)
        for seq in (*engine.waiting, *engine.prefilling):
            other = seq.keys
            n = 0
            for a, b in zip(keys, other, strict=False):
                if a != b:
                    break
                n += 1
            held = max(held, n)
        return held

    def _route(self, trace_request: TraceRequest, now_s: float) -> None:
        config = self.config
        outcome = RequestOutcome(
            trace_request.index,
            now_s,
            prompt_tokens=trace_request.input_tokens,
            output_tokens=trace_request.output_tokens,
        )
        self.outcomes.append(outcome)
        keys = block_keys(trace_request, self.trace.block_tokens, config.block_size)
        prompt = prompt_text(trace_request, self.trace.block_tokens) if self.needs_prompt else ""
        headers = {"x-session-id": trace_request.session} if trace_request.session else {}
        # A request names its adapter as the model; the pool still serves the base model.
        request = LLMRequest(
            request_id=str(trace_request.index),
            model=trace_request.lora or config.model,
            target_model=config.model,
            path="/v1/completions",
            prompt=Prompt("completions", prompt),
            stream=True,
            cache_salt=trace_request.salt,
            lora_adapter=trace_request.lora,
            headers=headers,
            body_size_bytes=len(prompt) + 120,
            state={BLOCK_KEYS_STATE: keys, PROMPT_TOKENS: trace_request.input_tokens},
        )
        self._stamp_scrapes()
        try:
            if self.on_route is None:
                routed = self.director.route(request)
            else:
                routed = self.director.route(request, explain=True)
        except SaturatedError as exc:
            outcome.status, outcome.detail = SHED, exc.message
            return
        except PickerError as exc:
            outcome.status, outcome.detail = ERROR, f"{exc.status} {exc.message}"
            return
        except Exception as exc:  # a plugin bug: counted, never a crashed replay
            outcome.status, outcome.detail = ERROR, f"{type(exc).__name__}: {exc}"
            return
        self._routed[outcome.index] = routed
        if self.on_route is not None:
            self.on_route(trace_request, routed, [self._held_blocks(e, keys) for e in self.engines])
        if not config.first_byte_seen:
            routed.no_first_byte()
        decode_id = routed.endpoint.id
        prefill_id = routed.prefill_endpoint.id if routed.prefill_endpoint is not None else -1
        decode_index = decode_id
        outcome.endpoint = decode_index
        num_kv_tokens = trace_request.input_tokens + trace_request.output_tokens - 1
        reason = self._reject_reason(trace_request, num_kv_tokens)
        if reason:
            outcome.status, outcome.detail = REJECTED, reason
            self._end(outcome.index)
            return
        self.engines[decode_index].stats.requests += 1
        if prefill_id >= 0:
            outcome.prefill_endpoint = prefill_id
            seq = _Seq(
                outcome,
                request,
                trace_request,
                keys,
                trace_request.input_tokens,
                1,
                -(-trace_request.input_tokens // config.block_size),
                leg=1,
                decode_endpoint=decode_index,
            )
            self._add(self.engines[prefill_id], seq, now_s)
        else:
            seq = _Seq(
                outcome,
                request,
                trace_request,
                keys,
                trace_request.input_tokens,
                trace_request.output_tokens,
                -(-num_kv_tokens // config.block_size),
                leg=0,
            )
            self._add(self.engines[decode_index], seq, now_s)

    def _end(self, index: int) -> None:
        """The request ended (finished, or refused by its endpoint): release its slot."""
        routed = self._routed.pop(index, None)
        if routed is not None:
            routed.finish()

    def _reject_reason(self, request: TraceRequest, num_kv_tokens: int) -> str:
        config = self.config
        total = request.input_tokens + request.output_tokens
        if total > config.max_model_len:
            return (
                f"{request.input_tokens} prompt + {request.output_tokens} output tokens exceed "
                f"max_model_len {config.max_model_len}"
            )
        return ""

    # -------------------------------------------------------------------------- engine

    def _add(self, engine: _Engine, seq: _Seq, now_s: float) -> None:
        if seq.num_blocks_total > engine.cache.num_gpu_blocks:
            outcome = seq.outcome
            outcome.status = REJECTED
            outcome.detail = (
                f"needs {seq.num_blocks_total} KV blocks; endpoint {engine.id} holds "
                f"{engine.cache.num_gpu_blocks}"
            )
            self._release_in_flight(seq)
            return
        engine.waiting.append(seq)
        self._dirty.add(engine.id)
        # Behind a blocked head (FIFO) or with every slot taken, only a finish can help.
        self._wake(engine, now_s, len(engine.waiting) == 1 and engine.num_running < engine.max_seqs)

    def _wake(self, engine: _Engine, now_s: float, may_admit: bool) -> None:
        """Something may run: start stepping, or end a decode stretch at the next boundary."""
        if engine.mode == _IDLE:
            self._boundary(engine, now_s)
        elif engine.mode == _STRETCH and may_admit:
            d, dd = engine.stretch_d, engine.stretch_dd
            steps = _stretch_steps_until(d, dd, now_s - engine.stretch_t0)
            if steps < engine.stretch_steps:
                engine.stats.busy_s -= _stretch_s(d, dd, engine.stretch_steps) - _stretch_s(
                    d, dd, steps
                )
                engine.stretch_steps = steps
                self._schedule_engine(engine, engine.stretch_t0 + _stretch_s(d, dd, steps))

    def _on_engine_event(self, engine: _Engine, now_s: float) -> None:
        if engine.mode == _STEP:
            self._complete_step(engine, now_s)
        elif engine.mode == _STRETCH:
            engine.counter = engine.stretch_c0 + engine.stretch_steps
        self._boundary(engine, now_s)

    def _complete_step(self, engine: _Engine, now_s: float) -> None:
        engine.counter += 1
        counter = engine.counter
        prefilling = engine.prefilling
        for seq, chunk in engine.plan:
            if chunk:
                seq.computed += chunk
                self._store_prompt(engine, seq, seq.computed)
                if seq.computed < seq.prompt_tokens:
                    continue
            # Prefill done (or a remote-prefilled sequence's first step): the first token.
            prefilling.popleft()
            self._first_token(engine, seq, now_s)
            if seq.output_tokens <= 1:
                self._finish(engine, seq, now_s)
            else:
                seq.finish_counter = counter + seq.output_tokens - 1
                order = 2 * seq.outcome.index + (seq.leg == 2)  # deterministic tie order
                heapq.heappush(engine.decoding, (seq.finish_counter, order, seq))
                engine.decode_context += _context_offset(seq)
        engine.plan = []
        self._dirty.add(engine.id)

    def _store_prompt(self, engine: _Engine, seq: _Seq, num_tokens: int) -> None:
        """Cache the sequence's full prompt blocks within its first ``num_tokens`` tokens."""
        num_full = min(num_tokens // self.config.block_size, len(seq.keys))
        if num_full > seq.held:
            keys = seq.keys
            engine.cache.store([StoredBlock(keys[i], None, ()) for i in range(seq.held, num_full)])
            seq.private -= num_full - seq.held
            seq.held = num_full

    def _boundary(self, engine: _Engine, now_s: float) -> None:
        """A step boundary: retire finished sequences, then plan and start the next step."""
        decoding = engine.decoding
        counter = engine.counter
        while decoding and decoding[0][0] <= counter:
            _, _, seq = heapq.heappop(decoding)
            engine.decode_context -= _context_offset(seq)
            self._finish(engine, seq, now_s)
        budget = engine.max_batched - len(decoding)
        at_schedule = self.config.cached_when == "scheduled"
        plan: list[tuple[_Seq, int]] = []
        prefill_tokens = 0
        for seq in engine.prefilling:
            if budget <= 0:
                break
            remaining = seq.prompt_tokens - seq.computed
            chunk = remaining if remaining < budget else budget
            plan.append((seq, chunk))
            if chunk and at_schedule:
                self._store_prompt(engine, seq, seq.computed + chunk)
            prefill_tokens += chunk
            budget -= chunk if chunk else 1
        waiting = engine.waiting
        while waiting and budget > 0 and engine.num_running < engine.max_seqs:
            seq = waiting[0]
            if not self._admit(engine, seq, now_s):
                break  # FIFO: a request that does not fit blocks the ones behind it
            waiting.popleft()
            if seq.loading:
                continue  # joins the prefilling queue when its KV has arrived
            engine.prefilling.append(seq)
            remaining = seq.prompt_tokens - seq.computed
            chunk = remaining if remaining < budget else budget
            plan.append((seq, chunk))
            if chunk and at_schedule:
                self._store_prompt(engine, seq, seq.computed + chunk)
            prefill_tokens += chunk
            budget -= chunk if chunk else 1
        hardware = engine.hardware
        timing = self._timing
        decode_context = engine.decode_context + len(decoding) * counter
        if plan:
            engine.mode = _STEP
            engine.plan = plan
            engine.plan_prefill_tokens = prefill_tokens
            # A chunk is priced at its context position (the tokens computed before it); a
            # remote-prefilled sequence's first step (chunk 0) reads its prompt's KV like a decode.
            chunks = [(chunk, seq.computed) for seq, chunk in plan if chunk]
            decode_context += sum(seq.computed for seq, chunk in plan if not chunk)
            duration_s = timing.step_duration_s(
                hardware, len(decoding) + len(plan), chunks, decode_context
            )
            engine.stats.busy_s += duration_s
            self._schedule_engine(engine, now_s + duration_s)
        elif decoding:
            engine.mode = _STRETCH
            num_decoding = len(decoding)
            step_s = timing.step_duration_s(hardware, num_decoding, (), decode_context)
            steps = decoding[0][0] - counter
            engine.stretch_t0 = now_s
            engine.stretch_c0 = counter
            engine.stretch_d = step_s
            # Every step, each decoding sequence's context grows by one token.
            engine.stretch_dd = timing.kv_read_s(hardware, num_decoding)
            engine.stretch_steps = steps
            stretch_s = _stretch_s(step_s, engine.stretch_dd, steps)
            engine.stats.busy_s += stretch_s  # corrected if the stretch is cut short
            self._schedule_engine(engine, now_s + stretch_s)
        else:
            engine.mode = _IDLE
            engine.event_s = math.inf
            engine.version += 1
        self._dirty.add(engine.id)

    def _admit(self, engine: _Engine, seq: _Seq, now_s: float) -> bool:
        cache = engine.cache
        block_size = self.config.block_size
        keys = seq.keys
        max_hit_blocks = (seq.prompt_tokens - 1) // block_size
        num_hits = cache.lookup(keys)
        if num_hits > max_hit_blocks:
            num_hits = max_hit_blocks
        num_new = seq.num_blocks_total - num_hits
        if not cache.allocate(keys[:num_hits], num_new):
            return False
        hit_tokens = num_hits * block_size
        engine.num_running += 1
        seq.held = num_hits
        seq.private = num_new
        seq.computed = hit_tokens
        outcome = seq.outcome
        stats = engine.stats
        stats.prompt_tokens += seq.prompt_tokens
        used = cache.num_used_blocks
        if used > stats.max_used_blocks:
            stats.max_used_blocks = used
        if seq.leg == 2:
            # The prompt's KV comes from the prefill endpoint, less what is cached here.
            transferred = seq.prompt_tokens - hit_tokens
            outcome.transferred_tokens = transferred
            seq.loading = True
            config = self.config
            transfer_s = (
                config.transfer_latency_s
                + transferred * config.kv_bytes_per_token / config.transfer_bytes_per_s
            )
            self._push(now_s + transfer_s, _EV_TRANSFER, (engine, seq))
        else:
            cache.record_query(seq.prompt_tokens, hit_tokens)
            outcome.cached_tokens = hit_tokens
            stats.computed_prompt_tokens += seq.prompt_tokens - hit_tokens
        return True

    def _on_transfer_done(self, payload: tuple[_Engine, _Seq], now_s: float) -> None:
        engine, seq = payload
        # Every full prompt block arrived: cached as a computed chunk would be.
        self._store_prompt(engine, seq, len(seq.keys) * self.config.block_size)
        seq.computed = seq.prompt_tokens
        seq.loading = False
        engine.prefilling.append(seq)
        self._dirty.add(engine.id)
        self._wake(engine, now_s, True)

    def _first_token(self, engine: _Engine, seq: _Seq, now_s: float) -> None:
        engine.first_tokens += 1  # a prefill leg's token counts at its endpoint too, as in vLLM
        self._dirty.add(engine.id)
        if seq.leg == 1:
            return  # the prefill leg's token is not the client's
        seq.outcome.first_token_s = now_s
        routed = self._routed.get(seq.outcome.index)
        if routed is not None and self.config.first_byte_seen:
            routed.first_byte()
        if seq.request is not None:
            for observer in self.observers:
                observer.on_first_token(seq.request, engine.id)

    def _finish(self, engine: _Engine, seq: _Seq, now_s: float) -> None:
        keys = seq.keys
        if self.config.cache_output_blocks and seq.leg != 1 and seq.held == len(keys):
            num_full = (seq.prompt_tokens + seq.output_tokens - 1) // self.config.block_size
            if num_full > len(keys):
                filled = output_block_keys(
                    seq.trace_request, self.trace.block_tokens, self.config.block_size
                )
                engine.cache.store([StoredBlock(key, None, ()) for key in filled])
                seq.private -= len(filled)
                keys = keys + filled
                seq.held = len(keys)
        engine.cache.release(keys[: seq.held], seq.private)
        seq.held = 0
        seq.private = 0
        engine.num_running -= 1
        self._dirty.add(engine.id)
        outcome = seq.outcome
        if seq.leg == 1:
            decode = self.engines[seq.decode_endpoint]
            leg = _Seq(
                outcome,
                seq.request,
                seq.trace_request,
                seq.keys,
                seq.prompt_tokens,
                outcome.output_tokens,
                -(-(seq.prompt_tokens + outcome.output_tokens - 1) // self.config.block_size),
                leg=2,
            )
            self._add(decode, leg, now_s)
            return
        engine.stats.output_tokens += seq.output_tokens
        outcome.finish_s = now_s
        self._release_in_flight(seq)

    def _release_in_flight(self, seq: _Seq) -> None:
        outcome = seq.outcome
        self._end(outcome.index)  # releases the prefill too when no first token came
        if seq.request is not None:
            for observer in self.observers:
                observer.on_finished(seq.request, outcome.endpoint)


def run_policy(
    trace: Trace,
    config: ClusterConfig,
    picker_config: PickerConfig,
    registry: Registry,
    policy: str,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
    needs_prompt: bool = True,
) -> SimulationResult:
    """Build a simulator for one policy and run it."""
    return ClusterSimulator(
        trace, config, picker_config, registry, policy, seed, progress, needs_prompt
    ).run()
