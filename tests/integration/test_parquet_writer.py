"""The file sink with ``format: parquet``: events read back with pyarrow equal the JSON events
(values native), one file per schema, atomic names, exactly-once recovery."""

from __future__ import annotations

import base64
import datetime as dt
from decimal import Decimal
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from cdcd.assembler.transaction import Transaction
from cdcd.decoder.events import Column, Relation
from cdcd.events.encoder import Encoder
from cdcd.sinks.file.layout import data_file_name
from cdcd.sinks.file.sink import FileSink, FileSinkConfig
from tests.unit.sink_fixtures import CONTEXT, TxnBuilder, encoder, tup

NUMERIC_10_2 = ((10 << 16) | 2) + 4
COLUMNS = (
    Column(1, "id", 23, -1),
    Column(0, "name", 25, -1),
    Column(0, "price", 1700, NUMERIC_10_2),
    Column(0, "at", 1184, -1),
    Column(0, "day", 1082, -1),
    Column(0, "tags", 1009, -1),
    Column(0, "blob", 17, -1),
    Column(0, "ok", 16, -1),
)
V1 = Relation(None, 16600, "public", "things", "d", COLUMNS)
V2 = Relation(None, 16600, "public", "things", "d", (*COLUMNS, Column(0, "extra", 20, -1)))


def make_sink(out: Path, **options: Any) -> FileSink:
    config = FileSinkConfig.model_validate(
        {"path": str(out), "format": "parquet", "flush_interval": 3600, "fsync": False, **options}
    )
    return FileSink(config, CONTEXT)


async def feed(sink: FileSink, enc: Encoder, txns: list[Transaction]) -> None:
    for txn in txns:
        await sink.begin(txn)
        for events in enc.batches(txn, max_events=3):
            await sink.write(events)
        await sink.commit(txn)


def row(i: int, *extra: object) -> tuple[object, ...]:
    return (
        i,
        f"n{i}",
        f"{i}.25",
        f"2024-01-0{1 + i % 9} 10:00:0{i % 10}.5+00",
        "infinity" if i == 3 else f"2024-03-{10 + i % 10}",
        '{a,"b c",NULL}',
        "\\x00ff",
        "t" if i % 2 else "f",
        *extra,
    )


def workload() -> list[Transaction]:
    txns = []
    for n in range(4):
        b = TxnBuilder(100 + n, 10_000 + n * 1000)
        b.insert(V1, tup(*row(n)))
        b.update(V1, tup(*row(n)[:1], "renamed", *row(n)[2:]))
        if n == 2:
            b.delete(V1, tup(n, None, None, None, None, None, None, None), kind="K")
        txns.append(b.build())
    later = TxnBuilder(200, 20_000)
    later.insert(V2, tup(*row(9, 2**40)))
    txns.append(later.build())
    return txns


def read_folder(folder: Path) -> list[dict[str, Any]]:
    """Every published Parquet file's rows, in file name order (what Spark reads)."""
    files = sorted(p for p in folder.iterdir() if p.suffix == ".parquet")
    return [r for p in files for r in pq.read_table(p).to_pylist()]


def as_json(value: Any) -> Any:
    """A native value in the JSON representation of docs/events.md, to compare with the JSON."""
    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, dt.datetime):
        text = value.astimezone(dt.UTC).replace(tzinfo=None).isoformat()
        return (text.rstrip("0").rstrip(".") if "." in text else text) + "Z"
    if isinstance(value, dt.date):
        return value.isoformat()
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    return value


async def test_rows_equal_the_json_events(tmp_path: Path) -> None:
    enc = encoder()
    txns = workload()
    sink = make_sink(tmp_path)
    await sink.start()
    await feed(sink, enc, txns)
    await sink.flush()
    await sink.close()

    expected = [e for t in txns for e in enc.events(t)]
    folder = tmp_path / "public.things"
    records = read_folder(folder)
    assert [(r["source"]["commit_lsn"], r["source"]["seq"]) for r in records] == [
        e.position for e in expected
    ]
    for record, event in zip(records, expected, strict=True):
        value = event.value()
        assert record["op"] == value["op"]
        assert record["transaction"] == value["transaction"]
        assert record["ts_ms"] == value["ts_ms"]
        for name in ("commit_lsn", "seq", "lsn", "txId", "sequence", "ts_us", "schema", "table"):
            assert record["source"][name] == value["source"][name]
        assert record["key"] == ({"id": event.key()["id"]} if event.key() else None)
        for image in ("before", "after"):
            if value[image] is None:
                assert record[image] is None
                continue
            lost = dict(record["unrepresentable"] or [])
            for column, json_value in value[image].items():
                native = record[image].get(column)
                if f"{image}.{column}" in lost:
                    assert native is None
                    continue
                assert as_json(native) == json_value, (event.position, image, column)
    # the one unrepresentable value: date 'infinity'
    infinity = [r for r in records if r["unrepresentable"]]
    assert {k for r in infinity for k, _ in r["unrepresentable"]} == {"after.day"}


async def test_new_file_when_columns_change_and_names_are_atomic(tmp_path: Path) -> None:
    enc = encoder()
    txns = workload()
    sink = make_sink(tmp_path)
    await sink.start()
    await feed(sink, enc, txns[:2])
    folder = tmp_path / "public.things"
    assert not [p for p in folder.iterdir() if p.suffix == ".parquet"]  # not yet published
    assert [p.name for p in folder.iterdir() if p.name.startswith(".")]  # written hidden
    await feed(sink, enc, txns[2:])
    await sink.flush()
    await sink.close()

    first = next(enc.events(txns[0])).position
    changed = next(enc.events(txns[-1])).position
    names = sorted(p.name for p in folder.iterdir() if not p.name.startswith(("_", ".")))
    assert names == [data_file_name(first, ".parquet"), data_file_name(changed, ".parquet")]
    assert not [p for p in folder.iterdir() if p.name.startswith(".")]
    old, new = (pq.read_schema(folder / n) for n in names)
    assert "extra" not in old.field("after").type.names
    assert new.field("after").type.field("extra").type == pa.int64()
    assert b"cdcd.schema" in (new.metadata or {})
    merged = pa.unify_schemas([old, new], promote_options="permissive")
    assert merged.field("after").type.field("extra").type == pa.int64()
    assert pq.read_table(folder / names[1]).to_pylist()[0]["after"]["extra"] == 2**40


async def test_restart_replay_publishes_nothing_twice(tmp_path: Path) -> None:
    enc = encoder()
    txns = workload()
    sink = make_sink(tmp_path, rollover_rows=3)
    await sink.start()
    await feed(sink, enc, txns[:3])
    await sink.flush()
    await feed(sink, enc, txns[3:])  # written but never flushed: lost in the "crash"
    await sink.close()

    again = make_sink(tmp_path, rollover_rows=3)
    await again.start()
    await feed(again, enc, txns)  # PostgreSQL resends from the confirmed LSN (here: all)
    await again.flush()
    await again.close()
    folder = tmp_path / "public.things"
    files = sorted(p for p in folder.iterdir() if p.suffix == ".parquet")
    positions = [
        (r["source"]["commit_lsn"], r["source"]["seq"])
        for p in files
        for r in pq.read_table(p, columns=["source"]).to_pylist()
    ]
    assert positions == [e.position for t in txns for e in enc.events(t)]
