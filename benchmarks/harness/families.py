"""Workload families: synthetic trace generators whose parameters a seed draws from ranges.

Why families and not one trace: a routing default that wins on one workload can lose on the
next (a cache-affinity policy shines on shared prefixes and hot-spots on skewed ones), so a
default has to be judged over many kinds of traffic. A family is one *kind* (a shape of
sharing, of sizes and of arrivals); a seed picks one concrete member of it: sizes, counts and
popularity skew are drawn from documented ranges, the rest is fixed, and explicit values
override any of them::

    FAMILIES["chat"].build(3)                 # seed 3: every ranged parameter drawn
    FAMILIES["chat"].build(3, turns=4)        # the same draw, turns forced (others unchanged)
    FAMILIES["chat"].build(None)              # the documented defaults, nothing drawn
    --trace chat:seed=3,turns=4               # the same from the command line

Draws come from their own generator (seeded with the family's name and the seed), so forcing
one parameter never shifts another; the spec's ``seed`` then seeds everything the build
samples (arrivals, picks, lengths). A family sets the *shape* of its arrivals (Poisson,
sessions with think times) and a base rate.

=============  ============================================================  ================
family         what is shared                                                 arrivals
=============  ============================================================  ================
shared-prefix  a context per group, a fixed question per user (llm-d)         Poisson
chat           a system prompt per group, then each session's history         sessions, think
=============  ============================================================  ================

Each spec lists its parameters with the range a seed draws them from (``ranged(default, low,
high)``; ``log`` ranges are drawn log-uniformly).
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field
from typing import Any, Protocol

from kv_picker_bench.harness.synthesis import (
    log_uniform,
    parse_stages,
    poisson_arrivals,
    staged_arrivals,
)
from kv_picker_bench.harness.trace_model import (
    DEFAULT_BLOCK_TOKENS,
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
        # Rounded so that a drawn spec reads well in reports and its repr round-trips.
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
