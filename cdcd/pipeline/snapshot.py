"""Orchestrating the initial snapshot: every published table read at the slot's exported
snapshot and handed to the sinks as one pseudo-transaction of ``op: "r"`` events (how rows are
read: :mod:`cdcd.source.snapshot`). Their position is just before the consistent point
(``commit_lsn`` = point - 1: a transaction may commit at the point itself); the pseudo-transaction
is acknowledged at the point.

It runs before streaming starts, so it writes to the sinks directly, one after the other,
retrying :class:`~cdcd.errors.TransientSinkError` as the writer does. The progress tracker counts
the snapshot in flight until every sink holds the consistent point durably; the state file
records it finished only after that.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

import structlog

from cdcd.assembler.transaction import Transaction
from cdcd.config import Config
from cdcd.events.encoder import Encoder
from cdcd.lsn import format_lsn, unix_to_pg_us
from cdcd.pipeline.progress import ProgressTracker
from cdcd.pipeline.writer import Writer, retrying
from cdcd.source import open_sql
from cdcd.source.catalog import LiveCatalog
from cdcd.source.snapshot import published_tables, read_rows
from cdcd.stats import Stats

log = structlog.get_logger("cdcd.snapshot")


async def initial_snapshot(
    config: Config,
    source: Any,
    plan: Any,
    writer: Writer,
    encoder: Encoder,
    catalog: LiveCatalog,
    tracker: ProgressTracker,
    stats: Stats,
) -> None:
    """Read every published table at ``plan``'s exported snapshot into every sink."""
    sinks = writer.sinks

    async def each_sink(what: str, call: Callable[[Any], Awaitable[None]]) -> None:
        for sink, sink_stats in zip(sinks, stats.sinks, strict=True):
            await retrying(partial(call, sink), what, sink_stats)

    point = plan.consistent_point
    tracker.snapshot_started(point)
    conn = await open_sql(source.params, config.source.connect_timeout)
    log.info("initial snapshot starting", consistent_point=format_lsn(point))
    started = time.monotonic()
    rows_total = 0
    try:
        async with conn.transaction(isolation="repeatable_read", readonly=True):
            literal = "'" + plan.name.replace("'", "''") + "'"
            await conn.execute(f"SET TRANSACTION SNAPSHOT {literal}")
            tables = await published_tables(conn, config.source.publication)
            commit_time = unix_to_pg_us(int(time.time() * 1_000_000))
            txn = Transaction(
                kind="snapshot",
                xid=0,
                commit_lsn=point - 1,  # a commit can start at the point (cdcd.source.snapshot)
                end_lsn=point,
                commit_time=commit_time,
                size=0,
            )
            await each_sink("begin", lambda sink: sink.begin(txn))
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
                await each_sink("write", lambda sink: sink.write(events))
                stats.events += len(events)
                stats.count(f"{relation.namespace}.{relation.name}", "r", len(events))

            for table in tables:
                await catalog.on_relation(table.relation)
                async for rows in read_rows(conn, table, config.snapshot.batch_rows):
                    if pending is not None:
                        await emit(*pending, last=False)
                    pending = (table.relation, rows)
                    rows_total += len(rows)
            if pending is not None:
                await emit(*pending, last=True)
            await each_sink("commit", lambda sink: sink.commit(txn))
        for i in range(len(sinks)):
            tracker.handed(i, point)
        await writer.flush_all()
        plan.state.finish(point)
    finally:
        await conn.close()
    log.info("initial snapshot done", rows=rows_total, seconds=round(time.monotonic() - started, 3))
