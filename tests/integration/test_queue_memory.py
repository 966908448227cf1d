"""Committed transactions waiting for a slow sink count against ``buffer.memory_limit``.

The queue between the reader and the writer is bounded by ``buffer.queue_transactions`` and,
in bytes, by ``buffer.memory_limit`` (Transaction.mem_bytes): with a sink that does not keep
up, reading pauses once the queued transactions hold the limit, long before the count bound.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import yaml

from cdcd.assembler.transaction import Transaction
from cdcd.config import load_config
from cdcd.pipeline.service import Pipeline
from cdcd.sinks.base import SinkContext
from cdcd.sinks.memory import MemorySink, MemorySinkConfig
from cdcd.sinks.registry import BUILTIN_SINKS
from tests.e2e import run_cdcd, write_config
from tests.integration.test_crash_kafka import wait_until
from tests.pgharness import PgDatabase

pytestmark = [pytest.mark.pg, pytest.mark.version_independent, pytest.mark.timeout(120)]

TRANSACTIONS = 30
ROWS = 20
LIMIT = 1 << 20


class SlowSink(MemorySink):
    """A memory sink whose writes wait for ``gate``."""

    type_name = "slow"
    gate: asyncio.Event | None = None

    def __init__(self, config: MemorySinkConfig, context: SinkContext) -> None:
        super().__init__(config, context)

    async def begin(self, txn: Transaction) -> None:
        assert SlowSink.gate is not None
        await SlowSink.gate.wait()
        await super().begin(txn)


@pytest.fixture(autouse=True)
def _slow_sink(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(BUILTIN_SINKS, "slow", f"{__name__}:SlowSink")


def config(db: PgDatabase, tmp_path: Path, sink: str) -> Path:
    path = write_config(tmp_path / sink, db.dsn, sinks=[{"type": sink}])
    cfg = yaml.safe_load(path.read_text())
    cfg["buffer"] |= {"memory_limit": LIMIT, "queue_transactions": 1000}
    path.write_text(yaml.safe_dump(cfg))
    return path


async def test_queued_transactions_are_bounded_in_bytes(pg_db: PgDatabase, tmp_path: Path) -> None:
    pg_db.execute(
        "CREATE TABLE t (id int PRIMARY KEY, v text); CREATE PUBLICATION cdcd_e2e_pub FOR TABLE t"
    )
    run_cdcd("slot", "create", "--config", str(config(pg_db, tmp_path, "memory")))
    for i in range(TRANSACTIONS):  # ~20 rows of 4 KB: about 200 KB accounted each
        pg_db.execute(
            f"INSERT INTO t SELECT g, repeat(md5(g::text), 128) "
            f"FROM generate_series({i * ROWS}, {i * ROWS + ROWS - 1}) g"
        )
    SlowSink.gate = asyncio.Event()
    pipeline = Pipeline(load_config(config(pg_db, tmp_path, "slow")))
    task = asyncio.create_task(pipeline.run())
    try:
        await wait_until(lambda: pipeline.stats.streaming or task.done(), "cdcd to stream")
        # the reader fills the queue until the bytes bound stops it
        await wait_until(lambda: pipeline.writer.queued_transactions >= 3, "transactions to queue")
        await asyncio.sleep(1.0)
        queued = pipeline.writer.queued_transactions
        assert 3 <= queued < TRANSACTIONS - 1, queued
        assert 0 < pipeline.stats.queued_bytes <= LIMIT
        assert pipeline.stats.queued_bytes + 300_000 > LIMIT  # full: the next one did not fit
        SlowSink.gate.set()
        (sink,) = pipeline.sinks
        assert isinstance(sink, MemorySink)
        await wait_until(lambda: len(sink.events) == TRANSACTIONS * ROWS, "every row")
        assert pipeline.stats.queued_bytes == 0
        ids = [ev.value()["after"]["id"] for ev in sink.events]
        assert ids == list(range(TRANSACTIONS * ROWS))
    finally:
        pipeline.request_stop()
        await asyncio.wait_for(task, 30)
