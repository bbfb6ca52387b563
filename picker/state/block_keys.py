"""Block keys of the precise KV index: our own chained keys, and vLLM's hashes in strict mode.

Dual keys (the default). The index does not depend on how vLLM hashes blocks: every
``BlockStored`` event carries the block's ``token_ids``, so the index computes its *own* key for
each block from those tokens, exactly as the scorer computes keys for a request's tokens, and
keeps a per-endpoint map from the engine's hash to our key so that ``BlockRemoved`` (which
carries engine hashes only) can be applied. Any ``--prefix-caching-hash-algo`` and an unset
``PYTHONHASHSEED`` on the pods work unchanged. The keys are the picker's one chained hash over
the tokens' bytes (:mod:`kv_picker.state.hashing`: :func:`~kv_picker.state.hashing.chain_root`
and :func:`~kv_picker.state.hashing.token_keys`)::

    root  = xxh64("kv-picker/1" \\0 model \\0 cache_salt)      model = LoRA adapter when one is used
    key_0 = xxh3_64(le_u32(tokens of block 0), seed=root)
    key_i = xxh3_64(le_u32(tokens of block i), seed=key_{i-1})

Strict keys, this module, reproduce vLLM's own block hashes (``vllm/v1/core/kv_cache_utils.py``
``hash_block_tokens``) for the four ``--prefix-caching-hash-algo`` values, with the pods'
``PYTHONHASHSEED``::

    NONE_HASH = H(PYTHONHASHSEED string)
    digest_i  = H((digest_{i-1} or NONE_HASH, tuple(tokens of block i), extra_i))
    extra_i   = (lora_name?, cache_salt if i == 0?) or None
    wire_i    = low 64 bits of digest_i, big-endian   (vLLM's default KV-event form)

    H = sha256:      sha256(pickle(x, protocol 5))     xxhash:      xxh3_128(pickle(x, protocol 5))
        sha256_cbor: sha256(canonical CBOR(x))         xxhash_cbor: xxh3_128(canonical CBOR(x))

In strict mode the engine's own hashes are the index keys: events need no ``token_ids`` (CPU
offload events arrive without them), but every pod must share the algorithm, the seed and the
block size with the picker. The chain runs on full digests, so it cannot be resumed from a
64-bit wire int: :meth:`VllmBlockHasher.block_keys` always hashes from block 0.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from typing import Any

import xxhash

_U64_MASK = (1 << 64) - 1

# The empty tuple of a block without extra keys: hoisted so a request allocates nothing for it.
_NO_EXTRA: tuple[Any, ...] = ()

HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
"""vLLM's ``--prefix-caching-hash-algo`` values that strict mode reproduces."""


# -- strict mode: vLLM's own hashes ---------------------------------------------------------


def _cbor_head(major: int, value: int, out: bytearray) -> None:
    if value < 24:
        out.append(major << 5 | value)
    elif value < 0x100:
        out += bytes((major << 5 | 24, value))
    elif value < 0x10000:
        out.append(major << 5 | 25)
        out += value.to_bytes(2, "big")
    elif value < 0x100000000:
        out.append(major << 5 | 26)
        out += value.to_bytes(4, "big")
    else:
        out.append(major << 5 | 27)
        out += value.to_bytes(8, "big")


def _cbor_encode(obj: Any, out: bytearray) -> None:
    # Canonical CBOR (RFC 7049 §3.9, as cbor2's canonical=True) for the shapes vLLM hashes.
    if obj is None:
        out.append(0xF6)
    elif obj is True:
        out.append(0xF5)
    elif obj is False:
        out.append(0xF4)
    elif isinstance(obj, int):
        if obj >= 0:
            if obj > _U64_MASK:
                raise TypeError("integers above 2**64-1 are not supported")
            _cbor_head(0, obj, out)
        else:
            if -1 - obj > _U64_MASK:
                raise TypeError("integers below -2**64 are not supported")
            _cbor_head(1, -1 - obj, out)
    elif isinstance(obj, bytes | bytearray):
        _cbor_head(2, len(obj), out)
        out += obj
    elif isinstance(obj, str):
        data = obj.encode()
        _cbor_head(3, len(data), out)
        out += data
    elif isinstance(obj, tuple | list):
        _cbor_head(4, len(obj), out)
        for item in obj:
            _cbor_encode(item, out)
    else:
        raise TypeError(f"cannot CBOR-encode {type(obj).__name__}")


def cbor_canonical(obj: Any) -> bytes:
    """Canonical CBOR of None, bools, ints (64-bit), bytes, str, and tuples/lists of those."""
    out = bytearray()
    _cbor_encode(obj, out)
    return bytes(out)


def _pickle5(obj: Any) -> bytes:
    return pickle.dumps(obj, protocol=5)


_HASH_FUNCTIONS: dict[str, Callable[[Any], bytes]] = {
    "sha256": lambda obj: hashlib.sha256(_pickle5(obj)).digest(),
    "sha256_cbor": lambda obj: hashlib.sha256(cbor_canonical(obj)).digest(),
    "xxhash": lambda obj: xxhash.xxh3_128_digest(_pickle5(obj)),
    "xxhash_cbor": lambda obj: xxhash.xxh3_128_digest(cbor_canonical(obj)),
}


def wire_hash(digest: bytes) -> int:
    """vLLM's default KV-event form of a block hash: the digest's low 64 bits, big-endian."""
    return int.from_bytes(digest[-8:], "big")


class VllmBlockHasher:
    """vLLM's block hashes for one algorithm and ``PYTHONHASHSEED`` (built once).

    Args:
        algo: ``sha256`` (vLLM's default), ``sha256_cbor``, ``xxhash`` or ``xxhash_cbor``.
        hash_seed: the pods' ``PYTHONHASHSEED`` string ("0", "42", "" are all different).
        block_size_tokens: vLLM's ``--block-size``.

    Raises:
        ValueError: unknown algorithm or non-positive block size.
    """

    __slots__ = ("_hash", "algo", "block_size_tokens", "hash_seed", "none_hash")

    def __init__(self, algo: str, hash_seed: str, block_size_tokens: int = 16) -> None:
        if algo not in _HASH_FUNCTIONS:
            raise ValueError(f"unknown hash algorithm {algo!r}; known: {', '.join(HASH_ALGOS)}")
        if block_size_tokens <= 0:
            raise ValueError(f"block_size_tokens must be positive, got {block_size_tokens}")
        self.algo = algo
        self.hash_seed = hash_seed
        self.block_size_tokens = block_size_tokens
        self._hash = _HASH_FUNCTIONS[algo]
        self.none_hash: bytes = self._hash(hash_seed)

    def block_digests(
        self,
        token_ids: Sequence[int],
        lora_name: str | None = None,
        cache_salt: str | None = None,
        max_blocks: int = 0,
    ) -> list[bytes]:
        """Full digests of the leading full blocks (vLLM's internal ``BlockHash`` values)."""
        size = self.block_size_tokens
        num_blocks = len(token_ids) // size
        if max_blocks and num_blocks > max_blocks:
            num_blocks = max_blocks
        lora_keys: tuple[Any, ...] = (lora_name,) if lora_name else _NO_EXTRA
        rest_extra = lora_keys or None
        first_extra = (*lora_keys, cache_salt) if cache_salt else rest_extra
        hash_fn = self._hash
        parent = self.none_hash
        digests: list[bytes] = []
        for i in range(num_blocks):
            block = tuple(token_ids[i * size : (i + 1) * size])
            parent = hash_fn((parent, block, first_extra if i == 0 else rest_extra))
            digests.append(parent)
        return digests

    def block_keys(
        self,
        token_ids: Sequence[int],
        lora_name: str | None = None,
        cache_salt: str | None = None,
        max_blocks: int = 0,
    ) -> list[int]:
        """vLLM's KV-event block hashes (64-bit ints) of the leading full blocks."""
        return [
            wire_hash(d) for d in self.block_digests(token_ids, lora_name, cache_salt, max_blocks)
        ]
