"""The daemon: wires the stages together and runs them until done, stopped or failed.

::

    PostgreSQL ──XLogData──▶ Reader (decoder ▶ assembler) ──Transaction──▶ Writer ──▶ sink tasks
        ▲                        │ Supervisor: reconnect, backoff                    │
        └──status update── Acker ◀── ProgressTracker ◀── durable positions ◀─────────┘

Each stage is its own module in :mod:`cdcd.pipeline`; this one only builds them, takes the
initial snapshot when the source asks for one, starts the tasks, and stops them: a failure of
any task stops all of them (no zombie tasks) and propagates; a stop request (SIGTERM/SIGINT)
or ``--endpos`` stops reading, drains the writer, flushes every sink and confirms what is
durable.

A stop request is honoured in every phase (docs/operating.md): before streaming starts
(waiting for an unreachable source, creating the slot, the initial snapshot, the reset after a
recreated slot) the phase is cancelled, which leaves what a crash there would leave and the
next start takes it up again; while streaming, the drain (writer, sinks' flush, the final
confirmation) is bounded by ``shutdown.grace_period``, after which what is durable is
confirmed and the rest is sent again at the next start. Either way the exit code is 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable
from typing import Any, TypeVar

import structlog

from cdcd.assembler.assembler import COMPACT_BYTES, Assembler
from cdcd.benchlog import LatencyLog, write_stats
from cdcd.config import Config
from cdcd.errors import EXIT_OK, ConfigError
from cdcd.events.encoder import Encoder
from cdcd.pipeline.acker import Acker
from cdcd.pipeline.progress import ProgressTracker
from cdcd.pipeline.publication_watch import watch_publication
from cdcd.pipeline.reader import Reader
from cdcd.pipeline.recreate import SlotRecreator
from cdcd.pipeline.slot_watch import watch_slot
from cdcd.pipeline.supervisor import Supervisor
from cdcd.pipeline.writer import Writer
from cdcd.sinks.base import Sink, SinkContext
from cdcd.sinks.registry import load_sink_class
from cdcd.snapshot.incremental import IncrementalSnapshot
from cdcd.snapshot.initial import initial_snapshot
from cdcd.source import Source
from cdcd.source.catalog import LiveCatalog
from cdcd.stats import Stats

log = structlog.get_logger("cdcd.pipeline")

T = TypeVar("T")


class _Stopped(Exception):
    """A stop request ended a phase before streaming (:meth:`Pipeline._unless_stopped`)."""


class Pipeline:
    """One running daemon. ``stats`` may be read at any time (the HTTP endpoint does)."""

    def __init__(self, config: Config, *, endpos: int | None = None) -> None:
        self.config = config
        self.endpos = endpos
        self.stats = Stats(name=config.name, slot=config.source.slot)
        self.sinks: list[Sink] = []
        self.assembler: Assembler | None = None
        self.writer: Writer | None = None
        self.acker: Acker | None = None
        self.reader: Reader | None = None
        self.tracker: ProgressTracker | None = None
        self.incremental: IncrementalSnapshot | None = None
        self.recreator: SlotRecreator | None = None
        self.supervisor: Supervisor | None = None
        #: a stop gave up waiting for a phase or the drain (shutdown.grace_period): a thread may
        #: still be busy in it (a write, an upload), which must not hold up the exit
        self.abandoned = False
        self._stop = asyncio.Event()
        self._latency = LatencyLog.from_env()  # bench/run.py only (cdcd.benchlog)

    def request_stop(self) -> None:
        """SIGTERM/SIGINT: stop reading, drain the sinks, confirm what is durable."""
        if not self._stop.is_set():
            log.info(
                "stopping: draining sinks (a second SIGTERM/SIGINT exits at once)",
                grace_period_s=self.config.shutdown.grace_period,
            )
            self._stop.set()

    async def _unless_stopped(self, phase: str, step: Awaitable[T]) -> T:
        """``step``'s result, unless a stop request comes first: then ``step`` is cancelled
        (and waited for, within ``shutdown.grace_period``) and :class:`_Stopped` raised."""
        task = asyncio.ensure_future(step)
        stop = asyncio.create_task(self._stop.wait())
        try:
            await asyncio.wait({task, stop}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            task.cancel()
            raise
        finally:
            stop.cancel()
        if task.done():
            return task.result()
        log.info("stopping before streaming started", phase=phase)
        task.cancel()
        done, _ = await asyncio.wait({task}, timeout=self.config.shutdown.grace_period)
        self.abandoned = not done
        if done and not task.cancelled() and task.exception() is not None:
            log.info("the interrupted phase ended with an error", error=str(task.exception()))
        raise _Stopped(phase)

    async def run(self) -> int:
        health = await self._start_health()
        source = Source(self.config)
        try:
            return await self._run(source, health)
        except _Stopped:
            return EXIT_OK
        finally:
            for sink in self.sinks:
                with contextlib.suppress(Exception):
                    await sink.close()
            if self.supervisor is not None:
                await self.supervisor.close_client()
            await source.close()
            if health is not None:
                await health.close()
            write_stats(self.stats, self.assembler)
            if self._latency is not None:
                self._latency.close()

    async def _start_health(self) -> Any:
        """The HTTP endpoint (``http.listen``), before anything is created on the source: an
        address that cannot be bound is a config problem (exit 2), not a crash."""
        cfg = self.config.http
        if not cfg.enabled:
            return None
        from cdcd.health import Health

        health = Health(self.stats)
        assert cfg.host is not None and cfg.port is not None
        try:
            await health.start(cfg.host, cfg.port)
        except OSError as exc:
            reason = os.strerror(exc.errno) if exc.errno else str(exc)
            raise ConfigError(
                f"http.listen: cannot listen on {cfg.listen}: {reason} (another process, or "
                "another cdcd, uses it?); choose another address, or set http.listen: null to "
                "disable the endpoint"
            ) from exc
        return health

    async def _run(self, source: Source, health: Any) -> int:
        cfg = self.config
        # wal_level, publication, slot (definite errors raise here)
        plan = await self._unless_stopped("start-up", source.prepare())
        context = SinkContext(name=cfg.name, database=source.database, config_dir=cfg.config_dir)
        catalog = LiveCatalog(source.catalog_conn)
        self.assembler = assembler = Assembler(
            memory_limit=cfg.buffer.memory_limit,
            spill_dir=cfg.buffer.spill_dir,
            part_bytes=COMPACT_BYTES,  # transactions go to the sinks while they arrive
        )
        self.sinks = [load_sink_class(spec.type)(spec.config, context) for spec in cfg.sinks]
        self.tracker = tracker = ProgressTracker(len(self.sinks))
        encoder = Encoder(context, catalog)
        self.writer = writer = Writer(
            self.sinks,
            encoder,
            tracker,
            self.stats,
            memory_limit=cfg.buffer.memory_limit,
            max_transactions=cfg.buffer.queue_transactions,
            latency=self._latency,
        )
        try:
            for sink in self.sinks:
                await self._unless_stopped("starting the sinks", sink.start())
            if plan is not None:
                await self._unless_stopped(
                    "initial snapshot",
                    initial_snapshot(
                        cfg, source, plan, writer, encoder, catalog, tracker, self.stats
                    ),
                )
        finally:
            if plan is not None:
                await plan.close()
        if cfg.snapshot.mode == "initial_only":
            log.info("snapshot.mode is initial_only: done")
            return EXIT_OK
        self.incremental = IncrementalSnapshot(
            cfg, source, tracker, self.stats, flush=writer.request_flush
        )
        if source.backfill is not None:  # a slot made outside cdcd: its snapshot
            self.incremental.request(source.backfill)
        if source.resume is not None:  # an interrupted initial snapshot: the rest
            self.incremental.resume(source.resume.tables)
            source.resumed()
        self.reader = reader = Reader(
            cfg,
            assembler,
            catalog,
            tracker,
            writer,
            self.stats,
            endpos=self.endpos,
            stop=self._stop,
            watermarks=self.incremental.watermarks,
            # docs/assembler.md, "Rendering streamed changes"
            renderer=encoder if any(sink.writes_json for sink in self.sinks) else None,
        )
        self.supervisor = supervisor = Supervisor(source, reader, catalog, self.stats, self._stop)
        self.recreator = SlotRecreator(
            cfg, source, writer, tracker, catalog, self.incremental, self.stats, reader.handover
        )
        if cfg.source.on_slot_lost == "recreate":
            supervisor.on_slot_lost = self.recreator.after_loss
        if source.recreated is not None:  # replaced at start-up: reset, then backfill
            assert source.consistent_point is not None
            await self._unless_stopped(
                "reset after the slot was recreated",
                self.recreator.reset(source.consistent_point, source.recreated),
            )
        writer.on_durable += [self.incremental.record_durable, self.recreator.record_durable]
        self.acker = Acker(tracker, writer, reader, supervisor, self.stats, self._stop)
        return await self._stream(supervisor, reader, writer, self.acker, source)

    async def _stream(
        self, supervisor: Supervisor, reader: Reader, writer: Writer, acker: Acker, source: Source
    ) -> int:
        writing = asyncio.create_task(writer.run(), name="writer")
        reading = asyncio.create_task(supervisor.run(), name="reader")
        tasks: set[asyncio.Task[Any]] = {
            writing,
            reading,
            asyncio.create_task(acker.run(), name="acker"),
            asyncio.create_task(watch_slot(source, self.stats), name="slot-watch"),
            asyncio.create_task(watch_publication(source, self.stats), name="publication-watch"),
        }
        if self.incremental is not None:
            tasks.add(asyncio.create_task(self.incremental.run(), name="incremental-snapshot"))
        if self.recreator is not None:
            tasks.add(asyncio.create_task(self.recreator.run(), name="slot-recreate"))
        stop_waiter = asyncio.create_task(self._stop.wait(), name="stop")
        tasks.add(stop_waiter)
        # The sinks' own positions, told by each sink as its position moves (a file sink's
        # background flush, Kafka's acknowledgements), so that the snapshots record their
        # durable chunks at once rather than at the acker's next tick (0.2 s): what a crash
        # makes them read and emit again stays small. Polled for a sink that does not tell.
        sinks = self.sinks
        latency_log = self._latency

        def lowest() -> int:
            return min(s.durable_lsn() for s in sinks)

        def told() -> None:
            writer.poll_durable()
            if latency_log is not None:
                latency_log.durable(lowest())

        for sink in sinks:
            sink.durable_listener = told
        if latency_log is not None:
            tasks.add(asyncio.create_task(latency_log.watch(lowest), name="latency"))
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                if task is not stop_waiter and task.exception():
                    raise task.exception()  # type: ignore[misc]
            # Orderly stop (signal or endpos): stop reading, then drain the writer. With
            # --endpos everything up to it must be written, however long that takes; on a
            # signal the grace period bounds the drain (what is not confirmed is resent).
            reading.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reading
            writer.close()
            if reader.endpos_reached:
                await writing
                await writer.flush_all()
            else:
                await self._drain(writing, writer)
            await acker.acknowledge(final=True)
            if self.incremental is not None:
                self.incremental.record_durable(now=True)
            if self.recreator is not None:
                self.recreator.record_durable()
            return EXIT_OK
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _drain(self, writing: asyncio.Task[Any], writer: Writer) -> None:
        """After a stop request: the writer's queue into the sinks and their flush, within
        ``shutdown.grace_period`` in all; past it, what is durable by then is confirmed (by
        the caller) and the rest is sent again at the next start."""
        grace = self.config.shutdown.grace_period

        async def drain() -> None:
            await writing
            await writer.flush_all()

        try:
            await asyncio.wait_for(drain(), timeout=grace)
        except TimeoutError:
            self.abandoned = True
            log.warning(
                "shutdown grace period expired before the sinks drained; confirming what is "
                "durable, the rest is sent again at the next start",
                grace_period_s=grace,
            )
            writing.cancel()
            with contextlib.suppress(BaseException):
                await writing
