"""Wires the stages together and supervises them; no protocol or format logic lives here.

::

    PostgreSQL ──XLogData──▶ reader task: decoder ▶ assembler ──Transaction──▶ bounded queue
                                                                                   │
    PostgreSQL ◀──status update── ack task ◀── min(sink.durable_lsn()) ◀── writer task ▶ sinks

Progress tracking (the reason this module exists):

* The LSN confirmed to the server (``flush`` in the standby status update) is the minimum over
  all sinks of the end LSN of the newest transaction they hold durably, capped by the
  assembler's ``confirm_ceiling()`` (never past an unresolved prepared transaction), and, for a
  prepared transaction already committed, by that same ceiling until the sinks hold it durably:
  once the confirmed position passes a PREPARE the server never resends its changes. It only
  moves forward (``cdcd.lsn.Progress``). One released past ``--endpos`` is never handed to the
  sinks, so its cap stays until the process ends.
* Only what the current replication session has streamed past may be confirmed: after a
  reconnect the assembler has forgotten the prepared transactions it held (the server sends them
  again), while the sinks may be durable past their PREPAREs and the last keepalive further still.
* When nothing is in flight — the assembler is idle, the queue is empty and every sink has made
  everything it was handed durable — the server's keepalive position may be confirmed as well,
  so an idle slot does not hold WAL forever (PITFALLS, "Positions and acknowledgement").
* After a reconnect the server resends everything after the confirmed position; transactions
  whose end LSN is not beyond that of the last one queued for the sinks are dropped here (end
  LSNs strictly increase in delivery order; commit LSNs may tie with a non-transactional
  message's), and after a crash the sinks recognise what they already hold by ``(commit_lsn, seq)``.

Failures are classified by ``cdcd.errors``: transient source errors reconnect with backoff;
anything else stops the whole daemon with a clear message (no zombie tasks).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import signal
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from operator import methodcaller
from typing import Any

import structlog

from cdcd import accel
from cdcd.assembler.assembler import Assembler
from cdcd.assembler.transaction import ChangeRecord, Transaction
from cdcd.benchlog import LatencyLog, write_stats
from cdcd.catalog import LiveCatalog
from cdcd.config import Config
from cdcd.decoder import events as ev
from cdcd.decoder.pgoutput import PgOutputDecoder
from cdcd.errors import (
    EXIT_FAILURE,
    EXIT_OK,
    CdcdError,
    ConfigError,
    DefiniteSourceError,
    SpillError,
    TransientSinkError,
    TransientSourceError,
)
from cdcd.lsn import Progress, format_lsn, pg_to_unix_us, unix_to_pg_us
from cdcd.replication.client import ReplicationClient
from cdcd.sinks.base import Sink, SinkContext
from cdcd.sinks.catalog import schema_name
from cdcd.sinks.encoding import Encoder
from cdcd.sinks.registry import load_sink_class

log = structlog.get_logger("cdcd.app")

_TWO_PHASE_EVENTS = (
    ev.BeginPrepare,
    ev.Prepare,
    ev.StreamPrepare,
    ev.CommitPrepared,
    ev.RollbackPrepared,
)

#: the op each kind of change counts under in Stats.events_by when no events are built
_CHANGE_OPS: dict[type, str] = {
    ev.Insert: "c",
    ev.Update: "u",
    ev.Delete: "d",
    ev.Truncate: "t",
    ev.Message: "m",
}

#: server_version_num thresholds for pgoutput protocol versions (PITFALLS: 14 -> 2, 15 -> 3, 16+ -> 4)
_PROTO_BY_VERSION = ((160000, 4), (150000, 3), (140000, 2), (0, 1))


@dataclass(frozen=True, slots=True)
class StreamOptions:
    proto_version: int
    streaming: str  # off | on | parallel
    options: dict[str, str]


def quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def stream_options(source: Any, server_version: int) -> StreamOptions:
    """pgoutput options for START_REPLICATION from the config and the server's version."""
    highest = next(proto for minimum, proto in _PROTO_BY_VERSION if server_version >= minimum)
    if source.proto_version == "auto":
        proto = highest
    else:
        proto = int(source.proto_version)
        if proto > highest:
            raise ConfigError(
                f"source.proto_version: {proto} is not supported by this server "
                f"(version {server_version // 10000} supports up to {highest})"
            )
    streaming = str(source.streaming)
    if streaming == "auto":
        streaming = "parallel" if proto >= 4 else "on" if proto >= 2 else "off"
    if streaming == "on" and proto < 2:
        raise ConfigError("source.streaming: 'on' needs proto_version 2 or later")
    if streaming == "parallel" and proto < 4:
        raise ConfigError("source.streaming: 'parallel' needs proto_version 4 (PostgreSQL 16+)")
    options = {
        "proto_version": str(proto),
        "publication_names": quote_ident(source.publication),
    }
    if streaming != "off":
        options["streaming"] = streaming
    if source.two_phase:
        if proto < 3:
            raise ConfigError("source.two_phase: needs proto_version 3 or later (PostgreSQL 15+)")
        options["two_phase"] = "on"
    if source.binary:
        options["binary"] = "true"
    if source.messages:
        options["messages"] = "true"
    if source.origin != "any":
        if server_version < 160000:
            raise ConfigError("source.origin: 'none' needs PostgreSQL 16 or later")
        options["origin"] = source.origin
    return StreamOptions(proto, streaming, options)


@dataclass
class Stats:
    """Counters the HTTP endpoint exports (cdcd.health)."""

    received_bytes: int = 0
    received_messages: int = 0
    transactions: int = 0
    events: int = 0
    events_by: dict[tuple[str, str], int] = field(default_factory=dict)
    reconnects: int = 0
    server_wal_end: int = 0
    confirmed_lsn: int = 0
    last_commit_time_us: int = 0
    streaming: bool = False
    connected: bool = False
    slot_wal_status: str | None = None
    slot_safe_wal_size: int | None = None
    slot_retained_bytes: int = 0


class Pipeline:
    """One running daemon: source connection, assembler, sinks, acknowledgement."""

    def __init__(self, config: Config, *, endpos: int | None = None) -> None:
        self.config = config
        self.endpos = endpos
        self.stats = Stats()
        self.sinks: list[Sink] = []
        self._stop = asyncio.Event()
        self._endpos_reached = False
        self._publication_check_due = False  # a server warning said it was skipped
        self._queue: asyncio.Queue[Transaction | None] = asyncio.Queue(
            maxsize=config.buffer.queue_transactions
        )
        self._queued_bytes = 0  # Transaction.mem_bytes of the queued transactions
        self._queue_room = asyncio.Event()
        self._confirmed = Progress()
        self._received = Progress()
        # End LSN of the last transaction queued for the sinks. Not the commit LSN: a
        # non-transactional message's LSN is the end of its record, which is also the commit
        # LSN of a transaction whose commit record follows it directly (e.g. COMMIT PREPARED).
        self._queued_end_lsn = 0
        # (ceiling before its Commit Prepared, end LSN) of committed prepared transactions not
        # yet durable: the confirmed position stays below the ceiling until they are.
        self._prepared_caps: list[tuple[int, int]] = []
        self._handed_end_lsn = 0
        self._writer_busy = False
        self._keepalive_lsn = 0
        # The highest position the current replication session has streamed past (see above).
        self._session_lsn = 0
        self._client: ReplicationClient | None = None
        self._catalog: LiveCatalog | None = None
        self._catalog_conn: Any = None
        self._catalog_stale = False  # the source was lost: reconnect the catalog too
        self._assembler: Assembler | None = None
        self._last_flush: dict[int, float] = {}
        self.health: Any = None
        self._latency = LatencyLog.from_env()  # bench/run.py only (cdcd.benchlog)

    @property
    def assembler(self) -> Assembler | None:
        return self._assembler

    def lag_seconds(self) -> float:
        """Now minus the commit time of the last delivered transaction; 0 when caught up."""
        idle = (
            (self._assembler is None or self._assembler.idle)
            and self._queue.empty()
            and not self._writer_busy
        )
        if idle or not self.stats.last_commit_time_us:
            return 0.0
        return max(0.0, time.time() - pg_to_unix_us(self.stats.last_commit_time_us) / 1e6)

    # -- lifecycle ---------------------------------------------------------------------------

    def request_stop(self) -> None:
        """SIGTERM/SIGINT: stop reading, drain the sinks, confirm what is durable."""
        if not self._stop.is_set():
            log.info("stopping: draining sinks")
            self._stop.set()

    async def run(self) -> int:
        cfg = self.config
        context = SinkContext(name=cfg.name, database="", config_dir=cfg.config_dir)
        from cdcd.source import Source  # local import: the source module wires asyncpg

        source = Source(cfg)
        if cfg.http.enabled and self.health is None:
            from cdcd.health import Health

            self.health = Health(self)
            await self.health.start(cfg.http.host, cfg.http.port)
        plan = await source.prepare()  # wal_level, publication, slot (definite errors raise here)
        context = SinkContext(name=cfg.name, database=source.database, config_dir=cfg.config_dir)
        self._catalog_conn = source.catalog_conn
        self._catalog = LiveCatalog(source.catalog_conn)
        self._assembler = Assembler(
            memory_limit=cfg.buffer.memory_limit,
            spill_dir=cfg.buffer.spill_dir,
            on_type=self._catalog.types.observe,
        )
        self.sinks = [load_sink_class(spec.type)(spec.config, context) for spec in cfg.sinks]
        encoder = Encoder(context, self._catalog)
        try:
            for sink in self.sinks:
                await sink.start()
            if plan is not None:
                try:
                    await self._snapshot(source, plan, encoder)
                finally:
                    await plan.close()
            if cfg.snapshot.mode == "initial_only":
                log.info("snapshot.mode is initial_only: done")
                return EXIT_OK
            writer = asyncio.create_task(self._writer(encoder), name="writer")
            acker = asyncio.create_task(self._acker(source), name="acker")
            reader = asyncio.create_task(self._reader_loop(source), name="reader")
            poller = asyncio.create_task(self._slot_poller(source), name="slot-poller")
            stop_waiter = asyncio.create_task(self._stop.wait(), name="stop")
            tasks = {writer, acker, reader, poller, stop_waiter}
            if self._latency is not None:
                durable = lambda: min((s.durable_lsn() for s in self.sinks), default=0)  # noqa: E731
                tasks.add(asyncio.create_task(self._latency.watch(durable), name="latency"))
            try:
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task is not stop_waiter and task.exception() is not None:
                        raise task.exception()  # type: ignore[misc]
                # Orderly stop (signal or endpos): stop reading, then drain the writer. With
                # --endpos everything up to it must be written, however long that takes; on a
                # signal the grace period bounds the drain (what is not confirmed is resent).
                reader.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await reader
                await self._queue.put(None)
                if self._endpos_reached:
                    await writer
                else:
                    try:
                        await asyncio.wait_for(writer, timeout=cfg.shutdown.grace_period)
                    except TimeoutError:
                        log.error(
                            "shutdown grace period expired before the sinks drained; what was "
                            "not confirmed will be sent again at the next start",
                            grace_period_s=cfg.shutdown.grace_period,
                        )
                        return EXIT_FAILURE
                await self._flush_all()
                await self._acknowledge(final=True)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            for sink in self.sinks:
                with contextlib.suppress(Exception):
                    await sink.close()
            if self._client is not None:
                with contextlib.suppress(Exception):
                    await self._client.close()
            await source.close()
            if self.health is not None:
                await self.health.close()
            write_stats(self.stats, self._assembler)
            if self._latency is not None:
                self._latency.close()
        return EXIT_OK

    # -- initial snapshot --------------------------------------------------------------------

    async def _snapshot(self, source: Any, plan: Any, encoder: Encoder) -> None:
        """Read every published table at the slot's exported snapshot (see cdcd.snapshot)."""
        from cdcd.snapshot import published_tables, read_rows
        from cdcd.source import open_sql

        assert self._catalog is not None
        cfg = self.config
        point = plan.consistent_point
        conn = await open_sql(source.params, cfg.source.connect_timeout)
        log.info("initial snapshot starting", consistent_point=format_lsn(point))
        started = time.monotonic()
        rows_total = 0
        try:
            async with conn.transaction(isolation="repeatable_read", readonly=True):
                literal = "'" + plan.name.replace("'", "''") + "'"
                await conn.execute(f"SET TRANSACTION SNAPSHOT {literal}")
                tables = await published_tables(conn, cfg.source.publication)
                commit_time = unix_to_pg_us(int(time.time() * 1_000_000))
                txn = Transaction(
                    kind="snapshot",
                    xid=0,
                    commit_lsn=point - 1,  # a commit can start at the point (snapshot.py)
                    end_lsn=point,
                    commit_time=commit_time,
                    size=0,
                )
                for sink in self.sinks:
                    await sink.begin(txn)
                pending: tuple[Any, list[Any]] | None = None
                seq = 0

                async def emit(relation: Any, rows: list[Any], last: bool) -> None:
                    nonlocal seq
                    events = list(
                        encoder.snapshot_events(
                            relation,
                            rows,
                            commit_lsn=point - 1,
                            commit_time=commit_time,
                            first_seq=seq,
                            last=last,
                        )
                    )
                    seq += len(events)
                    for sink in self.sinks:
                        await sink.write(events)
                    self.stats.events += len(events)
                    self._count(events)

                for table in tables:
                    await self._catalog.on_relation(table.relation)
                    async for rows in read_rows(conn, table, cfg.snapshot.batch_rows):
                        if pending is not None:
                            await emit(*pending, last=False)
                        pending = (table.relation, rows)
                        rows_total += len(rows)
                if pending is not None:
                    await emit(*pending, last=True)
                for sink in self.sinks:
                    await sink.commit(txn)
            await self._flush_all()
            self._handed_end_lsn = max(self._handed_end_lsn, point)
            plan.state.finish(point)
        finally:
            await conn.close()
        log.info(
            "initial snapshot done",
            rows=rows_total,
            seconds=round(time.monotonic() - started, 3),
        )

    # -- reading -----------------------------------------------------------------------------

    async def _reader_loop(self, source: Any) -> None:
        """Stream from the server; reconnect with backoff on transient failures."""
        src = self.config.source
        backoff = src.reconnect_min_backoff
        failing_since: float | None = None
        while not self._stop.is_set():
            try:
                await self._stream_once(source)
                return  # endpos reached
            except TransientSourceError as exc:
                if self.stats.streaming:  # it had been streaming: a new run of failures starts
                    backoff = src.reconnect_min_backoff
                    failing_since = None
                self.stats.connected = False
                self.stats.streaming = False
                now = time.monotonic()
                failing_since = failing_since or now
                if src.give_up_after is not None and now - failing_since > src.give_up_after:
                    raise DefiniteSourceError(
                        f"giving up after {src.give_up_after:.0f} s of failed connections: {exc}"
                    ) from exc
                self.stats.reconnects += 1
                self._catalog_stale = True
                log.warning(
                    "source connection lost; reconnecting", error=str(exc), backoff_s=backoff
                )
                await self._close_client()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, src.reconnect_max_backoff)
            else:
                failing_since = None

    async def _close_client(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                await client.close()

    async def _stream_once(self, source: Any) -> None:
        assert self._assembler is not None and self._catalog is not None
        if self._catalog_stale:
            self._catalog_conn = await source.reconnect_catalog()
            self._catalog.use_connection(self._catalog_conn)
            self._catalog_stale = False
        client = await source.replication_client()
        self._client = client
        client.on_notice = self._on_server_notice
        opts = stream_options(self.config.source, client.server_version)
        decoder = PgOutputDecoder(opts.proto_version)
        assembler = self._assembler
        self._session_lsn = 0  # together with the reset (no await in between)
        assembler.reset()
        catalog = self._catalog
        client.set_positions(written=self._confirmed.value, flushed=self._confirmed.value)
        await client.start_replication(self.config.source.slot, 0, opts.options)
        self.stats.connected = True
        self.stats.streaming = True
        structlog.contextvars.bind_contextvars(slot=self.config.source.slot)
        log.info(
            "streaming",
            proto_version=opts.proto_version,
            streaming=opts.streaming,
            options=opts.options,
            server_version=client.server_version,
            fast_paths="compiled" if all(accel.status().values()) else "pure Python",
        )
        endpos = self.endpos
        stats = self.stats
        async for batch in client.message_batches():
            # The server sends a message only after every transaction prepared or committed
            # before its position. The session position moves once the whole batch is fed (while
            # the reader waits for room in the queue the acker sees a lower, safe value).
            streamed = self._session_lsn
            keepalives = 0
            for item in batch:
                if type(item) is tuple:
                    lsn, wal_end, _, data = item
                    stats.received_bytes += len(data)
                    if wal_end > streamed:
                        streamed = wal_end
                    if assembler.feed_undecoded(data, lsn, streamed=decoder.in_stream):
                        continue  # decoded when the transaction is released
                    msg = decoder.decode(data, lsn)
                    kind = type(msg)
                    if type(msg) is ev.Relation:
                        self._received.advance(streamed)  # as before any await
                        await catalog.on_relation(msg)
                    two_phase = kind in _TWO_PHASE_EVENTS
                    if two_phase:
                        unknown = assembler.unknown_gid_resolutions
                    cap = assembler.confirm_ceiling() if kind is ev.CommitPrepared else None
                    try:
                        txn = assembler.feed(msg, lsn, data)
                    except OSError as exc:
                        raise SpillError(
                            f"buffer.spill_dir {self.config.buffer.spill_dir}: {exc.strerror or exc} "
                            "(free disk space or raise buffer.memory_limit)"
                        ) from exc
                    if two_phase:
                        self._log_two_phase(msg, lsn, assembler.unknown_gid_resolutions > unknown)
                    if txn is None:
                        continue
                    self._received.advance(streamed)
                    if endpos is not None and txn.commit_lsn > endpos:
                        if cap is not None:  # never handed to the sinks: never durable
                            self._prepared_caps.append((cap, txn.end_lsn))
                        txn.release()
                        self._session_lsn = streamed
                        self._reach_endpos()
                        return
                    if txn.end_lsn <= self._queued_end_lsn:
                        txn.release()  # resent after a reconnect; the sinks already have it
                        continue
                    self._queued_end_lsn = txn.end_lsn
                    if cap is not None:
                        self._prepared_caps.append((cap, txn.end_lsn))
                    await self._enqueue(txn)
                else:  # PrimaryKeepalive
                    keepalives += 1
                    self._keepalive_lsn = max(self._keepalive_lsn, item.wal_end)
                    stats.server_wal_end = max(stats.server_wal_end, item.wal_end)
                    self._received.advance(item.wal_end)
                    if item.wal_end > streamed:
                        streamed = item.wal_end
                    # Unresolved prepared and uncommitted streamed transactions may remain: their
                    # commit comes after the server's position, so after endpos; the confirmed
                    # LSN stays before them (confirm_ceiling), so the next run receives them again.
                    if (
                        endpos is not None
                        and item.wal_end >= endpos
                        and not assembler.in_transaction
                    ):
                        self._session_lsn = streamed
                        self._reach_endpos()
                        return
            stats.received_messages += len(batch) - keepalives
            self._received.advance(streamed)
            self._session_lsn = streamed
            if self._stop.is_set():
                return

    async def _enqueue(self, txn: Transaction) -> None:
        """Hand ``txn`` to the writer. Besides ``buffer.queue_transactions``, the memory of the
        committed transactions waiting for the sinks is bounded by ``buffer.memory_limit``
        (one transaction always fits): reading pauses until the writer has released enough."""
        limit = self.config.buffer.memory_limit
        while self._queued_bytes and self._queued_bytes + txn.mem_bytes > limit:
            self._queue_room.clear()
            await self._queue_room.wait()
        self._queued_bytes += txn.mem_bytes
        await self._queue.put(txn)

    def _log_two_phase(self, msg: Any, lsn: int, unknown: bool) -> None:
        """Debug trace of prepared transactions. A Commit Prepared whose GID was not held
        delivers nothing: right for an empty prepared transaction, and after a restart for one
        made durable before the confirmed position passed its PREPARE; otherwise it was lost.
        Logged at info: it happens in normal operation, and it is the trace of a loss."""
        if unknown and type(msg) is ev.CommitPrepared:
            log.info(
                "commit prepared for a transaction not held: nothing to deliver",
                gid=msg.gid,
                xid=msg.xid,
                commit_lsn=format_lsn(msg.commit_lsn),
                end_lsn=format_lsn(msg.end_lsn),
                confirmed=format_lsn(self._confirmed.value),
            )
        else:
            log.debug(
                type(msg).__name__, gid=msg.gid, xid=msg.xid, lsn=format_lsn(lsn), unknown=unknown
            )

    def _reach_endpos(self) -> None:
        log.info("endpos reached", endpos=format_lsn(self.endpos or 0))
        self._endpos_reached = True

    # -- writing -----------------------------------------------------------------------------

    async def _writer(self, encoder: Encoder) -> None:
        queue = self._queue
        sinks = self.sinks
        stats = self.stats
        # no sink wants events (the null sink alone): hand over decoded changes, build no events
        events_wanted = any(sink.wants_events for sink in sinks)
        while True:
            if queue.empty():  # wait_for costs a task per call: only when there is nothing
                try:
                    txn = await asyncio.wait_for(queue.get(), timeout=0.1)
                except TimeoutError:
                    await self._maybe_flush(idle=True, quiet=True)
                    continue
            else:
                txn = queue.get_nowait()
            if txn is None:
                return
            self._writer_busy = True
            spent = [0.0] * len(sinks)
            try:
                await _each_sink(sinks, spent, methodcaller("begin", txn))
                if events_wanted:
                    for batch in encoder.batches(txn):
                        await _each_sink(sinks, spent, methodcaller("write", batch))
                        stats.events += len(batch)
                        self._count(batch)
                else:
                    for records in _record_batches(txn):
                        await _each_sink(sinks, spent, methodcaller("write_changes", records))
                        stats.events += len(records)
                        self._count_changes(records)
                await _each_sink(sinks, spent, methodcaller("commit", txn))
            finally:
                txn.release()
                self._queued_bytes -= txn.mem_bytes
                self._queue_room.set()
            if self.health is not None:
                for i, sink in enumerate(sinks):
                    self.health.sink_write_seconds.labels(sink.type_name).observe(spent[i])
            self._handed_end_lsn = max(self._handed_end_lsn, txn.end_lsn)
            if self._latency is not None:
                self._latency.handed(txn.end_lsn, txn.commit_time)
            stats.transactions += 1
            stats.last_commit_time_us = txn.commit_time
            self._writer_busy = False
            await self._maybe_flush(idle=queue.empty())

    def _count_changes(self, records: list[ChangeRecord]) -> None:
        """:meth:`_count` without events: per change (an Update of the key counts as ``u``)."""
        events_by = self.stats.events_by
        for record in records:
            change = record.change
            op = _CHANGE_OPS[type(change)]
            if op == "m":
                events_by["_messages", "m"] = events_by.get(("_messages", "m"), 0) + 1
                continue
            for rel in record.relations:  # one for a row change, each table for a Truncate
                key = (f"{schema_name(rel)}.{rel.name}", op)
                events_by[key] = events_by.get(key, 0) + 1

    def _count(self, events: list[Any]) -> None:
        """Per table and op counters (logical messages count under ``_messages``)."""
        events_by = self.stats.events_by
        for event in events:
            table = "_messages" if event.table is None else f"{event.schema}.{event.table}"
            key = (table, event.op)
            events_by[key] = events_by.get(key, 0) + 1

    async def _maybe_flush(self, *, idle: bool, quiet: bool = False) -> None:
        """Flush the sinks whose ``flush_interval`` has passed (``0``: whenever the queue is
        empty). A sink that publishes in the background on its own schedule (``flushes_itself``,
        the file sink) is flushed here only after the writer has been quiet for a while: a
        safety net, which also raises what its background flush failed with."""
        now = time.monotonic()
        for sink in self.sinks:
            if sink.durable_lsn() >= self._handed_end_lsn:
                continue
            if not quiet and getattr(sink, "flushes_itself", False):
                continue
            interval = float(getattr(sink, "flush_interval", 1.0))
            last = self._last_flush.get(id(sink), 0.0)
            if now - last >= interval or (idle and interval == 0):
                await self._flush_sink(sink)
                self._last_flush[id(sink)] = now

    async def _flush_sink(self, sink: Sink) -> None:
        delay = 0.5
        while True:
            try:
                t0 = time.perf_counter()
                await sink.flush()
                if self.health is not None:
                    self.health.sink_flush_seconds.labels(sink.type_name).observe(
                        time.perf_counter() - t0
                    )
                if self._latency is not None:
                    self._latency.durable(min(s.durable_lsn() for s in self.sinks))
                return
            except TransientSinkError as exc:
                log.warning("sink flush failed; retrying", sink=sink.type_name, error=str(exc))
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)

    async def _flush_all(self) -> None:
        for sink in self.sinks:
            await self._flush_sink(sink)

    # -- watching the slot ---------------------------------------------------------------------

    async def _slot_poller(self, source: Any, interval: float = 15.0) -> None:
        """Poll the slot's wal_status, safe_wal_size and retained WAL for metrics and warnings."""
        src = self.config.source
        sql = (
            "SELECT wal_status, safe_wal_size, pg_current_wal_lsn()::text, "
            "pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::int8 "
            "FROM pg_replication_slots WHERE slot_name = $1"
        )
        from cdcd.source import open_sql

        warned = False
        conn: Any = None
        while True:
            row = None
            try:
                if conn is None or conn.is_closed():
                    conn = await open_sql(source.params, src.connect_timeout)
                row = await conn.fetchrow(sql, src.slot)
            except asyncio.CancelledError:
                if conn is not None:
                    conn.terminate()
                raise
            except Exception as exc:  # best effort: metrics only
                log.debug("slot poll failed", error=str(exc))
            if row is not None:
                from cdcd.lsn import parse_lsn

                s = self.stats
                s.slot_wal_status = row[0]
                s.slot_safe_wal_size = row[1]
                s.server_wal_end = max(s.server_wal_end, parse_lsn(row[2]))
                s.slot_retained_bytes = row[3] or 0
                if s.slot_retained_bytes > src.retained_wal_warning and not warned:
                    log.warning(
                        "the slot retains more WAL than source.retained_wal_warning",
                        retained_bytes=s.slot_retained_bytes,
                        budget_bytes=src.retained_wal_warning,
                        wal_status=row[0],
                        safe_wal_size=row[1],
                    )
                    warned = True
                elif s.slot_retained_bytes <= src.retained_wal_warning:
                    warned = False
            await asyncio.sleep(interval)

    # -- acknowledging -----------------------------------------------------------------------

    def _confirmable(self) -> int:
        """The LSN that may be confirmed now (see the module docstring)."""
        assert self._assembler is not None
        durable = min((sink.durable_lsn() for sink in self.sinks), default=0)
        ceiling = self._assembler.confirm_ceiling()
        position = durable if ceiling is None else min(durable, ceiling)
        # Compared with what the reader queued, not only with what the writer finished: a
        # transaction the writer has taken from the queue but not yet marked busy, or one the
        # reader holds while waiting for room in the queue, is in neither place.
        nothing_in_flight = (
            self._assembler.idle
            and self._queue.empty()
            and not self._writer_busy
            and durable >= max(self._handed_end_lsn, self._queued_end_lsn)
        )
        if nothing_in_flight:
            position = max(position, min(self._keepalive_lsn, self._received.value))
        caps = self._prepared_caps
        if caps:  # committed prepared transactions not durable yet: stay before their PREPARE
            caps[:] = [cap for cap in caps if cap[1] > durable]
            if caps:
                position = min(position, *(cap[0] for cap in caps))
        position = min(position, self._session_lsn)
        if position > self._confirmed.value:
            log.debug(
                "confirming",
                position=format_lsn(position),
                durable=format_lsn(durable),
                ceiling=None if ceiling is None else format_lsn(ceiling),
                keepalive=format_lsn(self._keepalive_lsn),
                received=format_lsn(self._received.value),
                idle=nothing_in_flight,
            )
        return position

    async def _acknowledge(self, *, final: bool = False) -> None:
        moved = self._confirmed.advance(self._confirmable())
        self.stats.confirmed_lsn = self._confirmed.value
        client = self._client
        if client is None:
            return
        client.set_positions(
            written=max(self._received.value, self._confirmed.value),
            flushed=self._confirmed.value,
        )
        if moved or final:
            with contextlib.suppress(CdcdError, OSError):
                await client.send_status()

    def _on_server_notice(self, fields: Any) -> None:
        # PostgreSQL 18 does not fail when the publication is missing at a WAL position: it
        # warns "skipped loading publication" (55000) and publishes nothing of those changes
        # (15-17 fail with an error, which ends the stream). See whether it was dropped.
        if fields.code == "55000" and "publication" in fields.message:
            self._publication_check_due = True

    async def _check_publication(self, source: Any) -> None:
        """A definite error when the publication does not exist (any more)."""
        from cdcd.source import open_sql

        name = self.config.source.publication
        conn = await open_sql(source.params, self.config.source.connect_timeout)
        try:
            exists = await conn.fetchval(
                "SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)", name
            )
        finally:
            await conn.close()
        if not exists:
            raise DefiniteSourceError(
                f"publication {name!r} does not exist: it was dropped while streaming, and the "
                "server skips the changes it would have published. Re-create it and "
                "re-snapshot the tables (changes since the drop were not captured)"
            )
        log.warning(
            "the server skipped the publication at an earlier WAL position (created "
            "after the slot?); changes before its creation are not published",
            publication=name,
        )

    async def _acker(self, source: Any = None) -> None:
        while True:
            await asyncio.sleep(0.2)
            if self._publication_check_due and source is not None:
                self._publication_check_due = False
                try:
                    await self._check_publication(source)
                except TransientSourceError as exc:  # check again at the next tick
                    log.warning("could not check the publication", error=str(exc))
                    self._publication_check_due = True
            await self._acknowledge()
            if self._endpos_reached:
                await self._finish_endpos()
                return

    async def _finish_endpos(self) -> None:
        """With --endpos: wait until everything handed over is durable, confirm, stop."""
        while self._writer_busy or not self._queue.empty():
            await asyncio.sleep(0.05)
        await self._flush_all()
        await self._acknowledge(final=True)
        self._stop.set()


async def _each_sink(
    sinks: list[Sink], spent: list[float], call: Callable[[Sink], Awaitable[None]]
) -> None:
    """``await call(sink)`` (a ``methodcaller``) for each sink in order, adding its wall time
    to ``spent``."""
    for i, sink in enumerate(sinks):
        t0 = time.perf_counter()
        await call(sink)
        spent[i] += time.perf_counter() - t0


def _record_batches(txn: Transaction, size: int = 1000) -> Iterator[list[ChangeRecord]]:
    """The decoded changes of ``txn`` in lists of at most ``size`` (never empty)."""
    changes = txn.changes()
    while batch := list(islice(changes, size)):
        yield batch


def _install_signal_handlers(pipeline: Pipeline) -> Callable[[], None]:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, pipeline.request_stop)

    def remove() -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)

    return remove


async def run_async(config: Config, endpos: int | None) -> int:
    pipeline = Pipeline(config, endpos=endpos)
    remove = _install_signal_handlers(pipeline)
    try:
        return await pipeline.run()
    finally:
        remove()


def run(config: Config, endpos: int | None) -> int:
    """``cdcd run``: the daemon. Returns the exit code."""
    from cdcd.cli import run_async as run_on_loop

    # A large transaction is millions of buffered objects. With the default thresholds
    # (700, 10, 10) the cyclic GC re-traverses them again and again (a third of the CPU
    # time in bench/run.py W1); collecting young objects every 50,000 allocations keeps
    # the cost small while cyclic garbage (rare here) is still collected.
    gc.set_threshold(50_000, 20, 100)

    return int(run_on_loop(run_async(config, endpos)))


def check(config: Config) -> int:
    """``cdcd check``: report on the source; non-zero on any blocking problem."""
    from cdcd.cli import run_async as run_on_loop
    from cdcd.commands import check_async

    return int(run_on_loop(check_async(config)))


def slot(config: Config, action: str) -> int:
    """``cdcd slot create|drop|status``."""
    from cdcd.cli import run_async as run_on_loop
    from cdcd.commands import slot_async

    return int(run_on_loop(slot_async(config, action)))
