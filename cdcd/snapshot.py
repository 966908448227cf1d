"""The initial snapshot: the rows that existed before the slot, as ``op: "r"`` events.

``snapshot.mode``: ``initial`` snapshots when cdcd creates the slot and then streams;
``initial_only`` snapshots and exits; ``never`` only streams.

Consistency: the slot is created with ``SNAPSHOT 'export'``; while that replication connection
stays open (and idle), an ordinary connection reads every published table inside
``REPEATABLE READ`` with ``SET TRANSACTION SNAPSHOT`` — exactly the database state at the slot's
consistent point, so streaming from the slot continues with no gap and no overlap
(PostgreSQL docs, "Exported Snapshots" and CREATE_REPLICATION_SLOT). An exported snapshot cannot
be resumed after a restart (docs/protocol.md): a state file records that a snapshot is running; if cdcd
finds it unfinished at start, it drops the slot and snapshots again (events of the interrupted
attempt may then appear twice in the sinks, with different positions: consumers keep the last
``r`` event per key, as with Debezium's restarted snapshots).

Positions: all snapshot events form one pseudo-transaction at ``commit_lsn`` = the slot's
consistent point - 1, ``seq`` counting across tables, which sorts them before every streamed
change. Not the point itself: it is the end of the running-xacts record at which the snapshot
became consistent, and a transaction still running there (not in the snapshot, decoded in full)
can commit with its commit record right after that one, i.e. at the point; one byte earlier
lies inside that record, where nothing commits (README "Change events": positions are unique).
Values are read as text with the same session settings as the replication connection and go
through the same text converters as streamed changes.

Chunks (README "Initial snapshot"): each table is split into block ranges of about
``snapshot.initial_chunk_rows`` rows (``WHERE ctid >= '(a,0)' AND ctid < '(b,0)'``: a TID range
scan on PostgreSQL 14+, so tables without a key split too), read with
``COPY (SELECT ...) TO STDOUT`` — measured faster than a cursor over the same ``SELECT``
(README). ``snapshot.workers`` connections read chunks at once, each in its own transaction
importing the same exported snapshot; :mod:`cdcd.pipeline.snapshot` hands them to the sinks in
chunk order, so ``seq`` stays dense and in table order however the reads interleave.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cdcd.decoder.events import KIND_NULL, KIND_TEXT, Column, Relation, TupleData
from cdcd.wire.frontend import quote_ident

_TABLES_SQL = """
SELECT c.oid::int8, n.nspname, c.relname, c.relreplident
FROM pg_publication_tables pt
JOIN pg_namespace n ON n.nspname = pt.schemaname
JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = pt.tablename
WHERE pt.pubname = $1
ORDER BY n.nspname, c.relname
"""

_COLUMNS_SQL = """
SELECT a.attname, a.atttypid::int8, a.atttypmod,
       COALESCE(a.attnum = ANY(i.indkey::int2[]), false) AS is_identity
FROM pg_attribute a
LEFT JOIN LATERAL (
    SELECT indkey FROM pg_index
    WHERE indrelid = a.attrelid AND (indisprimary OR indisreplident)
    ORDER BY indisreplident DESC, indisprimary DESC LIMIT 1
) i ON true
WHERE a.attrelid = $1 AND a.attnum > 0 AND NOT a.attisdropped AND a.attgenerated = ''
ORDER BY a.attnum
"""


_SIZE_SQL = """
SELECT c.relkind::text, pg_relation_size(c.oid) / current_setting('block_size')::int8,
       c.reltuples::float8, c.relpages::int8
FROM pg_class c WHERE c.oid = $1
"""

#: rows per block assumed for a table never analyzed (``pg_class.reltuples`` unknown)
_ROWS_PER_BLOCK_GUESS = 60


@dataclass(frozen=True, slots=True)
class SnapshotTable:
    relation: Relation
    row_filter: str | None


@dataclass(frozen=True, slots=True)
class TableChunk:
    """Blocks ``[first, end)`` of ``table`` (``None``: unbounded on that side; both ``None``:
    the whole table in one read)."""

    table: SnapshotTable
    first: int | None
    end: int | None


class SnapshotState:
    """``<state_dir>/<slot>.snapshot.json``: whether a snapshot for the slot is unfinished."""

    def __init__(self, state_dir: Path, slot: str) -> None:
        self.path = state_dir / f"{slot}.snapshot.json"

    def running(self) -> bool:
        try:
            return bool(json.loads(self.path.read_text()).get("status") == "running")
        except FileNotFoundError:
            return False

    def _write(self, data: dict[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name("." + self.path.name + ".tmp")
        with tmp.open("w") as fh:
            fh.write(json.dumps(data))
            fh.flush()
            os.fsync(fh.fileno())
        tmp.replace(self.path)
        fd = os.open(self.path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)  # the rename itself survives a crash
        finally:
            os.close(fd)

    def start(self, consistent_point: int | None = None) -> None:
        """A snapshot is under way. Written before the slot is created (``None``: no slot yet)
        and again with its consistent point once it is: whenever cdcd stops in between, the
        next start finds a snapshot not finished and takes it again on a new slot, instead of
        finding a slot and skipping the rows that existed before it."""
        self._write({"status": "running", "consistent_point": consistent_point})

    def finish(self, consistent_point: int) -> None:
        self._write({"status": "done", "consistent_point": consistent_point})


async def published_tables(
    conn: Any, publication: str, only: tuple[str, str] | None = None
) -> list[SnapshotTable]:
    """The publication's tables with their published columns and row filters; ``only``: just
    the table ``(schema, name)`` (none if it is not published)."""
    major = int(await conn.fetchval("SHOW server_version_num")) // 10000
    extra = "pt.attnames, pt.rowfilter" if major >= 15 else "NULL::name[], NULL::text"
    sql = _TABLES_SQL.replace("SELECT c.oid::int8,", f"SELECT {extra}, c.oid::int8,")
    if only is not None:
        sql = sql.replace(
            "WHERE pt.pubname = $1",
            "WHERE pt.pubname = $1 AND pt.schemaname = $2 AND pt.tablename = $3",
        )
    rows = await conn.fetch(sql, publication, *(only or ()))
    tables = []
    for attnames, rowfilter, oid, schema, name, replident in rows:
        published = set(attnames) if attnames is not None else None
        columns = []
        for col_name, type_oid, typmod, is_identity in await conn.fetch(_COLUMNS_SQL, oid):
            if published is not None and col_name not in published:
                continue
            columns.append(Column(1 if is_identity else 0, col_name, type_oid, typmod))
        ident = replident.decode() if isinstance(replident, bytes) else str(replident)
        relation = Relation(None, oid, schema, name, ident, tuple(columns))
        tables.append(SnapshotTable(relation, rowfilter))
    return tables


async def read_rows(
    conn: Any, table: SnapshotTable, batch_size: int = 5000
) -> AsyncIterator[list[TupleData]]:
    """The table's rows as text-kind TupleData, in batches (inside the caller's transaction)."""
    rel = table.relation
    if not rel.columns:
        return
    select = ", ".join(f"{quote_ident(c.name)}::text" for c in rel.columns)
    sql = f"SELECT {select} FROM {quote_ident(rel.namespace)}.{quote_ident(rel.name)}"
    if table.row_filter:
        sql += f" WHERE {table.row_filter}"
    width = len(rel.columns)
    batch: list[TupleData] = []
    async for record in conn.cursor(sql, prefetch=batch_size):
        values = tuple(None if v is None else v.encode() for v in record)
        kinds = bytes(KIND_NULL if v is None else KIND_TEXT for v in values)
        assert len(values) == width
        batch.append(TupleData(kinds, values))
        if len(batch) >= batch_size:
            yield batch
            batch = []
    if batch:
        yield batch


async def table_chunks(conn: Any, table: SnapshotTable, rows_per_chunk: int) -> list[TableChunk]:
    """``table`` split into block ranges of about ``rows_per_chunk`` rows (estimated from
    ``pg_class``). Partitioned tables (a publication with ``publish_via_partition_root``) and
    servers before 14 (no TID range scans) are read whole."""
    kind, blocks, reltuples, relpages = await conn.fetchrow(_SIZE_SQL, table.relation.oid)
    major = int(await conn.fetchval("SHOW server_version_num")) // 10000
    if kind != "r" or major < 14 or blocks <= 1:
        return [TableChunk(table, None, None)]
    per_block = reltuples / relpages if reltuples > 0 and relpages > 0 else _ROWS_PER_BLOCK_GUESS
    step = max(1, math.ceil(rows_per_chunk / max(per_block, 1.0)))
    starts = list(range(0, blocks, step))
    # the first and last ranges are open: nothing the snapshot sees lies outside them
    return [
        TableChunk(table, a if i else None, starts[i + 1] if i + 1 < len(starts) else None)
        for i, a in enumerate(starts)
    ]


def chunk_query(chunk: TableChunk) -> str | None:
    """The ``SELECT`` of ``chunk``'s published columns as text; None without columns."""
    table = chunk.table
    rel = table.relation
    if not rel.columns:
        return None
    select = ", ".join(f"{quote_ident(c.name)}::text" for c in rel.columns)
    sql = f"SELECT {select} FROM {quote_ident(rel.namespace)}.{quote_ident(rel.name)}"
    where = []
    if chunk.first is not None:
        where.append(f"ctid >= '({chunk.first},0)'::tid")
    if chunk.end is not None:
        where.append(f"ctid < '({chunk.end},0)'::tid")
    if table.row_filter:
        where.append(f"({table.row_filter})")
    if where:
        sql += " WHERE " + " AND ".join(where)
    return sql


# COPY's text format (PostgreSQL docs, COPY "Text Format"): what COPY TO writes escaped
_UNESCAPES = {
    b"b": b"\b",
    b"f": b"\f",
    b"n": b"\n",
    b"r": b"\r",
    b"t": b"\t",
    b"v": b"\v",
    b"\\": b"\\",
}
_ESCAPE = re.compile(rb"\\(.)", re.DOTALL)


def _unescape(match: re.Match[bytes]) -> bytes:
    return _UNESCAPES.get(match.group(1), match.group(1))


def copy_rows(lines: list[bytes], width: int) -> list[TupleData]:
    """Rows of COPY text output (one line each, without the newline) as text-kind TupleData."""
    all_text = bytes([KIND_TEXT]) * width
    rows = []
    for line in lines:
        fields = line.split(b"\t")
        if len(fields) != width:
            raise ValueError(f"COPY row with {len(fields)} fields, expected {width}")
        if b"\\" not in line:
            rows.append(TupleData(all_text, tuple(fields)))
            continue
        values = tuple(None if f == b"\\N" else _ESCAPE.sub(_unescape, f) for f in fields)
        kinds = bytes(KIND_NULL if v is None else KIND_TEXT for v in values)
        rows.append(TupleData(kinds, values))
    return rows


async def copy_chunk(
    conn: Any,
    chunk: TableChunk,
    on_rows: Callable[[list[TupleData]], Awaitable[None]],
    batch_size: int = 5000,
) -> int:
    """Read ``chunk`` (inside the caller's transaction) with :func:`copy_query`."""
    sql = chunk_query(chunk)
    if sql is None:
        return 0
    return await copy_query(conn, sql, len(chunk.table.relation.columns), on_rows, batch_size)


async def copy_query(
    conn: Any,
    sql: str,
    width: int,
    on_rows: Callable[[list[TupleData]], Awaitable[None]],
    batch_size: int = 5000,
) -> int:
    """Read the rows of ``sql`` (its ``width`` columns as text) with
    ``COPY (sql) TO STDOUT``, handing them to ``on_rows`` in batches of about ``batch_size``;
    the row count. ``on_rows`` may wait: the server's output waits with it."""
    rest = b""
    pending: list[TupleData] = []
    count = 0

    async def take(data: bytes | bytearray) -> None:
        nonlocal rest, pending, count
        data = bytes(data)  # asyncpg hands a bytearray; values must be bytes
        lines = (rest + data).split(b"\n") if rest else data.split(b"\n")
        rest = lines.pop()
        if lines:
            pending += copy_rows(lines, width)
        if len(pending) >= batch_size:
            count += len(pending)
            batch, pending = pending, []
            await on_rows(batch)

    await conn.copy_from_query(sql, output=take)
    if rest:
        raise ValueError(f"COPY output ends inside a row: {sql[:200]}")
    if pending:
        count += len(pending)
        await on_rows(pending)
    return count
