"""The reader: one replication session, from the socket to committed transactions.

::

    ReplicationClient.message_batches() ──▶ PgOutputDecoder ──▶ Assembler ──Transaction──▶ Writer.put

It tells the progress tracker (:mod:`cdcd.pipeline.progress`) what moved: data received,
keepalives, each released transaction (before its next ``await``, so that a transaction is
never in neither the assembler nor the tracker), and, once a whole batch has been taken in, how
far the session has streamed. A transaction whose end LSN was queued before is a resend after a
reconnect and is dropped. A transaction committed past ``--endpos`` ends the session.

Begins, inserts, updates, deletes and commits that come in a row are fed in one compiled call
(``Assembler.feed_run``): the changes of a large transaction that the assembler keeps in compact
form undecoded (decoded once, when the transaction is released), the rest decoded and fed; the
call returns at each transaction (or part) released. Every other message (Relation, Type,
logical messages, streaming and two-phase ones, Origin) goes through the loop here, one by one.

A regular transaction is handed to the writer in parts while it arrives (docs/assembler.md,
"Parts"); :mod:`cdcd.pipeline.parts` decides when, and what to put of each part after a
reconnect. The last part is queued like a whole transaction.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

import structlog

from cdcd import accel
from cdcd.assembler.assembler import Assembler
from cdcd.assembler.transaction import Transaction
from cdcd.config import Config
from cdcd.decoder import events as ev
from cdcd.decoder.pgoutput import PgOutputDecoder
from cdcd.errors import SpillError
from cdcd.lsn import format_lsn
from cdcd.pipeline.parts import Parts
from cdcd.pipeline.progress import ProgressTracker
from cdcd.pipeline.writer import Writer
from cdcd.replication.client import ReplicationClient
from cdcd.replication.options import stream_options
from cdcd.snapshot.watermarks import PREFIXES, Watermarks, marker
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
        self.parts = Parts(tracker, assembler.confirm_ceiling, endpos=endpos, watermarks=watermarks)
        assembler.may_part = self.parts.may_part

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
        lost = self.parts.session_started()  # the server sends it again from its start
        if lost is not None:  # unless the slot was recreated (cdcd.pipeline.recreate)
            log.warning(
                "the transaction being handed over in parts is lost with the slot",
                commit_lsn=format_lsn(lost.commit_lsn),
                handed=lost.handed,
            )
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
            fast_paths="compiled"
            if all(accel.status(imported_only=True).values())
            else "pure Python",
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
            position = 0
            size = len(batch)
            while position < size:
                item = batch[position]
                if type(item) is tuple:
                    # Begins, inserts, updates, deletes and commits, as many as come in a row,
                    # fed in one call (compiled): changes taken undecoded into a transaction in
                    # spill format (decoded when released), else decoded and fed; the run ends
                    # where feeding releases a transaction or a part of one (docs/assembler.md,
                    # "Parts")
                    try:
                        run, nbytes, wal_end, txn = assembler.feed_run(
                            batch, position, decoder.decode, decoder.in_stream
                        )
                    except OSError as exc:
                        raise self._spill_error(exc) from exc
                    cap: int | None = None
                    if run:
                        position += run
                        stats.received_bytes += nbytes
                        if wal_end > streamed:
                            streamed = wal_end
                    else:  # any other message
                        position += 1
                        lsn, wal_end, _, data = item
                        stats.received_bytes += len(data)
                        if wal_end > streamed:
                            streamed = wal_end
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
                            raise self._spill_error(exc) from exc
                        if two_phase:
                            self._log_two_phase(
                                msg, lsn, assembler.unknown_gid_resolutions > unknown
                            )
                    if txn is None:
                        continue
                    continued = not txn.ends or self.parts.handing is not None
                    if continued:
                        txn = self._in_parts(txn)
                        if txn is None:
                            continue
                        if not txn.ends:
                            await writer.put(txn)
                            continue
                        continued = not txn.begins
                    tracker.received(streamed)
                    if endpos is not None and txn.commit_lsn > endpos:
                        tracker.past_endpos(cap)  # never handed to the sinks
                        txn.release()
                        tracker.streamed(streamed)
                        self._reach_endpos()
                        return
                    if watermarks is not None and (marked or watermarks.window_open):
                        # never for the last part of a transaction handed in parts (no window
                        # is open then, and a transaction of watermark or signal has one change)
                        mark = marker(txn) if marked and not continued else None
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
                    position += 1
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

    def _spill_error(self, exc: OSError) -> SpillError:
        return SpillError(
            f"buffer.spill_dir {self.config.buffer.spill_dir}: "
            f"{exc.strerror or exc} (free disk space or raise buffer.memory_limit)"
        )

    def _in_parts(self, txn: Transaction) -> Transaction | None:
        """What to put of ``txn``, a part of a transaction handed in parts (or one that comes
        while it is): :meth:`Parts.take`, logging the changes dropped after a reconnect."""
        handing = self.parts.handing
        taken, resent = self.parts.take(txn)
        if resent and handing is not None:
            log.info(
                "transaction resent after a reconnect: dropping the changes handed before",
                commit_lsn=format_lsn(handing.commit_lsn),
                handed=resent,
            )
        return taken

    def _gauges(self) -> None:
        a = self.assembler
        s = self.stats
        s.buffered_bytes = a.buffered_bytes
        s.spilled_bytes = a.spilled_bytes
        s.open_streams = a.open_streams
        s.held_prepared = a.held_prepared
        s.rendered_changes = a.rendered

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
