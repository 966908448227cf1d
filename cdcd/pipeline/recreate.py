"""``source.on_slot_lost: recreate``: a new slot, a reset per table, then a backfill.

A slot is lost when PostgreSQL invalidates it (``max_slot_wal_keep_size``, 18's
``idle_replication_slot_timeout``, a standby's conflict) or it disappears (dropped, not
synchronised before a failover). The changes between the last one cdcd read and the new slot's
start are gone for good. A backfill (an incremental snapshot of every published table) brings
back every row that exists, but not the deletes made in the gap: those rows would stay in every
consumer's copy. So, before the backfill, each published table gets a *reset*: an ``op: "t"``
event, ``source.snapshot = "reset"``, that consumers already apply as "forget every row before
this position" (docs/high-availability.md). Every published table needs a key the backfill
can page by (:meth:`cdcd.source.Source.recreate_slot` refuses before touching the slot
otherwise: a reset table that cannot be refilled would leave consumers without its rows)::

    old slot ... lost ▶ new slot at P ▶ reset (t per table at (P - 1, seq)) ▶ changes ≥ P
                                                           and backfill chunks (r) ≥ P

Positions: the resets form one pseudo-transaction at ``commit_lsn = P - 1`` (``seq`` 0, 1, ...
in table order), acknowledged at ``P``, the new slot's consistent point. P is the end of the
running-xacts record at which the new slot became consistent, created after everything the old
slot delivered, so every position published before is smaller; ``P - 1`` lies inside that
record, where no transaction commits, so nothing of the new stream shares it (the argument of
:mod:`cdcd.source.snapshot` for the initial snapshot). Every change the new slot streams commits at
or after P, and every backfill chunk sits at a later high watermark: the reset comes first in
every sink, and the file sinks (which skip positions not beyond their last one) publish it.

Crash safety: :class:`cdcd.source.snapshot.RecreateState` is written before the old slot is dropped
and removed only once the reset is durable in every sink (:meth:`SlotRecreator.run`); a start
that finds it replaces the slot again (another reset, later positions). The backfill's requests
are in the incremental snapshot's own state file, which resumes by itself.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import structlog

from cdcd.assembler.transaction import ChangeRecord, Transaction
from cdcd.config import Config
from cdcd.decoder.events import Truncate
from cdcd.errors import SlotLostError
from cdcd.lsn import format_lsn, unix_to_pg_us
from cdcd.pipeline.progress import ProgressTracker
from cdcd.pipeline.stream import Handover
from cdcd.pipeline.writer import Writer
from cdcd.snapshot.incremental import IncrementalSnapshot
from cdcd.source.catalog import LiveCatalog
from cdcd.source.snapshot import RecreateState, published_tables
from cdcd.stats import Stats

log = structlog.get_logger("cdcd.recreate")


class SlotRecreator:
    """Emits the reset and requests the backfill after :meth:`cdcd.source.Source.recreate_slot`
    (at start-up, or during the run through :meth:`after_loss`, the supervisor's hook)."""

    def __init__(
        self,
        config: Config,
        source: Any,
        writer: Writer,
        tracker: ProgressTracker,
        catalog: LiveCatalog,
        incremental: IncrementalSnapshot,
        stats: Stats,
        handover: Handover,
    ) -> None:
        self.config = config
        self.source = source
        self.writer = writer
        self.tracker = tracker
        self.catalog = catalog
        self.incremental = incremental
        self.stats = stats
        self.handover = handover
        self.state = RecreateState(config.snapshot.state_dir, config.source.slot)
        self._until: int | None = None  # the reset's end LSN, until durable everywhere

    async def after_loss(self, exc: SlotLostError) -> None:
        """The slot was found lost while streaming: replace it, reset, backfill."""
        log.error("replication slot lost while streaming", error=str(exc), reason=exc.reason)
        point = await self.source.recreate_slot(exc.reason)
        await self.reset(point, exc.reason)

    async def reset(self, point: int, reason: str) -> None:
        """Queue the reset of every published table at ``(point - 1, seq)`` and request their
        backfill (the new slot's consistent point is ``point``)."""
        conn = self.source.catalog_conn
        tables = await published_tables(conn, self.config.source.publication)
        records = []
        for table in tables:
            rel = table.relation
            await self.catalog.on_relation(rel)
            records.append(ChangeRecord(point - 1, Truncate(None, 0, (rel.oid,)), (rel,)))
        names = [f"{t.relation.namespace}.{t.relation.name}" for t in tables]
        # The new slot was created with confirmed_flush_lsn = point: the old slot's positions
        # must not be reported to it (a status update below a slot's position is not refused
        # by every server version). Confirming the point ahead of the reset's durability loses
        # nothing: the server has nothing before it to resend, and RecreateState redoes the
        # reset after a crash.
        self.tracker.confirm(point)
        # the reset is queued (and a transaction being handed in parts forgotten) before the
        # next session starts: its positions come after everything delivered before
        lost = self.handover.slot_replaced(point, reset=bool(records))
        if lost is not None:
            log.warning(
                "the transaction being handed over in parts is lost with the slot",
                commit_lsn=format_lsn(lost.commit_lsn),
                handed=lost.handed,
            )
        if records:
            txn = Transaction(
                kind="reset",
                xid=0,
                commit_lsn=point - 1,
                end_lsn=point,
                commit_time=unix_to_pg_us(int(time.time() * 1_000_000)),
                size=len(records),
                _records=records,
            )
            self._until = point
            await self.writer.put(txn)
        else:
            self.state.finish()
        self.incremental.restart(names)
        stats = self.stats
        stats.slot_recreations += 1
        stats.slot_recreated_reason = reason
        stats.slot_recreated_at = time.time()
        log.warning(
            "slot recreated: every published table reset and backfilled by an incremental "
            "snapshot; rows deleted while no slot existed are removed by the reset",
            reason=reason,
            reset_position=format_lsn(point - 1),
            tables=len(names),
        )

    def record_durable(self) -> None:
        """Forget the recreation once its reset is durable in every sink (also called by the
        pipeline once it has drained)."""
        until = self._until
        if until is not None and self.tracker.durable_lsn() >= until:
            self._until = None
            self.state.finish()
            log.info("the reset of the recreated slot is durable in every sink")

    async def run(self) -> None:
        while True:
            self.record_durable()
            await asyncio.sleep(0.2)
