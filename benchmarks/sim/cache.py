"""Prefix cache of the simulated endpoint: block hashing and a finite, LRU-evicted block pool.

Block hashing reproduces vLLM's ``--prefix-caching-hash-algo xxhash`` bit for bit, so block keys
seen in the simulated endpoint's KV events (and in tests) are the ones a real vLLM pod with the
same ``PYTHONHASHSEED`` would publish::

    NONE_HASH  = xxh3_128(pickle(hash_seed))                 # hash_seed = PYTHONHASHSEED string
    digest_i   = xxh3_128(pickle((digest_{i-1} or NONE_HASH, tuple(tokens of block i), extra_i)))
    extra_i    = (lora_name?, cache_salt if i == 0?) or None
    key_i      = low 64 bits of digest_i (big-endian), vLLM's default wire form of a block hash

Only full blocks are hashed. The cache salt enters block 0 only, and every later block differs
through the parent chain, so requests with different salts never share a block.

The pool mirrors vLLM's ``BlockPool`` at the level a router can observe::

    num_gpu_blocks slots
    ┌───────────────────────────┬────────────────────────┬───────────────┬──────────┐
    │ cached, referenced         │ cached, unreferenced   │ private       │ empty    │
    │ (prompt blocks of running  │ (LRU order; evicted    │ (reserved for │          │
    │  requests)                 │  oldest first)         │  uncomputed / │          │
    │                            │                        │  output KV)   │          │
    └───────────────────────────┴────────────────────────┴───────────────┴──────────┘

- ``allocate`` pins a request's cache hits and reserves private slots for everything else it
  will compute, evicting unreferenced cached blocks when no empty slot is left. Referenced
  blocks are never evicted.
- ``store`` turns private slots into cached blocks: the engine calls it when it schedules a
  prefill chunk, as vLLM v1 caches full blocks when it allocates their slots (or, with its
  ``cached_when="computed"``, once the chunk's step has ended).
- ``release`` unpins blocks; they stay cached and become evictable.
- ``usage`` follows vLLM's ``kv_cache_usage_perc``: evictable cached blocks count as free.
"""

from __future__ import annotations

import pickle
from collections import OrderedDict
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import xxhash

HASH_ALGO = "xxhash"
"""The vLLM ``prefix_caching_hash_algo`` this module reproduces."""

_PICKLE_PROTOCOL = pickle.HIGHEST_PROTOCOL
_U64_MASK = (1 << 64) - 1


def _digest(obj: object) -> bytes:
    return xxhash.xxh3_128_digest(pickle.dumps(obj, protocol=_PICKLE_PROTOCOL))


class BlockHasher:
    """Computes the chained block keys of a token sequence (vLLM's ``xxhash`` algorithm).

    Built once per endpoint: the root hash is computed in the constructor, so hashing a request
    costs one pickle and one xxh3 call per full block.
    """

    __slots__ = ("_none_hash", "block_size", "hash_seed")

    def __init__(self, block_size: int, hash_seed: str = "0") -> None:
        """Creates a hasher.

        Args:
            block_size: Tokens per block (vLLM's ``--block-size``).
            hash_seed: The ``PYTHONHASHSEED`` string the emulated vLLM pod runs with.

        Raises:
            ValueError: If ``block_size`` is not positive.
        """
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size
        self.hash_seed = hash_seed
        self._none_hash = _digest(hash_seed)

    def block_keys(
        self,
        token_ids: Sequence[int],
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> list[int]:
        """Returns the 64-bit keys of every full block of ``token_ids``.

        Args:
            token_ids: The prompt's token ids.
            lora_name: The LoRA adapter serving the request, if any (folded into every block).
            cache_salt: The request's cache salt, if any (folded into block 0).

        Returns:
            One key per full block, in order; a trailing partial block has no key.
        """
        block_size = self.block_size
        num_full_blocks = len(token_ids) // block_size
        keys: list[int] = []
        parent = self._none_hash
        # Extra keys are hoisted out of the loop: only block 0 differs when a salt is given.
        lora_keys: tuple[str, ...] = (lora_name,) if lora_name else ()
        rest_extra = lora_keys or None
        first_extra = (*lora_keys, cache_salt) if cache_salt else rest_extra
        for index in range(num_full_blocks):
            start = index * block_size
            block = tuple(token_ids[start : start + block_size])
            parent = _digest((parent, block, first_extra if index == 0 else rest_extra))
            keys.append(int.from_bytes(parent[-8:], "big") & _U64_MASK)
        return keys


class StoredBlock(NamedTuple):
    """One block that became cached, as a vLLM ``BlockStored`` event describes it."""

    block_hash: int
    parent_hash: int | None
    token_ids: tuple[int, ...]


class CacheEventListener(Protocol):
    """Receives the cache's changes (a KV-event publisher implements this)."""

    def on_stored(self, blocks: Sequence[StoredBlock]) -> None:
        """Called when computed blocks become cached (newly cached blocks only)."""

    def on_removed(self, block_hashes: Sequence[int]) -> None:
        """Called when cached blocks are evicted or dropped by a reset."""

    def on_cleared(self) -> None:
        """Called when a reset leaves the cache empty."""


class PrefixCache:
    """A finite pool of KV blocks with prefix caching and LRU eviction of unreferenced blocks.

    All counts are in blocks unless the name says otherwise. Not thread-safe; the engine owns
    it. See the module docstring for the layout.

    Attributes:
        num_gpu_blocks: Capacity in blocks.
        queries_tokens: Prompt tokens looked up, counted once per request at scheduling
            (vLLM's ``vllm:prefix_cache_queries``).
        hits_tokens: Prompt tokens found cached (vLLM's ``vllm:prefix_cache_hits``).
    """

    __slots__ = (
        "_evictable",
        "_listener",
        "_num_private_blocks",
        "_refcounts",
        "hits_tokens",
        "num_gpu_blocks",
        "queries_tokens",
    )

    def __init__(self, num_gpu_blocks: int, listener: CacheEventListener | None = None) -> None:
        """Creates an empty cache.

        Args:
            num_gpu_blocks: Capacity in blocks.
            listener: Optional receiver of stored/removed/cleared notifications.

        Raises:
            ValueError: If ``num_gpu_blocks`` is not positive.
        """
        if num_gpu_blocks <= 0:
            raise ValueError(f"num_gpu_blocks must be positive, got {num_gpu_blocks}")
        self.num_gpu_blocks = num_gpu_blocks
        self._listener = listener
        # Every cached block with the number of running requests holding it.
        self._refcounts: dict[int, int] = {}
        # Cached blocks with refcount 0, least recently released first.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._num_private_blocks = 0
        self.queries_tokens = 0
        self.hits_tokens = 0

    @property
    def listener(self) -> CacheEventListener | None:
        """The receiver of cache notifications, if any."""
        return self._listener

    @listener.setter
    def listener(self, listener: CacheEventListener | None) -> None:
        self._listener = listener

    # ----------------------------------------------------------------------------- queries

    @property
    def num_cached_blocks(self) -> int:
        """Blocks that hold a hash (referenced or not)."""
        return len(self._refcounts)

    @property
    def num_evictable_blocks(self) -> int:
        """Cached blocks no running request holds."""
        return len(self._evictable)

    @property
    def num_private_blocks(self) -> int:
        """Slots reserved by running requests for KV not (yet) cached."""
        return self._num_private_blocks

    @property
    def num_used_blocks(self) -> int:
        """Slots in use by running requests (referenced cached blocks plus private ones)."""
        return len(self._refcounts) - len(self._evictable) + self._num_private_blocks

    @property
    def num_free_blocks(self) -> int:
        """Slots an allocation can take: empty slots plus evictable cached blocks."""
        return self.num_gpu_blocks - self.num_used_blocks

    @property
    def usage(self) -> float:
        """Fraction of the pool held by running requests, in [0, 1].

        Like vLLM's ``kv_cache_usage_perc``, cached blocks that nobody references count as free
        because an allocation may evict them.
        """
        return self.num_used_blocks / self.num_gpu_blocks

    @property
    def occupancy(self) -> float:
        """Fraction of the pool that is not empty (used or cached), in [0, 1]."""
        return (len(self._refcounts) + self._num_private_blocks) / self.num_gpu_blocks

    def lookup(self, keys: Sequence[int]) -> int:
        """Counts the leading blocks of ``keys`` that are cached. Changes nothing.

        Args:
            keys: A request's block keys, in order.

        Returns:
            The number of consecutive cached blocks from block 0.
        """
        refcounts = self._refcounts
        num_hit_blocks = 0
        for key in keys:
            if key not in refcounts:
                break
            num_hit_blocks += 1
        return num_hit_blocks

    def contains(self, key: int) -> bool:
        """Tells whether a block is cached."""
        return key in self._refcounts

    def record_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Counts one request's prefix-cache lookup (once per request, at scheduling)."""
        self.queries_tokens += num_query_tokens
        self.hits_tokens += num_hit_tokens

    # --------------------------------------------------------------------------- mutation

    def can_allocate(self, hit_keys: Sequence[int], num_new_blocks: int) -> bool:
        """Tells whether :meth:`allocate` would succeed.

        Args:
            hit_keys: Cached blocks the request will reuse (all must be cached).
            num_new_blocks: Slots the request needs beyond its hits.
        """
        evictable = self._evictable
        # Pinning an evictable hit takes it out of what eviction could free.
        num_pinned = sum(1 for key in hit_keys if key in evictable)
        return num_new_blocks <= self.num_free_blocks - num_pinned

    def allocate(self, hit_keys: Sequence[int], num_new_blocks: int) -> bool:
        """Pins a request's cache hits and reserves private slots for the rest of its KV.

        Evicts unreferenced cached blocks, least recently released first, when no empty slot
        is left. Either everything is allocated or nothing changes.

        Args:
            hit_keys: Cached blocks the request will reuse (from :meth:`lookup`).
            num_new_blocks: Slots to reserve beyond the hits.

        Returns:
            ``True`` if allocated, ``False`` if the pool cannot hold it now.

        Raises:
            KeyError: If a hit key is not cached.
        """
        if num_new_blocks < 0:
            raise ValueError(f"num_new_blocks must be >= 0, got {num_new_blocks}")
        refcounts = self._refcounts
        for key in hit_keys:
            if key not in refcounts:
                raise KeyError(f"block {key} is not cached")
        if not self.can_allocate(hit_keys, num_new_blocks):
            return False
        evictable = self._evictable
        for key in hit_keys:
            count = refcounts[key]
            if count == 0:
                del evictable[key]
            refcounts[key] = count + 1
        num_empty_blocks = self.num_gpu_blocks - len(refcounts) - self._num_private_blocks
        num_to_evict = num_new_blocks - num_empty_blocks
        if num_to_evict > 0:
            removed: list[int] = []
            for _ in range(num_to_evict):
                key, _ = evictable.popitem(last=False)
                del refcounts[key]
                removed.append(key)
            if self._listener is not None:
                self._listener.on_removed(removed)
        self._num_private_blocks += num_new_blocks
        return True

    def store(self, blocks: Sequence[StoredBlock]) -> None:
        """Turns computed private slots into cached blocks held by the caller.

        Each block consumes one private slot of the caller. A block whose hash another request
        cached meanwhile is shared instead (its refcount grows and the private slot is freed),
        which keeps one copy per hash.

        Args:
            blocks: The newly computed full blocks, in chain order.

        Raises:
            ValueError: If there are fewer private slots than blocks.
        """
        if len(blocks) > self._num_private_blocks:
            raise ValueError("store() needs one private slot per block")
        refcounts = self._refcounts
        evictable = self._evictable
        stored: list[StoredBlock] = []
        for block in blocks:
            key = block.block_hash
            count = refcounts.get(key)
            if count is None:
                refcounts[key] = 1
                stored.append(block)
            else:
                if count == 0:
                    del evictable[key]
                refcounts[key] = count + 1
            self._num_private_blocks -= 1
        if stored and self._listener is not None:
            self._listener.on_stored(stored)

    def release(self, keys: Sequence[int], num_private_blocks: int) -> None:
        """Drops a request's hold on its cached blocks and frees its private slots.

        Args:
            keys: The cached blocks the request holds, in chain order.
            num_private_blocks: Its private slots.

        Raises:
            ValueError: If more private slots are released than are reserved.
        """
        if num_private_blocks > self._num_private_blocks:
            raise ValueError("release() of more private slots than reserved")
        refcounts = self._refcounts
        evictable = self._evictable
        # Released in reverse chain order, so a chain's tail is evicted before its head: the
        # head is what other requests are most likely to share (vLLM frees in the same order).
        for key in reversed(keys):
            count = refcounts[key] - 1
            refcounts[key] = count
            if count == 0:
                evictable[key] = None
        self._num_private_blocks -= num_private_blocks

    def reset(self) -> int:
        """Drops every unreferenced cached block (``/reset_prefix_cache``).

        Blocks held by running requests stay. Listeners get ``on_cleared`` when the cache ends
        up empty, else ``on_removed`` with the dropped blocks.

        Returns:
            The number of blocks dropped.
        """
        dropped = list(self._evictable)
        for key in dropped:
            del self._refcounts[key]
        self._evictable.clear()
        if self._listener is not None:
            if not self._refcounts:
                self._listener.on_cleared()
            elif dropped:
                self._listener.on_removed(dropped)
        return len(dropped)

    def check_invariants(self) -> None:
        """Raises AssertionError if the internal bookkeeping is inconsistent (for tests)."""
        refcounts = self._refcounts
        assert self._num_private_blocks >= 0
        assert len(refcounts) + self._num_private_blocks <= self.num_gpu_blocks
        zero = [key for key, count in refcounts.items() if count == 0]
        assert all(count >= 0 for count in refcounts.values())
        assert set(zero) == set(self._evictable)
        assert 0.0 <= self.usage <= 1.0
