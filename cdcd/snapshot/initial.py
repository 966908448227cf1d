"""Orchestrating the initial snapshot: every published table read at the slot's exported
snapshot and handed to the sinks as one pseudo-transaction of ``op: "r"`` events (how rows are
read: :mod:`cdcd.source.snapshot`). Their position is just before the consistent point
(``commit_lsn`` = point - 1: a transaction may commit at the point itself); the pseudo-transaction
is acknowledged at the point.

``snapshot.workers`` connections each open ``REPEATABLE READ`` and import the exported snapshot
(``SET TRANSACTION SNAPSHOT``) while the replication connection that exported it stays idle, so
every worker sees the same state. The tables are split into block-range chunks; workers take
the next chunk in turn, and one writer hands the chunks to the sinks in chunk order (table by
table), so ``seq`` counts the rows densely in that order, as with one reader, whatever order the
reads finish in. Rows read ahead of the writer wait in memory: two batches per worker at most,
within half of ``buffer.memory_limit`` (the sinks have the other half) plus one batch; a batch
of the chunk the writer is at always gets through, so read-ahead can never block it. One worker
reads each table whole.

It runs before streaming starts, so it writes to the sinks directly, one after the other,
retrying :class:`~cdcd.errors.TransientSinkError` as the writer does. The progress tracker counts
the snapshot in flight until every sink holds the consistent point durably; the state file
records it finished only after that.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any, Protocol

import structlog

from cdcd.assembler.transaction import ChangeRecord, Transaction
from cdcd.config import Config
from cdcd.decoder.events import Truncate, TupleData
from cdcd.events.encoder import Encoder
from cdcd.lsn import format_lsn, unix_to_pg_us
from cdcd.sinks.base import Sink
from cdcd.sinks.retry import retrying
from cdcd.snapshot.initial_progress import InitialProgress, key_indexes
from cdcd.source import open_sql
from cdcd.source.catalog import LiveCatalog
from cdcd.source.snapshot import (
    SnapshotTable,
    TableChunk,
    copy_chunk,
    key_chunks,
    published_tables,
    table_chunks,
    usable_key,
)
from cdcd.stats import Stats

log = structlog.get_logger("cdcd.snapshot")


class Writer(Protocol):
    """What the snapshot needs of the pipeline's writer (:class:`cdcd.pipeline.writer.Writer`)."""

    @property
    def sinks(self) -> Sequence[Sink]: ...

    async def flush_all(self) -> None: ...


class Tracker(Protocol):
    """What the snapshot tells the progress tracker (:class:`cdcd.pipeline.progress.ProgressTracker`)."""

    def snapshot_started(self, point: int) -> None: ...

    def handed(self, sink: int, end_lsn: int) -> None: ...


class _Chunks:
    """The chunks' rows between the workers and the writer. ``position``: the chunk the writer
    is at. A worker's rows wait for room (``limit`` bytes, ``most`` batches), except one batch of
    the chunk the writer is at: workers take chunks in order, so that chunk is being read (or
    done), and the writer can always go on; memory stays within ``limit`` plus one batch."""

    def __init__(self, count: int, limit: int, most: int) -> None:
        self.batches: list[deque[tuple[Sequence[TupleData], int]]] = [deque() for _ in range(count)]
        self.done = [False] * count
        self.position = 0
        self.held = 0
        self.queued = 0
        self.limit = limit
        self.most = most
        self.changed = asyncio.Condition()

    async def put(self, index: int, rows: Sequence[TupleData], size: int) -> None:
        """Rows of chunk ``index`` and their accounted bytes."""
        if self.done[index]:  # the writer may have gone past it: fail, never lose them
            raise RuntimeError(f"snapshot chunk {index}: rows read after it was finished")
        async with self.changed:
            await self.changed.wait_for(
                lambda: (
                    (self.held + size <= self.limit and self.queued < self.most)
                    or (index == self.position and not self.batches[index])
                )
            )
            self.held += size
            self.queued += 1
            self.batches[index].append((rows, size))
            self.changed.notify_all()

    async def finish(self, index: int) -> None:
        async with self.changed:
            self.done[index] = True
            self.changed.notify_all()

    async def take(self, index: int) -> Sequence[TupleData] | None:
        """The next rows of chunk ``index`` (the writer's position), None once it is done."""
        async with self.changed:
            if self.position != index:
                self.position = index
                self.changed.notify_all()
            await self.changed.wait_for(lambda: bool(self.batches[index]) or self.done[index])
            if not self.batches[index]:
                return None
            rows, size = self.batches[index].popleft()
            self.held -= size
            self.queued -= 1
            self.changed.notify_all()
            return rows


class ReaderTuner:
    """How many of ``most`` workers read at once: as many as raise the rate. It starts with
    one and, after each window, keeps the one just added if the rate rose by ``gain`` (5 %) or
    more and tries one more; else it goes back to the best count and stays there. More readers
    pay where the server is the limit (a database with cores to spare); where cdcd is (one
    process: decoding, encoding, writing), they only add server backends competing for the
    same cores and interleaved streams, and make it slower (docs/snapshots.md)."""

    def __init__(self, most: int, gain: float = 1.05, *, tune: bool = True) -> None:
        self.most = most
        self.gain = gain
        self.active = 1 if tune else most  # not tuned (snapshot.tune_workers off): all of them
        self.settled = most <= 1 or not tune
        self._best_rate = 0.0
        self._best = 1

    def observe(self, rate: float) -> int:
        """The rate (rows/s) of the window just ended with ``active`` readers; the readers for
        the next one."""
        if self.settled:
            return self.active
        if self.active == 1 or rate >= self._best_rate * self.gain:
            self._best_rate, self._best = rate, self.active
            if self.active < self.most:
                self.active += 1
            else:
                self.settled = True
        else:
            self.active = self._best
            self.settled = True
        return self.active


def take_chunks(chunks: list[TableChunk], index: int, alone: bool) -> tuple[TableChunk, int]:
    """What a reader reads next from ``chunks[index]``, and the index after it: that chunk;
    or, ``alone`` (the one reader for good), the rest of its table in one read (a plain scan,
    one COPY, instead of TID ranges)."""
    chunk = chunks[index]
    after = index + 1
    if alone:
        while after < len(chunks) and chunks[after].table is chunk.table:
            after += 1
        if after > index + 1:
            last = chunks[after - 1]
            chunk = dataclasses.replace(chunk, end=last.end, upto=last.upto)
    return chunk, after


#: seconds of reading per measurement of :class:`ReaderTuner`
_TUNE_WINDOW = 1.0


async def _open_at_snapshot(config: Config, source: Any, snapshot_name: str) -> Any:
    """A connection inside a read-only ``REPEATABLE READ`` transaction at the exported snapshot."""
    conn = await open_sql(source.params, config.source.connect_timeout)
    try:
        await conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        literal = "'" + snapshot_name.replace("'", "''") + "'"
        await conn.execute(f"SET TRANSACTION SNAPSHOT {literal}")
        # tables with a key are read in key order: along the key's index, never a sort of
        # the whole table (which would first spill it to disk)
        await conn.execute("SET LOCAL enable_sort = off")
    except BaseException:
        conn.terminate()
        raise
    return conn


async def _resets(
    tables: Sequence[SnapshotTable],
    catalog: LiveCatalog,
    encoder: Encoder,
    point: int,
    commit_time: int,
) -> list[Any]:
    """The reset of every table (``op: "t"``, ``source.snapshot: "reset"``, as
    :mod:`cdcd.pipeline.recreate` emits for a recreated slot) at the head of a snapshot taken
    again: ``(point - 1, 0..)``, before its rows. An earlier attempt's rows sit at its own,
    earlier slot's point, so consumers drop them (rows deleted since included) and keep
    this attempt's."""
    records = []
    for table in tables:
        rel = table.relation
        await catalog.on_relation(rel)
        records.append(ChangeRecord(point - 1, Truncate(None, 0, (rel.oid,)), (rel,)))
    reset = Transaction(
        kind="reset",
        xid=0,
        commit_lsn=point - 1,
        end_lsn=point,
        commit_time=commit_time,
        size=len(records),
        _records=records,
    )
    return list(encoder.events(reset))


def _name(table: SnapshotTable) -> str:
    return f"{table.relation.namespace}.{table.relation.name}"


async def initial_snapshot(
    config: Config,
    source: Any,
    plan: Any,
    writer: Writer,
    encoder: Encoder,
    catalog: LiveCatalog,
    tracker: Tracker,
    stats: Stats,
) -> None:
    """Read every published table at ``plan``'s exported snapshot into every sink."""
    sinks = writer.sinks

    async def each_sink(what: str, call: Callable[[Any], Awaitable[None]]) -> None:
        for sink, sink_stats in zip(sinks, stats.sinks, strict=True):
            await retrying(partial(call, sink), what, sink_stats)

    cfg = config.snapshot
    point = plan.consistent_point
    tracker.snapshot_started(point)
    log.info("initial snapshot starting", consistent_point=format_lsn(point), workers=cfg.workers)
    started = time.monotonic()
    conns: list[Any] = []
    try:  # opened one after the other: the first failure stops the rest
        for _ in range(cfg.workers):
            conns.append(await _open_at_snapshot(config, source, plan.name))
        tables = [  # under keyless_tables: insert_only, the insert-only twin's too
            table
            for name in config.source.publication_names()
            for table in await published_tables(conns[0], name)
        ]
        # Tables with a usable key are read in key order, so that what is durable can be
        # recorded as "every row up to this key" and an interruption resumes after it; those
        # without one first, since an interruption before they are done takes it all again.
        keys = {}
        for table in tables:
            key = await usable_key(conns[0], table)
            if key is not None:
                keys[_name(table)] = key
        tables.sort(key=lambda t: _name(t) in keys)
        chunks: list[TableChunk] = []
        for table in tables:  # one worker reads tables whole: ranges would only cost
            key = keys.get(_name(table))
            if cfg.workers == 1:
                chunks.append(TableChunk(table, None, None, None if key is None else tuple(key)))
            elif key is not None:
                chunks += await key_chunks(conns[0], table, key, cfg.initial_chunk_rows)
            else:
                chunks += await table_chunks(conns[0], table, cfg.initial_chunk_rows)
        progress = InitialProgress(
            {
                _name(t): key_indexes([c.name for c in t.relation.columns], keys[_name(t)])
                for t in tables
                if _name(t) in keys
            },
            cfg.chunk_rows,
        )
        await asyncio.to_thread(plan.state.progress, point, {})
        commit_time = unix_to_pg_us(int(time.time() * 1_000_000))
        txn = Transaction(
            kind="snapshot",
            xid=0,
            commit_lsn=point - 1,  # a commit can start at the point (cdcd.source.snapshot)
            end_lsn=point,
            commit_time=commit_time,
            size=0,
        )
        # Read-ahead beyond a batch or two per worker gains nothing (the encoding is the
        # bottleneck) and costs: many live rows make every garbage collection longer.
        queue = _Chunks(len(chunks), config.buffer.memory_limit // 2, 2 * cfg.workers)
        next_chunk = 0
        written = 0  # rows handed to the sinks, for the tuner
        tuner = ReaderTuner(min(cfg.workers, len(chunks)), tune=cfg.tune_workers)
        readers = asyncio.Condition()  # tuner.active changed

        async def read(conn: Any, number: int) -> None:
            nonlocal next_chunk

            def my_turn() -> bool:
                return number < tuner.active or next_chunk >= len(chunks)

            while next_chunk < len(chunks):
                if number >= tuner.active:  # not needed now: the tuner may call on it later
                    async with readers:
                        await readers.wait_for(my_turn)
                    continue
                index = next_chunk
                chunk, after = take_chunks(chunks, index, tuner.settled and tuner.active == 1)
                next_chunk = after  # (the other readers move it on while this one reads)
                await copy_chunk(conn, chunk, partial(queue.put, index), cfg.batch_rows)
                for taken in range(index, after):  # those merged have no rows of their own
                    await queue.finish(taken)
            async with readers:
                readers.notify_all()  # the others waiting for their turn: nothing is left

        async def tune() -> None:
            """One more reader while it raises the rate (:class:`ReaderTuner`)."""
            while not tuner.settled and next_chunk < len(chunks):
                before, since = written, time.monotonic()
                await asyncio.sleep(_TUNE_WINDOW)
                rate = (written - before) / (time.monotonic() - since)
                was = tuner.active
                if tuner.observe(rate) != was:
                    async with readers:
                        readers.notify_all()
                log.debug("snapshot readers", readers=was, rows_per_s=round(rate))

        async def record(handed: int, entries: dict[str, dict[str, Any]]) -> None:
            """Make what is handed durable in every sink, then record it (InitialProgress)."""
            await each_sink("flush", lambda sink: sink.flush())
            await asyncio.to_thread(plan.state.progress, point, entries)
            progress.recorded(handed)

        recording: asyncio.Task[None] | None = None
        # the flush goes on while the writer does, where every sink allows it (a Kafka
        # transaction's commit must not take what is written meanwhile)
        background = all(sink.flushes_while_writing for sink in sinks)

        async def checkpoint() -> None:
            """A record every so often; the writer waits while too much is not durable."""
            nonlocal recording
            if recording is not None and (recording.done() or progress.must_wait()):
                await recording
                recording = None
            if recording is None and progress.due():
                recording = asyncio.create_task(record(*progress.take()))
                if progress.must_wait() or not background:
                    await recording
                    recording = None

        async def write() -> int:
            try:
                return await write_all()
            except asyncio.CancelledError:  # a stop request: record what was handed
                with contextlib.suppress(Exception):
                    if recording is not None:  # cancelled with us if we were awaiting it
                        await asyncio.gather(recording, return_exceptions=True)
                    if progress.handed > progress.durable:  # that record included
                        await record(*progress.take())
                    log.info("initial snapshot stopped; recorded", rows=progress.durable)
                raise
            finally:
                if recording is not None and not recording.done():
                    recording.cancel()
                    await asyncio.gather(recording, return_exceptions=True)

        async def write_all() -> int:
            pending: tuple[Any, Sequence[TupleData], str] | None = None
            ends: dict[str, Sequence[TupleData]] = {}  # a table is done once this is handed
            seq = 0

            async def emit(relation: Any, rows: Sequence[TupleData], name: str, last: bool) -> None:
                nonlocal seq, written
                events = encoder.snapshot_run(  # events made as a sink asks for them
                    relation,
                    rows,
                    commit_lsn=point - 1,
                    commit_time=commit_time,
                    first_seq=seq,
                    last=last,
                )
                seq += len(events)
                await each_sink("write", lambda sink: sink.write(events))
                written = seq
                stats.events += len(events)
                for table, op, n in encoder.take_counts():  # the encoder counts what it makes
                    stats.count(table, op, n)
                progress.hand(name, rows)
                if ends.get(name) is rows:
                    progress.finish(name)
                await checkpoint()

            await each_sink("begin", lambda sink: sink.begin(txn))
            if plan.reset:  # an earlier attempt's rows may be in the sinks: forget them first
                resets = await _resets(tables, catalog, encoder, point, commit_time)
                seq = len(resets)
                await each_sink("write", lambda sink: sink.write(resets))
                stats.events += seq
                for table, op, n in encoder.take_counts():
                    stats.count(table, op, n)
                log.warning(
                    "the earlier initial snapshot did not finish: every published table is "
                    "reset first, so that consumers forget its rows",
                    tables=len(tables),
                )
            described = None
            for index, chunk in enumerate(chunks):
                relation = chunk.table.relation
                name = _name(chunk.table)
                if relation is not described:
                    described = relation
                    await catalog.on_relation(relation)
                while (rows := await queue.take(index)) is not None:
                    if pending is not None:
                        await emit(*pending, last=False)
                    pending = (relation, rows, name)
                if index + 1 == len(chunks) or chunks[index + 1].table is not chunk.table:
                    if pending is not None and pending[2] == name:
                        ends[name] = pending[1]
                    else:
                        progress.finish(name)
            if pending is not None:
                await emit(*pending, last=True)
            if recording is not None:  # its flush, before the commit
                await recording
            await each_sink("commit", lambda sink: sink.commit(txn))
            return seq

        tasks = [
            asyncio.create_task(write()),
            *(asyncio.create_task(read(c, i)) for i, c in enumerate(conns)),
        ]
        tuning = asyncio.create_task(tune())
        try:  # the first failure as it is (a sink's error keeps its type and exit code)
            rows_total, *_ = await asyncio.gather(*tasks)
        except BaseException:
            # A stop (this task cancelled) cancelled the gathered tasks already; cancelling
            # the writer again would cut short the record it makes of what it handed.
            current = asyncio.current_task()
            if current is None or not current.cancelling():
                for task in tasks:
                    task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        finally:
            tuning.cancel()
        for i in range(len(sinks)):
            tracker.handed(i, point)
        await writer.flush_all()
        plan.state.finish(point)
    except BaseException:
        for conn in conns:
            conn.terminate()  # a COPY may be under way: no orderly goodbye
        raise
    for conn in conns:
        await conn.close()
    log.info(
        "initial snapshot done",
        rows=rows_total,
        tables=len(tables),
        chunks=len(chunks),
        readers=tuner.active,  # at the end (snapshot.tune_workers)
        seconds=round(time.monotonic() - started, 3),
    )
