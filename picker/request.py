"""One inference request as the picker sees it: the typed prompt and the request around it.

The body is parsed once (:mod:`kv_picker.handlers.body`) into a :class:`Prompt`; every
consumer reads that, never the JSON again:

```
body JSON ──parse──> Prompt
                      ├── text              approximate prefix hashing (characters)
                      ├── messages          precise mode: the model's chat template
                      └── token_ids         precise mode: a completion sent as token ids
```

Rules, the same for every consumer:

- chat: ``messages`` in order. A message's ``content`` is its text parts joined; other parts
  (images, audio, files) count by identity (their JSON) in ``text`` and are left out of what
  the chat template renders, because blocks at and after a multimodal item carry the item's
  hash on the server and can never match a text-only prefix anyway.
- completions: a list of prompts is served as one batch on one endpoint; it is routed on its
  *first* prompt, whose blocks are the ones a later request can share.
- anything else (embeddings, responses, ...): the body's text stands in for the prompt.

After the pick the prompt is dropped (:meth:`LLMRequest.drop_payload`): a long streamed
response keeps nothing of the request body alive.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

RequestKind = Literal["completions", "chat", "other"]


@dataclass(frozen=True, slots=True)
class ChatMessage:
    """One chat message.

    Attributes:
        role: ``system``, ``user``, ``assistant``, ``tool``, ...
        content: the text parts of the content, joined ("" for null content).
        identity: ``content`` plus the non-text parts' canonical JSON, in order (what prefix
            hashing by characters reads).
        extra: the message's other fields (``name``, ``tool_calls``, ``tool_call_id``, ...),
            which chat templates may render.
    """

    role: str
    content: str
    identity: str
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Prompt:
    """What the model will be asked to continue (see the module docstring).

    Attributes:
        kind: ``chat``, ``completions`` or ``other``.
        text: the prompt as one string, for hashing by characters.
        messages: chat messages (chat only).
        token_ids: a completion prompt sent as token ids (the first prompt of a batch).
        add_generation_prompt: chat: whether the template adds the assistant's header.
        num_prompts: completions: how many prompts the batch holds.
    """

    kind: RequestKind
    text: str
    messages: tuple[ChatMessage, ...] = ()
    token_ids: tuple[int, ...] | None = None
    add_generation_prompt: bool = True
    num_prompts: int = 1


EMPTY_PROMPTS: Mapping[RequestKind, Prompt] = {
    "completions": Prompt("completions", ""),
    "chat": Prompt("chat", ""),
    "other": Prompt("other", ""),
}
"""Prebuilt empties: what a request holds once its prompt has been dropped."""


@dataclass(slots=True)
class LLMRequest:
    """One parsed inference request.

    Attributes:
        request_id: from ``x-request-id`` or generated.
        model: the model named in the body.
        target_model: the model the pool should serve (after a rewrite header), the base
            model when ``model`` names a LoRA adapter.
        path: request path without the query string.
        prompt: the typed prompt (empty once :meth:`drop_payload` ran).
        stream: the client asked for a streamed (SSE) response.
        cache_salt: tenant isolation for prefix caching.
        lora_adapter: the adapter, when ``model`` names one the pool declares.
        headers: request headers, lower-cased names.
        priority: admission priority; negative means sheddable.
        body_size_bytes: size of the request body.
        state: per-request scratch space for plugins (e.g. the block keys a scorer computed
            and records after the pick); cleared with the prompt.
        serial: unique among this process's requests (a client may send one ``x-request-id``
            twice): names the request in what a plugin keeps past the pick.
    """

    request_id: str
    model: str
    target_model: str
    path: str
    prompt: Prompt
    stream: bool = False
    cache_salt: str | None = None
    lora_adapter: str | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    priority: int = 0
    body_size_bytes: int = 0
    state: dict[str, Any] = field(default_factory=dict)
    serial: int = field(default_factory=itertools.count().__next__)

    @property
    def kind(self) -> RequestKind:
        return self.prompt.kind

    def drop_payload(self) -> None:
        """Release the prompt and the plugins' scratch state (the pick has been made)."""
        self.prompt = EMPTY_PROMPTS[self.prompt.kind]
        self.state.clear()
