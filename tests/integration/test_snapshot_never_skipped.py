"""A snapshot cdcd was configured to take is never skipped: cdcd stopping right after it created
the slot (before recording the snapshot's consistent point) must end, at the next start, in a
new slot and every existing row snapshotted — not in a slot whose next start skips the rows
that existed before it. Nor does a slot made before cdcd's first start skip them."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from cdcd.config import load_config
from cdcd.pipeline.service import Pipeline
from cdcd.sinks.memory import MemorySink
from cdcd.source.snapshot import SnapshotState
from tests.e2e import apply_events, checked_events, run_cdcd, start_cdcd, write_config
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


def _rows(tmp_path: Path) -> dict[str, Any]:
    path = tmp_path / "cdcd-state" / "cdcd_e2e.incremental.json"
    return json.loads(path.read_text())["tables"] if path.exists() else {}


def test_a_slot_made_before_is_backfilled(pg_db: PgDatabase, tmp_path: Path) -> None:
    """``cdcd slot create`` (or a DBA) made the slot: ``snapshot.mode: initial`` still brings
    every existing row, through an incremental snapshot; ``cdcd check`` says so first."""
    pg_db.execute(
        "CREATE TABLE t (id int PRIMARY KEY, v text);"
        "INSERT INTO t SELECT g, 'v' || g FROM generate_series(1, 400) g"
    )
    cfg = write_config(tmp_path, pg_db.dsn, snapshot="initial")
    created = run_cdcd("slot", "create", "--config", str(cfg)).stdout
    assert "incremental snapshot" in created, created
    check = run_cdcd("check", "--config", str(cfg), check=False).stdout
    assert "backfills every published table (1)" in check, check
    assert "requests signed with the key in" in check and "signal-key" in check, check
    pg_db.execute("DELETE FROM t WHERE id <= 10; INSERT INTO t VALUES (1000, 'after')")
    proc = start_cdcd("run", "--config", str(cfg), log_path=tmp_path / "cdcd.log")
    try:
        deadline = time.monotonic() + 60
        while _rows(tmp_path).get("public.t", {}).get("status") != "done":
            assert proc.poll() is None, (tmp_path / "cdcd.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the backfill did not end"
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    run_cdcd("run", "--config", str(cfg), "--endpos")
    events = checked_events(tmp_path / "out", "public.t")
    read = sorted(e["after"]["id"] for e in events if e["op"] == "r")
    assert read == [*range(11, 401), 1000]
    # taken once: the next start streams on
    check = run_cdcd("check", "--config", str(cfg), check=False).stdout
    assert "backfills" not in check, check


def test_a_slot_made_before_without_a_key_is_refused(pg_db: PgDatabase, tmp_path: Path) -> None:
    # FULL: cdcd publishes it (its writes keep working), but it has no key to backfill by
    pg_db.execute("CREATE TABLE k (v text); ALTER TABLE k REPLICA IDENTITY FULL")
    pg_db.execute("INSERT INTO k VALUES ('a')")
    cfg = write_config(tmp_path, pg_db.dsn, snapshot="initial")
    run_cdcd("slot", "create", "--config", str(cfg))
    check = run_cdcd("check", "--config", str(cfg), check=False)
    assert check.returncode == 3 and "public.k has neither" in check.stdout, check.stdout
    run = run_cdcd("run", "--config", str(cfg), "--endpos", check=False)
    assert run.returncode == 3, run.stderr
    assert "cdcd slot drop" in run.stderr + run.stdout


async def test_a_redone_initial_snapshot_resets_the_tables_first(
    pg_db: PgDatabase, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An initial snapshot interrupted after the rows of a table without a key reached the
    sinks, but before it was recorded done, is taken again on a new slot (such a table cannot
    be resumed by key); rows deleted in between must not stay in the consumers' copy (ghosts):
    the second attempt first resets every table (``op: "t"``, ``source.snapshot: "reset"``)."""
    pg_db.execute(
        "CREATE TABLE t (id int NOT NULL, v text); ALTER TABLE t REPLICA IDENTITY FULL;"
        "INSERT INTO t SELECT g, 'v' || g FROM generate_series(1, 300) g"
    )
    cfg = write_config(tmp_path, pg_db.dsn, snapshot="initial")
    original = SnapshotState.finish

    def crash(self: SnapshotState, consistent_point: int) -> None:
        raise Crash("killed once every row was durable, before the snapshot was recorded")

    monkeypatch.setattr(SnapshotState, "finish", crash)
    with pytest.raises(Crash):
        await Pipeline(load_config(cfg)).run()
    monkeypatch.setattr(SnapshotState, "finish", original)
    first = checked_events(tmp_path / "out", "public.t")
    assert len([e for e in first if e["op"] == "r"]) == 300
    pg_db.execute("DELETE FROM t WHERE id <= 50")  # gone before the second attempt
    run_cdcd("run", "--config", str(cfg), "--endpos")
    events = checked_events(tmp_path / "out", "public.t")
    resets = [e for e in events if e["op"] == "t"]
    assert [e["source"]["snapshot"] for e in resets] == ["reset"]
    later = [
        e
        for e in events
        if (e["source"]["commit_lsn"], e["source"]["seq"])
        > (resets[0]["source"]["commit_lsn"], resets[0]["source"]["seq"])
    ]
    assert sorted(e["after"]["id"] for e in later if e["op"] == "r") == list(range(51, 301))
    rebuilt = sorted(r["id"] for r in apply_events(events))
    assert rebuilt == list(range(51, 301))  # no ghost of the deleted rows
