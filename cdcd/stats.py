"""The pipeline's counters and gauges: what ``/metrics``, the logs and the benchmark read.

The stages write plain attributes on the hot path; readers (the HTTP endpoint, the benchmark's
stats file) only read. Nothing here refers back to the stages.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from dataclasses import dataclass, field

from cdcd.lsn import pg_to_unix_us
from cdcd.progress_rate import RateMeter

#: upper bounds (seconds) of the sink latency histograms
WRITE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)
FLUSH_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)


class Histogram:
    """Observations counted in fixed buckets (Prometheus' cumulative form on export)."""

    __slots__ = ("buckets", "counts", "sum")

    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one: above every bound
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.sum += value
        self.counts[bisect_left(self.buckets, value)] += 1

    def observe_many(self, value: float, count: int) -> None:
        """``count`` observations of ``value`` (a run's mean, once per item of the run)."""
        self.sum += value * count
        self.counts[bisect_left(self.buckets, value)] += count

    def cumulative(self) -> list[tuple[str, int]]:
        """``[(le, count), ...]`` ending with ``+Inf``."""
        out: list[tuple[str, int]] = []
        total = 0
        for bound, count in zip((*map(str, self.buckets), "+Inf"), self.counts, strict=True):
            total += count
            out.append((bound, total))
        return out


@dataclass
class SinkStats:
    """Per sink: its position and how long its calls take."""

    type_name: str
    handed_lsn: int = 0
    durable_lsn: int = 0
    retries: int = 0
    write_seconds: Histogram = field(default_factory=lambda: Histogram(WRITE_BUCKETS))
    flush_seconds: Histogram = field(default_factory=lambda: Histogram(FLUSH_BUCKETS))


@dataclass
class TableSnapshot:
    """Per table of an incremental snapshot: rows emitted (``r``), the estimate of its rows
    and where it comes from (:func:`cdcd.source.snapshot.row_estimate`: ``"statistics"``,
    ``"size"``, None when nothing is known), rows dropped because the stream changed them in
    their window, bytes read (the text form of the chunks' values), and the rate over recent
    chunks."""

    status: str = "pending"
    rows: int = 0
    estimate: int = 0
    dropped: int = 0
    chunks: int = 0
    bytes: int = 0
    meter: RateMeter = field(default_factory=RateMeter)
    estimated_from: str | None = "statistics"

    @property
    def known(self) -> bool:
        """Whether there is an estimate to measure progress against."""
        return self.estimated_from is not None and self.estimate > 0

    def eta(self) -> float | None:
        """Seconds left at the current rate (None: unknown)."""
        return self.meter.eta(self.rows, self.estimate) if self.known else None


@dataclass
class Stats:
    """Everything the pipeline reports. Written by its stages, read by anyone."""

    name: str = ""  # the config's name
    slot: str = ""
    received_bytes: int = 0
    received_messages: int = 0
    #: socket reads of the replication connection (all sessions)
    socket_reads: int = 0
    transactions: int = 0
    events: int = 0
    events_by: dict[tuple[str, str], int] = field(default_factory=dict)
    reconnects: int = 0
    server_wal_end: int = 0
    confirmed_lsn: int = 0
    last_commit_time_us: int = 0
    #: nothing in flight (the acker's last look): the lag is then zero
    caught_up: bool = True
    streaming: bool = False
    connected: bool = False
    #: the source is reachable but not usable yet (e.g. a standby not promoted): why
    waiting_for: str | None = None
    slot_wal_status: str | None = None
    slot_safe_wal_size: int | None = None
    slot_retained_bytes: int = 0
    #: slots replaced under source.on_slot_lost: recreate (cdcd.pipeline.recreate), the last
    #: one's reason and time (Unix seconds)
    slot_recreations: int = 0
    slot_recreated_reason: str | None = None
    slot_recreated_at: float | None = None
    #: published tables whose UPDATE/DELETE the server refuses (no usable replica identity;
    #: cdcd.pipeline.publication_watch)
    breaking_tables: list[str] = field(default_factory=list)
    # the assembler's gauges, refreshed by the reader after each batch
    buffered_bytes: int = 0
    spilled_bytes: int = 0
    total_spilled_bytes: int = 0
    spill_count: int = 0
    #: changes of streamed transactions whose row JSON was made as they arrived
    rendered_changes: int = 0
    open_streams: int = 0
    held_prepared: int = 0
    #: bytes of committed transactions waiting for (or being written to) the sinks
    queued_bytes: int = 0
    sinks: list[SinkStats] = field(default_factory=list)
    #: incremental snapshots by table (docs/snapshots.md)
    snapshots: dict[str, TableSnapshot] = field(default_factory=dict)

    def lag_seconds(self, now: float | None = None) -> float:
        """Now minus the commit time of the last delivered transaction; 0 when caught up."""
        if self.caught_up or not self.last_commit_time_us:
            return 0.0
        now = time.time() if now is None else now
        return max(0.0, now - pg_to_unix_us(self.last_commit_time_us) / 1e6)

    def count(self, table: str, op: str, n: int = 1) -> None:
        key = (table, op)
        self.events_by[key] = self.events_by.get(key, 0) + n
