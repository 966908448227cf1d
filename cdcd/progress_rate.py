"""Rate and ETA of a snapshot's progress, from the rows done over time (docs/snapshots.md): used by the daemon's log lines and metrics and by ``cdcd snapshot --follow``.

The rate is taken over the samples of the last ``window`` seconds, so that it follows the
current pace (a pause, a restart) rather than the average since the start; a count that goes
back (the table's snapshot started over) starts the measure again.
"""

from __future__ import annotations

from collections import deque


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
        yet, or none at all); 0 once the estimate is reached."""
        if rows >= estimate > 0:
            return 0.0
        rate = self.rate
        if not rate or rate <= 0 or estimate <= 0:
            return None
        return (estimate - rows) / rate


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
