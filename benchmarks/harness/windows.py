"""Time windows of a trace, and the rule that holds some of them out of a tuning run.

``kv-picker tune`` must never be judged on the requests it tuned on. Requests of one trace are
not independent (a conversation's turns share a prefix, a burst shares its queue), so a random
split would leak: the held-out half would hold the other turns of the same conversations, in
the same bursts. Whole stretches of time are held out instead:

```
arrival time ─────────────────────────────────────────────────────────────────────────────>
  │ window 1 │ window 2 │ window 3 │ window 4 │ window 5 │ window 6 │     --windows 6
  │  tuning  │  tuning  │ held out │  tuning  │  tuning  │ held out │     --held-out every:3
```

The span from the first to the last arrival is cut into ``K`` windows of equal duration (the
last one includes the last arrival). Which ones are held out:

- ``every:N`` (the default, ``every:3``): windows N, 2N, 3N, ... (1-based). Interleaving keeps
  both sides spread over the whole trace, so a trace whose load drifts is tuned and evaluated
  on the same mix;
- ``last:N``: the last N windows, the strict "tune on the past, judge on the future" split;
- ``2,5``: these windows (1-based numbers).

At least one window must be left on each side. Each window is later replayed on its own,
starting cold (empty caches, nothing in flight), re-timed to start at 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kv_picker_bench.harness.traces import Trace, TraceError, slice_trace

DEFAULT_HELD_OUT = "every:3"


@dataclass(frozen=True, slots=True)
class Window:
    """One time window of a trace.

    Attributes:
        number: Position among the windows, from 1.
        start_s: Start in trace seconds (inclusive).
        end_s: End in trace seconds (exclusive, except the last window's, which holds the last
            arrival).
        trace: The window's requests, re-timed to start at 0.
        held_out: Kept out of tuning, for evaluation only.
    """

    number: int
    start_s: float
    end_s: float
    trace: Trace
    held_out: bool

    @property
    def label(self) -> str:
        """``window 3 (329s..493s)``, for messages and reports."""
        return f"window {self.number} ({self.start_s:.0f}s..{self.end_s:.0f}s)"


def parse_held_out(spec: str, count: int) -> frozenset[int]:
    """The 1-based numbers of the held-out windows that ``spec`` names.

    Args:
        spec: ``every:N``, ``last:N`` or a comma-separated list of window numbers.
        count: Number of windows.

    Raises:
        ValueError: If the spec is malformed, names a window that does not exist, or leaves no
            window on one side.
    """
    if count < 2:
        raise ValueError(f"--windows {count}: need at least 2 (one to tune on, one to hold out)")
    text = spec.strip()
    rule, sep, argument = text.partition(":")
    try:
        if sep and rule == "every":
            step = int(argument)
            if step < 1:
                raise ValueError
            chosen = frozenset(range(step, count + 1, step))
        elif sep and rule == "last":
            last = int(argument)
            if last < 1:
                raise ValueError
            chosen = frozenset(range(max(1, count - last + 1), count + 1))
        elif not sep:
            chosen = frozenset(int(item) for item in text.split(",") if item.strip())
        else:
            raise ValueError
    except ValueError:
        raise ValueError(
            f"--held-out {spec!r}: expected every:N, last:N or window numbers such as 3,6"
        ) from None
    outside = sorted(n for n in chosen if not 1 <= n <= count)
    if outside:
        raise ValueError(
            f"--held-out {spec!r}: no window {', '.join(map(str, outside))} among 1..{count}"
        )
    if not chosen or len(chosen) == count:
        raise ValueError(
            f"--held-out {spec!r} with --windows {count} holds out "
            f"{'no window' if not chosen else 'every window'}: leave at least one on each side"
        )
    return chosen


def split_windows(trace: Trace, count: int, held_out: frozenset[int]) -> list[Window]:
    """Cuts ``trace`` into ``count`` windows of equal duration.

    Args:
        trace: The whole trace (already sliced and scaled).
        count: Number of windows (>= 2).
        held_out: 1-based numbers of the windows to hold out (see :func:`parse_held_out`).

    Raises:
        TraceError: If the trace spans no time, or a window has no request.
    """
    if not trace.requests:
        raise TraceError(f"{trace.name}: no request to split into windows")
    first_s = trace.requests[0].arrival_s
    last_s = trace.requests[-1].arrival_s
    span_s = last_s - first_s
    if span_s <= 0:
        raise TraceError(f"{trace.name}: every request arrives at once; no time to split")
    windows: list[Window] = []
    for index in range(count):
        start_s = first_s + span_s * index / count
        end_s = first_s + span_s * (index + 1) / count if index + 1 < count else last_s
        # slice_trace's windows end before END; the last one must keep the last arrival.
        slice_end = end_s if index + 1 < count else math.nextafter(last_s, math.inf)
        number = index + 1
        try:
            part = slice_trace(trace, window_s=(start_s, slice_end))
        except TraceError:
            raise TraceError(
                f"{trace.name}: window {number} of {count} ({start_s:.0f}s..{end_s:.0f}s) has "
                "no request; use fewer --windows"
            ) from None
        windows.append(Window(number, start_s, end_s, part, number in held_out))
    return windows
