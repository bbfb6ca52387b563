"""The one chained block hash: against an independent reference, over characters and tokens."""

import struct

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_picker.state.hashing import chain_keys, chain_root, token_bytes, token_keys


def reference_chain(data: bytes, parent: int, block_bytes: int) -> list[int]:
    keys = []
    for i in range(len(data) // block_bytes):
        parent = xxhash.xxh3_64_intdigest(
            data[i * block_bytes : (i + 1) * block_bytes], seed=parent
        )
        keys.append(parent)
    return keys


@settings(max_examples=300)
@given(
    st.binary(max_size=400),
    st.binary(max_size=100),
    st.integers(1, 40),
    st.integers(0, 2**64 - 1),
)
def test_chain_keys_chain_and_resume(head: bytes, tail: bytes, size: int, parent: int) -> None:
    keys = chain_keys(head, parent, size)
    assert keys == reference_chain(head, parent, size)
    assert len(keys) == len(head) // size
    # A prefix's keys are a prefix of the longer sequence's keys.
    full = chain_keys(head + tail, parent, size)
    assert full[: len(keys)] == keys
    # Resuming from the last key of whole blocks gives the rest of the chain.
    aligned = len(head) // size * size
    if keys:
        assert chain_keys((head + tail)[aligned:], keys[-1], size) == full[len(keys) :]
    assert chain_keys(head, parent, size, max_blocks=2) == keys[:2]


@settings(max_examples=200)
@given(
    st.lists(st.integers(0, 2**32 - 1), max_size=200),
    st.integers(1, 20),
    st.integers(0, 2**64 - 1),
    st.integers(0, 5),
)
def test_tokens_are_their_little_endian_uint32_bytes(
    tokens: list[int], size: int, parent: int, max_blocks: int
) -> None:
    packed = struct.pack(f"<{len(tokens)}I", *tokens)
    assert token_bytes(tokens) == packed
    assert token_keys(tokens, parent, size, max_blocks) == chain_keys(
        packed, parent, 4 * size, max_blocks
    )


def test_roots_isolate_models_adapters_and_salts() -> None:
    roots = {
        chain_root("m"),
        chain_root("m", cache_salt="tenant-a"),
        chain_root("m", cache_salt="tenant-b"),
        chain_root("m2"),
        chain_root("m", lora_name="ad"),
        chain_root("m", lora_name="ad", cache_salt="tenant-a"),
    }
    assert len(roots) == 6
    # An adapter stands in for the model: the base model name does not matter then.
    assert chain_root("base", lora_name="ad") == chain_root("other", lora_name="ad")
    assert chain_root("ad") == chain_root("base", lora_name="ad")
    assert chain_root("m", cache_salt="") == chain_root("m")
    tokens = list(range(64))
    assert set(token_keys(tokens, chain_root("m", cache_salt="a"), 16)).isdisjoint(
        token_keys(tokens, chain_root("m", cache_salt="b"), 16)
    )


def test_text_keys_chain_and_isolate_salts() -> None:
    root = chain_root("m")
    text = ("The quick brown fox jumps over the lazy dog. " * 10).encode()
    keys = chain_keys(text, root, 64)
    assert len(keys) == len(text) // 64
    # A shared prefix gives shared leading keys; a change in block 2 changes every key after it.
    changed = bytearray(text)
    changed[64 * 2 + 5] ^= 1
    other = chain_keys(bytes(changed), root, 64)
    assert other[:2] == keys[:2]
    assert all(a != b for a, b in zip(other[2:], keys[2:], strict=True))
    salted = chain_keys(text, chain_root("m", cache_salt="tenant-a"), 64)
    assert not set(salted) & set(keys)
    assert set(chain_keys(text, chain_root("m2"), 64)).isdisjoint(keys)
    assert chain_keys(text, root, 64, 3) == keys[:3]
    assert chain_keys(b"short", root, 64) == []


def test_token_ids_must_fit_uint32() -> None:
    with pytest.raises(OverflowError):
        token_keys([2**32] * 16, 0, 16)
    with pytest.raises(OverflowError):
        token_keys([-1] * 16, 0, 16)
    with pytest.raises(TypeError):
        token_keys(["a"] * 16, 0, 16)  # type: ignore[list-item]
