"""The Spark jobs on real Spark, classic and through Spark Connect, over events written here
exactly as cdcd's JSON Lines files look (:func:`tests.sparkutil.change_event`): key changes
whose create leaves TOASTed columns unchanged (``source.old_key``/``new_key``), in one
transaction, chained, updated in between and split across micro-batches; Delta Lake and
Iceberg targets kept by MERGE, replays, truncates, a keyless table; a stream whose table gains,
loses, widens and then incompatibly retypes a column; schemas from ``_schema/`` files;
history; the command line.

``test_spark_connect.py`` runs this module again through Spark Connect. End-to-end runs over
what real cdcd writes from a real PostgreSQL are in
``test_spark_jobs.py``.
"""

from __future__ import annotations

import datetime as dt
import os
import subprocess
import sys
from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest

from tests.sparkutil import (
    ONE_PARTITION_CONF,
    TEST_JVM_OPTIONS,
    UNAVAILABLE,
    change_event,
    key_change,
    write_jsonl,
    write_schema_file,
)

pytest.importorskip("pyspark")

from cdcd.spark import (
    apply_to_table,
    current_rows,
    event_schema,
    events_from_files,
    history,
    latest_state,
    merge_changes,
    stream_table,
    table_ref,
    table_rows,
)
from cdcd.spark import cli as spark_cli

pytestmark = [pytest.mark.spark, pytest.mark.timeout(600)]

TABLE = "public.orders"
COLUMNS = [("id", "int4", 23, -1), ("note", "text", 25, -1), ("n", "int4", 23, -1)]
U = UNAVAILABLE

# Rows 4 and 5 hold TOASTed notes. Transaction 20 changes 4 → 104 (note unchanged), updates
# 104 (note unchanged), then changes 104 → 204 (unchanged again). Transaction 30 changes
# 5 → 105; its delete and create end up in different files (micro-batches), and transaction 40
# updates 105 with the note unchanged. Transaction 50 inserts 4 again (the old key reused).
KEY_CHANGES = [
    change_event("c", (10, 0), after={"id": 4, "note": "big-4", "n": 1}),
    change_event("c", (10, 1), after={"id": 5, "note": "big-5", "n": 1}),
    change_event("c", (10, 2), after={"id": 6, "note": "six", "n": 1}),
    *key_change((20, 0), {"id": 4}, {"id": 104, "note": "", "n": 2}, ["note"]),
    change_event("u", (20, 2), after={"id": 104, "note": U, "n": 3}, toast=["note"]),
    *key_change((20, 3), {"id": 104}, {"id": 204, "note": "", "n": 4}, ["note"]),
    *key_change((30, 0), {"id": 5}, {"id": 105, "note": "", "n": 5}, ["note"]),
    change_event("u", (40, 0), after={"id": 105, "note": U, "n": 6}, toast=["note"]),
    change_event("c", (50, 0), after={"id": 4, "note": "new-4", "n": 7}),
]
EXPECTED = {(4, "new-4", 7), (6, "six", 1), (105, "big-5", 6), (204, "big-4", 4)}


def table_folder(root: Path, events: list[dict[str, Any]], per_file: int) -> Path:
    folder = root / TABLE
    write_schema_file(folder, (10, 0), COLUMNS, ["id"])
    write_jsonl(folder, events, per_file)
    return folder


def rows(df: Any) -> set[tuple[Any, ...]]:
    return {tuple(r) for r in df.collect()}


@pytest.fixture(scope="module")
def key_changes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The events above in files of 7 events: the first file ends after the delete of 5."""
    root = tmp_path_factory.mktemp("keychanges")
    files = table_folder(root, KEY_CHANGES, per_file=7)
    assert len(list(files.glob("*.jsonl"))) == 2
    return root


def test_latest_state_fills_key_changes(spark: Any, key_changes: Path) -> None:
    events = events_from_files(spark, str(key_changes), TABLE)
    assert rows(latest_state(events)) == EXPECTED
    # without old_key (files from before the field) nothing says where the value is
    bare = events.withColumn("source", events["source"].dropFields("old_key"))
    assert (204, None, 4) in rows(latest_state(bare))


def test_apply_to_delta_in_batches_and_replays(spark: Any, key_changes: Path, tmp_path: Path):
    """``apply_to_table`` file by file (the key change of 5 split across the two batches,
    the table created by the first), then both files again: nothing changes."""
    target = table_ref(str(tmp_path / "orders"))
    schema = event_schema(spark, str(key_changes), TABLE)
    files = sorted(str(p) for p in (key_changes / TABLE).glob("*.jsonl"))
    for path in files:
        apply_to_table(spark, spark.read.schema(schema).json(path), target)
    assert rows(table_rows(spark, target)) == EXPECTED
    before = rows(spark.table(target))
    apply_to_table(spark, spark.read.schema(schema).json(files), target)  # a replay
    assert rows(spark.table(target)) == before


def test_history_matches_state(spark: Any, key_changes: Path) -> None:
    events = events_from_files(spark, str(key_changes), TABLE)
    versions = history(events).cache()
    current = versions.where("_cdc_current").select("id", "note", "n")
    assert rows(current) == EXPECTED
    by_key = {}
    for r in versions.orderBy("_cdc_valid_from_lsn", "_cdc_valid_from_seq").collect():
        by_key.setdefault(r["id"], []).append(r)
    # 104 existed inside transaction 20 only: from its create to the delete 2 events later
    assert [(r["n"], r["note"], r["_cdc_valid_to_seq"]) for r in by_key[104]] == [
        (2, "big-4", 2),
        (3, "big-4", 3),
    ]
    first = by_key[4][0]
    assert (first["_cdc_valid_to_lsn"], first["_cdc_valid_to_seq"]) == (20, 0)
    assert first["_cdc_valid_from"] == dt.datetime(2024, 11, 22, 0, 0, 0, 10_000)
    versions.unpersist()


def test_schema_from_files_and_a_schema_change(spark: Any, tmp_path: Path) -> None:
    """Types from the ``_schema/`` table; a column added and one dropped mid-stream."""
    folder = tmp_path / TABLE
    v1 = [("id", "int8", 20, -1), ("price", "numeric", 1700, (10 << 16) + 2 + 4)]
    v1 += [("day", "date", 1082, -1), ("at", "timestamptz", 1184, -1), ("gone", "text", 25, -1)]
    write_schema_file(folder, (10, 0), v1, ["id"])
    v2 = [c for c in v1 if c[0] != "gone"] + [("tags", "_text", 1009, -1)]
    write_schema_file(folder, (20, 0), v2, ["id"])
    old = {"id": 1, "price": "12.50", "day": "2024-01-02", "at": "2024-01-02T03:04:05Z"}
    new = {**{k: v for k, v in old.items()}, "id": 2, "tags": ["a", "b"]}
    write_jsonl(folder, [change_event("c", (10, 0), after={**old, "gone": "g"})])
    write_jsonl(folder, [change_event("c", (20, 0), after=new)])
    events = events_from_files(spark, str(tmp_path), TABLE)
    after = events.schema["after"].dataType.simpleString()
    assert after == (
        "struct<id:bigint,price:decimal(10,2),day:date,at:timestamp,tags:array<string>,gone:string>"
    )
    state = {r["id"]: r for r in latest_state(events).collect()}
    assert state[1]["price"] == Decimal("12.50") and state[1]["gone"] == "g"
    assert state[1]["day"] == dt.date(2024, 1, 2) and state[1]["tags"] is None
    assert state[2]["tags"] == ["a", "b"] and state[2]["gone"] is None
    assert state[2]["at"] == dt.datetime(2024, 1, 2, 3, 4, 5)  # the session is in UTC


def test_stream_to_delta_with_schema_changes(spark: Any, tmp_path: Path) -> None:
    """``stream_table`` over a JSON Lines folder into Delta, one file per micro-batch, run
    again after each change (each run restarts from the checkpoint): a column added (null in
    older rows), one dropped (kept, null in new rows), int4 widened to int8, a copy of an old
    file (a replay); then int8 → text stops the query naming table, column and position."""
    src, target = tmp_path / "src", str(tmp_path / "orders")
    checkpoint = str(tmp_path / "cp")
    folder = src / TABLE
    v1 = [("id", "int4", 23, -1), ("note", "text", 25, -1), ("n", "int4", 23, -1)]
    write_schema_file(folder, (10, 0), v1, ["id"])
    write_jsonl(
        folder, [change_event("c", (10, i), after={"id": i, "note": "a", "n": i}) for i in (1, 2)]
    )

    def run() -> Any:
        query = stream_table(
            spark, TABLE, target, checkpoint, path=str(src), max_files_per_trigger=1
        )
        try:
            query.awaitTermination()
        except Exception as failure:  # the query stopped with it
            return failure
        return query.exception()

    assert run() is None
    v2 = [("id", "int4", 23, -1), ("n", "int8", 20, -1), ("qty", "int4", 23, -1)]
    write_schema_file(folder, (20, 0), v2, ["id"])
    write_jsonl(
        folder,
        [
            change_event("u", (20, 0), after={"id": 1, "n": 5_000_000_000, "qty": 5}),
            change_event("c", (20, 1), after={"id": 3, "n": 3, "qty": 7}),
        ],
    )
    old = sorted(folder.glob("*.jsonl"))[0]
    replay = folder / "FFFFFFFFFFFFFFFF-00000000.jsonl"
    replay.write_bytes(old.read_bytes())
    os.utime(replay, (1_700_025_000, 1_700_025_000))  # after the others (Spark's maxFileAge)
    assert run() is None
    table = spark.table(table_ref(target))
    assert table.schema["n"].dataType.simpleString() == "bigint"
    assert rows(table_rows(spark, table_ref(target)).select("id", "note", "n", "qty")) == {
        (1, None, 5_000_000_000, 5),
        (2, "a", 2, None),
        (3, None, 3, 7),
    }
    write_schema_file(folder, (30, 0), [*v2[:1], ("n", "text", 25, -1), v2[2]], ["id"])
    write_jsonl(folder, [change_event("u", (30, 0), after={"id": 3, "n": "three", "qty": 7})])
    failure = run()
    assert failure is not None
    message = str(failure)
    assert "public.orders: column 'n' changed type from bigint to string" in message, message
    assert "commit_lsn 0/1E (30), seq 0" in message, message


def test_apply_to_delta_keyless(spark: Any, tmp_path: Path) -> None:
    """A table without a key (a multiset) is rewritten whole per batch; a replay changes
    nothing."""
    keyless = tmp_path / "keyless"
    v1 = [("id", "int4", 23, -1), ("note", "text", 25, -1)]
    write_schema_file(keyless / TABLE, (10, 0), v1, None)
    row = {"id": 0, "note": "same"}
    events = [
        change_event("c", (10, 0), after=row, key=None),
        change_event("c", (10, 1), after=row, key=None),
        change_event("d", (20, 0), before=row, key=None),
    ]
    write_jsonl(keyless / TABLE, events)
    target = table_ref(str(tmp_path / "keyless-table"))
    for _ in range(2):  # the second run is a replay
        apply_to_table(spark, events_from_files(spark, str(keyless), TABLE), target)
        assert [tuple(r) for r in table_rows(spark, target).collect()] == [(0, "same")]


def test_cli_apply_and_history(spark: Any, key_changes: Path, tmp_path: Path) -> None:
    out = tmp_path / "orders"
    argv = ["apply", "--input", str(key_changes), "--table", TABLE, "--output", str(out)]
    assert spark_cli.main(argv, spark=spark) == 0
    assert rows(table_rows(spark, table_ref(str(out)))) == EXPECTED
    argv = ["history", "--input", str(key_changes), "--table", TABLE]
    assert spark_cli.main([*argv, "--output", str(tmp_path / "h")], spark=spark) == 0
    current = spark.read.parquet(str(tmp_path / "h")).where("_cdc_current")
    assert rows(current.select("id", "note", "n")) == EXPECTED


@pytest.mark.skipif(bool(os.environ.get("CDCD_TEST_SPARK_REMOTE")), reason="own JVM")
def test_cli_stream_under_spark_submit(spark: Any, key_changes: Path, tmp_path: Path) -> None:
    """``spark-submit cdcd/spark/cli.py stream ...`` (the jars and catalogs given as a user
    gives them) uses the submitted session and logs each micro-batch."""
    import pyspark

    from cdcd.spark.session import jar_conf, table_conf

    submit = Path(pyspark.__file__).parent / "bin" / "spark-submit"
    out = tmp_path / "orders"
    cmd = [str(submit), "--master", "local[1]", "--conf", "spark.ui.enabled=false"]
    cmd += ["--driver-java-options", TEST_JVM_OPTIONS]
    for key, value in {**jar_conf(), **table_conf(), **ONE_PARTITION_CONF}.items():
        cmd += ["--conf", f"{key}={value}"]
    cmd += [spark_cli.__file__, "stream", "--input", str(key_changes), "--table", TABLE]
    cmd += ["--output", str(out), "--checkpoint", str(tmp_path / "cp"), "--max-files", "1"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYSPARK_GATEWAY")}
    env.update(PYSPARK_PYTHON=sys.executable, SPARK_LOCAL_IP="127.0.0.1")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=500)
    assert proc.returncode == 0, proc.stderr[-3000:]
    output = proc.stdout + proc.stderr  # spark-submit merges the driver's stderr into stdout
    assert "batch 0: 7 events" in output and "batch 1: 5 events" in output, output[-3000:]
    assert rows(table_rows(spark, table_ref(str(out)))) == EXPECTED


def test_cli_help() -> None:
    for job in ("apply", "state", "history", "stream"):
        proc = subprocess.run(
            [sys.executable, "-m", "cdcd.spark", job, "--help"], capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stderr
        assert "--table" in proc.stdout


# ------------------------------------------------------------------------------ MERGE INTO


def test_merge_into_delta_and_iceberg(spark: Any, key_changes: Path, tmp_path: Path) -> None:
    """``merge_changes`` on real Delta Lake and Iceberg tables. Delta: file by file (the key
    change of 5 split across the two MERGEs), then every event again (a replay changes
    nothing); Iceberg: every event at once. Then a truncate and an insert after it."""
    schema = event_schema(spark, str(key_changes), TABLE)
    files = sorted(str(p) for p in (key_changes / TABLE).glob("*.jsonl"))
    events = spark.read.schema(schema).json(files)
    later = table_folder(
        tmp_path / "later",
        [
            change_event("t", (60, 0), key=None),
            change_event("c", (70, 0), after={"id": 9, "note": "nine", "n": 9}),
        ],
        per_file=10,
    )
    after_truncate = events_from_files(spark, str(later.parent), TABLE)
    spark.sql("CREATE NAMESPACE IF NOT EXISTS iceberg.cdcd_test")
    spark.sql("DROP TABLE IF EXISTS iceberg.cdcd_test.merge_orders")
    columns = "id int, note string, n int, _cdc_commit_lsn bigint, _cdc_seq bigint"
    columns += ", _cdc_deleted boolean"  # tombstones: the delete half of 5's key change
    delta, iceberg = f"delta.`{tmp_path / 'delta'}`", "iceberg.cdcd_test.merge_orders"
    spark.sql(f"CREATE TABLE {delta} ({columns}) USING delta")
    spark.sql(f"CREATE TABLE {iceberg} ({columns}) USING iceberg")
    for path in files:
        merge_changes(spark, spark.read.schema(schema).json(path), delta, tombstones=True)
    assert rows(current_rows(spark.table(delta))) == EXPECTED
    before = rows(spark.table(delta))
    merge_changes(spark, events, delta, tombstones=True)
    assert rows(spark.table(delta)) == before
    merge_changes(spark, events, iceberg, tombstones=True)
    assert rows(spark.table(iceberg)) == before
    for target in (delta, iceberg):
        merge_changes(spark, after_truncate, target, tombstones=True)
        assert rows(current_rows(spark.table(target))) == {(9, "nine", 9)}, target


def test_merge_takes_unchanged_toast_from_the_target(spark: Any, tmp_path: Path) -> None:
    """A batch without key-change creates leaving TOASTed columns unchanged is folded
    without reading the target: the MERGE takes unchanged values (an update's, the values
    the delete half of a key change keeps) from the target row; a row the table never held
    gets null. A later batch's create of the new key finds the kept values; a replay of the
    middle batch changes nothing. On Delta Lake and Iceberg."""
    batches = [
        [
            change_event("c", (10, 0), after={"id": 1, "note": "big-1", "n": 1}),
            change_event("c", (10, 1), after={"id": 2, "note": "big-2", "n": 1}),
            change_event("c", (10, 2), after={"id": 3, "note": "three", "n": 1}),
        ],
        [
            change_event("u", (20, 0), after={"id": 1, "note": U, "n": 2}, toast=["note"]),
            key_change((20, 1), {"id": 2}, {"id": 202, "note": "", "n": 2}, ["note"])[0],
            change_event("u", (20, 3), after={"id": 3, "note": U, "n": 2}, toast=["note"]),
            change_event("u", (20, 4), after={"id": 3, "note": "new", "n": 3}),
            change_event("u", (20, 5), after={"id": 7, "note": U, "n": 1}, toast=["note"]),
        ],
        [key_change((20, 1), {"id": 2}, {"id": 202, "note": "", "n": 2}, ["note"])[1]],
    ]
    folders = [table_folder(tmp_path / f"b{i}", b, per_file=10) for i, b in enumerate(batches)]
    spark.sql("CREATE NAMESPACE IF NOT EXISTS iceberg.cdcd_test")
    spark.sql("DROP TABLE IF EXISTS iceberg.cdcd_test.toast_orders")
    columns = "id int, note string, n int, _cdc_commit_lsn bigint, _cdc_seq bigint"
    columns += ", _cdc_deleted boolean"
    delta, iceberg = f"delta.`{tmp_path / 'delta'}`", "iceberg.cdcd_test.toast_orders"
    spark.sql(f"CREATE TABLE {delta} ({columns}) USING delta")
    spark.sql(f"CREATE TABLE {iceberg} ({columns}) USING iceberg")
    expected = {(1, "big-1", 2), (3, "new", 3), (7, None, 1), (202, "big-2", 2)}
    for target in (delta, iceberg):
        for folder in folders:
            events = events_from_files(spark, str(folder.parent), TABLE)
            assert merge_changes(spark, events, target, tombstones=True) is not None
        assert rows(current_rows(spark.table(target))) == expected, target
        before = rows(spark.table(target))
        replay = events_from_files(spark, str(folders[1].parent), TABLE)
        merge_changes(spark, replay, target, tombstones=True)
        assert rows(spark.table(target)) == before, target
