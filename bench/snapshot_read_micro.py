"""How fast can a snapshot read rows? ``COPY (SELECT ...) TO STDOUT`` of block ranges (the
initial snapshot) and of key-ordered chunks (incremental snapshots) against the same chunks
read with ``SELECT``, and one cursor over the whole table: same table, same run.

Run: ``python bench/snapshot_read_micro.py [--rows N] [--pg 18] [--chunk-rows N]
[--key-chunk-rows N]``. Each reader
turns the rows into the text-kind ``TupleData`` the encoder takes (what the initial snapshot
does), nothing more; the table is the ten-column table of workload W1/S1 (bench/run.py).
Prints rows/s and CPU microseconds per row of this process for each; no assertions.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import asyncpg

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.run import W1_DDL, W1_ROWS
from cdcd.decoder.events import KIND_NULL, KIND_TEXT, TupleData
from cdcd.source.snapshot import (
    TableChunk,
    chunk_sql,
    copy_chunk,
    published_tables,
    read_key_chunk,
    read_rows,
    table_chunks,
)
from tests.pgharness import PgCluster, create_database, get_installation


async def _copy(conn: Any, table: Any, chunk_rows: int) -> int:
    count = 0

    async def take(rows: list[Any], _size: int) -> None:
        nonlocal count
        count += len(rows)

    for chunk in await table_chunks(conn, table, chunk_rows):
        await copy_chunk(conn, chunk, take)
    return count


async def _copy_whole(conn: Any, table: Any, _chunk_rows: int) -> int:
    count = 0

    async def take(rows: list[Any], _size: int) -> None:
        nonlocal count
        count += len(rows)

    await copy_chunk(conn, TableChunk(table, None, None), take)
    return count


async def _cursor(conn: Any, table: Any, _chunk_rows: int) -> int:
    count = 0
    async with conn.transaction():
        async for rows in read_rows(conn, table):
            count += len(rows)
    return count


async def _keyset(conn: Any, table: Any, chunk_rows: int, copy: bool = False) -> int:
    """Key-ordered chunks (incremental snapshots): SELECT, or COPY of the same SELECT."""
    keys = [("id", "bigint")]
    last: list[str] | None = None
    count = 0
    while True:
        if copy:  # the rows left as COPY's text: only the last one parsed, for its key
            batches, read, _, _ = await read_key_chunk(conn, table, keys, last, chunk_rows)
            key = batches[-1][-1].values[0].decode() if read else None  # type: ignore[union-attr]
            count += read
            if read < chunk_rows:
                return count
            last = [key]  # type: ignore[list-item]
            continue
        records = await conn.fetch(chunk_sql(table, keys, last, chunk_rows))
        rows = [
            TupleData(
                bytes(KIND_NULL if v is None else KIND_TEXT for v in r),
                tuple(None if v is None else v.encode() for v in r),
            )
            for r in records
        ]
        key = records[-1][0] if records else None
        count += len(rows)
        if len(rows) < chunk_rows:
            return count
        last = [key]  # type: ignore[list-item]


async def _keyset_copy(conn: Any, table: Any, chunk_rows: int) -> int:
    return await _keyset(conn, table, chunk_rows, copy=True)


READERS = {
    "copy_ctid_chunks": _copy,
    "copy_whole_table": _copy_whole,
    "keyset_select": _keyset,
    "keyset_copy": _keyset_copy,
    "cursor_select": _cursor,
}


async def measure(dsn: str, chunk_rows: int, key_chunk_rows: int) -> None:
    conn = await asyncpg.connect(dsn)
    try:
        (table,) = await published_tables(conn, "bench_pub")
        await conn.execute("SELECT count(*) FROM s1")  # warm: no reader pays for a cold cache
        for name, reader in READERS.items():
            cpu0, t0 = time.process_time(), time.perf_counter()
            size = key_chunk_rows if name.startswith("keyset") else chunk_rows
            rows = await reader(conn, table, size)
            seconds = time.perf_counter() - t0
            cpu = time.process_time() - cpu0
            print(
                f"{name:<18} rows={rows} {seconds:6.2f}s {rows / seconds:>10,.0f} rows/s "
                f"cpu {cpu / rows * 1e6:5.2f} us/row",
                flush=True,
            )
    finally:
        await conn.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--pg", type=int, default=18)
    parser.add_argument("--chunk-rows", type=int, default=100_000, help="initial: block ranges")
    parser.add_argument("--key-chunk-rows", type=int, default=2048, help="incremental: keyset")
    args = parser.parse_args()
    install = get_installation(args.pg)
    if install is None:
        raise SystemExit(f"PostgreSQL {args.pg} is not installed")
    cluster = PgCluster(install)
    cluster.start()
    try:
        db = create_database(cluster, "snapread")
        db.execute(W1_DDL.replace("w1", "s1"))
        db.execute(f"INSERT INTO s1 {W1_ROWS} FROM generate_series(1, {args.rows}) g")
        db.execute("ANALYZE s1; CREATE PUBLICATION bench_pub FOR TABLE s1")
        print(
            f"PostgreSQL {cluster.version}, {args.rows} rows, block-range chunks of "
            f"{args.chunk_rows} rows, keyset chunks of {args.key_chunk_rows}"
        )
        asyncio.run(measure(db.dsn, args.chunk_rows, args.key_chunk_rows))
    finally:
        cluster.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
