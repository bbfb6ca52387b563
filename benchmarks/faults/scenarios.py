"""Scenarios that hurt the stack from the outside: load, kills, reloads, floods, outages.

Each takes the suite's :class:`~kv_picker_bench.faults.suite.Sizes` and returns a
:class:`~kv_picker_bench.faults.report.ScenarioResult`; each starts its own stack, so one
scenario's damage never explains another's figures.
"""

from __future__ import annotations

import json
import signal
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import yaml

from kv_picker.wire import DESTINATION_HEADER
from kv_picker_bench.faults import probes
from kv_picker_bench.faults.probes import MB
from kv_picker_bench.faults.report import ScenarioResult
from kv_picker_bench.faults.suite import MAX_BODY_BYTES, Sizes, picker_config, scenario, stack
from kv_picker_bench.faults.traffic import (
    Shot,
    TrafficThread,
    failure_examples,
    mixed_requests,
    summarise,
    unique_requests,
)
from kv_picker_bench.localstack import LocalStack, ManagedProcess

# The picker's default scrape interval (metrics.scrapeInterval).
SCRAPE_INTERVAL_S = 0.1
# A request slower than this while something is down counts as a hang.
HANG_S = 10.0
# How long Envoy takes to see a SIGKILLed picker gone: the process dies a few milliseconds after
# the signal, and requests whose ext_proc stream opened before Envoy saw its connection close
# (and its next connection refused) were in flight at the kill as far as Envoy can tell. In
# FULL_DUPLEX_STREAMED mode Envoy has handed their bodies to the dead stream: they get a 500
# even with failure_mode_allow.
DETECTION_S = 0.05


def _picker(stack_: LocalStack) -> ManagedProcess:
    assert stack_.picker is not None
    return stack_.picker


def _note_failures(result: ScenarioResult, shots: Sequence[Shot]) -> None:
    examples = failure_examples(shots)
    if examples:
        result.notes.append("failed requests, e.g.: " + " | ".join(examples))


# -- load ---------------------------------------------------------------------------------------


def load(sizes: Sizes) -> ScenarioResult:
    """N mixed requests at 64 connections; RSS from the end of the warm-up (10%) to the end."""
    with scenario("load") as result, stack(sims=4) as local:
        picker = _picker(local)
        total = sizes.load_requests
        warm = max(total // 10, 100)
        traffic = TrafficThread(
            local.url, mixed_requests(), sizes.load_connections, total, 60 + total * 0.05
        ).start()
        rss_warm = 0
        started = time.monotonic()
        while traffic.running and time.monotonic() - started < 60 + total * 0.05:
            if not rss_warm and len(traffic.shots) >= warm:
                rss_warm = probes.rss_bytes(picker.process.pid)
            time.sleep(0.1)
        wall_s = time.monotonic() - started
        shots = traffic.stop()
        rss_end = probes.rss_bytes(picker.process.pid)
        settle_s = probes.wait_in_flight_zero(local.picker_metrics_port)
        reading = probes.read_picker(local.picker_metrics_port)
        summary = summarise(shots)
        growth = 100.0 * (rss_end - rss_warm) / rss_warm if rss_warm else float("nan")
        result.figures.update(
            requests=summary.requests,
            connections=sizes.load_connections,
            served=summary.served,
            documented_errors=summary.documented_errors,
            failed=summary.failed,
            requests_per_s=round(summary.requests / wall_s, 1),
            p50_ms=round(summary.p50_ms, 1),
            p99_ms=round(summary.p99_ms, 1),
            rss_after_warmup_mb=round(rss_warm / MB, 1),
            rss_end_mb=round(rss_end / MB, 1),
            rss_growth_pct=round(growth, 1),
            in_flight_after=probes.in_flight(reading),
        )
        result.check("every request was sent", summary.requests == total)
        result.check("no request failed (served or a documented error)", summary.failed == 0)
        result.check("RSS growth after warm-up < 10%", rss_warm > 0 and growth < 10.0)
        result.check("in-flight gauges back to 0", settle_s is not None)
        _note_failures(result, shots)
    return result


# -- endpoint kill ------------------------------------------------------------------------------


def endpoint_kill(sizes: Sizes) -> ScenarioResult:
    """SIGKILL one of three endpoints under load, restart it after a while, see it rejoin."""
    with scenario("endpoint-kill") as result, stack(sims=3) as local:
        victim = local.sim_addresses[0]
        with TrafficThread(local.url, mixed_requests(), sizes.kill_connections) as traffic:
            time.sleep(1.0)
            killed_s = time.monotonic()
            local.sim_process(0).kill(signal.SIGKILL)
            time.sleep(sizes.kill_downtime_s)
            restarted_s = time.monotonic()
            local.start_sim_again(0)
            healthy_s = time.monotonic()
            rejoined = probes.wait_for(
                lambda: any(s.served_by == victim and s.start_s > healthy_s for s in traffic.shots),
                15.0,
            )
            time.sleep(0.3)
            shots = traffic.stop()
        failed = [s for s in shots if s.failed]
        last_failure_s = max((s.start_s - killed_s for s in failed), default=0.0)
        first_back = min(
            (s.end_s for s in shots if s.served_by == victim and s.start_s > restarted_s),
            default=float("nan"),
        )
        window_s = 2 * SCRAPE_INTERVAL_S
        result.figures.update(
            requests=len(shots),
            failed=len(failed),
            failed_before_kill=sum(1 for s in failed if s.end_s < killed_s),
            last_failure_started_after_kill_s=round(last_failure_s, 3),
            scrape_interval_s=SCRAPE_INTERVAL_S,
            restart_to_healthy_s=round(healthy_s - restarted_s, 2),
            restart_to_first_served_s=round(first_back - restarted_s, 2),
        )
        result.check(
            "failures only among requests started within two scrape intervals of the kill",
            all(-HANG_S < s.start_s - killed_s <= window_s for s in failed),
        )
        result.check("the restarted endpoint serves again", rejoined is not None)
        result.check("no request hung", all(s.latency_s < HANG_S for s in shots))
        _note_failures(result, shots)
    return result


# -- picker kill and SIGTERM --------------------------------------------------------------------


def picker_kill(sizes: Sizes) -> ScenarioResult:
    """SIGKILL the picker under load (FailClose: Envoy answers 5xx), restart it, time the first
    served request; then SIGTERM it with long streams in flight: they must all complete."""
    with scenario("picker-kill") as result, stack(sims=2) as local:
        with TrafficThread(local.url, mixed_requests(), sizes.kill_connections) as traffic:
            time.sleep(1.0)
            killed_s = time.monotonic()
            _picker(local).kill(signal.SIGKILL)
            time.sleep(sizes.kill_downtime_s)
            restarted_s = time.monotonic()
            local.start_picker()
            back = probes.wait_for(
                lambda: any(s.ok and s.start_s > restarted_s for s in traffic.shots), 15.0
            )
            time.sleep(0.3)
            shots = traffic.stop()
        down = [s for s in shots if killed_s + 0.2 < s.start_s and s.end_s < restarted_s]
        first_ok = min((s.end_s for s in shots if s.ok and s.start_s > restarted_s), default=0.0)
        result.figures.update(
            requests=len(shots),
            requests_while_down=len(down),
            served_while_down=sum(1 for s in down if s.ok),
            max_latency_while_down_ms=round(max((s.latency_s for s in down), default=0) * 1e3, 1),
            restart_to_first_served_s=round(first_ok - restarted_s, 2) if first_ok else -1.0,
        )
        result.check("no request hung", all(s.latency_s < HANG_S for s in shots))
        result.check(
            "while the picker is down, 5xx at once (< 1 s)",
            bool(down) and all(s.status >= 500 and s.latency_s < 1.0 for s in down),
        )
        result.check("serves again after a restart", back is not None)

        # SIGTERM with long streams in flight: the picker stops taking new streams and lets the
        # open ones finish (the response path runs through it) before it exits.
        port = local.picker_metrics_port
        probes.wait_in_flight_zero(port)  # the load's last slots are released first
        drain = TrafficThread(local.url, long_streams(), 8, total=8, timeout_s=30.0).start()
        probes.wait_for(lambda: probes.in_flight(probes.read_picker(port)) >= 8, 5.0)
        term_s = time.monotonic()
        exit_code = _picker(local).kill(signal.SIGTERM, timeout_s=30.0)  # drainTimeout 20 s
        exit_s = time.monotonic() - term_s
        drain.wait(30.0)
        streams = drain.stop()
        in_flight_at_term = [s for s in streams if s.start_s < term_s < s.end_s]
        result.figures.update(
            sigterm_streams_in_flight=len(in_flight_at_term),
            sigterm_streams_completed=sum(1 for s in in_flight_at_term if s.ok),
            sigterm_exit_s=round(exit_s, 2),
            sigterm_exit_code=-1 if exit_code is None else exit_code,
        )
        result.check("SIGTERM found streams in flight", len(in_flight_at_term) >= 4)
        result.check(
            "SIGTERM drains: every stream in flight completes",
            all(s.ok for s in in_flight_at_term),
        )
        result.check("SIGTERM: the picker exits cleanly", exit_code == 0)
        _note_failures(result, [s for s in streams if s in in_flight_at_term])
    return result


def long_streams() -> Callable[[int], tuple[str, dict[str, object]]]:
    """Streamed completions that take about a second at the suite's time scale."""

    def request(i: int) -> tuple[str, dict[str, object]]:
        body: dict[str, object] = {
            "model": "sim-model",
            "prompt": f"drain {i} " * 40,
            "max_tokens": 1200,
            "ignore_eos": True,
            "stream": True,
        }
        return "/v1/completions", body

    return request


# -- bad reloads --------------------------------------------------------------------------------

BAD_CONFIGS = {
    "invalid YAML": "plugins: [ {type: queue-scorer\nschedulingProfiles: ::\n",
    "unknown plugin": yaml.safe_dump({"plugins": [{"type": "no-such-scorer"}]}),
    "wrong types": yaml.safe_dump(
        {
            "plugins": [
                {"type": "prefix-cache-scorer", "parameters": {"lruCapacityPerServer": "lots"}},
                {"type": "queue-scorer"},
            ],
            "schedulingProfiles": [
                {"name": "default", "plugins": [{"pluginRef": "queue-scorer", "weight": "heavy"}]}
            ],
        }
    ),
}


def _reloads(port: int, result: str) -> float:
    return probes.read_picker(port).value(f"kv_picker_config_reloads_total{{result={result}}}")


def bad_reloads(sizes: Sizes) -> ScenarioResult:
    """Write three broken configs under load, then a good one: each broken one is rejected and
    counted, the running config keeps serving, the good one is applied."""
    with scenario("bad-reloads") as result, stack(sims=2) as local:
        port = local.picker_metrics_port
        path = local.workdir / "picker.yaml"
        good = path.read_text()
        rejected: dict[str, bool] = {}
        with TrafficThread(local.url, mixed_requests(), 8) as traffic:
            time.sleep(0.5)
            for name, text in BAD_CONFIGS.items():
                before = _reloads(port, "rejected")
                _write(path, text)
                rejected[name] = (
                    probes.wait_for(lambda b=before: _reloads(port, "rejected") > b, 10.0)
                    is not None
                )
                time.sleep(0.3)
            before = _reloads(port, "applied")
            _write(path, good + "# restored\n")
            applied = probes.wait_for(lambda: _reloads(port, "applied") > before, 10.0)
            time.sleep(0.5)
            shots = traffic.stop()
        summary = summarise(shots)
        result.figures.update(
            requests=summary.requests,
            failed=summary.failed,
            rejected=int(_reloads(port, "rejected")),
            applied=int(_reloads(port, "applied")),
        )
        for name, seen in rejected.items():
            result.check(f"{name}: rejected and counted", seen)
        result.check("a good config is applied after them", applied is not None)
        result.check("0 failed requests", summary.failed == 0 and summary.requests > 0)
        result.check("picker alive", _picker(local).alive())
        _note_failures(result, shots)
    return result


def _write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.replace(path)


# -- unique-prompt flood ------------------------------------------------------------------------


def _index_keys(port: int) -> float:
    return probes.read_picker(port).total("kv_picker_prefix_index_keys")


def prompt_flood(sizes: Sizes) -> ScenarioResult:
    """Unique prompts until the prefix index's LRU is long full: the index stays within its
    bound and the picker's memory stops growing."""
    lru = sizes.flood_lru_blocks
    config = picker_config(lru_blocks=lru)
    with scenario("prompt-flood") as result, stack(sims=2, config=config) as local:
        pid = _picker(local).process.pid
        port = local.picker_metrics_port
        total = sizes.flood_prompts
        bound = lru * len(local.sim_addresses)
        traffic = TrafficThread(
            local.url, unique_requests(), sizes.flood_connections, total, 60 + total * 0.05
        ).start()
        marks: dict[int, tuple[int, float]] = {}  # percent done -> (RSS, index keys)
        max_keys = 0.0
        started = time.monotonic()
        while traffic.running and time.monotonic() - started < 60 + total * 0.05:
            keys = _index_keys(port)
            max_keys = max(max_keys, keys)
            done = 100 * len(traffic.shots) // total
            for mark in (25, 50, 75):
                if done >= mark and mark not in marks:
                    marks[mark] = (probes.rss_bytes(pid), keys)
            time.sleep(0.2)
        shots = traffic.stop()
        keys = _index_keys(port)
        max_keys = max(max_keys, keys)
        marks[100] = (probes.rss_bytes(pid), keys)
        summary = summarise(shots)
        rss_half = marks.get(50, marks[100])[0]
        growth_mb = (marks[100][0] - rss_half) / MB
        blocks_per_prompt = len(unique_requests()(0)[1]["prompt"]) // 64  # type: ignore[arg-type]
        result.figures.update(
            prompts=summary.requests,
            failed=summary.failed,
            blocks_offered=summary.requests * blocks_per_prompt,
            index_bound_keys=bound,
            index_max_keys=int(max_keys),
            rss_at_50pct_mb=round(rss_half / MB, 1),
            rss_end_mb=round(marks[100][0] / MB, 1),
            rss_growth_second_half_mb=round(growth_mb, 1),
        )
        result.check("the index reached its bound (the flood filled it)", max_keys >= 0.9 * bound)
        result.check("the index never exceeded its bound", max_keys <= bound)
        result.check("RSS grew < 5 MB over the second half", growth_mb < 5.0)
        result.check("no request failed", summary.failed == 0)
        _note_failures(result, shots)
    return result


# -- Valkey outage ------------------------------------------------------------------------------


def valkey_outage(sizes: Sizes) -> ScenarioResult:
    """Precise mode on a Valkey index under load: kill Valkey, restart it empty; no request
    fails, and the picker writes the index again."""
    from kv_picker_bench.overhead import TOKENIZER, precise_profile
    from kv_picker_bench.valkey import ValkeyServer

    with scenario("valkey-outage") as result, ValkeyServer() as valkey:
        config = {
            **precise_profile(),
            "server": {"maxBodyBytes": MAX_BODY_BYTES},
            "index": {"backend": "redis", "url": valkey.url, "timeout": "200ms"},
        }
        client = valkey.client()
        with (
            stack(sims=2, config=config, kv_events=True, tokenizer=TOKENIZER) as local,
            TrafficThread(local.url, mixed_requests(), 8) as traffic,
        ):
            port = local.picker_metrics_port
            written = probes.wait_for(lambda: client.dbsize() > 0, 15.0)
            killed_s = time.monotonic()
            valkey.kill()
            time.sleep(sizes.valkey_outage_s)
            restarted_s = time.monotonic()
            valkey.start()
            recovered = probes.wait_for(lambda: client.dbsize() > 0, 30.0)
            time.sleep(0.5)
            shots = traffic.stop()
            errors = probes.read_picker(port).total("kv_picker_kv_index_backend_errors_total")
        summary = summarise(shots)
        during = [s for s in shots if killed_s <= s.start_s <= restarted_s]
        result.figures.update(
            requests=summary.requests,
            requests_during_outage=len(during),
            failed=summary.failed,
            outage_s=sizes.valkey_outage_s,
            backend_errors=int(errors),
            index_rewritten_after_s=round(recovered, 2) if recovered is not None else -1.0,
        )
        result.check("the index was written before the outage", written is not None)
        result.check("requests were served during the outage", any(s.ok for s in during))
        result.check("0 failed requests", summary.failed == 0)
        result.check("the index is written again after the restart", recovered is not None)
        _note_failures(result, shots)
    return result


# -- fail-open ----------------------------------------------------------------------------------


def fail_open(sizes: Sizes) -> ScenarioResult:
    """SIGKILL the picker under load behind a FailOpen pool (both body modes) and a FailClose
    one; see who loses what, then whether the picker is used again after a restart."""
    with scenario("fail-open") as result:
        for failure_mode, body_mode in (
            ("FailOpen", "FULL_DUPLEX_STREAMED"),
            ("FailOpen", "BUFFERED"),
            ("FailClose", "FULL_DUPLEX_STREAMED"),
        ):
            run = kill_picker_under_load(failure_mode, body_mode, sizes.fail_open_load_s)
            tag = f"{failure_mode}/{'streamed' if body_mode.startswith('FULL') else 'buffered'}"
            for key, value in run.items():
                if key != "notes":
                    result.figures[f"{tag} {key}"] = value  # type: ignore[assignment]
            if failure_mode == "FailOpen":
                result.check(
                    f"{tag}: no loss but requests in flight at the kill",
                    run["lost_started_after_detection"] == 0,
                )
                result.check(
                    f"{tag}: served while the picker is down", run["served_while_down"] > 0
                )
                result.check(f"{tag}: a forged destination is not reached", run["trap_hits"] == 0)
            else:
                result.check(
                    f"{tag}: 5xx at once while the picker is down",
                    run["served_while_down"] == 0 and run["max_latency_while_down_ms"] < 1000,
                )
            result.check(f"{tag}: no request hung", run["max_latency_ms"] < HANG_S * 1000)
            result.check(
                f"{tag}: the picker routes again after a restart", run["picker_back_s"] >= 0
            )
    return result


def kill_picker_under_load(
    failure_mode: str, body_mode: str, load_s: float, connections: int = 16
) -> dict[str, float]:
    """One run of the fail-open experiment (also used by the integration test).

    Returns figures: ``lost_in_flight`` (failed requests started before the kill),
    ``lost_started_after_kill``, ``last_loss_after_kill_ms``, ``lost_started_after_detection``
    (failed requests started more than :data:`DETECTION_S` after the kill), and, for requests
    started after that and ended before the restart, ``served_while_down``, ``requests_while_down``,
    ``max_latency_while_down_ms``, ``max_latency_ms``, ``trap_hits`` (connections a forged
    destination header reached while the picker was down), ``picker_back_s`` (restart to the
    first request the picker routed; -1 if none within 15 s).
    """
    trap = socket.socket()
    trap.bind(("127.0.0.1", 0))
    trap.listen(16)
    trap.setblocking(False)
    trap_address = f"127.0.0.1:{trap.getsockname()[1]}"
    try:
        with (
            stack(sims=2, failure_mode=failure_mode, body_mode=body_mode) as local,
            TrafficThread(local.url, mixed_requests(), connections) as traffic,
        ):
            time.sleep(load_s / 2)
            killed_s = time.monotonic()
            _picker(local).kill(signal.SIGKILL)
            time.sleep(load_s)
            forged = _post_forged(local.url, trap_address)
            restarted_s = time.monotonic()
            local.start_picker()
            port = local.picker_metrics_port
            back = probes.wait_for(
                lambda: (
                    probes.read_picker(port).total("kv_picker_requests_total{model=sim-model") > 0
                ),
                15.0,
            )
            shots = traffic.stop()
        trap_hits = 0
        while True:
            try:
                trap.accept()[0].close()
                trap_hits += 1
            except BlockingIOError:
                break
    finally:
        trap.close()
    failed = [s for s in shots if s.failed]
    # "While down": after Envoy could know (DETECTION_S), before the restart.
    down = [s for s in shots if killed_s + DETECTION_S < s.start_s and s.end_s < restarted_s]
    return {
        "requests": len(shots),
        "lost_in_flight": sum(1 for s in failed if s.start_s <= killed_s),
        "lost_started_after_kill": sum(1 for s in failed if s.start_s > killed_s),
        "last_loss_after_kill_ms": round(
            max((s.start_s - killed_s for s in failed), default=0.0) * 1e3, 1
        ),
        "lost_started_after_detection": sum(
            1 for s in failed if s.start_s > killed_s + DETECTION_S
        ),
        "requests_while_down": len(down),
        "served_while_down": sum(1 for s in down if s.ok),
        "max_latency_while_down_ms": round(max((s.latency_s for s in down), default=0) * 1e3, 1),
        "max_latency_ms": round(max((s.latency_s for s in shots), default=0) * 1e3, 1),
        "forged_status": forged,
        "trap_hits": trap_hits,
        "picker_back_s": round(back, 2) if back is not None else -1.0,
    }


def _post_forged(base_url: str, destination: str) -> int:
    """Send one request naming ``destination`` in the picker's header; its status."""
    import urllib.error
    import urllib.request

    body = json.dumps({"model": "sim-model", "prompt": "forged", "max_tokens": 2}).encode()
    request = urllib.request.Request(
        base_url + "/v1/completions",
        data=body,
        headers={"content-type": "application/json", DESTINATION_HEADER: destination},
    )
    try:
        with urllib.request.urlopen(request, timeout=HANG_S) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except OSError:
        return 0
