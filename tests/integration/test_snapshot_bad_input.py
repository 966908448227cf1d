"""Incremental snapshots given bad input (docs/snapshots.md, "What goes wrong"),
against a real server and the real daemon: a primary key keyset pagination cannot page
through (a user-defined ordering), a table removed from the publication mid-snapshot (and added back), column types changed
mid-snapshot (a column's and the key's). Each is handled or stopped with a message naming the
table and saying what to do; nothing is lost. (A column added, a table dropped and a role
without the grant: tests/integration/test_incremental_snapshot.py.)"""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import psycopg2
import psycopg2.errors
import pytest

from tests.e2e import checked_events, run_cdcd, start_cdcd
from tests.integration.test_incremental_snapshot import (
    LOG,
    Workload,
    _change_while_stopped,
    _config,
    _finish,
    _log_lines,
    _source_rows,
    _state,
    _stop,
    _stopped_once,
    _wait,
    apply_events_lenient,
    throttled,
)
from tests.pgharness import PgDatabase

pytestmark = [pytest.mark.pg, pytest.mark.version_independent, pytest.mark.timeout(180)]

ROWS = 10000

# btree comparison for point (which has none built in): x, then y
POINT_ORDER = """
CREATE FUNCTION pt_cmp(point, point) RETURNS int LANGUAGE sql IMMUTABLE STRICT AS $$
  SELECT CASE WHEN $1[0] < $2[0] OR ($1[0] = $2[0] AND $1[1] < $2[1]) THEN -1
              WHEN $1[0] = $2[0] AND $1[1] = $2[1] THEN 0 ELSE 1 END $$;
CREATE FUNCTION pt_lt(point, point) RETURNS bool LANGUAGE sql IMMUTABLE
  AS 'SELECT pt_cmp($1, $2) < 0';
CREATE FUNCTION pt_le(point, point) RETURNS bool LANGUAGE sql IMMUTABLE
  AS 'SELECT pt_cmp($1, $2) <= 0';
CREATE FUNCTION pt_eq(point, point) RETURNS bool LANGUAGE sql IMMUTABLE
  AS 'SELECT pt_cmp($1, $2) = 0';
CREATE FUNCTION pt_ge(point, point) RETURNS bool LANGUAGE sql IMMUTABLE
  AS 'SELECT pt_cmp($1, $2) >= 0';
CREATE FUNCTION pt_gt(point, point) RETURNS bool LANGUAGE sql IMMUTABLE
  AS 'SELECT pt_cmp($1, $2) > 0';
CREATE OPERATOR <<< (LEFTARG = point, RIGHTARG = point, FUNCTION = pt_lt);
CREATE OPERATOR <<<= (LEFTARG = point, RIGHTARG = point, FUNCTION = pt_le);
CREATE OPERATOR === (LEFTARG = point, RIGHTARG = point, FUNCTION = pt_eq);
CREATE OPERATOR >>>= (LEFTARG = point, RIGHTARG = point, FUNCTION = pt_ge);
CREATE OPERATOR >>> (LEFTARG = point, RIGHTARG = point, FUNCTION = pt_gt);
"""
POINT_TABLE = """
CREATE OPERATOR CLASS point_order_ops {default} FOR TYPE point USING btree AS
  OPERATOR 1 <<<, OPERATOR 2 <<<=, OPERATOR 3 ===, OPERATOR 4 >>>=, OPERATOR 5 >>>,
  FUNCTION 1 pt_cmp(point, point);
CREATE TABLE pts (p point NOT NULL, v text NOT NULL);
INSERT INTO pts SELECT point(g % 37, g), 'p' || g FROM generate_series(1, 20) g;
CREATE UNIQUE INDEX pts_key ON pts (p point_order_ops);
"""


def test_a_key_that_cannot_be_paged_through(pg_db: PgDatabase, tmp_path: Path) -> None:
    """Keyset pagination sorts and compares with the key types' default btree operator
    classes. A primary key's index must use exactly those (PostgreSQL refuses any other), so
    ORDER BY always works; but ``(key) > (last)`` looks for an operator named ``>``, and a
    user-defined default class may name its operators otherwise: such a table is skipped
    with an error naming it, and a request for it is refused; the others are snapshotted."""
    _table(pg_db)
    pg_db.execute(POINT_ORDER + POINT_TABLE.format(default=""))
    with pytest.raises(psycopg2.errors.WrongObjectType, match="default sorting behavior"):
        pg_db.execute("ALTER TABLE pts ADD PRIMARY KEY USING INDEX pts_key")
    pg_db.execute(
        "DROP TABLE pts; DROP OPERATOR FAMILY point_order_ops USING btree;"
        + POINT_TABLE.format(default="DEFAULT")
        + "ALTER TABLE pts ADD PRIMARY KEY USING INDEX pts_key"
    )
    cfg = _config(tmp_path, pg_db.dsn, "incremental", chunk_rows=500)
    LOG[:] = [tmp_path / "cdcd.log"]
    proc = start_cdcd("run", "--config", str(cfg), log_path=LOG[0])
    try:
        _wait(
            lambda: {s.get("status") for s in _state(tmp_path).values()} == {"done", "skipped"},
            60,
            "the snapshots",
            proc,
        )
        asked = run_cdcd("snapshot", "--config", str(cfg), "--table", "public.pts", check=False)
        assert asked.returncode == 3, asked
        said = asked.stderr + asked.stdout
        assert "--table public.pts: its primary key (p point) cannot be paged through" in said
        assert "operator does not exist: point > point" in said
        assert "must name its operators < and >" in said and "snapshot.mode: initial" in said
    finally:
        _stop(proc)  # it went on streaming
    assert _state(tmp_path)["public.pts"]["status"] == "skipped"
    (error,) = [
        e
        for e in map(json.loads, LOG[0].read_text().splitlines())
        if e.get("event", "").startswith("table not snapshotted")
    ]
    assert error["table"] == "public.pts" and "cannot be paged through" in error["event"]
    status = run_cdcd("snapshot", "status", "--config", str(cfg)).stdout
    assert re.search(r"public\.pts +skipped", status), status
    assert len(checked_events(tmp_path / "out", "public.t")) == ROWS


def _table(pg_db: PgDatabase) -> None:
    pg_db.execute(
        "CREATE TABLE t (id int PRIMARY KEY, v text NOT NULL, n int NOT NULL);"
        f"INSERT INTO t SELECT g, 'v' || g, 0 FROM generate_series(1, {ROWS}) g; ANALYZE t"
    )


def test_a_table_removed_from_the_publication_and_added_back(
    pg_db: PgDatabase, tmp_path: Path
) -> None:
    """Its snapshot stops with a warning; added back, it is backfilled (snapshot.new_tables).
    Changes made while it is out of the publication are not streamed (deletes then would
    leave rows behind in consumers: docs/snapshots.md), so the writers pause during that time."""
    _table(pg_db)
    pg_db.execute("CREATE PUBLICATION cdcd_e2e_pub FOR TABLE t")
    cfg = _config(tmp_path, pg_db.dsn, "incremental", chunk_rows=20, chunks_in_flight=1)
    LOG[:] = [tmp_path / "cdcd.log"]
    proc = start_cdcd("run", "--config", str(cfg), log_path=LOG[0])
    workloads = [Workload(pg_db.dsn, seed=5), Workload(pg_db.dsn, seed=6)]
    workloads[0].start()
    try:
        # held from here: the snapshot must not end before the table leaves
        _stopped_once(
            proc, lambda: _state(tmp_path).get("public.t", {}).get("rows", 0) > 1000, 60, "t"
        )
        try:
            workloads[0].stop.set()
            workloads[0].join()
        finally:
            proc.send_signal(signal.SIGCONT)
        _change_while_stopped(proc, pg_db, "ALTER PUBLICATION cdcd_e2e_pub DROP TABLE t")
        # slowed down: cdcd sees the removal when it next looks at the table (every 2 s), and
        # at full speed it could read the rest of the table before that
        with throttled(proc, 60):
            _wait(lambda: _state(tmp_path)["public.t"]["status"] == "removed", 60, "removed", proc)
        pg_db.execute("UPDATE t SET n = n + 100 WHERE id % 3 = 0")
        pg_db.execute("ALTER PUBLICATION cdcd_e2e_pub ADD TABLE t")
        workloads[1].start()
        _wait(lambda: _state(tmp_path)["public.t"]["status"] == "running", 60, "backfill", proc)
        _wait(lambda: _state(tmp_path)["public.t"]["status"] == "done", 90, "backfill", proc)
    finally:
        for workload in workloads:
            workload.stop.set()
            if workload.is_alive():
                workload.join()
        _stop(proc)
    assert all(w.error is None for w in workloads), [w.error for w in workloads]
    (removed,) = _log_lines(
        tmp_path,
        "table dropped or removed from the publication during its snapshot; its snapshot "
        "stops (cdcd snapshot --table restarts it once it is published again)",
    )
    assert removed["table"] == "public.t"
    assert _log_lines(tmp_path, "tables added to the publication")[-1]["tables"] == ["public.t"]
    events = _finish(tmp_path, cfg, pg_db)
    assert apply_events_lenient(events) == _source_rows(pg_db)


def test_column_types_changed_during_the_snapshot(pg_db: PgDatabase, tmp_path: Path) -> None:
    _table(pg_db)
    cfg = _config(tmp_path, pg_db.dsn, "incremental", chunk_rows=50, chunks_in_flight=1)
    LOG[:] = [tmp_path / "cdcd.log"]
    proc = start_cdcd("run", "--config", str(cfg), log_path=LOG[0])
    try:
        _wait(lambda: _state(tmp_path).get("public.t", {}).get("rows", 0) > 2000, 60, "t", proc)
        # a column's type: later chunks carry the new type
        _change_while_stopped(
            proc,
            pg_db,
            "ALTER TABLE t ALTER COLUMN n TYPE numeric(10,2); UPDATE t SET n = 0.5 WHERE id > 9000",
        )
        _wait(lambda: _state(tmp_path).get("public.t", {}).get("rows", 0) > 5000, 60, "t", proc)
        # the key's type, to one that sorts differently ('10000' < '9'): started over
        _change_while_stopped(proc, pg_db, "ALTER TABLE t ALTER COLUMN id TYPE text")
        _wait(lambda: _state(tmp_path)["public.t"]["status"] == "done", 90, "the snapshot", proc)
    finally:
        _stop(proc)
    (over,) = _log_lines(
        tmp_path, "primary key changed during the table's snapshot; it starts over"
    )
    assert over["table"] == "public.t" and over["now"] == ["id text"], over
    events = _finish(tmp_path, cfg, pg_db)
    source = {str(i): (v, str(n)) for i, v, n in pg_db.fetch("SELECT id, v, n FROM t")}
    rebuilt = {}
    for e in events:
        rebuilt[str(e["key"]["id"])] = (e["after"]["v"], str(e["after"]["n"]))
    assert rebuilt == source
    # the last full pass read every row with the new types
    last = [e["after"] for e in events if e["op"] == "r"][-ROWS:]
    assert sorted(r["id"] for r in last) == sorted(str(i) for i in range(1, ROWS + 1))
    assert {type(r["id"]) for r in last} == {str}
    assert {r["n"] for r in last if int(r["id"]) > 9000} == {"0.50"}
