"""The initial snapshot read by several workers (docs/snapshots.md): block-range chunks
of several tables, one of them large and one without a key, read over ``snapshot.workers``
connections at the slot's exported snapshot while a workload changes the tables; the tables
rebuilt from the files equal the source, every row is read once, positions are unique and in
file order, and a kill -9 in the middle ends, at the next start, in a complete snapshot."""

from __future__ import annotations

import json
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e import (
    StatementWorkload,
    apply_events,
    checked_events,
    comparable,
    run_cdcd,
    start_cdcd,
    write_config,
)
from tests.pgharness import PgDatabase

pytestmark = [pytest.mark.pg, pytest.mark.timeout(240)]

BIG = 50_000
KEYLESS = 5_000
SMALL = 300


class Workload(StatementWorkload):
    """Single-statement transactions on ``big`` and ``keyless`` until stopped."""

    def step(self, cur: Any) -> None:
        rng = self.rng
        k = rng.randrange(1, BIG)
        op = rng.random()
        if op < 0.25:
            cur.execute(
                "INSERT INTO big VALUES (%s, 'new', 0) ON CONFLICT (id) DO NOTHING",
                (rng.randrange(BIG, 2 * BIG),),
            )
        elif op < 0.55:
            cur.execute("UPDATE big SET v = v || 'u', n = n + 1 WHERE id = %s", (k,))
        elif op < 0.7:
            cur.execute("DELETE FROM big WHERE id = %s", (k,))
        elif op < 0.85:
            cur.execute("UPDATE keyless SET n = n + 1 WHERE a = %s", (k % KEYLESS,))
        else:
            cur.execute("DELETE FROM keyless WHERE a = %s", (k % KEYLESS,))


def _setup(pg_db: PgDatabase) -> None:
    pg_db.execute(
        "CREATE TABLE big (id int PRIMARY KEY, v text NOT NULL, n int NOT NULL);"
        f"INSERT INTO big SELECT g, 'v' || g || E'\\ttab\\\\', 0 FROM generate_series(1, {BIG}) g;"
        # no key: updates and deletes carry the whole old row
        "CREATE TABLE keyless (a int NOT NULL, b text, n int NOT NULL);"
        "ALTER TABLE keyless REPLICA IDENTITY FULL;"
        f"INSERT INTO keyless SELECT g, CASE WHEN g % 7 = 0 THEN NULL ELSE 'b' || g END, 0 "
        f"FROM generate_series(0, {KEYLESS - 1}) g;"
        "CREATE TABLE small1 (id int PRIMARY KEY, v text);"
        f"INSERT INTO small1 SELECT g, E'line\\nbreak' || g FROM generate_series(1, {SMALL}) g;"
        "CREATE TABLE small2 (id int PRIMARY KEY, v jsonb);"
        f"INSERT INTO small2 SELECT g, jsonb_build_object('g', g) FROM generate_series(1, {SMALL}) g;"
        "CREATE TABLE empty (id int PRIMARY KEY);"
        "ANALYZE"
    )


def _config(tmp_path: Path, dsn: str, **buffer: Any) -> Path:
    cfg = write_config(tmp_path, dsn, snapshot="initial")
    data = yaml.safe_load(cfg.read_text())
    data["snapshot"].update(
        # all four from the start: a snapshot this short would end before the tuning added any
        {"workers": 4, "initial_chunk_rows": 2000, "batch_rows": 500, "tune_workers": False}
    )
    data["buffer"].update(buffer)
    cfg.write_text(yaml.safe_dump(data))
    return cfg


def _source(pg_db: PgDatabase, table: str, columns: str) -> list[dict[str, Any]]:
    names = [c.strip().partition("::")[0] for c in columns.split(",")]
    rows = pg_db.fetch(f"SELECT {columns} FROM {table}")
    return comparable(dict(zip(names, row, strict=True)) for row in rows)


def _log_lines(path: Path, event: str) -> list[dict[str, Any]]:
    lines = path.read_text().splitlines()
    return [
        e
        for e in map(json.loads, (x for x in lines if x.startswith("{")))
        if e.get("event") == event
    ]


def _check_tables(tmp_path: Path, pg_db: PgDatabase, restarted: bool = False) -> None:
    out = tmp_path / "out"
    for table, columns in (
        ("big", "id, v, n"),
        ("keyless", "a, b, n"),
        ("small1", "id, v"),
        ("small2", "id, v::text"),  # json values are strings in events
    ):
        events = checked_events(out, f"public.{table}")  # positions unique, in file order
        if restarted and table == "keyless":
            # rows without a key cannot be matched across attempts: a consumer keeps the `r`
            # events of the last snapshot only (docs/snapshots.md)
            last = max(e["source"]["commit_lsn"] for e in events if e["op"] == "r")
            events = [e for e in events if e["op"] != "r" or e["source"]["commit_lsn"] == last]
        reads = [e for e in events if e["op"] == "r"]
        assert reads, table
        assert comparable(apply_events(events)) == _source(pg_db, table, columns), table
        if table != "keyless" and not restarted:
            per_key = Counter(json.dumps(e["key"], sort_keys=True) for e in reads)
            assert max(per_key.values()) == 1, (table, per_key.most_common(2))


@pytest.mark.slow  # two workloads: newest PostgreSQL only (conftest.py)
def test_parallel_snapshot_under_a_workload(pg_db: PgDatabase, tmp_path: Path) -> None:
    _setup(pg_db)
    # a small memory limit: the workers' read-ahead must wait for the writer, not block it
    cfg = _config(tmp_path, pg_db.dsn, memory_limit="1MiB")
    log = tmp_path / "cdcd.log"
    workloads = [Workload(pg_db.dsn, seed=7 + i) for i in range(2)]
    for workload in workloads:
        workload.start()
    proc = start_cdcd("run", "--config", str(cfg), log_path=log)
    try:
        deadline = time.monotonic() + 120
        while not _log_lines(log, "initial snapshot done"):
            assert proc.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, "timed out waiting for the snapshot"
            time.sleep(0.2)
        time.sleep(1)  # changes after the snapshot too
    finally:
        for workload in workloads:
            workload.stop.set()
            workload.join()
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    for workload in workloads:
        assert workload.error is None, workload.error
        assert workload.done > 50, workload.done
    (started,) = _log_lines(log, "initial snapshot starting")
    (done,) = _log_lines(log, "initial snapshot done")
    assert started["workers"] == 4
    assert done["chunks"] >= 25 and done["tables"] == 5, done  # big alone: ~25 chunks
    run_cdcd("run", "--config", str(cfg), "--endpos")
    _check_tables(tmp_path, pg_db)
    # snapshot rows: one pseudo-transaction, seq dense from 0 in table order
    seqs = sorted(
        e["source"]["seq"]
        for t in ("big", "keyless", "small1", "small2")
        for e in checked_events(tmp_path / "out", f"public.{t}")
        if e["op"] == "r"
    )
    assert seqs == list(range(done["rows"]))


@pytest.mark.slow  # a rate-driven run: newest PostgreSQL only (conftest.py)
def test_workers_tuned_to_the_rate(pg_db: PgDatabase, tmp_path: Path) -> None:
    """``snapshot.tune_workers`` (default): the initial snapshot starts with one reader and
    adds one while it raises the rate, up to ``snapshot.workers``; whatever it settles on, every
    row is read once, in chunk order."""
    rows = 600_000  # a few tuning windows long on the development machine
    pg_db.execute(
        "CREATE TABLE wide (id int PRIMARY KEY, v text NOT NULL);"
        f"INSERT INTO wide SELECT g, repeat('x', g % 50) FROM generate_series(1, {rows}) g;"
        "ANALYZE"
    )
    cfg = write_config(tmp_path, pg_db.dsn, snapshot="initial_only")
    data = yaml.safe_load(cfg.read_text())
    data["snapshot"].update({"workers": 4, "initial_chunk_rows": 5000})
    data["log"]["level"] = "debug"
    cfg.write_text(yaml.safe_dump(data))
    result = run_cdcd("run", "--config", str(cfg))
    output = (result.stdout + result.stderr).splitlines()
    lines = [json.loads(x) for x in output if x.startswith("{")]
    windows = [e["readers"] for e in lines if e.get("event") == "snapshot readers"]
    (done,) = [e for e in lines if e.get("event") == "initial snapshot done"]
    # the tuner decides once per second (cdcd.snapshot.initial._TUNE_WINDOW): a snapshot
    # faster than two windows may end before it has logged two decisions
    assert len(windows) >= min(2, int(done["seconds"]) - 1), (windows, done)
    assert windows[:2] in ([], [1], [1, 2]), windows  # one first, then one more
    assert done["rows"] == rows and done["chunks"] >= 40, done
    assert 1 <= done["readers"] <= 4, done
    events = checked_events(tmp_path / "out", "public.wide")
    assert [e["source"]["seq"] for e in events] == list(range(rows))
    assert sorted(e["key"]["id"] for e in events) == list(range(1, rows + 1))


@pytest.mark.slow  # kills: newest PostgreSQL only (conftest.py)
def test_kill_during_a_parallel_snapshot(pg_db: PgDatabase, tmp_path: Path) -> None:
    """Killed before the table without a key is recorded done: the snapshot is taken again
    (the resumed case: test_initial_snapshot_resume.py)."""
    _setup(pg_db)
    cfg = _config(tmp_path, pg_db.dsn)
    data = yaml.safe_load(cfg.read_text())
    data["snapshot"]["chunk_rows"] = 10**7  # nothing recorded before the end
    cfg.write_text(yaml.safe_dump(data))
    log = tmp_path / "cdcd.log"
    proc = start_cdcd("run", "--config", str(cfg), log_path=log)
    try:
        deadline = time.monotonic() + 60
        out = tmp_path / "out"
        # killed once the first rows are in a file: the whole snapshot takes well under a second
        while not (out.exists() and any(f.is_file() for f in out.rglob("*"))):
            assert proc.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, "the snapshot did not start"
            time.sleep(0.001)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    state = json.loads((tmp_path / "cdcd-state" / "cdcd_e2e.snapshot.json").read_text())
    assert state["status"] == "running", "the kill came too late"
    pg_db.execute(
        "UPDATE big SET n = 7 WHERE id % 5 = 0; INSERT INTO big VALUES (-1, 'late', 0);"
        "UPDATE keyless SET n = 9 WHERE a < 100; DELETE FROM keyless WHERE a % 10 = 1"
    )
    again = run_cdcd("run", "--config", str(cfg), "--endpos")
    assert "initial snapshot done" in again.stdout + again.stderr  # taken again, in full
    _check_tables(tmp_path, pg_db, restarted=True)


def test_tables_without_a_key_in_incremental_snapshots(pg_db: PgDatabase, tmp_path: Path) -> None:
    """Incremental snapshots need a key: a replica identity index serves; a table with neither
    is refused by ``cdcd snapshot --table`` and skipped by the daemon, each naming the table."""
    pg_db.execute(
        "CREATE TABLE keyless (a int, b text);"
        "ALTER TABLE keyless REPLICA IDENTITY FULL;"  # publishable, still without a key
        "INSERT INTO keyless SELECT g, 'b' || g FROM generate_series(1, 100) g;"
        "CREATE TABLE ri (a int NOT NULL, b int NOT NULL, v text);"
        "CREATE UNIQUE INDEX ri_ab ON ri (b, a);"
        "ALTER TABLE ri REPLICA IDENTITY USING INDEX ri_ab;"
        "INSERT INTO ri SELECT g, g % 3, 'v' || g FROM generate_series(1, 1000) g"
    )
    cfg = write_config(tmp_path, pg_db.dsn, snapshot="incremental")
    data = yaml.safe_load(cfg.read_text())
    data["snapshot"].update({"chunk_rows": 64})
    cfg.write_text(yaml.safe_dump(data))
    log = tmp_path / "cdcd.log"
    proc = start_cdcd("run", "--config", str(cfg), log_path=log)
    state = tmp_path / "cdcd-state" / "cdcd_e2e.incremental.json"
    try:
        deadline = time.monotonic() + 60

        def statuses() -> dict[str, str]:
            tables = json.loads(state.read_text())["tables"] if state.exists() else {}
            return {name: t["status"] for name, t in tables.items()}

        while statuses() != {"public.keyless": "skipped", "public.ri": "done"}:
            assert proc.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, statuses()
            time.sleep(0.2)
        refused = run_cdcd("snapshot", "--config", str(cfg), "--table", "keyless", check=False)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    message = refused.stdout + refused.stderr
    assert refused.returncode != 0
    assert "public.keyless" in message and "primary key" in message, message
    assert "REPLICA IDENTITY USING INDEX" in message and "snapshot.mode: initial" in message
    (skipped,) = [
        e
        for e in map(json.loads, log.read_text().splitlines())
        if e.get("table") == "public.keyless" and "not snapshotted" in e["event"]
    ]
    assert "primary key" in skipped["event"], skipped
    events = checked_events(tmp_path / "out", "public.ri")
    assert len([e for e in events if e["op"] == "r"]) == 1000
    assert comparable(apply_events(events)) == _source(pg_db, "ri", "a, b, v")


@pytest.mark.slow  # kills: newest PostgreSQL only (conftest.py)
def test_incremental_snapshot_with_workers(pg_db: PgDatabase, tmp_path: Path) -> None:
    """Chunks of one table read at once over four connections, each between its own
    watermarks, under a workload; kill -9 in the middle resumes below every chunk in flight.
    The other tables are read alongside the large one (first in name order), sharing the
    workers: the small ones are done before it."""
    _setup(pg_db)
    cfg = write_config(tmp_path, pg_db.dsn, snapshot="incremental")
    data = yaml.safe_load(cfg.read_text())
    data["snapshot"].update({"workers": 4, "chunk_rows": 500})
    data["sinks"][0]["flush_interval"] = 0.2
    cfg.write_text(yaml.safe_dump(data))
    state = tmp_path / "cdcd-state" / "cdcd_e2e.incremental.json"

    def big() -> dict[str, Any]:
        return (
            json.loads(state.read_text())["tables"].get("public.big", {}) if state.exists() else {}
        )

    workloads = [Workload(pg_db.dsn, seed=23 + i) for i in range(2)]
    for workload in workloads:
        workload.start()
    log = tmp_path / "cdcd.log"
    try:
        for until in (
            lambda: int(big().get("rows") or 0) >= BIG // 3,
            lambda: big().get("status") == "done",
        ):
            proc = start_cdcd("run", "--config", str(cfg), log_path=log)
            try:
                deadline = time.monotonic() + 120
                while not until():
                    assert proc.poll() is None, log.read_text()[-4000:]
                    assert time.monotonic() < deadline, big()
                    time.sleep(0.05)
            finally:
                proc.send_signal(signal.SIGKILL)
                proc.wait(30)
            if big().get("status") != "done":
                resumed_after = big()["last_key"]
                assert resumed_after is not None
    finally:
        for workload in workloads:
            workload.stop.set()
            workload.join()
    for workload in workloads:
        assert workload.error is None, workload.error
    run_cdcd("run", "--config", str(cfg), "--endpos")
    events = checked_events(tmp_path / "out", "public.big")
    reads = Counter(e["key"]["id"] for e in events if e["op"] == "r")
    again = sum(1 for n in reads.values() if n > 1)
    # read twice: at most the chunks in flight at the kill (32 recorded late + 4 being read)
    assert again <= 36 * 500, again
    # and no more often than that (the table grows under the workload: not a bound on rows)
    assert sum(reads.values()) - len(reads) <= 36 * 500, Counter(reads.values())
    from tests.integration.test_incremental_snapshot import apply_events_lenient

    assert apply_events_lenient(events) == _source(pg_db, "big", "id, v, n")
    lines = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
    assert any(
        e.get("event") == "incremental snapshot of table" and e.get("resumed_after") for e in lines
    )
    # done in the first run, killed with the large table a third read (its resumption starts
    # the second): read one after the other, they would have waited for it
    seen = [
        (e["event"], e["table"])
        for e in lines
        if e.get("event") == "incremental snapshot of table done"
        or (e.get("event") == "incremental snapshot of table" and e.get("resumed_after"))
    ]
    resumed = seen.index(("incremental snapshot of table", "public.big"))
    for table in ("public.small1", "public.small2"):
        assert seen.index(("incremental snapshot of table done", table)) < resumed, seen
    for table, columns in (("small1", "id, v"), ("small2", "id, v::text")):
        small = checked_events(tmp_path / "out", f"public.{table}")
        assert len([e for e in small if e["op"] == "r"]) == SMALL, table
        assert comparable(apply_events(small)) == _source(pg_db, table, columns), table


def test_incremental_snapshot_without_messages_is_refused(
    pg_db: PgDatabase, tmp_path: Path
) -> None:
    """The watermarks are logical messages: with ``source.messages: false`` the stream would
    never carry them back and the snapshot would wait forever; it is refused, naming why."""
    pg_db.execute("CREATE TABLE t (id int PRIMARY KEY); INSERT INTO t VALUES (1), (2)")
    cfg = write_config(tmp_path, pg_db.dsn, snapshot="incremental", messages=False)
    log = tmp_path / "cdcd.log"
    proc = start_cdcd("run", "--config", str(cfg), log_path=log)
    state = tmp_path / "cdcd-state" / "cdcd_e2e.incremental.json"
    try:
        deadline = time.monotonic() + 60
        while not (state.exists() and "skipped" in state.read_text()):
            assert proc.poll() is None, log.read_text()[-4000:]
            assert time.monotonic() < deadline, "the table was not refused"
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    (refused,) = [
        e
        for e in map(json.loads, log.read_text().splitlines())
        if e.get("table") == "public.t" and "not snapshotted" in e["event"]
    ]
    assert "source.messages is off" in refused["event"], refused
    asked = run_cdcd("snapshot", "--config", str(cfg), "--table", "public.t", check=False)
    assert asked.returncode != 0 and "source.messages is off" in asked.stdout + asked.stderr
