"""The initial snapshot: the rows that existed before the slot, as ``op: "r"`` events.

``snapshot.mode``: ``initial`` snapshots when cdcd creates the slot and then streams;
``initial_only`` snapshots and exits; ``never`` only streams.

Consistency: the slot is created with ``SNAPSHOT 'export'``; while that replication connection
stays open (and idle), an ordinary connection reads every published table inside
``REPEATABLE READ`` with ``SET TRANSACTION SNAPSHOT`` — exactly the database state at the slot's
consistent point, so streaming from the slot continues with no gap and no overlap
(PostgreSQL docs, "Exported Snapshots" and CREATE_REPLICATION_SLOT). An exported snapshot cannot
be resumed after a restart (docs/protocol.md): a state file records that a snapshot is running,
and what of each table every sink holds (:meth:`SnapshotState.progress`); an unfinished one
found at start resumes on the same slot by key (:mod:`cdcd.source.resume`), or else the slot
is dropped and the snapshot taken again (events of the interrupted attempt may then appear
twice in the sinks, with different positions: consumers keep the last ``r`` event per key).

Positions: all snapshot events form one pseudo-transaction at ``commit_lsn`` = the slot's
consistent point - 1, ``seq`` counting across tables, which sorts them before every streamed
change. Not the point itself: it is the end of the running-xacts record at which the snapshot
became consistent, and a transaction still running there (not in the snapshot, decoded in full)
can commit with its commit record right after that one, i.e. at the point; one byte earlier
lies inside that record, where nothing commits (docs/events.md: positions are unique).
Values are read as text with the same session settings as the replication connection and go
through the same text converters as streamed changes.

Chunks (docs/snapshots.md): each table is split into block ranges of about
``snapshot.initial_chunk_rows`` rows (``WHERE ctid >= '(a,0)' AND ctid < '(b,0)'``: a TID range
scan on PostgreSQL 14+, so tables without a key split too), read with
``COPY (SELECT ...) TO STDOUT`` — measured faster than a cursor over the same ``SELECT``
(docs/snapshots.md). ``snapshot.workers`` connections read chunks at once, each in its own transaction
importing the same exported snapshot; :mod:`cdcd.snapshot.initial` hands them to the sinks in
chunk order, so ``seq`` stays dense and in table order however the reads interleave.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg

from cdcd.decoder.copy_batch import CopyBatch
from cdcd.decoder.events import KIND_NULL, KIND_TEXT, Column, Relation, TupleData
from cdcd.source.copy import copy_batches
from cdcd.source.queries import emit_refused
from cdcd.wire.frontend import quote_ident, quote_literal

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
       COALESCE(a.attnum = ANY(i.indkey::int2[]), false) AS is_identity,
       a.attgenerated <> '' AS generated
FROM pg_attribute a
LEFT JOIN LATERAL (
    SELECT indkey FROM pg_index
    WHERE indrelid = a.attrelid AND (indisprimary OR indisreplident)
    ORDER BY indisreplident DESC, indisprimary DESC LIMIT 1
) i ON true
WHERE a.attrelid = $1 AND a.attnum > 0 AND NOT a.attisdropped
ORDER BY a.attnum
"""


_SIZE_SQL = """
SELECT c.relkind::text, pg_relation_size(c.oid) / current_setting('block_size')::int8,
       c.reltuples::float8, c.relpages::int8
FROM pg_class c WHERE c.oid = $1
"""

#: why a table without a usable key is not snapshotted incrementally, and what to do
NO_KEY = (
    "it has neither a primary key nor a replica identity index, and incremental snapshots "
    "read tables in key order: add a primary key (or ALTER TABLE ... REPLICA IDENTITY USING "
    "INDEX on a unique index of NOT NULL columns), or snapshot it with snapshot.mode: initial "
    "(the exported snapshot reads tables without a key)"
)


#: rows per block assumed for a table never analyzed (``pg_class.reltuples`` unknown)
_ROWS_PER_BLOCK_GUESS = 60


@dataclass(frozen=True, slots=True)
class SnapshotTable:
    """A published table as described: its published columns (``relation``), its row filter,
    and ``shape``, every column of the table (published or not, generated ones included) as
    ``name type typmod`` in column order (:func:`read_key_chunk` compares it with the table's
    shape at each chunk's snapshot; None: not known, only the published columns are)."""

    relation: Relation
    row_filter: str | None
    shape: tuple[str, ...] | None = None


@dataclass(frozen=True, slots=True)
class TableChunk:
    """Blocks ``[first, end)`` of ``table`` (``None``: unbounded on that side; both ``None``:
    the whole table in one read); with ``keys`` (``(name, type)`` of the table's key), the
    keys ``(after, upto]`` instead, read in key order (``None``: unbounded on that side)."""

    table: SnapshotTable
    first: int | None
    end: int | None
    keys: tuple[tuple[str, str], ...] | None = None
    after: list[Any] | None = None
    upto: list[Any] | None = None


def write_state(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON to ``path`` atomically and durably (fsynced file and folder)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name("." + path.name + ".tmp")
    with tmp.open("w") as fh:
        fh.write(json.dumps(data))
        fh.flush()
        os.fsync(fh.fileno())
    tmp.replace(path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)  # the rename itself survives a crash
    finally:
        os.close(fd)


def incremental_state_path(state_dir: Path, slot: str) -> Path:
    """Where the incremental snapshot keeps its progress (``cdcd.snapshot.incremental``)."""
    return state_dir / f"{slot}.incremental.json"


def slot_record_path(state_dir: Path, slot: str) -> Path:
    """``<state_dir>/<slot>.slot.json``: cdcd streams from ``slot`` (written at every start
    that streams from it without an initial snapshot in progress; removed by ``cdcd slot
    drop``), so a slot gone later is known as lost, whatever ``snapshot.mode``."""
    return state_dir / f"{slot}.slot.json"


def record_slot(state_dir: Path, slot: str, position: int) -> None:
    """Record that cdcd streams from ``slot`` (from ``position`` on); kept once written."""
    path = slot_record_path(state_dir, slot)
    if path.exists():
        return
    state_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"slot": slot, "first_position": position}))
    os.replace(tmp, path)


def streamed_before(state_dir: Path, slot: str) -> Path | None:
    """The state file that shows cdcd streamed from ``slot`` before (its slot record, a
    finished initial snapshot, or the incremental snapshot's state), None when there is none or
    an initial snapshot is still unfinished (then a new slot is expected)."""
    snapshot = SnapshotState(state_dir, slot)
    if snapshot.running():
        return None
    paths = (
        slot_record_path(state_dir, slot),
        snapshot.path,
        incremental_state_path(state_dir, slot),
    )
    for path in paths:
        if path.exists():
            return path
    return None


class RecreateState:
    """``<state_dir>/<slot>.recreate.json``: a slot recreation (``source.on_slot_lost:
    recreate``) whose reset events are not durable in every sink yet. Written before the lost
    slot is dropped and removed once the reset is durable: a start that finds it recreates the
    slot again, so a crash in between cannot leave a new slot without the reset before it."""

    def __init__(self, state_dir: Path, slot: str) -> None:
        self.path = state_dir / f"{slot}.recreate.json"

    def pending(self) -> str | None:
        """Why the unfinished recreation started; None when there is none."""
        try:
            return str(json.loads(self.path.read_text()).get("reason") or "unknown")
        except FileNotFoundError:
            return None

    def start(self, reason: str) -> None:
        write_state(self.path, {"status": "pending", "reason": reason})

    def finish(self) -> None:
        self.path.unlink(missing_ok=True)


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
        write_state(self.path, data)

    def start(self, consistent_point: int | None = None) -> None:
        """A snapshot is under way. Written before the slot is created (``None``: no slot yet)
        and again with its consistent point once it is: whenever cdcd stops in between, the
        next start finds a snapshot not finished and takes it again on a new slot, instead of
        finding a slot and skipping the rows that existed before it."""
        self._write({"status": "running", "consistent_point": consistent_point})

    def finish(self, consistent_point: int) -> None:
        self._write({"status": "done", "consistent_point": consistent_point})

    def progress(self, consistent_point: int, tables: dict[str, dict[str, Any]]) -> None:
        """Still running; what of each table every sink holds durably (written by
        :mod:`cdcd.snapshot.initial`, read back by :meth:`recorded`): ``{"status": "done"}``,
        or ``{"status": "running", "last_key": [...] or None, "rows": n}`` for a table read in
        key order (every row up to ``last_key`` is durable; the key's values as text, as
        :class:`cdcd.snapshot.state.IncrementalState` keeps them)."""
        self._write({"status": "running", "consistent_point": consistent_point, "tables": tables})

    def recorded(self) -> tuple[int, dict[str, dict[str, Any]]] | None:
        """An unfinished snapshot's consistent point and tables' progress (:meth:`progress`);
        None when there is none, or it was written by a version that did not record it."""
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        if data.get("status") != "running" or not isinstance(data.get("tables"), dict):
            return None
        point = data.get("consistent_point")
        return (int(point), data["tables"]) if point else None


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
        shape = []
        for col_name, type_oid, typmod, is_identity, generated in await conn.fetch(
            _COLUMNS_SQL, oid
        ):
            shape.append(f"{col_name} {type_oid} {typmod}")
            if generated or (published is not None and col_name not in published):
                continue
            columns.append(Column(1 if is_identity else 0, col_name, type_oid, typmod))
        ident = replident.decode() if isinstance(replident, bytes) else str(replident)
        relation = Relation(None, oid, schema, name, ident, tuple(columns))
        tables.append(SnapshotTable(relation, rowfilter, tuple(shape)))
    return tables


async def read_rows(
    conn: Any, table: SnapshotTable, batch_size: int = 5000
) -> AsyncIterator[list[TupleData]]:
    """The table's rows as text-kind TupleData, in batches (inside the caller's transaction)."""
    rel = table.relation
    if not rel.columns:
        return
    # each value in its type's output form, as pgoutput sends it (a cast to text is not: see
    # chunk_query); format('%s', NULL) is '', hence the CASE (num_nulls: IS NULL looks inside
    # a composite value)
    select = ", ".join(
        f"CASE WHEN num_nulls({q}) = 0 THEN format('%s', {q}) END"
        for q in (quote_ident(c.name) for c in rel.columns)
    )
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
    """The ``SELECT`` of ``chunk``'s published columns, for COPY; None without columns.

    The columns are selected as they are: COPY writes each through its type's output function,
    the text pgoutput sends. A cast to ``text`` is another thing for some types (``bool::text``
    is ``true`` where the output is ``t``, ``inet::text`` adds the netmask, ``char(n)::text``
    drops the padding); tests/integration/test_types_server.py compares the two on every
    type."""
    table = chunk.table
    rel = table.relation
    if not rel.columns:
        return None
    select = ", ".join(quote_ident(c.name) for c in rel.columns)
    sql = f"SELECT {select} FROM {quote_ident(rel.namespace)}.{quote_ident(rel.name)}"
    where = []
    if chunk.first is not None:
        where.append(f"ctid >= '({chunk.first},0)'::tid")
    if chunk.end is not None:
        where.append(f"ctid < '({chunk.end},0)'::tid")
    if table.row_filter:
        where.append(f"({table.row_filter})")
    keys = list(chunk.keys or ())
    if keys:  # a key range, in key order (docs/snapshots.md: what an interruption costs)
        cols = ", ".join(quote_ident(k) for k, _ in keys)
        if chunk.after is not None:
            where.append(f"({cols}) > ({_key_literal(keys, chunk.after)})")
        if chunk.upto is not None:
            where.append(f"({cols}) <= ({_key_literal(keys, chunk.upto)})")
    if where:
        sql += " WHERE " + " AND ".join(where)
    if keys:
        sql += " ORDER BY " + ", ".join(quote_ident(k) for k, _ in keys)
    return sql


async def key_chunks(
    conn: Any, table: SnapshotTable, keys: list[tuple[str, str]], rows_per_chunk: int
) -> list[TableChunk]:
    """``table`` split into key ranges of ``rows_per_chunk`` rows (the bounds looked up on the
    key's index with :func:`next_bound`, inside the caller's transaction), in key order."""
    bounds: list[list[str | None]] = []
    after = None
    while (after := await next_bound(conn, table, keys, after, rows_per_chunk)) is not None:
        bounds.append(after)
    edges: list[list[str | None] | None] = [None, *bounds, None]
    key = tuple(keys)
    return [TableChunk(table, None, None, key, a, b) for a, b in itertools.pairwise(edges)]


async def usable_key(conn: Any, table: SnapshotTable) -> list[tuple[str, str]] | None:
    """``table``'s key (``(name, type)`` in key order) when it can be read in key order and
    paged through (:func:`primary_key`, :func:`key_problem`) and every key column is published
    (a row then carries its key); None otherwise."""
    keys = [(str(name), str(kind)) for name, kind in await primary_key(conn, table.relation.oid)]
    published = {c.name for c in table.relation.columns}
    if not keys or any(name not in published for name, _ in keys):
        return None
    if not conn.is_in_transaction():
        return None if await key_problem(conn, table, keys) is not None else keys
    # a key that cannot be compared fails the statement, and with it the transaction
    await conn.execute("SAVEPOINT cdcd_key")
    problem = await key_problem(conn, table, keys)
    await conn.execute("ROLLBACK TO SAVEPOINT cdcd_key; RELEASE SAVEPOINT cdcd_key")
    return None if problem is not None else keys


async def copy_chunk(
    conn: Any,
    chunk: TableChunk,
    on_rows: Callable[[CopyBatch, int], Awaitable[None]],
    batch_size: int = 5000,
) -> int:
    """Read ``chunk`` (inside the caller's transaction) with COPY (:func:`copy_batches`), its
    rows in :class:`~cdcd.decoder.copy_batch.CopyBatch` es (parsed when a sink asks)."""
    sql = chunk_query(chunk)
    if sql is None:
        return 0
    width = len(chunk.table.relation.columns)
    return await copy_batches(conn, sql, width, on_rows, batch_size)


# The primary key, else the replica identity index (unique, not partial, columns NOT NULL).
_KEY_SQL = """
SELECT a.attname, format_type(a.atttypid, a.atttypmod)
FROM (
    SELECT indrelid, indkey FROM pg_index
    WHERE indrelid = $1 AND (indisprimary OR indisreplident)
    ORDER BY indisprimary DESC LIMIT 1
) i
CROSS JOIN LATERAL unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord)
JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
ORDER BY k.ord
"""


async def primary_key(conn: Any, oid: int) -> list[Any]:
    """The columns of table ``oid``'s key in key order, ``(name, type)`` records: its primary
    key, else its replica identity index; none when it has neither."""
    return list(await conn.fetch(_KEY_SQL, oid))


async def row_estimate(conn: Any, table: SnapshotTable) -> tuple[int, str | None]:
    """How many rows ``table`` holds, and where that comes from: the planner's count
    (``pg_class.reltuples``, ``"statistics"``); for a table never vacuumed nor analysed
    (reltuples -1 on 14+), its size (its partitions' for a partitioned table) over the width of
    a sample of its first rows (``"size"``: dead rows and free space count as rows, so it
    errs high); ``(0, None)`` when neither says anything (rows in no block read)."""
    oid = table.relation.oid
    reltuples = float(await conn.fetchval(_RELTUPLES_SQL, oid))
    if reltuples >= 0:
        return int(reltuples), "statistics"
    blocks, block_size = await conn.fetchrow(_BLOCKS_SQL, oid)
    if not blocks:
        return 0, "size"
    rel = table.relation
    width = await conn.fetchval(
        f"SELECT avg(pg_column_size(s.*)) FROM (SELECT * FROM "
        f"{quote_ident(rel.namespace)}.{quote_ident(rel.name)} LIMIT {_SAMPLE_ROWS}) s"
    )
    if not width:
        return 0, None
    # a heap tuple: the row as a composite datum (its header included), a line pointer, and
    # alignment to 8 bytes; a page: its 24-byte header
    per_block = (int(block_size) - 24) // (math.ceil((float(width) + 4) / 8) * 8)
    return int(blocks) * max(per_block, 1), "size"


_RELTUPLES_SQL = "SELECT reltuples::float8 FROM pg_class WHERE oid = $1"
_BLOCKS_SQL = """
SELECT ((pg_relation_size($1::oid::regclass) + coalesce((
            SELECT sum(pg_relation_size(relid)) FROM pg_partition_tree($1::oid::regclass)
            WHERE isleaf AND relid <> $1::oid::regclass), 0))
        / current_setting('block_size')::int8)::int8,
       current_setting('block_size')::int8
"""
#: rows whose width stands for the table's when it has no statistics
_SAMPLE_ROWS = 1000


def chunk_sql(
    table: SnapshotTable,
    keys: list[tuple[str, str]],
    after: list[str] | None,
    limit: int,
    upto: list[str] | None = None,
    select: str | None = None,
) -> str:
    """Keyset pagination: the rows after the key ``after``, up to the key ``upto`` or else the
    next ``limit``, in key order (as literals: COPY takes no parameters)."""
    rel = table.relation
    # the columns as they are (see chunk_query), aliased: ORDER BY names the table's columns
    if select is None:
        select = ", ".join(f"{quote_ident(c.name)} AS c{i}" for i, c in enumerate(rel.columns))
    cols = ", ".join(quote_ident(k) for k, _ in keys)
    sql = f"SELECT {select} FROM {quote_ident(rel.namespace)}.{quote_ident(rel.name)}"
    where = []
    if after is not None:
        where.append(f"({cols}) > ({_key_literal(keys, after)})")
    if upto is not None:
        where.append(f"({cols}) <= ({_key_literal(keys, upto)})")
    if table.row_filter:
        where.append(f"({table.row_filter})")
    if where:
        sql += " WHERE " + " AND ".join(where)
    return sql + f" ORDER BY {cols}" + ("" if upto is not None else f" LIMIT {int(limit)}")


def _key_literal(keys: list[tuple[str, str]], values: list[Any]) -> str:
    return ", ".join(f"{quote_literal(v)}::{t}" for v, (_, t) in zip(values, keys, strict=True))


async def next_bound(
    conn: Any, table: SnapshotTable, keys: list[tuple[str, str]], after: Any, rows: int
) -> list[str | None] | None:
    """The key ``rows`` rows after ``after`` (the last key of the next chunk), from the key's
    index alone; None when fewer rows follow (the next chunk is the last)."""
    select = ", ".join(f"{quote_ident(k)}::text AS k{i}" for i, (k, _) in enumerate(keys))
    sql = chunk_sql(table, keys, after, 1, select=select).replace(
        " LIMIT 1", f" OFFSET {int(rows) - 1} LIMIT 1"
    )
    record = await conn.fetchrow(sql)
    return None if record is None else list(record)


async def read_key_chunk(
    conn: Any,
    table: SnapshotTable,
    keys: list[tuple[str, str]],
    after: list[str] | None,
    limit: int,
    upto: list[str] | None = None,
    seal: Callable[[list[CopyBatch], int, str, int], tuple[str, str]] | None = None,
    batch_size: int = 5000,
    low: tuple[str, str] | None = None,
) -> tuple[list[CopyBatch], int, bool, int]:
    """A chunk of an incremental snapshot (:func:`chunk_sql`), read with COPY (docs/snapshots.md:
    faster than a SELECT): its rows in batches of about ``batch_size`` left as COPY's text
    (:func:`copy_batches`: no object per row until something asks), how many, whether
    ``table``'s columns are no longer all there as described (an ALTER TABLE since it was
    described; then nothing is read), and the rows' accounted bytes
    (:func:`cdcd.source.copy.accounted`). ``seal(batches, rows, snapshot, bytes)``, called once
    the rows are read with the snapshot they were read at (``pg_current_snapshot()``: the
    watermarks drop rows of transactions it does not see, :mod:`cdcd.snapshot.watermarks`),
    returns a logical message ``(prefix, content)`` written in the read's transaction and
    committed with it: the chunk's high watermark, at one round trip and one commit less than a
    transaction of its own. ``low``, a logical message ``(prefix, content)`` (the chunk's low
    watermark), is written and committed first, in the round trip of the BEGIN: one round
    trip less than a query of its own.

    Four round trips: BEGIN with the lock (the lock first, then the snapshot: a table rewrite
    committed while the lock waited would otherwise look empty to an older snapshot), the
    snapshot with the table's shape (read under the lock, which keeps an ALTER from coming
    between it and the COPY), the COPY, the watermark with COMMIT."""
    batches: list[CopyBatch] = []
    size = 0

    async def take(batch: CopyBatch, batch_bytes: int) -> None:
        nonlocal size
        batches.append(batch)
        size += batch_bytes

    rel = table.relation
    begin = (
        "BEGIN ISOLATION LEVEL REPEATABLE READ; "
        f"LOCK TABLE {quote_ident(rel.namespace)}.{quote_ident(rel.name)} IN ACCESS SHARE MODE"
    )
    if low is not None:  # committed before the read's transaction begins, as if on its own
        begin = f"BEGIN; {_message_sql(*low)}; COMMIT; {begin}"
    count = 0
    try:
        try:
            await conn.execute(begin)
        except (asyncpg.ReadOnlySQLTransactionError, asyncpg.InsufficientPrivilegeError) as exc:
            if low is not None and (  # the message's, not the lock's
                isinstance(exc, asyncpg.ReadOnlySQLTransactionError)
                or "pg_logical_emit_message" in str(exc)
            ):
                raise emit_refused(exc, "incremental snapshot watermark") from exc
            raise
        snapshot, shape = await conn.fetchrow(_SNAPSHOT_SHAPE_SQL, rel.oid)
        # every column, published or not: a column added since the table was described is not
        # among the published columns described, and would be missing from the chunk's rows
        # (without the table's whole shape, the published columns must all be there still)
        altered = (
            tuple(shape) != table.shape
            if table.shape is not None
            else not set(relation_shape(rel)) <= set(shape)
        )
        mark = None
        if not altered:
            sql = chunk_sql(table, keys, after, limit, upto)
            count = await copy_batches(conn, sql, len(rel.columns), take, batch_size)
            if seal is not None:
                mark = seal(batches, count, str(snapshot), size)
        if mark is None:
            await conn.execute("COMMIT")
        else:
            await conn.execute(f"{_message_sql(*mark)}; COMMIT")
    except Exception:
        if not conn.is_closed() and conn.is_in_transaction():
            with contextlib.suppress(Exception):  # a lost connection: closed by the caller
                await conn.execute("ROLLBACK")
        raise
    return batches, count, altered, size


def _message_sql(prefix: str, content: str) -> str:
    """A statement that writes a transactional logical message."""
    return (
        f"SELECT pg_logical_emit_message(true, {quote_literal(prefix)}, {quote_literal(content)})"
    )


_SNAPSHOT_SHAPE_SQL = """
SELECT pg_current_snapshot()::text,
       coalesce(array_agg(format('%s %s %s', attname, atttypid, atttypmod) ORDER BY attnum), '{}')
FROM pg_attribute WHERE attrelid = $1 AND attnum > 0 AND NOT attisdropped
"""


def relation_shape(relation: Relation) -> list[str]:
    """``name type typmod`` per column of ``relation``, as :data:`_SNAPSHOT_SHAPE_SQL` gives them."""
    return [f"{c.name} {c.type_oid} {c.typmod}" for c in relation.columns]


async def key_problem(conn: Any, table: SnapshotTable, keys: list[tuple[str, str]]) -> str | None:
    """Why keyset pagination cannot page through ``table`` by its primary key ``keys``
    (``(name, type)``), or None. A primary key's index uses its types' default btree operator
    classes (PostgreSQL refuses any other), so ORDER BY always works; the comparison
    ``(key) > (last key)`` also needs that class's operators to be named ``<`` and ``>``,
    which a user-defined class need not do (docs/snapshots.md)."""
    rel = table.relation
    cols = ", ".join(quote_ident(k) for k, _ in keys)
    nulls = ", ".join(f"NULL::{t}" for _, t in keys)
    try:
        await conn.prepare(
            f"SELECT 1 FROM {quote_ident(rel.namespace)}.{quote_ident(rel.name)} "
            f"WHERE ({cols}) > ({nulls}) ORDER BY {cols} LIMIT 0"
        )
    except asyncpg.UndefinedFunctionError as exc:
        key = ", ".join(f"{k} {t}" for k, t in keys)
        return (
            f"its primary key ({key}) cannot be paged through in key order ({exc}): the "
            "default btree operator class of the key's type must name its operators < and >; "
            "snapshot the table with snapshot.mode: initial instead"
        )
    return None
