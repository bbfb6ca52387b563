"""The prefix match that the prefix scorer shares with the other plugins."""

import itertools

import pytest

from kv_picker.scheduling.signals import PrefixMatch


def _matches() -> list[PrefixMatch]:
    held = {0: 3, 2: 8, 5: 1}
    return [
        PrefixMatch(16.0, 8, dict(held)),
        PrefixMatch(16.0, 8, dict(held), capped=True),
        PrefixMatch(16.0, 8, dict(held), capped=True, whole_tokens=1000.0),
        PrefixMatch(16.0, 8, dict(held), capped=True, whole_tokens=50.0),  # estimate below match
        PrefixMatch(16.0, 8, {}),
    ]


@pytest.mark.parametrize("match", _matches())
def test_most_cached_tokens_is_the_most_any_endpoint_holds(match: PrefixMatch) -> None:
    ids = range(7)
    for size in range(len(ids) + 1):
        for subset in itertools.combinations(ids, size):
            expected = max((match.cached_tokens(i) for i in subset), default=0.0)
            assert match.most_cached_tokens(subset) == expected, subset


def test_a_whole_capped_match_counts_the_whole_prompt() -> None:
    match = PrefixMatch(16.0, 8, {0: 3, 2: 8}, capped=True, whole_tokens=1000.0)
    assert match.most_cached_tokens([0, 2]) == 1000.0
    assert match.most_cached_tokens([0, 1]) == 48.0
    assert match.most_cached_tokens([1]) == 0.0
