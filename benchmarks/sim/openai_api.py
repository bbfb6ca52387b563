"""The simulated endpoint's HTTP face: the part of vLLM's OpenAI-compatible server a gateway sees.

Why a module of its own: what a request looks like on the wire (parsing and validation, SSE
chunks, usage, OpenAI error bodies) changes for different reasons than how the simulated engine
runs it. This module knows nothing of engine steps, model time or P/D; it talks to its engine
through two small contracts, :class:`Backend` and :class:`Generation`, which
:class:`~kv_picker_bench.sim.endpoint.SimEndpoint` implements (vLLM's API server likewise talks to
an engine client)::

    client ──HTTP──> OpenAIApi ──GenerateParams──> Backend.submit() ──> Generation
                        ^                                                  │
                        └───────── TokenEvent (next_token) ────────────────┘

Routes:

    POST /v1/completions        prompt: str | [str] | [int] | [[int]] (one prompt per request)
    POST /v1/chat/completions   messages (rendered with the fixed chat template)
    GET  /v1/models             served model and LoRA adapters
    GET  /health                200 while serving
    GET  /version
    POST /reset_prefix_cache    drop every unreferenced cached block
    GET  /metrics               Prometheus text, vLLM metric names (see ``metrics``)

Every response carries ``x-kv-picker-sim-endpoint: host:port`` so tests can tell which endpoint
served a request. With a Hugging Face tokenizer (``--tokenizer``) prompts and chat messages are
tokenized with it and its chat template, the same files a precise picker loads, so both see the
same token ids; otherwise the built-in tokenizer and chat template apply.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final, Literal, Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from kv_picker.state.tokenization import PromptTokenizer
from kv_picker_bench.sim.engine import RequestRejected, TokenEvent
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

DEFAULT_MAX_TOKENS: Final = 16
_MAX_BODY_BYTES: Final = 64 * 1024 * 1024
_SHUTDOWN_TIMEOUT_S: Final = 5.0
# Bodies up to this size are parsed and tokenized on the event loop (well under a millisecond).
_INLINE_PARSE_BYTES: Final = 64 * 1024
_UNAVAILABLE: Final = "the endpoint is shutting down or failed"

Kind = Literal["completion", "chat"]


@dataclass(slots=True)
class GenerateParams:
    """What a completion or chat request asks the engine for, once parsed and validated.

    Attributes:
        prompt_token_ids: The prompt (chat messages already rendered), tokenized.
        max_tokens: Output tokens to generate (there is no EOS: always exactly this many).
        stream: Answer with server-sent events.
        include_usage: Send a final usage chunk (``stream_options.include_usage``).
        cache_salt: Isolates the request's prefix-cache blocks (vLLM's ``cache_salt``).
        lora_name: The LoRA adapter named as ``model``; ``None`` for the base model.
    """

    prompt_token_ids: list[int]
    max_tokens: int
    stream: bool
    include_usage: bool
    cache_salt: str | None
    lora_name: str | None


class Generation(Protocol):
    """One request being generated, as its HTTP handler follows it."""

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache (0 until the request finishes)."""
        ...

    @property
    def kv_transfer_params(self) -> dict[str, Any] | None:
        """KV transfer parameters to return (set when the request was a P/D prefill leg)."""
        ...

    async def next_token(self) -> TokenEvent | None:
        """The next generated token; ``None`` if the endpoint stopped or failed meanwhile."""
        ...

    def timing(self) -> dict[str, Any]:
        """Per-request timing in model seconds, sent as ``kv_picker_sim`` with the last token."""
        ...


class Backend(Protocol):
    """The engine side of one endpoint, as the HTTP layer needs it."""

    @property
    def address(self) -> str:
        """``host:port`` sent in :data:`ENDPOINT_HEADER`."""
        ...

    @property
    def closing(self) -> bool:
        """True once the endpoint is stopping (``/health`` answers 503)."""
        ...

    @property
    def accepting(self) -> bool:
        """False while stopping or after the engine failed (generation answers 503)."""
        ...

    def reset_prefix_cache(self) -> int:
        """Drops every unreferenced cached block; returns how many were dropped."""
        ...

    def render_metrics(self) -> bytes:
        """The Prometheus exposition of the endpoint's vLLM metrics."""
        ...

    async def submit(
        self,
        req_id: str,
        params: GenerateParams,
        payload: dict[str, Any],
        *,
        path: str,
        headers: Mapping[str, str],
    ) -> Generation:
        """Admits a request into the engine.

        ``payload``, ``path`` and ``headers`` are the client's, for P/D (a prefill leg carries
        ``kv_transfer_params``; a disaggregated request names its prefill endpoint in a header).

        Raises:
            RequestRejected: If the engine cannot take the request (too long, ...).
        """
        ...

    def release(self, generation: Generation) -> None:
        """Forgets a request, aborting it in the engine if it has not finished."""
        ...


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


def _usage(
    num_prompt_tokens: int, num_cached_tokens: int, num_output_tokens: int
) -> dict[str, Any]:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_output_tokens,
        "total_tokens": num_prompt_tokens + num_output_tokens,
        "prompt_tokens_details": {"cached_tokens": num_cached_tokens},
    }


class OpenAIApi:
    """Routes and handlers of one endpoint's OpenAI-compatible server, and its listener.

    Args:
        backend: The engine side of the endpoint.
        model: Served model name.
        lora_modules: Served LoRA adapter names (requests may name them as ``model``).
        max_model_len: Longest prompt plus output, as reported by ``/v1/models``.
        tokenizer: Tokenizer and chat template to use instead of the built-in ones.
        identity: The simulated endpoint's settings, added to the base model's card as
            ``kv_picker_sim`` (not in vLLM's model card: tests and the demo read it).
    """

    def __init__(
        self,
        backend: Backend,
        *,
        model: str,
        lora_modules: Sequence[str] = (),
        max_model_len: int,
        tokenizer: PromptTokenizer | None = None,
        identity: Mapping[str, Any] | None = None,
    ) -> None:
        self._backend = backend
        self._model = model
        self._lora_modules = tuple(lora_modules)
        self._served_models = {model, *lora_modules}
        self._max_model_len = max_model_len
        self._tokenizer = tokenizer
        self._identity = dict(identity or {})
        self._created = int(time.time())
        self._runner: web.AppRunner | None = None

    def build_app(self) -> web.Application:
        """The aiohttp application with every route."""
        app = web.Application(client_max_size=_MAX_BODY_BYTES, middlewares=[self._errors])
        app.on_response_prepare.append(self._add_endpoint_header)
        app.router.add_post("/v1/completions", self._handle_completions)
        app.router.add_post("/v1/chat/completions", self._handle_chat)
        app.router.add_get("/v1/models", self._handle_models)
        app.router.add_get("/health", self._handle_health)
        app.router.add_get("/version", self._handle_version)
        app.router.add_post("/reset_prefix_cache", self._handle_reset_prefix_cache)
        app.router.add_get("/metrics", self._handle_metrics)
        return app

    async def listen(self, host: str, port: int) -> tuple[str, int]:
        """Starts serving on ``host:port``.

        Args:
            host: Address to bind.
            port: Port to bind; 0 picks a free one.

        Returns:
            The bound host and port.

        Raises:
            OSError: If the address cannot be bound.
        """
        # handler_cancellation: a client that goes away cancels its handler, which aborts the
        # request in the engine and frees its blocks, as vLLM does.
        runner = web.AppRunner(
            self.build_app(),
            access_log=None,
            handler_cancellation=True,
            shutdown_timeout=_SHUTDOWN_TIMEOUT_S,
        )
        await runner.setup()
        try:
            site = web.TCPSite(runner, host, port)
            await site.start()
        except BaseException:
            await runner.cleanup()
            raise
        self._runner = runner
        sockname = runner.addresses[0]
        return str(sockname[0]), int(sockname[1])

    async def close(self) -> None:
        """Stops listening and ends open connections. Idempotent."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # ----------------------------------------------------------------------------- plumbing

    async def _add_endpoint_header(
        self, request: web.Request, response: web.StreamResponse
    ) -> None:
        response.headers[ENDPOINT_HEADER] = self._backend.address

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
        if self._backend.closing:
            return error_response(503, "shutting down")
        return web.Response(status=200)

    async def _handle_version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": "kv-picker-sim"})

    async def _handle_models(self, request: web.Request) -> web.Response:
        base = {
            "id": self._model,
            "object": "model",
            "created": self._created,
            "owned_by": "vllm",
            "root": self._model,
            "parent": None,
            "max_model_len": self._max_model_len,
            "kv_picker_sim": self._identity,
        }
        loras = [
            {
                "id": name,
                "object": "model",
                "created": self._created,
                "owned_by": "vllm",
                "root": name,
                "parent": self._model,
                "max_model_len": self._max_model_len,
            }
            for name in self._lora_modules
        ]
        return web.json_response({"object": "list", "data": [base, *loras]})

    async def _handle_reset_prefix_cache(self, request: web.Request) -> web.Response:
        num_dropped = self._backend.reset_prefix_cache()
        logger.info("prefix cache reset: %d blocks dropped", num_dropped)
        return web.Response(status=200)

    async def _handle_metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=self._backend.render_metrics(), headers={"Content-Type": CONTENT_TYPE_LATEST}
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

    def _parse(self, payload: dict[str, Any], kind: Kind) -> GenerateParams:
        model = payload.get("model")
        if not isinstance(model, str) or not model:
            raise _BadRequest("'model' is required and must be a string")
        if model not in self._served_models:
            raise _BadRequest(f"The model `{model}` does not exist.", status=404)
        lora_name = model if model != self._model else None

        tokenizer = self._tokenizer
        if kind == "chat":
            messages = payload.get("messages")
            if not isinstance(messages, list) or not messages:
                raise _BadRequest("'messages' is required and must be a non-empty list")
            if not all(isinstance(m, dict) for m in messages):
                raise _BadRequest("each message must be an object")
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
            if tokenizer is None:
                prompt_token_ids = _prompt_token_ids(payload["prompt"])
            else:
                prompt_token_ids = _prompt_token_ids(
                    payload["prompt"], tokenizer.encode, tokenizer.vocab_size
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
        return GenerateParams(
            prompt_token_ids=prompt_token_ids,
            max_tokens=_max_tokens(payload, kind),
            stream=stream,
            include_usage=include_usage,
            cache_salt=cache_salt,
            lora_name=lora_name,
        )

    async def _handle_generate(self, request: web.Request, kind: Kind) -> web.StreamResponse:
        backend = self._backend
        if not backend.accepting:
            return error_response(503, _UNAVAILABLE)
        payload = await self._read_payload(request)
        if request.content_length is not None and request.content_length <= _INLINE_PARSE_BYTES:
            params = self._parse(payload, kind)
        else:
            # Tokenizing a long prompt takes milliseconds; keep the event loop (and every other
            # request's token timing) free meanwhile.
            params = await asyncio.to_thread(self._parse, payload, kind)
        model = payload["model"]
        req_id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        try:
            generation = await backend.submit(
                req_id, params, payload, path=request.path, headers=request.headers
            )
        except RequestRejected as exc:
            raise _BadRequest(str(exc)) from None
        try:
            if params.stream:
                return await self._respond_stream(request, kind, req_id, model, params, generation)
            return await self._respond_full(kind, req_id, model, params, generation)
        finally:
            backend.release(generation)

    async def _respond_full(
        self,
        kind: Kind,
        req_id: str,
        model: str,
        params: GenerateParams,
        generation: Generation,
    ) -> web.Response:
        token_ids: list[int] = []
        while True:
            event = await generation.next_token()
            if event is None:
                return error_response(503, _UNAVAILABLE)
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
            "usage": _usage(
                len(params.prompt_token_ids), generation.num_cached_tokens, len(token_ids)
            ),
            "kv_picker_sim": generation.timing(),
        }
        if generation.kv_transfer_params is not None:
            body["kv_transfer_params"] = generation.kv_transfer_params
        return web.json_response(body)

    async def _respond_stream(
        self,
        request: web.Request,
        kind: Kind,
        req_id: str,
        model: str,
        params: GenerateParams,
        generation: Generation,
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
            event = await generation.next_token()
            if event is None:
                # Headers are sent already, so the failure travels as an SSE error event.
                await send(_error_body(503, _UNAVAILABLE))
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
                data["kv_picker_sim"] = generation.timing()
            await send(data)
            if event.finished:
                break
        if params.include_usage:
            final = chunk([])
            final["usage"] = _usage(
                len(params.prompt_token_ids), generation.num_cached_tokens, num_output_tokens
            )
            await send(final)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response
