import pytest
from hypothesis import given
from hypothesis import strategies as st

from kv_picker.sources.scraper import MetricsParseError, parse_vllm_metrics

VLLM_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 4.0
vllm:num_requests_waiting{engine="1",model_name="m"} 1.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",enable_prefix_caching="True",engine="0",num_gpu_blocks="2048"} 1.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="m"} 0.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 0.0
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 812.0
vllm:time_to_first_token_seconds_count{engine="1",model_name="m"} 40.0
"""


def test_reads_vllm_exposition() -> None:
    signals = parse_vllm_metrics(VLLM_TEXT)
    assert (signals.waiting, signals.running, signals.kv_usage) == (5.0, 5.0, 0.5)
    assert (signals.block_size_tokens, signals.num_gpu_blocks) == (16, 2048)
    # The TTFT histogram's count, summed over engines: the requests given a first token.
    assert signals.first_tokens == 852.0


def test_accepts_the_old_kv_usage_name() -> None:
    text = (
        "vllm:num_requests_waiting 2\nvllm:num_requests_running 1\nvllm:gpu_cache_usage_perc 0.75\n"
    )
    signals = parse_vllm_metrics(text)
    assert signals.kv_usage == 0.75
    assert signals.first_tokens is None  # not exported: unknown, not zero


@pytest.mark.parametrize(
    "text",
    [
        "",
        "<html>not metrics</html>",
        "vllm:num_requests_running 1\n",
        'vllm:num_requests_waiting{model_name="m" 3\n',
        "vllm:num_requests_waiting abc\n",
    ],
)
def test_garbage_is_a_parse_error(text: str) -> None:
    with pytest.raises(MetricsParseError):
        parse_vllm_metrics(text)


@given(st.text(max_size=400))
def test_any_text_parses_or_raises_parse_error(text: str) -> None:
    try:
        signals = parse_vllm_metrics(text)
    except MetricsParseError:
        return
    assert 0.0 <= signals.kv_usage <= 1.0
