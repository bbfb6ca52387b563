"""Trace-replay benchmark harness: compare routing policies on the same requests.

Why a package of its own: researchers replay real traces to compare routing policies, and SREs
use the same runs to choose weights, so every policy has to see identical requests, endpoints
and timing. The layers, each usable on its own:

- :mod:`~kv_picker_bench.harness.traces`: trace inputs (Mooncake JSONL, kv-picker JSONL, the
  synthetic families), validation, slicing and time scaling; the records it re-exports live in
  :mod:`~kv_picker_bench.harness.trace_model`.
- :mod:`~kv_picker_bench.harness.families`: workload families (shared-prefix, chat, zipf-prefix,
  long-doc-qa, agentic, rag, mixed, lora, tenants), each a generator whose parameters a seed
  draws from documented ranges, built from :mod:`~kv_picker_bench.harness.synthesis` (arrival
  processes, samplers, prefix block ids).
- :mod:`~kv_picker_bench.harness.simulator`: the offline cluster simulator (continuous batching,
  prefix caches with LRU, optional P/D), driving the service's own scheduling code.
- :mod:`~kv_picker_bench.harness.policies`: the baselines as scheduling plugins and configs.
- :mod:`~kv_picker_bench.harness.report`: metrics, hit-ratio bounds, Markdown, JSON and plots.
- :mod:`~kv_picker_bench.harness.live` and :mod:`~kv_picker_bench.harness.peers`: the same trace slice
  through real Envoy + kv-picker, or through vllm-router / sglang-router, over HTTP.
- :mod:`~kv_picker_bench.harness.args`: the commands' shared flags, results folders and errors.
- :mod:`~kv_picker_bench.harness.cli`: the offline commands, ``kv-picker bench replay|sweep``
  (``live`` and ``peers`` run from :mod:`~kv_picker_bench.harness.live`).
"""
