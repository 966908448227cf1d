"""An incremental snapshot's chunk against the table as described (cdcd.source.snapshot
read_key_chunk): a column added, dropped or retyped since the description makes the chunk be
read again with the table described anew (docs/snapshots.md, "Bad input"), so that its rows
carry the table's columns as they are; an unchanged table, generated and unpublished columns
included, reads at once."""

from __future__ import annotations

import asyncpg
import pytest

from cdcd.source.snapshot import SnapshotTable, published_tables, read_key_chunk
from tests.pgharness import PgDatabase

pytestmark = [pytest.mark.pg, pytest.mark.version_independent, pytest.mark.timeout(60)]

KEY = [("id", "integer")]


async def _chunk(conn: asyncpg.Connection, table: SnapshotTable) -> tuple[int, bool]:
    _, count, altered, _ = await read_key_chunk(conn, table, KEY, None, 10)
    return count, altered


async def _described(conn: asyncpg.Connection, name: str) -> SnapshotTable:
    [table] = await published_tables(conn, "p", ("public", name))
    return table


async def test_a_chunk_finds_the_table_altered_since_it_was_described(pg_db: PgDatabase) -> None:
    pg_db.execute(
        "CREATE TABLE t (id int PRIMARY KEY, v text, g int GENERATED ALWAYS AS (id * 2) STORED);"
        "INSERT INTO t (id, v) VALUES (1, 'a'), (2, 'b');"
        "CREATE TABLE c (id int PRIMARY KEY, v text, hidden text);"
        "INSERT INTO c VALUES (1, 'a', 'x');"
        "CREATE PUBLICATION p FOR TABLE t, c (id, v)"
    )
    conn = await asyncpg.connect(pg_db.dsn)
    try:
        table = await _described(conn, "t")
        assert [c.name for c in table.relation.columns] == ["id", "v"]  # g is generated
        assert await _chunk(conn, table) == (2, False)
        assert await _chunk(conn, await _described(conn, "c")) == (1, False)

        # a column added: the chunk would read the rows without it
        await conn.execute("ALTER TABLE t ADD COLUMN extra int NOT NULL DEFAULT 7")
        assert await _chunk(conn, table) == (0, True)
        table = await _described(conn, "t")
        assert [c.name for c in table.relation.columns] == ["id", "v", "extra"]
        assert await _chunk(conn, table) == (2, False)

        await conn.execute("ALTER TABLE t ALTER COLUMN extra TYPE bigint")
        assert await _chunk(conn, table) == (0, True)
        table = await _described(conn, "t")
        assert await _chunk(conn, table) == (2, False)

        await conn.execute("ALTER TABLE t DROP COLUMN extra")
        assert (await _chunk(conn, table))[1]
    finally:
        await conn.close()
