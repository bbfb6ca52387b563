"""Parse an OpenAI-style request body, once, into an :class:`~kv_picker.request.LLMRequest`.

Paths (query string ignored, matched by suffix):
- ``.../chat/completions``: ``messages`` is a non-empty list of ``{role, content}`` where
  content is a string, a list of content parts, or null.
- ``.../completions``: ``prompt`` is a string, a list of strings, a list of token ids, or a
  list of token-id lists.
- anything else with a JSON body (embeddings, responses, ...): ``model`` is still required;
  the body's text stands in for the prompt.

The typed prompt's rules (first prompt of a batch, non-text parts by identity) are in
:mod:`kv_picker.request`. Chat messages are rendered into ``Prompt.text`` one after another,
so two requests that share their first messages share a text prefix, as their token prefixes
do on the server.

Every string the picker keeps must be valid Unicode: JSON allows a lone UTF-16 surrogate
(``"\\ud800"``), which no encoder accepts later (hashing, metric labels, logs), so it is a 400
here. So is a number Python's JSON decoder refuses (integers over 4,300 digits).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping
from typing import Any

from kv_picker.config import ModelConfig
from kv_picker.errors import BadRequestError, ModelNotFoundError
from kv_picker.request import ChatMessage, LLMRequest, Prompt, RequestKind
from kv_picker.wire import MODEL_REWRITE_HEADERS, REQUEST_ID_HEADER

_MESSAGE_FIELDS = frozenset({"role", "content"})


def request_kind(path: str) -> RequestKind:
    path = path.split("?", 1)[0].rstrip("/")
    if path.endswith("chat/completions"):
        return "chat"
    if path.endswith("completions"):
        return "completions"
    return "other"


def _valid_text(text: str, where: str) -> str:
    """``text`` if it encodes to UTF-8 (no lone surrogates), else a 400 naming ``where``."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise BadRequestError(f"{where} is not valid Unicode (lone surrogate)") from None
    return text


def _is_token_ids(value: Any) -> bool:
    return isinstance(value, list) and all(type(t) is int for t in value)


def _completion_prompt(prompt: Any) -> Prompt:
    if isinstance(prompt, str):
        return Prompt("completions", _valid_text(prompt, "'prompt'"))
    if isinstance(prompt, list) and prompt:
        if all(isinstance(p, str) for p in prompt):
            return Prompt(
                "completions", _valid_text(prompt[0], "'prompt'[0]"), num_prompts=len(prompt)
            )
        if _is_token_ids(prompt):
            return Prompt("completions", " ".join(map(str, prompt)), token_ids=tuple(prompt))
        if all(_is_token_ids(p) for p in prompt):
            first = prompt[0]
            return Prompt(
                "completions",
                " ".join(map(str, first)),
                token_ids=tuple(first),
                num_prompts=len(prompt),
            )
    raise BadRequestError("'prompt' must be a string, a list of strings, or a list of token ids")


def _content(content: Any, where: str) -> tuple[str, str]:
    """(text parts joined, text plus the identity of other parts) of a message's content."""
    if content is None:
        return "", ""
    if isinstance(content, str):
        _valid_text(content, f"{where}.content")
        return content, content
    if isinstance(content, list):
        texts: list[str] = []
        identity: list[str] = []
        for j, part in enumerate(content):
            if not isinstance(part, Mapping) or not isinstance(part.get("type"), str):
                raise BadRequestError(f"{where}.content[{j}] must be an object with a 'type'")
            if part["type"] == "text":
                text = part.get("text")
                if not isinstance(text, str):
                    raise BadRequestError(f"{where}.content[{j}].text must be a string")
                _valid_text(text, f"{where}.content[{j}].text")
                texts.append(text)
                identity.append(text)
            else:
                # Images, audio, files: their identity matters for caching, not their bytes.
                try:
                    rendered = json.dumps(part, sort_keys=True, separators=(",", ":"))
                except (TypeError, ValueError):
                    raise BadRequestError(f"{where}.content[{j}] cannot be rendered") from None
                identity.append(_valid_text(rendered, f"{where}.content[{j}]"))
        return "".join(texts), "".join(identity)
    raise BadRequestError(f"{where}.content must be a string, a list of parts, or null")


def _chat_prompt(data: Mapping[str, Any]) -> Prompt:
    messages = data.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequestError("'messages' must be a non-empty list")
    parsed: list[ChatMessage] = []
    pieces: list[str] = []
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, Mapping):
            raise BadRequestError(f"{where} must be an object")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise BadRequestError(f"{where}.role must be a non-empty string")
        _valid_text(role, f"{where}.role")
        text, identity = _content(message.get("content"), where)
        extra = {k: v for k, v in message.items() if k not in _MESSAGE_FIELDS}
        parsed.append(ChatMessage(role, text, identity, extra))
        pieces.append(f"<|{role}|>\n{identity}\n")
    # Truthiness, as the server's request model coerces these flags.
    add_generation_prompt = bool(data.get("add_generation_prompt", True))
    if data.get("continue_final_message"):
        add_generation_prompt = False
    return Prompt(
        "chat", "".join(pieces), tuple(parsed), add_generation_prompt=add_generation_prompt
    )


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
    except ValueError as exc:  # e.g. an integer literal over the conversion limit
        raise BadRequestError(f"request body has a value JSON decoding refuses: {exc}") from None
    if not isinstance(data, dict):
        raise BadRequestError("request body must be a JSON object")
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequestError("model not found in request body ('model' must be a string)")
    _valid_text(model, "'model'")
    kind = request_kind(path)
    if kind == "chat":
        prompt = _chat_prompt(data)
    elif kind == "completions":
        if "prompt" not in data:
            raise BadRequestError("'prompt' is required for completions")
        prompt = _completion_prompt(data["prompt"])
    else:
        prompt = Prompt("other", body.decode("utf-8", errors="replace"))
    stream = data.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequestError("'stream' must be true or false")
    cache_salt = data.get("cache_salt")
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise BadRequestError("'cache_salt' must be a string")
    if cache_salt:
        _valid_text(cache_salt, "'cache_salt'")

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
        prompt=prompt,
        stream=stream,
        cache_salt=cache_salt or None,
        lora_adapter=lora_adapter,
        headers=headers,
        body_size_bytes=len(body),
    )
