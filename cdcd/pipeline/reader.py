"""The reader: one replication session, from the socket to committed transactions.

::

    ReplicationClient.message_batches() ──▶ PgOutputDecoder ──▶ Assembler ──Transaction──▶ Writer.put

I/O and dispatch only: what to hand on is decided by the handover (:mod:`cdcd.pipeline.stream`),
which the reader tells what moved — data received, keepalives, each released transaction (before
its next ``await``, so that a transaction is never in neither the assembler nor the progress
tracker), and, once a whole batch has been taken in, how far the session has streamed — and
whose answers it carries out: put to the writer, drop (a resend after a reconnect, a watermark),
end the session (``--endpos``).

Begins, inserts, updates, deletes and commits that come in a row are fed in one compiled call
(``Assembler.feed_run``): the changes of a large transaction that the assembler keeps in compact
form undecoded (decoded once, when the transaction is released), the rest decoded and fed; the
call returns at each transaction (or part) released. Every other message (Relation, Type,
logical messages, streaming and two-phase ones, Origin) goes through the loop here, one by one.
When some sink writes JSON, the run is :func:`~cdcd.pipeline.feeding.feed_rendering`'s, which
renders streamed changes as they arrive (docs/assembler.md, "Rendering streamed changes"). Type
messages go to the catalog's type registry from here.

A regular transaction is handed to the writer in parts while it arrives (docs/assembler.md,
"Parts"); the handover decides when, and what to put of each part after a reconnect. The last
part is queued like a whole transaction.
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
from cdcd.events.encoder import Encoder
from cdcd.lsn import format_lsn
from cdcd.pipeline.feeding import feed_rendering
from cdcd.pipeline.progress import ProgressTracker
from cdcd.pipeline.stream import Drop, Endpos, Handover, Put
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
        renderer: Encoder | None = None,
    ) -> None:
        self.config = config
        #: Renders a streamed change's row JSON as it arrives, when some sink writes JSON
        #: (docs/assembler.md, "Rendering streamed changes"); None: nothing is rendered.
        self.renderer = renderer
        self.assembler = assembler
        self.catalog = catalog
        self.tracker = tracker
        self.writer = writer
        self.stats = stats
        self.endpos = endpos
        self._stop = stop
        self.endpos_reached = False
        self.handover = Handover(
            tracker,
            assembler.part_policy,
            assembler.confirm_ceiling,
            endpos=endpos,
            watermarks=watermarks,
            marker=marker,
        )

    async def stream(self, client: ReplicationClient) -> None:
        """Stream from ``client`` until ``--endpos`` or a stop request (return) or a failure
        (raise)."""
        source = self.config.source
        opts = stream_options(source, client.server_version)
        decoder = PgOutputDecoder(opts.proto_version)
        assembler = self.assembler
        handover = self.handover
        assembler.reset()
        handover.session_started()  # what is being handed in parts comes again from its start
        confirmed = self.tracker.confirmed_lsn
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
        catalog = self.catalog
        writer = self.writer
        renderer = self.renderer
        reads_before = stats.socket_reads
        async for batch in client.message_batches():
            # The server sends a message only after every transaction prepared or committed
            # before its position. The session position moves once the whole batch is taken in.
            streamed = 0
            keepalives = 0
            position = 0
            size = len(batch)
            while position < size:
                handover.before_feed()
                item = batch[position]
                if type(item) is tuple:
                    # Begins, inserts, updates, deletes and commits, as many as come in a row,
                    # fed in one call (compiled): changes taken undecoded into a transaction in
                    # spill format (decoded when released), else decoded and fed; the run ends
                    # where feeding releases a transaction or a part of one (docs/assembler.md,
                    # "Parts")
                    try:
                        if renderer is None:
                            run, nbytes, wal_end, txn = assembler.feed_run(
                                batch, position, decoder.decode, decoder.in_stream
                            )
                        else:  # streamed changes rendered as they arrive (docs/assembler.md)
                            run, nbytes, wal_end, txn = feed_rendering(
                                assembler, renderer, batch, position, decoder.decode,
                                decoder.in_stream,
                            )  # fmt: skip
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
                            handover.marked()
                        elif kind is ev.Relation:
                            handover.received(streamed)
                            await catalog.on_relation(msg)  # type: ignore[arg-type]
                        elif kind is ev.Type:
                            catalog.types.observe(msg)  # type: ignore[arg-type]
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
                    match handover.released(txn, streamed, cap):
                        case Transaction() as put:  # the common answer: put it as it is
                            await writer.put(put)
                        case Put(txn=put, resumed=resumed, relation=rel, replaced=replaced):
                            if resumed:
                                self._log_resumed(put, resumed)
                            if replaced is not None:
                                replaced.release()
                            if rel is not None and not catalog.knows(rel.oid):
                                await catalog.on_relation(rel)  # a snapshot chunk's
                            await writer.put(put)
                        case Drop(txn=dropped, resumed=resumed):
                            if resumed:
                                self._log_resumed(dropped, resumed)
                            dropped.release()
                        case Endpos():
                            txn.release()  # committed past it: never handed to the sinks
                            self._reach_endpos()
                            return
                else:
                    position += 1
                    keepalives += 1
                    wal_end = cast(PrimaryKeepalive, item).wal_end
                    if wal_end > stats.server_wal_end:
                        stats.server_wal_end = wal_end
                    if wal_end > streamed:
                        streamed = wal_end
                    if handover.keepalive(wal_end, streamed, assembler.in_transaction):
                        self._reach_endpos()
                        return
            stats.received_messages += len(batch) - keepalives
            stats.socket_reads = reads_before + client.socket_reads
            handover.streamed(streamed)
            self._gauges()
            if self._stop.is_set():
                return

    def _spill_error(self, exc: OSError) -> SpillError:
        return SpillError(
            f"buffer.spill_dir {self.config.buffer.spill_dir}: "
            f"{exc.strerror or exc} (free disk space or raise buffer.memory_limit)"
        )

    @staticmethod
    def _log_resumed(txn: Transaction, resumed: int) -> None:
        log.info(
            "transaction resent after a reconnect: dropping the changes handed before",
            commit_lsn=format_lsn(txn.commit_lsn),
            handed=resumed,
        )

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
