"""Incremental snapshots: tables read in key-ordered chunks while streaming goes on (DBLog).

:class:`IncrementalSnapshot` is the task that takes requests (``cdcd snapshot --table``
signals in the stream, ``snapshot.mode: incremental``, tables added to the publication with
``snapshot.new_tables``) and reads the requested tables: how one table is read, chunk after
chunk between watermarks, is :mod:`cdcd.snapshot.table` (docs/snapshots.md). With
``snapshot.workers`` > 1 up to that many tables are read at once, their chunks sharing the
worker connections (:mod:`cdcd.snapshot.workers`), so that a small table does not wait behind
a large one. The short queries (describing a table, looking up the next key) go one at a time
over one more connection.

The reader drops the rows changed inside a chunk's window and queues the rest as a
``"snapshot"`` transaction at the high watermark's position, like any committed transaction
(:mod:`cdcd.snapshot.watermarks`): the progress tracker confirms nothing past it until every
sink holds it durably. The progress of each table (its last chunk's key) is written to
:class:`~cdcd.snapshot.state.IncrementalState` only once that chunk and every chunk before it
are durable in every sink (:class:`~cdcd.snapshot.state.Ledger`), so a restart (kill -9
included) resumes at the next chunk; at worst the chunks in flight at the crash are emitted
again, and those whose record was still being written.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Any, Protocol

import structlog

from cdcd.config import Config
from cdcd.lsn import format_lsn
from cdcd.snapshot.signals import KEY_ENV, REMEMBERED, signal_key, verify
from cdcd.snapshot.state import IncrementalState, Ledger
from cdcd.snapshot.table import read_table
from cdcd.snapshot.watermarks import Watermarks
from cdcd.snapshot.workers import CONNECTION_LOST, Control, Workers, longer, pause
from cdcd.source import open_sql
from cdcd.source.snapshot import published_tables
from cdcd.stats import Stats

log = structlog.get_logger("cdcd.snapshot")

#: seconds between looks for tables added to the publication (``snapshot.new_tables``)
_POLL_SECONDS = 2.0


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
        self.flush = flush  # ask the sinks to flush now (the writer's request_flush)
        self.source = source
        self.tracker = tracker
        self.stats = stats
        self.state = IncrementalState(config.snapshot.state_dir, config.source.slot)
        self.ledger = Ledger(self.state, stats)
        self.watermarks = Watermarks(self._signalled)
        self._wake = asyncio.Event()
        self.control = Control(self._open)
        self.workers = Workers(self._open, config.snapshot.workers)

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

    def resume(self, tables: dict[str, tuple[list[Any] | None, int]]) -> None:
        """The rest of an interrupted initial snapshot: each table after its durable key."""
        log.info(
            "the rest of the initial snapshot is read incrementally",
            tables={name: key for name, (key, _) in tables.items()},
        )
        self.state.resume(tables)
        self._wake.set()

    def restart(self, tables: list[str]) -> None:
        """Backfill ``tables`` from their first key, now (a recreated slot): the chunk in
        flight is abandoned, since the new slot may never carry its watermarks."""
        self.watermarks.abandon()
        self.request(tables)

    def record_durable(self, now: bool = False) -> None:
        """Record the progress of the chunks every sink now holds durably (written in a
        thread: :class:`~cdcd.snapshot.state.Ledger`; ``now``: before returning, as the
        pipeline asks once it has drained, so that an orderly stop re-reads nothing)."""
        self.ledger.record(self.tracker.durable_lsn(), now=now)

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
                    self.state.known = await self.control.run(self._published)
                except CONNECTION_LOST as exc:  # a failover, a restarting server
                    log.warning("could not list the published tables", error=str(exc))
                    backoff = await pause(backoff)
                    continue
                if cfg.mode == "incremental":
                    self.request(self.state.known)
                self.state.save()
            while True:
                if watch_new and time.monotonic() - polled >= _POLL_SECONDS:
                    polled = time.monotonic()
                    try:
                        await self.control.run(self._new_tables)
                    except CONNECTION_LOST as exc:
                        log.warning("could not look for new tables", error=str(exc))
                # several workers: as many tables at once, their chunks sharing the workers
                for name in self.state.pending():
                    if len(tasks) >= cfg.workers or time.monotonic() < not_before:
                        break
                    if name not in tasks:  # one that ended is started again when pending
                        tasks[name] = asyncio.create_task(read_table(self, name))
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
                    elif isinstance(failure, CONNECTION_LOST):  # the reader reconnects itself
                        log.warning(
                            "incremental snapshot lost its connection; resuming after a backoff",
                            table=name,
                            error=str(failure),
                        )
                        not_before = time.monotonic() + backoff
                        backoff = longer(backoff)
                    else:
                        raise failure
        finally:
            for task in tasks.values():
                task.cancel()
            if tasks:
                await asyncio.wait(tasks.values())
            self.control.close()
            self.workers.close()

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
