"""Opt-in measurements for the benchmark harness (``bench/run.py``); off unless asked for.

Two environment variables, read once when the pipeline starts:

``CDCD_LATENCY_LOG=<file>``
    One JSON line per transaction handed to the sinks, written once every sink holds it
    durably: ``{"end_lsn": int, "commit_time_us": int, "handed_us": int, "durable_us": int}``.
    ``commit_time_us`` is the Commit message's time (microseconds since the PostgreSQL epoch,
    the server's clock); ``handed_us`` the wall time (microseconds since the Unix epoch) when
    every sink had been handed the whole transaction; ``durable_us`` the wall time when
    ``min(sink.durable_lsn())`` first reached the transaction's end LSN: as a sink marks a
    position durable (``Sink.durable_listener``), as the transaction is handed over (for a
    sink durable at commit), right after each flush the pipeline runs, and by a task that polls
    every 50 ms, a safety net (it polled every 2 ms before the sinks told their positions: 500
    wake-ups a second that W4's daemon paid for).
    Commit-to-durable latency is ``durable_us`` minus the commit time (after converting
    epochs); server and daemon must share a clock (same machine).

``CDCD_BENCH_STATS=<file>``
    One JSON object written when the pipeline stops: events (also per op and per table),
    transactions, received bytes and messages, spilled bytes, changes rendered on arrival
    (docs/assembler.md), the process's peak RSS, and the
    directory of the cdcd package that ran (``cdcd_package``: the harness checks that it ran the
    checkout it meant to measure).

Neither changes what the pipeline does; the latency task costs a wake-up every 50 ms.
"""

from __future__ import annotations

import asyncio
import os
import resource
import time
from collections import deque
from collections.abc import Callable
from typing import IO, Any

import orjson

from cdcd import accel
from cdcd.stats import Stats

LATENCY_ENV = "CDCD_LATENCY_LOG"
STATS_ENV = "CDCD_BENCH_STATS"
POLL_SECONDS = 0.05


class LatencyLog:
    """Records when each handed-over transaction became durable in every sink."""

    def __init__(self, path: str) -> None:
        self._file: IO[bytes] = open(path, "ab")  # noqa: SIM115 - closed in close()
        self._pending: deque[tuple[int, int, int]] = deque()

    @classmethod
    def from_env(cls) -> LatencyLog | None:
        path = os.environ.get(LATENCY_ENV)
        return cls(path) if path else None

    def handed(self, end_lsn: int, commit_time: int) -> None:
        """A transaction was handed to every sink (after ``commit``)."""
        self._pending.append((end_lsn, commit_time, time.time_ns() // 1000))

    def durable(self, lsn: int) -> None:
        """Every sink holds everything up to ``lsn``: record the transactions it covers."""
        pending = self._pending
        if not pending or pending[0][0] > lsn:
            return
        now = time.time_ns() // 1000
        lines = []
        while pending and pending[0][0] <= lsn:
            end_lsn, commit_time, handed = pending.popleft()
            lines.append(
                b'{"end_lsn":%d,"commit_time_us":%d,"handed_us":%d,"durable_us":%d}\n'
                % (end_lsn, commit_time, handed, now)
            )
        self._file.write(b"".join(lines))

    async def watch(self, durable_lsn: Callable[[], int]) -> None:
        """Poll ``durable_lsn`` until cancelled (sinks that acknowledge in the background)."""
        while True:
            self.durable(durable_lsn())
            await asyncio.sleep(POLL_SECONDS)

    def close(self) -> None:
        self._file.close()


def write_stats(stats: Stats, assembler: Any = None) -> None:
    """Write the ``CDCD_BENCH_STATS`` summary, if asked for."""
    path = os.environ.get(STATS_ENV)
    if not path:
        return
    by_op: dict[str, int] = {}
    by_table: dict[str, int] = {}
    for (table, op), count in stats.events_by.items():
        by_op[op] = by_op.get(op, 0) + count
        by_table[table] = by_table.get(table, 0) + count
    summary = {
        "events": stats.events,
        "events_by_op": by_op,
        "events_by_table": by_table,
        "transactions": stats.transactions,
        "received_messages": stats.received_messages,
        "received_bytes": stats.received_bytes,
        "socket_reads": stats.socket_reads,
        "spilled_bytes": assembler.total_spilled_bytes if assembler is not None else 0,
        "spill_count": assembler.spill_count if assembler is not None else 0,
        "rendered_changes": assembler.rendered if assembler is not None else 0,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "cdcd_package": os.path.dirname(os.path.abspath(__file__)),
        # what the reader's "streaming" log line says: whether the compiled modules ran
        "fast_paths": "compiled"
        if all(accel.status(imported_only=True).values())
        else "pure Python",
    }
    with open(path, "wb") as f:
        f.write(orjson.dumps(summary) + b"\n")
