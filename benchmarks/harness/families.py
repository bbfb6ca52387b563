"""Workload families: synthetic trace generators whose parameters a seed draws from ranges.

Why families and not one trace: a routing default that wins on one workload can lose on the
next (a cache-affinity policy shines on shared prefixes and hot-spots on skewed ones), so a
default has to be judged over many kinds of traffic. A family is one *kind* (a shape of
sharing, of sizes and of arrivals); a seed picks one concrete member of it: sizes, counts and
popularity skew are drawn from documented ranges, the rest is fixed, and explicit values
override any of them::

    FAMILIES["rag"].build(3)                  # seed 3: every ranged parameter drawn
    FAMILIES["rag"].build(3, top_k=4)         # the same draw, top_k forced (others unchanged)
    FAMILIES["rag"].build(None)               # the documented defaults, nothing drawn
    --trace rag:seed=3,top_k=4                # the same from the command line

Draws come from their own generator (seeded with the family's name and the seed), so forcing
one parameter never shifts another; the spec's ``seed`` then seeds everything the build
samples (arrivals, picks, lengths). A family sets the *shape* of its arrivals (Poisson, Gamma
bursts, sessions with think times) and a base rate; a load matrix rescales time to its target
rate with :func:`~kv_picker_bench.harness.traces.scale_rate`.

=============  ============================================================  ================
family         what is shared                                                 arrivals
=============  ============================================================  ================
shared-prefix  a context per group, a fixed question per user (llm-d)         Poisson
chat           a system prompt per group, then each session's history         sessions, think
zipf-prefix    contexts of varied length, Zipf-popular groups                 Gamma bursts
long-doc-qa    a few 16k-64k-token documents, short questions                 bursts per doc
agentic        each tool-loop call extends the previous call and its answer   sessions, tools
rag            a system prompt, then whatever retrieved-chunk order repeats   Gamma bursts
mixed          chat histories; long documents share nothing                   sessions+Poisson
lora           a prefix per LoRA adapter; adapters never share blocks         Gamma bursts
tenants        one system prompt text, kept apart by each tenant's salt       Gamma bursts
=============  ============================================================  ================

Each spec lists its parameters with the range a seed draws them from (``ranged(default, low,
high)``; ``log`` ranges are drawn log-uniformly). Block ids come from
:class:`~kv_picker_bench.harness.synthesis.PrefixBlocks` (equal ids exactly for equal prefixes)
and, for adapters and salts, from the cache namespaces of
:mod:`~kv_picker_bench.harness.trace_model`.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kv_picker_bench.harness.synthesis import (
    PrefixBlocks,
    PromptNode,
    around,
    gamma_arrivals,
    heavy_tailed,
    log_uniform,
    parse_stages,
    pick,
    pick_distinct,
    poisson_arrivals,
    staged_arrivals,
    zipf_cum_weights,
)
from kv_picker_bench.harness.trace_model import (
    DEFAULT_BLOCK_TOKENS,
    CacheNamespaces,
    Trace,
    TraceError,
    TraceRequest,
    renumber_by_arrival,
)

# --------------------------------------------------------------------------- machinery

_RANGE = "kv_picker_bench.range"


@dataclass(frozen=True, slots=True)
class Range:
    """Where a seed draws a parameter from.

    Attributes:
        low: Smallest value.
        high: Largest value.
        log: Draw log-uniformly (for sizes and counts spanning a factor of several).
    """

    low: float
    high: float
    log: bool = False

    def draw(self, rng: random.Random, kind: str) -> int | float:
        """A value for a field of type ``kind`` (``"int"`` or ``"float"``)."""
        if self.log:
            value = log_uniform(rng, self.low, self.high)
        elif kind == "int":
            return rng.randint(int(self.low), int(self.high))
        else:
            value = rng.uniform(self.low, self.high)
        # Rounded so that a drawn spec reads well in reports and logs.
        return round(value) if kind == "int" else round(value, 3)


def ranged(default: float, low: float, high: float, *, log: bool = False) -> Any:
    """A spec field with its documented default and the range a seed draws it from."""
    return field(default=default, metadata={_RANGE: Range(low, high, log)})


class WorkloadSpec(Protocol):
    """A frozen dataclass of a family's parameters that builds one trace."""

    @property
    def seed(self) -> int:
        """Seed of everything the build samples."""

    def build(self, name: str = ...) -> Trace:
        """The trace, named ``name``."""


@dataclass(frozen=True, slots=True)
class Family:
    """A named workload generator with randomized parameters.

    Attributes:
        name: The name used in ``--trace NAME:...``.
        spec_type: The parameters' dataclass.
        description: One line for listings.
        preset: Values applied before the draw and the overrides (``llm-d``'s ladder).
        randomized: Whether a seed draws the ranged parameters (``False``: it only seeds the
            build, for a published workload that must stay as published).
    """

    name: str
    spec_type: type[Any]
    description: str
    preset: tuple[tuple[str, Any], ...] = ()
    randomized: bool = True

    def parameters(self) -> dict[str, str]:
        """Every parameter's name and type name (``int``, ``float``, ``bool``, ``str``)."""
        return {f.name: str(f.type) for f in dataclasses.fields(self.spec_type)}

    def ranges(self) -> dict[str, Range]:
        """The parameters a seed draws, with their ranges (declaration order)."""
        if not self.randomized:
            return {}
        return {
            f.name: f.metadata[_RANGE]
            for f in dataclasses.fields(self.spec_type)
            if _RANGE in f.metadata
        }

    def draw(self, seed: int) -> dict[str, int | float]:
        """The values seed ``seed`` gives the ranged parameters."""
        rng = random.Random(f"kv-picker-family/{self.name}/{seed}")
        kinds = self.parameters()
        return {name: span.draw(rng, kinds[name]) for name, span in self.ranges().items()}

    def spec(self, seed: int | None = None, **overrides: Any) -> WorkloadSpec:
        """The concrete parameters: defaults, preset, the seed's draw, then ``overrides``.

        Raises:
            TraceError: An unknown parameter.
        """
        known = self.parameters()
        unknown = sorted(set(overrides) - set(known))
        if unknown:
            raise TraceError(
                f"{self.name}: unknown parameter {unknown[0]!r}; known: {', '.join(sorted(known))}"
            )
        values: dict[str, Any] = dict(self.preset)
        if seed is not None:
            values["seed"] = seed
            values.update(self.draw(seed))
        if "requests" in overrides and "stages" not in overrides and values.get("stages"):
            values["stages"] = ""  # an explicit count replaces a preset ladder
        values.update(overrides)
        spec: WorkloadSpec = self.spec_type(**values)
        return spec

    def build(self, seed: int | None = None, **overrides: Any) -> Trace:
        """One trace of the family (see :meth:`spec`); ``seed=None`` gives the defaults.

        Raises:
            TraceError: An unknown parameter or a value out of bounds.
        """
        name = self.name if seed is None or not self.randomized else f"{self.name}-s{seed}"
        return self.spec(seed, **overrides).build(name)


def _require_positive(family: str, **values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise TraceError(f"{family}: {name} must be positive, got {value}")


def _require_at_least(family: str, minimum: int, **values: float) -> None:
    for name, value in values.items():
        if value < minimum:
            raise TraceError(f"{family}: {name} must be >= {minimum}, got {value}")


def _require_share(family: str, **values: float) -> None:
    for name, value in values.items():
        if not 0.0 <= value <= 1.0:
            raise TraceError(f"{family}: {name} must be in [0, 1], got {value}")


# ----------------------------------------------------------------- llm-d's and chat's


# llm-d's precise prefix-cache routing benchmark (llm-d-benchmark profile
# guide_precise-prefix-cache-routing_1): 150 groups x 5 prompts, 6000-token shared context,
# 1200-token question, 1000 output tokens; a 15 req/s warm-up then a Poisson ladder 3 -> 60.
LLMD_STAGES = (
    "15x50/3x20/10x20/15x20/20x38/22x34/25x30/30x25/35x21/40x38/43x36/46x33/49x30/52x29/"
    "55x27/57x26/60x25"
)


class _Ids:
    def __init__(self) -> None:
        self.next_id = 0

    def take(self, count: int) -> list[int]:
        start = self.next_id
        self.next_id += count
        return list(range(start, start + count))


@dataclass(frozen=True, slots=True)
class SharedPrefixSpec:
    """Synthetic shared-prefix workload with the parameters of llm-d's published one.

    ``groups`` customers each have a ``context_tokens`` shared context; each of their
    ``users`` asks a ``question_tokens`` question (the same one every time, as
    inference-perf's ``shared_prefix`` data does, unless ``unique``) and gets ``output_tokens``.
    Requests pick a (group, user) uniformly at random.

    Arrivals: ``stages`` (``"RATExSECONDS/..."``, Poisson per stage) when given, else
    ``requests`` Poisson arrivals at ``rate`` (a linear ramp when ``rate_end`` is set).
    """

    groups: int = ranged(150, 20, 200, log=True)
    users: int = ranged(5, 2, 10)
    context_tokens: int = ranged(6000, 1000, 8000, log=True)
    question_tokens: int = ranged(1200, 100, 1500, log=True)
    output_tokens: int = ranged(1000, 100, 1000, log=True)
    requests: int = ranged(750, 500, 1500)
    rate: float = 10.0
    rate_end: float = 0.0
    stages: str = ""
    unique: bool = False
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    seed: int = 0

    def build(self, name: str = "shared-prefix") -> Trace:
        if min(self.groups, self.users, self.output_tokens, self.block_tokens) < 1:
            raise TraceError("shared-prefix: groups, users, output and block must be >= 1")
        if self.context_tokens < 0 or self.question_tokens < 1:
            raise TraceError("shared-prefix: context must be >= 0 and question >= 1")
        rng = random.Random(self.seed)
        if self.stages:
            times = staged_arrivals(rng, parse_stages(self.stages))
        else:
            if self.requests < 1:
                raise TraceError("shared-prefix: requests must be >= 1")
            times = poisson_arrivals(rng, self.requests, self.rate, self.rate_end or self.rate)
        size = self.block_tokens
        input_tokens = self.context_tokens + self.question_tokens
        num_shared = self.context_tokens // size  # a block straddling context and question
        num_blocks = -(-input_tokens // size)  # belongs to the question
        ids = _Ids()
        contexts = [ids.take(num_shared) for _ in range(self.groups)]
        questions: dict[tuple[int, int], list[int]] = {}
        requests = []
        for index, arrival_s in enumerate(times):
            group = rng.randrange(self.groups)
            user = rng.randrange(self.users)
            if self.unique:
                tail = ids.take(num_blocks - num_shared)
            else:
                tail = questions.get((group, user)) or questions.setdefault(
                    (group, user), ids.take(num_blocks - num_shared)
                )
            requests.append(
                TraceRequest(
                    index=index,
                    arrival_s=arrival_s,
                    input_tokens=input_tokens,
                    output_tokens=self.output_tokens,
                    hash_ids=contexts[group] + tail,
                    session=f"g{group}-u{user}",
                )
            )
        return Trace(name, size, requests, f"shared-prefix {self}")


@dataclass(frozen=True, slots=True)
class ChatSpec:
    """Synthetic multi-turn chat sessions.

    ``sessions`` conversations start as a Poisson process at ``rate`` per second; each has
    ``turns`` turns. Turn k's prompt is the session's system prompt (one of ``groups`` shared
    ones, ``system_tokens`` long), then every earlier user message and answer, then a new
    ``user_tokens`` message; it asks for ``output_tokens``. The next turn arrives an
    exponential think time (mean ``think_s``) after the previous one (open loop: a trace is a
    fixed schedule, as Mooncake's is).
    """

    sessions: int = ranged(200, 100, 200, log=True)
    turns: int = ranged(5, 3, 8)
    groups: int = ranged(4, 1, 8)
    system_tokens: int = ranged(1000, 200, 2000, log=True)
    user_tokens: int = ranged(200, 50, 500, log=True)
    output_tokens: int = ranged(200, 50, 500, log=True)
    think_s: float = ranged(10.0, 2.0, 30.0, log=True)
    rate: float = 2.0
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    seed: int = 0

    def build(self, name: str = "chat") -> Trace:
        if min(self.sessions, self.turns, self.groups, self.user_tokens, self.output_tokens) < 1:
            raise TraceError("chat: sessions, turns, groups, user and output must be >= 1")
        if self.system_tokens < 0 or self.think_s < 0 or self.rate <= 0:
            raise TraceError("chat: system and think must be >= 0, rate > 0")
        rng = random.Random(self.seed)
        size = self.block_tokens
        ids = _Ids()
        system = [ids.take(-(-self.system_tokens // size)) for _ in range(self.groups)]
        starts = poisson_arrivals(rng, self.sessions, self.rate, self.rate)
        rows: list[TraceRequest] = []
        for session, start_s in enumerate(starts):
            group = rng.randrange(self.groups)
            blocks = list(system[group])
            num_tokens = self.system_tokens
            arrival_s = start_s
            for _ in range(self.turns):
                blocks, num_tokens = _extend(blocks, num_tokens, self.user_tokens, size, ids)
                rows.append(
                    TraceRequest(
                        index=0,
                        arrival_s=arrival_s,
                        input_tokens=num_tokens,
                        output_tokens=self.output_tokens,
                        hash_ids=list(blocks),
                        session=f"s{session}",
                    )
                )
                blocks, num_tokens = _extend(blocks, num_tokens, self.output_tokens, size, ids)
                rows[-1].output_ids = list(blocks)
                arrival_s += rng.expovariate(1.0 / self.think_s) if self.think_s > 0 else 0.0
        return Trace(name, size, renumber_by_arrival(rows), f"chat {self}")


def _extend(
    blocks: list[int], num_tokens: int, added_tokens: int, size: int, ids: _Ids
) -> tuple[list[int], int]:
    """Append tokens to a block-id history; a partial last block changes content (new id)."""
    blocks = list(blocks)
    total = num_tokens + added_tokens
    if num_tokens % size:
        blocks[-1] = ids.take(1)[0]
    blocks.extend(ids.take(-(-total // size) - len(blocks)))
    return blocks, total


# -------------------------------------------------------- families built from segments


@dataclass(frozen=True, slots=True)
class ZipfPrefixSpec:
    """Shared-prefix groups with Zipf popularity and contexts of varied length.

    ``groups`` contexts (a customer's documents, a few-shot template) of log-uniform length in
    ``[context_min_tokens, context_max_tokens]``; group of popularity rank r is asked with
    weight ``(r + 1) ** -zipf_exponent``. Each group has ``users``, each with its own question
    (about ``question_tokens``, repeated on every ask, as llm-d's workload does); requests pick
    a user of the group uniformly and ask for about ``output_tokens``. Arrivals: Gamma gaps at
    ``rate`` with coefficient of variation ``arrival_cv``.

    Shape: a Zipf law is the usual model of skewed content popularity (S-LoRA draws adapters
    from one, arXiv:2311.03285; RAGCache measures retrieval skewed the same way,
    arXiv:2404.12457); the exponent range and the lengths are a synthetic assumption.
    """

    groups: int = ranged(48, 16, 128, log=True)
    zipf_exponent: float = ranged(1.0, 0.6, 1.4)
    users: int = ranged(8, 2, 16, log=True)
    context_min_tokens: int = ranged(1000, 300, 2000, log=True)
    context_max_tokens: int = ranged(8000, 4000, 16000, log=True)
    question_tokens: int = ranged(200, 50, 600, log=True)
    output_tokens: int = ranged(200, 50, 500, log=True)
    requests: int = ranged(1000, 500, 1500)
    arrival_cv: float = ranged(1.0, 1.0, 2.0)
    rate: float = 10.0
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    seed: int = 0

    def build(self, name: str = "zipf-prefix") -> Trace:
        family = "zipf-prefix"
        _require_at_least(
            family,
            1,
            groups=self.groups,
            users=self.users,
            context_min_tokens=self.context_min_tokens,
            question_tokens=self.question_tokens,
            output_tokens=self.output_tokens,
            requests=self.requests,
        )
        if self.context_max_tokens < self.context_min_tokens:
            raise TraceError(f"{family}: context_max_tokens must be >= context_min_tokens")
        _require_positive(family, rate=self.rate, arrival_cv=self.arrival_cv)
        rng = random.Random(self.seed)
        blocks = PrefixBlocks(self.block_tokens)
        contexts = [
            blocks.child(
                blocks.root,
                ("context", group),
                round(log_uniform(rng, self.context_min_tokens, self.context_max_tokens)),
            )
            for group in range(self.groups)
        ]
        weights = zipf_cum_weights(self.groups, self.zipf_exponent)
        questions: dict[tuple[int, int], PromptNode] = {}
        rows = []
        for arrival_s in gamma_arrivals(rng, self.requests, self.rate, self.arrival_cv):
            group = pick(rng, weights)
            user = rng.randrange(self.users)
            question = questions.get((group, user))
            if question is None:  # a user asks the same question every time
                question = questions[group, user] = blocks.unique(
                    contexts[group], around(rng, self.question_tokens)
                )
            ids, input_tokens = blocks.prompt(question)
            output_tokens = around(rng, self.output_tokens)
            session = f"g{group}-u{user}"
            rows.append(TraceRequest(0, arrival_s, input_tokens, output_tokens, ids, session))
        return Trace(name, self.block_tokens, renumber_by_arrival(rows), f"{family} {self}")


@dataclass(frozen=True, slots=True)
class LongDocQASpec:
    """Many short questions against a few huge documents, in bursts per document.

    A shared ``system_tokens`` instruction, then one of ``documents`` documents (log-uniform
    in ``[document_min_tokens, document_max_tokens]``; popularity Zipf with
    ``zipf_exponent``, 0 = uniform), then a fresh question of about ``question_tokens``;
    answers of about ``output_tokens``. Reading sessions start as a Poisson process at
    ``rate`` per second; each picks a document and asks ``questions_per_session`` questions on
    average (uniform in ``1 .. 2 * mean - 1``), an exponential ``think_s`` apart: a burst of
    requests sharing one long prefix.

    Shape: document QA as Preble studies it on LooGLE (Srivatsa et al., ICLR 2025,
    arXiv:2407.00023: 776 documents of over 24k tokens, about 8 questions each); session
    lengths and think times are a synthetic assumption.
    """

    documents: int = ranged(4, 2, 8)
    document_min_tokens: int = 16_000
    document_max_tokens: int = 64_000
    zipf_exponent: float = ranged(0.5, 0.0, 1.0)
    system_tokens: int = ranged(100, 50, 300, log=True)
    question_tokens: int = ranged(50, 20, 150, log=True)
    output_tokens: int = ranged(150, 50, 400, log=True)
    sessions: int = ranged(120, 60, 150)
    questions_per_session: float = ranged(6.0, 3.0, 10.0)
    think_s: float = ranged(8.0, 3.0, 20.0, log=True)
    rate: float = 1.0
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    seed: int = 0

    def build(self, name: str = "long-doc-qa") -> Trace:
        family = "long-doc-qa"
        _require_at_least(
            family,
            1,
            documents=self.documents,
            document_min_tokens=self.document_min_tokens,
            question_tokens=self.question_tokens,
            output_tokens=self.output_tokens,
            sessions=self.sessions,
            questions_per_session=self.questions_per_session,
        )
        _require_at_least(family, 0, system_tokens=self.system_tokens)
        if self.document_max_tokens < self.document_min_tokens:
            raise TraceError(f"{family}: document_max_tokens must be >= document_min_tokens")
        _require_positive(family, rate=self.rate, think_s=self.think_s)
        rng = random.Random(self.seed)
        blocks = PrefixBlocks(self.block_tokens)
        system = blocks.child(blocks.root, "system", self.system_tokens)
        documents = [
            blocks.child(
                system,
                ("document", document),
                round(log_uniform(rng, self.document_min_tokens, self.document_max_tokens)),
            )
            for document in range(self.documents)
        ]
        weights = zipf_cum_weights(self.documents, self.zipf_exponent)
        most_questions = max(1, round(2 * self.questions_per_session - 1))
        rows = []
        starts = poisson_arrivals(rng, self.sessions, self.rate, self.rate)
        for session, start_s in enumerate(starts):
            document = pick(rng, weights)
            arrival_s = start_s
            for _ in range(rng.randint(1, most_questions)):
                question = blocks.unique(documents[document], around(rng, self.question_tokens))
                ids, input_tokens = blocks.prompt(question)
                output_tokens = around(rng, self.output_tokens)
                rows.append(
                    TraceRequest(
                        0, arrival_s, input_tokens, output_tokens, ids, f"d{document}-s{session}"
                    )
                )
                arrival_s += rng.expovariate(1.0 / self.think_s)
        return Trace(name, self.block_tokens, renumber_by_arrival(rows), f"{family} {self}")


@dataclass(frozen=True, slots=True)
class AgenticSpec:
    """Tool loops: every call's prompt is the previous call's prompt, its answer and a tool's
    output.

    Sessions start as a Poisson process at ``rate`` per second. Each runs one of ``agents``
    agents (a system prompt with its tool schemas, about ``system_tokens``), gets a task of
    about ``task_tokens``, then makes ``min_turns .. max_turns`` model calls (uniform). Call k
    asks for a step of about ``step_output_tokens`` (a tool call or an answer); the tool's
    output (exponential, mean ``tool_output_tokens``, at most 8 means) is appended with the
    step before call k + 1, which arrives after the step's decode (``decode_s_per_token`` per
    token, an unloaded estimate) and the tool's run (exponential, mean ``tool_s``). A session
    stops early when the next call would pass ``max_context_tokens`` (agents compact or stop
    there). Each call's ``output_ids`` name the blocks its answer fills, which the next call
    starts with.

    Shape: coding-agent traces show long autonomous loops, long contexts with short outputs
    and heavy-tailed tool calls (TraceLab, Zhu et al., arXiv:2606.30560); Preble's agent
    workloads (ToolBench, ALFWorld) grow the prompt call by call. Sizes and times here are a
    synthetic assumption within those shapes.
    """

    sessions: int = ranged(48, 24, 64)
    min_turns: int = 5
    max_turns: int = 30
    agents: int = ranged(3, 1, 6)
    system_tokens: int = ranged(3000, 1000, 8000, log=True)
    task_tokens: int = ranged(300, 100, 1000, log=True)
    step_output_tokens: int = ranged(150, 50, 400, log=True)
    tool_output_tokens: int = ranged(600, 150, 2000, log=True)
    tool_s: float = ranged(2.0, 0.5, 6.0, log=True)
    decode_s_per_token: float = 0.02
    max_context_tokens: int = 100_000
    rate: float = 0.5
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    seed: int = 0

    def build(self, name: str = "agentic") -> Trace:
        family = "agentic"
        _require_at_least(
            family,
            1,
            sessions=self.sessions,
            min_turns=self.min_turns,
            agents=self.agents,
            system_tokens=self.system_tokens,
            task_tokens=self.task_tokens,
            step_output_tokens=self.step_output_tokens,
            tool_output_tokens=self.tool_output_tokens,
        )
        if self.max_turns < self.min_turns:
            raise TraceError(f"{family}: max_turns must be >= min_turns")
        _require_positive(
            family, rate=self.rate, tool_s=self.tool_s, max_context_tokens=self.max_context_tokens
        )
        _require_at_least(family, 0, decode_s_per_token=self.decode_s_per_token)
        rng = random.Random(self.seed)
        blocks = PrefixBlocks(self.block_tokens)
        agents = [
            blocks.child(blocks.root, ("agent", agent), around(rng, self.system_tokens, 0.25))
            for agent in range(self.agents)
        ]
        rows = []
        starts = poisson_arrivals(rng, self.sessions, self.rate, self.rate)
        for session, start_s in enumerate(starts):
            context = agents[rng.randrange(self.agents)]
            context = blocks.unique(context, around(rng, self.task_tokens))
            arrival_s = start_s
            for _ in range(rng.randint(self.min_turns, self.max_turns)):
                step_tokens = around(rng, self.step_output_tokens)
                if context.end_tokens + step_tokens > self.max_context_tokens:
                    break
                ids, input_tokens = blocks.prompt(context)
                answered = blocks.unique(context, step_tokens)
                output_ids, _ = blocks.prompt(answered)
                rows.append(
                    TraceRequest(
                        0,
                        arrival_s,
                        input_tokens,
                        step_tokens,
                        ids,
                        f"s{session}",
                        output_ids=output_ids,
                    )
                )
                context = blocks.unique(answered, heavy_tailed(rng, self.tool_output_tokens))
                arrival_s += step_tokens * self.decode_s_per_token
                arrival_s += rng.expovariate(1.0 / self.tool_s)
        return Trace(name, self.block_tokens, renumber_by_arrival(rows), f"{family} {self}")


@dataclass(frozen=True, slots=True)
class RagSpec:
    """Retrieval-augmented generation: a system prompt, retrieved chunks, a question.

    One ``system_tokens`` system prompt, then ``top_k`` distinct chunks of a pool of
    ``chunks`` (each about ``chunk_tokens``, fixed per chunk), drawn one after the other by
    Zipf popularity (``zipf_exponent``), so popular chunks tend to come first but the order
    varies; then a fresh question of about ``question_tokens``. The cacheable prefix is the
    system prompt plus whatever leading chunk sequence an earlier request had. Arrivals: Gamma
    gaps at ``rate`` with coefficient of variation ``arrival_cv``.

    Shape: RAGCache (Jin et al., arXiv:2404.12457) finds retrieval skewed toward a small share
    of documents and a chunk's KV reusable only behind the same preceding chunks (its
    knowledge tree); chunk sizes and k are common retriever settings, a synthetic assumption.
    """

    system_tokens: int = ranged(600, 200, 1500, log=True)
    chunks: int = ranged(300, 100, 1000, log=True)
    chunk_tokens: int = ranged(512, 256, 1024, log=True)
    top_k: int = ranged(5, 3, 8)
    zipf_exponent: float = ranged(1.0, 0.6, 1.2)
    question_tokens: int = ranged(60, 20, 200, log=True)
    output_tokens: int = ranged(200, 50, 500, log=True)
    requests: int = ranged(1000, 500, 1500)
    arrival_cv: float = ranged(1.0, 1.0, 2.0)
    rate: float = 10.0
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    seed: int = 0

    def build(self, name: str = "rag") -> Trace:
        family = "rag"
        _require_at_least(
            family,
            1,
            chunks=self.chunks,
            chunk_tokens=self.chunk_tokens,
            top_k=self.top_k,
            question_tokens=self.question_tokens,
            output_tokens=self.output_tokens,
            requests=self.requests,
        )
        _require_at_least(family, 0, system_tokens=self.system_tokens)
        if self.top_k > self.chunks:
            raise TraceError(f"{family}: top_k must be <= chunks")
        _require_positive(family, rate=self.rate, arrival_cv=self.arrival_cv)
        rng = random.Random(self.seed)
        blocks = PrefixBlocks(self.block_tokens)
        system = blocks.child(blocks.root, "system", self.system_tokens)
        chunk_lengths = [around(rng, self.chunk_tokens, 0.25) for _ in range(self.chunks)]
        weights = zipf_cum_weights(self.chunks, self.zipf_exponent)
        rows = []
        for arrival_s in gamma_arrivals(rng, self.requests, self.rate, self.arrival_cv):
            context = system
            for chunk in pick_distinct(rng, weights, self.top_k):
                context = blocks.child(context, ("chunk", chunk), chunk_lengths[chunk])
            question = blocks.unique(context, around(rng, self.question_tokens))
            ids, input_tokens = blocks.prompt(question)
            rows.append(
                TraceRequest(0, arrival_s, input_tokens, around(rng, self.output_tokens), ids)
            )
        return Trace(name, self.block_tokens, renumber_by_arrival(rows), f"{family} {self}")


@dataclass(frozen=True, slots=True)
class MixedSpec:
    """Short chat sessions mixed with long documents that share nothing.

    ``requests`` in all; a ``document_share`` of them are documents (log-uniform in
    ``[document_min_tokens, document_max_tokens]``, behind a short shared instruction of
    ``instruction_tokens``, answered with about ``document_output_tokens``), arriving as a
    Poisson process. The rest are chat sessions: one of ``chat_groups`` system prompts (about
    ``system_tokens``), then turns of about ``user_tokens`` and ``chat_output_tokens``;
    ``turns`` per session on average (uniform in ``1 .. 2 * turns - 1``), an exponential
    ``think_s`` apart, sessions starting as a Poisson process. ``rate`` is the overall
    request rate.

    Both streams are stationary over the same span: sessions start from well before the
    first document (a warm-up of ``4 * turns * think_s``), and the trace keeps the first chat
    turns from time 0 on, so sessions are already under way when it starts (a first kept turn
    carries its session's earlier turns, cached nowhere yet) and no session outlives the
    documents by much. Without the warm-up, sessions that start late keep sending turns long
    after the last document: in the matrix's 600-request draw the documents fell in the first
    quarter of the trace, at about four times its mean prefill load.

    Shape: production traffic mixes conversation with API and batch-like jobs of very
    different lengths (BurstGPT's conversation and API services, arXiv:2401.17644); the share
    and sizes are a synthetic assumption. Long unique prompts evict and occupy prefill, which
    is what a cache-affinity policy must tolerate.
    """

    requests: int = ranged(1000, 500, 1500)
    document_share: float = ranged(0.25, 0.1, 0.5)
    document_min_tokens: int = 4_000
    document_max_tokens: int = 32_000
    instruction_tokens: int = 32
    document_output_tokens: int = ranged(300, 100, 800, log=True)
    chat_groups: int = ranged(4, 1, 8)
    system_tokens: int = ranged(800, 200, 2000, log=True)
    user_tokens: int = ranged(150, 50, 400, log=True)
    chat_output_tokens: int = ranged(200, 50, 500, log=True)
    turns: float = ranged(4.0, 2.0, 8.0)
    think_s: float = ranged(15.0, 5.0, 60.0, log=True)
    rate: float = 8.0
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    seed: int = 0

    def build(self, name: str = "mixed") -> Trace:
        family = "mixed"
        _require_at_least(
            family,
            1,
            requests=self.requests,
            document_min_tokens=self.document_min_tokens,
            document_output_tokens=self.document_output_tokens,
            chat_groups=self.chat_groups,
            user_tokens=self.user_tokens,
            chat_output_tokens=self.chat_output_tokens,
            turns=self.turns,
        )
        _require_at_least(
            family, 0, instruction_tokens=self.instruction_tokens, system_tokens=self.system_tokens
        )
        _require_share(family, document_share=self.document_share)
        if self.document_max_tokens < self.document_min_tokens:
            raise TraceError(f"{family}: document_max_tokens must be >= document_min_tokens")
        _require_positive(family, rate=self.rate, think_s=self.think_s)
        rng = random.Random(self.seed)
        blocks = PrefixBlocks(self.block_tokens)
        num_documents = round(self.requests * self.document_share)
        num_chat = self.requests - num_documents
        rows: list[TraceRequest] = []
        systems = [
            blocks.child(blocks.root, ("system", group), around(rng, self.system_tokens, 0.25))
            for group in range(self.chat_groups)
        ]
        most_turns = max(1, round(2 * self.turns - 1))
        session_rate = self.rate * num_chat / self.requests / self.turns
        start_s = -4.0 * self.turns * self.think_s  # warm-up: sessions under way at time 0
        session = 0
        chat: list[TraceRequest] = []
        cutoff_s = math.inf  # the num_chat-th kept arrival, once there are that many
        while num_chat and start_s <= cutoff_s:
            start_s += rng.expovariate(session_rate)
            context = systems[rng.randrange(self.chat_groups)]
            arrival_s = start_s
            for _ in range(rng.randint(1, most_turns)):
                context = blocks.unique(context, around(rng, self.user_tokens))
                ids, input_tokens = blocks.prompt(context)
                output_tokens = around(rng, self.chat_output_tokens)
                context = blocks.unique(context, output_tokens)
                if arrival_s >= 0.0:
                    output_ids, _ = blocks.prompt(context)
                    chat.append(
                        TraceRequest(
                            0,
                            arrival_s,
                            input_tokens,
                            output_tokens,
                            ids,
                            f"chat{session}",
                            output_ids=output_ids,
                        )
                    )
                arrival_s += rng.expovariate(1.0 / self.think_s)
            session += 1
            if len(chat) >= num_chat:
                chat.sort(key=lambda r: r.arrival_s)
                del chat[num_chat:]
                cutoff_s = chat[-1].arrival_s
        rows.extend(chat)
        instruction = blocks.child(blocks.root, "instruction", self.instruction_tokens)
        document_rate = self.rate * self.document_share
        for arrival_s in (
            poisson_arrivals(rng, num_documents, document_rate, document_rate)
            if num_documents
            else []
        ):
            length = round(log_uniform(rng, self.document_min_tokens, self.document_max_tokens))
            ids, input_tokens = blocks.prompt(blocks.unique(instruction, length))
            output_tokens = around(rng, self.document_output_tokens)
            rows.append(TraceRequest(0, arrival_s, input_tokens, output_tokens, ids))
        return Trace(name, self.block_tokens, renumber_by_arrival(rows), f"{family} {self}")


@dataclass(frozen=True, slots=True)
class LoraSpec:
    """Many LoRA adapters over one base model, each with its own shared prefix.

    ``adapters`` adapters named ``lora-0``, ``lora-1``, ...; adapter of popularity rank r is
    named with weight ``(r + 1) ** -zipf_exponent``, and a ``base_share`` of requests name the
    base model instead. Every adapter (and the base model) has its own prompt prefix (its
    application's instructions, about ``prefix_tokens``, ±60%), followed by a fresh message of
    about ``user_tokens``; answers of about ``output_tokens``. Requests carry the adapter in
    :attr:`~kv_picker_bench.harness.trace_model.TraceRequest.lora`, and their block ids sit in
    the adapter's cache namespace, so adapters never share a block (vLLM hashes the adapter
    into every block). Arrivals: Gamma gaps at ``rate``, coefficient of variation
    ``arrival_cv``.

    Shape: S-LoRA's synthetic workloads (Sheng et al., MLSys 2024, arXiv:2311.03285) draw the
    adapter of each request from a power law and arrivals from a Gamma process with a varied
    ``cv``; the prefixes are a synthetic assumption.
    """

    adapters: int = ranged(24, 8, 64, log=True)
    zipf_exponent: float = ranged(1.0, 0.6, 1.4)
    base_share: float = ranged(0.1, 0.0, 0.25)
    prefix_tokens: int = ranged(1500, 500, 4000, log=True)
    user_tokens: int = ranged(200, 50, 600, log=True)
    output_tokens: int = ranged(150, 50, 400, log=True)
    requests: int = ranged(1000, 500, 1500)
    arrival_cv: float = ranged(1.0, 1.0, 2.0)
    rate: float = 10.0
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    seed: int = 0

    def build(self, name: str = "lora") -> Trace:
        family = "lora"
        _require_at_least(
            family,
            1,
            adapters=self.adapters,
            prefix_tokens=self.prefix_tokens,
            user_tokens=self.user_tokens,
            output_tokens=self.output_tokens,
            requests=self.requests,
        )
        _require_share(family, base_share=self.base_share)
        _require_positive(family, rate=self.rate, arrival_cv=self.arrival_cv)
        rng = random.Random(self.seed)
        blocks = PrefixBlocks(self.block_tokens)
        namespaces = CacheNamespaces()
        # The base model's prefix is the last entry, picked apart from the Zipf draw.
        names: list[str | None] = [f"lora-{adapter}" for adapter in range(self.adapters)]
        names.append(None)
        prefixes = [
            blocks.child(blocks.root, ("prefix", name), around(rng, self.prefix_tokens, 0.6))
            for name in names
        ]
        weights = zipf_cum_weights(self.adapters, self.zipf_exponent)
        rows = []
        for arrival_s in gamma_arrivals(rng, self.requests, self.rate, self.arrival_cv):
            choice = self.adapters if rng.random() < self.base_share else pick(rng, weights)
            lora = names[choice]
            message = blocks.unique(prefixes[choice], around(rng, self.user_tokens))
            ids, input_tokens = blocks.prompt(message)
            rows.append(
                TraceRequest(
                    0,
                    arrival_s,
                    input_tokens,
                    around(rng, self.output_tokens),
                    namespaces.apply(ids, lora, None),
                    lora=lora,
                )
            )
        return Trace(name, self.block_tokens, renumber_by_arrival(rows), f"{family} {self}")


@dataclass(frozen=True, slots=True)
class TenantsSpec:
    """Tenants sending the same system prompt, kept apart by their ``cache_salt``.

    ``tenants`` tenants salted ``tenant-0``, ``tenant-1``, ...; tenant of volume rank r sends
    with weight ``(r + 1) ** -zipf_exponent``. Every request is the one ``system_tokens``
    system prompt (the same text for every tenant: a shared product's instructions), then a
    fresh message of about ``user_tokens``; answers of about ``output_tokens``. Without the
    salt all tenants would share the system prompt's blocks; with it each tenant's are its
    own (the ids sit in the salt's cache namespace, the text stays the same). Arrivals: Gamma
    gaps at ``rate``, coefficient of variation ``arrival_cv``.

    Shape: a synthetic assumption; it tests that a router keys its prefix index by salt (vLLM
    folds ``cache_salt`` into block 0's hash, see its prefix-caching design notes) instead of
    sending every tenant to the endpoint that served the text first.
    """

    tenants: int = ranged(6, 2, 12)
    zipf_exponent: float = ranged(0.8, 0.0, 1.2)
    system_tokens: int = ranged(2000, 500, 6000, log=True)
    user_tokens: int = ranged(200, 50, 600, log=True)
    output_tokens: int = ranged(150, 50, 400, log=True)
    requests: int = ranged(1000, 500, 1500)
    arrival_cv: float = ranged(1.0, 1.0, 1.5)
    rate: float = 10.0
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    seed: int = 0

    def build(self, name: str = "tenants") -> Trace:
        family = "tenants"
        _require_at_least(
            family,
            1,
            tenants=self.tenants,
            system_tokens=self.system_tokens,
            user_tokens=self.user_tokens,
            output_tokens=self.output_tokens,
            requests=self.requests,
        )
        _require_positive(family, rate=self.rate, arrival_cv=self.arrival_cv)
        rng = random.Random(self.seed)
        blocks = PrefixBlocks(self.block_tokens)
        namespaces = CacheNamespaces()
        system = blocks.child(blocks.root, "system", self.system_tokens)
        salts = [f"tenant-{tenant}" for tenant in range(self.tenants)]
        weights = zipf_cum_weights(self.tenants, self.zipf_exponent)
        rows = []
        for arrival_s in gamma_arrivals(rng, self.requests, self.rate, self.arrival_cv):
            salt = salts[pick(rng, weights)]
            ids, input_tokens = blocks.prompt(blocks.unique(system, around(rng, self.user_tokens)))
            rows.append(
                TraceRequest(
                    0,
                    arrival_s,
                    input_tokens,
                    around(rng, self.output_tokens),
                    namespaces.apply(ids, None, salt),
                    salt=salt,
                )
            )
        return Trace(name, self.block_tokens, renumber_by_arrival(rows), f"{family} {self}")


# ---------------------------------------------------------------------------- registry


FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        Family(
            "shared-prefix",
            SharedPrefixSpec,
            "llm-d's shape: a shared context per group, a fixed question per user",
        ),
        Family(
            "chat", ChatSpec, "multi-turn chat sessions: shared system prompts, growing history"
        ),
        Family(
            "zipf-prefix",
            ZipfPrefixSpec,
            "shared-prefix groups with Zipf popularity and contexts of varied length",
        ),
        Family(
            "long-doc-qa",
            LongDocQASpec,
            "a few 16k-64k-token documents, bursts of short questions per document",
        ),
        Family(
            "agentic",
            AgenticSpec,
            "tool loops: each call is the previous call, its answer and a tool output",
        ),
        Family(
            "rag",
            RagSpec,
            "system prompt, top-k retrieved chunks in varying order (Zipf), a question",
        ),
        Family("mixed", MixedSpec, "short chat sessions mixed with long unique documents"),
        Family("lora", LoraSpec, "many LoRA adapters (Zipf popularity), each with its own prefix"),
        Family(
            "tenants",
            TenantsSpec,
            "tenants sending the same system prompt, kept apart by their cache_salt",
        ),
    )
}
"""The workload families a load matrix runs, by name (see the module docstring)."""

GENERATORS: dict[str, Family] = {
    "shared-prefix": FAMILIES["shared-prefix"],
    "llm-d": Family(
        "llm-d",
        SharedPrefixSpec,
        "llm-d's published shared-prefix workload and Poisson load ladder, as published",
        preset=(("stages", LLMD_STAGES),),
        randomized=False,
    ),
    **FAMILIES,
}
"""Every generator name ``--trace NAME:...`` accepts: the families and the ``llm-d`` preset."""

_SPEC_ALIASES = {
    "context": "context_tokens",
    "question": "question_tokens",
    "output": "output_tokens",
    "system": "system_tokens",
    "user": "user_tokens",
    "think": "think_s",
    "block": "block_tokens",
    "zipf": "zipf_exponent",
    "cv": "arrival_cv",
    "task": "task_tokens",
    "step": "step_output_tokens",
    "tool": "tool_output_tokens",
    "chunk": "chunk_tokens",
    "prefix": "prefix_tokens",
}


def build_generator(name: str, params_text: str) -> Trace:
    """A trace from a generator name and its ``key=value,...`` parameters.

    ``seed=N`` draws the family's ranged parameters from seed N; without it the documented
    defaults apply. Short aliases (``context``, ``zipf``, ``cv``, ...) stand for the long
    names.

    Raises:
        TraceError: An unknown generator or parameter, a bad value, or a value out of bounds.
    """
    family = GENERATORS.get(name)
    if family is None:
        raise TraceError(f"unknown generator {name!r}; generators: {', '.join(GENERATORS)}")
    kinds = family.parameters()
    values: dict[str, Any] = {}
    for item in filter(None, params_text.split(",")):
        key, eq, raw = item.partition("=")
        key = _SPEC_ALIASES.get(key.strip(), key.strip())
        if not eq or key not in kinds:
            aliases = {alias for alias, target in _SPEC_ALIASES.items() if target in kinds}
            known = sorted(set(kinds) | aliases)
            raise TraceError(f"{name}: unknown parameter {item!r}; known: {', '.join(known)}")
        values[key] = _parse_value(name, key, kinds[key], raw)
    seed = values.pop("seed", None)
    return family.build(seed, **values)


def _parse_value(name: str, key: str, kind: str, raw: str) -> Any:
    try:
        if kind == "bool":
            return raw.strip().lower() in ("1", "true", "yes")
        if kind == "int":
            return int(raw)
        if kind == "float":
            return float(raw)
    except ValueError:
        raise TraceError(f"{name}: parameter {key!r}: bad value {raw!r}") from None
    return raw


# ---------------------------------------------------------------------------- listing


def describe(name: str, seed: int | None = None) -> str:
    """A generator's parameters as text: default, the range a seed draws from, and the draw.

    Raises:
        TraceError: An unknown generator.
    """
    family = GENERATORS.get(name)
    if family is None:
        raise TraceError(f"unknown generator {name!r}; generators: {', '.join(GENERATORS)}")
    aliases = {target: alias for alias, target in _SPEC_ALIASES.items()}
    ranges = family.ranges()
    drawn = family.spec(seed) if seed is not None else None
    lines = [f"{family.name}: {family.description}"]
    for spec_field in dataclasses.fields(family.spec_type):
        if spec_field.name == "seed":
            continue
        label = spec_field.name
        if spec_field.name in aliases:
            label += f" ({aliases[spec_field.name]})"
        default = dict(family.preset).get(spec_field.name, spec_field.default)
        text = f"  {label:<28} {spec_field.type!s:<6} default {default!r}"
        span = ranges.get(spec_field.name)
        if span is not None:
            text += f", seed draws {span.low:g}..{span.high:g}" + (" (log)" if span.log else "")
        if drawn is not None:
            text += f"; seed {seed}: {getattr(drawn, spec_field.name)!r}"
        lines.append(text)
    return "\n".join(lines)


def main(argv: Sequence[str]) -> int:
    """``kv-picker bench families [NAME] [--seed N]``: lists the generators and parameters."""
    parser = argparse.ArgumentParser(
        prog="kv-picker bench families",
        description="The trace generators --trace NAME:KEY=VALUE,... accepts: every parameter "
        "with its default and the range 'seed=N' draws it from.",
    )
    parser.add_argument("name", nargs="?", help="one generator (default: all)")
    parser.add_argument("--seed", type=int, help="also show what this seed draws")
    args = parser.parse_args(list(argv))
    try:
        names = [args.name] if args.name else list(GENERATORS)
        print("\n\n".join(describe(name, args.seed) for name in names))
    except TraceError as exc:
        print(f"kv-picker bench families: error: {exc}", file=sys.stderr)
        return 2
    return 0
