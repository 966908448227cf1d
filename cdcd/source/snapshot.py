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
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg

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


@dataclass(frozen=True, slots=True)
class SnapshotTable:
    relation: Relation
    row_filter: str | None


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
    """Where the incremental snapshot keeps its progress (``cdcd.pipeline.incremental``)."""
    return state_dir / f"{slot}.incremental.json"


def streamed_before(state_dir: Path, slot: str) -> Path | None:
    """The state file that shows cdcd streamed from ``slot`` before (a finished initial
    snapshot, or the incremental snapshot's state), None when there is none or an initial
    snapshot is still unfinished (then a new slot is expected)."""
    snapshot = SnapshotState(state_dir, slot)
    if snapshot.running():
        return None
    for path in (snapshot.path, incremental_state_path(state_dir, slot)):
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


_PRIMARY_KEY_SQL = """
SELECT a.attname, format_type(a.atttypid, a.atttypmod)
FROM pg_index i
CROSS JOIN LATERAL unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord)
JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
WHERE i.indrelid = $1 AND i.indisprimary
ORDER BY k.ord
"""


async def primary_key(conn: Any, oid: int) -> list[Any]:
    """The primary key's columns of table ``oid`` in key order: ``(name, type)`` records."""
    return list(await conn.fetch(_PRIMARY_KEY_SQL, oid))


async def row_estimate(conn: Any, oid: int) -> int:
    """The planner's row count of table ``oid`` (``pg_class.reltuples``; -1 before the first
    VACUUM or ANALYZE on 14+, read as 0)."""
    return max(
        int(await conn.fetchval("SELECT reltuples::int8 FROM pg_class WHERE oid = $1", oid)), 0
    )


def chunk_sql(table: SnapshotTable, keys: list[tuple[str, str]], after: Any) -> str:
    """Keyset pagination: the next ``$1`` rows after the key ``$2..`` in key order."""
    rel = table.relation
    # aliased: ORDER BY a name of the select list would sort by its text
    select = ", ".join(f"{quote_ident(c.name)}::text AS c{i}" for i, c in enumerate(rel.columns))
    cols = ", ".join(quote_ident(k) for k, _ in keys)
    sql = f"SELECT {select} FROM {quote_ident(rel.namespace)}.{quote_ident(rel.name)}"
    where = []
    if after is not None:
        params = ", ".join(f"${i + 2}::text::{t}" for i, (_, t) in enumerate(keys))
        where.append(f"({cols}) > ({params})")
    if table.row_filter:
        where.append(f"({table.row_filter})")
    if where:
        sql += " WHERE " + " AND ".join(where)
    return sql + f" ORDER BY {cols} LIMIT $1"


async def key_problem(conn: Any, table: SnapshotTable, keys: list[tuple[str, str]]) -> str | None:
    """Why keyset pagination cannot page through ``table`` by its primary key ``keys``
    (``(name, type)``), or None. A primary key's index uses its types' default btree operator
    classes (PostgreSQL refuses any other), so ORDER BY always works; the comparison
    ``(key) > (last key)`` also needs that class's operators to be named ``<`` and ``>``,
    which a user-defined class need not do (README "Incremental snapshots")."""
    try:
        await conn.prepare(chunk_sql(table, keys, [None] * len(keys)))
    except asyncpg.UndefinedFunctionError as exc:
        key = ", ".join(f"{k} {t}" for k, t in keys)
        return (
            f"its primary key ({key}) cannot be paged through in key order ({exc}): the "
            "default btree operator class of the key's type must name its operators < and >; "
            "snapshot the table with snapshot.mode: initial instead"
        )
    return None


_SHAPE_SQL = """
SELECT coalesce(array_agg(format('%I %s', attname, format_type(atttypid, atttypmod))
                          ORDER BY attnum), '{}')
FROM pg_attribute WHERE attrelid = $1 AND attnum > 0 AND NOT attisdropped
"""


async def table_shape(conn: Any, oid: int) -> list[str]:
    """The columns of table ``oid``, ``name type`` in order: compared before and after a
    chunk is read, to notice an ALTER TABLE."""
    return list(await conn.fetchval(_SHAPE_SQL, oid))
