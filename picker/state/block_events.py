"""What the precise index consumes: KV-event records, and how a stored event becomes keys.

The records are the contract between the event sources and the index. The wire decoder
(:mod:`kv_picker.sources.kv_event_decoder`) produces them from vLLM's msgpack, whichever of its
encodings arrives; anything else (a simulator, a test, a benchmark) may build them directly.
Each backend (in-process :mod:`kv_picker.state.kv_index`, shared
:mod:`kv_picker.state.redis_index`) applies them the same way::

    BlockStored ──EventKeys.stored_keys──> keys (dropped blocks reported with a reason)
                                           ──> ledger (engine hash -> key, bounds) + holders
    BlockRemoved ──ledger (engine hash -> key)──> holders
    AllBlocksCleared ──> every entry of the endpoint

:class:`EventKeys` is the one front half: our dual keys computed from the event's ``token_ids``
(or vLLM's own hashes in strict mode; see :mod:`kv_picker.state.block_keys`), and the decision
of what is not indexed (other media than GPU, non-full-attention groups, multimodal blocks,
blocks whose parent is unknown), reported as ``kv_picker_kv_events_dropped_total{reason}``.
The same object computes a request's keys for the scorer, so both sides share one key space.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kv_picker.state.block_keys import VllmBlockHasher
from kv_picker.state.block_ledger import BlockLedger
from kv_picker.state.hashing import chain_root, token_keys

KEY_MODES = ("dual", "strict")

# Why a stored event (or part of it) was not indexed; label values of the dropped-events metric.
DROP_UNKNOWN_PARENT = "unknown_parent"
DROP_BLOCK_SIZE = "block_size"
DROP_TOKEN_COUNT = "token_count"
DROP_EXTRA_KEYS = "extra_keys"
DROP_MEDIUM = "medium"
DROP_ATTENTION = "attention_kind"
DROP_LORA_ID = "lora_id_only"
DROP_BAD_TOKENS = "bad_token_ids"

_INDEXED_MEDIA = (None, "GPU", "gpu")
_INDEXED_KINDS = (None, "full_attention")


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


class EventKeys:
    """From a ``BlockStored`` event (and from a request's tokens) to the keys the index records.

    Args:
        block_size_tokens: tokens per block; must equal vLLM's ``--block-size``.
        key_mode: ``dual`` (our keys from ``token_ids``) or ``strict`` (vLLM's hashes).
        hash_algo: strict mode's ``--prefix-caching-hash-algo``.
        hash_seed: strict mode's ``PYTHONHASHSEED``.
        on_drop: called with (reason, blocks) when a stored event is not (fully) indexed.
    """

    __slots__ = ("_on_drop", "block_size_tokens", "key_mode", "strict_hasher")

    def __init__(
        self,
        block_size_tokens: int = 16,
        key_mode: str = "dual",
        hash_algo: str = "sha256",
        hash_seed: str = "0",
        on_drop: Callable[[str, int], None] | None = None,
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

    def stored_keys(
        self, ledger: BlockLedger, endpoint_id: int, event: BlockStored, model: str
    ) -> list[int]:
        """Keys for the leading blocks of a stored event that can be indexed.

        What cannot be indexed is reported to ``on_drop`` with its reason.

        Args:
            ledger: the backend's ledger, to resolve the event's parent hash.
            endpoint_id: the endpoint that stored the blocks.
            event: the decoded event.
            model: the model the endpoint's events belong to (from the topic or the config).

        Returns:
            Keys aligned with ``event.block_hashes[:len(keys)]``.
        """
        keys, reason = self._stored_keys(ledger, endpoint_id, event, model)
        if reason and self._on_drop is not None:
            self._on_drop(reason, len(event.block_hashes) - len(keys))
        return keys

    def _stored_keys(
        self, ledger: BlockLedger, endpoint_id: int, event: BlockStored, model: str
    ) -> tuple[list[int], str]:
        if event.medium not in _INDEXED_MEDIA:
            return [], DROP_MEDIUM
        if event.kv_cache_spec_kind not in _INDEXED_KINDS:
            return [], DROP_ATTENTION
        engine_hashes = event.block_hashes
        if self.strict_hasher is not None:
            # vLLM's hashes are the keys: no tokens needed, nothing to resolve.
            return list(engine_hashes), ""
        lora_name = event.lora_name
        if event.lora_id is not None and not lora_name:
            return [], DROP_LORA_ID  # an adapter we cannot name would look like the base model
        size = self.block_size_tokens
        if event.block_size != size:
            return [], DROP_BLOCK_SIZE
        num_blocks = len(engine_hashes)
        token_ids = event.token_ids
        if len(token_ids) != num_blocks * size:
            return [], DROP_TOKEN_COUNT
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
                return [], reason
        if parent_hash is None:
            parent = chain_root(model, lora_name, salt)
        else:
            resolved = ledger.get(endpoint_id, parent_hash)
            if resolved is None:
                return [], DROP_UNKNOWN_PARENT
            parent = resolved
        try:
            keys = token_keys(token_ids[: num_blocks * size], parent, size)
        except (OverflowError, TypeError):
            return [], DROP_BAD_TOKENS
        return keys, reason
