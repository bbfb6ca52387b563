"""Block keys for the approximate prefix index.

Approximate mode has no tokenizer: it cuts the prompt's UTF-8 bytes into fixed-size character
blocks and chains 64-bit xxhash digests, so a key names a block *and everything before it*:

```
seed  = xxh64(model \\0 lora \\0 cache_salt)
key_0 = xxh3_64(bytes[0:B],   seed=seed)
key_i = xxh3_64(bytes[iB:(i+1)B], seed=key_{i-1})
```

Chaining through the seed argument costs one call per block and allocates only the result int.
A trailing partial block is dropped: it cannot be a full cached block on the server either.
Tenants with different ``cache_salt`` get different seeds, so their keys never collide.
"""

from __future__ import annotations

import xxhash

_xxh3_64 = xxhash.xxh3_64_intdigest


def request_seed(model: str, lora_adapter: str | None, cache_salt: str | None) -> int:
    """The root of a request's key chain: model, adapter and salt all isolate prefixes."""
    material = f"{model}\0{lora_adapter or ''}\0{cache_salt or ''}".encode()
    return xxhash.xxh64_intdigest(material)


def char_block_keys(data: bytes, seed: int, block_bytes: int, max_blocks: int) -> list[int]:
    """Chained keys of the leading full blocks of ``data``.

    Args:
        data: prompt bytes (UTF-8).
        seed: chain root from :func:`request_seed`.
        block_bytes: block size in bytes (> 0).
        max_blocks: at most this many keys (0 = unlimited).

    Returns:
        One key per full block, in prompt order.
    """
    num_blocks = len(data) // block_bytes
    if max_blocks and num_blocks > max_blocks:
        num_blocks = max_blocks
    keys = [0] * num_blocks
    view = memoryview(data)
    key = seed
    start = 0
    for i in range(num_blocks):
        end = start + block_bytes
        key = _xxh3_64(view[start:end], seed=key)
        keys[i] = key
        start = end
    return keys
