"""``kv-picker tune``: search profile weights and scorer parameters on a trace; write the best.

A run replays a trace (a file, a generator spec, or a request log the service wrote, which is
Mooncake JSONL) through the offline cluster simulator once per *trial*: a candidate profile made
of a base profile and one value per dimension of a search space (:mod:`.space`). Optuna's TPE
sampler proposes the candidates; the best one is written as a complete EndpointPickerConfig.

```
trace ─> K time windows ─┬─ tuning windows ──> every trial replays its candidate on them
         (.windows)      │                      score = f(candidate, built-in default)
                         └─ held-out windows ─> the best candidate only, at the end
built-in default profile: replayed once on every window, kept in the study (the reference)
```

Objective (lower is better; the built-in default scores exactly 1). For each tuning window
``w``, with ``c`` the candidate's replay and ``d`` the built-in default's on the same window::

    ratio_w   = sqrt(c.ttft_mean / d.ttft_mean * c.ttft_p90 / d.ttft_p90)
    served_w  = min(c.output_tokens_per_s / d.output_tokens_per_s, c.ok / d.ok)
    penalty_w = ((1 - 0.01) / served_w) ** 10   if served_w < 1 - 0.01, else 1
    score     = geometric mean over w of ratio_w * penalty_w

so mean and tail TTFT count alike, every window counts alike whatever its size, and a
candidate that buys latency by serving fewer tokens per second (or shedding requests) pays
about 10% per extra 1% lost. TTFT statistics cover the requests served.

Evaluation is on held-out windows of the same trace (:mod:`.windows`: ``--windows 6`` of equal
duration, ``--held-out every:3`` by default), which the search never sees. Every window is
replayed on its own and starts cold: empty caches, nothing in flight, arrivals re-timed to
start at 0. The report puts the best trial's gain on the tuning windows next to its gain on the
held-out ones; a large gap means the search fitted the tuning windows rather than the workload.

Parallel and distributed: trials run in ``--workers`` processes (default: the CPU count), each
running ``study.optimize`` against one shared Optuna storage: a journal file in the output
folder by default, or ``--storage redis://HOST:PORT/DB`` (Optuna's Redis journal backend, on
the project's Redis/Valkey), where ``kv-picker tune --worker-only`` on other machines joins the
same ``--study``. Every process checks that the study was made for the same trace, windows,
cluster, base, space and seed (a fingerprint kept in the study) before it adds a trial.

Budget and resume: ``--trials`` is the total wanted in the study. A trial is run only while
fewer than that many trials are complete, running or queued before it; a worker that loses
the race for the last slot marks its trial pruned. Rerunning with the same storage and study
continues where the last run stopped. A trial whose worker died (killed, or its machine lost)
would count as running for ever: each trial records its worker and a heartbeat, and a running
trial whose worker is gone (a dead process on this machine, or no heartbeat for
``--stale-after`` seconds) is failed before new trials are counted, so its slot is run again.

Reproducibility: with ``--workers 1``, the same ``--seed`` and the same inputs give the same
trials, hence the same best parameters and the same ``tuned.yaml`` (the simulator is
deterministic under its seed, and so is a seeded TPE sampler given the same history). Parallel
workers each seed their sampler from ``--seed`` and their own index (a ``--worker-only``
process also from its host and process id, so machines do not propose the same candidates),
but trials finish in an order that depends on timing, and each proposal depends on the trials
finished before it: a parallel run finds comparable, not identical, results.

Outputs (``--out``): ``tuned.yaml``, ``report.md``, ``report.json``, ``command.txt`` and the
study's journal (``study.journal``, unless ``--storage`` names another place).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import multiprocessing
import os
import random
import re
import shlex
import socket
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
import redis
import yaml
from optuna.storages import BaseStorage, JournalStorage
from optuna.storages.journal import BaseJournalBackend, JournalFileBackend, JournalRedisBackend
from optuna.trial import FrozenTrial, TrialState

from kv_picker.config import API_VERSIONS, KIND, parse_config_text
from kv_picker.errors import ConfigError
from kv_picker.plugins import builtin_registry
from kv_picker_bench.harness.args import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    UsageError,
    add_cluster_arguments,
    add_trace_arguments,
    cluster_from_args,
    results_dir,
    trace_from_args,
)
from kv_picker_bench.harness.paths import portable_argv, portable_path, repository_root
from kv_picker_bench.harness.policies import Policy, harness_registry, pd_variant, resolve_policy
from kv_picker_bench.harness.report import cluster_json, describe_cluster, summarize, write_json
from kv_picker_bench.harness.simulator import OK, ClusterConfig
from kv_picker_bench.harness.space import (
    DEFAULT_SPACE,
    DEFAULT_SPACE_SOURCE,
    Dimension,
    FixedChooser,
    Space,
    load_space,
)
from kv_picker_bench.harness.traces import Trace, TraceError
from kv_picker_bench.harness.windows import (
    DEFAULT_HELD_OUT,
    Window,
    parse_held_out,
    split_windows,
)

DEFAULT_WINDOWS = 6
DEFAULT_TRIALS = 40
DEFAULT_STUDY = "tune"
DEFAULT_STALE_AFTER_S = 120.0
IDENTITY_GRACE_S = 10.0
"""A trial names its worker within milliseconds of its creation; a running trial still
nameless after this long lost its worker in between (e.g. killed right then)."""
JOURNAL_FILE = "study.journal"
REDIS_PREFIX = "kv-picker-tune"
"""Key prefix of the study's journal in Redis (the picker's own index uses ``kv-picker``)."""

THROUGHPUT_TOLERANCE = 0.01
PENALTY_EXPONENT = 10.0
OBJECTIVE_VERSION = 1
"""Changes when the score's definition changes: a study keeps scores of one definition only."""

REFERENCE = Policy("kv-picker", {}, "built-in default")
"""What every candidate is compared with: the service's built-in default profile."""

_REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
_SCORE_ATTR = "windows"  # trial user attribute: the candidate's result on each tuning window

# ------------------------------------------------------------------------------ replays


@dataclass(frozen=True, slots=True)
class WindowResult:
    """What one replay of one window produced, as the score and the report need it.

    Attributes:
        requests: Requests in the window.
        ok: Requests served.
        ttft_mean_s: Mean time to first token of the served requests.
        ttft_p90_s: Its 90th percentile (nearest rank).
        ttft_p99_s: Its 99th percentile.
        output_tokens_per_s: Output tokens of served requests over the replay's makespan.
        prompt_tokens: Prompt tokens of served requests.
        cached_tokens: Of those, tokens found in an endpoint's cache.
    """

    requests: int
    ok: int
    ttft_mean_s: float
    ttft_p90_s: float
    ttft_p99_s: float
    output_tokens_per_s: float
    prompt_tokens: int
    cached_tokens: int

    @property
    def hit_ratio(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> WindowResult:
        return cls(**{name: data[name] for name in cls.__slots__})


def replay_window(
    trace: Trace,
    cluster: ClusterConfig,
    policy: Policy,
    seed: int,
    pd_threshold: int | None,
) -> WindowResult:
    """Replays one window under one policy.

    Args:
        trace: The window's requests.
        cluster: The simulated cluster.
        policy: The policy (a candidate, or the reference).
        seed: Seed of the policy's tie-breaks.
        pd_threshold: Run the policy's P/D variant with this threshold; ``None`` for an
            aggregated cluster.

    Raises:
        ConfigError: If the policy's config is invalid.
    """
    if pd_threshold is not None:
        policy = pd_variant(policy, pd_threshold)
    result = policy.replay(trace, cluster, seed)
    metrics = summarize(result, cluster)
    served = [o for o in result.outcomes if o.status == OK]
    return WindowResult(
        requests=metrics.requests,
        ok=metrics.ok,
        ttft_mean_s=metrics.ttft_s["mean"],
        ttft_p90_s=metrics.ttft_s["p90"],
        ttft_p99_s=metrics.ttft_s["p99"],
        output_tokens_per_s=metrics.output_tokens_per_s,
        prompt_tokens=sum(o.prompt_tokens for o in served),
        cached_tokens=sum(o.cached_tokens for o in served),
    )


def _replay_job(
    job: tuple[Trace, ClusterConfig, Policy, int, int | None],
) -> WindowResult:
    return replay_window(*job)


def replay_many(
    windows: Sequence[Window],
    setup: TuneSetup,
    policy: Policy,
    processes: int,
) -> dict[int, WindowResult]:
    """Replays ``policy`` on each window, over up to ``processes`` worker processes.

    Returns:
        Window number -> result.
    """
    jobs = [(w.trace, setup.cluster, policy, setup.seed, setup.pd_threshold) for w in windows]
    if processes <= 1 or len(jobs) <= 1:
        results = [_replay_job(job) for job in jobs]
    else:
        # spawn, as the replay commands do: forking a process with threads is unsafe.
        context = multiprocessing.get_context("spawn")
        with context.Pool(min(processes, len(jobs))) as pool:
            results = pool.map(_replay_job, jobs, chunksize=1)
    return {w.number: r for w, r in zip(windows, results, strict=True)}


# ------------------------------------------------------------------------------ scoring


def _ratio(candidate: float, reference: float) -> float:
    """``candidate / reference``; infinite when either side has no finite positive value."""
    if not (math.isfinite(candidate) and math.isfinite(reference)) or reference <= 0:
        return math.inf
    return candidate / reference


def window_score(candidate: WindowResult, reference: WindowResult) -> float:
    """One window's factor of the objective (see the module docstring)."""
    if candidate.ok == 0:
        return math.inf
    latency = math.sqrt(
        _ratio(candidate.ttft_mean_s, reference.ttft_mean_s)
        * _ratio(candidate.ttft_p90_s, reference.ttft_p90_s)
    )
    served = min(
        _ratio(candidate.output_tokens_per_s, reference.output_tokens_per_s),
        candidate.ok / reference.ok if reference.ok else 1.0,
    )
    floor = 1.0 - THROUGHPUT_TOLERANCE
    penalty = (floor / served) ** PENALTY_EXPONENT if served < floor else 1.0
    return latency * penalty


def _geometric_mean(values: Iterable[float]) -> float:
    values = list(values)
    if not values:
        return math.nan
    if any(v == math.inf for v in values):
        return math.inf
    if any(not v > 0 for v in values):
        return math.nan
    return math.exp(sum(math.log(v) for v in values) / len(values))


def score(candidate: Mapping[int, WindowResult], reference: Mapping[int, WindowResult]) -> float:
    """The objective: geometric mean of :func:`window_score` over the candidate's windows."""
    return _geometric_mean(window_score(candidate[n], reference[n]) for n in candidate)


@dataclass(frozen=True, slots=True)
class Gain:
    """A candidate against the reference on a group of windows.

    Ratios are geometric means over the windows of candidate / reference (below 1 is lower
    for the candidate); hit ratios are pooled over the windows' prompt tokens.
    """

    windows: tuple[int, ...]
    requests: int
    score: float
    ttft_mean: float
    ttft_p90: float
    ttft_p99: float
    throughput: float
    hit_ratio: float
    reference_hit_ratio: float
    ok: int
    reference_ok: int

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__}


def gain(candidate: Mapping[int, WindowResult], reference: Mapping[int, WindowResult]) -> Gain:
    """How ``candidate`` compares with ``reference`` on the windows ``candidate`` covers."""
    numbers = tuple(sorted(candidate))
    pairs = [(candidate[n], reference[n]) for n in numbers]

    def ratio(name: str) -> float:
        return _geometric_mean(_ratio(getattr(c, name), getattr(r, name)) for c, r in pairs)

    def pooled(results: Iterable[WindowResult]) -> float:
        results = list(results)
        prompt = sum(r.prompt_tokens for r in results)
        return sum(r.cached_tokens for r in results) / prompt if prompt else 0.0

    return Gain(
        windows=numbers,
        requests=sum(r.requests for _, r in pairs),
        score=score(candidate, reference),
        ttft_mean=ratio("ttft_mean_s"),
        ttft_p90=ratio("ttft_p90_s"),
        ttft_p99=ratio("ttft_p99_s"),
        throughput=ratio("output_tokens_per_s"),
        hit_ratio=pooled(c for c, _ in pairs),
        reference_hit_ratio=pooled(r for _, r in pairs),
        ok=sum(c.ok for c, _ in pairs),
        reference_ok=sum(r.ok for _, r in pairs),
    )


# ------------------------------------------------------------------------------ the setup


@dataclass(frozen=True)
class TuneSetup:
    """Everything a worker needs to run trials; sent to spawned workers as is.

    Attributes:
        windows: Every window of the trace, tuning and held out.
        cluster: The simulated cluster.
        space: The base profile and the dimensions that vary it.
        seed: Seed of the simulated policies and of the samplers.
        pd_threshold: Replay P/D variants with this threshold; ``None`` when aggregated.
        storage: The storage spec: a journal file's path, or a Redis URL.
        study: The study's name.
        trials: Total trials wanted in the study.
        stale_after_s: A running trial without a heartbeat for this long is taken as dead.
        quiet: No progress lines.
        fingerprint: Digest of everything that makes results comparable (see
            :func:`setup_record`).
    """

    windows: tuple[Window, ...]
    cluster: ClusterConfig
    space: Space
    seed: int
    pd_threshold: int | None
    storage: str
    study: str
    trials: int
    stale_after_s: float
    quiet: bool
    fingerprint: str

    @property
    def tuning(self) -> tuple[Window, ...]:
        return tuple(w for w in self.windows if not w.held_out)

    @property
    def held_out(self) -> tuple[Window, ...]:
        return tuple(w for w in self.windows if w.held_out)


def _trace_digest(trace: Trace) -> str:
    """Digest of the requests themselves (two files of one name may differ)."""
    digest = hashlib.sha256()
    for r in trace.requests:
        digest.update(
            json.dumps(
                [r.arrival_s, r.input_tokens, r.output_tokens, r.hash_ids, r.output_ids]
            ).encode()
        )
    return digest.hexdigest()


def setup_record(
    trace: Trace,
    windows: Sequence[Window],
    cluster: ClusterConfig,
    space: Space,
    seed: int,
    pd_threshold: int | None,
) -> dict[str, Any]:
    """What makes two runs' trials comparable, as plain data; kept in the study.

    Its ``fingerprint`` digests the rest: a worker refuses to add trials to a study whose
    fingerprint differs from its own.
    """
    record: dict[str, Any] = {
        "objective": OBJECTIVE_VERSION,
        "trace": {**trace.summary(), "digest": _trace_digest(trace)},
        "windows": [
            {
                "number": w.number,
                "start_s": round(w.start_s, 6),
                "end_s": round(w.end_s, 6),
                "requests": len(w.trace.requests),
                "held_out": w.held_out,
            }
            for w in windows
        ],
        "cluster": cluster_json(cluster),
        "base": dict(space.base),
        "space": space.describe(),
        "seed": seed,
        "pd_threshold": pd_threshold,
    }
    text = json.dumps(_comparable(record), sort_keys=True, default=str)
    record["fingerprint"] = hashlib.sha256(text.encode()).hexdigest()[:16]
    return record


def _comparable(record: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a setup record that must match: machines may name one trace differently
    (its path, how it was sliced), so the trace counts by its content alone."""
    trace = {k: v for k, v in record["trace"].items() if k not in ("name", "source", "notes")}
    return {**{k: v for k, v in record.items() if k != "fingerprint"}, "trace": trace}


# ------------------------------------------------------------------------------ storage


def open_storage(spec: str) -> BaseStorage:
    """The Optuna storage a ``--storage`` value names.

    Args:
        spec: ``redis://HOST:PORT/DB`` (also ``rediss://``, ``unix://``), or a journal file's
            path.

    Raises:
        UsageError: For another kind of URL.
    """
    if spec.startswith(_REDIS_SCHEMES):
        with warnings.catch_warnings():
            # Optuna still labels the Redis journal experimental; the warning says nothing
            # a user of this command can act on.
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            backend: BaseJournalBackend = JournalRedisBackend(spec, prefix=REDIS_PREFIX)
    elif re.match(r"^[A-Za-z][A-Za-z0-9+.-]*://", spec):
        raise UsageError(
            f"--storage {spec!r}: expected redis://HOST:PORT/DB or the path of a journal file"
        )
    else:
        path = Path(spec)
        path.parent.mkdir(parents=True, exist_ok=True)
        backend = JournalFileBackend(str(path))
    return JournalStorage(backend)


def shown_storage(spec: str) -> str:
    """The storage spec as reports show it: a URL without its password, a file's path as
    :func:`~.paths.portable_path` records it."""
    if spec.startswith(_REDIS_SCHEMES):
        return re.sub(r"://[^@/]*@", "://", spec)
    return portable_path(spec)


def _quiet_optuna() -> None:
    # Optuna logs every trial at INFO; the workers print their own, shorter lines.
    optuna.logging.set_verbosity(optuna.logging.WARNING)


def _startup_trials(trials: int) -> int:
    """Random trials before TPE models the results: a third of the budget, 4 to 10."""
    return min(10, max(4, trials // 3))


def make_sampler(seed: int, trials: int) -> optuna.samplers.TPESampler:
    """A seeded TPE sampler; ``constant_liar`` keeps parallel workers off each other's points."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        return optuna.samplers.TPESampler(
            seed=seed, n_startup_trials=_startup_trials(trials), constant_liar=True
        )


def host_id() -> str:
    """This machine: its host name, and its boot id where Linux has one (names can repeat)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text(encoding="ascii").strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot[:8]}" if boot else socket.gethostname()


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int):
        return True  # not ours to judge: the heartbeat decides
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def fail_stale_trials(study: optuna.Study, storage: BaseStorage, stale_after_s: float) -> int:
    """Fails running trials whose worker is gone (see the module docstring).

    Returns:
        How many trials were failed.
    """
    now = time.time()
    host = host_id()
    study_id = storage.get_study_id_from_name(study.study_name)
    failed = 0
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        attrs = trial.user_attrs
        started = trial.datetime_start.timestamp() if trial.datetime_start else now
        if "heartbeat" in attrs:
            silent_s = now - float(attrs["heartbeat"])
            gone = attrs.get("host") == host and not _alive(attrs.get("pid"))
        else:
            silent_s = now - started
            gone = silent_s > min(IDENTITY_GRACE_S, stale_after_s)
        if not gone and silent_s <= stale_after_s:
            continue
        trial_id = storage.get_trial_id_from_study_id_trial_number(study_id, trial.number)
        try:
            storage.set_trial_user_attr(trial_id, "note", "its worker stopped; run again")
            storage.set_trial_state_values(trial_id, TrialState.FAIL)
        except optuna.exceptions.UpdateFinishedTrialError:
            continue  # it finished meanwhile, or another worker failed it first
        failed += 1
    return failed


_COUNTED = (TrialState.COMPLETE, TrialState.RUNNING, TrialState.WAITING)


def remaining_trials(study: optuna.Study, total: int) -> int:
    """Trials still to start for the study to hold ``total`` complete, running or queued."""
    return total - len(study.get_trials(deepcopy=False, states=_COUNTED))


# ------------------------------------------------------------------------------ trials


class TrialChooser:
    """Candidate values from an Optuna trial (the :class:`~.space.Chooser` of a search).

    Args:
        trial: The trial to suggest values in.
    """

    def __init__(self, trial: optuna.Trial) -> None:
        self.trial = trial

    def enabled(self, dimension: Dimension) -> bool:
        return bool(self.trial.suggest_categorical(dimension.enabled_name, (True, False)))

    def value(self, dimension: Dimension) -> Any:
        trial = self.trial
        if dimension.choices is not None:
            return trial.suggest_categorical(dimension.name, dimension.choices)
        assert dimension.low is not None and dimension.high is not None  # a range
        if dimension.integer:
            return trial.suggest_int(
                dimension.name,
                int(dimension.low),
                int(dimension.high),
                step=int(dimension.step or 1),
                log=dimension.log,
            )
        return trial.suggest_float(
            dimension.name, dimension.low, dimension.high, step=dimension.step, log=dimension.log
        )


class _Heartbeat:
    """Marks a trial alive every ``interval_s`` from a thread, while the trial runs."""

    def __init__(self, trial: optuna.Trial, interval_s: float) -> None:
        self._trial = trial
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tune-heartbeat", daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                self._trial.set_user_attr("heartbeat", time.time())
            except Exception:
                # A storage hiccup must not end the trial; a missed beat only risks the trial
                # being failed as stale after --stale-after seconds.
                continue

    def __enter__(self) -> _Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()


class Objective:
    """One trial: build the candidate, replay it on the tuning windows, score it.

    Args:
        setup: The run's setup.
        storage: The study's storage (to fail trials whose worker is gone).
        reference: The built-in default's result on every window.
        worker: This worker's name in the trial history (``host:pid``).
    """

    def __init__(
        self,
        setup: TuneSetup,
        storage: BaseStorage,
        reference: Mapping[int, WindowResult],
        worker: str,
    ) -> None:
        self.setup = setup
        self.storage = storage
        self.reference = reference
        self.worker = worker
        self._host = host_id()

    def __call__(self, trial: optuna.Trial) -> float:
        setup = self.setup
        for key, value in (
            ("worker", self.worker),
            ("host", self._host),
            ("pid", os.getpid()),
            ("heartbeat", time.time()),
        ):
            trial.set_user_attr(key, value)
        study = trial.study
        # A dead worker's trial would hold its slot for ever: fail it before counting.
        fail_stale_trials(study, self.storage, setup.stale_after_s)
        earlier = [
            t for t in study.get_trials(deepcopy=False, states=_COUNTED) if t.number < trial.number
        ]
        if len(earlier) >= setup.trials:
            trial.set_user_attr("note", "over the trial budget: another worker took the slot")
            raise optuna.TrialPruned()
        with _Heartbeat(trial, min(30.0, setup.stale_after_s / 4)):
            document, _ = setup.space.build(TrialChooser(trial))
            policy = Policy(f"trial-{trial.number}", document, "tune")
            results = {
                w.number: replay_window(
                    w.trace, setup.cluster, policy, setup.seed, setup.pd_threshold
                )
                for w in setup.tuning
            }
        trial.set_user_attr(_SCORE_ATTR, {str(n): r.to_json() for n, r in results.items()})
        return score(results, self.reference)


class _AfterTrial:
    """Prints a line per trial and stops the worker when the budget is spent.

    Args:
        setup: The run's setup.
        storage: The study's storage.
        parent: The process that started this worker, if it is a spawned local worker: when
            it is gone (killed), the worker stops after its trial instead of running on.
    """

    def __init__(self, setup: TuneSetup, storage: BaseStorage, parent: int | None) -> None:
        self.setup = setup
        self.storage = storage
        self.parent = parent

    def __call__(self, study: optuna.Study, trial: FrozenTrial) -> None:
        if not self.setup.quiet:
            shown = "-" if trial.value is None else f"{trial.value:.4f}"
            worker = trial.user_attrs.get("worker", "?")
            print(
                f"trial {trial.number} ({worker}): {trial.state.name.lower()}, score {shown}",
                file=sys.stderr,
                flush=True,
            )
        orphaned = self.parent is not None and os.getppid() != self.parent
        fail_stale_trials(study, self.storage, self.setup.stale_after_s)
        if orphaned or remaining_trials(study, self.setup.trials) <= 0:
            study.stop()


def _worker_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def run_worker(setup: TuneSetup, index: int, salted: bool, parent: int | None = None) -> None:
    """One worker: runs trials until the study holds ``setup.trials`` of them.

    Args:
        setup: The run's setup.
        index: The worker's index on this machine (part of its sampler's seed).
        salted: Also seed the sampler from this host and process (``--worker-only``).
        parent: See :class:`_AfterTrial`.
    """
    _quiet_optuna()
    storage = open_storage(setup.storage)
    seed = setup.seed + index
    if salted:
        seed = random.Random(f"{setup.seed}:{index}:{_worker_name()}").getrandbits(31)
    study = optuna.load_study(
        study_name=setup.study, storage=storage, sampler=make_sampler(seed, setup.trials)
    )
    reference = _stored_reference(study)
    assert reference is not None  # the process that started this worker stored it
    objective = Objective(setup, storage, reference, _worker_name())
    after_trial = _AfterTrial(setup, storage, parent)
    while True:
        fail_stale_trials(study, storage, setup.stale_after_s)
        if remaining_trials(study, setup.trials) <= 0:
            return
        try:
            study.optimize(
                objective,
                callbacks=[after_trial],
                # An invalid candidate (a value the plugin's own checks refuse together with
                # another) fails its trial; the search goes on.
                catch=(ConfigError,),
            )
            return  # stopped by after_trial: the budget is spent
        except optuna.exceptions.UpdateFinishedTrialError:
            # Another worker took this one's trial for dead (no heartbeat for --stale-after
            # seconds) and failed it; the result is lost, its slot is run again.
            continue


def _spawned_worker(setup: TuneSetup, index: int, salted: bool, parent: int) -> None:
    try:
        run_worker(setup, index, salted, parent)
    except KeyboardInterrupt:
        sys.exit(EXIT_FAILURE)  # Ctrl-C reaches every worker; the coordinator reports it


def run_workers(setup: TuneSetup, workers: int, salted: bool) -> None:
    """Runs ``workers`` workers: in this process for one, else in spawned processes.

    Raises:
        RuntimeError: If a worker process failed.
    """
    if workers <= 1:
        run_worker(setup, 0, salted)
        return
    context = multiprocessing.get_context("spawn")
    processes = [
        context.Process(
            target=_spawned_worker,
            args=(setup, index, salted, os.getpid()),
            name=f"tune-worker-{index}",
        )
        for index in range(workers)
    ]
    for process in processes:
        process.start()
    try:
        for process in processes:
            process.join()
    finally:
        for process in processes:
            if process.is_alive():
                process.terminate()
                process.join(10)
    failed = [p.exitcode for p in processes if p.exitcode]
    if failed:
        raise RuntimeError(f"{len(failed)} of {workers} workers failed (exit codes {failed})")


# ------------------------------------------------------------------------------ the study


def _stored_reference(study: optuna.Study) -> dict[int, WindowResult] | None:
    stored = study.user_attrs.get("reference")
    if stored is None:
        return None
    return {int(n): WindowResult.from_json(r) for n, r in stored.items()}


def open_study(
    storage: BaseStorage, setup: TuneSetup, record: Mapping[str, Any], enqueue_base: bool
) -> optuna.Study:
    """Creates the study, or joins it after checking it was made for the same setup.

    A new study gets the setup record and, when the base profile lies inside the space and
    ``enqueue_base`` is set, the base as its first trial (so the search starts from it, and
    the best trial is never worse than the base on the tuning windows).

    Raises:
        UsageError: If the study exists for another setup.
    """
    study = optuna.create_study(
        study_name=setup.study,
        storage=storage,
        sampler=make_sampler(setup.seed, setup.trials),
        direction="minimize",
        load_if_exists=True,
    )
    stored = study.user_attrs.get("setup")
    if stored is None:
        if study.get_trials(deepcopy=False):
            raise UsageError(
                f"--study {setup.study}: the study exists and was not made by kv-picker tune"
            )
        study.set_user_attr("setup", dict(record))
        if enqueue_base and setup.space.base_values is not None:
            study.enqueue_trial(dict(setup.space.base_values), skip_if_exists=True)
    elif stored.get("fingerprint") != setup.fingerprint:
        mine, theirs = _plain(_comparable(record)), _comparable(stored)
        differs = [k for k in mine if theirs.get(k) != mine[k]]
        raise UsageError(
            f"study {setup.study!r} in {shown_storage(setup.storage)} was made for another "
            f"setup (differs in: {', '.join(differs) or 'details'}); use another --study "
            "(or --out), or the same trace, windows, cluster, base, space and seed"
        )
    return study


def _plain(value: Any) -> Any:
    """``value`` as it reads back from the study's JSON (tuples become lists)."""
    return json.loads(json.dumps(value, default=str))


def ensure_reference(
    study: optuna.Study, setup: TuneSetup, processes: int, log: Callable[[str], None]
) -> dict[int, WindowResult]:
    """The built-in default's result on every window: from the study, else replayed now."""
    reference = _stored_reference(study)
    if reference is None:
        log(f"reference: the built-in default profile on {len(setup.windows)} windows")
        reference = replay_many(setup.windows, setup, REFERENCE, processes)
        study.set_user_attr("reference", {str(n): r.to_json() for n, r in reference.items()})
    return reference


# ------------------------------------------------------------------------------ results


@dataclass(frozen=True)
class Outcome:
    """The run's result: the best trial and how it fares on both groups of windows.

    Attributes:
        best: The best complete trial.
        document: Its complete EndpointPickerConfig (what ``tuned.yaml`` holds).
        tuning: Its gain over the built-in default on the tuning windows.
        held_out: The same on the held-out windows.
        per_window: Its result on every window.
        reference: The built-in default's result on every window.
        trials: Every trial of the study, in order.
    """

    best: FrozenTrial
    document: dict[str, Any]
    tuning: Gain
    held_out: Gain
    per_window: dict[int, WindowResult]
    reference: dict[int, WindowResult]
    trials: list[FrozenTrial]


def evaluate_best(
    study: optuna.Study,
    setup: TuneSetup,
    reference: Mapping[int, WindowResult],
    processes: int,
) -> Outcome:
    """Replays the best trial's candidate on the held-out windows and compares both groups.

    Raises:
        RuntimeError: If no trial completed.
    """
    trials = study.get_trials(deepcopy=False)
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    if not complete:
        raise RuntimeError(f"no trial of study {setup.study!r} completed; see the errors above")
    best = study.best_trial
    document = tuned_document(setup, best.params)
    tuning = {int(n): WindowResult.from_json(r) for n, r in best.user_attrs[_SCORE_ATTR].items()}
    policy = Policy(f"trial-{best.number}", setup.space.build(FixedChooser(best.params))[0])
    held = replay_many(setup.held_out, setup, policy, processes)
    return Outcome(
        best=best,
        document=document,
        tuning=gain(tuning, reference),
        held_out=gain(held, reference),
        per_window={**tuning, **held},
        reference=dict(reference),
        trials=trials,
    )


def tuned_document(setup: TuneSetup, params: Mapping[str, Any]) -> dict[str, Any]:
    """The complete EndpointPickerConfig of a trial's parameters (its P/D variant under P/D)."""
    document, _ = setup.space.build(FixedChooser(params))
    if setup.pd_threshold is not None:
        document = dict(pd_variant(Policy("tuned", document), setup.pd_threshold).document)
    head = {
        "apiVersion": document.get("apiVersion", API_VERSIONS[0]),
        "kind": document.get("kind", KIND),
    }
    return {**head, **{k: v for k, v in document.items() if k not in head}}


def _change(ratio: float) -> str:
    if not math.isfinite(ratio):
        return "–"
    return f"{(ratio - 1) * 100:+.1f}%".replace("-", "−")


def _numbers(windows: Sequence[int]) -> str:
    return ", ".join(map(str, windows))


def _value(value: Any) -> str:
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))  # 16384.0 -> 16384, not 1.638e+04
        return f"{value:.4g}"
    return str(value)


def summary_lines(outcome: Outcome, setup: TuneSetup) -> list[str]:
    """The summary the command prints and ``report.md`` opens with (Markdown)."""
    tuning, held = outcome.tuning, outcome.held_out
    complete = sum(t.state == TrialState.COMPLETE for t in outcome.trials)
    base = setup.space.base_values or {}
    lines = [
        f"Best trial: {outcome.best.number} of {complete} complete, score "
        f"{outcome.best.value:.4f} (the built-in default scores 1; lower is better).",
        "",
        f"| vs the built-in default | tuning windows ({_numbers(tuning.windows)}) "
        f"| held-out windows ({_numbers(held.windows)}) |",
        "|---|---:|---:|",
        f"| score | {tuning.score:.4f} | {held.score:.4f} |",
        f"| TTFT mean | {_change(tuning.ttft_mean)} | {_change(held.ttft_mean)} |",
        f"| TTFT p90 | {_change(tuning.ttft_p90)} | {_change(held.ttft_p90)} |",
        f"| TTFT p99 | {_change(tuning.ttft_p99)} | {_change(held.ttft_p99)} |",
        f"| output throughput | {_change(tuning.throughput)} | {_change(held.throughput)} |",
        f"| token hit ratio | {tuning.reference_hit_ratio:.3f} → {tuning.hit_ratio:.3f} "
        f"| {held.reference_hit_ratio:.3f} → {held.hit_ratio:.3f} |",
        f"| requests served | {tuning.reference_ok:,} → {tuning.ok:,} of {tuning.requests:,} "
        f"| {held.reference_ok:,} → {held.ok:,} of {held.requests:,} |",
        "",
        "| parameter | best | base |",
        "|---|---:|---:|",
    ]
    for name, value in outcome.best.params.items():
        lines.append(f"| {name} | {_value(value)} | {_value(base.get(name, '–'))} |")
    return lines


def tuned_yaml(outcome: Outcome, setup: TuneSetup, trace: Mapping[str, Any]) -> str:
    """``tuned.yaml``'s text: the best config under a comment saying where it came from."""
    tuning, held = outcome.tuning, outcome.held_out
    header = [
        "# EndpointPickerConfig written by kv-picker tune: best trial "
        f"{outcome.best.number}, score {outcome.best.value:.4f} vs the built-in default's 1.",
        f"# Trace {trace['name']} ({trace['source']}), {trace['requests']} requests in "
        f"{len(setup.windows)} windows: tuned on {_numbers(tuning.windows)}, held out "
        f"{_numbers(held.windows)}.",
        "# TTFT mean / p90 / p99 vs the built-in default, tuning | held-out windows: "
        f"{_change(tuning.ttft_mean)} / {_change(tuning.ttft_p90)} / {_change(tuning.ttft_p99)}"
        f" | {_change(held.ttft_mean)} / {_change(held.ttft_p90)} / {_change(held.ttft_p99)}.",
        "# Details: report.md next to this file.",
    ]
    return "\n".join(header) + "\n" + yaml.safe_dump(outcome.document, sort_keys=False)


def _trial_states(trials: Sequence[FrozenTrial]) -> dict[str, int]:
    return {s.name.lower(): sum(t.state == s for t in trials) for s in TrialState}


def report_markdown(
    outcome: Outcome,
    setup: TuneSetup,
    trace: Mapping[str, Any],
    command: str,
    summary: str,
    note: str,
) -> str:
    """``report.md``: the setup, the summary, then every window and every trial."""
    tuning, held = outcome.tuning, outcome.held_out
    states = _trial_states(outcome.trials)
    span_s = setup.windows[-1].end_s - setup.windows[0].start_s
    lines = [
        f"# Tuning on {trace['name']}",
        "",
        f"Command: `{command}`",
        "",
        f"Trace: {trace['name']} ({trace['source']}), {trace['requests']:,} requests over "
        f"{span_s:,.0f} s, cut into {len(setup.windows)} windows of "
        f"{span_s / len(setup.windows):,.0f} s; tuned on windows {_numbers(tuning.windows)} "
        f"({tuning.requests:,} requests), held out {_numbers(held.windows)} "
        f"({held.requests:,} requests). Each window is replayed on its own, starting cold "
        "(empty caches, nothing in flight).",
        "",
        f"Cluster: {describe_cluster(setup.cluster)}"
        f"{'; P/D' if setup.pd_threshold is not None else ''}.",
        "",
        f"Base: {setup.space.base_source}. Space: {setup.space.source}, "
        f"{len(setup.space.dimensions)} dimensions. Study {setup.study!r} in "
        f"{shown_storage(setup.storage)}: "
        + ", ".join(f"{n} {s}" for s, n in states.items() if n)
        + f"; seed {setup.seed}.",
        "",
        "Score: the geometric mean over the tuning windows of sqrt(TTFT mean ratio × TTFT p90 "
        "ratio) against the built-in default profile, times (0.99 / served)^10 where served, "
        "the lower of the output-throughput and requests-served ratios, is below 0.99. The "
        "built-in default scores 1; lower is better.",
        "",
        "## Best trial",
        "",
        summary,
        "",
        "`tuned.yaml` holds its complete config: `kv-picker serve --config tuned.yaml`, or "
        "`kv-picker bench replay --policy tuned=tuned.yaml` to compare it with the baselines.",
    ]
    if note:
        lines += ["", note]
    lines += [
        "",
        "## Per window",
        "",
        "| window | span s | requests | held out | TTFT mean s (default → best) "
        "| TTFT p90 s | output tok/s | hit ratio |",
        "|---:|---|---:|---|---|---|---|---|",
    ]
    for window in setup.windows:
        best, ref = outcome.per_window[window.number], outcome.reference[window.number]
        lines.append(
            f"| {window.number} | {window.start_s:,.0f}–{window.end_s:,.0f} | {best.requests:,} "
            f"| {'yes' if window.held_out else ''} "
            f"| {ref.ttft_mean_s:.3f} → {best.ttft_mean_s:.3f} "
            f"| {ref.ttft_p90_s:.3f} → {best.ttft_p90_s:.3f} "
            f"| {ref.output_tokens_per_s:,.0f} → {best.output_tokens_per_s:,.0f} "
            f"| {ref.hit_ratio:.3f} → {best.hit_ratio:.3f} |"
        )
    lines += ["", "## Trials", "", "| trial | state | score | worker | s | parameters |"]
    lines.append("|---:|---|---:|---|---:|---|")
    for trial in outcome.trials:
        shown = "" if trial.value is None else f"{trial.value:.4f}"
        params = ", ".join(f"{k}={_value(v)}" for k, v in trial.params.items())
        seconds = trial.duration.total_seconds() if trial.duration else math.nan
        lines.append(
            f"| {trial.number} | {trial.state.name.lower()} | {shown} "
            f"| {trial.user_attrs.get('worker', '')} | {seconds:.1f} | {params} |"
        )
    return "\n".join(lines) + "\n"


def report_json(
    outcome: Outcome, setup: TuneSetup, record: Mapping[str, Any], command: str
) -> dict[str, Any]:
    """``report.json``: the figures of ``report.md``, every window and every trial."""
    return {
        "command": command,
        "setup": dict(record),
        "study": {
            "name": setup.study,
            "storage": shown_storage(setup.storage),
            **_trial_states(outcome.trials),
        },
        "objective": {
            "version": OBJECTIVE_VERSION,
            "throughput_tolerance": THROUGHPUT_TOLERANCE,
            "penalty_exponent": PENALTY_EXPONENT,
        },
        "best": {
            "trial": outcome.best.number,
            "score": outcome.best.value,
            "params": outcome.best.params,
            "base_params": dict(setup.space.base_values or {}),
            "tuning": outcome.tuning.to_json(),
            "held_out": outcome.held_out.to_json(),
        },
        "windows": {
            str(w.number): {
                "held_out": w.held_out,
                "best": outcome.per_window[w.number].to_json(),
                "reference": outcome.reference[w.number].to_json(),
            }
            for w in setup.windows
        },
        "trials": [
            {
                "number": t.number,
                "state": t.state.name.lower(),
                "score": t.value,
                "params": t.params,
                "worker": t.user_attrs.get("worker"),
                "seconds": t.duration.total_seconds() if t.duration else None,
                "note": t.user_attrs.get("note"),
            }
            for t in outcome.trials
        ],
        "complete": sum(t.state == TrialState.COMPLETE for t in outcome.trials),
    }


def write_outputs(
    folder: Path, outcome: Outcome, setup: TuneSetup, record: Mapping[str, Any], command: str
) -> str:
    """Writes ``tuned.yaml``, ``report.md`` and ``report.json``; returns the summary."""
    trace = record["trace"]
    text = tuned_yaml(outcome, setup, trace)
    (folder / "tuned.yaml").write_text(text, encoding="utf-8")
    try:
        parse_config_text(text, builtin_registry(), source="tuned.yaml")
        note = ""
    except ConfigError as exc:
        note = (
            f"Note: the service refuses tuned.yaml as it is ({exc}): its base uses plugins "
            "only the benchmark harness has."
        )
    summary = "\n".join(summary_lines(outcome, setup))
    markdown = report_markdown(outcome, setup, trace, command, summary, note)
    (folder / "report.md").write_text(markdown, encoding="utf-8")
    write_json(folder / "report.json", report_json(outcome, setup, record, command))
    return summary + (f"\n\n{note}" if note else "")


# ------------------------------------------------------------------------------ command


def build_parser() -> argparse.ArgumentParser:
    """The flags of ``kv-picker tune``."""
    parser = argparse.ArgumentParser(
        prog="kv-picker tune",
        description="Search profile weights and scorer parameters by replaying a trace "
        "offline, judge the best on held-out time windows of the same trace, and write it as "
        "a complete EndpointPickerConfig (tuned.yaml).",
    )
    add_trace_arguments(parser)
    add_cluster_arguments(parser)
    group = parser.add_argument_group("search")
    group.add_argument(
        "--trials",
        type=int,
        default=DEFAULT_TRIALS,
        help=f"total trials wanted in the study, earlier runs' included ({DEFAULT_TRIALS})",
    )
    group.add_argument(
        "--windows",
        type=int,
        default=DEFAULT_WINDOWS,
        metavar="K",
        help=f"cut the trace into K time windows of equal duration ({DEFAULT_WINDOWS})",
    )
    group.add_argument(
        "--held-out",
        default=DEFAULT_HELD_OUT,
        metavar="RULE",
        help="windows kept out of tuning, for evaluation: every:N (windows N, 2N, ...), "
        f"last:N, or numbers such as 3,6 ({DEFAULT_HELD_OUT})",
    )
    group.add_argument(
        "--base",
        type=Path,
        metavar="FILE.yaml",
        help="EndpointPickerConfig with one scheduling profile to start from "
        "(default: the built-in default profile)",
    )
    group.add_argument(
        "--space",
        type=Path,
        metavar="FILE.yaml",
        help="search space file (default: the built-in one; see --print-space)",
    )
    group.add_argument(
        "--print-space", action="store_true", help="print the built-in search space and exit"
    )
    group.add_argument(
        "--seed", type=int, default=0, help="seed of the sampler and the simulated policies (0)"
    )
    group = parser.add_argument_group("workers and storage")
    group.add_argument(
        "--workers",
        type=int,
        default=os.cpu_count() or 1,
        help="worker processes on this machine (default: the CPU count)",
    )
    group.add_argument(
        "--storage",
        metavar="URL|FILE",
        help=f"Optuna storage: redis://HOST:PORT/DB, or a journal file (default: OUT/{JOURNAL_FILE})",
    )
    group.add_argument(
        "--study", default=DEFAULT_STUDY, help=f"study name in the storage ({DEFAULT_STUDY})"
    )
    group.add_argument(
        "--worker-only",
        action="store_true",
        help="only run trials in the study (another machine's kv-picker tune writes the report)",
    )
    group.add_argument(
        "--stale-after",
        type=float,
        default=DEFAULT_STALE_AFTER_S,
        metavar="SECONDS",
        help="fail a running trial with no heartbeat for this long, so it is run again "
        f"({DEFAULT_STALE_AFTER_S:g})",
    )
    group = parser.add_argument_group("output")
    group.add_argument("--out", type=Path, help="results folder (default: results/<time>-tune-...)")
    group.add_argument("--quiet", action="store_true", help="no progress lines")
    return parser


def _check_flags(args: argparse.Namespace) -> None:
    for flag, value in (("--trials", args.trials), ("--workers", args.workers)):
        if value < 1:
            raise UsageError(f"{flag} must be >= 1")
    if not args.stale_after > 0:
        raise UsageError("--stale-after must be > 0")
    if args.worker_only and args.storage is None and args.out is None:
        raise UsageError("--worker-only needs the study's --storage (or the --out it is in)")


def _base(path: Path | None) -> tuple[dict[str, Any], str]:
    """The base document and where it came from (validated against the harness registry)."""
    if path is None:
        return {}, "built-in default"
    policy = resolve_policy(f"base={path}")
    if policy.pd_parameters:
        raise UsageError(
            f"--base {path}: pdParameters (per-side P/D parameters) are not tuned; "
            "the tuner builds one parameter set for both sides; drop them from the base"
        )
    policy.config(harness_registry())
    return dict(policy.document), str(path)


def _space(path: Path | None, base: Mapping[str, Any], base_source: str) -> Space:
    registry = harness_registry()
    if path is None:
        return load_space(DEFAULT_SPACE, DEFAULT_SPACE_SOURCE, base, base_source, registry)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read the search space: {exc.strerror or exc}") from exc
    return load_space(text, str(path), base, base_source, registry)


def _command_line(argv: Sequence[str]) -> str:
    return "kv-picker " + shlex.join(["tune", *portable_argv(argv)])


def tune(argv: Sequence[str]) -> int:
    """``kv-picker tune``'s body; raises the harness's errors (see :func:`main`)."""
    if "--print-space" in argv:  # before parsing: it needs none of the required flags
        print(DEFAULT_SPACE, end="")
        return EXIT_OK
    args = build_parser().parse_args(list(argv))
    _check_flags(args)

    def log(message: str) -> None:
        if not args.quiet:
            print(f"tune: {message}", file=sys.stderr, flush=True)

    base, base_source = _base(args.base)
    space = _space(args.space, base, base_source)
    cluster = cluster_from_args(args)
    trace = trace_from_args(args, load=args.load)
    try:
        held_out = parse_held_out(args.held_out, args.windows)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    windows = split_windows(trace, args.windows, held_out)
    folder: Path | None = None
    if not args.worker_only or args.storage is None:
        folder = results_dir(args, "tune", trace.name)
    storage_spec = args.storage or str(Path(folder or ".") / JOURNAL_FILE)
    pd_threshold = args.pd_threshold_tokens if args.pd else None
    record = setup_record(trace, windows, cluster, space, args.seed, pd_threshold)
    setup = TuneSetup(
        windows=tuple(windows),
        cluster=cluster,
        space=space,
        seed=args.seed,
        pd_threshold=pd_threshold,
        storage=storage_spec,
        study=args.study,
        trials=args.trials,
        stale_after_s=args.stale_after,
        quiet=args.quiet,
        fingerprint=record["fingerprint"],
    )
    _quiet_optuna()
    storage = open_storage(storage_spec)
    study = open_study(storage, setup, record, enqueue_base=True)
    log(
        f"{len(trace.requests):,} requests in {len(windows)} windows (held out: "
        f"{_numbers(sorted(held_out))}), {len(cluster.endpoints)} endpoints, "
        f"{len(space.dimensions)} dimensions; study {args.study!r} in "
        f"{shown_storage(storage_spec)}"
    )
    reference = ensure_reference(study, setup, args.workers, log)
    fail_stale_trials(study, storage, setup.stale_after_s)
    remaining = remaining_trials(study, setup.trials)
    if remaining > 0:
        log(f"{remaining} trial(s) to run on {min(args.workers, remaining)} worker(s)")
        run_workers(setup, min(args.workers, remaining), salted=args.worker_only)
    if args.worker_only:
        done = sum(
            t.user_attrs.get("host") == host_id()
            for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
        )
        complete = len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)))
        print(f"tune: study {args.study!r} holds {complete} complete trials, {done} from this host")
        return EXIT_OK
    assert folder is not None
    command = _command_line(argv)
    where = "the repository root" if repository_root() else "the working directory of the run"
    (folder / "command.txt").write_text(
        f"{command}\n# paths are relative to {where}\n", encoding="utf-8"
    )
    log(f"best trial on the {len(setup.held_out)} held-out window(s)")
    outcome = evaluate_best(study, setup, reference, args.workers)
    print(write_outputs(folder, outcome, setup, record, command))
    print(f"\nresults: {folder} (tuned.yaml, report.md, report.json)")
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """``kv-picker tune``: returns the exit code.

    Exit codes: 0 success; 1 a runtime failure (a worker failed, the storage is out of reach,
    no trial completed, Ctrl-C); 2 a bad flag, trace, config or space file, or a study made
    for another setup.
    """
    arguments = list(sys.argv[1:] if argv is None else argv)
    try:
        return tune(arguments)
    except (UsageError, TraceError, ConfigError) as exc:
        print(f"kv-picker tune: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except (RuntimeError, redis.RedisError, OSError) as exc:
        print(f"kv-picker tune: failed: {exc}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return EXIT_FAILURE
