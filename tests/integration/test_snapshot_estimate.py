"""How many rows a table holds, before its incremental snapshot (cdcd.source.snapshot
row_estimate): the planner's statistics when there are any; for a table never analysed, its
size over a sample's row width, said to be an estimate from the size; nothing made up."""

from __future__ import annotations

import asyncpg
import pytest

from cdcd.source.snapshot import published_tables, row_estimate
from tests.pgharness import PgDatabase

pytestmark = [pytest.mark.pg, pytest.mark.version_independent, pytest.mark.timeout(60)]


async def test_a_never_analysed_table_is_estimated_from_its_size(pg_db: PgDatabase) -> None:
    pg_db.execute(
        # autovacuum off: nothing analyses it behind the test's back
        "CREATE TABLE t (id bigint PRIMARY KEY, a int, b text) WITH (autovacuum_enabled = off);"
        "INSERT INTO t SELECT g, g, 'row ' || g FROM generate_series(1, 20000) g;"
        "CREATE TABLE e (id int PRIMARY KEY) WITH (autovacuum_enabled = off);"
        "CREATE PUBLICATION p FOR TABLE t, e"
    )
    conn = await asyncpg.connect(pg_db.dsn)
    try:
        tables = {t.relation.name: t for t in await published_tables(conn, "p")}
        assert await conn.fetchval("SELECT reltuples FROM pg_class WHERE relname = 't'") == -1
        rows, source = await row_estimate(conn, tables["t"])
        assert source == "size" and 15_000 <= rows <= 30_000, rows
        assert await row_estimate(conn, tables["e"]) == (0, "size")  # no block: no row
        await conn.execute("ANALYZE t")
        assert await row_estimate(conn, tables["t"]) == (20_000, "statistics")
    finally:
        await conn.close()
