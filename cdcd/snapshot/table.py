"""One table of an incremental snapshot: its chunks, read in key order (docs/snapshots.md).

Chunk after chunk::

    arm the window ▶ low watermark ▶ COPY (SELECT ... WHERE (key) > (last) ORDER BY key
        LIMIT n) ▶ high watermark ▶ wait until the reader has reached it (cdcd.snapshot.watermarks)

With ``snapshot.workers`` > 1 the next chunk's last key is looked up first (``OFFSET n - 1`` on
the key's index), so that chunks ``(last, next]`` are read at once, each on a worker of
:class:`cdcd.snapshot.workers.Workers` between its own watermarks. A chunk gives its worker
back once its rows are read, before its window closes in the stream; each chunk waits for its
high watermark, then goes to the :class:`cdcd.snapshot.state.Ledger` to be recorded once
durable. The chunks not recorded yet stay within ``snapshot.chunks_in_flight`` (what a crash
makes emit again), their rows within half of ``buffer.memory_limit``
(:class:`cdcd.snapshot.chunk_size.ChunkSizer`).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import asyncpg
import structlog

from cdcd.config import Config
from cdcd.decoder.copy_batch import CopyBatch
from cdcd.decoder.events import TupleData
from cdcd.lsn import format_lsn
from cdcd.progress_rate import estimate_source
from cdcd.snapshot.chunk_size import ChunkSizer
from cdcd.snapshot.state import Done, IncrementalState, Ledger
from cdcd.snapshot.watermarks import WATERMARK, Chunk, ChunkResult, Watermarks, parse_snapshot
from cdcd.snapshot.workers import Control, Slot, Workers
from cdcd.source.snapshot import (
    NO_KEY,
    SnapshotTable,
    key_problem,
    next_bound,
    primary_key,
    published_tables,
    read_key_chunk,
    row_estimate,
)
from cdcd.stats import Stats, TableSnapshot

log = structlog.get_logger("cdcd.snapshot")

#: what reading a chunk of a table altered meanwhile may raise
_ALTERED = (
    asyncpg.UndefinedTableError,
    asyncpg.UndefinedColumnError,
    asyncpg.UndefinedFunctionError,
    asyncpg.DataError,
)

#: seconds between progress lines in the log
_LOG_EVERY = 5.0
#: rows of a table's first chunk (then :class:`ChunkSizer` adapts it)
_FIRST_CHUNK_ROWS = 2048
#: seconds between looks at whether the table was altered
DESCRIBE_EVERY = 2.0
#: rows per batch of a chunk (about one socket read of COPY's output): the sinks render a batch
#: at a time and the loop reads the next chunk's COPY between two (docs/snapshots.md)
_BATCH_ROWS = 1024


class _KeyChanged(Exception):
    """A chunk found the table's primary key changed (its columns or their types)."""


class Backfill(Protocol):
    """What a table's reader uses of the snapshot reading it
    (:class:`cdcd.snapshot.incremental.IncrementalSnapshot`)."""

    config: Config
    stats: Stats
    state: IncrementalState
    ledger: Ledger
    watermarks: Watermarks
    control: Control
    workers: Workers
    flush: Callable[[], None]  # ask the sinks to flush now (the writer's request_flush)

    def request(self, tables: list[str], signal_lsn: int = 0) -> None: ...

    def record_durable(self) -> None: ...


@dataclass(slots=True)
class _ChunkRead:
    """What a chunk reads: ``name``'s keys after ``after``, up to ``upto`` (else ``limit``
    rows); ``current`` holds the table as last described (a chunk that finds it altered
    describes it again)."""

    name: str
    current: list[SnapshotTable]
    key_names: tuple[str, ...]
    keys: list[tuple[str, str]]
    after: Any
    upto: Any
    limit: int


def _log_progress(name: str, progress: TableSnapshot) -> None:
    """Rows done / estimated, bytes, rate and ETA of one table's snapshot."""
    rate, eta = progress.meter.rate, progress.eta()
    known = progress.estimated_from is not None and progress.estimate > 0
    log.info(
        "incremental snapshot progress",
        table=name,
        rows=progress.rows,
        estimate=progress.estimate if progress.estimated_from is not None else None,
        estimated_from=progress.estimated_from,
        percent=min(99.9, round(100 * progress.rows / progress.estimate, 1)) if known else None,
        bytes=progress.bytes,
        rows_per_s=None if rate is None else round(rate),
        eta_s=None if eta is None else round(eta),
    )


async def read_table(snap: Backfill, name: str) -> None:
    """Snapshot table ``name`` from the key its state records, until its last chunk is
    durable (or it is removed, requested again, or its key changes)."""
    workers = snap.workers
    workers.reading.append(name)  # in the order they started (for Workers.share)
    try:
        await _TableReader(snap, name).run()
    finally:
        workers.reading.remove(name)


class _TableReader:
    def __init__(self, snap: Backfill, name: str) -> None:
        self.snap = snap
        self.name = name
        self.entry = snap.state.tables[name]

    async def run(self) -> None:
        snap, name, entry = self.snap, self.name, self.entry
        control = snap.control
        table = await control.run(self._describe)
        if table is None:
            self._removed()
            return
        key_cols = await control.run(primary_key, table.relation.oid)
        problem = (
            "source.messages is off: the watermarks are logical messages the stream must carry "
            "(turn it on)"
            if not snap.config.source.messages
            else "source.binary is on: incremental snapshots compare keys as text (turn it off)"
            if snap.config.source.binary
            else None
            if key_cols
            else NO_KEY
        )
        keys = [(str(r[0]), str(r[1])) for r in key_cols]
        if problem is None:
            problem = await control.run(key_problem, table, keys)
        if problem is not None:
            log.error(f"table not snapshotted: {problem}", table=name)
            entry["status"] = "skipped"
            snap.state.save()
            return
        if entry["status"] == "pending":
            estimate, source = await control.run(row_estimate, table)
            entry["status"] = "running"
            entry["estimate"] = estimate
            entry["estimated_from"] = source
            snap.state.save()
        key_names = tuple(str(r[0]) for r in key_cols)
        rows_done = int(entry["rows"])
        last_key = entry["last_key"]
        source = estimate_source(entry)
        log.info(
            "incremental snapshot of table",
            table=name,
            estimate=entry["estimate"] if source is not None else None,
            estimated_from=source,
            resumed_after=last_key,
        )
        progress = snap.stats.snapshots[name] = TableSnapshot(
            "running",
            rows_done,
            int(entry["estimate"] or 0),
            bytes=int(entry.get("bytes") or 0),
            estimated_from=source,
        )
        cfg = snap.config.snapshot
        workers, ledger = snap.workers, snap.ledger
        started = last_log = described = time.monotonic()
        progress.meter.add(started, rows_done)
        current = [table]  # as last described; a chunk that finds it changed describes it again
        lo = last_key  # the next chunk starts after this key
        tail: Done | None = None  # a chunk without an upper key: the next start comes from it
        ended = False
        inflight: dict[asyncio.Task[Any], tuple[Done, Slot]] = {}
        undurable = ledger.undurable[name] = []
        # each chunk's rows wait in memory until durable: a share of the buffer for each
        memory = int(snap.config.buffer.memory_limit) // (2 * cfg.chunks_in_flight)
        sizer = ChunkSizer(_FIRST_CHUNK_ROWS, cfg.chunk_rows, memory)
        keyed = asyncio.Event()  # a chunk without an upper key has read its rows

        def outcome() -> None:
            """Say how the table's reading ended: done once its last chunk is recorded (which
            the sinks' durable listener may do while cdcd is stopping), else not yet."""
            if entry["status"] == "done":
                progress.status = "done"
                log.info(
                    "incremental snapshot of table done",
                    dropped=progress.dropped,
                    chunks=progress.chunks,
                    table=name,
                    rows=rows_done,
                    bytes=progress.bytes,
                    seconds=round(time.monotonic() - started, 3),
                )
            else:  # removed, started over, or stopped before its last chunk was durable
                progress.status = entry["status"] if entry["status"] != "running" else "pending"

        try:
            while snap.state.tables.get(name) is entry and not (ended and not inflight):
                snap.record_durable()
                # bounded: what a crash makes emit again (chunks not recorded yet) stays small.
                # From half the bound on, or with no chunk left to read, the sinks are asked to
                # flush rather than left to wait for their flush_interval: the flush goes on
                # while the next chunks are read, and the bound is seldom reached
                if ended or ledger.in_flight() >= max(1, cfg.chunks_in_flight // 2):
                    snap.flush()
                if tail is not None and tail.keyed:  # its rows are read: the next start
                    lo, ended, tail = tail.last_key, tail.finished, None
                if (
                    not ended
                    and tail is None
                    and workers.free > 0
                    and sum(slot.held for _, slot in inflight.values()) < workers.share(name)
                    and ledger.in_flight() < cfg.chunks_in_flight
                ):
                    slot = workers.take()  # this chunk's worker
                    done = Done(name, -1, None, 0, False)  # end_lsn -1: not read yet
                    undurable.append(done)  # in key order: resume after durable ones
                    launched = False
                    try:
                        if time.monotonic() - described >= DESCRIBE_EVERY and not inflight:
                            described = time.monotonic()
                            latest = await control.run(self._describe)  # altered?
                            if latest is None:
                                self._removed()
                                break
                            current[0] = latest
                        # several workers: the next chunk's last key, so that it and the one
                        # after it can be read at once; one worker reads `sizer.rows` rows
                        limit = sizer.rows
                        hi = done.last_key = (
                            await control.run(next_bound, current[0], keys, lo, limit)
                            if cfg.workers > 1
                            else None
                        )
                        done.keyed = hi is not None
                        task = asyncio.create_task(
                            self._chunk(
                                _ChunkRead(name, current, key_names, keys, lo, hi, limit),
                                done,
                                slot,
                                keyed,
                                sizer,
                            )
                        )
                        task.add_done_callback(lambda _, slot=slot: slot.release())  # type: ignore[misc]
                        launched = True
                    finally:
                        if not launched:
                            slot.release()
                            undurable.remove(done)
                    inflight[task] = (done, slot)
                    if hi is None:
                        tail = done
                    else:
                        lo = hi
                    continue
                keyed.clear()
                ledger.recorded.clear()
                waiting: set[asyncio.Future[Any]] = set(inflight)
                if tail is not None:  # woken as soon as its rows are read
                    waiting.add(asyncio.ensure_future(keyed.wait()))
                # and as soon as chunks are recorded durable (the next chunk may start at once)
                waiting.add(asyncio.ensure_future(ledger.recorded.wait()))
                finished, _ = await asyncio.wait(
                    waiting, timeout=0.5 if inflight else 0.05, return_when=asyncio.FIRST_COMPLETED
                )
                for extra in waiting - set(inflight):
                    extra.cancel()
                for task in [t for t in inflight if t in finished]:
                    done, _ = inflight.pop(task)
                    try:
                        read = task.result()
                    except _KeyChanged as exc:
                        log.warning(
                            "primary key changed during the table's snapshot; it starts over",
                            table=name,
                            key=[" ".join(k) for k in exc.args[0]],
                            now=[" ".join(k) for k in exc.args[1]],
                        )
                        snap.request([name])
                        ended = True
                        continue
                    if read is None:  # the table went away
                        self._removed()
                        ended = True
                        continue
                    rows, size, result = read
                    rows_done += result.emitted
                    done.rows = rows_done
                    done.end_lsn = result.end_lsn
                    progress.rows = rows_done
                    progress.dropped += result.dropped
                    progress.chunks += 1
                    progress.bytes += size - 64 * rows  # the values' text
                    progress.meter.add(time.monotonic(), rows_done)
                    done.bytes = progress.bytes
                    if result.end_lsn:
                        log.debug(
                            "chunk queued",
                            table=name,
                            at=format_lsn(result.end_lsn),
                            rows=result.emitted,
                            dropped=result.dropped,
                        )
                if time.monotonic() - last_log >= _LOG_EVERY:
                    last_log = time.monotonic()
                    _log_progress(name, progress)
        except BaseException:
            for task in inflight:  # a worker failed, or cdcd stops
                task.cancel()
            outcome()
            raise
        finally:
            if inflight:  # the table was requested again: let its chunks finish
                await asyncio.wait(inflight)
            # chunks after one not read are read again at the next attempt: not recorded
            unread = next((i for i, d in enumerate(undurable) if d.end_lsn < 0), None)
            if unread is not None:
                del undurable[unread:]
        try:
            while undurable:
                snap.flush()  # the last chunks: recorded (the table done) without waiting
                await asyncio.sleep(0.02)
                snap.record_durable()
        finally:  # also when cdcd stops meanwhile: the state may say done already
            del ledger.undurable[name]
            outcome()

    async def _chunk(
        self, what: _ChunkRead, done: Done, slot: Slot, keyed: asyncio.Event, sizer: ChunkSizer
    ) -> tuple[int, int, ChunkResult] | None:
        """Read the chunk ``what`` between its watermarks on a worker, give the worker back,
        and wait until the window lets it through: how many rows it read, their accounted
        bytes (:func:`cdcd.source.copy.accounted`) and what became of them; None if the table
        is gone. Once the rows are read, ``done`` learns the key of the last (and whether the
        table ends there) and ``keyed`` is set: the next chunk starts from it. A chunk read
        again (its window saw a change its keys cannot show) keeps its key range."""
        watermarks = self.snap.watermarks
        while True:
            started = time.monotonic()
            read = await self.snap.workers.run(self._read_chunk, what)
            slot.release()
            if read is None:
                return None
            chunk, count = read
            seconds = time.monotonic() - started
            if not done.keyed:
                rows = chunk.rows
                last = _key_values(chunk, rows[-1][-1]) if rows and count else None
                key = None if last is None else [None if v is None else v.decode() for v in last]
                done.last_key = key if key is not None else what.after
                done.finished = count < what.limit
                done.keyed = True
                keyed.set()
            try:
                result = await chunk.done
            finally:
                watermarks.disarm(chunk)
            size = chunk.size
            sizer.observe(count, size, seconds, result.dropped)
            if not result.retry:
                return count, size, result
            log.info(
                "chunk changed in a way its keys cannot show; reading it again", table=what.name
            )
            what.upto = done.last_key  # the same keys: the next chunk may have started after them
            await slot.take()

    async def _read_chunk(self, conn: Any, what: _ChunkRead) -> tuple[Chunk, int] | None:
        """Arm the chunk, write its low watermark, read its rows and commit its high watermark
        with the read (:func:`read_key_chunk`); the chunk (its window open in the stream, its
        rows read) and how many rows, or None if the table is gone."""
        name, keys = what.name, what.keys
        watermarks = self.snap.watermarks
        while True:
            table = what.current[0]
            chunk = Chunk(uuid.uuid4().hex, table.relation, what.key_names)
            watermarks.arm(chunk)
            armed = True
            try:

                def seal(
                    batches: list[CopyBatch],
                    count: int,
                    snapshot: str,
                    size: int,
                    chunk: Chunk = chunk,
                ) -> tuple[str, str]:
                    chunk.snapshot = parse_snapshot(snapshot)
                    chunk.rows = list(batches)
                    chunk.count = count
                    chunk.size = size
                    return WATERMARK, json.dumps({"id": chunk.id, "mark": "high"})

                try:
                    _, count, altered, _ = await read_key_chunk(
                        conn,
                        table,
                        keys,
                        what.after,
                        what.limit,
                        what.upto,
                        seal,
                        _BATCH_ROWS,
                        low=(WATERMARK, json.dumps({"id": chunk.id, "mark": "low"})),
                    )
                except _ALTERED as exc:  # the key's type too: the last key may not fit it
                    log.info("table changed during its snapshot", table=name, error=str(exc))
                    altered = True
                if not altered:
                    armed = False  # the caller waits for the window, then disarms
                    return chunk, count
            finally:
                if armed:
                    watermarks.disarm(chunk)
            # a column added, dropped, of another type: describe, read again
            latest = await self._describe(conn)
            if latest is None:
                return None
            now_keys = [
                (str(r[0]), str(r[1])) for r in await primary_key(conn, latest.relation.oid)
            ]
            if now_keys != keys:  # another order: the keys already read mean nothing
                raise _KeyChanged(keys, now_keys)
            what.current[0] = latest

    async def _describe(self, conn: Any) -> SnapshotTable | None:
        """The table as published now; None when it is not (dropped, removed)."""
        schema, _, table = self.name.partition(".")
        found = await published_tables(conn, self.snap.config.source.publication, (schema, table))
        return found[0] if found else None

    def _removed(self) -> None:
        log.warning(
            "table dropped or removed from the publication during its snapshot; its snapshot "
            "stops (cdcd snapshot --table restarts it once it is published again)",
            table=self.name,
        )
        state = self.snap.state
        self.entry["status"] = "removed"
        if state.known and self.name in state.known:
            state.known.remove(self.name)  # published again later: backfilled as new
        state.save()


def _key_values(chunk: Chunk, row: TupleData) -> tuple[bytes | None, ...]:
    key = chunk.key_of(chunk.relation, row)
    assert key is not None  # a primary key is never null
    return key
