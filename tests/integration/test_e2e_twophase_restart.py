"""Prepared transactions across crashes, reconnects and ``--endpos``: the confirmed position must
stay before the PREPARE of every prepared transaction the sinks do not hold durably.

PostgreSQL decides whether to send a prepared transaction's changes again by the position of its
PREPARE: once the slot's confirmed position is past it, a new session sends only Commit Prepared,
for a GID the new process never held, and the transaction is gone (docs/protocol.md, "Two-phase"). The
SIGKILL loop with Kafka and files (``test_crash_kafka.py``) lost prepared transactions that way.
Each test here reproduces one way the confirmed position could pass a PREPARE, deterministically:

* a prepared transaction released by Commit Prepared but not yet durable, while the sinks are
  durable through a transaction committed between its PREPARE and its COMMIT PREPARED;
* a reconnect: the assembler forgets the prepared transactions it held until the server sends
  them again, while the sinks are durable past their PREPAREs;
* ``--endpos`` before a COMMIT PREPARED: the released transaction is not handed to the sinks.

cdcd runs in-process (:class:`cdcd.pipeline.service.Pipeline`), so a test can act at the worst moment; a
"crash" cancels it (nothing more is flushed or confirmed than what it had sent). Then the slot's
confirmed position is checked, and a second run to ``--endpos`` must deliver the prepared
transaction's row: the outcome a user sees.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import pytest

from cdcd.assembler.transaction import Transaction
from cdcd.config import load_config
from cdcd.errors import EXIT_OK
from cdcd.lsn import parse_lsn
from cdcd.pipeline.service import Pipeline
from cdcd.sinks.base import SinkContext
from cdcd.sinks.memory import MemorySink, MemorySinkConfig
from cdcd.sinks.registry import BUILTIN_SINKS
from tests.e2e import run_cdcd, write_config
from tests.integration.test_crash_kafka import wait_until
from tests.pgharness import PgDatabase, PgInstall

pytestmark = [pytest.mark.pg, pytest.mark.timeout(120)]

SLOT = "cdcd_e2e"


class GatedSink(MemorySink):
    """A memory sink that stops making transactions durable at the first prepared one (as a
    Kafka sink whose records are still in flight, or a file not yet published), and never
    flushes on its own."""

    type_name = "gated"
    flush_interval = 3600.0

    def __init__(self, config: MemorySinkConfig, context: SinkContext) -> None:
        super().__init__(config, context)
        self.holding = False

    async def commit(self, txn: Transaction) -> None:
        self.transactions.append((txn.xid, txn.commit_lsn, txn.end_lsn, self._current))
        self.holding = self.holding or txn.kind == "prepared"
        if not self.holding:
            self._mark_durable(txn.end_lsn)


@pytest.fixture(autouse=True)
def _two_phase_servers(pg_install: PgInstall, monkeypatch: pytest.MonkeyPatch) -> None:
    if pg_install.major < 15:
        pytest.skip("two-phase decoding needs PostgreSQL 15 or later")
    monkeypatch.setitem(BUILTIN_SINKS, "gated", f"{__name__}:GatedSink")


def setup(db: PgDatabase, tmp_path: Path) -> None:
    db.execute(
        "CREATE TABLE t (id int PRIMARY KEY, v text); CREATE PUBLICATION cdcd_e2e_pub FOR TABLE t"
    )
    run_cdcd("slot", "create", "--config", str(config(db, tmp_path, "memory")))


def config(db: PgDatabase, tmp_path: Path, sink: str) -> Path:
    return write_config(
        tmp_path / sink,
        db.dsn,
        sinks=[{"type": sink}],
        two_phase=True,
        reconnect_min_backoff=0.1,
        reconnect_max_backoff=0.2,
    )


def prepare(db: PgDatabase, row: int, gid: str) -> int:
    """A prepared transaction inserting ``row``; returns a WAL position before its PREPARE."""
    with db.connect() as conn, conn.cursor() as cur:
        cur.execute("BEGIN")
        cur.execute("INSERT INTO t VALUES (%s, 'prepared')", (row,))
        cur.execute("SELECT pg_current_wal_insert_lsn()::text")
        before = parse_lsn(cur.fetchone()[0])
        cur.execute(f"PREPARE TRANSACTION '{gid}'")
    return before


def confirmed(db: PgDatabase) -> int:
    return parse_lsn(
        db.fetchval(
            f"SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = '{SLOT}'"
        )
    )


def insert_lsn(db: PgDatabase) -> int:
    return parse_lsn(db.fetchval("SELECT pg_current_wal_insert_lsn()::text"))


async def start(cfg: Path) -> tuple[Pipeline, asyncio.Task[int]]:
    pipeline = Pipeline(load_config(cfg))
    task = asyncio.create_task(pipeline.run())
    await wait_until(lambda: pipeline.stats.streaming or task.done(), "cdcd to stream")
    assert not task.done(), task.result()
    return pipeline, task


async def crash(task: asyncio.Task[int]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def run_to_endpos(cfg: Path, endpos: int) -> tuple[Pipeline, list[int]]:
    """``cdcd run --endpos``; the pipeline and the ids of the rows inserted, in order."""
    pipeline = Pipeline(load_config(cfg), endpos=endpos)
    assert await pipeline.run() == EXIT_OK
    (sink,) = pipeline.sinks
    assert isinstance(sink, MemorySink)
    values: list[dict[str, Any]] = sink.values
    return pipeline, [v["after"]["id"] for v in values if v["op"] == "c"]


async def test_committed_prepared_transaction_not_yet_durable(
    pg_db: PgDatabase, tmp_path: Path
) -> None:
    """Durable through T (committed between g1's PREPARE and COMMIT PREPARED), g1 released by
    Commit Prepared but not durable: an acknowledgement then must not pass g1's PREPARE."""
    setup(pg_db, tmp_path)
    pipeline, task = await start(config(pg_db, tmp_path, "gated"))
    try:
        before_prepare = prepare(pg_db, 1, "g1")
        pg_db.execute("INSERT INTO t VALUES (2, 'after the prepare')")
        pg_db.execute("COMMIT PREPARED 'g1'")
        (sink,) = pipeline.sinks
        assert isinstance(sink, GatedSink)
        await wait_until(lambda: sink.holding, "g1 to reach the sink")
        assert sink.durable_lsn() > before_prepare  # T is durable: the premise of the test
        await pipeline.acker.acknowledge()  # what the acker does every 0.2 s
    finally:
        await crash(task)
    assert confirmed(pg_db) <= before_prepare
    _, rows = await run_to_endpos(config(pg_db, tmp_path, "memory"), insert_lsn(pg_db))
    assert 1 in rows and 2 in rows, rows


async def test_reconnect_while_a_prepared_transaction_is_held(
    pg_db: PgDatabase, tmp_path: Path
) -> None:
    """g1 prepared, T committed after it and durable; the connection is lost. Between the
    assembler's reset and the server sending g1 again, an acknowledgement must not pass g1's
    PREPARE (the acker may run at any await; here it runs at the first one)."""
    setup(pg_db, tmp_path)
    pipeline, task = await start(config(pg_db, tmp_path, "memory"))
    acks: list[asyncio.Task[None]] = []
    try:
        before_prepare = prepare(pg_db, 1, "g1")
        pg_db.execute("INSERT INTO t VALUES (2, 'after the prepare')")
        assembler = pipeline.assembler
        assert assembler is not None
        (sink,) = pipeline.sinks
        await wait_until(lambda: sink.durable_lsn() > before_prepare, "T to be durable")
        assert assembler.held_prepared == 1
        inner = assembler

        class ResetThenAcknowledge:
            """The assembler, whose reset also starts an acknowledgement (a proxy: the
            compiled Assembler's methods cannot be replaced on the instance)."""

            def __getattr__(self, name: str) -> Any:
                return getattr(inner, name)

            def reset(self) -> None:
                inner.reset()
                acks.append(asyncio.get_running_loop().create_task(pipeline.acker.acknowledge()))

        pipeline.reader.assembler = ResetThenAcknowledge()  # type: ignore[assignment]
        pg_db.execute(
            f"SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots "
            f"WHERE slot_name = '{SLOT}'"
        )
        await wait_until(
            lambda: (
                pipeline.stats.reconnects >= 1
                and pipeline.stats.streaming
                and assembler.held_prepared == 1
                and all(a.done() for a in acks)
            ),
            "cdcd to stream again and hold g1 again",
        )
        assert acks
        await pipeline.acker.acknowledge()
    finally:
        await crash(task)
    assert confirmed(pg_db) <= before_prepare
    pg_db.execute("COMMIT PREPARED 'g1'")
    _, rows = await run_to_endpos(config(pg_db, tmp_path, "memory"), insert_lsn(pg_db))
    assert 1 in rows, rows


async def test_endpos_before_commit_prepared(pg_db: PgDatabase, tmp_path: Path) -> None:
    """``--endpos`` between T and g1's COMMIT PREPARED: g1 is released past endpos and dropped;
    the final acknowledgement must not pass its PREPARE, so the next run delivers it."""
    setup(pg_db, tmp_path)
    before_prepare = prepare(pg_db, 1, "g1")
    pg_db.execute("INSERT INTO t VALUES (2, 'after the prepare')")
    endpos = insert_lsn(pg_db) - 1  # the COMMIT PREPARED record starts after it
    pg_db.execute("COMMIT PREPARED 'g1'")
    pg_db.execute("INSERT INTO t VALUES (3, 'after the commit prepared')")
    cfg = config(pg_db, tmp_path, "memory")
    first, rows = await run_to_endpos(cfg, endpos)
    assert rows == [2]
    # The premise: the run stopped at g1's Commit Prepared (past endpos), not while holding g1.
    assert first.assembler is not None and first.assembler.held_prepared == 0
    assert confirmed(pg_db) <= before_prepare
    _, rows = await run_to_endpos(cfg, insert_lsn(pg_db))
    assert sorted(set(rows)) == [1, 2, 3], rows
