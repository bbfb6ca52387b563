"""Block keys of the precise KV index: our own chained keys, and vLLM's hashes in strict mode.

Dual keys (the default). The index does not depend on how vLLM hashes blocks: every
``BlockStored`` event carries the block's ``token_ids``, so the index computes its *own* key for
each block from those tokens, exactly as the scorer computes keys for a request's tokens, and
keeps a per-endpoint map from the engine's hash to our key so that ``BlockRemoved`` (which
carries engine hashes only) can be applied. Any ``--prefix-caching-hash-algo`` and an unset
``PYTHONHASHSEED`` on the pods work unchanged::

    root  = xxh64("kv-picker/1" \\0 model \\0 cache_salt)      model = LoRA adapter when one is used
    key_0 = xxh3_64(le_u32(tokens of block 0), seed=root)
    key_i = xxh3_64(le_u32(tokens of block i), seed=key_{i-1})

A key names a block *and everything before it*, so two requests share key i only if they share
blocks 0..i. Folding the ``cache_salt`` into the root means tenants with different salts never
share a key (vLLM folds it into block 0's hash, which has the same effect through the chain).
Only full blocks get keys. Chaining through the xxh3 seed costs one call per block.

Strict keys reproduce vLLM's own block hashes (``vllm/v1/core/kv_cache_utils.py``
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
import struct
import sys
from array import array
from collections.abc import Callable, Sequence
from typing import Any

import xxhash

_xxh3_64 = xxhash.xxh3_64_intdigest
_U64_MASK = (1 << 64) - 1
_SWAP_BYTES = sys.byteorder == "big"  # token bytes are little-endian on every machine
_ROOT_DOMAIN = b"kv-picker/1"

# The empty tuple of a block without extra keys: hoisted so a request allocates nothing for it.
_NO_EXTRA: tuple[Any, ...] = ()

HASH_ALGOS = ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
"""vLLM's ``--prefix-caching-hash-algo`` values that strict mode reproduces."""


def chain_root(model: str, lora_name: str | None = None, cache_salt: str | None = None) -> int:
    """The root of a key chain.

    Args:
        model: the served (base) model name.
        lora_name: the LoRA adapter, when the request uses one; it stands in for the model
            (requests name an adapter as their model, events name it in ``lora_name``).
        cache_salt: the request's ``cache_salt``; requests with different salts never share
            a key.

    Returns:
        A 64-bit seed for :func:`chain_keys`.
    """
    material = b"\0".join(
        (_ROOT_DOMAIN, (lora_name or model).encode(), (cache_salt or "").encode())
    )
    return xxhash.xxh64_intdigest(material)


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes.

    Raises:
        OverflowError: a token id is negative or does not fit 32 bits.
        TypeError: a token id is not an int.
    """
    packed = array("I", token_ids)
    if packed.itemsize != 4:  # pragma: no cover (no mainstream platform)
        return struct.pack(f"<{len(token_ids)}I", *token_ids)
    if _SWAP_BYTES:  # pragma: no cover
        packed.byteswap()
    return packed.tobytes()


def chain_keys(
    token_ids: Sequence[int], parent: int, block_size_tokens: int, max_blocks: int = 0
) -> list[int]:
    """Chained keys of the full blocks of ``token_ids``, continuing from ``parent``.

    Args:
        token_ids: tokens, starting at a block boundary.
        parent: :func:`chain_root` for block 0, else the key of the block before.
        block_size_tokens: tokens per block (> 0).
        max_blocks: at most this many keys (0 = every full block).

    Returns:
        One key per full block, in order; a trailing partial block has none.

    Raises:
        OverflowError, TypeError: a token id is not a uint32 int.
    """
    num_blocks = len(token_ids) // block_size_tokens
    if max_blocks and num_blocks > max_blocks:
        num_blocks = max_blocks
    if not num_blocks:
        return []
    data = memoryview(token_bytes(token_ids[: num_blocks * block_size_tokens]))
    step = 4 * block_size_tokens
    keys = [0] * num_blocks
    key = parent
    start = 0
    for i in range(num_blocks):
        key = _xxh3_64(data[start : start + step], seed=key)
        keys[i] = key
        start += step
    return keys


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
