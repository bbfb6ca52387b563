"""Tests of block hashing and the prefix cache, including a property test against a model."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_picker_bench.sim.cache import BlockHasher, PrefixCache, StoredBlock
from tests.benchmarks.sim.conftest import RecordingListener


def _stored(keys: Sequence[int]) -> list[StoredBlock]:
    return [StoredBlock(key, None, ()) for key in keys]


# --------------------------------------------------------------------------------- hashing

# vLLM `xxhash` algorithm, PYTHONHASHSEED="0", tokens 1..32, block size 16: the vectors of
# /work/shared/reference/vllm-kv.md §2.6 (wire ints, block 0 and block 1).
_TOKENS = list(range(1, 33))


@pytest.mark.parametrize(
    ("lora_name", "cache_salt", "expected"),
    [
        (None, None, [11844795890135418255, 14253768906014549686]),
        (None, "s1", [15944358904584171686, 1663955946419092180]),
        ("lora-a", None, [4281070652815113677, 1444373669785824707]),
        ("lora-a", "s1", [4427779540544723737, 4742709416570940276]),
    ],
)
def test_block_keys_match_vllm_xxhash_vectors(
    lora_name: str | None, cache_salt: str | None, expected: list[int]
) -> None:
    hasher = BlockHasher(16, "0")
    assert hasher.block_keys(_TOKENS, lora_name=lora_name, cache_salt=cache_salt) == expected


def test_block_keys_cover_full_blocks_only_and_chain() -> None:
    hasher = BlockHasher(4)
    keys = hasher.block_keys(list(range(11)))
    assert len(keys) == 2
    # Block 1 depends on block 0: change a token of block 0 and block 1's key changes too.
    other = hasher.block_keys([99, 1, 2, 3, 4, 5, 6, 7])
    assert other[0] != keys[0]
    assert other[1] != keys[1]
    assert hasher.block_keys([0, 1, 2]) == []


def test_salts_never_share_blocks() -> None:
    hasher = BlockHasher(16)
    tokens = list(range(200, 264))
    plain = hasher.block_keys(tokens)
    salt_a = hasher.block_keys(tokens, cache_salt="tenant-a")
    salt_b = hasher.block_keys(tokens, cache_salt="tenant-b")
    assert not set(plain) & set(salt_a)
    assert not set(salt_a) & set(salt_b)
    assert hasher.block_keys(tokens, cache_salt="tenant-a") == salt_a


def test_hash_seed_changes_every_key() -> None:
    tokens = list(range(32))
    assert not set(BlockHasher(16, "0").block_keys(tokens)) & set(
        BlockHasher(16, "1").block_keys(tokens)
    )


def test_hasher_rejects_bad_block_size() -> None:
    with pytest.raises(ValueError):
        BlockHasher(0)


# ---------------------------------------------------------------------------------- cache


def test_lookup_counts_leading_cached_blocks_only() -> None:
    cache = PrefixCache(8)
    assert cache.allocate([], 3)
    cache.store(_stored([1, 2, 3]))
    assert cache.lookup([1, 2, 3, 4]) == 3
    assert cache.lookup([1, 9, 3]) == 1
    assert cache.lookup([9, 1]) == 0


def test_lru_evicts_only_unreferenced_blocks_oldest_first() -> None:
    listener = RecordingListener()
    cache = PrefixCache(4, listener)
    assert cache.allocate([], 2)
    cache.store(_stored([1, 2]))  # request A holds 1, 2
    assert cache.allocate([], 2)
    cache.store(_stored([3, 4]))  # request B holds 3, 4
    assert cache.usage == 1.0
    assert not cache.allocate([], 1)  # everything is referenced: nothing can be evicted
    cache.release([3, 4], 0)  # B done: 4 is released first, so it is older than 3
    assert cache.usage == 0.5
    assert cache.occupancy == 1.0
    assert cache.allocate([], 1)
    assert listener.removed == [4]
    assert cache.lookup([3]) == 1
    assert cache.lookup([1, 2]) == 2
    assert cache.allocate([], 1)
    assert listener.removed == [4, 3]
    assert not cache.allocate([], 1)
    cache.check_invariants()


def test_hit_on_evictable_block_pins_it() -> None:
    cache = PrefixCache(3)
    assert cache.allocate([], 2)
    cache.store(_stored([1, 2]))
    cache.release([1, 2], 0)
    # Pinning 1 and 2 leaves one free slot, so two new blocks do not fit.
    assert not cache.can_allocate([1, 2], 2)
    assert not cache.allocate([1, 2], 2)
    assert cache.allocate([1, 2], 1)
    assert cache.num_evictable_blocks == 0
    assert cache.usage == 1.0
    cache.check_invariants()


def test_release_then_rehit_moves_block_to_most_recent() -> None:
    listener = RecordingListener()
    cache = PrefixCache(3, listener)
    assert cache.allocate([], 3)
    cache.store(_stored([1, 2, 3]))
    cache.release([1], 0)
    cache.release([2], 0)
    cache.release([3], 0)
    # Re-use block 1: it becomes the most recently released.
    assert cache.allocate([1], 0)
    cache.release([1], 0)
    assert cache.allocate([], 2)
    assert listener.removed == [2, 3]


def test_store_of_an_already_cached_hash_shares_it() -> None:
    listener = RecordingListener()
    cache = PrefixCache(4, listener)
    assert cache.allocate([], 1)
    assert cache.allocate([], 1)
    cache.store([StoredBlock(7, None, (1, 2))])
    cache.store([StoredBlock(7, None, (1, 2))])  # computed concurrently by a second request
    assert cache.num_cached_blocks == 1
    assert cache.num_private_blocks == 0
    assert [b.block_hash for b in listener.stored] == [7]
    cache.release([7], 0)
    assert cache.num_evictable_blocks == 0
    cache.release([7], 0)
    assert cache.num_evictable_blocks == 1
    cache.check_invariants()


def test_reset_drops_unreferenced_blocks_only() -> None:
    listener = RecordingListener()
    cache = PrefixCache(4, listener)
    assert cache.allocate([], 2)
    cache.store(_stored([1, 2]))
    cache.release([2], 0)
    cache.release([1], 0)
    assert cache.allocate([], 1)
    cache.store(_stored([3]))
    assert cache.reset() == 2
    assert listener.removed == [2, 1]
    assert listener.cleared == 0
    assert cache.lookup([3]) == 1
    cache.release([3], 0)
    assert cache.reset() == 1
    assert listener.cleared == 1
    assert cache.num_cached_blocks == 0


def test_misuse_is_reported() -> None:
    cache = PrefixCache(2)
    with pytest.raises(KeyError):
        cache.allocate([5], 0)
    with pytest.raises(ValueError):
        cache.store(_stored([1]))
    with pytest.raises(ValueError):
        cache.release([], 1)
    with pytest.raises(ValueError):
        PrefixCache(0)


def test_query_counters() -> None:
    cache = PrefixCache(2)
    cache.record_query(100, 32)
    cache.record_query(50, 0)
    assert (cache.queries_tokens, cache.hits_tokens) == (150, 32)


# ------------------------------------------------------------------ property test vs model


class ModelCache:
    """Brute-force reference: timestamps instead of an ordered free list, linear scans."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.refs: dict[int, int] = {}
        self.released_at: dict[int, int] = {}
        self.private = 0
        self.tick = 0
        self.evicted: list[int] = []
        self.cleared = 0

    def lookup(self, keys: Sequence[int]) -> int:
        count = 0
        for key in keys:
            if key not in self.refs:
                break
            count += 1
        return count

    def used(self) -> int:
        return sum(1 for r in self.refs.values() if r > 0) + self.private

    def allocate(self, hits: Sequence[int], new: int) -> bool:
        pinned = sum(1 for k in hits if self.refs[k] == 0)
        if new > self.capacity - self.used() - pinned:
            return False
        for key in hits:
            self.refs[key] += 1
        while self.capacity - len(self.refs) - self.private < new:
            victim = min(
                (k for k, r in self.refs.items() if r == 0), key=lambda k: self.released_at[k]
            )
            del self.refs[victim]
            self.evicted.append(victim)
        self.private += new
        return True

    def store(self, keys: Sequence[int]) -> None:
        for key in keys:
            self.refs[key] = self.refs.get(key, 0) + 1
            self.private -= 1

    def release(self, keys: Sequence[int], private: int) -> None:
        for key in reversed(keys):
            self.refs[key] -= 1
            if self.refs[key] == 0:
                self.tick += 1
                self.released_at[key] = self.tick
        self.private -= private

    def reset(self) -> None:
        dropped = sorted(
            (k for k, r in self.refs.items() if r == 0), key=lambda k: self.released_at[k]
        )
        for key in dropped:
            del self.refs[key]
        # An emptied cache is announced as cleared, otherwise the dropped blocks as removed.
        if not self.refs:
            self.cleared += 1
        else:
            self.evicted.extend(dropped)


@dataclass
class Active:
    chain: int
    length: int
    held: list[int]
    private: int


_NUM_CHAINS = 4


def _chain(chain: int, length: int) -> list[int]:
    return [chain * 1000 + i for i in range(length)]


_op = st.one_of(
    st.tuples(
        st.just("request"),
        st.integers(0, _NUM_CHAINS - 1),
        st.integers(0, 6),
        st.integers(0, 3),
        st.integers(0, 6),
    ),
    st.tuples(st.just("store_more"), st.integers(0, 20), st.integers(1, 6)),
    st.tuples(st.just("release"), st.integers(0, 20)),
    st.tuples(
        st.just("reset"),
    ),
)


@settings(max_examples=150, deadline=None)
@given(capacity=st.integers(1, 12), ops=st.lists(_op, max_size=60))
def test_cache_matches_brute_force_model(capacity: int, ops: list[tuple[object, ...]]) -> None:
    listener = RecordingListener()
    cache = PrefixCache(capacity, listener)
    model = ModelCache(capacity)
    active: list[Active] = []
    for op in ops:
        kind = op[0]
        if kind == "request":
            _, chain, length, extra, store_count = op
            assert isinstance(chain, int) and isinstance(length, int)
            assert isinstance(extra, int) and isinstance(store_count, int)
            keys = _chain(chain, length)
            hits = cache.lookup(keys)
            assert hits == model.lookup(keys)
            new = length - hits + extra
            ok = cache.allocate(keys[:hits], new)
            assert ok == model.allocate(keys[:hits], new)
            if ok:
                stored = keys[hits : hits + min(store_count, length - hits)]
                cache.store(_stored(stored))
                model.store(stored)
                active.append(Active(chain, length, keys[: hits + len(stored)], new - len(stored)))
        elif kind == "store_more" and active:
            _, index, count = op
            assert isinstance(index, int) and isinstance(count, int)
            request = active[index % len(active)]
            keys = _chain(request.chain, request.length)
            more = keys[len(request.held) : len(request.held) + min(count, request.private)]
            cache.store(_stored(more))
            model.store(more)
            request.held.extend(more)
            request.private -= len(more)
        elif kind == "release" and active:
            _, index = op
            assert isinstance(index, int)
            request = active.pop(index % len(active))
            cache.release(request.held, request.private)
            model.release(request.held, request.private)
        elif kind == "reset":
            cache.reset()
            model.reset()

        cache.check_invariants()
        assert cache.num_cached_blocks + cache.num_private_blocks <= capacity
        assert cache.num_used_blocks == model.used()
        assert listener.removed == model.evicted
        assert listener.cleared == model.cleared
        for request in active:
            # Blocks held by running requests are never evicted.
            assert cache.lookup(request.held) == len(request.held)
        for chain in range(_NUM_CHAINS):
            keys = _chain(chain, 10)
            assert cache.lookup(keys) == model.lookup(keys)
