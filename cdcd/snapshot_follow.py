"""``cdcd snapshot ... --follow``: the progress of incremental snapshots until they end (docs/snapshots.md).

It reads what the daemon records in ``<snapshot.state_dir>/<slot>.incremental.json`` (rows
durable in every sink, the estimate from ``pg_class.reltuples``, the status) twice a second and
shows, per table, rows done / estimated, the rate over the last 30 s and the ETA: as progress
bars (tqdm) on a terminal, as plain lines every few seconds otherwise. After a request it first
waits for the daemon to take it (the state records the last signal taken).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from cdcd.config import Config
from cdcd.errors import EXIT_FAILURE, EXIT_OK
from cdcd.progress_rate import (
    SIZE,
    STATISTICS,
    RateMeter,
    duration,
    estimate_source,
    show_estimate,
    show_percent,
)
from cdcd.snapshot.state import IncrementalState

#: a table's snapshot has ended in these statuses
ENDED = ("done", "skipped", "removed")


def line(
    name: str,
    status: str,
    rows: int,
    estimate: int,
    meter: RateMeter,
    source: str | None = STATISTICS,
) -> str:
    """``public.t  running  120,000 / 250,000 rows  48.0%  21,000 rows/s  ETA 6s``; against
    an estimate from the table's size ``/ ~250,000 rows  ~48.0%``; without any estimate
    ``120,000 / ? rows  -`` and no ETA (never a percentage of nothing)."""
    pct = show_percent(status, rows, estimate, source)
    rate = meter.rate
    speed = "-" if rate is None else f"{rate:,.0f} rows/s"
    left = meter.eta(rows, estimate) if source is not None else None
    eta = "0s" if status == "done" else duration(left)
    shown = f"{rows:,}" if status == "done" else show_estimate(estimate, source)
    return f"{name}  {status}  {rows:,} / {shown} rows  {pct}  {speed}  ETA {eta}"


class _Bars:
    """One tqdm bar per table (a terminal)."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.bars: dict[str, Any] = {}

    def show(
        self, name: str, status: str, rows: int, estimate: int, meter: RateMeter, source: str | None
    ) -> None:
        """A bar against the estimate (``~`` before the total when it comes from the table's
        size); without an estimate, or once rows pass it, no bar and no percentage: the rows,
        the rate."""
        from tqdm import tqdm

        known = source is not None and estimate > rows
        total = max(rows, 1) if status == "done" else estimate if known else None
        approx = "~" if source == SIZE and status != "done" else ""
        bar = self.bars.get(name)
        if bar is None:
            bar = self.bars[name] = tqdm(
                total=total,
                desc=name,
                unit="rows",
                unit_scale=True,
                position=len(self.bars),
                file=self.out,
                dynamic_ncols=True,
            )
        bar.total = total
        bar.bar_format = (
            f"{{desc}} {approx}{{percentage:3.0f}}%|{{bar}}| {{n_fmt}}/{approx}{{total_fmt}} "
            "rows{postfix}"
            if total is not None
            else "{desc} {n_fmt} rows (no estimate){postfix}"
        )
        bar.n = rows if status != "done" else bar.total
        rate, eta = meter.rate, meter.eta(rows, estimate) if known else None
        speed = "-" if rate is None else f"{rate:,.0f} rows/s"
        bar.set_postfix_str(f"{status}, {speed}, ETA {duration(eta)}", refresh=False)
        bar.refresh()

    def close(self) -> None:
        for bar in self.bars.values():
            bar.close()


def follow(
    config: Config,
    tables: list[str] | None,
    *,
    after_signal: int = 0,
    out: TextIO = sys.stdout,
    tty: bool | None = None,
    every: float = 5.0,
    poll: float = 0.5,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Show the progress of ``tables`` (None: every table not ended yet) until each has ended;
    ``after_signal``: first wait until the daemon has taken the signal written there. Exit 0
    when every table is done, 1 when one was skipped or removed (the daemon's log says why)."""
    tty = out.isatty() if tty is None else tty
    bars = _Bars(out) if tty else None
    meters: dict[str, RateMeter] = {}
    shown: dict[str, tuple[str, float]] = {}  # per table: status and time of the last line
    waiting_said = False
    try:
        while True:
            state = IncrementalState(config.snapshot.state_dir, config.source.slot)
            if state.last_signal < after_signal:
                if not waiting_said:
                    out.write("waiting for the daemon to take the request (is it running?)\n")
                    out.flush()
                    waiting_said = True
                sleep(poll)
                continue
            if tables is None:
                tables = [n for n, t in state.tables.items() if t["status"] not in ENDED]
                if not tables:
                    out.write("no incremental snapshot running\n")
                    return EXIT_OK
            now = clock()
            ended = []
            for name in tables:
                entry = state.tables.get(name, {"status": "pending"})
                status = str(entry["status"])
                rows, estimate = int(entry.get("rows") or 0), int(entry.get("estimate") or 0)
                source = estimate_source(entry)
                meter = meters.setdefault(name, RateMeter())
                meter.add(now, rows)
                if status in ENDED:
                    ended.append(name)
                if bars is not None:
                    bars.show(name, status, rows, estimate, meter, source)
                    continue
                last = shown.get(name)
                again = last is not None and status not in ENDED and now - last[1] >= every
                if last is None or last[0] != status or again:
                    out.write(line(name, status, rows, estimate, meter, source) + "\n")
                    out.flush()
                    shown[name] = (status, now)
            if len(ended) == len(tables):
                break
            sleep(poll)
    finally:
        if bars is not None:
            bars.close()
    failed = [n for n in tables if state.tables.get(n, {}).get("status") != "done"]
    if failed:
        out.write(
            f"not snapshotted: {', '.join(failed)} (skipped or removed: the daemon's log says "
            "why and what to do)\n"
        )
        return EXIT_FAILURE
    return EXIT_OK
