"""Trace-replay benchmark harness: compare routing policies on the same requests.

Why a package of its own: researchers replay real traces to compare routing policies, and SREs
use the same runs to choose weights, so every policy has to see identical requests, endpoints
and timing. The layers, each usable on its own:

- :mod:`~benchmarks.harness.traces`: trace inputs (Mooncake JSONL, kv-picker JSONL, synthetic
  shared-prefix and multi-turn chat generators), validation, slicing and time scaling.
- :mod:`~benchmarks.harness.simulator`: the offline cluster simulator (continuous batching,
  prefix caches with LRU, optional P/D), driving the service's own scheduling code.
- :mod:`~benchmarks.harness.policies`: the baselines as scheduling plugins and configs.
- :mod:`~benchmarks.harness.report`: metrics, hit-ratio bounds, Markdown, JSON and plots.
- :mod:`~benchmarks.harness.live` and :mod:`~benchmarks.harness.peers`: the same trace slice
  through real Envoy + kv-picker, or through vllm-router / sglang-router, over HTTP.
- :mod:`~benchmarks.harness.cli`: ``kv-picker bench replay|sweep|live|peers``.
"""
