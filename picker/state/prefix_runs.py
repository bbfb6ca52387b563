"""The one leading-run walk: how many of a request's leading blocks each candidate holds.

Every prefix signal asks the same question over the same shape. The question: of the request's
block keys, in order, how many leading ones does endpoint ``e`` hold? The shape: a map from
block key to an int bitset of the endpoints holding it (bit ``e`` set: endpoint ``e`` holds the
block). The approximate index, the precise indexes (and the speculative holders they consult),
and the benchmark's baselines all answer it here, so runs and ties cannot drift apart::

    keys:       k0      k1      k2      k3          candidates 0b0111
    holders:    0b0111  0b0011  0b0011  0b0001
    alive:      0b0111  0b0011  0b0011  0b0001  ->  runs: endpoint 2: 1, 1: 3, 0: 4 (best 4)

The walk intersects a bitset of the endpoints still alive with each key's holders; when a bit
drops out at block i, that endpoint's run is i. That is O(blocks + candidates) int operations,
with no allocation per block, and it stops at the first block no candidate holds. Runs go into a
buffer indexed by endpoint id that the caller keeps across requests (grown here when a higher
id shows up), not into a fresh dict per request.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from kv_picker.endpoint import Endpoint


def mask_of(candidates: Iterable[Endpoint]) -> int:
    """The bitset of the candidates' endpoint ids."""
    mask = 0
    for endpoint in candidates:
        mask |= 1 << endpoint.id
    return mask


def leading_runs(
    keys: Sequence[int],
    candidate_mask: int,
    runs_out: list[int],
    holders: Mapping[int, int],
    overlay: tuple[Mapping[int, int], Mapping[int, int]] | None = None,
) -> int:
    """Each candidate's leading run over ``keys``.

    Args:
        keys: the request's block keys, in order.
        candidate_mask: bitset of the candidate endpoint ids.
        runs_out: indexed by endpoint id; receives every candidate's run (0 when it lacks
            block 0), other entries are left alone. Grown with zeros to cover every candidate.
        holders: block key -> bitset of the endpoints holding it.
        overlay: two more such maps whose holders also count (the speculative holders'
            generations); consulted only at blocks where a candidate would drop out.

    Returns:
        The longest run of any candidate (0 without candidates).
    """
    if not candidate_mask:
        return 0
    short = candidate_mask.bit_length() - len(runs_out)
    if short > 0:
        runs_out.extend([0] * short)
    mask = candidate_mask
    position = 0
    # Hoisted: an empty overlay costs nothing per block.
    newer, older = overlay if overlay is not None and (overlay[0] or overlay[1]) else (None, None)
    for key in keys:
        held = mask & holders.get(key, 0)
        if newer is not None and older is not None and held != mask:
            held |= mask & (newer.get(key, 0) | older.get(key, 0))
        if held != mask:
            dropped = mask ^ held
            while dropped:
                low = dropped & -dropped
                runs_out[low.bit_length() - 1] = position
                dropped ^= low
            mask = held
            if not mask:
                return position
        position += 1
    while mask:
        low = mask & -mask
        runs_out[low.bit_length() - 1] = position
        mask ^= low
    return position
