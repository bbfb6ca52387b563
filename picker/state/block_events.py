"""What the precise index consumes: KV-event records, their tiers, and how a stored event
becomes keys.

The records are the contract between the event sources and the index. The wire decoder
(:mod:`kv_picker.sources.kv_event_decoder`) produces them from vLLM's msgpack, whichever of its
encodings arrives; anything else (a simulator, a test, a benchmark) may build them directly.
Each backend (in-process :mod:`kv_picker.state.kv_index`, shared
:mod:`kv_picker.state.redis_index`) applies them the same way::

    BlockStored ──EventKeys.stored_keys──> (tier, group, keys)   dropped blocks reported with
                                           ──> ledger (endpoint, tier, group): engine hash -> key
                                           ──> holders (tier): key -> endpoints
    BlockRemoved (medium, group_idx) ──ledger (endpoint, tier, group)──> holders (tier)
    AllBlocksCleared ──> every entry of the endpoint, every tier and group

Entries are kept per (endpoint, tier, group), so a CPU-tier eviction or a removal in another
KV-cache group never deletes the GPU full-attention entry of the same block.

:class:`Tiers` maps vLLM's ``medium`` (``GPU``, ``CPU``, ``STORAGE``; none means GPU) to a tier
and its score weight. :class:`EventKeys` is the one front half: our dual keys computed from the
event's ``token_ids`` (or vLLM's own hashes in strict mode; see
:mod:`kv_picker.state.block_keys`), keys of a tier event that carries no tokens resolved through
the engine-hash map (an offloading connector's placeholder events name a block by hash alone),
engine blocks that span several of ours split into ours (:func:`sub_block_hashes`), and the
decision of what is not indexed (media without a tier, groups that are not full attention, block
sizes that are not a multiple of ours, multimodal blocks, blocks whose parent is unknown),
reported as
``kv_picker_kv_events_dropped_total{reason}``. The same object computes a request's keys for the
scorer, so both sides share one key space.

Attention kinds: ``full_attention``, ``mla_attention`` (DeepSeek-style latent attention) and
``sink_full_attention`` keep every block of the prefix, so they are indexed alike. Sliding
window, chunked local, Mamba, cross and encoder-only groups keep only some blocks (or none) and
never extend a prefix: they are not indexed. A group's kind is learned from its stored events;
an event without a kind takes its group's learned kind, and full attention when none was seen
(older vLLM sends no kind and one group).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import xxhash

from kv_picker.state.block_keys import VllmBlockHasher
from kv_picker.state.hashing import chain_root, token_keys

if TYPE_CHECKING:
    from kv_picker.state.block_ledger import Ledger

KEY_MODES = ("dual", "strict")

# Why a stored event (or part of it) was not indexed; label values of the dropped-events metric.
DROP_UNKNOWN_PARENT = "unknown_parent"
DROP_UNKNOWN_HASH = "unknown_hash"
DROP_BLOCK_SIZE = "block_size"
DROP_TOKEN_COUNT = "token_count"
DROP_EXTRA_KEYS = "extra_keys"
DROP_MEDIUM = "medium"
DROP_ATTENTION = "attention_kind"
DROP_LORA_ID = "lora_id_only"
DROP_BAD_TOKENS = "bad_token_ids"
# A removal of a block the index did not hold (never indexed, or already evicted).
DROP_NOT_HELD = "not_held"

FULL_ATTENTION_KINDS = frozenset({"full_attention", "mla_attention", "sink_full_attention"})
"""``kv_cache_spec_kind`` values whose groups keep every block of a prefix."""

MAX_TIERS = 8
"""Tiers the index can tell apart (the Redis layout gives each endpoint one byte per block)."""

DEFAULT_TIER_WEIGHTS: Mapping[str, float] = {"gpu": 1.0, "cpu": 0.8, "storage": 0.5}
"""Score weight of a block by the tier holding it: llm-d's GPU 1.0 and CPU 0.8, and storage
(vLLM's ``STORAGE`` medium: disk or a remote store behind an offloading connector) 0.5."""

_FIXED_TIER_IDS = {"gpu": 0, "cpu": 1, "storage": 2}
GPU_TIER = 0


class Tiers:
    """The media the index keeps, their tier ids and score weights.

    vLLM's ``medium`` is matched without regard to case; an event without one is GPU's. Ids are
    fixed for ``gpu`` (0), ``cpu`` (1) and ``storage`` (2); other configured names (say an
    offloading connector's own medium) take 3 and up in name order, so replicas with the same
    config number them alike (the Redis layout depends on it). A medium without a weight is not
    indexed.

    Args:
        weights: tier name -> weight in (0, 1]; must name ``gpu``.

    Raises:
        ValueError: no ``gpu`` weight, a weight outside (0, 1], a name given twice (ignoring
            case), or more than :data:`MAX_TIERS` tiers.
    """

    __slots__ = ("_ids", "names", "weights")

    def __init__(self, weights: Mapping[str, float] | None = None) -> None:
        given = DEFAULT_TIER_WEIGHTS if weights is None else weights
        normalized: dict[str, float] = {}
        for name, weight in given.items():
            lowered = name.lower()
            if lowered in normalized:
                raise ValueError(f"tier {name!r} is given twice")
            if not 0 < weight <= 1:
                raise ValueError(f"tier {name!r}: weight must be in (0, 1], got {weight}")
            normalized[lowered] = float(weight)
        if "gpu" not in normalized:
            raise ValueError("the gpu tier needs a weight (events without a medium are GPU's)")
        ids = {name: _FIXED_TIER_IDS[name] for name in normalized if name in _FIXED_TIER_IDS}
        next_id = len(_FIXED_TIER_IDS)
        for name in sorted(n for n in normalized if n not in _FIXED_TIER_IDS):
            ids[name] = next_id
            next_id += 1
        if max(ids.values()) >= MAX_TIERS:
            raise ValueError(f"at most {MAX_TIERS} tiers (gpu, cpu, storage and 5 more)")
        size = max(ids.values()) + 1
        self.names: tuple[str | None, ...] = tuple(
            next((n for n, i in ids.items() if i == t), None) for t in range(size)
        )
        self.weights: tuple[float, ...] = tuple(normalized.get(n or "", 0.0) for n in self.names)
        self._ids: dict[str | None, int] = {None: GPU_TIER}
        self._ids.update(ids)

    def id_of(self, medium: str | None) -> int | None:
        """The tier of a ``medium`` (None: not indexed)."""
        tier = self._ids.get(medium)
        if tier is None and medium is not None:
            tier = self._ids.get(medium.lower())
        return tier

    def __len__(self) -> int:
        return len(self.weights)


@dataclass(slots=True)
class BlockStored:
    """Blocks that became cached. ``block_hashes`` are normalised to 64-bit ints."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None


@dataclass(slots=True)
class BlockRemoved:
    """Cached blocks that were evicted."""

    block_hashes: list[int]
    medium: str | None = None
    group_idx: int | None = None


@dataclass(slots=True)
class AllBlocksCleared:
    """The endpoint's prefix cache was reset."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


StoredBlocks = tuple[int, int, list[int], list[int]]
"""What of a ``BlockStored`` the index records: (tier, group, engine hashes, keys), the keys
aligned with the first ``len(keys)`` hashes."""


def sub_block_hashes(engine_hashes: Sequence[int], multiple: int) -> list[int]:
    """The ledger's hashes for engine blocks that each span ``multiple`` of our blocks.

    vLLM reports blocks of its own size, which can be a multiple of ours (an offloading
    connector's or LMCache's chunks, a hybrid model's attention group). Each such block becomes
    ``multiple`` of ours: the last keeps the engine's hash (so that a later event naming it as
    its parent resolves to the right key), the others get hashes derived from it and their
    position, so that a removal naming the engine block removes all of them.
    """
    hashes: list[int] = []
    pack = _SUB_BLOCK.pack
    for engine_hash in engine_hashes:
        for position in range(1, multiple):
            hashes.append(xxhash.xxh3_64_intdigest(pack(engine_hash, position)))
        hashes.append(engine_hash)
    return hashes


_SUB_BLOCK = struct.Struct("<QI")


class EventKeys:
    """From a ``BlockStored`` event (and from a request's tokens) to the keys the index records.

    Args:
        block_size_tokens: tokens per block; must equal vLLM's ``--block-size``.
        key_mode: ``dual`` (our keys from ``token_ids``) or ``strict`` (vLLM's hashes).
        hash_algo: strict mode's ``--prefix-caching-hash-algo``.
        hash_seed: strict mode's ``PYTHONHASHSEED``.
        on_drop: called with (reason, blocks) when a stored event is not (fully) indexed.
        tiers: the media indexed and their weights (default :data:`DEFAULT_TIER_WEIGHTS`).
    """

    __slots__ = ("_on_drop", "block_size_tokens", "key_mode", "strict_hasher", "tiers")

    def __init__(
        self,
        block_size_tokens: int = 16,
        key_mode: str = "dual",
        hash_algo: str = "sha256",
        hash_seed: str = "0",
        on_drop: Callable[[str, int], None] | None = None,
        tiers: Tiers | None = None,
    ) -> None:
        if block_size_tokens <= 0:
            raise ValueError(f"block_size_tokens must be positive, got {block_size_tokens}")
        if key_mode not in KEY_MODES:
            raise ValueError(f"key mode must be dual or strict, got {key_mode!r}")
        self.block_size_tokens = block_size_tokens
        self.key_mode = key_mode
        self.strict_hasher = (
            VllmBlockHasher(hash_algo, hash_seed, block_size_tokens)
            if key_mode == "strict"
            else None
        )
        self._on_drop = on_drop
        self.tiers = tiers if tiers is not None else Tiers()

    def request_keys(
        self,
        token_ids: Sequence[int],
        model: str,
        lora_name: str | None,
        cache_salt: str | None,
        max_blocks: int = 0,
    ) -> list[int]:
        """A request's block keys, in the same key space as the stored events'.

        Raises:
            OverflowError, TypeError: a token id is not a uint32 int.
        """
        if self.strict_hasher is not None:
            return self.strict_hasher.block_keys(token_ids, lora_name, cache_salt, max_blocks)
        root = chain_root(model, lora_name, cache_salt)
        return token_keys(token_ids, root, self.block_size_tokens, max_blocks)

    def drop(self, reason: str, blocks: int) -> None:
        """Report blocks not indexed (or removals of blocks not held)."""
        if blocks and self._on_drop is not None:
            self._on_drop(reason, blocks)

    def stored_keys(
        self, ledger: Ledger, endpoint_id: int, event: BlockStored, model: str
    ) -> StoredBlocks | None:
        """Where and under which keys a stored event's blocks are indexed.

        What cannot be indexed is reported to ``on_drop`` with its reason.

        Args:
            ledger: the backend's ledger: it resolves the event's parent hash (and the hashes
                of an event without tokens), and knows the kinds of the endpoint's groups.
            endpoint_id: the endpoint that stored the blocks.
            event: the decoded event.
            model: the model the endpoint's events belong to (from the topic or the config).

        Returns:
            (tier, group, engine hashes, keys), or None when nothing is indexed.
        """
        num_blocks = len(event.block_hashes)
        tier = self.tiers.id_of(event.medium)
        if tier is None:
            self.drop(DROP_MEDIUM, num_blocks)
            return None
        group = event.group_idx or 0
        kind = event.kv_cache_spec_kind
        if kind is None:
            full = ledger.group_is_full(endpoint_id, group)
        else:
            full = kind in FULL_ATTENTION_KINDS
            ledger.learn_group(endpoint_id, group, full)
        if not full:
            self.drop(DROP_ATTENTION, num_blocks)
            return None
        if self.strict_hasher is not None:
            # vLLM's hashes are the keys: no tokens needed, nothing to resolve.
            if event.block_size != self.block_size_tokens:
                self.drop(DROP_BLOCK_SIZE, num_blocks)
                return None
            hashes = event.block_hashes
            return tier, group, hashes, hashes
        if not event.token_ids and num_blocks:
            return self._resolved(ledger, endpoint_id, tier, group, event)
        keys, reason, multiple = self._keys_from_tokens(
            ledger, endpoint_id, tier, group, event, model
        )
        if reason:
            self.drop(reason, num_blocks - len(keys) // multiple)
        if not keys:
            return None
        ledger.learn_multiple(endpoint_id, tier, group, multiple)
        hashes = event.block_hashes
        if multiple > 1:
            hashes = sub_block_hashes(hashes[: len(keys) // multiple], multiple)
        return tier, group, hashes, keys

    def apply_removed(self, ledger: Ledger, endpoint_id: int, event: BlockRemoved) -> int:
        """Apply a ``BlockRemoved`` of its (medium, group) to a backend's ledger (which tells
        the backend what is no longer held); returns the engine blocks it hit."""
        tier = self.tiers.id_of(event.medium)
        if tier is None:
            return 0
        group = event.group_idx or 0
        hashes, multiple = self.engine_block_hashes(
            ledger, endpoint_id, tier, group, event.block_hashes
        )
        return ledger.remove(endpoint_id, tier, group, hashes) // multiple

    def engine_block_hashes(
        self, ledger: Ledger, endpoint_id: int, tier: int, group: int, hashes: Sequence[int]
    ) -> tuple[Sequence[int], int]:
        """The ledger's hashes for engine blocks named in an event of (endpoint, tier, group),
        and our blocks per engine block (see :func:`sub_block_hashes`)."""
        multiple = ledger.multiple(endpoint_id, tier, group)
        return (hashes if multiple == 1 else sub_block_hashes(hashes, multiple)), multiple

    def _resolved(
        self, ledger: Ledger, endpoint_id: int, tier: int, group: int, event: BlockStored
    ) -> StoredBlocks | None:
        """A tier event without tokens: blocks the endpoint already indexed, by engine hash."""
        hashes: list[int] = []
        keys: list[int] = []
        named, multiple = self.engine_block_hashes(
            ledger, endpoint_id, tier, group, event.block_hashes
        )
        for engine_hash in named:
            key = ledger.resolve(endpoint_id, tier, group, engine_hash)
            if key is not None:
                hashes.append(engine_hash)
                keys.append(key)
        self.drop(DROP_UNKNOWN_HASH, len(event.block_hashes) - len(keys) // multiple)
        return (tier, group, hashes, keys) if keys else None

    def _keys_from_tokens(
        self,
        ledger: Ledger,
        endpoint_id: int,
        tier: int,
        group: int,
        event: BlockStored,
        model: str,
    ) -> tuple[list[int], str, int]:
        """Our keys for the event's blocks (``multiple`` of ours per engine block), why some
        were not indexed, and ``multiple``."""
        engine_hashes = event.block_hashes
        lora_name = event.lora_name
        if event.lora_id is not None and not lora_name:
            return [], DROP_LORA_ID, 1  # an adapter we cannot name would look like the base model
        size = self.block_size_tokens
        event_size = event.block_size
        if event_size <= 0 or event_size % size:
            return [], DROP_BLOCK_SIZE, 1
        multiple = event_size // size
        num_blocks = len(engine_hashes)
        token_ids = event.token_ids
        if len(token_ids) != num_blocks * event_size:
            return [], DROP_TOKEN_COUNT, multiple
        parent_hash = event.parent_block_hash
        extra_keys = event.extra_keys
        salt: str | None = None
        reason = ""
        if extra_keys:
            usable = num_blocks
            for i in range(min(len(extra_keys), num_blocks)):
                extra = extra_keys[i]
                if extra is None:
                    continue
                items = list(extra) if isinstance(extra, list | tuple) else [extra]
                if lora_name and items and items[0] == lora_name:
                    del items[0]
                if not items:
                    continue
                if i == 0 and parent_hash is None and len(items) == 1 and isinstance(items[0], str):
                    salt = items[0]  # vLLM puts cache_salt in block 0's extra keys only
                    continue
                # Multimodal or embedding keys: a text request can never produce this block.
                usable = i
                reason = DROP_EXTRA_KEYS
                break
            num_blocks = usable
            if not num_blocks:
                return [], reason, multiple
        if parent_hash is None:
            parent = chain_root(model, lora_name, salt)
        else:
            # (with engine blocks of several of ours, the parent's hash names its last one)
            resolved = ledger.resolve(endpoint_id, tier, group, parent_hash)
            if resolved is None:
                return [], DROP_UNKNOWN_PARENT, multiple
            parent = resolved
        try:
            keys = token_keys(token_ids[: num_blocks * event_size], parent, size)
        except (OverflowError, TypeError):
            return [], DROP_BAD_TOKENS, multiple
        return keys, reason, multiple
