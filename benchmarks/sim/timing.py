"""What one engine step of a simulated endpoint costs: the timing model and its named profiles.

Why profiles with sources: routing on long conversation traces (Mooncake's prompts reach 130k
tokens) hinges on what a prefill costs, and that cost is not linear in the prompt: attention makes
a token at position 100k far dearer than one at position 100. Each profile here names a model and a
GPU setup, and every figure comes from the H100 datasheet and the model's shape, turned into time
with utilisation factors measured on that GPU. The profiles drive both the live simulated endpoint
(:mod:`~kv_picker_bench.sim.engine`) and the offline cluster simulator.

Step model, in seconds on the reference hardware (one H100 SXM per GPU of the profile)::

    step = (step_base_s + step_per_seq_s * (num_seqs - 1)
            + kv_read_s_per_token * sum(decode contexts)) / decode_speed
         + sum over prefill chunks (n new tokens at context position c) of
           (prefill_s_per_token * n + attention_s_per_token_pair * n * (c + n / 2)) / prefill_speed

- ``c`` counts the tokens already in the KV (cache hits and earlier chunks). Token ``i`` of the
  chunk attends causally to ``c + i + 1`` tokens; QK^T and PV cost 2 FLOPs per head dimension
  each, so attention costs ``4 * layers * (heads * head_dim) * n * (c + n/2)`` FLOPs, the count
  FlashAttention's benchmarks use. Doubling the context of a long prompt doubles its attention.
- A decoding sequence's context is the tokens its new token attends to (prompt plus outputs so
  far); decode is memory-bound, so it costs the read of their KV from HBM on top of the weights.
- ``step_base_s`` reads the weights (and the LM head) once per step; under tensor parallelism it
  adds the latency of the two all-reduces per layer. ``step_per_seq_s`` is the measured growth of a
  decode-sized forward pass per extra token.
- Compute and memory terms add up instead of overlapping (a roofline would take their maximum).
  That overstates a mixed step by at most its smaller term: on the 8B profile the weight read is
  3 % of a full 8,192-token prefill chunk, and 64 decodes of 4k tokens add 22 ms to its 214 ms.
- Not modelled: host-side scheduling overhead per step, the logits and sampling of each sequence.

Hardware scaling: compute terms divide by the hardware class's ``prefill_speed`` (dense BF16
FLOP/s relative to an H100), memory terms by its ``decode_speed`` (HBM bandwidth), as in
:mod:`kv_picker.state.hardware`.

Derivation of the profiles
--------------------------

Hardware (NVIDIA H100 Tensor Core GPU datasheet, SXM5): 989 TFLOP/s dense BF16, 3.35 TB/s HBM3,
80 GB. Model shapes (Hugging Face ``config.json`` of meta-llama/Llama-3.1-8B and -70B):

| model | layers | hidden | heads / KV heads x 128 | intermediate | vocab |
|---|---:|---:|---:|---:|---:|
| Llama-3.1-8B | 32 | 4,096 | 32 / 8 | 14,336 | 128,256 |
| Llama-3.1-70B | 80 | 8,192 | 64 / 8 | 28,672 | 128,256 |

Weights per layer: QKV ``h * (h + 2 * kv * 128)``, O ``h * h``, gate and up ``2 * h * i``, down
``i * h``: 218,103,808 (8B) and 855,638,016 (70B); with embeddings, LM head (not tied) and norms,
8,030,261,248 and 70,553,706,496 parameters. BF16 KV per token: ``2 (K, V) * layers * 8 * 128 * 2
bytes``: 131,072 (8B) and 327,680 (70B).

Achieved utilisation, measured: Vidur (Agrawal et al., MLSys 2024) profiled every operation of a
Llama layer on an H100 (repo microsoft/vidur, ``data/profiling/compute/h100/meta-llama/
Llama-2-7b-hf/mlp.csv`` and ``.../Llama-2-70b-hf/mlp.csv``; median times; Llama-2-70B's layer has
exactly Llama-3.1-70B's shape, Llama-2-7B's has the 8B's hidden size with an 11,008 MLP and 32 KV
heads, 202,375,168 weights). Summing a layer's operations (QKV, O, gate/up, down projections,
the two norms, rotary embedding, activation, residual add):

| layer, tensor parallel | 1 token | 64 tokens | 4,096 tokens |
|---|---:|---:|---:|
| Llama-2-7B, TP1 | 0.175 ms | 0.183 ms | 2.592 ms |
| Llama-2-70B, TP4 (per GPU) | 0.179 ms | 0.191 ms | 2.772 ms |

- Prefill (4,096 tokens, compute-bound): 7B ``4096 * 2 * 202,375,168 FLOP / 2.592 ms`` = 640
  TFLOP/s = **0.65** of 989; 70B TP4 ``4096 * 2 * 855,638,016 / 4 / 2.772 ms`` = 632 TFLOP/s =
  **0.64**.
- Decode (1 token, memory-bound): 7B ``2 * 202,375,168 bytes / 0.175 ms`` = 2.31 TB/s = **0.69** of
  3.35 TB/s; 70B TP4 ``2 * 855,638,016 / 4 bytes / 0.179 ms`` = 2.39 TB/s = **0.71**. The KV read is
  the same kind of streaming HBM read and gets the same factor.
- Per extra decode token: ``(t(64) - t(1)) / 63`` = 0.127 us per 7B layer (scaled to the 8B layer
  by its weights, 218.1M / 202.4M) and 0.190 us per 70B TP4 layer.
- Tensor parallelism (Vidur ``data/profiling/network/h100_dgx/all_reduce.csv``, 4 GPUs): an
  all-reduce of up to 1 MiB (a decode batch) takes a median **0.042 ms**; 64 MiB (4,096 tokens of
  16 KiB) takes **0.318 ms**. Each layer all-reduces twice (after attention and after the MLP).
- Attention (FlashAttention-3, Shah et al. 2024, arXiv:2407.08608, Fig. 5(d), causal, head dim
  128, BF16, H100 SXM5): the forward pass peaks at 616 TFLOP/s (0.62 of 989) at 16k tokens and
  runs slower on shorter sequences; the abstract's "up to 740 TFLOPs/s (75% utilization)" is the
  non-causal best. vLLM's prefill attends over a paged, partly cached KV in variable-length
  batches, below that dense benchmark, so the profiles take **0.5**.

``llama-3.1-8b-h100`` (the default), one H100:

- ``prefill_s_per_token`` = ``2 * 32 * 218,103,808 FLOP / (989e12 * 0.65)`` = 21.7 us (46k
  tokens/s).
- ``attention_s_per_token_pair`` = ``4 * 32 * 4096 FLOP / (989e12 * 0.5)`` = 1.06 ns: a fresh
  8,192-token chunk adds 36 ms of attention to its 178 ms of linear layers; the last chunk of a
  130k-token prompt (context 122k) adds 1.1 s.
- ``step_base_s`` = ``2 * 7,504,924,672 bytes (all weights but the embedding table) /
  (3.35e12 * 0.69)`` = 6.49 ms.
- ``step_per_seq_s`` = ``32 * 0.127 us * 218.1 / 202.4`` = 4.4 us.
- ``kv_read_s_per_token`` = ``131,072 / (3.35e12 * 0.69)`` = 56.7 ns (64 sequences of 4k tokens
  add 14.9 ms to a decode step).

``llama-3.1-70b-h100-tp4``, four H100s at tensor parallel 4 (figures per GPU, all four in step):

- ``prefill_s_per_token`` = ``2 * 80 * 855,638,016 / 4 FLOP / (989e12 * 0.64)`` = 54.1 us, plus
  ``160 all-reduces * 16 KiB * 0.318 ms / 64 MiB`` = 12.4 us: 66.5 us (15k tokens/s).
- ``attention_s_per_token_pair`` = ``4 * 80 * 8192 / 4 FLOP / (989e12 * 0.5)`` = 1.33 ns.
- ``step_base_s`` = ``2 * (80 * 855,638,016 + 1,050,673,152) / 4 bytes / (3.35e12 * 0.71)`` = 14.6
  ms, plus ``160 * 0.042 ms`` = 6.7 ms of all-reduce latency: 21.3 ms.
- ``step_per_seq_s`` = ``80 * 0.190 us`` = 15.2 us.
- ``kv_read_s_per_token`` = ``327,680 / 4 / (3.35e12 * 0.71)`` = 34.4 ns.

Cross-check against an end-to-end measurement: vLLM's performance benchmark (buildkite.com/vllm/
performance-benchmark/builds/9515, latency test: batch 8, 32 input and 128 output tokens, H200)
reports a mean 833.4 ms for latency_llama8B_tp1 and 2,077.5 ms for latency_llama70B_tp4. These
profiles on the H200 class (memory terms / 1.433) give 0.59 s and 1.93 s: 7 % short for the 70B
and 29 % short for the 8B, whose 5 ms steps feel most the host overhead this model leaves out.

KV capacity per endpoint (``kv_capacity_tokens``): vLLM gives the KV cache
``gpu_memory_utilization`` (default 0.9) of each GPU's memory less the weights. 8B: ``0.9 * 80 GB
- 16.06 GB`` = 55.94 GB = 426,784 tokens of 131,072 bytes (26,674 blocks of 16). 70B TP4: ``4 *
0.9 * 80 GB - 141.11 GB`` = 146.89 GB = 448,280 tokens of 327,680 bytes. The datasheet's 80 GB
is about 6 % under what the GPU reports (nvidia-smi: 81,559 MiB), which roughly offsets the
activation and CUDA graph memory vLLM also reserves.

Why the 8B profile is the default: it is the model every other default here already assumes
(131,072 KV bytes per token, one GPU per endpoint); with one GPU per endpoint the hardware
classes' per-GPU speed ratios apply as they are; and its 16 GB of weights fit one GPU of every
class down to the L4 and the 3g.40gb MIG slice, where a 70B needs several GPUs of any class.

``legacy`` keeps the uncited figures all results before these profiles were measured with
(10,000 prefill tokens/s, 20 ms + 0.5 ms per extra sequence per step, no attention or KV-read
cost, 524,288 tokens of KV), only to reproduce those results.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, fields
from types import MappingProxyType

from kv_picker.state.hardware import HardwareClass

H100_BF16_FLOPS = 989e12
"""Dense BF16 tensor throughput of one H100 SXM (datasheet)."""

H100_HBM_BYTES_PER_S = 3.35e12
"""HBM3 bandwidth of one H100 SXM (datasheet)."""

H100_HBM_BYTES = 80e9
"""Memory of one H100 SXM (datasheet)."""

VLLM_GPU_MEMORY_UTILIZATION = 0.9
"""vLLM's default share of each GPU's memory for weights, activations and the KV cache."""

ATTENTION_UTILISATION = 0.5
"""Achieved share of peak FLOP/s in prefill attention (see the module docstring)."""


@dataclass(frozen=True, slots=True)
class TimingModel:
    """Step costs of one endpoint on the reference hardware (H100), in seconds.

    Attributes:
        name: Profile name, as ``--timing`` takes it and results record it.
        step_base_s: Fixed cost of a step with one sequence (weight read, TP all-reduce latency).
        step_per_seq_s: Extra cost per further scheduled sequence.
        prefill_s_per_token: Linear-layer cost of one prompt token computed.
        attention_s_per_token_pair: Attention cost per new token per context token.
        kv_read_s_per_token: Cost of reading one context token's KV in a decode step.
        kv_bytes_per_token: KV size of one token over all GPUs of the endpoint (P/D transfers).
        kv_capacity_tokens: KV capacity of an H100-class endpoint, in tokens.
        summary: One line for ``--help``.
    """

    name: str
    step_base_s: float
    step_per_seq_s: float
    prefill_s_per_token: float
    attention_s_per_token_pair: float
    kv_read_s_per_token: float
    kv_bytes_per_token: int
    kv_capacity_tokens: int
    summary: str = ""

    def __post_init__(self) -> None:
        for spec in fields(self):
            value = getattr(self, spec.name)
            if isinstance(value, str):
                continue
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"timing {self.name!r}: {spec.name} must be >= 0, got {value}")
        for name in ("step_base_s", "prefill_s_per_token", "kv_bytes_per_token"):
            if not getattr(self, name) > 0:
                raise ValueError(f"timing {self.name!r}: {name} must be positive")

    def prefill_chunk_s(
        self, hardware: HardwareClass, num_tokens: int, context_tokens: int
    ) -> float:
        """Compute time of one prefill chunk, without the step's fixed cost.

        Args:
            hardware: The hardware class running it.
            num_tokens: New prompt tokens computed in the chunk.
            context_tokens: Tokens already in the KV before the chunk (cached or computed).

        Returns:
            Model seconds.
        """
        pairs = num_tokens * (context_tokens + num_tokens / 2)
        return (
            num_tokens * self.prefill_s_per_token + pairs * self.attention_s_per_token_pair
        ) / hardware.prefill_speed

    def kv_read_s(self, hardware: HardwareClass, context_tokens: int) -> float:
        """Time a decode step spends reading the KV of ``context_tokens`` tokens."""
        return context_tokens * self.kv_read_s_per_token / hardware.decode_speed

    def step_duration_s(
        self,
        hardware: HardwareClass,
        num_seqs: int,
        prefill_chunks: Iterable[tuple[int, int]] = (),
        decode_context_tokens: int = 0,
    ) -> float:
        """Duration of one engine step (see the module docstring for the formula).

        Args:
            hardware: The hardware class running it.
            num_seqs: Sequences scheduled in the step (prefill chunks and decodes).
            prefill_chunks: ``(new tokens, context tokens before the chunk)`` per prefill chunk.
            decode_context_tokens: Sum over the decoding sequences of the tokens each attends to.

        Returns:
            Model seconds; 0.0 for an empty step.
        """
        if num_seqs <= 0:
            return 0.0
        memory_s = (
            self.step_base_s
            + self.step_per_seq_s * (num_seqs - 1)
            + self.kv_read_s_per_token * decode_context_tokens
        ) / hardware.decode_speed
        compute_s = 0.0
        for num_tokens, context_tokens in prefill_chunks:
            compute_s += self.prefill_chunk_s(hardware, num_tokens, context_tokens)
        return memory_s + compute_s

    def isolated_prefill_s(
        self,
        hardware: HardwareClass,
        prompt_tokens: int,
        cached_tokens: int,
        max_num_batched_tokens: int,
    ) -> float:
        """Time an idle endpoint needs from a request's arrival to its first token.

        The uncached prompt tokens run in chunks of at most ``max_num_batched_tokens``, one step
        each; the first token comes out of the last chunk's step. At most ``prompt_tokens - 1``
        tokens count as cached: the last prompt token is always recomputed, as in vLLM.

        Args:
            hardware: The endpoint's hardware class.
            prompt_tokens: Prompt length (at least 1).
            cached_tokens: Leading prompt tokens served from the prefix cache.
            max_num_batched_tokens: The endpoint's token budget per step.

        Returns:
            Model seconds.

        Raises:
            ValueError: If ``prompt_tokens`` or ``max_num_batched_tokens`` is not positive.
        """
        if prompt_tokens <= 0 or max_num_batched_tokens <= 0:
            raise ValueError("prompt_tokens and max_num_batched_tokens must be positive")
        computed = min(max(cached_tokens, 0), prompt_tokens - 1)
        total_s = 0.0
        while computed < prompt_tokens:
            chunk = min(prompt_tokens - computed, max_num_batched_tokens)
            total_s += self.step_duration_s(hardware, 1, ((chunk, computed),))
            computed += chunk
        return total_s


# ------------------------------------------------------------------------------ derivation


@dataclass(frozen=True, slots=True)
class _Llama:
    """The shape of a Llama-3.1 model (Hugging Face ``config.json``), BF16 weights and KV."""

    layers: int
    hidden: int
    kv_heads: int
    intermediate: int
    vocab: int = 128_256
    head_dim: int = 128

    @property
    def layer_weights(self) -> int:
        kv_width = 2 * self.kv_heads * self.head_dim
        h, i = self.hidden, self.intermediate
        return h * (h + kv_width) + h * h + 2 * h * i + i * h

    @property
    def parameters(self) -> int:
        norms = 2 * self.layers * self.hidden + self.hidden
        return self.layers * self.layer_weights + 2 * self.vocab * self.hidden + norms

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * 2


def _profile(
    name: str,
    model: _Llama,
    *,
    gpus: int,
    linear_utilisation: float,
    bandwidth_utilisation: float,
    per_token_layer_s: float,
    allreduce_latency_s: float = 0.0,
    allreduce_s_per_byte: float = 0.0,
    summary: str,
) -> TimingModel:
    """A profile from the model's shape and the measured factors (see the module docstring)."""
    flops = H100_BF16_FLOPS
    bandwidth = H100_HBM_BYTES_PER_S * bandwidth_utilisation
    allreduces = 2 * model.layers  # after attention and after the MLP
    linear_flops = 2 * model.layers * model.layer_weights / gpus
    attention_flops = 4 * model.layers * model.hidden / gpus
    # Every weight but the embedding table, which decode only indexes; split over the GPUs.
    step_bytes = 2 * (model.parameters - model.vocab * model.hidden) / gpus
    kv_bytes = model.kv_bytes_per_token
    kv_budget = gpus * VLLM_GPU_MEMORY_UTILIZATION * H100_HBM_BYTES - 2 * model.parameters
    return TimingModel(
        name=name,
        step_base_s=step_bytes / bandwidth + allreduces * allreduce_latency_s,
        step_per_seq_s=model.layers * per_token_layer_s,
        prefill_s_per_token=linear_flops / (flops * linear_utilisation)
        + allreduces * 2 * model.hidden * allreduce_s_per_byte,
        attention_s_per_token_pair=attention_flops / (flops * ATTENTION_UTILISATION),
        kv_read_s_per_token=kv_bytes / gpus / bandwidth,
        kv_bytes_per_token=kv_bytes,
        kv_capacity_tokens=int(kv_budget // kv_bytes),
        summary=summary,
    )


_LLAMA_8B = _Llama(layers=32, hidden=4096, kv_heads=8, intermediate=14_336)
_LLAMA_70B = _Llama(layers=80, hidden=8192, kv_heads=8, intermediate=28_672)
# Vidur's Llama-2-7B layer (11,008 MLP, 32 KV heads): its per-token growth scales to the 8B layer.
_LLAMA2_7B_LAYER_WEIGHTS = 202_375_168
_LLAMA2_7B_PER_TOKEN_S = (0.183e-3 - 0.175e-3) / 63

LLAMA_8B_H100 = _profile(
    "llama-3.1-8b-h100",
    _LLAMA_8B,
    gpus=1,
    linear_utilisation=0.65,
    bandwidth_utilisation=0.69,
    per_token_layer_s=_LLAMA2_7B_PER_TOKEN_S * _LLAMA_8B.layer_weights / _LLAMA2_7B_LAYER_WEIGHTS,
    summary="Llama-3.1-8B, BF16, one H100 SXM (the default)",
)
LLAMA_70B_H100_TP4 = _profile(
    "llama-3.1-70b-h100-tp4",
    _LLAMA_70B,
    gpus=4,
    linear_utilisation=0.64,
    bandwidth_utilisation=0.71,
    per_token_layer_s=(0.191e-3 - 0.179e-3) / 63,
    allreduce_latency_s=0.042e-3,
    allreduce_s_per_byte=0.318e-3 / (64 * 2**20),
    summary="Llama-3.1-70B, BF16, four H100 SXM at tensor parallel 4",
)
LEGACY = TimingModel(
    name="legacy",
    step_base_s=0.020,
    step_per_seq_s=0.0005,
    prefill_s_per_token=1 / 10_000,
    attention_s_per_token_pair=0.0,
    kv_read_s_per_token=0.0,
    kv_bytes_per_token=131_072,
    kv_capacity_tokens=32_768 * 16,
    summary="the uncited figures of results measured before the profiles, to reproduce them",
)

TIMING_PROFILES: Mapping[str, TimingModel] = MappingProxyType(
    {p.name: p for p in (LLAMA_8B_H100, LLAMA_70B_H100_TP4, LEGACY)}
)
"""The named profiles, by name."""

DEFAULT_TIMING = LLAMA_8B_H100
"""The profile used when none is named (see the module docstring for why)."""


def timing_profile(name: str) -> TimingModel:
    """Looks up a named profile.

    Args:
        name: A key of :data:`TIMING_PROFILES`.

    Returns:
        The profile.

    Raises:
        ValueError: If the name is unknown; the message lists the known names.
    """
    try:
        return TIMING_PROFILES[name]
    except KeyError:
        known = ", ".join(TIMING_PROFILES)
        raise ValueError(f"unknown timing profile {name!r}; known: {known}") from None


def describe_profiles() -> str:
    """One ``name: summary`` entry per profile, for ``--help``."""
    return "; ".join(f"{p.name}: {p.summary}" for p in TIMING_PROFILES.values())
