"""Strict block keys: vLLM's own hashes against the reference vectors (dual keys: test_hashing)."""

import hashlib
import pickle
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_picker.state.block_keys import (
    HASH_ALGOS,
    VllmBlockHasher,
    cbor_canonical,
    wire_hash,
)
from kv_picker_bench.sim.cache import BlockHasher

TOKENS = list(range(1, 33))  # two blocks of 16, PYTHONHASHSEED "0" (reference notes §2.6)

NONE_HASHES = {
    "sha256": "1973e23848344dc43a988a9b478663803cfffe1243480253f9a3cf004b14aa7c",
    "sha256_cbor": "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e",
    "xxhash": "6fb31cc38bba6066183f7f2104b9c051",
    "xxhash_cbor": "1ebe36576dcb573f26b99533a20aaeca",
}
PLAIN = {
    "sha256": [7536218907325174565, 9048537298590080561],
    "sha256_cbor": [3236607068019569386, 2758186210834249151],
    "xxhash": [11844795890135418255, 14253768906014549686],
    "xxhash_cbor": [882618318818381833, 12890060145260523405],
}
SALTED = {
    "sha256": [3816977835166085791, 13679387932305922364],
    "sha256_cbor": [2098375440168515790, 13351230569374862786],
    "xxhash": [15944358904584171686, 1663955946419092180],
    "xxhash_cbor": [8419553871955216197, 12436513963002137193],
}
LORA = {
    "sha256": [326297463649400895, 3685617167104202848],
    "sha256_cbor": [16148250904256190698, 11656050330326652032],
    "xxhash": [4281070652815113677, 1444373669785824707],
    "xxhash_cbor": [11377662419225707367, 6761487875620617735],
}
LORA_SALTED = {
    "sha256": [12954850025363469110, 16676182568630021115],
    "sha256_cbor": [15611566038367308200, 15609623053590547327],
    "xxhash": [4427779540544723737, 4742709416570940276],
    "xxhash_cbor": [13144994874681327969, 6127011023429939368],
}


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_strict_hashes_match_the_reference_vectors(algo: str) -> None:
    hasher = VllmBlockHasher(algo, "0")
    assert hasher.none_hash.hex() == NONE_HASHES[algo]
    assert hasher.block_keys(TOKENS) == PLAIN[algo]
    assert hasher.block_keys(TOKENS, cache_salt="s1") == SALTED[algo]
    assert hasher.block_keys(TOKENS, lora_name="lora-a") == LORA[algo]
    assert hasher.block_keys(TOKENS, lora_name="lora-a", cache_salt="s1") == LORA_SALTED[algo]
    assert hasher.block_keys(TOKENS + [99] * 15) == PLAIN[algo]  # a partial block has no key
    assert hasher.block_keys(TOKENS, max_blocks=1) == PLAIN[algo][:1]


def test_strict_full_digests_and_preimages() -> None:
    hasher = VllmBlockHasher("sha256", "0")
    digests = hasher.block_digests(TOKENS)
    assert digests[0].hex() == "bea72b7d33de03c1aa715efbb492d0e0d3801f00c1f985756896072ae8b31325"
    assert digests[1].hex() == "2744667f6645310ff670b0c5d7c64987ffa5940de5a549f17d92dcbb5b559e31"
    assert [wire_hash(d) for d in digests] == PLAIN["sha256"]
    cbor = VllmBlockHasher("sha256_cbor", "0")
    assert cbor_canonical("0") == bytes.fromhex("6130")
    preimage = cbor_canonical((cbor.none_hash, tuple(range(1, 17)), None))
    assert preimage == (
        bytes.fromhex("835820") + cbor.none_hash + bytes([0x90, *range(1, 17), 0xF6])
    )
    assert hashlib.sha256(preimage).digest() == cbor.block_digests(TOKENS)[0]


def test_seed_changes_every_hash() -> None:
    assert VllmBlockHasher("sha256", "42").block_keys(TOKENS) != PLAIN["sha256"]
    assert VllmBlockHasher("sha256", "").block_keys(TOKENS) != PLAIN["sha256"]


def test_strict_xxhash_equals_the_simulated_endpoint() -> None:
    # The simulated endpoint reproduces vLLM's xxhash algorithm independently.
    tokens = list(range(100, 180))
    ours = VllmBlockHasher("xxhash", "7")
    theirs = BlockHasher(16, "7")
    assert ours.block_keys(tokens) == theirs.block_keys(tokens)
    assert ours.block_keys(tokens, "ad", "salt") == theirs.block_keys(
        tokens, lora_name="ad", cache_salt="salt"
    )


def test_bad_strict_parameters() -> None:
    with pytest.raises(ValueError, match="known: sha256"):
        VllmBlockHasher("md5", "0")
    with pytest.raises(ValueError):
        VllmBlockHasher("sha256", "0", 0)


@settings(max_examples=200)
@given(
    st.recursive(
        st.none()
        | st.booleans()
        | st.integers(-(2**64), 2**64 - 1)
        | st.binary(max_size=300)
        | st.text(max_size=300),
        lambda children: st.lists(children, max_size=30).map(tuple),
        max_leaves=40,
    )
)
def test_cbor_is_the_canonical_encoding(value: object) -> None:
    # Cross-check against a reference written from RFC 8949 §4.2.1 independently of the encoder.
    def ref(obj: object) -> bytes:
        def head(major: int, n: int) -> bytes:
            for limit, extra, fmt in ((24, None, ""), (256, 24, ">B"), (65536, 25, ">H")):
                if n < limit:
                    return (
                        bytes([major << 5 | n])
                        if extra is None
                        else bytes([major << 5 | extra]) + struct.pack(fmt, n)
                    )
            if n < 2**32:
                return bytes([major << 5 | 26]) + struct.pack(">I", n)
            return bytes([major << 5 | 27]) + struct.pack(">Q", n)

        if obj is None:
            return b"\xf6"
        if isinstance(obj, bool):
            return b"\xf5" if obj else b"\xf4"
        if isinstance(obj, int):
            return head(0, obj) if obj >= 0 else head(1, -1 - obj)
        if isinstance(obj, bytes):
            return head(2, len(obj)) + obj
        if isinstance(obj, str):
            return head(3, len(obj.encode())) + obj.encode()
        assert isinstance(obj, tuple)
        return head(4, len(obj)) + b"".join(ref(item) for item in obj)

    assert cbor_canonical(value) == ref(value)


def test_pickle_protocol_is_vllms() -> None:
    assert pickle.HIGHEST_PROTOCOL == 5  # vLLM pickles with HIGHEST_PROTOCOL
