"""A snapshot cdcd was configured to take is never skipped: cdcd stopping right after it created
the slot (before recording the snapshot's consistent point) must end, at the next start, in a
new slot and every existing row snapshotted — not in a slot whose next start skips the rows
that existed before it."""

from __future__ import annotations

from pathlib import Path

import pytest

from cdcd.config import load_config
from cdcd.pipeline.service import Pipeline
from cdcd.sinks.memory import MemorySink
from cdcd.source.snapshot import SnapshotState
from tests.e2e import write_config
from tests.pgharness import PgDatabase

pytestmark = [pytest.mark.pg, pytest.mark.timeout(120)]


class Crash(Exception):
    pass


async def test_crash_between_slot_creation_and_the_snapshot(
    pg_db: PgDatabase, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pg_db.execute(
        "CREATE TABLE t (id int PRIMARY KEY, v text);"
        "INSERT INTO t SELECT g, 'v' || g FROM generate_series(1, 300) g"
    )
    cfg = write_config(tmp_path, pg_db.dsn, sinks=[{"type": "memory"}], snapshot="initial")
    original = SnapshotState.start

    def crash_once_created(self: SnapshotState, consistent_point: int | None = None) -> None:
        if consistent_point is not None:  # the slot exists now: stop before recording it
            raise Crash("killed right after the slot was created")
        original(self, consistent_point)

    monkeypatch.setattr(SnapshotState, "start", crash_once_created)
    with pytest.raises(Crash):
        await Pipeline(load_config(cfg)).run()
    assert pg_db.fetchval("SELECT count(*) FROM pg_replication_slots") == 1  # it was created
    monkeypatch.setattr(SnapshotState, "start", original)

    pg_db.execute("INSERT INTO t VALUES (1000, 'after')")
    endpos = pg_db.fetchval("SELECT pg_current_wal_insert_lsn()::text")
    from cdcd.lsn import parse_lsn

    pipeline = Pipeline(load_config(cfg), endpos=parse_lsn(endpos))
    assert await pipeline.run() == 0
    (sink,) = pipeline.sinks
    assert isinstance(sink, MemorySink)
    snapshot = sorted(e.value()["after"]["id"] for e in sink.events if e.op == "r")
    # every row, those before the first slot included, from the new slot's snapshot
    assert snapshot == [*range(1, 301), 1000]
    assert SnapshotState(tmp_path / "cdcd-state", "cdcd_e2e").path.exists()
