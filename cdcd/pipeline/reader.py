"""The reader: one replication session, from the socket to committed transactions.

::

    ReplicationClient.message_batches() ──▶ PgOutputDecoder ──▶ Assembler ──Transaction──▶ Writer.put

It tells the progress tracker (:mod:`cdcd.pipeline.progress`) what moved: data received,
keepalives, each released transaction (before its next ``await``, so that a transaction is
never in neither the assembler nor the tracker), and, once a whole batch has been taken in, how
far the session has streamed. A transaction whose end LSN was queued before is a resend after a
reconnect and is dropped. A transaction committed past ``--endpos`` ends the session.

Changes of a large transaction that the assembler keeps in compact form are handed to it
undecoded (``feed_undecoded``) and decoded once, when the transaction is released.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

import structlog

from cdcd import accel
from cdcd.assembler.assembler import Assembler
from cdcd.config import Config
from cdcd.decoder import events as ev
from cdcd.decoder.pgoutput import PgOutputDecoder
from cdcd.errors import SpillError
from cdcd.lsn import format_lsn
from cdcd.pipeline.progress import ProgressTracker
from cdcd.pipeline.watermarks import PREFIXES, Watermarks, marker
from cdcd.pipeline.writer import Writer
from cdcd.replication.client import ReplicationClient
from cdcd.replication.options import stream_options
from cdcd.source.catalog import LiveCatalog
from cdcd.stats import Stats
from cdcd.wire.copydata import PrimaryKeepalive

log = structlog.get_logger("cdcd.reader")

_TWO_PHASE_EVENTS = (
    ev.BeginPrepare,
    ev.Prepare,
    ev.StreamPrepare,
    ev.CommitPrepared,
    ev.RollbackPrepared,
)


class Reader:
    """Streams one session at a time (:meth:`stream`); the supervisor reconnects."""

    def __init__(
        self,
        config: Config,
        assembler: Assembler,
        catalog: LiveCatalog,
        tracker: ProgressTracker,
        writer: Writer,
        stats: Stats,
        *,
        endpos: int | None,
        stop: asyncio.Event,
        watermarks: Watermarks | None = None,
    ) -> None:
        self.config = config
        self.assembler = assembler
        self.catalog = catalog
        self.tracker = tracker
        self.writer = writer
        self.stats = stats
        self.endpos = endpos
        self._stop = stop
        self.endpos_reached = False
        self.watermarks = watermarks

    async def stream(self, client: ReplicationClient) -> None:
        """Stream from ``client`` until ``--endpos`` or a stop request (return) or a failure
        (raise)."""
        source = self.config.source
        opts = stream_options(source, client.server_version)
        decoder = PgOutputDecoder(opts.proto_version)
        assembler = self.assembler
        tracker = self.tracker
        assembler.reset()
        tracker.session_started()
        confirmed = tracker.confirmed_lsn
        client.set_positions(written=confirmed, flushed=confirmed)
        await client.start_replication(source.slot, 0, opts.options)
        stats = self.stats
        stats.connected = True
        stats.streaming = True
        stats.waiting_for = None
        structlog.contextvars.bind_contextvars(slot=source.slot)
        log.info(
            "streaming",
            proto_version=opts.proto_version,
            streaming=opts.streaming,
            options=opts.options,
            server_version=client.server_version,
            fast_paths="compiled" if all(accel.status().values()) else "pure Python",
        )
        endpos = self.endpos
        catalog = self.catalog
        writer = self.writer
        watermarks = self.watermarks
        marked = False  # the transaction being received carries a watermark or signal
        reads_before = stats.socket_reads
        async for batch in client.message_batches():
            # The server sends a message only after every transaction prepared or committed
            # before its position. The session position moves once the whole batch is taken in.
            streamed = 0
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
                    if kind is ev.Message and msg.prefix in PREFIXES:  # type: ignore[union-attr]
                        marked = True
                    elif kind is ev.Relation:
                        tracker.received(streamed)
                        await catalog.on_relation(msg)  # type: ignore[arg-type]
                    two_phase = kind in _TWO_PHASE_EVENTS
                    if two_phase:
                        unknown = assembler.unknown_gid_resolutions
                    cap = assembler.confirm_ceiling() if kind is ev.CommitPrepared else None
                    try:
                        txn = assembler.feed(msg, lsn, data)
                    except OSError as exc:
                        raise SpillError(
                            f"buffer.spill_dir {self.config.buffer.spill_dir}: "
                            f"{exc.strerror or exc} (free disk space or raise buffer.memory_limit)"
                        ) from exc
                    if two_phase:
                        self._log_two_phase(msg, lsn, assembler.unknown_gid_resolutions > unknown)
                    if txn is None:
                        continue
                    tracker.received(streamed)
                    if endpos is not None and txn.commit_lsn > endpos:
                        tracker.past_endpos(cap)  # never handed to the sinks
                        txn.release()
                        tracker.streamed(streamed)
                        self._reach_endpos()
                        return
                    if watermarks is not None and (marked or watermarks.window_open):
                        mark = marker(txn) if marked else None
                        marked = False
                        if txn.end_lsn > tracker.last_queued_end:  # else a resend: below
                            taken = watermarks.observe(txn, mark)
                            if taken is not txn:
                                txn.release()
                                if taken is None:
                                    continue  # a watermark or signal: not for the sinks
                                txn = taken
                                rel = next(txn.changes()).relations[0]  # a snapshot chunk
                                if not catalog.knows(rel.oid):  # no change of it streamed yet
                                    await catalog.on_relation(rel)
                    if not tracker.queued(txn.end_lsn, cap):
                        txn.release()  # resent after a reconnect; the sinks have it
                        continue
                    await writer.put(txn)
                else:
                    keepalives += 1
                    wal_end = cast(PrimaryKeepalive, item).wal_end
                    tracker.keepalive(wal_end)
                    if wal_end > stats.server_wal_end:
                        stats.server_wal_end = wal_end
                    if wal_end > streamed:
                        streamed = wal_end
                    # Unresolved prepared and uncommitted streamed transactions may remain: their
                    # commit comes after the server's position, so after endpos; the confirmed
                    # LSN stays before them (the assembler's ceiling), so the next run receives
                    # them again.
                    if endpos is not None and wal_end >= endpos and not assembler.in_transaction:
                        tracker.streamed(streamed)
                        self._reach_endpos()
                        return
            stats.received_messages += len(batch) - keepalives
            stats.socket_reads = reads_before + client.socket_reads
            tracker.streamed(streamed)
            self._gauges()
            if self._stop.is_set():
                return

    def _gauges(self) -> None:
        a = self.assembler
        s = self.stats
        s.buffered_bytes = a.buffered_bytes
        s.spilled_bytes = a.spilled_bytes
        s.open_streams = a.open_streams
        s.held_prepared = a.held_prepared

    def _reach_endpos(self) -> None:
        log.info("endpos reached", endpos=format_lsn(self.endpos or 0))
        self.endpos_reached = True

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
                confirmed=format_lsn(self.tracker.confirmed_lsn),
            )
        else:
            log.debug(
                type(msg).__name__, gid=msg.gid, xid=msg.xid, lsn=format_lsn(lsn), unknown=unknown
            )
