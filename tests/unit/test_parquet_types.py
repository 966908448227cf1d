"""PostgreSQL column types to Arrow types, and values that do not fit their native type."""

from __future__ import annotations

from decimal import Decimal

import orjson
import pyarrow as pa
import pytest

from cdcd.decoder.events import Column, Relation
from cdcd.sinks.file.parquet import RowLayout, column_type
from cdcd.values.types import TypeInfo, TypeRegistry
from tests.unit.sink_fixtures import TxnBuilder, encoder, tup


def numeric(precision: int, scale: int) -> int:
    return ((precision << 16) | (scale & 0x7FF)) + 4


REGISTRY = TypeRegistry()
REGISTRY.register(TypeInfo(90001, "public", "mood", "e"))
REGISTRY.register(TypeInfo(90002, "public", "posint", "d", base_oid=23))
REGISTRY.register(TypeInfo(90003, "public", "money2", "d", base_oid=1700))


@pytest.mark.parametrize(
    ("oid", "typmod", "expected"),
    [
        (21, -1, pa.int16()),
        (23, -1, pa.int32()),
        (20, -1, pa.int64()),
        (26, -1, pa.int64()),  # oid
        (700, -1, pa.float32()),
        (701, -1, pa.float64()),
        (1700, numeric(10, 2), pa.decimal128(10, 2)),
        (1700, numeric(38, 0), pa.decimal128(38, 0)),
        (1700, numeric(39, 2), pa.string()),  # beyond decimal128
        (1700, numeric(5, -2), pa.string()),  # negative scale (PostgreSQL 15+)
        (1700, -1, pa.string()),  # unconstrained
        (790, -1, pa.decimal128(19, 2)),  # money
        (16, -1, pa.bool_()),
        (25, -1, pa.string()),
        (1043, 14, pa.string()),
        (1042, 5, pa.string()),
        (19, -1, pa.string()),  # name
        (2950, -1, pa.string()),  # uuid
        (114, -1, pa.string()),  # json
        (3802, -1, pa.string()),  # jsonb
        (869, -1, pa.string()),  # inet
        (1186, -1, pa.string()),  # interval: ISO-8601 text
        (1266, -1, pa.string()),  # timetz
        (17, -1, pa.binary()),
        (1082, -1, pa.date32()),
        (1083, -1, pa.time64("us")),
        (1114, -1, pa.timestamp("us")),
        (1184, -1, pa.timestamp("us", tz="UTC")),
        (1007, -1, pa.list_(pa.int32())),  # int4[]
        (1009, -1, pa.list_(pa.string())),  # text[]
        (1231, numeric(10, 2), pa.list_(pa.decimal128(10, 2))),  # numeric(10,2)[]
        (1185, -1, pa.list_(pa.timestamp("us", tz="UTC"))),  # timestamptz[]
        (90001, -1, pa.string()),  # enum
        (90002, -1, pa.int32()),  # domain over int4
        (90003, numeric(8, 3), pa.decimal128(8, 3)),  # domain over numeric, typmod applies
        (3904, -1, pa.string()),  # int4range
        (123456789, -1, pa.string()),  # never seen
    ],
)
def test_column_type(oid: int, typmod: int, expected: pa.DataType) -> None:
    assert column_type(REGISTRY, oid, typmod) == expected


RELATION = Relation(
    None,
    16500,
    "public",
    "odd",
    "d",
    (
        Column(1, "id", 23, -1),
        Column(0, "price", 1700, numeric(10, 2)),
        Column(0, "amount", 1700, -1),
        Column(0, "at", 1184, -1),
        Column(0, "day", 1082, -1),
        Column(0, "t", 1083, -1),
        Column(0, "ints", 1007, -1),
        Column(0, "f", 701, -1),
    ),
)


def events(*rows: tuple[object, ...]) -> list:  # type: ignore[type-arg]
    builder = TxnBuilder(77, 5000)
    for row in rows:
        builder.insert(RELATION, tup(*row))
    return list(encoder().events(builder.build()))


def test_values_that_fit_are_native() -> None:
    (event,) = events(
        (
            1,
            "12.50",
            "0.0000001",
            "2024-01-01 10:00:00.5+00",
            "2024-02-29",
            "12:30:00",
            "{1,NULL,3}",
            "NaN",
        )
    )
    record = RowLayout.for_event(event).record(event)
    after = record["after"]
    assert after["price"] == Decimal("12.50")
    assert after["amount"] == "0.0000001"  # unconstrained numeric: exact text, never 1E-7
    assert after["at"].isoformat() == "2024-01-01T10:00:00.500000+00:00"
    assert after["ints"] == [1, None, 3]
    assert after["f"] != after["f"]  # NaN stays a float
    assert record["unrepresentable"] is None
    assert record["key"] == {"id": 1}


def test_unrepresentable_values_are_null_with_their_json_in_the_sidecar() -> None:
    (event,) = events(
        (2, "NaN", "Infinity", "infinity", "-infinity", "24:00:00", "[0:1]={1,2}", "1")
    )
    layout = RowLayout.for_event(event)
    record = layout.record(event)
    after = record["after"]
    assert after["price"] is None and after["at"] is None and after["day"] is None
    assert after["t"] is None and after["ints"] is None
    assert after["amount"] == "Infinity"  # a string column holds it as it is
    sidecar = dict(record["unrepresentable"])
    json_after = event.value()["after"]
    assert set(sidecar) == {"after.price", "after.at", "after.day", "after.t", "after.ints"}
    for name, text in sidecar.items():
        assert orjson.loads(text) == json_after[name.split(".", 1)[1]]
    batch = layout.batch([event])  # and Arrow accepts the row
    assert batch.num_rows == 1


def test_null_values_are_not_sidecar_entries() -> None:
    (event,) = events((3, None, None, None, None, None, None, None))
    record = RowLayout.for_event(event).record(event)
    assert record["unrepresentable"] is None
    assert set(record["after"].values()) == {3, None}
