"""An interrupted initial snapshot resumes (docs/snapshots.md, "Interrupted"): the real
``cdcd`` daemon, killed with SIGKILL in the middle of the initial snapshot of two tables with a
key and one without while a workload inserts, updates, deletes and changes keys, then twice
more while the rest is read incrementally, and left to finish. The tables rebuilt from the files
(in position order) equal the source, no table was reset, what was emitted again stays within
the bound the settings give, and the slot advanced while the rest was read."""

from __future__ import annotations

import json
import signal
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e import (
    StatementWorkload,
    checked_events,
    comparable,
    run_cdcd,
    start_cdcd,
    write_config,
)
from tests.integration.test_incremental_snapshot import (
    LOG,
    _stopped_once,
    _wait,
    apply_events_lenient,
)
from tests.pgharness import PgDatabase

pytestmark = [pytest.mark.pg, pytest.mark.timeout(240)]

TABLES = {"t1": 24_000, "t2": 12_000}
KEYLESS = 600
CHUNK = 500  # snapshot.chunk_rows: the initial snapshot records every CHUNK / 2 rows
BATCH = 200
IN_FLIGHT = 2  # snapshot.chunks_in_flight of the incremental part


class Workload(StatementWorkload):
    """Single-statement transactions on the keyed tables (inserts past their keys, updates,
    deletes, key changes to keys no insert takes) and on the keyless one, until stopped."""

    def step(self, cur: Any) -> None:
        rng = self.rng
        table, rows = rng.choice(list(TABLES.items()))
        k = rng.randrange(1, rows)
        op = rng.random()
        if op < 0.25:
            cur.execute(
                f"INSERT INTO {table} VALUES (%s, 'new', 0) ON CONFLICT (id) DO NOTHING",
                (rng.randrange(rows, 2 * rows),),
            )
        elif op < 0.55:
            cur.execute(f"UPDATE {table} SET v = v || 'u', n = n + 1 WHERE id = %s", (k,))
        elif op < 0.7:
            cur.execute(f"DELETE FROM {table} WHERE id = %s", (k,))
        elif op < 0.85:
            cur.execute(
                f"UPDATE {table} SET id = %s WHERE id = %s AND NOT EXISTS "
                f"(SELECT 1 FROM {table} WHERE id = %s)",
                (k + 3 * rows, k, k + 3 * rows),
            )
        else:
            cur.execute("UPDATE keyless SET n = n + 1 WHERE a = %s", (k % KEYLESS,))


def _setup(pg_db: PgDatabase) -> None:
    sql = ""
    for table, rows in TABLES.items():
        sql += (
            f"CREATE TABLE {table} (id int PRIMARY KEY, v text NOT NULL, n int NOT NULL);"
            f"INSERT INTO {table} SELECT g, 'v' || g, 0 FROM generate_series(1, {rows}) g;"
        )
    pg_db.execute(
        sql + "CREATE TABLE keyless (a int NOT NULL, n int NOT NULL);"
        "ALTER TABLE keyless REPLICA IDENTITY FULL;"
        f"INSERT INTO keyless SELECT g, 0 FROM generate_series(0, {KEYLESS - 1}) g; ANALYZE"
    )


def _state(tmp_path: Path, kind: str) -> dict[str, Any]:
    path = tmp_path / "cdcd-state" / f"cdcd_e2e.{kind}.json"
    try:
        return dict(json.loads(path.read_text()))
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


def _rows(tables: dict[str, Any]) -> int:
    return sum(int(t.get("rows") or 0) for n, t in tables.items() if n != "public.keyless")


@pytest.mark.slow  # a workload and four runs: newest PostgreSQL only (conftest.py)
def test_kill_9_three_times_then_finish(pg_db: PgDatabase, tmp_path: Path) -> None:
    _setup(pg_db)
    cfg = write_config(tmp_path, pg_db.dsn, snapshot="initial")
    data = yaml.safe_load(cfg.read_text())
    data["snapshot"].update(
        {
            "workers": 2,  # key ranges of 2,000 rows, read two at a time
            "tune_workers": False,
            "initial_chunk_rows": 2000,
            "chunk_rows": CHUNK,
            "batch_rows": BATCH,
            "chunks_in_flight": IN_FLIGHT,
        }
    )
    data["sinks"][0]["flush_interval"] = 0.2
    cfg.write_text(yaml.safe_dump(data))
    total = sum(TABLES.values())
    LOG[:] = [tmp_path / "cdcd.log"]
    workload = Workload(pg_db.dsn, seed=11)
    workload.start()
    confirmed: set[str] = set()
    try:
        # kill 1: in the initial snapshot, a fifth of the keyed rows durable
        proc = start_cdcd("run", "--config", str(cfg), log_path=LOG[0])
        _stopped_once(
            proc,
            lambda: _rows(_state(tmp_path, "snapshot").get("tables", {})) > total * 0.2,
            90,
            "the initial snapshot's progress",
        )
        proc.kill()
        proc.wait()
        initial = _state(tmp_path, "snapshot")
        assert initial["status"] == "running", "the kill came too late"
        assert initial["tables"]["public.keyless"]["status"] == "done"
        # kills 2 and 3: while the rest is read incrementally
        for fraction in (0.45, 0.7):
            proc = start_cdcd("run", "--config", str(cfg), log_path=LOG[0])
            _stopped_once(
                proc,
                lambda f=fraction: (
                    _rows(_state(tmp_path, "incremental").get("tables", {})) > total * f
                ),
                240,  # a restart on a busy 2-core CI machine: seconds before the rest moves
                "the incremental progress",
            )
            proc.kill()
            proc.wait()
        proc = start_cdcd("run", "--config", str(cfg), log_path=LOG[0])

        def done() -> bool:
            tables = _state(tmp_path, "incremental").get("tables", {})
            lsn = pg_db.fetchval(
                "SELECT confirmed_flush_lsn::text FROM pg_replication_slots "
                "WHERE slot_name = 'cdcd_e2e'"
            )
            if lsn is not None and any(t["status"] == "running" for t in tables.values()):
                confirmed.add(lsn)
            return bool(tables) and all(t["status"] == "done" for t in tables.values())

        _wait(done, 120, "the rest of the snapshot", proc)
    finally:
        workload.stop.set()
        workload.join()
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
    assert workload.error is None, workload.error
    assert workload.done > 100, workload.done
    assert len(confirmed) >= 2, confirmed  # the slot moved on while the rest was read
    log = LOG[0].read_text()
    assert log.count("resuming it") == 1 and "cannot be resumed" not in log
    run_cdcd("run", "--config", str(cfg), "--endpos")
    out = tmp_path / "out"
    again = 0
    reads = 0
    for table in ("t1", "t2", "keyless"):
        events = checked_events(out, f"public.{table}")
        assert not [e for e in events if e["op"] == "t"], table  # nothing was reset
        columns = "id, v, n" if table != "keyless" else "a, n"
        names = [c.strip() for c in columns.split(",")]
        source = comparable(
            dict(zip(names, r, strict=True)) for r in pg_db.fetch(f"SELECT {columns} FROM {table}")
        )
        assert apply_events_lenient(events) == source, table
        if table != "keyless":
            per_key = Counter(json.dumps(e["key"]) for e in events if e["op"] == "r")
            reads += sum(per_key.values())
            again += sum(n - 1 for n in per_key.values())
    # emitted again: at the first kill what was handed but not recorded (CHUNK rows and a
    # batch at most); at each later one the incremental chunks in flight and the one being read
    bound = CHUNK + BATCH + 2 * (IN_FLIGHT + 1) * CHUNK
    assert again <= bound, (again, bound)
    print(
        f"r events {reads} for {reads - again} keys: {reads / (reads - again):.3f}x, again {again}"
    )
