from pathlib import Path

import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from kv_picker.config import PickerConfig, load_config, parse_config, parse_config_text
from kv_picker.decode import parse_duration_s
from kv_picker.errors import ConfigError
from kv_picker.plugins import builtin_registry

REGISTRY = builtin_registry(include_entry_points=False)

ISSUE_SHAPE = """
server: {grpcPort: 9002, metricsPort: 9090}
endpoints:
- address: 127.0.0.1:8001
  labels: {llm-d.ai/role: both}
plugins:
- type: prefix-cache-scorer
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: max-score-picker
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: prefix-cache-scorer, weight: 3}
  - {pluginRef: queue-scorer, weight: 2}
  - {pluginRef: kv-cache-utilization-scorer, weight: 2}
"""


def test_documented_shape_loads() -> None:
    config = parse_config_text(ISSUE_SHAPE, REGISTRY)
    assert config.server.grpc_port == 9002 and config.server.metrics_port == 9090
    assert config.endpoints[0].address == "127.0.0.1:8001"
    assert config.endpoints[0].labels == {"llm-d.ai/role": "both"}
    (profile,) = config.profiles
    weights = {entry.plugin_ref: entry.weight for entry in profile.entries}
    assert weights == {
        "prefix-cache-scorer": 3.0,
        "queue-scorer": 2.0,
        "kv-cache-utilization-scorer": 2.0,
        "max-score-picker": 1.0,
    }


def test_upstream_header_and_ignored_sections_accepted() -> None:
    text = "apiVersion: llm-d.ai/v1alpha1\nkind: EndpointPickerConfig\nfeatureGates: [x]\n"
    assert parse_config_text(text, REGISTRY).profiles[0].name == "default"


def test_empty_config_is_the_builtin_default() -> None:
    config = parse_config_text("", REGISTRY)
    refs = [entry.plugin_ref for entry in config.profiles[0].entries]
    assert refs == [
        "prefix-cache-scorer",
        "predicted-latency-scorer",
        "active-request-scorer",
        "recent-work-scorer",
        "max-score-picker",
    ]
    weights = [entry.weight for entry in config.profiles[0].entries[:4]]
    assert weights == [1, 1.5, 2, 0.5]
    (recent,) = [p for p in config.plugins if p.type == "recent-work-scorer"]
    assert recent.params.idleShare == 0.25
    assert recent.params.decodeSpeedScaled is True
    assert config == parse_config({}, REGISTRY, source="<text>")


def test_no_profiles_means_one_default_profile_with_every_plugin() -> None:
    config = parse_config(
        {"plugins": [{"type": "queue-scorer"}, {"type": "random-picker"}]}, REGISTRY
    )
    assert [e.plugin_ref for e in config.profiles[0].entries] == ["queue-scorer", "random-picker"]


def test_picker_added_when_profile_has_none() -> None:
    config = parse_config(
        {
            "plugins": [{"type": "queue-scorer"}],
            "schedulingProfiles": [{"name": "p", "plugins": [{"pluginRef": "queue-scorer"}]}],
        },
        REGISTRY,
    )
    assert config.profiles[0].entries[-1].plugin_ref == "max-score-picker"


def test_durations() -> None:
    assert parse_duration_s("100ms", "x") == pytest.approx(0.1)
    assert parse_duration_s("2s", "x") == 2.0
    assert parse_duration_s(1.5, "x") == 1.5
    assert parse_duration_s("1m", "x") == 60.0
    assert parse_duration_s("1m30s", "x") == 90.0
    assert parse_duration_s("3h", "x") == 10800.0
    assert parse_duration_s(0, "x") == 0.0  # "off", where a field allows it
    for bad in ("fast", -1, "-2s", True, "3x", "1m 2s", float("nan")):
        with pytest.raises(ConfigError):
            parse_duration_s(bad, "x")


@pytest.mark.parametrize(
    ("document", "fragments"),
    [
        (
            {"plugins": [{"type": "nope-scorer"}]},
            ["plugins[0] (nope-scorer)", "unknown plugin type", "queue-scorer"],
        ),
        (
            {"plugins": [{"type": "prefix-cache-scorer", "parameters": {"blockSiz": 4}}]},
            ["prefix-cache-scorer", "blockSiz", "known: blockSizeChars"],
        ),
        (
            {"plugins": [{"type": "prefix-cache-scorer", "parameters": {"blockSizeChars": "x"}}]},
            ["prefix-cache-scorer", "blockSizeChars", "integer"],
        ),
        (
            {"plugins": [{"type": "prefix-cache-scorer", "parameters": {"blockSizeChars": 0}}]},
            ["prefix-cache-scorer", "blockSizeChars"],
        ),
        ({"plugins": [{"type": "prefix-cache-scorer", "parameters": {"mode": "exact"}}]}, ["mode"]),
        (
            {"plugins": [{"type": "prefix-cache-scorer", "parameters": {"mode": "precise"}}]},
            ["prefix-cache-scorer", "tokenizer", "required"],
        ),
        ({"plugins": [{"type": "queue-scorer"}, {"type": "queue-scorer"}]}, ["used twice"]),
        (
            {
                "plugins": [{"type": "queue-scorer"}],
                "schedulingProfiles": [{"name": "d", "plugins": [{"pluginRef": "missing"}]}],
            },
            ["schedulingProfiles[0] (d).plugins[0].pluginRef", "missing", "declared: queue-scorer"],
        ),
        (
            {
                "plugins": [{"type": "queue-scorer"}],
                "schedulingProfiles": [
                    {"name": "d", "plugins": [{"pluginRef": "queue-scorer", "weight": -1}]}
                ],
            },
            ["weight"],
        ),
        (
            {
                "plugins": [{"type": "random-picker"}, {"type": "max-score-picker"}],
                "schedulingProfiles": [
                    {
                        "name": "d",
                        "plugins": [
                            {"pluginRef": "random-picker"},
                            {"pluginRef": "max-score-picker"},
                        ],
                    }
                ],
            },
            ["more than one picker"],
        ),
        ({"endpoints": [{"address": "localhost:80"}]}, ["endpoints[0].address", "IP"]),
        ({"endpoints": [{"address": "10.0.0.1"}]}, ["endpoints[0].address"]),
        ({"endpoints": [{"address": "10.0.0.1:0"}]}, ["port"]),
        ({"endpoints": [{"address": "10.0.0.1:80"}, {"address": "10.0.0.1:80"}]}, ["twice"]),
        ({"endpoints": [{"address": "10.0.0.1:80", "labels": {"a": 1}}]}, ["labels"]),
        ({"endpoints": [{"address": "10.0.0.1:80", "weight": 1}]}, ["endpoints[0]", "weight"]),
        ({"server": {"grpcPort": "9002"}}, ["server.grpcPort", "integer"]),
        ({"server": {"grpcPort": 70000}}, ["server.grpcPort"]),
        ({"server": {"tls": {"certPath": "c"}}}, ["server.tls"]),
        ({"server": {"maxBodyBytes": 0}}, ["maxBodyBytes"]),
        ({"metrics": {"scrapeInterval": "soon"}}, ["metrics.scrapeInterval"]),
        ({"metrics": {"path": "metrics"}}, ["metrics.path"]),
        ({"metrics": {"scraper": "thread"}}, ["metrics.scraper"]),
        ({"server": {"shutdownDelay": "soon"}}, ["server.shutdownDelay"]),
        ({"server": {"shutdownDelay": "-1s"}}, ["server.shutdownDelay"]),
        ({"server": {"drainTimeout": "0s"}}, ["server.drainTimeout"]),
        ({"server": {"drainTimeout": "a while"}}, ["server.drainTimeout"]),
        ({"admission": {"maxPendingRequests": -1}}, ["admission.maxPendingRequests"]),
        ({"admission": {"maxPendingRequests": "many"}}, ["admission.maxPendingRequests"]),
        ({"admission": {"queueDelayTarget": "-5ms"}}, ["admission.queueDelayTarget"]),
        ({"admission": {"queueDelayTarget": "soon"}}, ["admission.queueDelayTarget"]),
        ({"admission": {"queueDelayInterval": 0}}, ["admission.queueDelayInterval"]),
        ({"admission": {"requestStartHeader": "X-Start"}}, ["admission.requestStartHeader"]),
        ({"models": [{"name": ""}]}, ["models[0].name"]),
        ({"bogus": 1}, ["unknown field", "bogus"]),
        ({"apiVersion": "v9"}, ["apiVersion"]),
        ({"kind": "Deployment"}, ["kind"]),
        ({"schedulingProfiles": []}, ["at least one profile"]),
        ({"plugins": "queue-scorer"}, ["plugins", "list"]),
        (
            {"plugins": [{"type": "predicted-latency-scorer", "parameters": {"maxNumSeqs": -1}}]},
            ["plugins[0]", "maxNumSeqs"],
        ),
        (
            {"plugins": [{"type": "predicted-latency-scorer", "parameters": {"maxNumSeqs": 1.5}}]},
            ["plugins[0]", "maxNumSeqs", "integer"],
        ),
        (
            {
                "plugins": [
                    {"type": "predicted-latency-scorer", "parameters": {"outputTokens": "x"}}
                ]
            },
            ["plugins[0]", "outputTokens"],
        ),
        (
            {
                "plugins": [
                    {"type": "predicted-latency-scorer", "parameters": {"remotePrefillTokens": -1}}
                ]
            },
            ["plugins[0]", "remotePrefillTokens"],
        ),
        (
            {
                "plugins": [
                    {
                        "type": "predicted-latency-scorer",
                        "parameters": {"remotePrefillTokens": "all"},
                    }
                ]
            },
            ["plugins[0]", "remotePrefillTokens", "integer"],
        ),
        (  # a parameter the scorer does not read is refused, not silently ignored
            {"plugins": [{"type": "predicted-latency-scorer", "parameters": {"ratioSpan": 2}}]},
            ["plugins[0]", "unknown field", "ratioSpan"],
        ),
    ],
)
def test_bad_configs_name_the_field(document: dict[str, object], fragments: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(document, REGISTRY)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_file_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"missing\.yaml"):
        load_config(tmp_path / "missing.yaml", REGISTRY)
    bad = tmp_path / "bad.yaml"
    bad.write_text("plugins: [\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml.*YAML"):
        load_config(bad, REGISTRY)
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text(yaml.safe_dump({"plugins": [{"type": "x"}]}))
    with pytest.raises(ConfigError, match=r"wrong\.yaml.*unknown plugin type"):
        load_config(wrong, REGISTRY)


@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=8),
        lambda inner: (
            st.lists(inner, max_size=3)
            | st.dictionaries(
                st.sampled_from(
                    [
                        "plugins",
                        "schedulingProfiles",
                        "type",
                        "name",
                        "pluginRef",
                        "weight",
                        "parameters",
                        "server",
                        "endpoints",
                        "address",
                        "metrics",
                        "grpcPort",
                        "labels",
                        "models",
                    ]
                ),
                inner,
                max_size=4,
            )
        ),
        max_leaves=25,
    )
)
def test_garbage_documents_give_config_errors_only(document: object) -> None:
    try:
        config = parse_config(document, REGISTRY)
    except ConfigError as exc:
        assert str(exc)
    else:
        assert isinstance(config, PickerConfig)


def test_shipped_profiles_load() -> None:
    profiles = sorted(
        (Path(__file__).resolve().parents[2] / "benchmarks" / "profiles").glob("*.yaml")
    )
    assert profiles, "benchmarks/profiles/ holds the documented candidate profiles"
    for path in profiles:
        document = yaml.safe_load(path.read_text(encoding="utf-8"))
        if "pdParameters" in document:
            # The harness's per-side P/D key: the service refuses it by name, and the rest of
            # the document is a service config.
            with pytest.raises(ConfigError, match="pdParameters"):
                load_config(path, REGISTRY)
            del document["pdParameters"]
            config = parse_config(document, REGISTRY, str(path))
        else:
            config = load_config(path, REGISTRY)
        assert config.profiles, path
