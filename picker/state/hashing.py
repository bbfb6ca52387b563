"""The one chained block hash behind every key the picker computes.

Both prefix scorers and the precise index's dual keys name blocks with the same chain; only what
a block's bytes are differs with what the caller has::

    root  = xxh64("kv-picker/1" \\0 name \\0 cache_salt)    name = the LoRA adapter when one is
                                                             used, else the model
    key_0 = xxh3_64(bytes of block 0, seed=root)
    key_i = xxh3_64(bytes of block i, seed=key_{i-1})

    tokens      (precise scorer, KV events' token_ids): each id as little-endian uint32,
                a block is ``4 * block_size_tokens`` bytes
    characters  (approximate scorer, no tokenizer): the prompt's UTF-8 bytes,
                a block is ``blockSizeChars`` bytes

A key names a block *and everything before it*, so two requests share key i only if they share
blocks 0..i. The root decides which requests may share a key at all:

- The adapter stands in for the model: requests name an adapter as their model (the base
  model is then only the pool's), and KV events name it in ``lora_name``; llm-d's indexer keys
  events the same way (effective model = ``lora_name`` when set). Adapter names are unique in a
  pool, so the base model adds nothing.
- ``cache_salt`` is folded in so tenants with different salts never share a key (vLLM folds it
  into block 0's extra keys, which has the same effect through the chain); an empty salt is no
  salt.
- The ``kv-picker/1`` tag versions the scheme: changing it changes every key.

Chaining through the xxh3 seed costs one call per block and allocates only the result int. A
trailing partial block has no key: it cannot be a full cached block on the server either.
vLLM's own block hashes (strict mode) are a different chain: :mod:`kv_picker.state.block_keys`.
"""

from __future__ import annotations

import struct
import sys
from array import array
from collections.abc import Sequence

import xxhash

_xxh3_64 = xxhash.xxh3_64_intdigest
_SWAP_BYTES = sys.byteorder == "big"  # token bytes are little-endian on every machine
_ROOT_DOMAIN = b"kv-picker/1"

TOKEN_BYTES = 4
"""Bytes per token id in a block's bytes (uint32)."""


def chain_root(model: str, lora_name: str | None = None, cache_salt: str | None = None) -> int:
    """The root of a request's key chain (see the module docstring).

    Args:
        model: the served (base) model name.
        lora_name: the LoRA adapter, when the request uses one; it stands in for the model.
        cache_salt: the request's ``cache_salt``; requests with different salts never share
            a key.

    Returns:
        A 64-bit seed for :func:`chain_keys`.
    """
    material = b"\0".join(
        (_ROOT_DOMAIN, (lora_name or model).encode(), (cache_salt or "").encode())
    )
    return xxhash.xxh64_intdigest(material)


def chain_keys(data: bytes, parent: int, block_bytes: int, max_blocks: int = 0) -> list[int]:
    """Chained keys of the full blocks of ``data``, continuing from ``parent``.

    Args:
        data: the blocks' bytes, starting at a block boundary.
        parent: :func:`chain_root` for block 0, else the key of the block before.
        block_bytes: bytes per block (> 0).
        max_blocks: at most this many keys (0 = every full block).

    Returns:
        One key per full block, in order; a trailing partial block has none.
    """
    num_blocks = len(data) // block_bytes
    if max_blocks and num_blocks > max_blocks:
        num_blocks = max_blocks
    keys = [0] * num_blocks
    view = memoryview(data)  # slices without copying
    key = parent
    start = 0
    for i in range(num_blocks):
        end = start + block_bytes
        key = _xxh3_64(view[start:end], seed=key)
        keys[i] = key
        start = end
    return keys


def token_bytes(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian uint32 bytes.

    Raises:
        OverflowError: a token id is negative or does not fit 32 bits.
        TypeError: a token id is not an int.
    """
    packed = array("I", token_ids)
    if packed.itemsize != TOKEN_BYTES:  # pragma: no cover (no mainstream platform)
        return struct.pack(f"<{len(token_ids)}I", *token_ids)
    if _SWAP_BYTES:  # pragma: no cover
        packed.byteswap()
    return packed.tobytes()


def token_keys(
    token_ids: Sequence[int], parent: int, block_size_tokens: int, max_blocks: int = 0
) -> list[int]:
    """:func:`chain_keys` of token ids, converting only the tokens of the blocks keyed.

    Args:
        token_ids: tokens, starting at a block boundary.
        parent: :func:`chain_root` for block 0, else the key of the block before.
        block_size_tokens: tokens per block (> 0).
        max_blocks: at most this many keys (0 = every full block).

    Raises:
        OverflowError, TypeError: a token id is not a uint32 int.
    """
    num_blocks = len(token_ids) // block_size_tokens
    if max_blocks and num_blocks > max_blocks:
        num_blocks = max_blocks
    if not num_blocks:
        return []
    data = token_bytes(token_ids[: num_blocks * block_size_tokens])
    return chain_keys(data, parent, TOKEN_BYTES * block_size_tokens)
