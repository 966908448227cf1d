"""Rate and ETA of a snapshot's progress, from the rows done over time (docs/snapshots.md): used by the daemon's log lines and metrics and by ``cdcd snapshot --follow``.

The rate is taken over the samples of the last ``window`` seconds, so that it follows the
current pace (a pause, a restart) rather than the average since the start; a count that goes
back (the table's snapshot started over) starts the measure again.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import Any


class RateMeter:
    """Rows per second over the last ``window`` seconds of ``(time, rows done)`` samples."""

    __slots__ = ("_samples", "window")

    def __init__(self, window: float = 30.0) -> None:
        self.window = window
        self._samples: deque[tuple[float, int]] = deque()

    def add(self, at: float, rows: int) -> None:
        samples = self._samples
        if samples and rows < samples[-1][1]:
            samples.clear()
        samples.append((at, rows))
        # keep one sample at or before the window's start, so the window stays covered
        while len(samples) > 2 and samples[1][0] <= at - self.window:
            samples.popleft()

    @property
    def rate(self) -> float | None:
        """Rows per second, or None before two samples some time apart."""
        if len(self._samples) < 2:
            return None
        (t0, r0), (t1, r1) = self._samples[0], self._samples[-1]
        return (r1 - r0) / (t1 - t0) if t1 > t0 else None

    def eta(self, rows: int, estimate: int) -> float | None:
        """Seconds until ``estimate`` rows at the current rate; None when unknown (no rate
        yet, none at all, no estimate, or the estimate passed: it was wrong, and how many rows
        are left is not known)."""
        rate = self.rate
        if not rate or rate <= 0 or estimate <= rows:
            return None
        return (estimate - rows) / rate


#: where the estimate of a table's rows comes from: the planner's statistics
#: (``pg_class.reltuples``), or the table's size over the width of a sample of its rows
STATISTICS, SIZE = "statistics", "size"


def estimate_source(entry: Mapping[str, Any]) -> str | None:
    """Where a recorded table's estimate comes from (:data:`STATISTICS`, :data:`SIZE`), None
    when there is none (records made before the key existed: statistics, when not 0)."""
    source = entry.get("estimated_from", STATISTICS if int(entry.get("estimate") or 0) else None)
    return str(source) if source is not None else None


def show_estimate(estimate: int, source: str | None, separators: bool = True) -> str:
    """``100,000`` from statistics, ``~100,000`` from the size (an estimate, and said so),
    ``?`` when nothing is known."""
    if source is None:
        return "?"
    text = f"{estimate:,}" if separators else str(estimate)
    return "~" + text if source == SIZE else text


def show_percent(status: str, rows: int, estimate: int, source: str | None) -> str:
    """``48.0%``; ``~48.0%`` against an estimate from the size; ``-`` without an estimate
    (never a percentage of nothing); below 100% until the snapshot is done."""
    if status == "done":
        return "100%"
    if source is None or estimate <= 0:
        return "-"
    text = f"{min(99.9, 100 * rows / estimate):.1f}%"
    return "~" + text if source == SIZE else text


def duration(seconds: float | None) -> str:
    """``45s``, ``3m05s``, ``2h07m``; ``?`` when unknown."""
    if seconds is None:
        return "?"
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
