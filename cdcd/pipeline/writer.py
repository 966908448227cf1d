"""The writer: committed transactions fanned out to every sink, each at its own pace.

::

    reader ──put(txn)──▶ transactions ──producer: events (or decoded changes), encoded once──▶
        fan-out window ──▶ one task per sink: begin ▶ write ... ▶ commit ▶ flush when due

* Transactions wait here bounded by ``buffer.memory_limit`` (their accounted bytes) and
  ``buffer.queue_transactions``; one transaction always fits. A transaction is released (its
  memory and spill file freed) once every sink has been handed all of it.
* Events are built once and shared: the producer puts them into a window of at most
  ``window`` items (begin, a batch of events, commit); each sink's task takes them in order.
  A slow or retrying sink holds the producer back only when it is a whole window behind, so the
  others keep writing meanwhile; the confirmable position is the minimum of the sinks' durable
  positions (:mod:`cdcd.pipeline.progress`).
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
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from functools import partial
from itertools import islice
from typing import Any, TypeVar

import structlog

from cdcd.assembler.transaction import ChangeRecord, Transaction
from cdcd.benchlog import LatencyLog
from cdcd.decoder import events as ev
from cdcd.errors import TransientSinkError
from cdcd.pipeline.progress import ProgressTracker
from cdcd.sinks.base import Sink
from cdcd.sinks.catalog import schema_name
from cdcd.sinks.encoding import Encoder
from cdcd.stats import SinkStats, Stats

log = structlog.get_logger("cdcd.writer")

T = TypeVar("T")

_BEGIN, _WRITE, _COMMIT, _END = range(4)
#: seconds a sink task waits for work before it looks at flushing again
_IDLE_TICK = 0.1
#: the op each kind of change counts under in Stats.events_by when no events are built
_CHANGE_OPS: dict[type, str] = {
    ev.Insert: "c",
    ev.Update: "u",
    ev.Delete: "d",
    ev.Truncate: "t",
    ev.Message: "m",
}


async def retrying(call: Callable[[], Awaitable[T]], what: str, stats: SinkStats) -> T:
    """``await call()``, again after a backoff (0.5 s doubling to 10 s) while it raises
    :class:`TransientSinkError`."""
    delay = 0.5
    while True:
        try:
            return await call()
        except TransientSinkError as exc:
            stats.retries += 1
            log.warning(
                "sink call failed; retrying",
                sink=stats.type_name,
                call=what,
                error=str(exc),
                backoff_s=delay,
            )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 10.0)


class _Fanout:
    """Items in order, read by several consumers at their own pace; an item is dropped once
    every consumer is past it. ``publish`` waits while the slowest is ``window`` behind."""

    def __init__(self, consumers: int, window: int, on_dropped: Callable[[Any], None]) -> None:
        self._items: deque[tuple[int, Any]] = deque()
        self._base = 0  # index of _items[0]
        self._cursors = [0] * consumers
        self._wake = [asyncio.Event() for _ in range(consumers)]
        self._room = asyncio.Event()
        self._window = window
        self._on_dropped = on_dropped

    async def publish(self, kind: int, payload: Any) -> None:
        while len(self._items) >= self._window:
            self._room.clear()
            await self._room.wait()
        self._items.append((kind, payload))
        for wake in self._wake:
            wake.set()

    def peek(self, consumer: int) -> tuple[int, Any] | None:
        pos = self._cursors[consumer] - self._base
        return self._items[pos] if pos < len(self._items) else None

    def advance(self, consumer: int) -> None:
        """Consumer ``consumer`` is done with the item ``peek`` gave it."""
        cursors = self._cursors
        cursors[consumer] += 1
        items = self._items
        while items and min(cursors) > self._base:
            kind, payload = items.popleft()
            self._base += 1
            if kind == _COMMIT:
                self._on_dropped(payload)
            self._room.set()

    async def wait(self, consumer: int, timeout: float) -> bool:
        """Until an item is there for ``consumer`` (False) or ``timeout`` seconds passed (True)."""
        wake = self._wake[consumer]
        wake.clear()
        if self.peek(consumer) is not None:
            return False
        try:
            await asyncio.wait_for(wake.wait(), timeout)
        except TimeoutError:
            return True
        return False


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
        window: int = 32,
        latency: LatencyLog | None = None,
    ) -> None:
        self.sinks = sinks
        self._encoder = encoder
        self._tracker = tracker
        self._stats = stats
        self._memory_limit = memory_limit
        self._max_transactions = max(1, max_transactions)
        self._latency = latency
        self._waiting: deque[Transaction | None] = deque()  # put, not yet taken by the producer
        self._arrived = asyncio.Event()
        self._room = asyncio.Event()
        self._held = 0  # transactions put and not yet released
        self._held_bytes = 0
        self._producing = False
        self._fanout = _Fanout(len(sinks), window, self._released)
        if len(stats.sinks) != len(sinks):
            stats.sinks[:] = [SinkStats(sink.type_name) for sink in sinks]
        self._last_flush = [0.0] * len(sinks)
        # no sink wants events (the null sink alone): hand over decoded changes, build no events
        self._events_wanted = any(sink.wants_events for sink in sinks)

    # -- the reader's side -------------------------------------------------------------------

    @property
    def queued_transactions(self) -> int:
        """Transactions put and not yet handed to every sink."""
        return self._held

    async def put(self, txn: Transaction) -> None:
        """Queue ``txn``; waits while the transactions held here would pass the limits."""
        while self._held and (
            self._held_bytes + txn.mem_bytes > self._memory_limit
            or self._held >= self._max_transactions
        ):
            self._room.clear()
            await self._room.wait()
        self._held += 1
        self._held_bytes += txn.mem_bytes
        self._stats.queued_bytes = self._held_bytes
        self._waiting.append(txn)
        self._arrived.set()

    def close(self) -> None:
        """Nothing more comes: ``run`` returns once what was put is handed over."""
        self._waiting.append(None)
        self._arrived.set()

    @property
    def idle(self) -> bool:
        """Nothing waiting and the producer not busy (the sinks may still be writing)."""
        return not self._waiting and not self._producing

    # -- running -----------------------------------------------------------------------------

    async def run(self) -> None:
        tasks = [asyncio.create_task(self._produce(), name="writer-producer")]
        tasks += [
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

    async def flush_all(self) -> None:
        """Make everything handed over durable in every sink."""
        for i in range(len(self.sinks)):
            await self._flush(i)

    def poll_durable(self) -> None:
        """Tell the tracker what each sink holds durably now."""
        for i, sink in enumerate(self.sinks):
            lsn = sink.durable_lsn()
            self._tracker.durable(i, lsn)
            self._stats.sinks[i].durable_lsn = lsn

    # -- the producer ------------------------------------------------------------------------

    async def _produce(self) -> None:
        fanout = self._fanout
        while True:
            while not self._waiting:
                self._arrived.clear()
                await self._arrived.wait()
            txn = self._waiting.popleft()
            if txn is None:
                await fanout.publish(_END, None)
                return
            self._producing = True
            await fanout.publish(_BEGIN, txn)
            if self._events_wanted:
                for batch in self._encoder.batches(txn):
                    self._count(batch)
                    await fanout.publish(_WRITE, batch)
            else:
                for records in _record_batches(txn):
                    self._count_changes(records)
                    await fanout.publish(_WRITE, records)
            await fanout.publish(_COMMIT, txn)
            self._producing = False

    def _released(self, txn: Transaction) -> None:
        """Every sink has been handed all of ``txn``."""
        txn.release()
        self._held -= 1
        self._held_bytes -= txn.mem_bytes
        stats = self._stats
        stats.queued_bytes = self._held_bytes
        stats.transactions += 1
        stats.last_commit_time_us = txn.commit_time
        if self._latency is not None:
            self._latency.handed(txn.end_lsn, txn.commit_time)
        self._room.set()

    def _count(self, events: list[Any]) -> None:
        """Per table and op counters (logical messages count under ``_messages``)."""
        stats = self._stats
        stats.events += len(events)
        events_by = stats.events_by
        for event in events:
            table = "_messages" if event.table is None else f"{event.schema}.{event.table}"
            key = (table, event.op)
            events_by[key] = events_by.get(key, 0) + 1

    def _count_changes(self, records: list[ChangeRecord]) -> None:
        """:meth:`_count` without events: per change (an Update of the key counts as ``u``)."""
        stats = self._stats
        stats.events += len(records)
        for record in records:
            op = _CHANGE_OPS[type(record.change)]
            if op == "m":
                stats.count("_messages", "m")
                continue
            for rel in record.relations:  # one for a row change, each table for a Truncate
                stats.count(f"{schema_name(rel)}.{rel.name}", op)

    # -- one task per sink -------------------------------------------------------------------

    async def _consume(self, i: int) -> None:
        sink = self.sinks[i]
        stats = self._stats.sinks[i]
        fanout = self._fanout
        write = sink.write if self._events_wanted else sink.write_changes
        spent = 0.0
        while True:
            item = fanout.peek(i)
            if item is None:
                if await fanout.wait(i, _IDLE_TICK):
                    await self._maybe_flush(i, idle=True, quiet=True)
                continue
            kind, payload = item
            if kind == _END:
                return
            t0 = time.perf_counter()
            if kind == _WRITE:
                await retrying(partial(write, payload), "write", stats)
            elif kind == _BEGIN:
                await retrying(partial(sink.begin, payload), "begin", stats)
            else:
                await retrying(partial(sink.commit, payload), "commit", stats)
            spent += time.perf_counter() - t0
            fanout.advance(i)
            if kind == _COMMIT:
                stats.write_seconds.observe(spent)
                spent = 0.0
                self._tracker.handed(i, payload.end_lsn)
                stats.handed_lsn = max(stats.handed_lsn, payload.end_lsn)
                idle = fanout.peek(i) is None and self.idle
                await self._maybe_flush(i, idle=idle, quiet=False)

    async def _maybe_flush(self, i: int, *, idle: bool, quiet: bool) -> None:
        if not self._tracker.pending(i):
            self._tracker.durable(i, self.sinks[i].durable_lsn())
            if not self._tracker.pending(i):
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


def _record_batches(txn: Transaction, size: int = 1000) -> Iterator[list[ChangeRecord]]:
    """The decoded changes of ``txn`` in lists of at most ``size`` (never empty)."""
    changes = txn.changes()
    while batch := list(islice(changes, size)):
        yield batch
