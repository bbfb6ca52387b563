"""The KV-event wire decoder: both encodings, byte-exact reference batches, and property tests
that any bytes either decode or raise MalformedMessage."""

from __future__ import annotations

import contextlib
from typing import Any

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kv_picker.sources.kv_event_decoder import (
    MalformedMessage,
    decode_payload,
    decode_seq,
    parse_topic,
)
from kv_picker.state.block_events import AllBlocksCleared, BlockRemoved, BlockStored
from kv_picker_bench.sim.events import encode_batch, encode_removed, encode_stored

HASH = 3236607068019569386  # sha256_cbor block 0 of tokens 1..16, PYTHONHASHSEED "0"

# The legacy (array) example batch of the reference notes §1.8, byte for byte.
LEGACY_BATCH = bytes.fromhex(
    "93cb41d954fc40200000"
    "93"
    "9cab426c6f636b53746f72656491cf2ceabcfae6d332eac0dc0010"
    + "".join(f"{t:02x}" for t in range(1, 17))
    + "10c0a3475055c091c000ae66756c6c5f617474656e74696f6ec0"
    "94ac426c6f636b52656d6f76656491cf2ceabcfae6d332eaa347505500"
    "91b0416c6c426c6f636b73436c6561726564"
    "00"
)


def test_decodes_the_reference_array_batch() -> None:
    assert len(LEGACY_BATCH) == 128
    batch = decode_payload(LEGACY_BATCH)
    assert batch.ts == 1700000000.5
    assert batch.data_parallel_rank == 0
    stored, removed, cleared = batch.events
    assert stored == BlockStored(
        [HASH], None, list(range(1, 17)), 16, None, "GPU", None, [None], 0, "full_attention"
    )
    assert removed == BlockRemoved([HASH], "GPU", 0)
    assert cleared == AllBlocksCleared()


def test_decodes_the_map_encoding_and_ignores_unknown_fields_and_types() -> None:
    events = [
        {
            "type": "BlockStored",
            "block_hashes": [HASH],
            "parent_block_hash": None,
            "token_ids": list(range(1, 17)),
            "block_size": 16,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
            "extra_keys": [None],
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
            "origin": "a field from the future",
        },
        {"type": "BlockRemoved", "block_hashes": [HASH], "medium": "GPU", "group_idx": 0},
        {"type": "AllBlocksCleared"},
        {"type": "BlockPromoted", "block_hashes": [1]},
        ["SomethingNew", 1, 2],
    ]
    batch = decode_payload(msgpack.packb([1.5, events, 0]))
    assert [type(e) for e in batch.events] == [BlockStored, BlockRemoved, AllBlocksCleared]
    assert batch.events[0] == decode_payload(LEGACY_BATCH).events[0]
    # An outer map, and the oldest array layout (fewer fields, no dp rank) decode too.
    as_map = decode_payload(msgpack.packb({"ts": 2, "events": [["AllBlocksCleared"]]}))
    assert as_map.events == [AllBlocksCleared()] and as_map.data_parallel_rank is None
    oldest = decode_payload(
        msgpack.packb([3.0, [["BlockStored", [7], 6, [1, 2], 2, None], ["BlockRemoved", [7]]]])
    )
    assert oldest.events == [BlockStored([7], 6, [1, 2], 2), BlockRemoved([7])]
    longer = decode_payload(msgpack.packb([3.0, [["BlockRemoved", [7], "GPU", 0, "x", 1]]]))
    assert longer.events == [BlockRemoved([7], "GPU", 0)]


def test_hashes_as_bytes_and_signed_ints_name_64_bit_blocks() -> None:
    digest = bytes.fromhex("202da172482d928bbc42ab25b0151e2b895f13f41002e27b2ceabcfae6d332ea")
    batch = decode_payload(
        msgpack.packb([0.0, [["BlockRemoved", [digest, -1, b"\x01\x02"], None]]], use_bin_type=True)
    )
    assert batch.events == [BlockRemoved([HASH, 2**64 - 1, 0x0102])]


def test_offloading_placeholder_events_decode() -> None:
    """vLLM's offloading connector names an offloaded chunk by hash alone: no tokens, size 0."""
    placeholder = ["BlockStored", [7], None, [], 0, None, "CPU", None, None, 1]
    batch = decode_payload(msgpack.packb([1.0, [placeholder, ["BlockRemoved", [7], "CPU", 1]]]))
    assert batch.events == [
        BlockStored([7], None, [], 0, medium="CPU", group_idx=1),
        BlockRemoved([7], "CPU", 1),
    ]


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xc1",
        msgpack.packb("not a batch"),
        msgpack.packb([1.0]),
        msgpack.packb(["ts", []]),
        msgpack.packb([1.0, {}]),
        msgpack.packb([1.0, [], "rank"]),
        msgpack.packb([1.0, [["BlockStored", [1], None, "tokens", 16]]]),
        msgpack.packb([1.0, [["BlockStored", [1], None, [1], -1]]]),
        msgpack.packb([1.0, [["BlockStored", [1], None, [1], True]]]),
        msgpack.packb([1.0, [["BlockStored", "hashes", None, [1], 16]]]),
        msgpack.packb([1.0, [["BlockStored", [1.5], None, [1], 16]]]),
        msgpack.packb([1.0, [["BlockStored", [b""], None, [1], 16]]], use_bin_type=True),
        msgpack.packb([1.0, [["BlockStored", [1], None, [1], 16, None, 7]]]),
        msgpack.packb([1.0, [["BlockStored", [1], None, [1], 16, None, None, None, "x"]]]),
        msgpack.packb([1.0, [["BlockRemoved"]]]),
        # KV-cache group numbers the ledger cannot hold.
        msgpack.packb([1.0, [{"type": "BlockRemoved", "block_hashes": [1], "group_idx": -1}]]),
        msgpack.packb([1.0, [["BlockStored", [1], None, [], 16, None, None, None, None, 65_536]]]),
        msgpack.packb([1.0, [[]]]),
        msgpack.packb([1.0, [5]]),
        msgpack.packb([1.0, [[5, 1]]]),
        msgpack.packb([1.0, [{"block_hashes": [1]}]]),
        msgpack.packb([1.0, [{1: 2}]]),
        msgpack.packb([1.0, []]) + b"trailing",
    ],
)
def test_malformed_payloads_raise_malformed_message(payload: bytes) -> None:
    with pytest.raises(MalformedMessage):
        decode_payload(payload)


@settings(max_examples=500)
@given(st.binary(max_size=200))
def test_any_bytes_decode_or_count_as_malformed(payload: bytes) -> None:
    try:
        batch = decode_payload(payload)
    except MalformedMessage:
        return
    assert isinstance(batch.events, list)


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=20)
    | st.binary(max_size=20)
    | st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "type"]),
    lambda children: (
        st.lists(children, max_size=12)
        | st.dictionaries(
            st.sampled_from(["type", "block_hashes", "token_ids", "block_size", "ts", "events"])
            | st.text(max_size=5),
            children,
            max_size=6,
        )
    ),
    max_leaves=30,
)


@settings(max_examples=500)
@given(msgpack_values)
def test_any_msgpack_value_decodes_or_counts_as_malformed(value: Any) -> None:
    shapes = [value, [1.0, value], [1.0, [value], 0]]
    if isinstance(value, list):
        shapes.append([1.0, [["BlockStored", *value], ["BlockRemoved", *value]]])
    for shaped in shapes:
        with contextlib.suppress(MalformedMessage):
            decode_payload(msgpack.packb(shaped, use_bin_type=True))


def test_sequence_and_topic_frames() -> None:
    assert decode_seq(b"\x00" * 7 + b"\x05") == 5
    with pytest.raises(MalformedMessage):
        decode_seq(b"\x00" * 4)
    assert parse_topic(b"kv@10.0.0.7:8000@Qwen/Qwen3-0.6B") == ("10.0.0.7:8000", "Qwen/Qwen3-0.6B")
    assert parse_topic(b"kv@10.0.0.7@") == ("10.0.0.7", None)
    assert parse_topic(b"") == (None, None)
    assert parse_topic(b"kv@a@b@c") == (None, None)
    assert parse_topic(b"\xff") == (None, None)


def test_simulated_publisher_encodings_decode_identically() -> None:
    for encoding in ("array", "map"):
        stored = encode_stored(
            encoding, [1, 2], None, list(range(8)), 4, "ad", [["ad", "s"], ["ad"]]
        )
        payload = encode_batch(5.0, [stored, encode_removed(encoding, [2])])
        batch = decode_payload(payload)
        assert batch.events == [
            BlockStored(
                [1, 2], None, list(range(8)), 4, None, "GPU", "ad", [["ad", "s"], ["ad"]], 0,
                "full_attention",
            ),
            BlockRemoved([2], "GPU", 0),
        ]  # fmt: skip
