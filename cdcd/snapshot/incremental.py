"""Incremental snapshots: tables read in key-ordered chunks while streaming goes on (DBLog).

For each requested table with a primary key (or a replica identity index), chunk after chunk
(docs/snapshots.md)::

    arm the window ▶ low watermark ▶ COPY (SELECT ... WHERE (key) > (last) ORDER BY key
        LIMIT n) ▶ high watermark ▶ wait until the reader has reached it (cdcd.snapshot.watermarks)

With ``snapshot.workers`` > 1 the next chunk's last key is looked up first (``OFFSET n - 1`` on
the key's index), so that chunks ``(last, next]`` are read at once over that many connections,
each between its own watermarks; and up to that many tables are read at once, their chunks
sharing the connections (a small table does not wait behind a large one). The short queries
(describing a table, looking up the next key) go one at a time over one more connection.

The reader drops the rows changed inside the window and queues the rest as a ``"snapshot"``
transaction at the high watermark's position, like any committed transaction: the progress
tracker confirms nothing past it until every sink holds it durably. The progress of each table
(its last chunk's key) is written to :class:`IncrementalState` only once that chunk and every
chunk before it are durable in every sink, so a restart (kill -9 included) resumes at the next
chunk; at worst the chunks in flight at the crash are emitted again.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import asyncpg
import structlog

from cdcd.config import Config
from cdcd.decoder.events import TupleData
from cdcd.errors import ConfigError, TransientSourceError
from cdcd.lsn import format_lsn
from cdcd.progress_rate import estimate_source
from cdcd.snapshot.chunk_size import ChunkSizer
from cdcd.snapshot.signals import KEY_ENV, REMEMBERED, signal_key, verify
from cdcd.snapshot.watermarks import (
    WATERMARK,
    Chunk,
    ChunkResult,
    Watermarks,
    parse_snapshot,
)
from cdcd.source import open_sql
from cdcd.source.queries import emit_message
from cdcd.source.snapshot import (
    SnapshotTable,
    incremental_state_path,
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


class _KeyChanged(Exception):
    """A chunk found the table's primary key changed (its columns or their types)."""


#: what a lost connection raises (the server restarting, a cut connection): retried
_CONNECTION_LOST = (
    OSError,
    TransientSourceError,
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    asyncpg.exceptions.OperatorInterventionError,
)

#: seconds between progress lines in the log
_LOG_EVERY = 5.0
#: rows of a table's first chunk (then :class:`ChunkSizer` adapts it)
_FIRST_CHUNK_ROWS = 2048
#: seconds between looks for tables added to the publication (``snapshot.new_tables``)
_POLL_SECONDS = 2.0


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


class IncrementalState:
    """``<state_dir>/<slot>.incremental.json``: per table, whether it is requested, the key of
    its last durable chunk, the rows emitted and the estimate; written atomically (fsynced)."""

    def __init__(self, state_dir: Path, slot: str) -> None:
        self.path = incremental_state_path(state_dir, slot)
        self.tables: dict[str, dict[str, Any]] = {}
        self.last_signal = 0  # end LSN of the last signal taken (they are sent again)
        self.known: list[str] | None = None  # the published tables at the last look
        self.signals: list[str] = []  # ids of the last signals taken (cdcd.snapshot.signals)
        self.exists = self.path.exists()
        if self.exists:
            data = json.loads(self.path.read_text())
            self.tables = data["tables"]
            self.last_signal = int(data.get("last_signal", 0))
            self.known = data.get("known")
            self.signals = list(data.get("signals") or [])

    def save(self) -> None:
        try:
            self._save()
        except OSError as exc:
            raise ConfigError(
                f"snapshot.state_dir {self.path.parent}: cannot record the incremental "
                f"snapshot's progress: {exc.strerror or exc} (make it writable)"
            ) from exc

    def _save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name("." + self.path.name + ".tmp")
        with tmp.open("w") as fh:
            fh.write(
                json.dumps(
                    {
                        "tables": self.tables,
                        "last_signal": self.last_signal,
                        "known": self.known,
                        "signals": self.signals,
                    },
                    indent=1,
                )
            )
            fh.flush()
            os.fsync(fh.fileno())
        tmp.replace(self.path)
        fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        self.exists = True

    def request(self, tables: list[str]) -> None:
        """Snapshot ``tables`` (again) from their first key."""
        for name in tables:
            self.tables[name] = {
                "status": "pending",
                "last_key": None,
                "rows": 0,
                "estimate": None,
                "estimated_from": None,
            }
        self.save()

    def pending(self) -> list[str]:
        return [n for n, t in self.tables.items() if t["status"] in ("pending", "running")]


_T = TypeVar("_T")


class _Control:
    """The connection for the short queries (listing and describing tables, looking up the
    next chunk's key), one query at a time for every table being read; opened when first
    needed, and again after it was lost."""

    def __init__(self, connect: Callable[[], Awaitable[Any]]) -> None:
        self._connect = connect
        self._conn: Any = None
        self._lock = asyncio.Lock()

    async def run(self, query: Callable[..., Awaitable[_T]], *args: Any) -> _T:
        """``query(connection, *args)``."""
        async with self._lock:
            if self._conn is None:
                self._conn = await self._connect()
            try:
                return await query(self._conn, *args)
            except BaseException as exc:
                if isinstance(exc, _CONNECTION_LOST) or not isinstance(exc, Exception):
                    self._conn.terminate()  # lost, or a query cut short: not reusable
                    self._conn = None
                raise

    def close(self) -> None:
        if self._conn is not None:
            self._conn.terminate()
            self._conn = None


@dataclass(slots=True)
class _Done:
    """A chunk queued at ``end_lsn`` (0: nothing queued; -1: not read yet), to record once
    durable; kept in key order, so the recorded key is one below which every chunk is
    durable."""

    table: str
    end_lsn: int
    last_key: list[str | None] | None
    rows: int
    finished: bool
    bytes: int = 0
    keyed: bool = False  # last_key and finished are known (the chunk's rows are read)


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


class _Slot:
    """The worker slot (``IncrementalSnapshot._free``) a chunk holds while it reads: given back
    once the read ends, before its window closes in the stream, so that the next chunk is read
    while this one waits for its high watermark."""

    __slots__ = ("_owner", "held")

    def __init__(self, owner: IncrementalSnapshot) -> None:
        self._owner = owner
        self.held = True

    def release(self) -> None:
        if self.held:
            self.held = False
            self._owner._free += 1

    async def take(self) -> None:
        """Hold a slot again (a chunk read a second time)."""
        while self._owner._free <= 0:
            await asyncio.sleep(0.02)
        self._owner._free -= 1
        self.held = True


class Tracker(Protocol):
    """What the snapshot asks the progress tracker (:class:`cdcd.pipeline.progress.ProgressTracker`)."""

    def durable_lsn(self) -> int: ...


class IncrementalSnapshot:
    """The task that reads the requested tables; :meth:`request` adds tables (signals)."""

    def __init__(
        self,
        config: Config,
        source: Any,
        tracker: Tracker,
        stats: Stats,
        flush: Callable[[], None] = lambda: None,
    ) -> None:
        self.config = config
        self._flush = flush  # ask the sinks to flush now (the writer's request_flush)
        self.source = source
        self.tracker = tracker
        self.stats = stats
        self.state = IncrementalState(config.snapshot.state_dir, config.source.slot)
        self.watermarks = Watermarks(self._signalled)
        self._wake = asyncio.Event()
        #: per table, its chunks not recorded yet, in key order
        self._undurable: dict[str, list[_Done]] = {}
        self._control = _Control(self._open)
        self._idle: list[Any] = []  # worker connections not in use
        self._free = config.snapshot.workers  # worker slots not in use
        self._reading: list[str] = []  # the tables being read

    def _signalled(self, content: bytes, signal_lsn: int) -> None:
        """A signal in the stream at ``signal_lsn``: taken when it is for this slot and signed
        with this daemon's key (:mod:`cdcd.snapshot.signals`), else logged and ignored."""
        if signal_lsn <= self.state.last_signal:
            return  # taken before, sent again after a reconnect or restart
        cfg = self.config
        slot = cfg.source.slot
        try:
            key, _ = signal_key(cfg.snapshot.signal_secret(), cfg.snapshot.state_dir, slot)
        except OSError as exc:
            log.error(
                "signal ignored: no signal key to check it with (set snapshot.signal_key or "
                f"{KEY_ENV}, or make snapshot.state_dir writable)",
                error=str(exc),
                at=format_lsn(signal_lsn),
            )
            return
        verdict = verify(key, slot, content)
        if verdict.tables is None:
            if verdict.other_slot:
                log.debug("signal for another daemon", reason=verdict.why)
            else:
                log.warning(
                    "signal ignored: not authorised or malformed",
                    reason=verdict.why,
                    at=format_lsn(signal_lsn),
                )
            return
        if verdict.id in self.state.signals:
            log.warning("signal ignored: taken before (a replay)", id=verdict.id)
            return
        self.state.signals = [*self.state.signals, verdict.id][-REMEMBERED:]
        self.request(verdict.tables, signal_lsn)

    def request(self, tables: list[str], signal_lsn: int = 0) -> None:
        """Tables asked for (by a signal in the stream at ``signal_lsn``, or at start):
        recorded at once. A signal already taken (sent again after a restart) is ignored."""
        if signal_lsn:
            if signal_lsn <= self.state.last_signal:
                return
            self.state.last_signal = signal_lsn
        log.info("incremental snapshot requested", tables=tables)
        self.state.request(tables)
        self._wake.set()

    def restart(self, tables: list[str]) -> None:
        """Backfill ``tables`` from their first key, now (a recreated slot): the chunk in
        flight is abandoned, since the new slot may never carry its watermarks."""
        self.watermarks.abandon()
        self.request(tables)

    async def run(self) -> None:
        cfg = self.config.snapshot
        watch_new = cfg.new_tables and cfg.mode != "never"
        first = watch_new or cfg.mode == "incremental" or bool(self.state.pending())
        tasks: dict[str, asyncio.Task[None]] = {}  # the tables being read
        try:
            polled = time.monotonic()
            backoff = 1.0
            not_before = 0.0  # after a lost connection, no table starts before this
            while first and self.state.known is None:  # the first start with this state
                try:
                    self.state.known = await self._control.run(self._published)
                except _CONNECTION_LOST as exc:  # a failover, a restarting server
                    log.warning("could not list the published tables", error=str(exc))
                    backoff = await _pause(backoff)
                    continue
                if cfg.mode == "incremental":
                    self.request(self.state.known)
                self.state.save()
            while True:
                if watch_new and time.monotonic() - polled >= _POLL_SECONDS:
                    polled = time.monotonic()
                    try:
                        await self._control.run(self._new_tables)
                    except _CONNECTION_LOST as exc:
                        log.warning("could not look for new tables", error=str(exc))
                # several workers: as many tables at once, their chunks sharing the workers
                for name in self.state.pending():
                    if len(tasks) >= cfg.workers or time.monotonic() < not_before:
                        break
                    if name not in tasks:  # one that ended is started again when pending
                        tasks[name] = asyncio.create_task(self._table(name))
                if not tasks:
                    self.record_durable()
                    self._wake.clear()
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self._wake.wait(), 0.5)
                    continue
                ended, _ = await asyncio.wait(
                    tasks.values(), timeout=0.5, return_when=asyncio.FIRST_COMPLETED
                )
                for name, task in list(tasks.items()):
                    if task not in ended:
                        continue
                    del tasks[name]
                    failure = task.exception()
                    if failure is None:
                        backoff = 1.0
                    elif isinstance(failure, _CONNECTION_LOST):  # the reader reconnects itself
                        log.warning(
                            "incremental snapshot lost its connection; resuming after a backoff",
                            table=name,
                            error=str(failure),
                        )
                        not_before = time.monotonic() + backoff
                        backoff = _longer(backoff)
                    else:
                        raise failure
        finally:
            for task in tasks.values():
                task.cancel()
            if tasks:
                await asyncio.wait(tasks.values())
            self._control.close()
            for conn in self._idle:
                conn.terminate()
            self._idle.clear()

    async def _open(self) -> Any:
        return await open_sql(self.source.params, self.config.source.connect_timeout)

    async def _published(self, conn: Any) -> list[str]:
        tables = await published_tables(conn, self.config.source.publication)
        return [f"{t.relation.namespace}.{t.relation.name}" for t in tables]

    async def _new_tables(self, conn: Any) -> None:
        """``snapshot.new_tables``: request the tables added to the publication since the last
        look (a table removed and added again counts as new)."""
        published = await self._published(conn)
        known = set(self.state.known or ())
        new = [name for name in published if name not in known]
        if new or len(known) != len(published):
            self.state.known = published
            if new:
                log.info("tables added to the publication", tables=new)
                self.request(new)
            else:
                self.state.save()

    def record_durable(self) -> None:
        """Write the progress of the chunks every sink now holds durably (also called by the
        pipeline once it has drained, so that an orderly stop re-reads nothing)."""
        durable = self.tracker.durable_lsn()
        recorded = False
        for chunks in self._undurable.values():
            recorded |= self._record(chunks, durable)
        if recorded:
            self.state.save()

    def _record(self, chunks: list[_Done], durable: int) -> bool:
        """Record the leading ``chunks`` (one table's) durable at ``durable``."""
        done = 0
        for item in chunks:
            if item.end_lsn < 0 or item.end_lsn > durable:  # < 0: not read yet
                break
            done += 1
        if not done:
            return False
        for item in chunks[:done]:
            entry = self.state.tables.get(item.table)
            if entry is None or entry["status"] == "pending":
                continue  # requested again meanwhile: starts over
            entry["last_key"] = item.last_key
            entry["rows"] = item.rows
            entry["bytes"] = item.bytes
            progress = self.stats.snapshots.get(item.table)
            rate = progress.meter.rate if progress is not None else None
            entry["rows_per_s"] = None if rate is None else round(rate)  # for cdcd snapshot status
            if item.finished:
                entry["status"] = "done"
        del chunks[:done]
        return True

    def _share(self, name: str) -> int:
        """How many workers table ``name`` may use at once: ``snapshot.workers`` split between
        the tables being read (the first ones get the remainder), so that none waits behind
        another for a worker."""
        tables = self._reading
        workers = self.config.snapshot.workers
        return workers // len(tables) + (tables.index(name) < workers % len(tables))

    def _in_flight(self) -> int:
        """Chunks queued or being read, not recorded yet, of every table."""
        return sum(len(chunks) for chunks in self._undurable.values())

    async def _on_worker(self, read: Callable[..., Awaitable[_T]], *args: Any) -> _T:
        """``read(connection, *args)`` on a worker connection (an idle one, else a new one), in
        the slot the caller took (``self._free``, given back by :meth:`_release`); the
        connection goes back to the idle ones after, or is closed if ``read`` failed (it may
        be broken)."""
        conn = None
        ok = False
        try:
            conn = self._idle.pop() if self._idle else await self._open()
            result = await read(conn, *args)
            ok = True
            return result
        finally:
            if conn is not None:
                if ok:
                    self._idle.append(conn)
                else:
                    conn.terminate()

    async def _table(self, name: str) -> None:
        self._reading.append(name)  # in the order they started (for _share)
        try:
            await self._read_table(name)
        finally:
            self._reading.remove(name)

    async def _read_table(self, name: str) -> None:
        entry = self.state.tables[name]
        control = self._control
        table = await control.run(self._describe, name)
        if table is None:
            self._removed(name, entry)
            return
        key_cols = await control.run(primary_key, table.relation.oid)
        problem = (
            "source.messages is off: the watermarks are logical messages the stream must carry "
            "(turn it on)"
            if not self.config.source.messages
            else "source.binary is on: incremental snapshots compare keys as text (turn it off)"
            if self.config.source.binary
            else None
            if key_cols
            else NO_KEY
        )
        keys = [(str(r[0]), str(r[1])) for r in key_cols]
        if problem is None:
            problem = await control.run(key_problem, table, keys)
        if problem is not None:
            self._skipped(name, entry, problem)
            return
        if entry["status"] == "pending":
            estimate, source = await control.run(row_estimate, table)
            entry["status"] = "running"
            entry["estimate"] = estimate
            entry["estimated_from"] = source
            self.state.save()
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
        progress = self.stats.snapshots[name] = TableSnapshot(
            "running",
            rows_done,
            int(entry["estimate"] or 0),
            bytes=int(entry.get("bytes") or 0),
            estimated_from=source,
        )
        cfg = self.config.snapshot
        started = last_log = described = time.monotonic()
        progress.meter.add(started, rows_done)
        current = [table]  # as last described; a chunk that finds it changed describes it again
        lo = last_key  # the next chunk starts after this key
        tail: _Done | None = None  # a chunk without an upper key: the next start comes from it
        ended = False
        inflight: dict[asyncio.Task[Any], tuple[_Done, _Slot]] = {}
        undurable = self._undurable[name] = []
        # each chunk's rows wait in memory until durable: a share of the buffer for each
        memory = int(self.config.buffer.memory_limit) // (2 * cfg.chunks_in_flight)
        sizer = ChunkSizer(_FIRST_CHUNK_ROWS, cfg.chunk_rows, memory)
        keyed = asyncio.Event()  # a chunk without an upper key has read its rows
        try:
            while self.state.tables.get(name) is entry and not (ended and not inflight):
                self.record_durable()
                # bounded: what a crash makes emit again (chunks not recorded yet) stays small
                if self._in_flight() >= cfg.chunks_in_flight:
                    self._flush()  # rather than wait for the sinks' flush_interval
                if tail is not None and tail.keyed:  # its rows are read: the next start
                    lo, ended, tail = tail.last_key, tail.finished, None
                if (
                    not ended
                    and tail is None
                    and self._free > 0
                    and sum(slot.held for _, slot in inflight.values()) < self._share(name)
                    and self._in_flight() < cfg.chunks_in_flight
                ):
                    # taken before anything is awaited: other tables' tasks take them too
                    self._free -= 1  # this chunk's worker
                    slot = _Slot(self)
                    done = _Done(name, -1, None, 0, False)  # end_lsn -1: not read yet
                    undurable.append(done)  # in key order: resume after durable ones
                    launched = False
                    try:
                        if time.monotonic() - described >= _POLL_SECONDS and not inflight:
                            described = time.monotonic()
                            latest = await control.run(self._describe, name)  # altered?
                            if latest is None:
                                self._removed(name, entry)
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
                if not inflight:
                    await asyncio.sleep(0.05)  # waiting for chunks to be durable
                    continue
                keyed.clear()
                waiting: set[asyncio.Future[Any]] = set(inflight)
                if tail is not None:  # woken as soon as its rows are read
                    waiting.add(asyncio.ensure_future(keyed.wait()))
                finished, _ = await asyncio.wait(
                    waiting, timeout=0.5, return_when=asyncio.FIRST_COMPLETED
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
                        self.request([name])
                        ended = True
                        continue
                    if read is None:  # the table went away
                        self._removed(name, entry)
                        ended = True
                        continue
                    rows, size, result = read
                    rows_done += result.emitted
                    done.rows = rows_done
                    done.end_lsn = result.end_lsn
                    progress.rows = rows_done
                    progress.dropped += result.dropped
                    progress.chunks += 1
                    progress.bytes += size - 64 * len(rows)  # the values' text
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
                await asyncio.sleep(0.1)
                self.record_durable()
        finally:  # also when cdcd stops meanwhile: the state may say done already
            del self._undurable[name]
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

    async def _chunk(
        self, what: _ChunkRead, done: _Done, slot: _Slot, keyed: asyncio.Event, sizer: ChunkSizer
    ) -> tuple[list[TupleData], int, ChunkResult] | None:
        """Read the chunk ``what`` between its watermarks on a worker, give the worker back,
        and wait until the window lets it through: its rows, their accounted bytes
        (:func:`cdcd.source.copy.accounted`) and what became of them; None if
        the table is gone. Once the rows are read, ``done`` learns the key of the last (and
        whether the table ends there) and ``keyed`` is set: the next chunk starts from it. A
        chunk read again (its window saw a change its keys cannot show) keeps its key range."""
        while True:
            started = time.monotonic()
            read = await self._on_worker(self._read_chunk, what)
            slot.release()
            if read is None:
                return None
            chunk, rows, size = read
            seconds = time.monotonic() - started
            if not done.keyed:
                last = _key_values(chunk, rows[-1]) if rows else None
                key = None if last is None else [None if v is None else v.decode() for v in last]
                done.last_key = key if key is not None else what.after
                done.finished = len(rows) < what.limit
                done.keyed = True
                keyed.set()
            try:
                result = await chunk.done
            finally:
                self.watermarks.disarm(chunk)
            sizer.observe(len(rows), size, seconds, result.dropped)
            if not result.retry:
                return rows, size, result
            log.info(
                "chunk changed in a way its keys cannot show; reading it again", table=what.name
            )
            what.upto = done.last_key  # the same keys: the next chunk may have started after them
            await slot.take()

    async def _read_chunk(
        self, conn: Any, what: _ChunkRead
    ) -> tuple[Chunk, list[TupleData], int] | None:
        """Arm the chunk, write its low watermark, read its rows and commit its high watermark
        with the read (:func:`read_key_chunk`); the chunk (its window open in the stream) and
        its rows, or None if the table is gone."""
        name, keys = what.name, what.keys
        while True:
            table = what.current[0]
            chunk = Chunk(uuid.uuid4().hex, table.relation, what.key_names)
            self.watermarks.arm(chunk)
            armed = True
            try:
                await _watermark(conn, chunk.id, "low")

                def seal(
                    rows: list[TupleData], snapshot: str, size: int, chunk: Chunk = chunk
                ) -> tuple[str, str]:
                    chunk.snapshot = parse_snapshot(snapshot)
                    chunk.rows = rows
                    chunk.size = size
                    return WATERMARK, json.dumps({"id": chunk.id, "mark": "high"})

                try:
                    rows, _, altered, size = await read_key_chunk(
                        conn, table, keys, what.after, what.limit, what.upto, seal
                    )
                except _ALTERED as exc:  # the key's type too: the last key may not fit it
                    log.info("table changed during its snapshot", table=name, error=str(exc))
                    altered = True
                if not altered:
                    armed = False  # the caller waits for the window, then disarms
                    return chunk, rows, size
            finally:
                if armed:
                    self.watermarks.disarm(chunk)
            # a column added, dropped, of another type: describe, read again
            latest = await self._describe(conn, name)
            if latest is None:
                return None
            now_keys = [
                (str(r[0]), str(r[1])) for r in await primary_key(conn, latest.relation.oid)
            ]
            if now_keys != keys:  # another order: the keys already read mean nothing
                raise _KeyChanged(keys, now_keys)
            what.current[0] = latest

    async def _describe(self, conn: Any, name: str) -> SnapshotTable | None:
        """The table as published now; None when it is not (dropped, removed)."""
        schema, _, table = name.partition(".")
        found = await published_tables(conn, self.config.source.publication, (schema, table))
        return found[0] if found else None

    def _skipped(self, name: str, entry: dict[str, Any], problem: str) -> None:
        log.error(f"table not snapshotted: {problem}", table=name)
        entry["status"] = "skipped"
        self.state.save()

    def _removed(self, name: str, entry: dict[str, Any]) -> None:
        log.warning(
            "table dropped or removed from the publication during its snapshot; its snapshot "
            "stops (cdcd snapshot --table restarts it once it is published again)",
            table=name,
        )
        entry["status"] = "removed"
        if self.state.known and name in self.state.known:
            self.state.known.remove(name)  # published again later: backfilled as new
        self.state.save()


#: why a table without a usable key is not snapshotted incrementally, and what to do
NO_KEY = (
    "it has neither a primary key nor a replica identity index, and incremental snapshots "
    "read tables in key order: add a primary key (or ALTER TABLE ... REPLICA IDENTITY USING "
    "INDEX on a unique index of NOT NULL columns), or snapshot it with snapshot.mode: initial "
    "(the exported snapshot reads tables without a key)"
)


async def _pause(backoff: float) -> float:
    """Wait ``backoff`` seconds after a lost connection; the next wait (:func:`_longer`)."""
    await asyncio.sleep(backoff)
    return _longer(backoff)


def _longer(backoff: float) -> float:
    """The wait after ``backoff`` for the next lost connection: doubled, at most 10 s."""
    return min(backoff * 2, 10.0)


def _key_values(chunk: Chunk, row: TupleData) -> tuple[bytes | None, ...]:
    key = chunk.key_of(chunk.relation, row)
    assert key is not None  # a primary key is never null
    return key


async def _watermark(conn: Any, chunk_id: str, mark: str) -> None:
    content = json.dumps({"id": chunk_id, "mark": mark})
    await emit_message(conn, WATERMARK, content, "incremental snapshot watermark")
