"""Parse an OpenAI-style request body into an :class:`LLMRequest`.

Paths (query string ignored, matched by suffix):
- ``.../chat/completions``: ``messages`` is a non-empty list of ``{role, content}`` where
  content is a string, a list of content parts (text parts are used), or null.
- ``.../completions``: ``prompt`` is a string, a list of strings, a list of token ids, or a
  list of token-id lists.
- anything else with a JSON body (embeddings, responses, ...): ``model`` is still required;
  the body's JSON text stands in for the prompt when hashing.

The text used for prefix hashing renders chat messages one after another, so two requests that
share their first messages share a text prefix, as their token prefixes do on the server.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import Any

from kv_picker.config import ModelConfig
from kv_picker.errors import BadRequestError, ModelNotFoundError
from kv_picker.scheduling.types import LLMRequest
from kv_picker.wire import MODEL_REWRITE_HEADERS, REQUEST_ID_HEADER


def request_kind(path: str) -> str:
    path = path.split("?", 1)[0].rstrip("/")
    if path.endswith("chat/completions"):
        return "chat"
    if path.endswith("completions"):
        return "completions"
    return "other"


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return "".join(prompt)
        if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
            return " ".join(map(str, prompt))
        if all(
            isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
            for p in prompt
        ):
            return "\n".join(" ".join(map(str, p)) for p in prompt)
    raise BadRequestError("'prompt' must be a string, a list of strings, or a list of token ids")


def _content_text(content: Any, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
                raise BadRequestError(f"{where}.content[{j}] must be an object with a 'type'")
            text = part.get("text")
            if part["type"] == "text":
                if not isinstance(text, str):
                    raise BadRequestError(f"{where}.content[{j}].text must be a string")
                parts.append(text)
            else:
                # Images, audio, files: their identity matters for caching, not their bytes.
                parts.append(json.dumps(part, sort_keys=True, separators=(",", ":")))
        return "".join(parts)
    raise BadRequestError(f"{where}.content must be a string, a list of parts, or null")


def _chat_text(messages: Any) -> str:
    if not isinstance(messages, list) or not messages:
        raise BadRequestError("'messages' must be a non-empty list")
    pieces = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise BadRequestError(f"{where} must be an object")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise BadRequestError(f"{where}.role must be a non-empty string")
        pieces.append(f"<|{role}|>\n{_content_text(message.get('content'), where)}\n")
    return "".join(pieces)


def parse_request(
    body: bytes,
    headers: Mapping[str, str],
    models: tuple[ModelConfig, ...] = (),
) -> LLMRequest:
    """Build an :class:`LLMRequest` from a complete body and the request headers.

    Args:
        body: the whole request body.
        headers: request headers with lower-cased names (``:path`` included).
        models: models the pool declares; empty means any model is accepted.

    Raises:
        BadRequestError: malformed JSON or a missing/invalid field (400).
        ModelNotFoundError: the pool declares its models and this is not one of them (404).
    """
    path = headers.get(":path", "") or headers.get("x-original-path", "") or "/v1/completions"
    try:
        data = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequestError(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise BadRequestError("request body is nested too deeply") from None
    if not isinstance(data, dict):
        raise BadRequestError("request body must be a JSON object")
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequestError("model not found in request body ('model' must be a string)")
    kind = request_kind(path)
    if kind == "chat":
        prompt = _chat_text(data.get("messages"))
    elif kind == "completions":
        if "prompt" not in data:
            raise BadRequestError("'prompt' is required for completions")
        prompt = _prompt_text(data["prompt"])
    else:
        prompt = body.decode("utf-8", errors="replace")
    stream = data.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequestError("'stream' must be true or false")
    cache_salt = data.get("cache_salt")
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise BadRequestError("'cache_salt' must be a string")

    target_model = model
    for header in MODEL_REWRITE_HEADERS:
        if headers.get(header):
            target_model = headers[header]
            break
    lora_adapter = None
    if models:
        for declared in models:
            if target_model == declared.name:
                break
            if target_model in declared.lora_adapters:
                lora_adapter = target_model
                target_model = declared.name
                break
        else:
            raise ModelNotFoundError(f"model {target_model!r} is not served by this pool")

    request_id = headers.get(REQUEST_ID_HEADER) or str(uuid.uuid4())
    return LLMRequest(
        request_id=request_id,
        model=model,
        target_model=target_model,
        path=path.split("?", 1)[0],
        kind=kind,
        prompt=prompt,
        stream=stream,
        cache_salt=cache_salt or None,
        lora_adapter=lora_adapter,
        headers=headers,
        body_size_bytes=len(body),
        body=data,
    )
