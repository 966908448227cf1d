"""The column-wise Parquet conversion gives exactly the row path's batch (RowLayout.batch).

Random rows over many types, with the values that have no native form (NaN, ±infinity, BC,
year 10000, 24:00:00, odd array bounds), NULLs, unchanged TOAST (filled from an old image or
not), binary values, key and full old images, key changes, deletes, truncates and snapshot
events: ``ColumnBuilder.batch`` must equal ``RowLayout.batch`` value for value, sidecar
included. Then the writer: runs across conversion and row-group boundaries read back equal.
"""

from __future__ import annotations

import random
import struct
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cdcd import __version__
from cdcd.decoder.events import (
    KIND_BINARY,
    KIND_NULL,
    KIND_TEXT,
    KIND_UNCHANGED_TOAST,
    Column,
    Relation,
    TupleData,
)
from cdcd.events import ChangeEvent
from cdcd.events.encoder import Encoder
from cdcd.sinks.file import parquet, parquet_columns
from cdcd.sinks.file.parquet import RowLayout
from cdcd.sinks.file.parquet_columns import ColumnBuilder
from cdcd.sinks.file.sink import FileSink, FileSinkConfig
from cdcd.values.types import TypeInfo
from tests.unit.sink_fixtures import CONTEXT, TxnBuilder, encoder


def numeric(precision: int, scale: int) -> int:
    return ((precision << 16) | (scale & 0x7FF)) + 4


U = object()  # unchanged TOAST
B = "binary"  # marks a (kind, bytes) pair given in binary
TS = ["2024-01-01 10:00:00+00", "2024-02-29 23:59:59.123456+00", "1999-12-31 00:00:00.5+00"]

#: (name, type oid, typmod, text values to draw from; a tuple (B, bytes) is a binary value)
TYPES: list[tuple[str, int, int, list[Any]]] = [
    ("id", 23, -1, []),  # the key: filled with the row number
    ("i2", 21, -1, ["0", "-32768", "32767", "7", "007"]),
    ("i8", 20, -1, ["9223372036854775807", "-1", "42", (B, struct.pack(">q", -5))]),
    ("o", 26, -1, ["4294967295", "0"]),
    ("f4", 700, -1, ["1.1", "3.4028235e+38", "NaN", "-Infinity", "1e-45", "-0"]),
    ("f8", 701, -1, ["0.1", "1e+308", "Infinity", "NaN", "-0", (B, struct.pack(">d", 2.5))]),
    ("n", 1700, numeric(10, 2), ["12.50", "-0.01", "99999999.99", "0.00", "NaN", "Infinity"]),
    ("n0", 1700, numeric(5, 0), ["12345", "-1", "0"]),
    ("nu", 1700, -1, ["0.0000001", "123", "-1.50", "NaN", "-Infinity", "1" * 60]),
    ("nbig", 1700, numeric(50, 2), ["1.25", "NaN"]),
    ("m", 790, -1, ["$1,234.56", "-$0.01"]),
    ("b", 16, -1, ["t", "f", (B, b"\x01")]),
    ("t", 25, -1, ["", "héllo", "a,b", "NULL", "x" * 300]),
    ("vc", 1043, 14, ["abc"]),
    ("u", 2950, -1, ["a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"]),
    ("j", 3802, -1, ['{"a": 1}', "[]", "null"]),
    ("by", 17, -1, ["\\x00ff", "\\x"]),
    ("d", 1082, -1, ["2024-03-10", "0001-01-01", "9999-12-31", "infinity", "0044-03-15 BC"]),
    ("d2", 1082, -1, ["10000-01-01", "-infinity", "2000-02-29"]),
    ("tm", 1083, -1, ["12:30:00", "24:00:00", "00:00:00.000001"]),
    ("ts", 1114, -1, ["2024-01-01 10:00:00.5", "infinity", "0044-03-15 12:00:00 BC"]),
    ("ts2", 1114, -1, ["10000-01-01 00:00:00", "2024-01-01 00:00:00"]),
    ("tz", 1184, -1, [*TS, "infinity", "-infinity", "0044-03-15 12:00:00+00 BC"]),
    ("tz2", 1184, -1, [*TS, "2024-01-01 10:00:00+05:30", "0001-01-01 00:30:00+01"]),
    ("tz3", 1184, -1, ["9999-12-31 23:59:59.999999+00", "10000-01-01 00:00:00+00"]),
    ("iv", 1186, -1, ["P1Y2M3DT4H5M6.5S", "PT0S"]),
    ("ttz", 1266, -1, ["12:00:00.5+05:30"]),
    ("ai", 1007, -1, ["{1,NULL,3}", "{}", "[0:1]={1,2}", "{{1,2},{3,4}}"]),
    ("at", 1009, -1, ['{a,"b c",NULL}', "{}"]),
    ("an", 1231, numeric(10, 2), ["{1.50,NaN}", "{2.25}"]),
    ("atz", 1185, -1, ['{"2024-01-01 10:00:00+00",infinity}']),
    ("e", 90001, -1, ["happy", "sad"]),
    ("dom", 90002, -1, ["5", "-7"]),
    ("ddate", 90004, -1, ["2024-01-01", "infinity"]),
    ("inet", 869, -1, ["10.0.0.1/8"]),
    ("unknown", 99999, -1, ["whatever"]),
]
COLUMNS = tuple(Column(1 if name == "id" else 0, name, oid, mod) for name, oid, mod, _ in TYPES)
REL = Relation(None, 17000, "public", "many", "d", COLUMNS)
FULL = Relation(None, 17001, "public", "full", "f", COLUMNS)  # every column is key


def make_encoder() -> Encoder:
    enc = encoder()
    types = enc.catalog.types
    types.register(TypeInfo(90001, "public", "mood", "e"))
    types.register(TypeInfo(90002, "public", "posint", "d", base_oid=23))
    types.register(TypeInfo(90004, "public", "day", "d", base_oid=1082))
    return enc


def random_tuple(
    rng: random.Random, row_id: int, *, nulls: float, toast: float, key_only: bool = False
) -> TupleData:
    kinds = bytearray()
    values: list[bytes | None] = []
    for name, _oid, _mod, choices in TYPES:
        if name == "id":
            kinds.append(KIND_TEXT)
            values.append(str(row_id).encode())
            continue
        roll = rng.random()
        if key_only or roll < nulls or not choices:
            kinds.append(KIND_NULL)
            values.append(None)
        elif roll < nulls + toast:
            kinds.append(KIND_UNCHANGED_TOAST)
            values.append(None)
        else:
            choice = rng.choice(choices)
            if isinstance(choice, tuple):
                kinds.append(KIND_BINARY)
                values.append(choice[1])
            else:
                kinds.append(KIND_TEXT)
                values.append(choice.encode())
    return TupleData(bytes(kinds), tuple(values))


def random_events(seed: int, count: int, *, nulls: float = 0.1, toast: float = 0.05) -> list[Any]:
    rng = random.Random(seed)
    enc = make_encoder()
    events: list[ChangeEvent] = []
    lsn = 1_000_000
    while len(events) < count:
        origin = rng.choice([None, "up", "east"]) if seed % 3 == 0 else None
        b = TxnBuilder(rng.randrange(1, 10**6), lsn, origin=origin)
        for _ in range(rng.randrange(1, 8)):
            rel = REL if rng.random() < 0.8 else FULL
            row_id = rng.randrange(100)
            new = random_tuple(rng, row_id, nulls=nulls, toast=toast)
            old = random_tuple(rng, row_id, nulls=nulls, toast=toast / 2)
            kind = rng.random()
            if kind < 0.35:
                b.insert(rel, random_tuple(rng, row_id, nulls=nulls, toast=0))
            elif kind < 0.5:
                b.update(rel, new)
            elif kind < 0.6:
                b.update(rel, new, old, kind="O")
            elif kind < 0.7:  # key change: a delete and a create
                b.update(rel, new, random_tuple(rng, row_id + 1, nulls=0, toast=0), kind="O")
            elif kind < 0.8:
                key = random_tuple(rng, row_id + rng.randrange(2), nulls=0, toast=0, key_only=True)
                b.update(rel, new, key, kind="K")
            elif kind < 0.9:
                b.delete(rel, random_tuple(rng, row_id, nulls=0, toast=0, key_only=True), kind="K")
            elif kind < 0.97:
                b.delete(rel, old, kind="O")
            else:
                b.truncate([rel], options=rng.randrange(4))
        txn = b.build()
        lsn = txn.end_lsn + 8
        events.extend(enc.events(txn))
    if seed % 2:  # snapshot events (no transaction block) too
        rows = [random_tuple(rng, i, nulls=nulls, toast=0) for i in range(5)]
        events.extend(enc.snapshot_events(REL, rows, commit_lsn=lsn, commit_time=0, last=True))
    return events


def by_table(events: list[Any]) -> dict[str, list[Any]]:
    tables: dict[str, list[Any]] = {}
    for event in events:
        tables.setdefault(event.table, []).append(event)
    return tables


def assert_same_batch(events: list[Any]) -> pa.RecordBatch:
    layout = RowLayout.for_event(events[0])
    expected = layout.batch(events)

    def no_fallback(_: Any) -> None:
        raise AssertionError("the column-wise path handed the run to the row path")

    layout.batch = no_fallback  # type: ignore[method-assign]
    actual = ColumnBuilder(layout, layout.registry).batch(events)
    assert actual.schema.equals(expected.schema, check_metadata=True)
    # repr: NaN equals NaN, Decimal and datetime compare with their digits and zone
    for name in expected.schema.names:
        assert repr(actual.column(name).to_pylist()) == repr(expected.column(name).to_pylist()), (
            name
        )
    return actual


@pytest.fixture(params=["c", "python"])
def gather(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """How the column builder gathers a run's values into columns: cdcd._arrowcols.arrow_columns
    (C), or zip and pa.array (Python, where the C module is not in use)."""
    if request.param == "python":
        monkeypatch.setattr(parquet_columns, "_c_arrow_columns", None)
    elif parquet_columns._c_arrow_columns is None:
        pytest.skip("cdcd._arrowcols is not compiled here")
    return str(request.param)


@pytest.mark.parametrize("seed", range(12))
def test_column_wise_equals_row_wise(seed: int, gather: str) -> None:
    events = random_events(seed, 400, nulls=0.1 * (seed % 3), toast=0.04 * (seed % 4))
    for table_events in by_table(events).values():
        assert_same_batch(table_events)


def test_sidecar_entries_come_from_both_paths() -> None:
    """The random runs really exercise both the casts and the value-by-value fallback."""
    batch = assert_same_batch(by_table(random_events(3, 300))["many"])
    sidecar = [dict(r) for r in batch.column("unrepresentable").to_pylist() if r]
    names = {k for r in sidecar for k in r}
    assert {"after.d", "after.tz", "after.n", "after.ai"} <= names
    assert any(r for r in batch.column("source").to_pylist() if r["unchanged_toast"])


@pytest.mark.parametrize(
    "values",
    [
        [TS[0], TS[1], None],  # the cast
        ["2024-01-01 10:00:00+05:30"],  # timestamptz with an offset: the fallback
        ["infinity", "2024-01-01 00:00:00+00"],
    ],
)
def test_single_column_runs(values: list[str | None]) -> None:
    rel = Relation(
        None, 17002, "public", "one", "d", (Column(1, "id", 23, -1), Column(0, "v", 1184, -1))
    )
    enc = make_encoder()
    b = TxnBuilder(5, 100)
    for i, v in enumerate(values):
        raw = None if v is None else v.encode()
        kinds = bytes([KIND_TEXT, KIND_NULL if raw is None else KIND_TEXT])
        b.insert(rel, TupleData(kinds, (str(i).encode(), raw)))
    assert_same_batch(list(enc.events(b.build())))


def test_all_truncates_and_all_deletes() -> None:
    enc = make_encoder()
    b = TxnBuilder(9, 100)
    b.truncate([REL], options=1)
    b.truncate([REL], options=2)
    assert_same_batch(list(enc.events(b.build())))
    b = TxnBuilder(10, 200)
    for i in range(3):
        b.delete(REL, random_tuple(random.Random(i), i, nulls=0, toast=0, key_only=True))
    assert_same_batch(list(enc.events(b.build())))


def test_key_change_links_are_structs_of_the_key_in_both_paths() -> None:
    """``source.old_key`` / ``source.new_key``: typed like ``key``, set on the two events of a
    key change only (the row path and the column path alike)."""
    enc = make_encoder()
    rng = random.Random(5)
    b = TxnBuilder(11, 300)
    b.insert(REL, random_tuple(rng, 1, nulls=0, toast=0))
    old_key = random_tuple(rng, 1, nulls=0, toast=0, key_only=True)
    b.update(REL, random_tuple(rng, 2, nulls=0, toast=0.5), old_key, kind="K")
    b.update(REL, random_tuple(rng, 2, nulls=0, toast=0.5))
    batch = assert_same_batch(list(enc.events(b.build())))
    key_type = batch.schema.field("key").type
    source_type = batch.schema.field("source").type
    assert source_type.field("old_key").type == source_type.field("new_key").type == key_type
    links = [(s["old_key"], s["new_key"]) for s in batch.column("source").to_pylist()]
    assert links == [(None, None), (None, {"id": 2}), ({"id": 1}, None), (None, None)]
    assert [k["id"] for k in batch.column("key").to_pylist()] == [1, 1, 2, 2]


BAD_ROWS = {
    "wrong width": TupleData(bytes([KIND_TEXT]), (b"1",)),
    "invalid UTF-8": TupleData(
        bytes([KIND_TEXT] * len(TYPES)),
        tuple(b"1" if name != "t" else b"\xff" for name, *_ in TYPES),
    ),
    "decimal beyond its precision": TupleData(
        bytes([KIND_TEXT] + [KIND_NULL] * (len(TYPES) - 1)),
        (b"1", *[None] * (len(TYPES) - 1)),
    ),
}


@pytest.mark.parametrize("case", BAD_ROWS)
def test_bad_values_raise_as_the_row_path_does(case: str) -> None:
    enc = make_encoder()
    b = TxnBuilder(11, 100)
    tup = BAD_ROWS[case]
    if case == "decimal beyond its precision":  # numeric(10, 2) never sends this; Arrow refuses
        at = [name for name, *_ in TYPES].index("n")
        tup = TupleData(
            tup.kinds[:at] + bytes([KIND_TEXT]) + tup.kinds[at + 1 :],
            (*tup.values[:at], b"123456789012.50", *tup.values[at + 1 :]),
        )
    b.insert(REL, tup)
    events = list(enc.events(b.build()))
    layout = RowLayout.for_event(events[0])
    with pytest.raises(Exception) as row_path:
        layout.batch(events)
    with pytest.raises(type(row_path.value)):
        ColumnBuilder(layout, layout.registry).batch(events)


async def test_writer_across_conversion_and_row_group_boundaries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Small CONVERT_ROWS / ROW_GROUP_ROWS: many conversions and row groups in one file, and
    a batch of events that straddles them; the file reads back as the row path's rows."""
    monkeypatch.setattr(parquet, "CONVERT_ROWS", 7)
    monkeypatch.setattr(parquet, "ROW_GROUP_ROWS", 20)
    events = [e for e in random_events(5, 150) if e.table == "many"]
    config = FileSinkConfig.model_validate(
        {"path": str(tmp_path), "format": "parquet", "flush_interval": 3600, "fsync": False}
    )
    sink = FileSink(config, CONTEXT)
    await sink.start()
    for start in range(0, len(events), 5):
        await sink.write(events[start : start + 5])
    writer = next(iter(sink.open_folders.values())).writer
    assert writer is not None and writer.rows == len(events) and writer.size() > 0
    await sink.flush()
    await sink.close()
    (path,) = (tmp_path / "public.many").glob("*.parquet")
    table = pq.read_table(path)
    assert pq.ParquetFile(path).metadata.num_row_groups > 1
    expected = RowLayout.for_event(events[0]).batch(events)
    assert repr(table.to_pylist()) == repr(expected.to_pylist())
    # dictionary encoding for op and the source's repeated strings only
    meta = pq.ParquetFile(path).metadata.row_group(0)
    dictionary = {
        meta.column(i).path_in_schema
        for i in range(meta.num_columns)
        if meta.column(i).has_dictionary_page
    }
    assert {"op", "source.table", "source.version", "source.snapshot"} <= dictionary
    assert not {c for c in dictionary if c.startswith(("after.", "before.", "key."))}
    assert "source.sequence" not in dictionary and "transaction.id" not in dictionary


def test_shared_source_fields_follow_source_base_when_it_differs() -> None:
    """The per-field shortcut gives way to ``source_base``'s dicts when the first key's dict
    has a field or a value the shortcut does not know."""
    from types import SimpleNamespace

    from cdcd.sinks.file.parquet_columns import _shared_fields

    class Txn(SimpleNamespace):
        def source_base(self, rel: Any, snapshot: str) -> dict[str, Any]:
            return {**self.base, "ts_ms": self.ts_ms, "lsn": None}

    rel = SimpleNamespace(schema="s", table="t")
    context = SimpleNamespace(name="n", database="d")
    plain = {"version": __version__, "connector": "postgresql", "name": "n", "db": "d"}
    plain |= {"schema": "s", "table": "t", "ts_us": 5, "snapshot": "false", "txId": 1}
    plain |= {"commit_lsn": 9}
    txns = [
        Txn(base=plain, context=context, ts_ms=i, ts_us=5, xid=1, commit_lsn=9, origin=None)
        for i in range(3)
    ]
    keys = [(t, rel, "false") for t in txns]
    fields = _shared_fields(keys)
    assert fields["ts_ms"] == [0, 1, 2] and fields["table"] == ["t"]
    for txn in txns:
        txn.base = {**plain, "shard": 7}  # a field the shortcut does not build
    assert _shared_fields(keys)["shard"] == [7, 7, 7]
    for txn in txns:
        txn.base = {**plain, "db": "other"}  # a value it would build differently
    assert _shared_fields(keys)["db"] == ["other"] * 3


def test_arrow_columns_hold_what_pa_array_holds() -> None:
    arrow_columns = parquet_columns._c_arrow_columns
    if arrow_columns is None:
        pytest.skip("cdcd._arrowcols is not compiled here")
    rng = random.Random(3)
    for n in (0, 1, 7, 8, 9, 300):
        width = rng.randrange(0, 5)
        rows = [
            tuple(
                rng.choice([None, b"", b"\xff\x00", b"x" * rng.randrange(200)])
                for _ in range(width)
            )
            for _ in range(n)
        ]
        columns = arrow_columns(rows, width)
        assert columns is not None and len(columns) == width
        for i, (validity, offsets, data, null_count) in enumerate(columns):
            buffers = [
                validity and pa.py_buffer(validity),
                pa.py_buffer(offsets),
                pa.py_buffer(data),
            ]
            got = pa.Array.from_buffers(pa.binary(), n, buffers, null_count)
            got.validate(full=True)
            assert got.equals(pa.array([row[i] for row in rows], pa.binary()))
            assert (validity is None) == (null_count == 0)
    # what it does not take: the caller's Python path decides
    assert arrow_columns([(b"1", b"2"), (b"1",)], 2) is None
    assert arrow_columns([(b"1", "text")], 2) is None
    assert arrow_columns([[b"1", b"2"]], 2) is None
