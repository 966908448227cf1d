"""The writer: committed transactions fanned out to every sink, each at its own pace.

::

    reader ──put(txn)──▶ transactions ──events (or decoded changes), built once──▶
        shared window ──▶ one task per sink: begin ▶ write ... ▶ commit ▶ flush when due

* Transactions wait here bounded by ``buffer.memory_limit`` (their accounted bytes plus what
  the sinks buffer, ``Sink.buffered_bytes``) and ``buffer.queue_transactions``; one
  transaction always fits once the sinks' buffers are empty. The buffers are summed again
  only once the writer has handed a sink something since (they grow only then), and while
  ``put`` waits (they drain by themselves). Each sink gets half the limit,
  shared out, as its ``memory_budget``. A transaction is released (its
  memory and spill file freed) once every sink has been handed all of it.
* A transaction still arriving comes in parts (docs/assembler.md, "Parts"): the sinks see one
  ``begin`` (with the first part), the events of every part in order, with ``seq`` going on
  from part to part, and one ``commit`` (with the last part, which carries the end LSN). Each
  part counts against the limits above like a transaction, and is released on its own.
* Events are built once and shared: a window of at most ``window`` items (begin, a batch of
  events, commit; or a *run* of whole small transactions, at most ``_WHOLE_CHANGES`` changes
  in all, as one item: each one's begin, batches and commit) that each sink's task reads in
  order. A run takes the small transactions already waiting when it is built, never waits for
  more; a sink that overrides ``Sink.write_transactions`` gets it in one call (the per-call
  costs of begin, write and commit, paid once per run: what makes many small transactions,
  W2, cheaper), the others call by call. The sink task
  that runs out of items builds the next one itself (no task of its own, so one sink costs no
  task switch per item).
  A slow or retrying sink holds the others back only when it is a whole window behind; the
  confirmable position is the minimum of the sinks' durable positions
  (:mod:`cdcd.pipeline.progress`).
* A :class:`~cdcd.errors.TransientSinkError` from any sink method is retried with backoff,
  calling the same method again with the same arguments (the sink interface says a sink that
  raises it has taken nothing of that call). Any other error stops the pipeline.
* Flushing: a sink is flushed once its ``flush_interval`` has passed since its last flush while
  it holds something not yet durable, and at once when it has nothing more to do and its
  interval is 0. A sink that publishes on its own schedule (``flushes_itself``) is flushed here
  only after 0.1 s with nothing to do: a safety net, which also surfaces its background errors.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator, Sequence
from functools import partial
from itertools import islice
from typing import Any, overload

import structlog

from cdcd.assembler.transaction import ChangeRecord, Transaction
from cdcd.benchlog import LatencyLog
from cdcd.decoder import events as ev
from cdcd.errors import TransientSinkError
from cdcd.events.catalog import schema_name
from cdcd.events.change_event import ChangeEvent
from cdcd.events.encoder import Encoder, EventCursor
from cdcd.events.snapshot_run import SnapshotRun
from cdcd.pipeline.progress import ProgressTracker
from cdcd.sinks.base import Sink
from cdcd.sinks.retry import retrying
from cdcd.stats import SinkStats, Stats

log = structlog.get_logger("cdcd.writer")

_BEGIN, _WRITE, _COMMIT, _END, _PART, _WHOLE = range(6)  # _PART: a part other than the last
#: is over; _WHOLE: a run of small transactions in one item, [(txn, batches), ...]: for each,
#: begin, write each batch, commit
#: transactions of at most this many changes go in _WHOLE items (not begin, batches, commit),
#: as many as are waiting while the run's changes stay within it
_WHOLE_CHANGES = 1000
#: rows per batch of an incremental snapshot's chunk handed to the sinks
_SNAPSHOT_BATCH = 5000
#: kinds of transaction a run takes after its first (a snapshot chunk or a reset goes alone)
_RUN_KINDS = frozenset({"regular", "streamed", "prepared", "message"})
#: seconds a sink task waits for work before it looks at flushing again
_IDLE_TICK = 0.1
#: seconds between two looks at the sinks' buffers while they hold reading back
_BUFFER_TICK = 0.02
#: the op each kind of change counts under in Stats.events_by when no events are built
_CHANGE_OPS: dict[type, str] = {
    ev.Insert: "c",
    ev.Update: "u",
    ev.Delete: "d",
    ev.Truncate: "t",
    ev.Message: "m",
}


class _Window:
    """Items in order, read by several readers at their own pace; an item is dropped once every
    reader is past it (``on_dropped`` sees the dropped commits and ends of parts)."""

    def __init__(self, readers: int, size: int, on_dropped: Callable[[int, Any], None]) -> None:
        self._items: deque[tuple[int, Any]] = deque()
        self._base = 0  # index of _items[0]
        self._cursors = [0] * readers
        self._size = size
        self._on_dropped = on_dropped

    @property
    def full(self) -> bool:
        return len(self._items) >= self._size

    def append(self, item: tuple[int, Any]) -> None:
        self._items.append(item)

    def peek(self, reader: int) -> tuple[int, Any] | None:
        pos = self._cursors[reader] - self._base
        return self._items[pos] if pos < len(self._items) else None

    def advance(self, reader: int) -> bool:
        """Reader ``reader`` is done with the item ``peek`` gave it; whether room was made."""
        cursors = self._cursors
        cursors[reader] += 1
        items = self._items
        dropped = False
        while items and min(cursors) > self._base:
            kind, payload = items.popleft()
            self._base += 1
            dropped = True
            if kind == _WHOLE:
                for txn, _ in payload:
                    self._on_dropped(_COMMIT, txn)
            elif kind in (_COMMIT, _PART):
                self._on_dropped(kind, payload)
        return dropped


class Writer:
    """See the module docstring. ``put`` from the reader, ``run`` as a task, ``close`` to
    drain: ``run`` returns once everything put before ``close`` was handed to every sink."""

    def __init__(
        self,
        sinks: list[Sink],
        encoder: Encoder,
        tracker: ProgressTracker,
        stats: Stats,
        *,
        memory_limit: int,
        max_transactions: int,
        window: int = 8,
        latency: LatencyLog | None = None,
    ) -> None:
        self.sinks = sinks
        self._encoder = encoder
        self._tracker = tracker
        self._stats = stats
        self._memory_limit = memory_limit
        self._max_transactions = max(1, max_transactions)
        self._latency = latency
        self._waiting: deque[Transaction | None] = deque()  # put, not yet being built
        self._building: Iterator[tuple[int, Any]] | None = None  # items of the next transaction
        self._cursor: EventCursor | None = None  # of the transaction being handed in parts
        self._progress = asyncio.Event()  # an arrival, an item built, room in the window
        self._room = asyncio.Event()  # a transaction released: room for the reader
        self._held = 0  # transactions put and not yet released
        self._held_bytes = 0
        # the sinks' buffered bytes as last summed: they grow only by what the writer hands
        # over (which forgets the sum) and drain by themselves, so the sum stays an upper bound
        self._sinks_buffered: int | None = None
        self._window = _Window(len(sinks), window, self._released)
        if len(stats.sinks) != len(sinks):
            stats.sinks[:] = [SinkStats(sink.type_name) for sink in sinks]
        # a first flush is due flush_interval after the start, not at once
        self._last_flush = [time.monotonic()] * len(sinks)
        # called by poll_durable when the durable position moved (each sink calls it as its own
        # position moves, service.py): the snapshots record their durable chunks at once, so
        # that a crash right after a flush re-reads as little as possible
        self.on_durable: list[Callable[[], None]] = []
        self._flush_wanted = [False] * len(sinks)  # request_flush: flush at the next chance
        for sink in sinks:  # the sinks' own buffers: half the limit, shared out
            sink.memory_budget = memory_limit // (2 * len(sinks))
        # no sink wants events (the null sink alone): hand over decoded changes, build no events
        self._events_wanted = any(sink.wants_events for sink in sinks)
        # which sinks take a run of small transactions in one call (Sink.write_transactions)
        self._whole_runs = [
            type(sink).write_transactions is not Sink.write_transactions for sink in sinks
        ]

    # -- the reader's side -------------------------------------------------------------------

    @property
    def queued_transactions(self) -> int:
        """Transactions put and not yet handed to every sink."""
        return self._held

    async def put(self, txn: Transaction) -> None:
        """Queue ``txn``; waits while the transactions held here and the sinks' buffers would
        pass the limits (looking at the buffers, which drain without a signal, every 0.02 s)."""
        while True:
            buffered = self._sinks_buffered
            if buffered is None:
                buffered = self._sinks_buffered = sum(s.buffered_bytes() for s in self.sinks)
            if (
                not (
                    (self._held or buffered)
                    and self._held_bytes + buffered + txn.mem_bytes > self._memory_limit
                )
                and self._held < self._max_transactions
            ):
                break
            self._room.clear()
            self._sinks_buffered = None  # the sinks drain meanwhile: look again
            if not buffered:
                await self._room.wait()
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._room.wait(), _BUFFER_TICK)
        self._held += 1
        self._held_bytes += txn.mem_bytes
        self._stats.queued_bytes = self._held_bytes
        self._waiting.append(txn)
        self._progress.set()

    def close(self) -> None:
        """Nothing more comes: ``run`` returns once what was put is handed over."""
        self._waiting.append(None)
        self._progress.set()

    @property
    def idle(self) -> bool:
        """Nothing waiting to be built (the sinks may still be writing)."""
        return not self._waiting and self._building is None

    # -- running -----------------------------------------------------------------------------

    async def run(self) -> None:
        tasks = [
            asyncio.create_task(self._consume(i), name=f"sink-{i}-{sink.type_name}")
            for i, sink in enumerate(self.sinks)
        ]
        try:
            for done in asyncio.as_completed(tasks):
                await done  # the first failure propagates
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def request_flush(self) -> None:
        """Flush every sink holding something not durable at its next commit or idle moment,
        without waiting for ``flush_interval`` (the incremental snapshot asks, with its chunks
        in flight at their bound, so that recording its progress does not wait a whole
        interval)."""
        self._flush_wanted = [True] * len(self.sinks)
        self._progress.set()

    async def flush_all(self) -> None:
        """Make everything handed over durable in every sink."""
        for i in range(len(self.sinks)):
            await self._flush(i)

    def poll_durable(self) -> None:
        """Tell the tracker what each sink holds durably now."""
        before = self._tracker.durable_lsn()
        for i, sink in enumerate(self.sinks):
            lsn = sink.durable_lsn()
            self._tracker.durable(i, lsn)
            self._stats.sinks[i].durable_lsn = lsn
        if self._tracker.durable_lsn() > before:
            for listener in self.on_durable:
                listener()

    # -- building items ----------------------------------------------------------------------

    def _take(self, i: int) -> tuple[int, Any] | None:
        """The next item for sink ``i``, built now if it is the first to need it; None when
        there is none yet or the window is full."""
        window = self._window
        item = window.peek(i)
        while item is None and not window.full and self._build_one():
            item = window.peek(i)
        return item

    def _build_one(self) -> bool:
        """Append the next item of the waiting transactions to the window; False: none."""
        while True:
            building = self._building
            if building is None:
                if not self._waiting:
                    return False
                building = self._building = self._items(self._waiting.popleft())
            item = next(building, None)
            if item is not None:
                self._window.append(item)
                self._progress.set()
                return True
            self._building = None

    def _items(self, txn: Transaction | None) -> Iterator[tuple[int, Any]]:
        if txn is None:
            yield (_END, None)
            return
        if txn.begins and txn.ends and txn.size <= _WHOLE_CHANGES:
            self._cursor = None
            run = [txn]
            changes = txn.size
            waiting = self._waiting
            if txn.kind in _RUN_KINDS:  # and the small transactions waiting behind it
                while waiting:
                    after = waiting[0]
                    if (
                        after is None
                        or not (after.begins and after.ends)
                        or after.kind not in _RUN_KINDS
                        or changes + after.size > _WHOLE_CHANGES
                    ):
                        break
                    waiting.popleft()
                    run.append(after)
                    changes += after.size
            whole: list[tuple[Transaction, list[Any]]]
            if self._events_wanted:
                whole = [(t, list(self._event_batches(t))) for t in run]
                self._count(sum(len(batch) for _, batches in whole for batch in batches))
            else:
                whole = [(t, list(_record_batches(t))) for t in run]
                for _, batches in whole:
                    for records in batches:
                        self._count_changes(records)
            yield (_WHOLE, whole)
            return
        if txn.begins:
            self._cursor = None if txn.ends else EventCursor()
            yield (_BEGIN, txn)
        # the last reading of a large transaction's changes: one held in memory in the compact
        # form frees its chunks as they are read, while the sinks' buffers fill (docs/guarantees.md)
        if self._events_wanted:
            for batch in self._event_batches(txn, cursor=self._cursor, last=True):
                self._count(len(batch))
                yield (_WRITE, batch)
        else:
            for records in _record_batches(txn, last=True):
                self._count_changes(records)
                yield (_WRITE, records)
        yield (_COMMIT, txn) if txn.ends else (_PART, txn)

    def _event_batches(
        self, txn: Transaction, cursor: EventCursor | None = None, last: bool = False
    ) -> Iterator[Sequence[ChangeEvent]]:
        """The events of ``txn`` in batches: a chunk of an incremental snapshot (rows of one
        table) as :class:`~cdcd.events.snapshot_run.SnapshotRun` s, whose records the JSON
        Lines writer makes in one call (docs/development.md), as the initial snapshot
        does; any other from the encoder (the same events either way)."""
        if txn.kind != "snapshot":
            yield from self._encoder.batches(txn, cursor=cursor, last=last)
            return
        if txn.rows is not None:  # in the batches they were read in: no record per row
            relation, batches = txn.rows
            first = 0
            for batch in batches:
                yield self._encoder.snapshot_run(
                    relation,
                    batch,
                    commit_lsn=txn.commit_lsn,
                    commit_time=txn.commit_time,
                    first_seq=first,
                )
                first += len(batch)
            return
        rows = [record.change.new for record in txn.changes()]  # type: ignore[union-attr]
        if not rows:
            return
        relation = next(txn.changes()).relations[0]
        for first in range(0, len(rows), _SNAPSHOT_BATCH):
            yield self._encoder.snapshot_run(
                relation,
                rows[first : first + _SNAPSHOT_BATCH],
                commit_lsn=txn.commit_lsn,
                commit_time=txn.commit_time,
                first_seq=first,
            )

    def _could_take(self, i: int) -> bool:
        window = self._window
        return window.peek(i) is not None or (
            not window.full and (self._building is not None or bool(self._waiting))
        )

    async def _wait(self, i: int, timeout: float) -> bool:
        """Until sink ``i`` may have an item (False) or ``timeout`` seconds passed (True)."""
        progress = self._progress
        progress.clear()
        if self._could_take(i):
            return False
        expired = False

        def expire() -> None:
            nonlocal expired
            expired = True
            progress.set()

        timer = asyncio.get_running_loop().call_later(timeout, expire)
        try:
            await progress.wait()
        finally:
            timer.cancel()
        return expired and not self._could_take(i)

    def _released(self, kind: int, txn: Transaction) -> None:
        """Every sink has been handed all of ``txn`` (a transaction, or a part of one)."""
        txn.release()
        self._held -= 1
        self._held_bytes -= txn.mem_bytes
        stats = self._stats
        stats.queued_bytes = self._held_bytes
        self._room.set()
        if kind == _PART:
            return
        stats.transactions += 1
        stats.last_commit_time_us = txn.commit_time
        if self._latency is not None:
            self._latency.handed(txn.end_lsn, txn.commit_time)
            # a sink durable at commit (null) told its listener before the handing was known
            self._latency.durable(min(sink.durable_lsn() for sink in self.sinks))

    def _count(self, events: int) -> None:
        """Per table and op counters (logical messages count under ``_messages``), as the
        encoder counted the events it made."""
        stats = self._stats
        stats.events += events
        for table, op, n in self._encoder.take_counts():
            stats.count(table, op, n)

    def _count_changes(self, records: Sequence[ChangeRecord]) -> None:
        """:meth:`_count` without events: per change (an Update of the key counts as ``u``),
        summed over the batch first (by Relation object: the changes of one table share it);
        a snapshot chunk's rows as ``r``, as their events count."""
        stats = self._stats
        stats.events += len(records)
        if isinstance(records, _SnapshotRecords):
            stats.count(
                f"{schema_name(records.relation)}.{records.relation.name}", "r", len(records)
            )
            return
        counts: dict[tuple[int, str], list[Any]] = {}
        for record in records:
            op = _CHANGE_OPS[type(record.change)]
            if op == "m":
                stats.count("_messages", "m")
                continue
            for rel in record.relations:  # one for a row change, each table for a Truncate
                key = (id(rel), op)  # the records keep their Relations alive meanwhile
                entry = counts.get(key)
                if entry is None:
                    counts[key] = [rel, 1]
                else:
                    entry[1] += 1
        for (_, op), (rel, n) in counts.items():
            stats.count(f"{schema_name(rel)}.{rel.name}", op, n)

    # -- one task per sink -------------------------------------------------------------------

    async def _consume(self, i: int) -> None:
        sink = self.sinks[i]
        stats = self._stats.sinks[i]
        window = self._window
        write = sink.write if self._events_wanted else sink.write_changes
        spent = 0.0
        while True:
            item = self._take(i)
            if item is None:
                if await self._wait(i, _IDLE_TICK):
                    await self._maybe_flush(i, idle=True, quiet=True)
                continue
            kind, payload = item
            if kind == _END:
                return
            if kind == _PART:
                if window.advance(i):
                    self._progress.set()
                # let the loop read the socket between parts: the server keeps sending while
                # the sinks work through a transaction still arriving
                await asyncio.sleep(0)
                continue
            t0 = time.perf_counter()
            handed = 1  # transactions this item completes
            if kind == _WHOLE:
                run = payload
                handed = len(run)
                payload = run[-1][0]
                if self._whole_runs[i]:
                    calls: tuple[tuple[Callable[[Any], Awaitable[None]], Any], ...] = (
                        (sink.write_transactions, run),
                    )
                else:
                    calls = tuple(
                        call
                        for txn, batches in run
                        for call in (
                            (sink.begin, txn),
                            *((write, batch) for batch in batches),
                            (sink.commit, txn),
                        )
                    )
            else:
                method = write if kind == _WRITE else sink.begin if kind == _BEGIN else sink.commit
                calls = ((method, payload),)
            for call, arg in calls:
                self._sinks_buffered = None
                try:
                    await call(arg)
                except TransientSinkError as exc:  # again after a backoff, until it passes
                    await retrying(partial(call, arg), call.__name__, stats, exc)
            self._sinks_buffered = None
            spent += time.perf_counter() - t0
            if window.advance(i):
                self._progress.set()
            if kind == _WRITE and type(payload) in _SNAPSHOT_BATCHES:
                # let the loop read between a snapshot chunk's batches: rendered in one go, a
                # chunk held the loop long enough for the server's COPY of the next chunk to
                # fill the socket and wait (docs/snapshots.md, "Backfill speed")
                await asyncio.sleep(0)
            if kind in (_COMMIT, _WHOLE):
                # per transaction (of a run: its mean)
                stats.write_seconds.observe_many(spent / handed, handed)
                spent = 0.0
                self._tracker.handed(i, payload.end_lsn)
                stats.handed_lsn = max(stats.handed_lsn, payload.end_lsn)
                idle = window.peek(i) is None and self.idle
                await self._maybe_flush(i, idle=idle, quiet=False)

    async def _maybe_flush(self, i: int, *, idle: bool, quiet: bool) -> None:
        tracker = self._tracker
        if tracker.pending(i):  # a sink durable at commit (null), or acknowledged (Kafka)
            tracker.durable(i, self.sinks[i].durable_lsn())
        if not tracker.pending(i):  # nothing to flush
            return
        if self._flush_wanted[i]:
            self._flush_wanted[i] = False
            await self._flush(i)
            return
        sink = self.sinks[i]
        if not quiet and sink.flushes_itself:
            return
        interval = sink.flush_interval
        if time.monotonic() - self._last_flush[i] >= interval or (idle and interval == 0):
            await self._flush(i)

    async def _flush(self, i: int) -> None:
        sink = self.sinks[i]
        stats = self._stats.sinks[i]
        t0 = time.perf_counter()
        await retrying(sink.flush, "flush", stats)
        stats.flush_seconds.observe(time.perf_counter() - t0)
        self._last_flush[i] = time.monotonic()
        lsn = sink.durable_lsn()
        self._tracker.durable(i, lsn)
        stats.durable_lsn = lsn
        if self._latency is not None:
            self._latency.durable(self._tracker.durable_lsn())


def _record_batches(
    txn: Transaction, size: int = 1000, last: bool = False
) -> Iterator[Sequence[ChangeRecord]]:
    """The decoded changes of ``txn`` in lists of at most ``size`` (never empty); ``last``:
    read for the last time (Transaction.take_changes). A snapshot chunk's rows come in the
    batches they were read in, each record made only when asked for."""
    if txn.rows is not None:
        relation, batches = txn.rows
        for rows in batches:
            yield _SnapshotRecords(txn.commit_lsn, relation, rows)
        return
    changes = txn.take_changes() if last else txn.changes()
    while batch := list(islice(changes, size)):
        yield batch


class _SnapshotRecords(Sequence[ChangeRecord]):
    """Rows of a snapshot chunk as Inserts at ``lsn``, each made when asked for: the null
    sink only counts them."""

    __slots__ = ("lsn", "relation", "rows")

    def __init__(self, lsn: int, relation: ev.Relation, rows: Sequence[ev.TupleData]) -> None:
        self.lsn = lsn
        self.relation = relation
        self.rows = rows

    def _record(self, row: ev.TupleData) -> ChangeRecord:
        return ChangeRecord(self.lsn, ev.Insert(None, self.relation.oid, row), (self.relation,))

    def __len__(self) -> int:
        return len(self.rows)

    @overload
    def __getitem__(self, index: int) -> ChangeRecord: ...

    @overload
    def __getitem__(self, index: slice) -> list[ChangeRecord]: ...

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self._record(row) for row in self.rows[index]]
        return self._record(self.rows[index])


#: the batches of a snapshot chunk's rows (the sink task yields to the loop after each)
_SNAPSHOT_BATCHES = frozenset({SnapshotRun, _SnapshotRecords})
