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

The precise index keeps one such map per tier (GPU, CPU, storage): :func:`tiered_runs` walks
them together, a block counting when any tier holds it and weighing its best tier's weight.
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


def tiered_runs(
    keys: Sequence[int],
    candidate_mask: int,
    runs_out: list[int],
    weighted_out: list[float],
    tier_holders: Sequence[Mapping[int, int]],
    tier_weights: Sequence[float],
    overlay: tuple[Mapping[int, int], Mapping[int, int]] | None = None,
) -> int:
    """Each candidate's leading run over blocks held in any tier, and its weighted length.

    A block counts for an endpoint when some tier of it holds the block; it weighs what the
    best such tier weighs (llm-d's longest-prefix score). The speculative overlay counts as the
    first tier (GPU: the endpoint is computing the blocks).

    With one tier populated this is :func:`leading_runs` and each weighted run is the run times
    that tier's weight. Otherwise the walk keeps, per tier, the endpoints whose best tier it is
    at the current block; an endpoint entering that set at block p subtracts ``w * p`` and
    leaving it at block q adds ``w * q``, so only changes cost per-endpoint work::

        keys:     k0   k1   k2   k3          gpu: e0 holds k0 k1, e1 holds k0..k3
        cpu:      .    .    e0   .           cpu: e0 holds k2      (weights 1.0, 0.8)
        runs:     e0: 3 (k3 missing), e1: 4;  weighted: e0 1 + 1 + 0.8 = 2.8, e1 4.0

    Args:
        keys: the request's block keys, in order.
        candidate_mask: bitset of the candidate endpoint ids.
        runs_out: as for :func:`leading_runs`.
        weighted_out: indexed by endpoint id like ``runs_out``: each candidate's weighted run.
        tier_holders: per tier id, block key -> bitset of the endpoints holding it there.
        tier_weights: per tier id, its weight.
        overlay: the speculative holders' two generations (see :func:`leading_runs`).

    Returns:
        The longest run of any candidate (0 without candidates).
    """
    if not candidate_mask:
        return 0
    short = candidate_mask.bit_length() - len(weighted_out)
    if short > 0:
        weighted_out.extend([0.0] * short)
    populated = [t for t, holders in enumerate(tier_holders) if holders]
    speculating = overlay is not None and bool(overlay[0] or overlay[1])
    if not populated or populated == [0] or (len(populated) == 1 and not speculating):
        tier = populated[0] if populated else 0
        best = leading_runs(keys, candidate_mask, runs_out, tier_holders[tier], overlay)
        weight = tier_weights[tier]
        mask = candidate_mask
        while mask:
            low = mask & -mask
            endpoint_id = low.bit_length() - 1
            weighted_out[endpoint_id] = runs_out[endpoint_id] * weight
            mask ^= low
        return best
    return _tiered_walk(
        keys, candidate_mask, runs_out, weighted_out, tier_holders, tier_weights, overlay
    )


def _tiered_walk(
    keys: Sequence[int],
    candidate_mask: int,
    runs_out: list[int],
    weighted_out: list[float],
    tier_holders: Sequence[Mapping[int, int]],
    tier_weights: Sequence[float],
    overlay: tuple[Mapping[int, int], Mapping[int, int]] | None,
) -> int:
    short = candidate_mask.bit_length() - len(runs_out)
    if short > 0:
        runs_out.extend([0] * short)
    newer, older = overlay if overlay is not None and (overlay[0] or overlay[1]) else ({}, {})
    # Best tier first; the overlay rides with the GPU tier (id 0).
    order = sorted(
        (t for t, holders in enumerate(tier_holders) if holders or (t == 0 and (newer or older))),
        key=lambda t: -tier_weights[t],
    )
    lookups = [tier_holders[t] for t in order]
    weights = [tier_weights[t] for t in order]
    gpu_at = order.index(0) if 0 in order else -1
    num = len(order)
    classes = [0] * num  # per tier (in order): endpoints whose best tier it is at this block
    mask = candidate_mask
    pending = mask
    while pending:  # weighted runs start at 0
        low = pending & -pending
        weighted_out[low.bit_length() - 1] = 0.0
        pending ^= low
    position = 0
    for key in keys:
        remaining = mask
        for j in range(num):
            held = lookups[j].get(key, 0)
            if j == gpu_at and (newer or older):
                held |= newer.get(key, 0) | older.get(key, 0)
            held &= remaining
            remaining ^= held
            before = classes[j]
            if held != before:
                weight = weights[j]
                left = before & ~held
                while left:
                    low = left & -left
                    weighted_out[low.bit_length() - 1] += weight * position
                    left ^= low
                entered = held & ~before
                while entered:
                    low = entered & -entered
                    weighted_out[low.bit_length() - 1] -= weight * position
                    entered ^= low
                classes[j] = held
        if remaining:
            dropped = remaining
            while dropped:
                low = dropped & -dropped
                runs_out[low.bit_length() - 1] = position
                dropped ^= low
            mask ^= remaining
            if not mask:
                return position
        position += 1
    for j in range(num):
        staying = classes[j]
        weight = weights[j]
        while staying:
            low = staying & -staying
            weighted_out[low.bit_length() - 1] += weight * position
            staying ^= low
    pending = mask
    while pending:
        low = pending & -pending
        runs_out[low.bit_length() - 1] = position
        pending ^= low
    return position
