"""One simulated vLLM endpoint: its engine driven in model time, P/D legs and KV events.

Why a module of its own: :mod:`~kv_picker_bench.sim.engine` is a pure step function with an
injected clock, and :mod:`~kv_picker_bench.sim.openai_api` only speaks HTTP. Something has to run
the engine against the event loop's clock, hand each generated token to the request waiting for
it, fetch KV from a prefill endpoint when a gateway disaggregates a request, and publish the
cache's changes as KV events. :class:`SimEndpoint` does that and serves itself through
:class:`~kv_picker_bench.sim.openai_api.OpenAIApi`, implementing its ``Backend`` contract.

Time: one asyncio task runs engine steps back to back while there is work and sleeps each
step's duration times ``time_scale`` (wall seconds per model second: 1.0 is real time, 0.01 is
a hundred times faster). Model time follows the wall clock divided by ``time_scale`` while the
engine is idle, advances by exactly the step durations while it is busy, and a step starts at
the later of the previous step's end and the latest arrival, so event-loop wake-up delays and
oversleeping do not leak into model-time latencies. Usage figures and latency
metrics are model time; a client measures roughly model time times ``time_scale`` plus overhead.

P/D, as llm-d's routing sidecar does it with vLLM's NIXL connector: a request whose
``kv_transfer_params`` has ``do_remote_decode`` is a prefill leg (any role answers it, with one
output token and where to pull its KV from); a request carrying ``x-prefiller-host-port`` first
sends its prefill leg there, then pulls the prompt's KV over a modelled link and decodes.

KV events: with ``kv_events_port`` set, the prefix cache's changes go out as vLLM KV events on
a ZMQ PUB socket (see :mod:`~kv_picker_bench.sim.events`), topic ``kv@<address>@<model>``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

import aiohttp

from kv_picker.state.tokenization import PromptTokenizer
from kv_picker_bench.sim.cache import CacheEventListener
from kv_picker_bench.sim.engine import (
    EngineConfig,
    FinishedRequest,
    SimEngine,
    StepResult,
    TokenEvent,
    hardware_class,
)
from kv_picker_bench.sim.events import ENCODINGS, KVEventPublisher, default_topic
from kv_picker_bench.sim.metrics import SimMetrics
from kv_picker_bench.sim.openai_api import GenerateParams, Generation, OpenAIApi
from kv_picker_bench.sim.timing import DEFAULT_TIMING, timing_profile

logger = logging.getLogger(__name__)

ROLES: Final = ("prefill", "decode", "both")

_PREFILLER_HEADER: Final = "x-prefiller-host-port"
_PREFILL_LEG_DROPPED = ("stream_options", "max_completion_tokens", "max_tokens")


@dataclass(frozen=True, slots=True)
class SimEndpointConfig:
    """Configuration of one simulated endpoint.

    Attributes:
        host: Address to bind.
        port: Port to bind; 0 picks a free one.
        model: Served model name.
        role: ``prefill``, ``decode`` or ``both``. Any role answers a prefill leg (a request
            whose ``kv_transfer_params`` has ``do_remote_decode``); a request carrying
            ``x-prefiller-host-port`` first sends its prefill leg there, then decodes with the
            transferred KV, as llm-d's routing sidecar does.
        hardware_class: Name of a built-in hardware class.
        timing: Name of a timing profile (:data:`kv_picker_bench.sim.timing.TIMING_PROFILES`).
        time_scale: Wall seconds per model second (> 0); 0.01 runs 100 times faster.
        block_size: Tokens per KV block.
        num_gpu_blocks: KV capacity in blocks; ``None`` derives it from the hardware class.
        max_num_seqs: Most requests running at once.
        max_num_batched_tokens: Token budget per engine step.
        max_model_len: Longest prompt plus output in tokens.
        seed: Seed of the generated tokens.
        hash_seed: ``PYTHONHASHSEED`` string of the emulated pod (root of block hashes).
        lora_modules: Served LoRA adapter names (requests may name them as ``model``).
        max_loras: Reported ``max_lora`` of ``vllm:lora_requests_info``.
        advertise_address: ``host:port`` for the endpoint header; defaults to the bound one.
        tokenizer: model directory (or ``tokenizer.json``) to tokenize with instead of the
            built-in tokenizer.
        kv_events_port: PUB port of the KV-event publisher (None: no events; 0: a free port).
        kv_events_replay_port: ROUTER port answering replays (None: no replay socket).
        kv_events_encoding: ``array`` or ``map`` event encoding.
        kv_events_topic: first frame of every message; default ``kv@<address>@<model>``.
        kv_transfer_gbps: P/D link bandwidth in gigabits per second (model time).
        kv_bytes_per_token: KV bytes per token of the served model (default: Llama-3.1-8B in
            BF16, 2 (K,V) x 32 layers x 8 KV heads x 128 dims x 2 bytes = 131,072).
        prefill_leg_timeout_s: wall seconds to wait for a prefill leg before prefilling here.
        cached_when: when a prompt block becomes a cache hit: ``scheduled`` (vLLM v1) or
            ``computed`` (see :mod:`kv_picker_bench.sim.engine`).
    """

    host: str = "127.0.0.1"
    port: int = 0
    model: str = "sim-model"
    role: str = "both"
    hardware_class: str = "H100"
    timing: str = DEFAULT_TIMING.name
    time_scale: float = 1.0
    block_size: int = 16
    num_gpu_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 8192
    max_model_len: int = 32_768
    seed: int = 0
    hash_seed: str = "0"
    lora_modules: tuple[str, ...] = ()
    max_loras: int = 1
    advertise_address: str | None = None
    tokenizer: str | None = None
    kv_events_port: int | None = None
    kv_events_replay_port: int | None = None
    kv_events_encoding: str = "array"
    kv_events_topic: str | None = None
    kv_transfer_gbps: float = 200.0
    kv_bytes_per_token: int = 131_072
    prefill_leg_timeout_s: float = 60.0
    cached_when: str = "scheduled"

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}; got {self.role!r}")
        if not (self.time_scale > 0 and math.isfinite(self.time_scale)):
            raise ValueError(f"time_scale must be a positive number, got {self.time_scale}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if not self.model:
            raise ValueError("model must not be empty")
        if self.model in self.lora_modules:
            raise ValueError(f"LoRA name {self.model!r} equals the served model name")
        hardware_class(self.hardware_class)
        timing_profile(self.timing)
        if not (self.kv_transfer_gbps > 0 and self.kv_bytes_per_token > 0):
            raise ValueError("kv_transfer_gbps and kv_bytes_per_token must be positive")
        if self.kv_events_encoding not in ENCODINGS:
            raise ValueError(f"kv_events_encoding must be one of {', '.join(ENCODINGS)}")
        for name in ("kv_events_port", "kv_events_replay_port"):
            port = getattr(self, name)
            if port is not None and not 0 <= port <= 65535:
                raise ValueError(f"{name} must be in 0..65535, got {port}")
        self.engine_config()

    def engine_config(self) -> EngineConfig:
        """The engine configuration this endpoint runs with.

        Raises:
            ValueError: If a value is out of range.
        """
        return EngineConfig(
            block_size=self.block_size,
            num_gpu_blocks=self.num_gpu_blocks,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            hardware=hardware_class(self.hardware_class),
            timing=timing_profile(self.timing),
            hash_seed=self.hash_seed,
            seed=self.seed,
            cached_when=self.cached_when,
        )


class _ModelClock:
    """Maps the event loop's clock to model time (see the module docstring)."""

    __slots__ = ("_anchor_model_s", "_anchor_wall_s", "_cap_s", "_time_scale", "_wall")

    def __init__(self, time_scale: float, wall: Callable[[], float]) -> None:
        self._time_scale = time_scale
        self._wall = wall
        self._anchor_wall_s = wall()
        self._anchor_model_s = 0.0
        self._cap_s = math.inf

    def now_s(self) -> float:
        elapsed_s = (self._wall() - self._anchor_wall_s) / self._time_scale
        return min(self._anchor_model_s + elapsed_s, self._cap_s)

    def begin_step(self, end_s: float) -> None:
        # Arrivals during a step are placed within it, never after its end.
        self._cap_s = end_s

    def end_step(self, end_s: float) -> None:
        # Re-anchor at the exact step end so oversleeping does not add model time.
        self._anchor_model_s = end_s
        self._anchor_wall_s = self._wall()
        self._cap_s = math.inf


@dataclass(slots=True)
class _Disaggregation:
    """What happened before this endpoint's engine saw a request (P/D), in model seconds."""

    prefill_endpoint: str | None = None
    prefill_leg_s: float = 0.0
    transfer_s: float = 0.0
    transferred_tokens: int = 0
    leg_error: str | None = None
    # Set on a prefill leg: the KV transfer parameters returned to the decode side.
    kv_transfer_params: dict[str, Any] | None = None


@dataclass(slots=True)
class _Generation:
    """A request in this endpoint's engine: its token queue and outcome (a ``Generation``)."""

    req_id: str
    arrival_s: float
    address: str
    disaggregation: _Disaggregation
    queue: asyncio.Queue[TokenEvent | None] = field(default_factory=asyncio.Queue)
    last_token_s: float | None = None
    summary: FinishedRequest | None = None

    @property
    def num_cached_tokens(self) -> int:
        return self.summary.num_cached_tokens if self.summary is not None else 0

    @property
    def kv_transfer_params(self) -> dict[str, Any] | None:
        return self.disaggregation.kv_transfer_params

    async def next_token(self) -> TokenEvent | None:
        return await self.queue.get()

    def timing(self) -> dict[str, Any]:
        """Per-request timing in model seconds, for benchmarks that need exact figures.

        ``ttft_s`` counts from the client's point of view: the prefill leg and the KV transfer
        (when disaggregated) plus this engine's time to the first token.
        """
        summary = self.summary
        disaggregation = self.disaggregation
        local_ttft_s = summary.ttft_s if summary is not None and summary.ttft_s else 0.0
        e2e_s = summary.e2e_s if summary is not None else 0.0
        num_output = summary.num_output_tokens if summary is not None else 0
        tpot_s = (e2e_s - local_ttft_s) / (num_output - 1) if num_output > 1 else 0.0
        before_s = disaggregation.prefill_leg_s + disaggregation.transfer_s
        return {
            "endpoint": self.address,
            "prefill_endpoint": disaggregation.prefill_endpoint,
            "prefill_leg_error": disaggregation.leg_error,
            "ttft_s": before_s + local_ttft_s,
            "tpot_s": tpot_s,
            "e2e_s": before_s + e2e_s,
            "prefill_leg_s": disaggregation.prefill_leg_s,
            "transfer_s": disaggregation.transfer_s,
            "transferred_tokens": disaggregation.transferred_tokens,
            "cached_tokens": self.num_cached_tokens,
        }


class SimEndpoint:
    """One simulated vLLM endpoint: engine, engine loop and HTTP server.

    Use :func:`start_sim_endpoint` (or ``async with SimEndpoint(config)``) to run it in-process.
    """

    def __init__(
        self, config: SimEndpointConfig, *, listener: CacheEventListener | None = None
    ) -> None:
        """Builds the endpoint without starting it.

        Args:
            config: The configuration.
            listener: Optional receiver of the prefix cache's notifications (KV events).
        """
        self.config = config
        self.tokenizer = PromptTokenizer.load(config.tokenizer) if config.tokenizer else None
        self.publisher: KVEventPublisher | None = None
        if config.kv_events_port is not None:
            self.publisher = KVEventPublisher(
                config.kv_events_port,
                encoding=config.kv_events_encoding,
                block_size=config.block_size,
                replay_port=config.kv_events_replay_port,
                host=config.host,
                forward_to=listener,
            )
            listener = self.publisher
        self.engine = SimEngine(config.engine_config(), listener)
        self.metrics = SimMetrics(
            self.engine,
            model_name=config.model,
            role=config.role,
            hardware_class=config.hardware_class,
            time_scale=config.time_scale,
            lora_names=config.lora_modules,
            max_loras=config.max_loras,
        )
        self._api = OpenAIApi(
            self,
            model=config.model,
            lora_modules=config.lora_modules,
            max_model_len=config.max_model_len,
            tokenizer=self.tokenizer,
            identity={
                "role": config.role,
                "hardware_class": config.hardware_class,
                "time_scale": config.time_scale,
                "block_size": config.block_size,
                "num_gpu_blocks": self.engine.cache.num_gpu_blocks,
            },
        )
        self._pending: dict[str, _Generation] = {}
        self._clock: _ModelClock | None = None
        self._work = asyncio.Event()
        self._engine_task: asyncio.Task[None] | None = None
        self._closing = False
        self._failed = False
        self._last_arrival_s = 0.0
        self._host = config.host
        self._port = config.port
        self._address = config.advertise_address or ""

    # ---------------------------------------------------------------------------- lifecycle

    @property
    def host(self) -> str:
        """The bound host."""
        return self._host

    @property
    def port(self) -> int:
        """The bound port (the real one once started, even when configured as 0)."""
        return self._port

    @property
    def address(self) -> str:
        """``host:port`` as sent in the endpoint header."""
        return self._address

    @property
    def url(self) -> str:
        """Base URL, e.g. ``http://127.0.0.1:8000``."""
        host = f"[{self._host}]" if ":" in self._host else self._host
        return f"http://{host}:{self._port}"

    @property
    def closing(self) -> bool:
        """True once :meth:`stop` has been called."""
        return self._closing

    @property
    def accepting(self) -> bool:
        """Whether new requests are taken: not stopping, and the engine loop has not failed."""
        return not (self._closing or self._failed)

    async def start(self) -> None:
        """Starts the engine loop and listens.

        Raises:
            OSError: If the address cannot be bound.
        """
        loop = asyncio.get_running_loop()
        self._clock = _ModelClock(self.config.time_scale, loop.time)
        self._host, self._port = await self._api.listen(self.config.host, self.config.port)
        if not self.config.advertise_address:
            self._address = f"{self._host}:{self._port}"
        if self.publisher is not None:
            self.publisher.set_topic(
                self.config.kv_events_topic or default_topic(self._address, self.config.model)
            )
            try:
                await self.publisher.start()
            except BaseException:
                await self._api.close()
                raise
        self._engine_task = asyncio.create_task(self._run_engine(), name=f"sim-engine-{self.port}")
        logger.info("simulated endpoint %s serving %s", self._address, self.config.model)

    async def stop(self) -> None:
        """Stops listening, ends in-flight requests and the engine loop. Idempotent."""
        if self._closing:
            return
        self._closing = True
        # Wake every waiting handler so the server's shutdown does not wait for generation.
        for pending in self._pending.values():
            pending.queue.put_nowait(None)
        if self._engine_task is not None:
            self._engine_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._engine_task
            self._engine_task = None
        await self._api.close()
        if self.publisher is not None:
            await self.publisher.stop()

    async def __aenter__(self) -> SimEndpoint:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    # -------------------------------------------------------------------------- engine loop

    def _now_s(self) -> float:
        if self._clock is None:
            raise RuntimeError("the endpoint is not started")
        return self._clock.now_s()

    async def _run_engine(self) -> None:
        try:
            await self._run_steps()
        except Exception:
            # A broken engine must not leave clients hanging: fail everything in flight.
            logger.exception("engine loop of %s failed", self._address)
            self._failed = True
            for pending in self._pending.values():
                pending.queue.put_nowait(None)

    async def _run_steps(self) -> None:
        clock = self._clock
        if clock is None:
            raise RuntimeError("the endpoint is not started")
        engine = self.engine
        time_scale = self.config.time_scale
        last_end_s = 0.0
        while True:
            if not engine.has_work:
                self._work.clear()
                await self._work.wait()
                continue
            # A real engine starts a step as soon as the previous one ends or a request
            # arrives; the wall-clock delay of waking this task is not model time (at small
            # time scales it would otherwise dominate queue times).
            result = engine.step(max(last_end_s, self._last_arrival_s))
            if result.duration_s <= 0.0:
                # has_work with nothing schedulable would spin; the engine rules this out.
                raise RuntimeError("engine step made no progress")
            clock.begin_step(result.end_s)
            await asyncio.sleep(result.duration_s * time_scale)
            clock.end_step(result.end_s)
            last_end_s = result.end_s
            self._dispatch(result)

    def _dispatch(self, result: StepResult) -> None:
        metrics = self.metrics
        # Summaries first: a handler woken by its last token reads the summary right away.
        for summary in result.finished:
            metrics.observe_finished(summary)
            pending = self._pending.get(summary.req_id)
            if pending is not None:
                pending.summary = summary
        for event in result.tokens:
            pending = self._pending.get(event.req_id)
            if pending is None:
                continue
            if event.index == 0:
                metrics.ttft.observe(event.time_s - pending.arrival_s)
            elif pending.last_token_s is not None:
                metrics.inter_token.observe(event.time_s - pending.last_token_s)
            pending.last_token_s = event.time_s
            pending.queue.put_nowait(event)

    # ------------------------------------------------------------------- the API's backend

    def reset_prefix_cache(self) -> int:
        """Drops every unreferenced cached block; returns how many were dropped."""
        return self.engine.reset_prefix_cache()

    def render_metrics(self) -> bytes:
        """The Prometheus exposition of the endpoint's vLLM metrics."""
        return self.metrics.render()

    async def submit(
        self,
        req_id: str,
        params: GenerateParams,
        payload: dict[str, Any],
        *,
        path: str,
        headers: Mapping[str, str],
    ) -> Generation:
        """Admits a request into the engine, after its prefill leg when disaggregated.

        Args:
            req_id: Request id, unique on this endpoint.
            params: The parsed request.
            payload: The client's JSON body (a prefill leg is the same body, adjusted).
            path: The request path (the prefill leg goes to the same path).
            headers: The client's headers (``x-prefiller-host-port``, ``x-request-id``).

        Returns:
            The request's generation; pass it to :meth:`release` when done with it.

        Raises:
            RequestRejected: If the engine cannot take the request.
        """
        disaggregation = _Disaggregation()
        kv_params = payload.get("kv_transfer_params")
        prefiller = headers.get(_PREFILLER_HEADER)
        if isinstance(kv_params, dict) and kv_params.get("do_remote_decode") is True:
            disaggregation.kv_transfer_params = self._remote_prefill_params(params)
        elif prefiller:
            await self._prefill_leg(prefiller, path, headers, payload, params, disaggregation)
        now_s = self._now_s()
        self.engine.add_request(
            req_id,
            params.prompt_token_ids,
            params.max_tokens,
            now_s=now_s,
            cache_salt=params.cache_salt,
            lora_name=params.lora_name,
            num_transferred_tokens=disaggregation.transferred_tokens,
        )
        self._last_arrival_s = max(self._last_arrival_s, now_s)
        generation = _Generation(
            req_id=req_id, arrival_s=now_s, address=self._address, disaggregation=disaggregation
        )
        self._pending[req_id] = generation
        self._work.set()
        return generation

    def release(self, generation: Generation) -> None:
        """Forgets a request, aborting it in the engine if it has not finished.

        Args:
            generation: What :meth:`submit` returned.
        """
        if not isinstance(generation, _Generation):
            raise TypeError("not a generation of this endpoint")
        self._pending.pop(generation.req_id, None)
        if generation.summary is None and self.accepting:
            aborted = self.engine.abort_request(generation.req_id, self._now_s())
            if aborted is not None:
                self.metrics.observe_finished(aborted)

    # ------------------------------------------------------------------------------- P/D

    def _remote_prefill_params(self, params: GenerateParams) -> dict[str, Any]:
        """What a prefill leg returns: where the decode side can pull the prompt's KV from."""
        num_blocks = -(-len(params.prompt_token_ids) // self.config.block_size)
        self.metrics.pd_legs["prefill"] += 1
        return {
            "do_remote_prefill": True,
            "do_remote_decode": False,
            "remote_engine_id": self._address,
            "remote_block_ids": list(range(num_blocks)),
            "remote_host": self._host,
            "remote_port": self._port,
            "tp_size": 1,
        }

    async def _prefill_leg(
        self,
        prefiller: str,
        path: str,
        headers: Mapping[str, str],
        payload: dict[str, Any],
        params: GenerateParams,
        disaggregation: _Disaggregation,
    ) -> None:
        """Have ``prefiller`` compute the prompt, then pull its KV over the modelled link.

        The leg is the same request with one output token, not streamed, and
        ``kv_transfer_params.do_remote_decode`` set (llm-d's sidecar with vLLM's NIXL
        connector does the same). A failed leg is logged and counted, and this endpoint
        prefills by itself: the client still gets its answer.
        """
        disaggregation.prefill_endpoint = prefiller
        leg = {k: v for k, v in payload.items() if k not in _PREFILL_LEG_DROPPED}
        leg.update(
            max_tokens=1,
            stream=False,
            kv_transfer_params={
                "do_remote_decode": True,
                "do_remote_prefill": False,
                "remote_engine_id": None,
                "remote_block_ids": None,
                "remote_host": None,
                "remote_port": None,
            },
        )
        leg_headers = {"x-request-id": headers.get("x-request-id", uuid.uuid4().hex)}
        url = f"http://{prefiller}{path}"
        try:
            timeout = aiohttp.ClientTimeout(total=self.config.prefill_leg_timeout_s)
            async with (
                aiohttp.ClientSession(timeout=timeout) as session,
                session.post(url, json=leg, headers=leg_headers) as reply,
            ):
                document = await reply.json(content_type=None)
                if reply.status != 200:
                    raise ValueError(f"HTTP {reply.status}: {str(document)[:200]}")
            returned = document.get("kv_transfer_params") or {}
            block_ids = returned.get("remote_block_ids") or []
            leg_timing = document.get("kv_picker_sim") or {}
        except (aiohttp.ClientError, TimeoutError, ValueError, AttributeError) as exc:
            disaggregation.leg_error = f"{type(exc).__name__}: {exc}"
            self.metrics.pd_leg_failures += 1
            logger.warning("prefill leg to %s failed, prefilling locally: %s", prefiller, exc)
            return
        block_size = self.config.block_size
        transferred = min(len(block_ids) * block_size, len(params.prompt_token_ids))
        local = self.engine.num_cached_prompt_tokens(
            params.prompt_token_ids, cache_salt=params.cache_salt, lora_name=params.lora_name
        )
        to_pull = max(0, transferred - local)
        link_bytes_per_s = self.config.kv_transfer_gbps * 1e9 / 8
        disaggregation.transfer_s = to_pull * self.config.kv_bytes_per_token / link_bytes_per_s
        disaggregation.prefill_leg_s = float(leg_timing.get("ttft_s") or 0.0)
        disaggregation.transferred_tokens = transferred
        self.metrics.pd_legs["decode"] += 1
        self.metrics.transferred_blocks += -(-to_pull // block_size)
        # The pull runs beside the engine (RDMA), so it delays this request only.
        await asyncio.sleep(disaggregation.transfer_s * self.config.time_scale)


async def start_sim_endpoint(
    config: SimEndpointConfig, *, listener: CacheEventListener | None = None
) -> SimEndpoint:
    """Starts a simulated endpoint in the running event loop.

    Args:
        config: The configuration (``port=0`` picks a free port; read ``endpoint.port``).
        listener: Optional receiver of the prefix cache's notifications.

    Returns:
        The started endpoint; call ``await endpoint.stop()`` when done.
    """
    endpoint = SimEndpoint(config, listener=listener)
    await endpoint.start()
    return endpoint
