"""End to end: PostgreSQL -> ``cdcd run --endpos`` (the real CLI, a real server) -> JSON Lines files.

Every test creates its tables in a fresh database, creates the slot and publication with
``cdcd slot create``, runs a workload, then runs ``cdcd run --endpos <current WAL LSN>`` and
reads the table folders back independently of cdcd's code (:mod:`tests.e2e`). Checks:

* the file layout (docs/files.md): each file named after its first event, sorted names = event
  order, no position ``(commit_lsn, seq)`` twice (:func:`tests.e2e.checked_events`);
* the event shapes (docs/events.md) where the scenario is about them;
* the table state: applying the events in ``(commit_lsn, seq)`` order to an empty table (by
  ``key``, else by the whole ``before``; unchanged-TOAST markers keep the previous value) gives
  the source table's rows. Source rows are read as ``to_jsonb(t)``; both sides are normalised
  by :func:`tests.e2e.normalize` (numbers, including numeric strings, compared as Decimal), so
  the tables here use ints, numerics and text unless the test is about types.

Parametrized over the installed PostgreSQL versions by the ``pg_db`` fixture (what the
server sends differs between them), but for the file layout across runs
(``version_independent``).
"""

from __future__ import annotations

import base64
import datetime
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.e2e import (
    UNAVAILABLE,
    all_events,
    apply_events,
    assert_no_duplicates,
    checked_events,
    comparable,
    data_files,
    position,
    run_cdcd,
    write_config,
)
from tests.pgharness import PgDatabase

pytestmark = [pytest.mark.pg, pytest.mark.timeout(300)]


@dataclass
class Cdc:
    """One cdcd configuration (slot, publication, file sink at ``dir/out``) on ``db``."""

    db: PgDatabase
    dir: Path
    cfg: Path

    @property
    def out(self) -> Path:
        return self.dir / "out"

    def create_slot(self) -> None:
        run_cdcd("slot", "create", "--config", str(self.cfg))

    def sync(self, endpos: str | None = None) -> str:
        """``cdcd run --endpos`` up to ``endpos`` (default: :func:`wal_position`)."""
        endpos = endpos or wal_position(self.db)
        run_cdcd("run", "--config", str(self.cfg), "--endpos", endpos)
        if self.out.is_dir():  # positions are unique across tables too
            assert_no_duplicates(all_events(self.out))
        return endpos

    def events(self, table: str) -> list[dict[str, Any]]:
        return checked_events(self.out, f"public.{table}")

    def assert_state(
        self, table: str, columns: str = "*", where: str = "true"
    ) -> list[dict[str, Any]]:
        """The rebuilt state of ``table`` equals the source rows (``columns``/``where``
        restrict the source side, for column lists and row filters)."""
        events = self.events(table)
        expected = [
            r[0]
            for r in self.db.fetch(
                f"SELECT to_jsonb(s) FROM (SELECT {columns} FROM {table} WHERE {where}) s"
            )
        ]
        assert comparable(apply_events(events)) == comparable(expected)
        return events


def wal_position(db: PgDatabase) -> str:
    """The end of the WAL inserted so far. Not ``pg_current_wal_lsn()`` (written WAL): a
    non-transactional logical message is not flushed by its statement, and the written
    position may not include it yet."""
    return str(db.fetchval("SELECT pg_current_wal_insert_lsn()::text"))


def make_cdc(db: PgDatabase, directory: Path, create: bool = True, **source: Any) -> Cdc:
    cdc = Cdc(db, directory, write_config(directory, db.dsn, **source))
    if create:
        cdc.create_slot()
    return cdc


@contextmanager
def transaction(db: PgDatabase) -> Iterator[Any]:
    """A cursor inside BEGIN ... COMMIT on its own connection (ROLLBACK on error)."""
    with db.connect() as conn, conn.cursor() as cur:
        cur.execute("BEGIN")
        try:
            yield cur
        except BaseException:
            cur.execute("ROLLBACK")
            raise
        cur.execute("COMMIT")


def ops(events: list[dict[str, Any]]) -> str:
    return "".join(e["op"] for e in events)


# --------------------------------------------------------------------------- 1. replica identity


def test_replica_identities(pg_db: PgDatabase, tmp_path: Path) -> None:
    """DEFAULT (pk), FULL, USING INDEX and NOTHING: before/after/key shapes (docs/events.md)."""
    pg_db.execute(
        """
        CREATE TABLE t_default (id int PRIMARY KEY, a text, n numeric);
        CREATE TABLE t_full (id int PRIMARY KEY, a text, n numeric);
        ALTER TABLE t_full REPLICA IDENTITY FULL;
        CREATE TABLE t_index (id int, code int NOT NULL, a text);
        CREATE UNIQUE INDEX t_index_code ON t_index (code);
        ALTER TABLE t_index REPLICA IDENTITY USING INDEX t_index_code;
        CREATE TABLE t_nothing (id int PRIMARY KEY, a text);
        ALTER TABLE t_nothing REPLICA IDENTITY NOTHING;
        CREATE PUBLICATION cdcd_e2e_pub FOR ALL TABLES;
        """
    )
    # the DBA's publication: cdcd would refuse to create one that breaks t_nothing's writes
    # (docs/keyless-tables.md), but streams from one that exists
    cdc = make_cdc(pg_db, tmp_path, create_publication=False)
    for table in ("t_default", "t_full"):
        pg_db.execute(
            f"""
            INSERT INTO {table} VALUES (1, 'a', 1.50), (2, 'b', 2), (3, 'c', NULL);
            UPDATE {table} SET a = 'a2', n = n + 1 WHERE id = 1;
            UPDATE {table} SET id = 30 WHERE id = 3;
            DELETE FROM {table} WHERE id = 2;
            """
        )
    pg_db.execute(
        """
        INSERT INTO t_index VALUES (1, 10, 'a'), (2, 20, 'b'), (3, 30, 'c');
        UPDATE t_index SET a = 'a2' WHERE code = 10;
        UPDATE t_index SET code = 21 WHERE code = 20;
        DELETE FROM t_index WHERE code = 30;
        INSERT INTO t_nothing VALUES (1, 'a'), (2, 'b');
        """
    )
    # The server refuses updates and deletes of a table without replica identity that is
    # published for them (FOR ALL TABLES publishes every operation).
    for sql in ("UPDATE t_nothing SET a = 'x'", "DELETE FROM t_nothing"):
        with pytest.raises(Exception, match="does not have a replica identity"):
            pg_db.execute(sql)
    cdc.sync()

    default = cdc.assert_state("t_default")
    assert ops(default) == "cccudcd"
    u, d_old, c_new, d = default[3:]
    assert u["before"] is None and u["key"] == {"id": 1}
    assert u["after"] == {"id": 1, "a": "a2", "n": "2.50"}
    # a key change: delete of the old key then create of the new one, consecutive seqs
    assert d_old["key"] == {"id": 3} and d_old["before"] == {"id": 3, "a": None, "n": None}
    assert c_new["key"] == {"id": 30} and c_new["after"] == {"id": 30, "a": "c", "n": None}
    assert c_new["source"]["seq"] == d_old["source"]["seq"] + 1
    assert d["before"] == {"id": 2, "a": None, "n": None} and d["after"] is None

    full = cdc.assert_state("t_full")
    assert ops(full) == "cccudcd"
    u, d_old, c_new, d = full[3:]
    assert u["before"] == {"id": 1, "a": "a", "n": "1.50"} and u["key"] == {"id": 1}
    assert d_old["before"] == {"id": 3, "a": "c", "n": None} and d_old["key"] == {"id": 3}
    assert c_new["after"] == {"id": 30, "a": "c", "n": None}
    assert d["before"] == {"id": 2, "a": "b", "n": "2"} and d["key"] == {"id": 2}

    index = cdc.assert_state("t_index")
    assert ops(index) == "cccudcd"
    assert [e["key"] for e in index] == [
        {"code": 10},
        {"code": 20},
        {"code": 30},
        {"code": 10},
        {"code": 20},
        {"code": 21},
        {"code": 30},
    ]
    assert index[3]["before"] is None
    assert index[4]["before"] == {"id": None, "code": 20, "a": None}
    assert index[6]["before"] == {"id": None, "code": 30, "a": None}

    nothing = cdc.assert_state("t_nothing")
    assert ops(nothing) == "cc"
    assert all(e["before"] is None for e in nothing)


def test_replica_identity_nothing_insert_only_publication(
    pg_db: PgDatabase, tmp_path: Path
) -> None:
    """REPLICA IDENTITY NOTHING in a publication that only publishes inserts: updates and
    deletes succeed on the server and are not published; the inserts are, without key."""
    pg_db.execute(
        """
        CREATE TABLE t_nothing (id int, a text);
        ALTER TABLE t_nothing REPLICA IDENTITY NOTHING;
        CREATE PUBLICATION cdcd_e2e_pub FOR TABLE t_nothing WITH (publish = 'insert');
        """
    )
    cdc = make_cdc(pg_db, tmp_path, create_publication=False)
    pg_db.execute("INSERT INTO t_nothing VALUES (1, 'a'), (2, 'b')")
    pg_db.execute("UPDATE t_nothing SET a = 'x' WHERE id = 1")
    pg_db.execute("DELETE FROM t_nothing WHERE id = 2")
    pg_db.execute("INSERT INTO t_nothing VALUES (3, 'c')")
    cdc.sync()
    events = cdc.events("t_nothing")
    assert ops(events) == "ccc"
    assert [e["after"] for e in events] == [
        {"id": 1, "a": "a"},
        {"id": 2, "a": "b"},
        {"id": 3, "a": "c"},
    ]
    assert all(e["key"] is None and e["before"] is None for e in events)


# --------------------------------------------------------------------------- 12. no primary key


def test_table_without_key_replica_identity_full(pg_db: PgDatabase, tmp_path: Path) -> None:
    """No primary key, REPLICA IDENTITY FULL: key null, the whole row in before; duplicates."""
    pg_db.execute("CREATE TABLE nokey (a int, b text); ALTER TABLE nokey REPLICA IDENTITY FULL")
    cdc = make_cdc(pg_db, tmp_path)
    pg_db.execute("INSERT INTO nokey VALUES (1, 'x'), (1, 'x'), (2, 'y'), (3, NULL)")
    pg_db.execute("UPDATE nokey SET b = 'z' WHERE a = 2")
    pg_db.execute("DELETE FROM nokey WHERE ctid = (SELECT min(ctid) FROM nokey WHERE a = 1)")
    pg_db.execute("UPDATE nokey SET a = 4 WHERE a = 3")
    cdc.sync()
    events = cdc.assert_state("nokey")
    assert ops(events) == "ccccudu"
    assert all(e["key"] is None for e in events)
    assert events[4]["before"] == {"a": 2, "b": "y"} and events[4]["after"] == {"a": 2, "b": "z"}
    assert events[5]["before"] == {"a": 1, "b": "x"}
    assert events[6]["before"] == {"a": 3, "b": None} and events[6]["after"] == {"a": 4, "b": None}


# --------------------------------------------------------------------------- 11. repeated runs


@pytest.mark.version_independent  # the file sink's resume: newest PostgreSQL only (conftest.py)
def test_runs_resume_exactly_once(pg_db: PgDatabase, tmp_path: Path) -> None:
    """A second run without new data adds nothing; a run to an endpos in the middle and one to
    the end publish every event exactly once between them."""
    pg_db.execute("CREATE TABLE t (id int PRIMARY KEY, a text)")
    cdc = make_cdc(pg_db, tmp_path)
    for i in range(5):
        pg_db.execute(
            f"INSERT INTO t VALUES ({i}, 'first'); UPDATE t SET a = 'x{i}' WHERE id = {i}"
        )
    middle = wal_position(pg_db)
    for i in range(5, 10):
        pg_db.execute(f"INSERT INTO t VALUES ({i}, 'second'); DELETE FROM t WHERE id = {i - 5}")
    cdc.sync(middle)
    first = cdc.events("t")
    assert ops(first) == "cu" * 5
    end = cdc.sync()
    files = data_files(cdc.out / "public.t")
    events = cdc.assert_state("t")
    assert events[:10] == first
    assert ops(events) == "cu" * 5 + "cd" * 5
    cdc.sync(end)  # nothing new
    cdc.sync()  # nothing new either (the current position moved only by cdcd's own traffic)
    assert data_files(cdc.out / "public.t") == files
    assert cdc.events("t") == events


# --------------------------------------------------------------------------- 2. TOAST


def test_unchanged_toast(pg_db: PgDatabase, tmp_path: Path) -> None:
    """An update leaving a TOASTed value unchanged: the marker and ``source.unchanged_toast``
    under DEFAULT; under FULL the value comes from the old row. The state still rebuilds."""
    for table, identity in (("toast_default", "DEFAULT"), ("toast_full", "FULL")):
        pg_db.execute(
            f"""
            CREATE TABLE {table} (id int PRIMARY KEY, n int, big text);
            ALTER TABLE {table} ALTER COLUMN big SET STORAGE EXTERNAL;
            ALTER TABLE {table} REPLICA IDENTITY {identity};
            """
        )
    cdc = make_cdc(pg_db, tmp_path)
    big = "".join(f"{i:05d}" for i in range(2000))  # 10 kB, stored out of line (EXTERNAL)
    for table in ("toast_default", "toast_full"):
        pg_db.execute(f"INSERT INTO {table} VALUES (1, 0, '{big}'), (2, 0, 'short')")
        pg_db.execute(f"UPDATE {table} SET n = 1")  # row 1: big unchanged and TOASTed
        pg_db.execute(f"UPDATE {table} SET big = '{big[::-1]}' WHERE id = 2")
        pg_db.execute(f"UPDATE {table} SET n = 2 WHERE id = 2")  # row 2: now unchanged TOAST
    toast = pg_db.fetchval(
        "SELECT reltoastrelid::regclass::text FROM pg_class WHERE relname = 'toast_default'"
    )
    assert (
        pg_db.fetchval(f"SELECT count(DISTINCT chunk_id) FROM {toast}") == 2
    )  # stored out of line
    cdc.sync()

    events = cdc.assert_state("toast_default")
    assert ops(events) == "ccuuuu"
    unchanged = [events[2], events[5]]
    for event in unchanged:
        assert event["after"]["big"] == UNAVAILABLE
        assert event["source"]["unchanged_toast"] == ["big"]
    assert events[2]["after"]["n"] == 1 and events[5]["after"]["n"] == 2
    # a short value is stored inline: it is sent even when unchanged
    assert events[3]["after"]["big"] == "short" and "unchanged_toast" not in events[3]["source"]
    assert events[4]["after"]["big"] == big[::-1]

    events = cdc.assert_state("toast_full")
    assert ops(events) == "ccuuuu"
    assert events[2]["before"]["big"] == big and events[2]["after"]["big"] == big
    assert events[5]["before"]["big"] == big[::-1] and events[5]["after"]["big"] == big[::-1]
    assert all(not e["source"].get("unchanged_toast") for e in events)


def test_key_change_with_unchanged_toast(pg_db: PgDatabase, tmp_path: Path) -> None:
    """An update that changes the key and leaves a TOASTed value unchanged becomes delete +
    create, linked by ``source.new_key`` / ``source.old_key``. Under FULL the create carries
    the value (from the old row). Under DEFAULT the server sends neither the value nor the old
    row: the create carries the marker and lists the column, and a consumer takes the value
    from the row it held under ``old_key`` (tests/integration/test_lossless_events.py has the
    thorough version)."""
    for table, identity in (("toast_default", "DEFAULT"), ("toast_full", "FULL")):
        pg_db.execute(
            f"""
            CREATE TABLE {table} (id int PRIMARY KEY, big text);
            ALTER TABLE {table} ALTER COLUMN big SET STORAGE EXTERNAL;
            ALTER TABLE {table} REPLICA IDENTITY {identity};
            """
        )
    cdc = make_cdc(pg_db, tmp_path)
    big = "".join(f"{i:05d}" for i in range(2000))
    for table in ("toast_default", "toast_full"):
        pg_db.execute(f"INSERT INTO {table} VALUES (1, '{big}')")
        pg_db.execute(f"UPDATE {table} SET id = 10 WHERE id = 1")
    cdc.sync()

    events = cdc.assert_state("toast_full")
    assert ops(events) == "cdc"
    assert events[1]["key"] == {"id": 1} and events[1]["before"] == {"id": 1, "big": big}
    assert events[2]["key"] == {"id": 10} and events[2]["after"] == {"id": 10, "big": big}
    assert not events[2]["source"].get("unchanged_toast")

    events = cdc.assert_state("toast_default")
    assert ops(events) == "cdc"
    assert events[2]["after"] == {"id": 10, "big": UNAVAILABLE}
    assert events[2]["source"]["unchanged_toast"] == ["big"]
    for events in (cdc.events("toast_default"), cdc.events("toast_full")):
        assert events[1]["source"]["new_key"] == events[2]["key"] == {"id": 10}
        assert events[2]["source"]["old_key"] == events[1]["key"] == {"id": 1}
        assert "old_key" not in events[1]["source"] and "new_key" not in events[2]["source"]
        assert not {"old_key", "new_key"} & set(events[0]["source"])


# --------------------------------------------------------------------------- 3. TRUNCATE


def test_truncate_cascade_restart_identity(pg_db: PgDatabase, tmp_path: Path) -> None:
    pg_db.execute(
        """
        CREATE TABLE parent (id serial PRIMARY KEY, a text);
        CREATE TABLE child (id serial PRIMARY KEY, parent_id int REFERENCES parent, a text);
        CREATE TABLE other (id serial PRIMARY KEY, a text);
        """
    )
    cdc = make_cdc(pg_db, tmp_path)
    pg_db.execute(
        """
        INSERT INTO parent (a) VALUES ('p1'), ('p2');
        INSERT INTO child (parent_id, a) VALUES (1, 'c1'), (2, 'c2');
        INSERT INTO other (a) VALUES ('o1');
        """
    )
    pg_db.execute("TRUNCATE parent, other RESTART IDENTITY CASCADE")
    pg_db.execute(
        """
        INSERT INTO parent (a) VALUES ('p3');
        INSERT INTO other (a) VALUES ('o2');
        INSERT INTO child (parent_id, a) VALUES (1, 'c3');
        """
    )
    pg_db.execute("TRUNCATE other")
    cdc.sync()

    tables = ("parent", "child", "other")
    events = {t: cdc.assert_state(t) for t in tables}
    assert ops(events["parent"]) == "cctc" and ops(events["child"]) == "cctc"
    assert ops(events["other"]) == "ctct"
    assert pg_db.fetchval("SELECT id FROM parent") == 1  # identity restarted
    truncates = sorted((e for t in tables for e in events[t] if e["op"] == "t"), key=position)
    first = [
        e for e in truncates if e["source"]["commit_lsn"] == truncates[0]["source"]["commit_lsn"]
    ]
    assert sorted(e["source"]["table"] for e in first) == sorted(tables)
    assert [e["source"]["seq"] for e in first] == [0, 1, 2]
    for event in first:
        assert event["source"]["truncate"] == {"cascade": True, "restart_identity": True}
        assert event["before"] is None and event["after"] is None
    plain = truncates[-1]
    assert plain["source"]["table"] == "other" and plain["source"]["seq"] == 0
    assert plain["source"]["truncate"] == {"cascade": False, "restart_identity": False}


# --------------------------------------------------------------------------- 4. streaming


def by_transaction(events: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """Events grouped by commit LSN, in commit order; asserting seqs 0..n-1 in each."""
    groups: dict[int, list[dict[str, Any]]] = {}
    for event in events:
        groups.setdefault(event["source"]["commit_lsn"], []).append(event)
    result = [groups[lsn] for lsn in sorted(groups)]
    for group in result:
        assert [e["source"]["seq"] for e in group] == list(range(len(group)))
    return result


def assert_streamed(db: PgDatabase, at_least: int = 1, slot: str = "cdcd_e2e") -> None:
    """The server streamed at least ``at_least`` transactions to the slot (else the test
    proves nothing about streaming). Slot statistics may lag the walsender's exit: poll."""
    sql = f"SELECT stream_txns FROM pg_stat_replication_slots WHERE slot_name = '{slot}'"
    deadline = time.monotonic() + 30
    while (count := int(db.fetchval(sql) or 0)) < at_least and time.monotonic() < deadline:
        time.sleep(0.2)
    assert count >= at_least, f"{count} streamed transactions, expected {at_least} or more"


def test_streamed_transactions(pg_db: PgDatabase, tmp_path: Path) -> None:
    """Committed, aborted, with (nested) savepoints rolled back, and two interleaved streamed
    transactions: only committed work appears, each transaction in one piece, in commit order."""
    pg_db.enable_streaming()
    pg_db.execute("CREATE TABLE s (id int PRIMARY KEY, tag text, v int)")
    cdc = make_cdc(pg_db, tmp_path)
    pg_db.execute("INSERT INTO s SELECT g, 'committed', g FROM generate_series(1, 2000) g")
    with pytest.raises(RuntimeError), transaction(pg_db) as cur:
        cur.execute("INSERT INTO s SELECT g, 'aborted', g FROM generate_series(2001, 4000) g")
        raise RuntimeError("roll back")
    with transaction(pg_db) as cur:
        cur.execute("INSERT INTO s SELECT g, 'outer', g FROM generate_series(5001, 5300) g")
        cur.execute("SAVEPOINT a")
        cur.execute("INSERT INTO s SELECT g, 'in a', g FROM generate_series(5301, 5600) g")
        cur.execute("SAVEPOINT b")
        cur.execute("INSERT INTO s SELECT g, 'in b', g FROM generate_series(5601, 5900) g")
        cur.execute("UPDATE s SET v = -1 WHERE id <= 500")
        cur.execute("SELECT pg_logical_emit_message(true, 'sp', 'rolled back')")
        cur.execute("ROLLBACK TO SAVEPOINT b")
        cur.execute("INSERT INTO s SELECT g, 'in a after b', g FROM generate_series(5901, 6000) g")
        cur.execute("RELEASE SAVEPOINT a")
        cur.execute("SAVEPOINT c")
        cur.execute("DELETE FROM s WHERE id <= 100")
        cur.execute("ROLLBACK TO SAVEPOINT c")
        cur.execute("UPDATE s SET v = 0 WHERE id BETWEEN 5001 AND 5010")
        cur.execute("SELECT pg_logical_emit_message(true, 'sp', 'kept')")
    with pg_db.connect() as one, pg_db.connect() as two, one.cursor() as c1, two.cursor() as c2:
        c1.execute("BEGIN")
        c2.execute("BEGIN")
        for k in range(4):
            for cur, base in ((c1, 10_000), (c2, 20_000)):
                lo = base + k * 250
                cur.execute(
                    f"INSERT INTO s SELECT g, 'inter', g FROM generate_series({lo}, {lo + 249}) g"
                )
        c2.execute("COMMIT")
        c1.execute("UPDATE s SET tag = 'one' WHERE id >= 20000")  # sees two's rows
        c1.execute("COMMIT")
    cdc.sync()

    events = cdc.assert_state("s")
    txns = by_transaction(events)
    assert [len(t) for t in txns] == [2000, 300 + 300 + 100 + 10, 1000, 2000]
    assert {e["after"]["tag"] for e in txns[1]} == {"outer", "in a", "in a after b"}
    assert all(e["after"]["id"] >= 20_000 for e in txns[2])  # two committed first
    assert ops(txns[3]) == "c" * 1000 + "u" * 1000
    (message,) = checked_events(cdc.out, "_messages")
    assert base64.b64decode(message["message"]["content"]) == b"kept"
    assert position(message) == (txns[1][0]["source"]["commit_lsn"], 710)
    assert_streamed(pg_db, 3)


# --------------------------------------------------------------------------- 5. DDL


def test_ddl_inside_streamed_transaction(pg_db: PgDatabase, tmp_path: Path) -> None:
    """ADD COLUMN and DROP COLUMN in the middle of a streamed transaction: later events carry
    the new columns, and a ``_schema`` file starts at each change."""
    pg_db.enable_streaming()
    pg_db.execute("CREATE TABLE d (id int PRIMARY KEY, a text)")
    cdc = make_cdc(pg_db, tmp_path)
    with transaction(pg_db) as cur:
        cur.execute("INSERT INTO d SELECT g, 'a' || g FROM generate_series(1, 500) g")
        cur.execute("ALTER TABLE d ADD COLUMN x int DEFAULT 7")
        cur.execute("INSERT INTO d SELECT g, 'a' || g, g FROM generate_series(501, 1000) g")
        cur.execute("ALTER TABLE d DROP COLUMN a")
        cur.execute("INSERT INTO d SELECT g, g FROM generate_series(1001, 1500) g")
        cur.execute("UPDATE d SET x = 0 WHERE id <= 10")
    cdc.sync()

    events = cdc.events("d")
    assert [sorted(e["after"]) for e in events[::500]] == [
        ["a", "id"],
        ["a", "id", "x"],
        ["id", "x"],
        ["id", "x"],
    ]
    assert all(sorted(e["after"]) == ["id", "x"] for e in events[1000:])
    rebuilt = {row["id"]: row for row in apply_events(events)}
    source = {row["id"]: row for (row,) in pg_db.fetch("SELECT to_jsonb(d) FROM d")}
    assert rebuilt.keys() == source.keys()
    for key, row in source.items():
        # columns an event did not have are the ones added later (default 7 on the server)
        assert {c: v for c, v in row.items() if c in rebuilt[key]} == {
            c: v for c, v in rebuilt[key].items() if c in row
        }
    schema_dir = cdc.out / "public.d" / "_schema"
    schemas = [orjson.loads(p.read_bytes()) for p in sorted(schema_dir.iterdir())]
    assert [(s["seq"], [c["name"] for c in s["columns"]]) for s in schemas] == [
        (0, ["id", "a"]),
        (500, ["id", "a", "x"]),
        (1000, ["id", "x"]),
    ]
    assert sorted(p.name for p in schema_dir.iterdir()) == [
        f"{s['commit_lsn']:016X}-{s['seq']:08X}.json" for s in schemas
    ]
    assert_streamed(pg_db)


# --------------------------------------------------------------------------- 6. two-phase


@pytest.mark.parametrize("streamed", [False, True], ids=["small", "streamed"])
@pytest.mark.parametrize("two_phase", [True, False], ids=["two_phase", "no_two_phase"])
def test_prepared_transactions(
    pg_db: PgDatabase, tmp_path: Path, two_phase: bool, streamed: bool
) -> None:
    """COMMIT PREPARED publishes the transaction once, at its commit position; ROLLBACK
    PREPARED publishes nothing."""
    if streamed:
        pg_db.enable_streaming()
    rows = 2000 if streamed else 5
    pg_db.execute("CREATE TABLE p (id int PRIMARY KEY, gid text)")
    cdc = make_cdc(pg_db, tmp_path, two_phase=two_phase)
    assert (
        pg_db.fetchval("SELECT two_phase FROM pg_replication_slots WHERE slot_name = 'cdcd_e2e'")
        is two_phase
    )
    for n, (gid, resolve) in enumerate((("g_commit", "COMMIT"), ("g_rollback", "ROLLBACK"))):
        with transaction(pg_db) as cur:
            cur.execute(
                f"INSERT INTO p SELECT g, '{gid}' FROM generate_series({n * rows}, {n * rows + rows - 1}) g"
            )
            cur.execute(f"PREPARE TRANSACTION '{gid}'")
            cur.execute("BEGIN")  # the connection is outside a transaction after PREPARE
        pg_db.execute(f"INSERT INTO p VALUES ({-1 - n}, 'between')")
        pg_db.execute(f"{resolve} PREPARED '{gid}'")
    cdc.sync()

    events = cdc.assert_state("p")
    txns = by_transaction(events)
    assert [{e["after"]["gid"] for e in t} for t in txns] == [
        {"between"},
        {"g_commit"},
        {"between"},
    ]
    assert len(txns[1]) == rows
    if streamed:
        assert_streamed(pg_db)


@pytest.mark.parametrize(
    ("two_phase", "streamed", "prepare"),
    [(True, False, True), (False, False, True), (True, True, True), (False, True, False)],
    ids=[
        "prepared-two_phase",
        "prepared-no_two_phase",
        "prepared-streamed-two_phase",
        "open-streamed",
    ],
)
def test_unresolved_transaction_across_restart(
    pg_db: PgDatabase, tmp_path: Path, two_phase: bool, streamed: bool, prepare: bool
) -> None:
    """A run that ends while a transaction is prepared but unresolved (or, streamed, still
    open) publishes nothing of it and exits; once it commits, the next run publishes it
    exactly once."""
    rows = 2000 if streamed else 10
    if streamed:
        pg_db.enable_streaming()
    pg_db.execute("CREATE TABLE p (id int PRIMARY KEY, gid text)")
    cdc = make_cdc(pg_db, tmp_path, two_phase=two_phase)
    pg_db.execute("INSERT INTO p VALUES (1, 'before')")
    with pg_db.connect() as conn, conn.cursor() as cur:
        cur.execute("BEGIN")
        cur.execute(f"INSERT INTO p SELECT g, 'g1' FROM generate_series(100, {99 + rows}) g")
        if prepare:
            cur.execute("PREPARE TRANSACTION 'g1'")
        pg_db.execute("INSERT INTO p VALUES (2, 'after prepare')")
        cdc.sync()
        assert [e["after"]["gid"] for e in cdc.events("p")] == ["before", "after prepare"]
        cdc.sync()  # again, still unresolved
        assert len(cdc.events("p")) == 2
        if prepare:
            pg_db.execute("COMMIT PREPARED 'g1'")
        else:
            cur.execute("COMMIT")
    pg_db.execute("INSERT INTO p VALUES (3, 'after commit')")
    cdc.sync()
    events = cdc.assert_state("p")
    expected = ["before", "after prepare"] + ["g1"] * rows + ["after commit"]
    assert [e["after"]["gid"] for e in events] == expected
    if streamed:
        assert_streamed(pg_db)


# --------------------------------------------------------------------------- 7. messages


def test_logical_messages(pg_db: PgDatabase, tmp_path: Path) -> None:
    """Transactional and non-transactional logical decoding messages under ``_messages``."""
    pg_db.execute("CREATE TABLE t (id int PRIMARY KEY)")
    cdc = make_cdc(pg_db, tmp_path)
    pg_db.execute("INSERT INTO t VALUES (1); SELECT pg_logical_emit_message(true, 'p', 'x')")
    pg_db.execute("SELECT pg_logical_emit_message(false, 'nt', '\\x00ff'::bytea)")
    with pytest.raises(RuntimeError), transaction(pg_db) as cur:
        cur.execute("SELECT pg_logical_emit_message(true, 'p', 'rolled back')")
        cur.execute("SELECT pg_logical_emit_message(false, 'nt', 'survives')")
        raise RuntimeError("roll back")
    cdc.sync()

    messages = checked_events(cdc.out, "_messages")
    assert [
        (m["message"]["prefix"], base64.b64decode(m["message"]["content"])) for m in messages
    ] == [("p", b"x"), ("nt", b"\x00\xff"), ("nt", b"survives")]
    assert all(m["op"] == "m" for m in messages)
    assert [m["source"]["transactional"] for m in messages] == [True, False, False]
    (insert,) = cdc.events("t")
    assert messages[0]["source"]["commit_lsn"] == insert["source"]["commit_lsn"]
    assert messages[0]["source"]["seq"] == 1
    for message in messages[1:]:  # position: its own LSN - 1, seq 0 (docs/events.md)
        assert message["source"]["seq"] == 0
        assert message["source"]["commit_lsn"] == message["source"]["lsn"] - 1


# --------------------------------------------------------------------------- 8. partitions


def test_partitioned_table_via_root(pg_db: PgDatabase, tmp_path: Path) -> None:
    pg_db.execute(
        """
        CREATE TABLE root (id int, region text, a text, PRIMARY KEY (id, region)) PARTITION BY LIST (region);
        CREATE TABLE root_eu PARTITION OF root FOR VALUES IN ('eu');
        CREATE TABLE root_us PARTITION OF root FOR VALUES IN ('us');
        CREATE PUBLICATION cdcd_e2e_pub FOR TABLE root WITH (publish_via_partition_root = true);
        """
    )
    cdc = make_cdc(pg_db, tmp_path, create_publication=False)
    pg_db.execute("INSERT INTO root VALUES (1, 'eu', 'a'), (2, 'us', 'b'), (3, 'eu', 'c')")
    pg_db.execute("UPDATE root SET a = 'x' WHERE id = 2")
    pg_db.execute("UPDATE root SET region = 'us' WHERE id = 1")  # moves to the other partition
    pg_db.execute("DELETE FROM root WHERE id = 3")
    cdc.sync()
    assert sorted(p.name for p in cdc.out.iterdir()) == ["public.root"]
    events = cdc.assert_state("root")
    assert all(e["source"]["table"] == "root" for e in events)
    assert events[3]["key"] == {"id": 2, "region": "us"}


# --------------------------------------------------------------------------- 9. filters, columns


def test_row_filter_and_column_list(pg_db: PgDatabase, tmp_path: Path) -> None:
    pg_db.execute(
        """
        CREATE TABLE f (id int PRIMARY KEY, a text, secret text);
        CREATE PUBLICATION cdcd_e2e_pub FOR TABLE f (id, a) WHERE (id > 10);
        """
    )
    cdc = make_cdc(pg_db, tmp_path, create_publication=False)
    pg_db.execute("INSERT INTO f SELECT g, 'a' || g, 's' || g FROM generate_series(1, 20) g")
    pg_db.execute("UPDATE f SET a = 'changed', secret = 'x' WHERE id IN (5, 15)")
    pg_db.execute("UPDATE f SET id = 50 WHERE id = 6")  # enters the filter: published as insert
    pg_db.execute("UPDATE f SET id = -12 WHERE id = 12")  # leaves it: published as delete
    pg_db.execute("DELETE FROM f WHERE id IN (1, 20)")
    cdc.sync()
    events = cdc.assert_state("f", columns="id, a", where="id > 10")
    assert all(set(e["after"] or e["before"]) == {"id", "a"} for e in events)
    assert all((e["after"] or e["before"])["id"] > 10 for e in events)
    assert ops(events) == "c" * 10 + "ucdd"


# --------------------------------------------------------------------------- 10. binary mode

_TYPES_TABLE = """
CREATE TABLE typed (
    id int PRIMARY KEY, i8 bigint, num numeric(20, 4), txt text, ts timestamptz, js jsonb,
    u uuid, b bytea, ints int[], texts text[], flag bool, f float8
)
"""
_TYPED_ROWS = """
INSERT INTO typed VALUES
 (1, 9007199254740993, 12345678901234.5678, 'héllo "quoted"', '2024-02-29 23:59:59.123456+05:30',
  '{"a": [1, 2.50, null], "b": {"c": "d"}}', 'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', '\\x00ff10',
  '{1, NULL, -3}', '{"x", "with,comma", NULL}', true, 1.5e300),
 (2, -1, -0.0001, '', '1970-01-01 00:00:00+00', 'null', '00000000-0000-0000-0000-000000000000', '',
  '{}', '{}', false, 'NaN'),
 (3, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, '-Infinity'),
 (4, 0, 0, 'x', 'infinity', '[]', NULL, '\\x', '{{1, 2}, {3, 4}}', '{"\\\\"}', NULL, -0.0)
"""


def _same_float(event: Any, value: float) -> bool:
    if value != value:
        return bool(event == "NaN")
    if value in (float("inf"), float("-inf")):
        return bool(event == ("Infinity" if value > 0 else "-Infinity"))
    return bool(event == value)


def _same_timestamptz(event: Any, value: datetime.datetime) -> bool:
    if event in ("infinity", "-infinity"):  # psycopg2 reads them as datetime.max / min
        limit = datetime.datetime.max if event == "infinity" else datetime.datetime.min
        return value.replace(tzinfo=None) == limit
    return datetime.datetime.fromisoformat(event.replace("Z", "+00:00")) == value


#: how each column's contract JSON value (docs/events.md) compares with psycopg2's Python value
_SAME: dict[str, Any] = {
    "num": lambda e, v: Decimal(e) == v,
    "ts": _same_timestamptz,
    "js": lambda e, v: orjson.loads(e) == orjson.loads(v),
    "b": lambda e, v: base64.b64decode(e) == bytes(v),
    "f": _same_float,
}


def test_binary_mode_matches_text_mode_and_source(pg_db: PgDatabase, tmp_path: Path) -> None:
    """Two slots on one workload, one with ``binary: true``: the same events apart from the
    processing time, and the values are the source's (compared per type with psycopg2's)."""
    pg_db.execute(_TYPES_TABLE)
    text = make_cdc(pg_db, tmp_path / "text", slot="cdcd_text")
    binary = make_cdc(pg_db, tmp_path / "binary", slot="cdcd_binary", binary=True)
    pg_db.execute(_TYPED_ROWS)
    pg_db.execute("UPDATE typed SET txt = 'changed', ints = ints || 5 WHERE id IN (1, 2)")
    pg_db.execute("DELETE FROM typed WHERE id = 3")
    endpos = wal_position(pg_db)
    text.sync(endpos)
    binary.sync(endpos)

    def comparable_event(event: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in event.items() if k != "ts_ms"}

    text_events = text.events("typed")
    assert ops(text_events) == "ccccuud"
    assert [comparable_event(e) for e in binary.events("typed")] == [
        comparable_event(e) for e in text_events
    ]
    rebuilt = {row["id"]: row for row in apply_events(text_events)}
    with pg_db.connect() as conn, conn.cursor() as cur:
        # jsonb as text: psycopg2 would read a JSON null as None, like SQL NULL
        cur.execute(
            "SELECT id, i8, num, txt, ts, js::text AS js, u, b, ints, texts, flag, f FROM typed"
        )
        names = [d[0] for d in cur.description]
        source = {row[0]: dict(zip(names, row, strict=True)) for row in cur.fetchall()}
    assert rebuilt.keys() == source.keys()
    for key, row in source.items():
        for column, value in row.items():
            got = rebuilt[key][column]
            same = _SAME.get(column, lambda e, v: e == v)
            assert got is None if value is None else same(got, value), (
                f"row {key} {column}: {got!r} vs {value!r}"
            )
