"""Tables without a usable replica identity (docs/keyless-tables.md), on every installed version.

A keyed table ``t``, a keyless ``nk(x int)`` and, in schema ``s``, a partitioned table whose one
partition has no key. Published for updates and deletes, the application's UPDATE and DELETE on
``nk`` fail on the server; so:

* ``source.keyless_tables: refuse`` (the default): ``cdcd check`` exits 3 naming ``nk`` and the
  partition with their fixes; ``cdcd run`` and ``cdcd slot create`` exit 3 naming them and
  create no publication; the application's UPDATE on ``nk`` keeps working;
* ``insert_only``: a daemon run. The main publication lists ``t``, ``<pub>_insert_only`` holds
  ``nk`` and the partitioned table for inserts and truncates; UPDATE and DELETE on ``nk`` work;
  its events are the initial snapshot's rows, inserts and the truncate only. A keyless table created while cdcd runs goes to
  the insert-only publication, a keyed one to the main one (and its changes are captured);
* ``exclude``: ``nk`` is left out, its writes work, no events;
* ``replica_identity_full``: cdcd sets REPLICA IDENTITY FULL, updates and deletes of ``nk``
  arrive with the whole old row and a null key; run by a role that does not own ``nk``, exit 3
  saying so. For both, tables created while cdcd is stopped get the choice at its next start;
* a publication made by the DBA that already breaks ``nk``: ``cdcd run`` streams, but logs an
  error naming it and counts it in ``cdcd_tables_breaking_writes``; a keyless table created
  while it runs is logged and counted too, and shown on the status page;
* the event-trigger recipe of docs/keyless-tables.md gives new keyless tables REPLICA IDENTITY
  FULL.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e import REPO, read_events, run_cdcd, write_config
from tests.integration.test_service import (
    alive,
    current_lsn,
    daemon,
    endpoint_up,
    http_get,
    metric,
    scrape,
    wait_for,
)
from tests.pgharness import PgDatabase, free_port

pytestmark = [pytest.mark.pg, pytest.mark.timeout(300)]

PUB = "cdcd_e2e_pub"
TWIN = "cdcd_e2e_pub_insert_only"

SCHEMA = """
CREATE TABLE t (id int PRIMARY KEY, v text);
CREATE TABLE nk (x int);
CREATE SCHEMA s;
CREATE TABLE s.parts (k int NOT NULL, v int) PARTITION BY LIST (k);
CREATE TABLE s.parts_a PARTITION OF s.parts FOR VALUES IN (1);
"""


def config(tmp_path: Path, db: PgDatabase, port: int | None = None, **source: Any) -> Path:
    path = write_config(tmp_path, db.dsn, **source)
    if port is not None:
        cfg = yaml.safe_load(path.read_text())
        cfg["http"] = {"listen": f"127.0.0.1:{port}"}
        path.write_text(yaml.safe_dump(cfg))
    return path


def streaming(proc: Any, log_path: Path, port: int) -> bool:
    return alive(proc, log_path) and endpoint_up(port) and http_get(port, "/readyz")[0] == 200


def published(db: PgDatabase, publication: str) -> list[str]:
    return [
        f"{s}.{t}"
        for s, t in db.fetch(
            "SELECT schemaname, tablename FROM pg_publication_tables "
            f"WHERE pubname = '{publication}' ORDER BY 1, 2"
        )
    ]


def ops(out: Path, table: str) -> str:
    folder = out / table
    return "".join(e["op"] for e in read_events(out, table)) if folder.exists() else ""


def application_writes(db: PgDatabase, table: str = "nk") -> None:
    """What the application does; raises if the server refuses it."""
    db.execute(f"INSERT INTO {table} VALUES (1), (2)")
    db.execute(f"UPDATE {table} SET x = 3 WHERE x = 1")
    db.execute(f"DELETE FROM {table} WHERE x = 2")


def test_refuse_by_default(pg_db: PgDatabase, tmp_path: Path) -> None:
    pg_db.execute(SCHEMA + "CREATE TABLE dpk (id int PRIMARY KEY DEFERRABLE)")
    cfg = config(tmp_path, pg_db)

    check = run_cdcd("check", "--config", str(cfg), check=False)
    assert check.returncode == 3, check.stdout + check.stderr
    report = check.stdout
    assert re.search(
        r"^\s+public\.nk\s+FAIL\s+replica identity default without a primary", report, re.M
    ), report
    assert "REPLICA IDENTITY FULL" in report and "ADD PRIMARY KEY" in report
    assert re.search(r"^\s+s\.parts_a \(partition of s\.parts\)\s+FAIL", report, re.M), report
    assert re.search(
        r"^\s+public\.t\s+ok\s+replica identity default \(primary key\)", report, re.M
    ), report
    # the server does not take a deferrable primary key as the identity (15, 16, 18)
    assert re.search(r"^\s+public\.dpk\s+FAIL\s+.*primary key is deferrable", report, re.M), report
    assert re.search(
        r"^keyless tables\s+FAIL\s+public\.dpk, public\.nk, s\.parts_a", report, re.M
    ), report

    for args in (("run", "--endpos", "now"), ("slot", "create")):
        proc = run_cdcd(*args, "--config", str(cfg), check=False)
        assert proc.returncode == 3, proc.stdout + proc.stderr
        assert "public.nk" in proc.stdout + proc.stderr
        assert "source.keyless_tables" in proc.stdout + proc.stderr
        assert pg_db.fetchval("SELECT count(*) FROM pg_publication") == 0
    application_writes(pg_db)

    # the tables fixed (a key, a replica identity index): check passes, run creates FOR ALL TABLES
    pg_db.execute("TRUNCATE nk; ALTER TABLE nk ALTER x SET NOT NULL")
    pg_db.execute("CREATE UNIQUE INDEX nk_x ON nk (x)")
    pg_db.execute("ALTER TABLE nk REPLICA IDENTITY USING INDEX nk_x")
    pg_db.execute("ALTER TABLE s.parts_a ADD PRIMARY KEY (k); DROP TABLE dpk")
    check = run_cdcd("check", "--config", str(cfg), check=False)
    assert check.returncode == 0, check.stdout
    run_cdcd("slot", "create", "--config", str(cfg))
    assert pg_db.fetchval(f"SELECT puballtables FROM pg_publication WHERE pubname = '{PUB}'")
    application_writes(pg_db)


def test_insert_only_while_running(pg_db: PgDatabase, tmp_path: Path) -> None:
    pg_db.execute(SCHEMA + "INSERT INTO t VALUES (0, 'z'); INSERT INTO nk VALUES (0)")
    port = free_port()
    cfg = config(tmp_path, pg_db, port, snapshot="initial", keyless_tables="insert_only")
    check = run_cdcd("check", "--config", str(cfg), check=False)
    assert check.returncode == 0, check.stdout
    assert re.search(r"^\s+public\.nk\s+warn\s+.*inserts and truncates only", check.stdout, re.M)

    log_path = tmp_path / "cdcd.log"
    out = tmp_path / "out"
    with daemon(cfg, log_path) as proc:
        wait_for(lambda: streaming(proc, log_path, port), "streaming")
        assert published(pg_db, PUB) == ["public.t"]
        assert published(pg_db, TWIN) == ["public.nk", "s.parts_a"]
        pg_db.execute("INSERT INTO t VALUES (1, 'a'); UPDATE t SET v = 'b' WHERE id = 1")
        application_writes(pg_db)
        pg_db.execute("TRUNCATE nk")
        # tables created while cdcd runs: each to its publication, before the writes break
        pg_db.execute("CREATE TABLE late_nk (x int); CREATE TABLE late_k (id int PRIMARY KEY)")
        wait_for(lambda: "public.late_nk" in published(pg_db, TWIN), "late_nk in the twin")
        wait_for(lambda: "public.late_k" in published(pg_db, PUB), "late_k in the main one")
        # a table added to the publication is backfilled: written to only once that is done,
        # so that its events do not depend on when the backfill reads it
        wait_for(
            lambda: (
                re.search(
                    r'"event":"incremental snapshot of table done".*"table":"public\.late_k"',
                    log_path.read_text(),
                )
                is not None
            ),
            "late_k backfilled",
        )
        application_writes(pg_db, "late_nk")
        pg_db.execute("INSERT INTO late_k VALUES (1); UPDATE late_k SET id = 2")
        samples = scrape(port)
        assert metric(samples, "cdcd_tables_breaking_writes") == 0
        end = current_lsn(pg_db)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    run_cdcd("run", "--config", str(cfg), "--endpos", end)
    log = log_path.read_text()
    assert "FOR TABLE, as source.keyless_tables needs" in log
    assert ops(out, "public.t") == "rcu"
    # the initial snapshot, then inserts and the truncate: updates and deletes are not published
    assert ops(out, "public.nk") == "rcct"
    assert ops(out, "public.late_nk") == "cc"
    assert ops(out, "public.late_k") == "cdc"  # the key change: delete + create


@pytest.mark.parametrize("policy", ["exclude", "replica_identity_full"])
def test_exclude_and_replica_identity_full(pg_db: PgDatabase, tmp_path: Path, policy: str) -> None:
    pg_db.execute(SCHEMA)
    if policy == "replica_identity_full":  # only the owner may: a clear exit 3 otherwise
        pg_db.execute(
            "CREATE ROLE cdc_not_owner LOGIN REPLICATION PASSWORD 'pw';"
            f"GRANT CREATE ON DATABASE {pg_db.name} TO cdc_not_owner"
        )
        try:
            dsn = pg_db.dsn_for("cdc_not_owner", "pw")
            cfg = write_config(tmp_path / "not-owner", dsn, keyless_tables=policy)
            proc = run_cdcd("slot", "create", "--config", str(cfg), check=False)
            said = proc.stdout + proc.stderr
            assert proc.returncode == 3 and "Only the table's owner may" in said, said
            assert "REPLICA IDENTITY FULL: must be owner of table nk" in said, said
        finally:
            pg_db.execute(
                f"REVOKE CREATE ON DATABASE {pg_db.name} FROM cdc_not_owner;DROP ROLE cdc_not_owner"
            )
    cfg = config(tmp_path, pg_db, keyless_tables=policy)
    run_cdcd("slot", "create", "--config", str(cfg))
    application_writes(pg_db)
    pg_db.execute("INSERT INTO s.parts VALUES (1, 1); UPDATE s.parts SET v = 2")
    # tables created while cdcd is stopped: the choice is applied at its next start
    pg_db.execute("CREATE TABLE late_nk (x int); CREATE TABLE late_k (id int PRIMARY KEY)")
    run_cdcd("run", "--config", str(cfg), "--endpos", current_lsn(pg_db))
    application_writes(pg_db, "late_nk")
    out = tmp_path / "out"
    if policy == "exclude":
        assert published(pg_db, PUB) == ["public.late_k", "public.t"]
        assert ops(out, "public.nk") == "" and ops(out, "s.parts_a") == ""
        return
    idents = dict(pg_db.fetch("SELECT relname, relreplident FROM pg_class WHERE relkind = 'r'"))
    assert idents["nk"] == idents["late_nk"] == idents["parts_a"] == "f"
    assert idents["t"] == idents["late_k"] == "d"
    events = read_events(out, "public.nk")
    assert "".join(e["op"] for e in events) == "ccud"
    update, delete = events[2], events[3]
    assert update["before"] == {"x": 1} and update["after"] == {"x": 3}
    assert delete["before"] == {"x": 2} and update["key"] is None and delete["key"] is None
    assert ops(out, "s.parts_a") == "cu"


def test_dba_publication_and_a_table_created_while_running(
    pg_db: PgDatabase, tmp_path: Path
) -> None:
    pg_db.execute(SCHEMA + f"CREATE PUBLICATION {PUB} FOR ALL TABLES")
    port = free_port()
    cfg = config(tmp_path, pg_db, port)
    check = run_cdcd("check", "--config", str(cfg), check=False)
    assert check.returncode == 3 and "created outside cdcd" in check.stdout, check.stdout
    log_path = tmp_path / "cdcd.log"
    with daemon(cfg, log_path) as proc:
        wait_for(lambda: streaming(proc, log_path, port), "streaming")
        assert metric(scrape(port), "cdcd_tables_breaking_writes") == 2
        pg_db.execute("CREATE TABLE late (x int)")
        wait_for(lambda: metric(scrape(port), "cdcd_tables_breaking_writes") == 3, "late counted")
        samples = scrape(port)
        assert metric(samples, "cdcd_table_breaking_writes", table="public.late") == 1
        status, page = http_get(port, "/")
        assert status == 200 and 'id="breaking-alarm"' in page and "public.late" in page
        with pytest.raises(Exception, match="does not have a replica identity"):
            pg_db.execute("UPDATE late SET x = 1")
    log = log_path.read_text()
    errors = [line for line in log.splitlines() if "no usable replica identity" in line]
    assert any('"public.nk"' in line for line in errors), log[-4000:]
    assert any('"public.late"' in line and "REPLICA IDENTITY FULL" in line for line in errors)


def test_event_trigger_recipe(pg_db: PgDatabase) -> None:
    """The recipe in docs/keyless-tables.md, run as written."""
    text = (REPO / "docs" / "keyless-tables.md").read_text()
    recipe = re.search(r"```sql\n(-- event trigger.*?)```", text, re.S)
    assert recipe is not None
    pg_db.execute(recipe.group(1))
    pg_db.execute("CREATE TABLE plain (x int); CREATE TABLE keyed (id int PRIMARY KEY)")
    pg_db.execute("CREATE TABLE parted (k int) PARTITION BY LIST (k)")
    pg_db.execute("CREATE TABLE parted_1 PARTITION OF parted FOR VALUES IN (1)")
    idents = dict(
        pg_db.fetch(
            "SELECT relname, relreplident FROM pg_class "
            "WHERE relname IN ('plain', 'keyed', 'parted', 'parted_1')"
        )
    )
    assert idents == {"plain": "f", "keyed": "d", "parted": "f", "parted_1": "f"}
