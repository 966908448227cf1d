"""AUTO CDC options of the table jobs (:mod:`cdcd.spark.autocdc`, :mod:`cdcd.spark.scd2`) on
real Spark with Delta Lake and Iceberg, over events written exactly as cdcd's JSON Lines files
look (:func:`tests.sparkutil.change_event`): SCD type 2 history through updates, unchanged
TOAST values, a delete, a key change, a truncate and replays; history tracked on some columns
only (through the command line's stream job); ``column_list`` / ``except_column_list``.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

import pytest

from tests.sparkutil import (
    UNAVAILABLE,
    change_event,
    key_change,
    write_jsonl,
    write_schema_file,
)

pytest.importorskip("pyspark")

from pyspark.sql import functions as F

from cdcd.spark import apply_to_table, events_from_files, table_ref, table_rows
from cdcd.spark import cli as spark_cli
from cdcd.spark.autocdc import AutoCdcError

pytestmark = [pytest.mark.spark, pytest.mark.timeout(600)]

TABLE = "public.orders"
U = UNAVAILABLE
COLUMNS = [("id", "int4", 23, -1), ("note", "text", 25, -1), ("n", "int4", 23, -1)]
TAGGED = [*COLUMNS, ("tag", "text", 25, -1)]

# Batch 1 inserts 1, 2, 3 (notes TOASTed). Batch 2 updates 1 leaving its note unchanged,
# deletes 2 and changes 3 → 103 (note unchanged). Batch 3 truncates, then inserts 4 and
# updates it with the same values (no new version).
HISTORY = [
    [
        change_event("c", (10, 0), after={"id": 1, "note": "big-1", "n": 1}),
        change_event("c", (10, 1), after={"id": 2, "note": "two", "n": 1}),
        change_event("c", (10, 2), after={"id": 3, "note": "big-3", "n": 1}),
    ],
    [
        change_event("u", (20, 0), after={"id": 1, "note": U, "n": 2}, toast=["note"]),
        change_event("d", (30, 0), before={"id": 2, "note": None, "n": None}),
        *key_change((40, 0), {"id": 3}, {"id": 103, "note": "", "n": 5}, ["note"]),
    ],
    [
        change_event("t", (50, 0), key=None),
        change_event("c", (60, 0), after={"id": 4, "note": "four", "n": 1}),
        change_event("u", (60, 1), after={"id": 4, "note": "four", "n": 1}),
    ],
]
VERSIONS = {  # id, note, n, __START_AT, __END_AT
    (1, "big-1", 1, (10, 0), (20, 0)),
    (1, "big-1", 2, (20, 0), (50, 0)),
    (2, "two", 1, (10, 1), (30, 0)),
    (3, "big-3", 1, (10, 2), (40, 0)),
    (103, "big-3", 5, (40, 1), (50, 0)),
    (4, "four", 1, (60, 0), None),
}


def versions(df: Any, *columns: str) -> set[tuple[Any, ...]]:
    """Rows of a type 2 table, positions as (commit_lsn, seq) tuples."""

    def position(p: Any) -> tuple[int, int] | None:
        return None if p is None else (p["commit_lsn"], p["seq"])

    return {
        (*(r[c] for c in columns), position(r["__START_AT"]), position(r["__END_AT"]))
        for r in df.collect()
    }


def folder(root: Path, batches: list[list[dict[str, Any]]], columns: Any) -> Path:
    write_schema_file(root / TABLE, (10, 0), columns, ["id"])
    for batch in batches:
        write_jsonl(root / TABLE, batch)
    return root


def test_scd2_history_delta_and_iceberg(spark: Any, tmp_path: Path) -> None:
    """Delta: batch by batch, then every event again (a replay: nothing changes); Iceberg:
    every event in one batch. Both hold the same versions."""
    src = folder(tmp_path / "src", HISTORY, COLUMNS)
    events = events_from_files(spark, str(src), TABLE).localCheckpoint()
    delta = table_ref(str(tmp_path / "delta"))
    for lsns in ((10,), (20, 30, 40), (50, 60)):
        batch = events.where(events["source.commit_lsn"].isin(*lsns))
        apply_to_table(spark, batch, delta, stored_as_scd_type=2)
    assert versions(table_rows(spark, delta), "id", "note", "n") == VERSIONS
    table = spark.table(delta)
    assert table.columns[-4:] == ["__START_AT", "__END_AT", "_cdc_commit_lsn", "_cdc_seq"]
    assert "_cdc_deleted" not in table.columns
    before = {tuple(r) for r in table.collect()}
    apply_to_table(spark, events, delta, stored_as_scd_type=2)
    apply_to_table(spark, events.where("source.commit_lsn = 20"), delta, stored_as_scd_type=2)
    assert {tuple(r) for r in spark.table(delta).collect()} == before
    # the version of 4 was updated in place by (60, 1): its newest position
    four = spark.table(delta).where("id = 4").collect()
    assert [(r["_cdc_commit_lsn"], r["_cdc_seq"]) for r in four] == [(60, 1)]
    # commit times, as docs/spark.md joins them: the events' source.ts_us at each position
    at = events.select(
        F.struct("source.commit_lsn", "source.seq"), F.timestamp_micros("source.ts_us")
    ).distinct()
    timed = (
        table_rows(spark, delta)
        .join(at.toDF("__START_AT", "start_time"), "__START_AT", "left")
        .join(at.toDF("__END_AT", "end_time"), "__END_AT", "left")
    )
    two = timed.where("id = 2").collect()[0]
    assert (two["start_time"], two["end_time"]) == (
        dt.datetime(2024, 11, 22, 0, 0, 0, 10_000),
        dt.datetime(2024, 11, 22, 0, 0, 0, 30_000),
    )

    spark.sql("CREATE NAMESPACE IF NOT EXISTS iceberg.cdcd_test")
    iceberg = "iceberg.cdcd_test.scd2_orders"
    spark.sql(f"DROP TABLE IF EXISTS {iceberg}")
    apply_to_table(spark, events, iceberg, format="iceberg", stored_as_scd_type=2)
    assert versions(table_rows(spark, iceberg), "id", "note", "n") == VERSIONS
    # a type 1 write into a type 2 table is refused, naming the option
    with pytest.raises(AutoCdcError, match=r"stored_as_scd_type=1: .* is a type 2 table"):
        apply_to_table(spark, events, delta)


# Untracked column ``tag``: changes to it alone update the current version in place. Files
# (one micro-batch each): 10 | 20, 30 and a replay of 10 | 40, 50.
TRACKED = [
    [change_event("c", (10, 0), after={"id": 1, "note": "x", "n": 1, "tag": "a"})],
    [
        change_event("u", (20, 0), after={"id": 1, "note": "x", "n": 1, "tag": "b"}),
        change_event("u", (30, 0), after={"id": 1, "note": "x", "n": 2, "tag": "b"}),
        change_event("c", (10, 0), after={"id": 1, "note": "x", "n": 1, "tag": "a"}),
    ],
    [
        change_event("u", (40, 0), after={"id": 1, "note": "x", "n": 2, "tag": "c"}),
        change_event("d", (50, 0), before={"id": 1, "note": None, "n": None, "tag": None}),
    ],
]


def test_scd2_track_history_from_the_command_line(spark: Any, tmp_path: Path) -> None:
    """``python -m cdcd.spark stream --stored-as-scd-type 2
    --track-history-except-column-list tag`` (in-process on the shared session), one file per
    micro-batch; an in-place update crosses a micro-batch boundary."""
    src = folder(tmp_path / "src", TRACKED, TAGGED)
    out = tmp_path / "orders"
    argv = ["stream", "--input", str(src), "--table", TABLE, "--output", str(out)]
    argv += ["--checkpoint", str(tmp_path / "cp"), "--max-files", "1"]
    argv += ["--stored-as-scd-type", "2", "--track-history-except-column-list", "tag"]
    assert spark_cli.main(argv, spark=spark) == 0
    assert versions(table_rows(spark, table_ref(str(out))), "id", "n", "tag") == {
        (1, 1, "b", (10, 0), (30, 0)),
        (1, 2, "c", (30, 0), (50, 0)),
    }


def test_column_list_and_except_column_list(spark: Any, tmp_path: Path) -> None:
    """Type 1 with ``column_list`` (the key added) and ``except_column_list``: only those
    columns are created and written; an unchanged TOAST value still comes from the row."""
    batches = [
        [change_event("c", (10, 0), after={"id": 1, "note": "big", "n": 1, "tag": "a"})],
        [
            change_event(
                "u", (20, 0), after={"id": 1, "note": U, "n": 2, "tag": "b"}, toast=["note"]
            )
        ],
    ]
    src = folder(tmp_path / "src", batches, TAGGED)
    events = events_from_files(spark, str(src), TABLE).localCheckpoint()
    only, without = table_ref(str(tmp_path / "only")), table_ref(str(tmp_path / "without"))
    for lsn in (10, 20):
        batch = events.where(events["source.commit_lsn"] == lsn)
        apply_to_table(spark, batch, only, column_list=["n"])
        apply_to_table(spark, batch, without, except_column_list="tag")
    assert [tuple(r) for r in table_rows(spark, only).collect()] == [(1, 2)]
    assert table_rows(spark, only).columns == ["id", "n"]
    assert [tuple(r) for r in table_rows(spark, without).collect()] == [(1, "big", 2)]
    with pytest.raises(AutoCdcError, match="except_column_list: id is a key column"):
        apply_to_table(spark, events, without, except_column_list=["id", "tag"])


def test_scd2_from_kafka_records(spark: Any, tmp_path: Path) -> None:
    """Kafka values parsed per batch without ``_schema/`` files (the streaming job's way: the
    target's columns, then types inferred from the values): a type 2 target's own
    ``__START_AT`` / ``__END_AT`` are not taken for source columns."""
    from types import SimpleNamespace

    import orjson

    from cdcd.spark.sources import events_from_kafka_records, kafka_records_frame
    from cdcd.spark.streaming import kafka_batch_schema

    target = table_ref(str(tmp_path / "kafka"))
    for number, batch in enumerate(HISTORY):
        records = [
            SimpleNamespace(
                key=orjson.dumps(e["key"]),
                value=orjson.dumps(e),
                topic="shop.public.orders",
                partition=0,
                offset=number * 10 + i,
                timestamp=0,
                headers=[],
            )
            for i, e in enumerate(batch)
        ]
        frame = kafka_records_frame(spark, records)
        schema = kafka_batch_schema(spark, frame, target, TABLE)
        events = events_from_kafka_records(spark, frame, schema)
        apply_to_table(spark, events, target, stored_as_scd_type=2)
    assert versions(table_rows(spark, target), "id", "note", "n") == VERSIONS


def test_kafka_batch_without_values_changes_nothing(spark: Any, tmp_path: Path) -> None:
    """A micro-batch can hold no record at all: under read_committed, a batch whose offsets
    span only an aborted Kafka transaction (a producer killed mid-commit) and its marker. It
    and a batch of tombstones only apply nothing, to a missing target and to an existing one."""
    from types import SimpleNamespace

    import orjson

    from cdcd.spark.sources import events_from_kafka_records, kafka_records_frame
    from cdcd.spark.streaming import kafka_batch_schema

    def record(offset: int, event: dict[str, Any] | None, key: Any) -> SimpleNamespace:
        value = orjson.dumps(event) if event is not None else None
        return SimpleNamespace(
            key=orjson.dumps(key),
            value=value,
            topic="shop.public.orders",
            partition=0,
            offset=offset,
            timestamp=0,
            headers=[],
        )

    def apply(records: list[SimpleNamespace]) -> dict[str, Any]:
        frame = kafka_records_frame(spark, records)
        schema = kafka_batch_schema(spark, frame, target, TABLE)
        return apply_to_table(spark, events_from_kafka_records(spark, frame, schema), target)

    target = table_ref(str(tmp_path / "kafka"))
    assert apply([])["events"] == 0
    assert not Path(target).exists()
    first = HISTORY[0]
    assert apply([record(i, e, e["key"]) for i, e in enumerate(first)])["events"] == len(first)
    before = sorted(tuple(r) for r in table_rows(spark, target).collect())
    assert apply([])["events"] == 0
    assert apply([record(100, None, first[0]["key"])])["events"] == 0
    assert sorted(tuple(r) for r in table_rows(spark, target).collect()) == before
