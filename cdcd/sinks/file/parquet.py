"""Parquet files for the file sink (``format: parquet``): the change event with native types.

One Parquet file holds the events of one table with one set of columns (the file sink rolls
to a new file when a table's columns change, ``roll_on_schema_change``; Spark reads a folder
with ``mergeSchema``). Names, atomic publication, rollover and recovery are the file sink's
(:mod:`cdcd.sinks.file.sink`); this module only turns events into rows.

Row schema (the JSON event's fields, docs/events.md)::

    op           string
    before       struct<columns>          null when the server sent no old row
    after        struct<columns>
    source       struct<version, connector, name, db, schema, table: string,
                        ts_ms, ts_us: int64, snapshot: string, txId: int64, lsn: int64,
                        sequence: string, xmin: int64, commit_lsn: int64, seq: int64,
                        origin: string, unchanged_toast: list<string>,
                        truncate: struct<cascade: bool, restart_identity: bool>,
                        old_key, new_key: struct<key columns>>   (only with key columns)
    ts_ms        int64
    transaction  struct<id: string, total_order: int64, data_collection_order: int64>
    key          struct<key columns>      only when the table has key columns
    unrepresentable  map<string, string>  see below; null on most rows

Column types (:func:`column_type`): int2/int4/int8 → int16/int32/int64; oid, xid, cid, xid8
→ int64; float4/float8 → float32/float64 (NaN and ±Infinity are floats); numeric(p, s) with
0 <= s <= p <= 38 → decimal128(p, s), any other numeric → string (its exact decimal text);
money → decimal128(19, 2); bool → bool; bytea → binary; date → date32; time → time64(us);
timestamp → timestamp(us); timestamptz → timestamp(us, UTC); arrays → list<element type>;
domains → their base type's; everything else (text types, uuid, enum, json, jsonb, inet,
interval as ISO-8601, timetz, ranges, unknown types) → string, the same text as in JSON.

Lossless by a sidecar. A value that has no native form in its column's type (numeric NaN or
±Infinity in a decimal column, date/timestamp ±infinity, BC or after 9999, time 24:00:00, an
array with lower bounds other than 1 or more than one dimension) is stored as null in its
column, and its JSON value (as JSON text, exactly what the JSON Lines file carries) goes into
``unrepresentable`` under ``"before.<column>"`` / ``"after.<column>"``. A reader that needs
every value coalesces the two; a reader that does not care sees a null. Unchanged TOAST
values are null, as in the native rows, and listed in ``source.unchanged_toast``.

``source.old_key`` / ``source.new_key`` have the type of ``key`` and are null except on the two
events of a key change (the delete carries ``new_key``, the create ``old_key``, docs/events.md); a
table without key columns has neither field (its updates never change a key).

The Arrow schema's metadata ``cdcd.schema`` carries the table's columns (the ``_schema`` file
document). Events are buffered, converted column by column (:mod:`cdcd.sinks.file.parquet_columns`;
:meth:`RowLayout.batch` is the value-by-value reference it equals) and written in row groups
of ``ROW_GROUP_ROWS``.
"""

from __future__ import annotations

import contextlib
import datetime as dt
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import orjson
import pyarrow as pa
import pyarrow.parquet as pq

from cdcd.decoder.events import Relation
from cdcd.errors import DefiniteSinkError
from cdcd.sinks.file.layout import Position, TableWriter, sync_and_release
from cdcd.sinks.file.parquet_columns import ColumnBuilder, as_text, has_none, lost
from cdcd.values.types import TypeInfo, TypeRegistry

if TYPE_CHECKING:
    from cdcd.events import ChangeEvent
    from cdcd.sinks.file.config import FileSinkConfig

ROW_GROUP_ROWS = 65_536
#: events kept before a column-wise conversion (bounds the Python objects a writer holds).
#: Kept well under the cyclic GC's young-generation threshold (50,000 allocations,
#: cdcd.runtime.tune_gc) in objects: at 16,384 events (3-4 tracked objects each) the events
#: held survived every young collection, which then re-traversed them, 17 % of W1's CPU
#: (63 collections, 3.2 s); at 4,096 there were 8 (0.08 s).
CONVERT_ROWS = 4096
_ROW_BYTES_GUESS = 256
#: with a memory budget: events converted first, to learn the bytes per row
FIRST_CONVERT_ROWS = 1024
# Arrow's default pool (mimalloc) keeps freed buffers for reuse, so row groups written long
# ago still count in the process's RSS (about 40 MB more in a W3-style run at a 32 MiB
# buffer.memory_limit); the system allocator gives them back, which keeps the sink within its
# memory_budget (docs/guarantees.md). This is the pool of pyarrow's Python calls (building the
# batches); the Parquet writer's own buffers come from the C++ default, which the package sets
# (cdcd/sinks/file/__init__.py).
pa.set_memory_pool(pa.system_memory_pool())
#: Row groups are encoded and compressed here (Arrow releases the GIL meanwhile), so decoding
#: the next events overlaps with writing the previous ones. One thread: FIFO for all files.
_ROW_GROUP_WRITER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cdcd-parquet")
MAX_DECIMAL_PRECISION = 38

Fits = Callable[[Any], bool]

_INT_TYPES: dict[int, pa.DataType] = {
    21: pa.int16(),
    23: pa.int32(),
    20: pa.int64(),
    26: pa.int64(),  # oid
    28: pa.int64(),  # xid
    29: pa.int64(),  # cid
    5069: pa.int64(),  # xid8
}
_SCALARS: dict[int, pa.DataType] = {
    **_INT_TYPES,
    700: pa.float32(),
    701: pa.float64(),
    16: pa.bool_(),
    17: pa.binary(),
    1082: pa.date32(),
    1083: pa.time64("us"),
    1114: pa.timestamp("us"),
    1184: pa.timestamp("us", tz="UTC"),
    790: pa.decimal128(19, 2),  # money
}
_NUMERIC_OID = 1700
#: types whose native converter gives None for values it cannot represent (±infinity, BC, ...)
_NONE_WHEN_UNREPRESENTABLE = frozenset({1082, 1083, 1114, 1184})

SOURCE_TYPE = pa.struct(
    [
        ("version", pa.string()),
        ("connector", pa.string()),
        ("name", pa.string()),
        ("db", pa.string()),
        ("schema", pa.string()),
        ("table", pa.string()),
        ("ts_ms", pa.int64()),
        ("ts_us", pa.int64()),
        ("snapshot", pa.string()),
        ("txId", pa.int64()),
        ("lsn", pa.int64()),
        ("sequence", pa.string()),
        ("xmin", pa.int64()),
        ("commit_lsn", pa.int64()),
        ("seq", pa.int64()),
        ("origin", pa.string()),
        ("unchanged_toast", pa.list_(pa.string())),
        ("truncate", pa.struct([("cascade", pa.bool_()), ("restart_identity", pa.bool_())])),
    ]
)
#: The source fields that repeat a few values across a file, written with dictionary encoding
#: like ``op``. Every other column is plain-encoded (and compressed): dictionary encoding of a
#: column with many distinct values builds a 1 MiB dictionary, then falls back to plain anyway,
#: which cost W1 0.9 us per row and made its files 60 % larger (docs/files.md).
DICTIONARY_SOURCE_FIELDS = frozenset(
    {"version", "connector", "name", "db", "schema", "table", "snapshot", "origin"}
)
TRANSACTION_TYPE = pa.struct(
    [("id", pa.string()), ("total_order", pa.int64()), ("data_collection_order", pa.int64())]
)


def _link_fields(key_type: pa.DataType) -> list[pa.Field]:
    """``source.old_key`` and ``source.new_key`` of a table with key columns."""
    return [pa.field("old_key", key_type), pa.field("new_key", key_type)]


# --- type mapping ----------------------------------------------------------------------------


def _resolve(registry: TypeRegistry, oid: int) -> TypeInfo | None:
    """The type behind any chain of domains."""
    info = registry.info(oid)
    for _ in range(32):
        if info is None or info.category != "d" or not info.base_oid:
            return info
        info = registry.info(info.base_oid)
    return info


def _is_array(info: TypeInfo) -> bool:
    return info.elem_oid != 0 and info.category in ("b", "?")


def _scalar_type(registry: TypeRegistry, oid: int, typmod: int) -> pa.DataType:
    info = _resolve(registry, oid)
    if info is None:
        return pa.string()
    if info.oid == _NUMERIC_OID:
        ps = registry.numeric_precision_scale(typmod)
        if ps is not None and 0 <= ps[1] <= ps[0] <= MAX_DECIMAL_PRECISION:
            return pa.decimal128(*ps)
        return pa.string()
    return _SCALARS.get(info.oid, pa.string())


def column_type(registry: TypeRegistry, oid: int, typmod: int) -> pa.DataType:
    """The Arrow type of a column of type ``oid`` with attribute ``typmod``."""
    info = _resolve(registry, oid)
    if info is not None and _is_array(info):
        # an array column's typmod is its element's (numeric(10,2)[])
        return pa.list_(_scalar_type(registry, info.elem_oid, typmod))
    return _scalar_type(registry, oid, typmod)


def _base_oid(registry: TypeRegistry, oid: int) -> int:
    info = _resolve(registry, oid)
    if info is None:
        return oid
    if _is_array(info):
        return _base_oid(registry, info.elem_oid)
    return info.oid


def _fits(t: pa.DataType) -> Fits | None:
    """A check that a native value can be stored in ``t``; None when anything goes (strings)."""
    if pa.types.is_list(t):
        elem = _fits(t.value_type)
        return lambda v: (
            isinstance(v, list)
            and all(x is None or (not isinstance(x, list) and (elem is None or elem(x))) for x in v)
        )
    if pa.types.is_decimal(t):
        scale = t.scale
        return lambda v: (
            isinstance(v, Decimal) and v.is_finite() and v.as_tuple().exponent >= -scale
        )
    if pa.types.is_timestamp(t):
        aware = t.tz is not None
        return lambda v: isinstance(v, dt.datetime) and (v.tzinfo is not None) == aware
    if pa.types.is_date(t):
        return lambda v: isinstance(v, dt.date) and not isinstance(v, dt.datetime)
    if pa.types.is_time(t):
        return lambda v: isinstance(v, dt.time)
    if pa.types.is_integer(t):
        return lambda v: isinstance(v, int) and not isinstance(v, bool)
    if pa.types.is_floating(t):
        return lambda v: isinstance(v, float | int) and not isinstance(v, bool)
    if pa.types.is_boolean(t):
        return lambda v: isinstance(v, bool)
    if pa.types.is_binary(t):
        return lambda v: isinstance(v, bytes | bytearray | memoryview)
    return None


@dataclass(frozen=True, slots=True)
class _Column:
    name: str
    type: pa.DataType
    fits: Fits | None  # None: a string column, values go through as_text
    none_may_hide: bool  # the native converter yields None for unrepresentable values
    oid: int  # the column's type OID and typmod, as in the Relation message
    typmod: int
    resolved: int  # the OID behind domains (arrays: the element's)


class RowLayout:
    """The Arrow schema of one table's events, and the conversion of events to a batch."""

    def __init__(
        self,
        relation: Relation,
        registry: TypeRegistry,
        key_names: Sequence[str] | None,
        schema_info: dict[str, Any] | None = None,
    ) -> None:
        self.columns = tuple(
            _Column(
                c.name,
                t := column_type(registry, c.type_oid, c.typmod),
                _fits(t),
                (base := _base_oid(registry, c.type_oid)) in _NONE_WHEN_UNREPRESENTABLE,
                c.type_oid,
                c.typmod,
                base,
            )
            for c in relation.columns
        )
        self.registry = registry
        by_name = {c.name: c for c in self.columns}
        self.key_names = tuple(k for k in key_names or () if k in by_name)
        self.row_type = pa.struct([(c.name, c.type) for c in self.columns])
        self.key_type = pa.struct([(k, by_name[k].type) for k in self.key_names])
        self.source_type = SOURCE_TYPE
        if self.key_names:
            self.source_type = pa.struct([*SOURCE_TYPE, *_link_fields(self.key_type)])
        self.source_fields = tuple(f.name for f in self.source_type)
        self._by_name = by_name
        fields: list[pa.Field] = [
            pa.field("op", pa.string()),
            pa.field("before", self.row_type),
            pa.field("after", self.row_type),
            pa.field("source", self.source_type),
            pa.field("ts_ms", pa.int64()),
            pa.field("transaction", TRANSACTION_TYPE),
        ]
        if self.key_names:
            fields.append(pa.field("key", self.key_type))
        fields.append(pa.field("unrepresentable", pa.map_(pa.string(), pa.string())))
        metadata = {"cdcd.schema": orjson.dumps(schema_info)} if schema_info else None
        self.schema = pa.schema(fields, metadata=metadata)
        #: the columns written with dictionary encoding (docs/files.md)
        self.dictionary_columns = [
            "op",
            *(f"source.{f.name}" for f in self.source_type if f.name in DICTIONARY_SOURCE_FIELDS),
        ]

    @classmethod
    def for_event(cls, event: ChangeEvent, relation: Relation | None = None) -> RowLayout:
        relation = relation or event.relation
        catalog = event.catalog
        if relation is None or catalog is None:
            raise DefiniteSinkError(
                f"parquet: event at {event.position} has no table (logical messages are "
                "written as JSON Lines)"
            )
        return cls(relation, catalog.types, event.key_names, event.schema_info())

    def _row(
        self,
        event: ChangeEvent,
        which: Literal["before", "after"],
        sidecar: list[tuple[str, str]],
        skip: Sequence[str],
    ) -> dict[str, Any] | None:
        native = event.native_row(which)
        if native is None:
            return None
        row: dict[str, Any] = {}
        json_row: dict[str, Any] | None = None
        for col in self.columns:
            v = native.get(col.name)
            bad = False
            if col.fits is None:
                v = as_text(v)
            elif v is not None and not col.fits(v):
                bad = True
            if (bad or (col.none_may_hide and has_none(v))) and col.name not in skip:
                if json_row is None:
                    json_row = event.value()[which] or {}
                j = json_row.get(col.name)
                if bad or lost(v, j):
                    sidecar.append((f"{which}.{col.name}", orjson.dumps(j).decode()))
                    v = None
            row[col.name] = v
        return row

    def linked_key(self, event: ChangeEvent) -> tuple[str, dict[str, Any]] | None:
        """``("old_key" | "new_key", key)`` with the key's values as the ``key`` column holds
        them, for the two events of a key change (see :meth:`ChangeEvent.key_link`)."""
        link = event.key_link(native=True)
        if link is None or not self.key_names:
            return None
        name, native = link
        key: dict[str, Any] = {}
        for k in self.key_names:
            col, v = self._by_name[k], native.get(k)
            if col.fits is None:
                v = as_text(v)
            elif v is not None and not col.fits(v):
                v = None  # as in ``key``: the value has no native form (the sidecar has it)
            key[k] = v
        return name, key

    def record(self, event: ChangeEvent) -> dict[str, Any]:
        """One event as a row (a dict matching :attr:`schema`)."""
        sidecar: list[tuple[str, str]] = []
        unchanged = event.unchanged_toast() if event.op in ("c", "u", "r") else []
        before = self._row(event, "before", sidecar, ())
        after = self._row(event, "after", sidecar, unchanged)
        source = event.source()
        record: dict[str, Any] = {
            "op": event.op,
            "before": before,
            "after": after,
            "source": {name: source.get(name) for name in self.source_fields},
            "ts_ms": event.ts_ms,
            "transaction": event.transaction(),
            "unrepresentable": sidecar or None,
        }
        if self.key_names:
            record["source"]["old_key"] = record["source"]["new_key"] = None
            link = self.linked_key(event)
            if link is not None:
                record["source"][link[0]] = link[1]
            row = after if after is not None else before
            record["key"] = (
                None if row is None or event.op == "t" else {k: row[k] for k in self.key_names}
            )
        return record

    def batch(self, events: Sequence[ChangeEvent]) -> pa.RecordBatch:
        rows = [self.record(e) for e in events]
        try:
            return pa.RecordBatch.from_pylist(rows, schema=self.schema)
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError) as exc:
            first = events[0].position
            raise DefiniteSinkError(
                f"parquet: cannot convert events from position {first} of "
                f"{events[0].schema}.{events[0].table} to Arrow: {exc}"
            ) from exc


# --- the writer ------------------------------------------------------------------------------


class ParquetTableWriter(TableWriter):
    """One Parquet file of one table's events (the file sink's ``TableWriter``).

    Events are kept as they come (a file sink calls ``write`` once per transaction or batch,
    often with a handful of events) and converted column-wise (:class:`ColumnBuilder`) every
    ``CONVERT_ROWS`` events and when the file is finished; the converted batches are written
    as one row group every ``ROW_GROUP_ROWS`` rows, by a writer thread (``finish`` waits for
    it). Nothing is durable before ``finish`` anyway: the file is published, and its events
    made durable, only after it.
    """

    suffix: ClassVar[str] = ".parquet"
    roll_on_schema_change: ClassVar[bool] = True

    def __init__(self, path: Path, relation: Relation | None, config: FileSinkConfig) -> None:
        super().__init__(path, relation, config)
        self._file = path.open("wb")
        self._writer: pq.ParquetWriter | None = None
        self._layout: RowLayout | None = None
        self._builder: ColumnBuilder | None = None
        self._events: list[ChangeEvent] = []
        self._pending: list[pa.RecordBatch] = []
        self._pending_rows = 0
        self._pending_bytes = 0
        self._row_bytes = _ROW_BYTES_GUESS  # Arrow bytes per row of the last converted batch
        self._measured = False  # _row_bytes is from a converted batch
        self._written = 0  # bytes in the file after the last row group written
        self._inflight: Future[None] | None = None  # the row group the writer thread writes
        self._inflight_bytes = 0

    @property
    def layout(self) -> RowLayout | None:
        return self._layout

    def write(self, events: Sequence[ChangeEvent]) -> None:
        if not events:
            return
        if self._layout is None:
            self._layout = RowLayout.for_event(events[0], self.relation)
            self._builder = ColumnBuilder(self._layout, self._layout.registry)
            self._writer = pq.ParquetWriter(
                self._file,
                self._layout.schema,
                compression=self.config.compression,
                use_dictionary=self._layout.dictionary_columns,
            )
        self._events.extend(events)
        self.rows += len(events)
        held = len(self._events)
        if held >= CONVERT_ROWS or self._over_budget(held * self._row_bytes, held):
            self._convert()

    def _convert(self) -> None:
        events, self._events = self._events, []
        if not events or self._builder is None:
            return
        batch = self._builder.batch(events)
        self._pending.append(batch)
        self._pending_rows += batch.num_rows
        self._pending_bytes += batch.nbytes
        self._row_bytes = max(1, batch.nbytes // batch.num_rows)
        self._measured = True
        if self._pending_rows >= ROW_GROUP_ROWS or self._over_budget(self._pending_bytes, 0):
            self._write_pending()

    def _write_pending(self) -> None:
        """Hand the converted batches to the writer thread as one row group; at most one row
        group of a file is in flight (bounded memory, and row groups stay in order)."""
        if self._pending and self._writer is not None:
            table = pa.Table.from_batches(self._pending)
            self._wait()
            self._inflight = _ROW_GROUP_WRITER.submit(self._writer.write_table, table)
            self._inflight_bytes = self._pending_bytes
        self._pending = []
        self._pending_rows = 0
        self._pending_bytes = 0

    def _wait(self) -> None:
        """Wait for the row group in flight; its error (an OSError from the file) is raised."""
        inflight, self._inflight = self._inflight, None
        if inflight is not None:
            inflight.result()
            self._written = self._file.tell()
            self._inflight_bytes = 0

    def _over_budget(self, held: int, events: int) -> bool:
        """Whether ``held`` bytes (events not yet converted, or converted batches not yet
        written) pass a quarter of the memory budget: with the row group in flight and the
        conversion under way, the writer then stays within its budget. Until a first
        conversion tells the bytes per row, ``FIRST_CONVERT_ROWS`` events are enough."""
        budget = self.memory_budget
        if budget is None:
            return False
        return held * 4 >= budget or (not self._measured and events >= FIRST_CONVERT_ROWS)

    def buffered(self) -> int:
        return self._inflight_bytes + self._pending_bytes + len(self._events) * self._row_bytes

    def size(self) -> int:
        return (
            self._written
            + self._inflight_bytes
            + self._pending_bytes
            + len(self._events) * self._row_bytes
        )

    def finish(self) -> None:
        self._convert()
        self._write_pending()
        self._wait()
        if self._writer is not None:
            self._writer.close()
        self._file.flush()
        if self.config.fsync:
            sync_and_release(self._file.fileno())
        self._file.close()

    def discard(self) -> None:
        self._events = []
        try:
            with contextlib.suppress(Exception):  # the file is deleted anyway
                self._wait()
            if self._writer is not None:
                self._writer.close()
        finally:
            self._file.close()
            self.path.unlink(missing_ok=True)

    @classmethod
    def last_position(cls, path: Path) -> Position:
        try:
            pf = pq.ParquetFile(path)
            last = pf.metadata.num_row_groups - 1
            source = pf.read_row_group(last, columns=["source"]).column("source")
            row = source[len(source) - 1].as_py()
            return int(row["commit_lsn"]), int(row["seq"])
        except (OSError, pa.ArrowException, KeyError, TypeError, ValueError, IndexError) as exc:
            raise DefiniteSinkError(
                f"file sink: cannot read the last event position of {path}: {exc}"
            ) from exc
