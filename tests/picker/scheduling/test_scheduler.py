import math
from collections import Counter

import pytest

from kv_picker.errors import ConfigError, SaturatedError
from kv_picker.scheduling.pickers import MaxScorePicker, PickerParams, WeightedRandomPicker
from tests.fakes import make_context, make_request, make_scheduler, make_store


def test_weights_multiply_clamped_scores_and_sum() -> None:
    store = make_store(3, waiting=[0, 5, 10], kv_usage=[0.9, 0.5, 0.0])
    scheduler = make_scheduler(
        {
            "plugins": [{"type": "queue-scorer"}, {"type": "kv-cache-utilization-scorer"}],
            "schedulingProfiles": [
                {
                    "name": "default",
                    "plugins": [
                        {"pluginRef": "queue-scorer", "weight": 2},
                        {"pluginRef": "kv-cache-utilization-scorer", "weight": 3},
                    ],
                }
            ],
        },
        store,
    )
    result = scheduler.schedule(make_request(), store.all(), explain=True)
    totals = result.primary.totals
    assert totals == pytest.approx([2 * 1.0 + 3 * 0.1, 2 * 0.5 + 3 * 0.5, 2 * 0.0 + 3 * 1.0])
    assert result.primary.targets[0].address == "10.0.0.3:8000"
    assert result.primary.breakdown is not None
    assert result.primary.breakdown["queue-scorer"] == pytest.approx([1.0, 0.5, 0.0])


def test_filter_removing_everything_is_429() -> None:
    store = make_store(2)
    scheduler = make_scheduler(
        {
            "plugins": [{"type": "prefill-filter"}, {"type": "queue-scorer"}],
        },
        store,
    )
    with pytest.raises(SaturatedError) as info:
        scheduler.schedule(make_request(), store.all())
    assert info.value.status == 429 and "prefill-filter" in info.value.message


def test_decode_filter_lets_unlabelled_pass_prefill_requires_label() -> None:
    store = make_store(3, labels=[{"llm-d.ai/role": "prefill"}, {}, {"llm-d.ai/role": "decode"}])
    decode = make_scheduler(
        {"plugins": [{"type": "decode-filter"}, {"type": "random-picker"}]}, store
    )
    seen = {
        decode.schedule(make_request(), store.all()).primary.targets[0].address for _ in range(50)
    }
    assert seen == {"10.0.0.2:8000", "10.0.0.3:8000"}
    prefill = make_scheduler({"plugins": [{"type": "prefill-filter"}]}, store)
    assert (
        prefill.schedule(make_request(), store.all()).primary.targets[0].address == "10.0.0.1:8000"
    )


def test_max_score_ties_break_randomly_but_repeatably() -> None:
    store = make_store(4)
    picks = []
    for _ in range(2):
        picker = MaxScorePicker("p", PickerParams(), make_context(store, seed=42))
        picks.append(
            [picker.pick(make_request(), store.all(), [1.0] * 4)[0].id for _ in range(200)]
        )
    assert picks[0] == picks[1]
    counts = Counter(picks[0])
    assert len(counts) == 4 and min(counts.values()) > 25


def test_max_score_multiple_endpoints_ordered() -> None:
    store = make_store(4)
    picker = MaxScorePicker("p", PickerParams(maxNumOfEndpoints=3), make_context(store))
    picked = picker.pick(make_request(), store.all(), [0.1, 0.9, 0.5, 0.7])
    assert [e.id for e in picked] == [1, 3, 2]


def test_weighted_random_follows_weights_and_skips_zero() -> None:
    store = make_store(3)
    picker = WeightedRandomPicker("p", PickerParams(), make_context(store, seed=1))
    counts = Counter(
        picker.pick(make_request(), store.all(), [3.0, 1.0, 0.0])[0].id for _ in range(4000)
    )
    assert counts[2] == 0
    assert math.isclose(counts[0] / counts[1], 3.0, rel_tol=0.2)
    all_zero = Counter(
        picker.pick(make_request(), store.all(), [0.0, 0.0, 0.0])[0].id for _ in range(300)
    )
    assert len(all_zero) == 3


def test_scorer_out_of_range_values_are_clamped() -> None:
    class Wild:
        type_name = "wild"
        name = "queue-scorer"  # takes the place (and the timer) of the configured scorer

        def score(self, request, candidates, out):  # type: ignore[no-untyped-def]
            out[0], out[1], out[2] = 7.0, -3.0, float("nan")

    store = make_store(3)
    scheduler = make_scheduler({"plugins": [{"type": "queue-scorer"}]}, store)
    profile = scheduler.profiles["default"]
    profile.scorers[0].plugin = Wild()
    result = profile.run(make_request(), store.all())
    assert result.totals == [1.0, 0.0, 0.0]


def test_by_label_selector_matches_as_kubernetes_selectors_do() -> None:
    labels = [
        {"tier": "gpu", "zone": "a"},
        {"tier": "gpu", "zone": "b", "spot": "true"},
        {"tier": "cpu", "zone": "a"},
        {"zone": "c"},
    ]
    store = make_store(4, labels=labels)

    def kept(parameters: dict[str, object]) -> list[int]:
        document = {
            "plugins": [
                {"type": "by-label-selector", "parameters": parameters},
                {"type": "max-score-picker", "parameters": {"maxNumOfEndpoints": 4}},
            ]
        }
        scheduler = make_scheduler(document, store)
        return sorted(e.id for e in scheduler.schedule(make_request(), store.all()).primary.targets)

    assert kept({}) == [0, 1, 2, 3]  # an empty selector selects everything
    assert kept({"matchLabels": {"tier": "gpu"}}) == [0, 1]
    expression = {"key": "zone", "operator": "In", "values": ["a", "c"]}
    assert kept({"matchExpressions": [expression]}) == [0, 2, 3]
    assert kept(
        {"matchExpressions": [{"key": "tier", "operator": "NotIn", "values": ["cpu"]}]}
    ) == [
        0,
        1,
        3,  # no tier label: not in the set
    ]
    assert kept({"matchExpressions": [{"key": "spot", "operator": "DoesNotExist"}]}) == [0, 2, 3]
    both = {
        "matchLabels": {"tier": "gpu"},
        "matchExpressions": [{"key": "spot", "operator": "Exists"}],
    }
    assert kept(both) == [1]


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ({"key": "zone", "operator": "In"}, "In needs values"),
        ({"key": "zone", "operator": "Exists", "values": ["a"]}, "Exists takes no values"),
        ({"key": "zone", "operator": "Gt", "values": ["1"]}, "operator 'Gt' is not one of"),
        ({"key": "", "operator": "Exists"}, "'key' is required"),
    ],
)
def test_a_bad_label_selector_is_refused(expression: dict[str, object], message: str) -> None:
    document = {
        "plugins": [
            {"type": "by-label-selector", "parameters": {"matchExpressions": [expression]}},
        ]
    }
    with pytest.raises(ConfigError, match=message):
        make_scheduler(document, make_store(2))
