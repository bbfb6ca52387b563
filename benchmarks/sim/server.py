"""HTTP server of the simulated vLLM endpoint (aiohttp), and its command line.

Routes, as a gateway sees a vLLM OpenAI server:

    POST /v1/completions        prompt: str | [str] | [int] | [[int]] (one prompt per request)
    POST /v1/chat/completions   messages (rendered with the fixed chat template)
    GET  /v1/models             served model and LoRA adapters
    GET  /health                200 while serving
    GET  /version
    POST /reset_prefix_cache    drop every unreferenced cached block
    GET  /metrics               Prometheus text, vLLM metric names (see ``metrics``)

Every response carries ``x-kv-picker-sim-endpoint: host:port`` so tests can tell which endpoint
served a request.

Options that make it a precise-routing peer: ``--tokenizer DIR`` tokenizes with a Hugging Face
``tokenizer.json`` and the chat template of ``tokenizer_config.json`` (the same files a precise
picker loads, so both see the same token ids; the built-in tokenizer stays the default), and
``--kv-events-port`` publishes the prefix cache's changes as vLLM KV events on a ZMQ PUB socket
(``--kv-events-replay-port`` adds the replay socket, ``--kv-events-encoding`` picks the array or
map event encoding; see :mod:`kv_picker_bench.sim.events`).

Time: one asyncio task runs engine steps back to back while there is work and sleeps each
step's duration times ``time_scale`` (wall seconds per model second: 1.0 is real time, 0.01 is
a hundred times faster). Model time follows the wall clock divided by ``time_scale`` while the
engine is idle, advances by exactly the step durations while it is busy, and a step starts at
the later of the previous step's end and the latest arrival, so event-loop wake-up delays and
oversleeping do not leak into model-time latencies. Usage figures and latency
metrics are model time; a client measures roughly model time times ``time_scale`` plus overhead.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import math
import signal
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal

import aiohttp
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from kv_picker.state.tokenization import PromptTokenizer
from kv_picker_bench.sim.cache import CacheEventListener
from kv_picker_bench.sim.engine import (
    EngineConfig,
    FinishedRequest,
    RequestRejected,
    SimEngine,
    StepResult,
    TokenEvent,
    hardware_class,
)
from kv_picker_bench.sim.events import ENCODINGS, KVEventPublisher, default_topic
from kv_picker_bench.sim.metrics import SimMetrics
from kv_picker_bench.sim.tokenizer import (
    VOCAB_SIZE,
    content_text,
    decode,
    decode_token,
    encode,
    render_chat,
)

logger = logging.getLogger(__name__)

ENDPOINT_HEADER: Final = "x-kv-picker-sim-endpoint"
"""Response header naming the endpoint (``host:port``) that served the request."""

ROLES: Final = ("prefill", "decode", "both")
DEFAULT_MAX_TOKENS: Final = 16
_MAX_BODY_BYTES: Final = 64 * 1024 * 1024
_SHUTDOWN_TIMEOUT_S: Final = 5.0
# Bodies up to this size are parsed and tokenized on the event loop (well under a millisecond).
_INLINE_PARSE_BYTES: Final = 64 * 1024

Kind = Literal["completion", "chat"]


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
    """

    host: str = "127.0.0.1"
    port: int = 0
    model: str = "sim-model"
    role: str = "both"
    hardware_class: str = "H100"
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
            hash_seed=self.hash_seed,
            seed=self.seed,
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


class _BadRequest(Exception):
    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status = status


_ERROR_TYPES: Final = {
    400: "BadRequestError",
    404: "NotFoundError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def error_response(status: int, message: str) -> web.Response:
    """Builds an OpenAI-style error response.

    Args:
        status: HTTP status.
        message: Human-readable message.

    Returns:
        ``{"error": {"message", "type", "param", "code"}}`` with that status.
    """
    return web.json_response(_error_body(status, message), status=status)


def _error_body(status: int, message: str) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _ERROR_TYPES.get(status, "Error"),
            "param": None,
            "code": status,
        }
    }


@dataclass(slots=True)
class _GenerateParams:
    prompt_token_ids: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    cache_salt: str | None
    lora_name: str | None


@dataclass(slots=True)
class _Pending:
    queue: asyncio.Queue[TokenEvent | None]
    arrival_s: float
    last_token_s: float | None = None
    summary: FinishedRequest | None = None


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


_PREFILLER_HEADER: Final = "x-prefiller-host-port"
_PREFILL_LEG_DROPPED = ("stream_options", "max_completion_tokens", "max_tokens")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _token_ids(values: list[Any], vocab_size: int = VOCAB_SIZE) -> list[int]:
    if not all(_is_int(v) for v in values):
        raise _BadRequest("prompt token ids must be integers")
    if any(not 0 <= v < vocab_size for v in values):
        raise _BadRequest(f"prompt token ids must be in [0, {vocab_size})")
    return list(values)


def _prompt_token_ids(
    prompt: Any, encode: Callable[[str], list[int]] = encode, vocab_size: int = VOCAB_SIZE
) -> list[int]:
    if isinstance(prompt, str):
        return encode(prompt)
    if not isinstance(prompt, list) or not prompt:
        raise _BadRequest("'prompt' must be a string, a list of strings or a list of token ids")
    if all(isinstance(p, str) for p in prompt):
        if len(prompt) != 1:
            raise _BadRequest("only one prompt per request is supported")
        return encode(prompt[0])
    if all(isinstance(p, list) for p in prompt):
        if len(prompt) != 1:
            raise _BadRequest("only one prompt per request is supported")
        return _token_ids(prompt[0], vocab_size)
    return _token_ids(prompt, vocab_size)


def _max_tokens(payload: dict[str, Any], kind: Kind) -> int:
    value = payload.get("max_completion_tokens") if kind == "chat" else None
    name = "max_completion_tokens"
    if value is None:
        value = payload.get("max_tokens")
        name = "max_tokens"
    if value is None:
        return DEFAULT_MAX_TOKENS
    if not _is_int(value) or value < 1:
        raise _BadRequest(f"'{name}' must be an integer >= 1")
    return int(value)


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
        self._served_models = {config.model, *config.lora_modules}
        self._pending: dict[str, _Pending] = {}
        self._clock: _ModelClock | None = None
        self._work = asyncio.Event()
        self._engine_task: asyncio.Task[None] | None = None
        self._runner: web.AppRunner | None = None
        self._closing = False
        self._failed = False
        self._last_arrival_s = 0.0
        self._created = int(time.time())
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

    async def start(self) -> None:
        """Starts the engine loop and listens.

        Raises:
            OSError: If the address cannot be bound.
        """
        loop = asyncio.get_running_loop()
        self._clock = _ModelClock(self.config.time_scale, loop.time)
        app = web.Application(client_max_size=_MAX_BODY_BYTES, middlewares=[self._errors])
        app.on_response_prepare.append(self._add_endpoint_header)
        app.router.add_post("/v1/completions", self._handle_completions)
        app.router.add_post("/v1/chat/completions", self._handle_chat)
        app.router.add_get("/v1/models", self._handle_models)
        app.router.add_get("/health", self._handle_health)
        app.router.add_get("/version", self._handle_version)
        app.router.add_post("/reset_prefix_cache", self._handle_reset_prefix_cache)
        app.router.add_get("/metrics", self._handle_metrics)
        # handler_cancellation: a client that goes away cancels its handler, which aborts the
        # request in the engine and frees its blocks, as vLLM does.
        runner = web.AppRunner(
            app,
            access_log=None,
            handler_cancellation=True,
            shutdown_timeout=_SHUTDOWN_TIMEOUT_S,
        )
        await runner.setup()
        try:
            site = web.TCPSite(runner, self.config.host, self.config.port)
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        sockname = runner.addresses[0]
        self._host, self._port = str(sockname[0]), int(sockname[1])
        if not self.config.advertise_address:
            self._address = f"{self._host}:{self._port}"
        if self.publisher is not None:
            self.publisher.set_topic(
                self.config.kv_events_topic or default_topic(self._address, self.config.model)
            )
            try:
                await self.publisher.start()
            except BaseException:
                await runner.cleanup()
                self._runner = None
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
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
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

    # ----------------------------------------------------------------------------- plumbing

    async def _add_endpoint_header(
        self, request: web.Request, response: web.StreamResponse
    ) -> None:
        response.headers[ENDPOINT_HEADER] = self._address

    @web.middleware
    async def _errors(
        self,
        request: web.Request,
        handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
    ) -> web.StreamResponse:
        try:
            return await handler(request)
        except web.HTTPException:
            raise
        except _BadRequest as exc:
            return error_response(exc.status, exc.message)
        except Exception:
            logger.exception("unhandled error on %s %s", request.method, request.path)
            return error_response(500, "internal error in the simulated endpoint")

    # ----------------------------------------------------------------------------- handlers

    async def _handle_health(self, request: web.Request) -> web.Response:
        if self._closing:
            return error_response(503, "shutting down")
        return web.Response(status=200)

    async def _handle_version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": "kv-picker-sim"})

    async def _handle_models(self, request: web.Request) -> web.Response:
        config = self.config
        base = {
            "id": config.model,
            "object": "model",
            "created": self._created,
            "owned_by": "vllm",
            "root": config.model,
            "parent": None,
            "max_model_len": config.max_model_len,
            # Not in vLLM's model card: lets tests and the demo read the simulated identity.
            "kv_picker_sim": {
                "role": config.role,
                "hardware_class": config.hardware_class,
                "time_scale": config.time_scale,
                "block_size": config.block_size,
                "num_gpu_blocks": self.engine.cache.num_gpu_blocks,
            },
        }
        loras = [
            {
                "id": name,
                "object": "model",
                "created": self._created,
                "owned_by": "vllm",
                "root": name,
                "parent": config.model,
                "max_model_len": config.max_model_len,
            }
            for name in config.lora_modules
        ]
        return web.json_response({"object": "list", "data": [base, *loras]})

    async def _handle_reset_prefix_cache(self, request: web.Request) -> web.Response:
        num_dropped = self.engine.reset_prefix_cache()
        logger.info("prefix cache reset: %d blocks dropped", num_dropped)
        return web.Response(status=200)

    async def _handle_metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def _handle_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._handle_generate(request, "completion")

    async def _handle_chat(self, request: web.Request) -> web.StreamResponse:
        return await self._handle_generate(request, "chat")

    # --------------------------------------------------------------------------- generation

    async def _read_payload(self, request: web.Request) -> dict[str, Any]:
        # read() collects the whole body, chunked transfer encoding included (Envoy streams
        # bodies upstream that way).
        raw = await request.read()
        try:
            payload = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise _BadRequest(f"the request body is not valid JSON: {exc}") from None
        if not isinstance(payload, dict):
            raise _BadRequest("the request body must be a JSON object")
        return payload

    def _parse(self, payload: dict[str, Any], kind: Kind) -> _GenerateParams:
        model = payload.get("model")
        if not isinstance(model, str) or not model:
            raise _BadRequest("'model' is required and must be a string")
        if model not in self._served_models:
            raise _BadRequest(f"The model `{model}` does not exist.", status=404)
        lora_name = model if model != self.config.model else None

        if kind == "chat":
            messages = payload.get("messages")
            if not isinstance(messages, list) or not messages:
                raise _BadRequest("'messages' is required and must be a non-empty list")
            if not all(isinstance(m, dict) for m in messages):
                raise _BadRequest("each message must be an object")
            tokenizer = self.tokenizer
            try:
                if tokenizer is None:
                    prompt_token_ids = encode(render_chat(messages))
                else:
                    # The template carries the special tokens, as vLLM's chat path assumes.
                    generation_prompt = bool(payload.get("add_generation_prompt", True))
                    if payload.get("continue_final_message"):
                        generation_prompt = False
                    # A string content per message, as vLLM hands the template.
                    rendered = tokenizer.render_chat(
                        [{**m, "content": content_text(m.get("content"))} for m in messages],
                        generation_prompt,
                    )
                    prompt_token_ids = tokenizer.encode(rendered, add_special_tokens=False)
            except ValueError as exc:
                raise _BadRequest(f"invalid 'messages': {exc}") from None
        else:
            if "prompt" not in payload:
                raise _BadRequest("'prompt' is required")
            if self.tokenizer is None:
                prompt_token_ids = _prompt_token_ids(payload["prompt"])
            else:
                prompt_token_ids = _prompt_token_ids(
                    payload["prompt"], self.tokenizer.encode, self.tokenizer.vocab_size
                )
        if not prompt_token_ids:
            raise _BadRequest("the prompt is empty")

        stream = payload.get("stream", False)
        if stream is None:
            stream = False
        if not isinstance(stream, bool):
            raise _BadRequest("'stream' must be a boolean")
        stream_options = payload.get("stream_options")
        if stream_options is not None and not isinstance(stream_options, dict):
            raise _BadRequest("'stream_options' must be an object")
        include_usage = bool(stream_options and stream_options.get("include_usage"))
        n = payload.get("n")
        if n is not None and n != 1:
            raise _BadRequest("only n=1 is supported")
        cache_salt = payload.get("cache_salt")
        if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
            raise _BadRequest("'cache_salt' must be a non-empty string")
        # ignore_eos is accepted and has no effect: there is no EOS, every request generates
        # exactly max_tokens tokens.
        return _GenerateParams(
            prompt_token_ids=prompt_token_ids,
            max_tokens=_max_tokens(payload, kind),
            stream=stream,
            include_usage=include_usage,
            cache_salt=cache_salt,
            lora_name=lora_name,
        )

    async def _handle_generate(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        if self._closing or self._failed:
            return error_response(503, "the endpoint is shutting down or failed")
        payload = await self._read_payload(request)
        if request.content_length is not None and request.content_length <= _INLINE_PARSE_BYTES:
            params = self._parse(payload, kind)
        else:
            # Tokenizing a long prompt takes milliseconds; keep the event loop (and every other
            # request's token timing) free meanwhile.
            params = await asyncio.to_thread(self._parse, payload, kind)
        model = payload["model"]
        req_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        disaggregation = _Disaggregation()
        kv_params = payload.get("kv_transfer_params")
        prefiller = request.headers.get(_PREFILLER_HEADER)
        if isinstance(kv_params, dict) and kv_params.get("do_remote_decode") is True:
            disaggregation.kv_transfer_params = self._remote_prefill_params(params)
        elif prefiller:
            await self._prefill_leg(prefiller, request, payload, params, disaggregation)
        now_s = self._now_s()
        try:
            self.engine.add_request(
                req_id,
                params.prompt_token_ids,
                params.max_tokens,
                now_s=now_s,
                cache_salt=params.cache_salt,
                lora_name=params.lora_name,
                num_transferred_tokens=disaggregation.transferred_tokens,
            )
        except RequestRejected as exc:
            raise _BadRequest(str(exc)) from None
        self._last_arrival_s = max(self._last_arrival_s, now_s)
        pending = _Pending(queue=asyncio.Queue(), arrival_s=now_s)
        self._pending[req_id] = pending
        self._work.set()
        try:
            if params.stream:
                return await self._respond_stream(
                    request, kind, req_id, model, params, pending, disaggregation
                )
            return await self._respond_full(kind, req_id, model, params, pending, disaggregation)
        finally:
            self._pending.pop(req_id, None)
            if pending.summary is None and not (self._closing or self._failed):
                aborted = self.engine.abort_request(req_id, self._now_s())
                if aborted is not None:
                    self.metrics.observe_finished(aborted)

    def _remote_prefill_params(self, params: _GenerateParams) -> dict[str, Any]:
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
        request: web.Request,
        payload: dict[str, Any],
        params: _GenerateParams,
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
        headers = {"x-request-id": request.headers.get("x-request-id", uuid.uuid4().hex)}
        url = f"http://{prefiller}{request.path}"
        try:
            timeout = aiohttp.ClientTimeout(total=self.config.prefill_leg_timeout_s)
            async with (
                aiohttp.ClientSession(timeout=timeout) as session,
                session.post(url, json=leg, headers=headers) as reply,
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

    def _timing(self, pending: _Pending, disaggregation: _Disaggregation) -> dict[str, Any]:
        """Per-request timing in model seconds, for benchmarks that need exact figures.

        ``ttft_s`` counts from the client's point of view: the prefill leg and the KV transfer
        (when disaggregated) plus this engine's time to the first token.
        """
        summary = pending.summary
        local_ttft_s = summary.ttft_s if summary is not None and summary.ttft_s else 0.0
        e2e_s = summary.e2e_s if summary is not None else 0.0
        num_output = summary.num_output_tokens if summary is not None else 0
        tpot_s = (e2e_s - local_ttft_s) / (num_output - 1) if num_output > 1 else 0.0
        before_s = disaggregation.prefill_leg_s + disaggregation.transfer_s
        return {
            "endpoint": self._address,
            "prefill_endpoint": disaggregation.prefill_endpoint,
            "prefill_leg_error": disaggregation.leg_error,
            "ttft_s": before_s + local_ttft_s,
            "tpot_s": tpot_s,
            "e2e_s": before_s + e2e_s,
            "prefill_leg_s": disaggregation.prefill_leg_s,
            "transfer_s": disaggregation.transfer_s,
            "transferred_tokens": disaggregation.transferred_tokens,
            "cached_tokens": summary.num_cached_tokens if summary is not None else 0,
        }

    async def _respond_full(
        self,
        kind: Kind,
        req_id: str,
        model: str,
        params: _GenerateParams,
        pending: _Pending,
        disaggregation: _Disaggregation,
    ) -> web.Response:
        token_ids: list[int] = []
        while True:
            event = await pending.queue.get()
            if event is None:
                return error_response(503, "the endpoint is shutting down or failed")
            token_ids.append(event.token_id)
            if event.finished:
                break
        text = decode(token_ids)
        if kind == "chat":
            choice: dict[str, Any] = {
                "index": 0,
                "message": {"role": "assistant", "content": text},
                "logprobs": None,
                "finish_reason": "length",
            }
            obj = "chat.completion"
        else:
            choice = {
                "index": 0,
                "text": text,
                "logprobs": None,
                "finish_reason": "length",
                "stop_reason": None,
            }
            obj = "text_completion"
        body = {
            "id": req_id,
            "object": obj,
            "created": int(time.time()),
            "model": model,
            "choices": [choice],
            "usage": _usage(pending.summary, params, len(token_ids)),
            "kv_picker_sim": self._timing(pending, disaggregation),
        }
        if disaggregation.kv_transfer_params is not None:
            body["kv_transfer_params"] = disaggregation.kv_transfer_params
        return web.json_response(body)

    async def _respond_stream(
        self,
        request: web.Request,
        kind: Kind,
        req_id: str,
        model: str,
        params: _GenerateParams,
        pending: _Pending,
        disaggregation: _Disaggregation,
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            status=200,
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"},
        )
        await response.prepare(request)
        created = int(time.time())
        obj = "chat.completion.chunk" if kind == "chat" else "text_completion"

        async def send(data: dict[str, Any]) -> None:
            await response.write(b"data: " + json.dumps(data).encode() + b"\n\n")

        def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
            return {
                "id": req_id,
                "object": obj,
                "created": created,
                "model": model,
                "choices": choices,
            }

        if kind == "chat":
            # vLLM opens a chat stream with the assistant role before any content.
            await send(
                chunk(
                    [
                        {
                            "index": 0,
                            "delta": {"role": "assistant", "content": ""},
                            "logprobs": None,
                            "finish_reason": None,
                        }
                    ]
                )
            )
        num_output_tokens = 0
        while True:
            event = await pending.queue.get()
            if event is None:
                # Headers are sent already, so the failure travels as an SSE error event.
                await send(_error_body(503, "the endpoint is shutting down or failed"))
                await response.write_eof()
                return response
            num_output_tokens += 1
            text = decode_token(event.token_id)
            finish_reason = "length" if event.finished else None
            if kind == "chat":
                choice: dict[str, Any] = {
                    "index": 0,
                    "delta": {"content": text},
                    "logprobs": None,
                    "finish_reason": finish_reason,
                }
            else:
                choice = {
                    "index": 0,
                    "text": text,
                    "logprobs": None,
                    "finish_reason": finish_reason,
                    "stop_reason": None,
                }
            data = chunk([choice])
            if event.finished:
                data["kv_picker_sim"] = self._timing(pending, disaggregation)
            await send(data)
            if event.finished:
                break
        if params.include_usage:
            final = chunk([])
            final["usage"] = _usage(pending.summary, params, num_output_tokens)
            await send(final)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def _usage(
    summary: FinishedRequest | None, params: _GenerateParams, num_output_tokens: int
) -> dict[str, Any]:
    num_prompt_tokens = len(params.prompt_token_ids)
    num_cached_tokens = summary.num_cached_tokens if summary is not None else 0
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_output_tokens,
        "total_tokens": num_prompt_tokens + num_output_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }


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


# ------------------------------------------------------------------------------ command line


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``sim-endpoint`` command."""
    parser = argparse.ArgumentParser(
        prog="kv-picker sim-endpoint",
        description="Run one simulated vLLM endpoint (OpenAI API, vLLM metrics, prefix cache).",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s)")
    parser.add_argument("--port", type=int, required=True, help="port to bind; 0 picks a free one")
    parser.add_argument(
        "--model", default="sim-model", help="served model name (default %(default)s)"
    )
    parser.add_argument(
        "--role", choices=ROLES, default="both", help="endpoint role (default %(default)s)"
    )
    parser.add_argument(
        "--hardware-class",
        default="H100",
        help="hardware class: H100, H200, A100, L4 or default (default %(default)s)",
    )
    parser.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="wall seconds per model second; 0.01 runs 100x faster (default %(default)s)",
    )
    parser.add_argument(
        "--block-size", type=int, default=16, help="tokens per KV block (default %(default)s)"
    )
    parser.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=None,
        help="KV capacity in blocks (default: 2048 scaled by the hardware class)",
    )
    parser.add_argument(
        "--max-num-seqs", type=int, default=64, help="most running requests (default %(default)s)"
    )
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=8192,
        help="token budget per engine step (default %(default)s)",
    )
    parser.add_argument(
        "--max-model-len",
        type=int,
        default=32_768,
        help="longest prompt+output (default %(default)s)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of generated tokens (default %(default)s)"
    )
    parser.add_argument(
        "--hash-seed",
        default="0",
        help="PYTHONHASHSEED string of the emulated vLLM pod, the root of block hashes "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        metavar="NAME[=PATH]",
        help="served LoRA adapters; requests may name them as the model",
    )
    parser.add_argument(
        "--max-loras", type=int, default=1, help="reported max_lora (default %(default)s)"
    )
    parser.add_argument(
        "--advertise-address",
        default=None,
        metavar="HOST:PORT",
        help=f"value of the {ENDPOINT_HEADER} header (default: the bound host:port)",
    )
    parser.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="tokenize with this model directory's tokenizer.json and chat template "
        "(default: the built-in tokenizer)",
    )
    parser.add_argument(
        "--kv-events-port",
        type=int,
        default=None,
        help="publish vLLM KV events on a ZMQ PUB socket bound to this port on --host",
    )
    parser.add_argument(
        "--kv-events-replay-port",
        type=int,
        default=None,
        help="serve KV-event replays (ZMQ ROUTER) on this port",
    )
    parser.add_argument(
        "--kv-events-encoding",
        choices=ENCODINGS,
        default="array",
        help="event encoding: array (vLLM before 0.26) or map (newer) (default %(default)s)",
    )
    parser.add_argument(
        "--kv-events-topic",
        default=None,
        help="topic frame of KV events (default kv@<endpoint>@<model>)",
    )
    parser.add_argument(
        "--kv-transfer-gbps",
        type=float,
        default=200.0,
        help="P/D link bandwidth in Gbit/s, for the KV pulled from a prefill endpoint "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--kv-bytes-per-token",
        type=int,
        default=131_072,
        help="KV bytes per token of the served model (default %(default)s: Llama-3.1-8B, BF16)",
    )
    parser.add_argument(
        "--log-level",
        default="WARNING",
        choices=("DEBUG", "INFO", "WARNING", "ERROR"),
        help="log level (default %(default)s)",
    )
    return parser


def config_from_args(args: argparse.Namespace) -> SimEndpointConfig:
    """Builds the endpoint configuration from parsed arguments.

    Raises:
        ValueError: If a value is invalid.
    """
    return SimEndpointConfig(
        host=args.host,
        port=args.port,
        model=args.model,
        role=args.role,
        hardware_class=args.hardware_class,
        time_scale=args.time_scale,
        block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        seed=args.seed,
        hash_seed=args.hash_seed,
        lora_modules=tuple(item.split("=", 1)[0] for item in args.lora_modules),
        max_loras=args.max_loras,
        advertise_address=args.advertise_address,
        tokenizer=args.tokenizer,
        kv_events_port=args.kv_events_port,
        kv_events_replay_port=args.kv_events_replay_port,
        kv_events_encoding=args.kv_events_encoding,
        kv_events_topic=args.kv_events_topic,
        kv_transfer_gbps=args.kv_transfer_gbps,
        kv_bytes_per_token=args.kv_bytes_per_token,
    )


async def serve(config: SimEndpointConfig, stop: asyncio.Event | None = None) -> int:
    """Runs an endpoint until SIGTERM/SIGINT (or ``stop`` is set).

    Prints ``ready http://HOST:PORT`` to stdout once listening.

    Returns:
        The process exit code: 0 after a clean stop, 1 if the address cannot be bound.
    """
    loop = asyncio.get_running_loop()
    stop_event = stop or asyncio.Event()
    signals = (signal.SIGINT, signal.SIGTERM)
    for signum in signals:
        loop.add_signal_handler(signum, stop_event.set)
    try:
        endpoint = SimEndpoint(config)
        try:
            await endpoint.start()
        except OSError as exc:
            print(f"error: cannot listen on {config.host}:{config.port}: {exc}", file=sys.stderr)
            return 1
        print(f"ready {endpoint.url}", flush=True)
        try:
            await stop_event.wait()
        finally:
            await endpoint.stop()
        return 0
    finally:
        for signum in signals:
            loop.remove_signal_handler(signum)


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point of one simulated endpoint.

    Args:
        argv: Arguments without the program name; ``None`` reads ``sys.argv``.

    Returns:
        The exit code (2 for invalid arguments, via argparse).
    """
    parser = build_parser()
    args = parser.parse_args(None if argv is None else list(argv))
    try:
        config = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    return asyncio.run(serve(config))
