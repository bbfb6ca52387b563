"""vLLM's KV-event wire format: frames and msgpack payloads to event records.

Apart from the subscriber because it is a pure function of bytes: no sockets, no sequence state,
no index. The subscriber, the simulated endpoint's tests and fuzzing all use the same decoder,
and what it produces are the index's own records (:mod:`kv_picker.state.block_events`).

Wire format (vLLM ``vllm/distributed/kv_events.py``; reference notes §1)::

    frames:  [topic, seq (8 bytes, big-endian), msgpack payload]      topic: kv@<endpoint>@<model>
    payload: [ts, events, data_parallel_rank]     (a map with those names is accepted too)
    event:   ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id,
              medium, lora_name, extra_keys, group_idx, kv_cache_spec_kind, ...]   older vLLM
             {"type": "BlockStored", "block_hashes": ..., ...}                       newer vLLM
             BlockRemoved(block_hashes, medium, group_idx), AllBlocksCleared()
    hash:    uint64, or the digest's bytes (the last 8 bytes, big-endian, name the block)
    replay:  DEALER sends [b"", start seq]; ROUTER answers [b"", (topic,) seq, payload] per
             buffered batch, then a seq frame of END_SEQ

Unknown fields and unknown event types are ignored; anything else that does not fit raises
:class:`MalformedMessage`, which the subscriber counts and drops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack

from kv_picker.state.block_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

_U64_MASK = (1 << 64) - 1
END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The replay socket's end-of-replay marker (``ff`` × 8)."""

_STORED_FIELDS = (
    "block_hashes",
    "parent_block_hash",
    "token_ids",
    "block_size",
    "lora_id",
    "medium",
    "lora_name",
    "extra_keys",
    "group_idx",
    "kv_cache_spec_kind",
)
_REMOVED_FIELDS = ("block_hashes", "medium", "group_idx")


class MalformedMessage(ValueError):
    """A KV-event message that does not follow the wire format."""


@dataclass(slots=True)
class EventBatch:
    """One published batch (one engine step)."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


def _hash64(value: Any) -> int:
    if type(value) is int:
        return value & _U64_MASK
    if isinstance(value, bytes) and value:
        return int.from_bytes(value[-8:], "big")
    raise MalformedMessage(f"block hash must be an int or non-empty bytes, got {value!r:.40}")


_INT_ONLY = {int}


def _hashes(value: Any) -> list[int]:
    if not isinstance(value, list):
        raise MalformedMessage("block_hashes must be a list")
    # vLLM's default: uint64 ints, kept as decoded (checked in C-speed passes, no copy).
    if value and set(map(type, value)) == _INT_ONLY and min(value) >= 0 and max(value) <= _U64_MASK:
        return value
    return [_hash64(v) for v in value]


def _optional(value: Any, kind: type, name: str) -> Any:
    if value is None or (type(value) is kind):
        return value
    raise MalformedMessage(f"{name} must be {kind.__name__} or nil")


def _fields(event: Any, names: tuple[str, ...]) -> dict[str, Any]:
    if isinstance(event, dict):
        return event
    return dict(zip(names, event[1:], strict=False))


MAX_GROUP_IDX = 0xFFFF  # KV-cache groups are a model's few attention kinds; the ledger's bound


def _group(value: Any) -> int | None:
    group: int | None = _optional(value, int, "group_idx")
    if group is not None and not 0 <= group <= MAX_GROUP_IDX:
        raise MalformedMessage(f"group_idx must be in 0..{MAX_GROUP_IDX}")
    return group


def _decode_event(event: Any) -> KVEvent | None:
    if isinstance(event, dict):
        tag = event.get("type")
    elif isinstance(event, list) and event:
        tag = event[0]
    else:
        raise MalformedMessage("an event must be a tagged array or a map with a 'type'")
    if tag == "BlockStored":
        f = _fields(event, _STORED_FIELDS)
        token_ids = f.get("token_ids")
        block_size = f.get("block_size")
        if not isinstance(token_ids, list):
            raise MalformedMessage("BlockStored.token_ids must be a list")
        # 0 in an offloading connector's placeholder events, which carry no tokens either.
        if type(block_size) is not int or block_size < 0:
            raise MalformedMessage("BlockStored.block_size must be a non-negative int")
        parent = f.get("parent_block_hash")
        extra_keys = f.get("extra_keys")
        if extra_keys is not None and not isinstance(extra_keys, list):
            raise MalformedMessage("BlockStored.extra_keys must be a list or nil")
        return BlockStored(
            block_hashes=_hashes(f.get("block_hashes")),
            parent_block_hash=None if parent is None else _hash64(parent),
            token_ids=token_ids,
            block_size=block_size,
            lora_id=_optional(f.get("lora_id"), int, "lora_id"),
            medium=_optional(f.get("medium"), str, "medium"),
            lora_name=_optional(f.get("lora_name"), str, "lora_name"),
            extra_keys=extra_keys,
            group_idx=_group(f.get("group_idx")),
            kv_cache_spec_kind=_optional(f.get("kv_cache_spec_kind"), str, "kv_cache_spec_kind"),
        )
    if tag == "BlockRemoved":
        f = _fields(event, _REMOVED_FIELDS)
        return BlockRemoved(
            block_hashes=_hashes(f.get("block_hashes")),
            medium=_optional(f.get("medium"), str, "medium"),
            group_idx=_group(f.get("group_idx")),
        )
    if tag == "AllBlocksCleared":
        return AllBlocksCleared()
    if not isinstance(tag, str):
        raise MalformedMessage("an event's tag must be a string")
    return None  # an event type this picker does not know: ignored


def decode_payload(payload: bytes) -> EventBatch:
    """Decode a msgpack ``KVEventBatch``.

    Raises:
        MalformedMessage: for anything that is not a batch in either encoding.
    """
    try:
        batch = msgpack.unpackb(payload, raw=False, strict_map_key=False, use_list=True)
    except Exception as exc:  # msgpack raises many types on arbitrary bytes
        raise MalformedMessage(f"payload is not msgpack: {type(exc).__name__}") from None
    ts: Any
    raw_events: Any
    rank: Any
    if isinstance(batch, dict):
        ts, raw_events, rank = batch.get("ts"), batch.get("events"), batch.get("data_parallel_rank")
    elif isinstance(batch, list) and len(batch) >= 2:
        ts, raw_events = batch[0], batch[1]
        rank = batch[2] if len(batch) > 2 else None
    else:
        raise MalformedMessage("payload must be [ts, events, dp_rank] or a map")
    if type(ts) not in (int, float):
        raise MalformedMessage("batch ts must be a number")
    if not isinstance(raw_events, list):
        raise MalformedMessage("batch events must be a list")
    if rank is not None and type(rank) is not int:
        raise MalformedMessage("data_parallel_rank must be an int or nil")
    try:
        decoded = [_decode_event(e) for e in raw_events]
    except MalformedMessage:
        raise
    except Exception as exc:  # e.g. a map whose keys are not strings
        raise MalformedMessage(f"bad event: {type(exc).__name__}") from None
    return EventBatch(float(ts), [e for e in decoded if e is not None], rank)


def decode_seq(frame: bytes) -> int:
    """The sequence number frame (8 bytes, big-endian, unsigned)."""
    if len(frame) != 8:
        raise MalformedMessage(f"sequence frame must be 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big")


def parse_topic(topic: bytes) -> tuple[str | None, str | None]:
    """(endpoint, model) from a ``kv@<endpoint>@<model>`` topic; (None, None) otherwise."""
    try:
        text = topic.decode()
    except UnicodeDecodeError:
        return None, None
    parts = text.split("@")
    if len(parts) != 3 or parts[0] != "kv" or not parts[1]:
        return None, None
    return parts[1], parts[2] or None
