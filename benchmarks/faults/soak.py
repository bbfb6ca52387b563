"""``kv-picker bench soak``: a long run that looks for slow leaks. Not part of the test suite.

A steady mixed load (repeated and unique prompts, streamed and not) through real Envoy and
kv-picker to four simulated endpoints, an endpoint restart every few minutes (round robin), a
config reload every minute (two valid configs in turn). Every few seconds it samples the
picker's RSS and open file descriptors (``/proc``), its asyncio task count and its prefix-index
size (``/metrics``: ``kv_picker_asyncio_tasks``, ``kv_picker_prefix_index_keys``).

Verdict: no series trends upward once warm. "Warm" is after the first quarter of the run (the
prefix index needs that long to reach its LRU bound); a trend is the median of the last quarter
of the warm samples minus the median of their first quarter, and must stay under a tolerance
per series:

```
RSS              2% of its warm mean (at least 1 MB)
open fds         3
asyncio tasks    3
index keys       5% of its warm mean (at least 100)
```

Writes ``soak.json`` (settings, samples, events, figures, verdict) and ``soak.png``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import yaml

from kv_picker_bench.faults import probes
from kv_picker_bench.faults.probes import MB
from kv_picker_bench.faults.suite import picker_config, stack
from kv_picker_bench.faults.traffic import (
    RequestFactory,
    ShotCounter,
    TrafficThread,
    mixed_requests,
    unique_requests,
)

SERIES = ("rss_mb", "open_fds", "asyncio_tasks", "index_keys")


@dataclass
class Sample:
    t_s: float
    rss_mb: float
    open_fds: int
    asyncio_tasks: float
    index_keys: float
    requests: int
    failed: int


def soak_requests(unique_share: float = 0.2) -> RequestFactory:
    """Mostly a finite set of shared-context requests, some unique prompts (the index fills)."""
    mixed, unique = mixed_requests(), unique_requests(seed=7)

    def request(i: int) -> tuple[str, dict[str, object]]:
        if random.Random(i).random() < unique_share:
            return unique(i)
        return mixed(i)

    return request


def trend(samples: Sequence[Sample], series: str) -> float:
    """Growth of ``series`` across ``samples``: the median of their last quarter minus the
    median of their first quarter (medians, because a count of open streams jumps from one
    sample to the next under load while a leak moves every quarter up)."""
    values = [float(getattr(s, series)) for s in samples]
    if len(values) < 4:
        return 0.0
    quarter = len(values) // 4
    return statistics.median(values[-quarter:]) - statistics.median(values[:quarter])


def tolerance(samples: Sequence[Sample], series: str) -> float:
    mean = statistics.fmean(float(getattr(s, series)) for s in samples)
    return {
        "rss_mb": max(0.02 * mean, 1.0),
        "open_fds": 3.0,
        "asyncio_tasks": 3.0,
        "index_keys": max(0.05 * mean, 100.0),
    }[series]


def judge(
    samples: Sequence[Sample], duration_s: float
) -> tuple[dict[str, object], dict[str, bool]]:
    """Figures of each series (start, once warm, max, end, warm trend) and the verdicts."""
    warm = [s for s in samples if s.t_s >= duration_s / 4]
    figures: dict[str, object] = {}
    verdicts: dict[str, bool] = {}
    for series in SERIES:
        growth = trend(warm, series)
        limit = tolerance(warm, series) if warm else 0.0
        figures[f"{series}_start"] = getattr(samples[0], series) if samples else None
        figures[f"{series}_warm"] = getattr(warm[0], series) if warm else None
        figures[f"{series}_max"] = max((getattr(s, series) for s in samples), default=None)
        figures[f"{series}_end"] = getattr(samples[-1], series) if samples else None
        figures[f"{series}_warm_trend"] = round(growth, 2)
        verdicts[f"{series}: no upward trend once warm (< {limit:.3g})"] = bool(warm) and (
            growth < limit
        )
    return figures, verdicts


def rejudge(path: Path) -> dict[str, object]:
    """Apply the current verdict to the samples of a written ``soak.json`` (rewritten)."""
    document: dict[str, object] = json.loads(path.read_text())
    samples = [Sample(**s) for s in document["samples"]]  # type: ignore[attr-defined]
    settings: dict[str, float] = document["settings"]  # type: ignore[assignment]
    figures, verdicts = judge(samples, settings["duration_s"])
    document["figures"] = {**document["figures"], **figures}  # type: ignore[dict-item]
    document["checks"] = verdicts
    document["passed"] = all(verdicts.values())
    path.write_text(json.dumps(document, indent=2) + "\n")
    return document


def picker_pids(pid: int) -> list[int]:
    """The picker's processes: ``pid``, and with ``serve --workers`` its workers (not the
    metrics scrape processes each runs)."""
    pids = [pid]
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return pids
    for child in map(int, children):
        try:
            argv = Path(f"/proc/{child}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"--worker" in argv:
            pids.append(child)
    return pids


def run(
    duration_s: float,
    out_dir: Path,
    connections: int = 8,
    rate_per_s: float = 100.0,
    restart_every_s: float = 180.0,
    reload_every_s: float = 60.0,
    sample_every_s: float = 5.0,
    lru_blocks: int = 4096,
    picker_args: Sequence[str] = (),
) -> dict[str, object]:
    configs = [picker_config(lru_blocks=lru_blocks), picker_config(lru_blocks=lru_blocks)]
    configs[1]["schedulingProfiles"][0]["plugins"][0]["weight"] = 2  # a real change to apply
    samples: list[Sample] = []
    events: list[tuple[float, str]] = []
    counter = ShotCounter()
    with stack(
        sims=4, config=configs[0], workdir_prefix="kv-picker-soak-", picker_args=picker_args
    ) as local:
        picker = local.picker
        assert picker is not None
        pid, port = picker.process.pid, local.picker_metrics_port
        path = local.workdir / "picker.yaml"
        traffic = TrafficThread(
            local.url,
            soak_requests(),
            connections,
            max_duration_s=duration_s + 60,
            rate_per_s=rate_per_s,
            counter=counter,
        ).start()
        started = time.monotonic()
        next_sample = next_restart = next_reload = 0.0
        next_restart, next_reload = restart_every_s, reload_every_s
        restarts = reloads = 0
        try:
            while (now := time.monotonic() - started) < duration_s:
                if now >= next_sample:
                    reading = probes.read_picker(port)
                    samples.append(
                        Sample(
                            round(now, 1),
                            round(sum(map(probes.rss_bytes, picker_pids(pid))) / MB, 2),
                            sum(map(probes.open_fds, picker_pids(pid))),
                            reading.value("kv_picker_asyncio_tasks"),
                            reading.total("kv_picker_prefix_index_keys"),
                            counter.sent,
                            counter.failed,
                        )
                    )
                    next_sample += sample_every_s
                if now >= next_restart:
                    index = restarts % len(local.sim_addresses)
                    events.append((round(now, 1), f"restart endpoint {index}"))
                    local.restart_sim(index, downtime_s=1.0)
                    restarts += 1
                    next_restart += restart_every_s
                if now >= next_reload:
                    reloads += 1
                    document = dict(configs[reloads % 2])
                    document["server"] = {
                        **document["server"],
                        **yaml.safe_load(path.read_text())["server"],
                    }
                    document["endpoints"] = yaml.safe_load(path.read_text())["endpoints"]
                    tmp = path.with_suffix(".tmp")
                    tmp.write_text(yaml.safe_dump(document, sort_keys=False))
                    tmp.replace(path)
                    events.append((round(now, 1), "reload"))
                    next_reload += reload_every_s
                time.sleep(0.2)
        finally:
            traffic.stop(120.0)
        final = probes.read_picker(port)
        # Every worker applies every reload; the merged counter sums them (and keeps what a
        # recycled worker had counted).
        workers = max(1, int(final.value("kv_picker_workers{state=up}") or 1))
        applied = final.value("kv_picker_config_reloads_total{result=applied}") / workers
        recycles = final.value("kv_picker_worker_recycles_total")
    figures: dict[str, object] = {
        "duration_s": duration_s,
        "requests": counter.sent,
        "served": counter.served,
        "failed": counter.failed,
        "endpoint_restarts": restarts,
        "reloads_written": reloads,
        "reloads_applied": int(applied),
        "worker_recycles": int(recycles),
    }
    series_figures, verdicts = judge(samples, duration_s)
    figures.update(series_figures)
    document = {
        "settings": {
            "duration_s": duration_s,
            "connections": connections,
            "rate_per_s": rate_per_s,
            "restart_every_s": restart_every_s,
            "reload_every_s": reload_every_s,
            "sample_every_s": sample_every_s,
            "lru_blocks_per_endpoint": lru_blocks,
            "endpoints": 4,
            "picker_args": list(picker_args),
        },
        "figures": figures,
        "checks": verdicts,
        "passed": all(verdicts.values()),
        "events": events,
        "samples": [asdict(s) for s in samples],
        "failures": [
            f"{s.kind} at {s.start_s - started:.1f}s: status {s.status} {s.error or s.reason}"
            for s in counter.failures[:20]
        ],
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "soak.json").write_text(json.dumps(document, indent=2) + "\n")
    plot(samples, events, out_dir / "soak.png", duration_s / 4)
    return document


def plot(
    samples: Sequence[Sample], events: Sequence[tuple[float, str]], path: Path, warm_s: float
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    titles = {
        "rss_mb": "picker RSS (MB)",
        "open_fds": "picker open fds",
        "asyncio_tasks": "picker asyncio tasks",
        "index_keys": "prefix index keys",
    }
    figure, axes = plt.subplots(len(SERIES), 1, figsize=(9, 9), sharex=True)
    minutes = [s.t_s / 60 for s in samples]
    for axis, series in zip(axes, SERIES, strict=True):
        axis.plot(minutes, [getattr(s, series) for s in samples], linewidth=1.2)
        axis.set_ylabel(titles[series], fontsize=8)
        axis.axvspan(0, warm_s / 60, color="0.92")
        for t_s, what in events:
            axis.axvline(t_s / 60, color="C3" if what.startswith("restart") else "C2", alpha=0.3)
        axis.grid(alpha=0.3)
    axes[-1].set_xlabel("minutes (grey: warm-up; red: endpoint restart; green: reload)")
    figure.suptitle("kv-picker soak")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kv-picker bench soak",
        description="Long run: steady mixed load, endpoint restarts, config reloads; samples the "
        "picker's RSS, open fds, asyncio tasks and index size; verdict: no upward trend once "
        "warm. Writes soak.json and soak.png.",
    )
    parser.add_argument("--duration-s", type=float, help="how long to run (required)")
    parser.add_argument(
        "--judge",
        type=Path,
        default=None,
        metavar="SOAK_JSON",
        help="do not run: apply the current verdict to the samples of a soak.json (rewritten)",
    )
    parser.add_argument("--out", type=Path, default=Path("soak-results"), help="output folder")
    parser.add_argument("--connections", type=int, default=8, help="client connections (8)")
    parser.add_argument("--rate", type=float, default=100.0, help="requests per second (100)")
    parser.add_argument(
        "--restart-every-s", type=float, default=180.0, help="endpoint restart period (180)"
    )
    parser.add_argument("--reload-every-s", type=float, default=60.0, help="reload period (60)")
    parser.add_argument("--sample-every-s", type=float, default=5.0, help="sample period (5)")
    parser.add_argument(
        "--workers",
        type=int,
        default=1,
        help="kv-picker serve --workers N (1); RSS and fds "
        "are then the supervisor's and the workers' together",
    )
    parser.add_argument(
        "--recycle-rss",
        type=float,
        default=0.0,
        metavar="MB",
        help="kv-picker serve --recycle-rss MB (with --workers 2 or more)",
    )
    args = parser.parse_args(argv)
    picker_args = ["--workers", str(args.workers)]
    if args.recycle_rss:
        picker_args += ["--recycle-rss", str(args.recycle_rss)]
    if args.judge is not None:
        document = rejudge(args.judge)
    elif args.duration_s is None:
        parser.error("--duration-s is required (or --judge)")
    elif args.duration_s <= 0 or args.connections < 1 or args.rate <= 0:
        parser.error("--duration-s, --connections and --rate must be positive")
    else:
        document = run(
            args.duration_s,
            args.out,
            args.connections,
            args.rate,
            args.restart_every_s,
            args.reload_every_s,
            args.sample_every_s,
            picker_args=picker_args,
        )
    print(json.dumps(document["figures"], indent=2))
    for check, ok in document["checks"].items():  # type: ignore[attr-defined]
        print(f"{'PASS' if ok else 'FAIL'}  {check}")
    return 0 if document["passed"] else 1
