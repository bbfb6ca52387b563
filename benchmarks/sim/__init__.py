"""Simulated vLLM endpoint: stands in for GPU pods in tests, the demo and benchmarks.

Layers, each usable on its own:

- :mod:`~kv_picker_bench.sim.tokenizer`: deterministic built-in tokenizer and chat template.
- :mod:`~kv_picker_bench.sim.cache`: vLLM-compatible block hashing and the finite prefix cache.
- :mod:`~kv_picker_bench.sim.engine`: pure continuous-batching and timing model (clock injected),
  shared with the offline cluster simulator.
- :mod:`~kv_picker_bench.sim.events`: the cache's changes as vLLM KV events (ZMQ PUB, msgpack,
  array or map encoding) with a replay socket.
- :mod:`~kv_picker_bench.sim.openai_api`: the OpenAI-compatible HTTP layer (aiohttp): request
  parsing, SSE streaming, error bodies, ``/v1/models``, ``/health``, ``/metrics``.
- :mod:`~kv_picker_bench.sim.endpoint`: :class:`SimEndpoint`, the engine run in model time behind
  that API, with P/D prefill legs, KV transfer and KV-event publishing.
- :mod:`~kv_picker_bench.sim.cli`: the command line (``python -m kv_picker_bench.sim --port 8000``).
"""

from kv_picker_bench.sim.cache import (
    HASH_ALGO,
    BlockHasher,
    CacheEventListener,
    PrefixCache,
    StoredBlock,
)
from kv_picker_bench.sim.cli import build_parser, config_from_args, main, serve
from kv_picker_bench.sim.endpoint import ROLES, SimEndpoint, SimEndpointConfig, start_sim_endpoint
from kv_picker_bench.sim.engine import (
    DEFAULT_NUM_GPU_BLOCKS,
    HARDWARE_CLASSES,
    EngineConfig,
    EngineStats,
    FinishedRequest,
    HardwareClass,
    RequestRejected,
    SimEngine,
    StepResult,
    TimingModel,
    TokenEvent,
    hardware_class,
)
from kv_picker_bench.sim.events import KVEventPublisher
from kv_picker_bench.sim.openai_api import ENDPOINT_HEADER
from kv_picker_bench.sim.tokenizer import VOCAB_SIZE, decode, encode, render_chat

__all__ = [
    "DEFAULT_NUM_GPU_BLOCKS",
    "ENDPOINT_HEADER",
    "HARDWARE_CLASSES",
    "HASH_ALGO",
    "ROLES",
    "VOCAB_SIZE",
    "BlockHasher",
    "CacheEventListener",
    "EngineConfig",
    "EngineStats",
    "FinishedRequest",
    "HardwareClass",
    "KVEventPublisher",
    "PrefixCache",
    "RequestRejected",
    "SimEndpoint",
    "SimEndpointConfig",
    "SimEngine",
    "StepResult",
    "StoredBlock",
    "TimingModel",
    "TokenEvent",
    "build_parser",
    "config_from_args",
    "decode",
    "encode",
    "hardware_class",
    "main",
    "render_chat",
    "serve",
    "start_sim_endpoint",
]
