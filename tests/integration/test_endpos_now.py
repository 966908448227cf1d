"""``cdcd run --endpos`` without an LSN: catch up to where the server's WAL ends at start
(``pg_current_wal_insert_lsn()``), then exit 0 with everything committed before it written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cdcd.lsn import parse_lsn
from tests.e2e import read_events, run_cdcd, write_config
from tests.pgharness import PgDatabase

pytestmark = pytest.mark.pg


def test_bare_endpos_stops_at_the_wal_insert_position(pg_db: PgDatabase, tmp_path: Path) -> None:
    pg_db.execute("CREATE TABLE orders (id int PRIMARY KEY, note text)")
    cfg = write_config(tmp_path, pg_db.dsn)
    run_cdcd("slot", "create", "--config", str(cfg))
    # asynchronous commit: the commits may end past pg_current_wal_lsn() (written), never past
    # pg_current_wal_insert_lsn() (inserted); the last one must still be in the output
    pg_db.execute(
        "SET synchronous_commit = off; "
        "INSERT INTO orders SELECT g, 'n' || g FROM generate_series(1, 50) g; "
        "INSERT INTO orders VALUES (51, 'last')"
    )
    before = parse_lsn(pg_db.fetchval("SELECT pg_current_wal_insert_lsn()::text"))
    done = run_cdcd("run", "--config", str(cfg), "--endpos", timeout=120)
    events = read_events(tmp_path / "out", "public.orders")
    assert [e["after"]["id"] for e in events] == list(range(1, 52))
    logged = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    (start,) = [e for e in logged if e["event"] == "running until end position"]
    assert parse_lsn(start["endpos"]) >= before


def test_endpos_now_is_the_same_and_bad_text_is_a_usage_error(
    pg_db: PgDatabase, tmp_path: Path
) -> None:
    cfg = write_config(tmp_path, pg_db.dsn)
    run_cdcd("slot", "create", "--config", str(cfg))
    assert run_cdcd("run", "--config", str(cfg), "--endpos", "now").returncode == 0
    bad = run_cdcd("run", "--config", str(cfg), "--endpos", "soon", check=False)
    assert bad.returncode == 2 and "or 'now'" in bad.stderr
