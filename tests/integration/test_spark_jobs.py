"""The PySpark jobs (:mod:`cdcd.spark`) on real Spark over what real cdcd wrote.

One workload on the newest installed PostgreSQL (``version_independent``: the jobs read
files, not the server) is streamed by ``cdcd run --endpos`` into a JSON Lines and a
Parquet file sink. Tables:

* ``orders`` (primary key ``id``; ``note`` stored EXTERNAL so long values are TOASTed):
  inserts, updates (one leaving the TOASTed ``note`` unchanged, one setting a column to
  null), a key-changing update, deletes, a delete and re-insert of one key in a transaction;
* ``items`` (primary key): inserts, a truncate, inserts and an update after it;
* ``tags`` (no key, REPLICA IDENTITY FULL): duplicate rows, an update of one of two equal
  rows leaving a TOASTed value unchanged, a delete.

Every check compares Spark's rebuilt state with the source table read with SQL, values
normalised by :func:`tests.e2e.normalize` (numbers as Decimal).

The Kafka paths run cdcd again (a slot of their own each, created before the workload) with
the Kafka sink into the Apache Kafka broker of ``kafka_broker``: one consumes the topics with
aiokafka and builds the Spark DataFrame of Kafka records from them, the other streams the
topics into Delta Lake with Spark's Kafka source, in two parts (the query restarted from its
checkpoint).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer

from tests.e2e import data_files, normalize, read_events, run_cdcd, write_config
from tests.kafkaharness import KafkaBroker
from tests.pgharness import PgDatabase, PgInstall, create_database
from tests.s3harness import S3Store, launch_s3

pytest.importorskip("pyspark")

from cdcd.spark import (
    apply_changes,
    current_rows,
    deduplicate,
    event_schema,
    events_from_files,
    events_from_kafka_records,
    kafka_records_frame,
    latest_state,
    stream_table,
    table_ref,
    table_rows,
)
from cdcd.spark import cli as spark_cli

pytestmark = [
    pytest.mark.pg,
    pytest.mark.spark,
    pytest.mark.version_independent,
    pytest.mark.timeout(400),
]

TABLES = {"public.orders": ("id",), "public.items": ("id",), "public.tags": ()}
BIG = "repeat(md5({}::text), 200)"  # 6400 incompressible-ish characters: TOASTed


@dataclass
class Workload:
    db: PgDatabase
    dir: Path
    kafka_cfg: Path
    stream_cfg: Path
    mid_lsn: str  # after the truncate of items, before its column is added
    s3: S3Store
    s3_prefix: str  # bucket/prefix of the JSON Lines file sink on S3
    schemas: dict[str, Any] = field(default_factory=dict)

    @property
    def jsonl(self) -> Path:
        return self.dir / "out-jsonl"

    @property
    def parquet(self) -> Path:
        return self.dir / "out-parquet"

    def schema(self, spark: Any, table: str) -> Any:
        """The JSON Lines event schema of ``table`` (inferred once: each inference is a job)."""
        if table not in self.schemas:
            self.schemas[table] = event_schema(spark, str(self.jsonl), table)
        return self.schemas[table]

    def source_rows(self, table: str) -> list[dict[str, Any]]:
        """The source table's rows as dicts (column order as in the table)."""
        with self.db.connect() as conn, conn.cursor() as cur:
            cur.execute(f"SELECT * FROM {table}")
            names = [d[0] for d in cur.description]
            return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]


SCHEMA_SQL = """
CREATE TABLE orders (id int PRIMARY KEY, name text, price numeric(10,2), qty int, note text);
ALTER TABLE orders ALTER COLUMN note SET STORAGE EXTERNAL;
CREATE TABLE items (id int PRIMARY KEY, label text);
CREATE TABLE docs (id int PRIMARY KEY, body text, n int);
ALTER TABLE docs ALTER COLUMN body SET STORAGE EXTERNAL;
CREATE TABLE tags (name text, n int, note text);
ALTER TABLE tags REPLICA IDENTITY FULL;
ALTER TABLE tags ALTER COLUMN note SET STORAGE EXTERNAL;
"""

WORKLOAD_SQL = [
    f"""INSERT INTO orders SELECT i, 'n' || i, i * 1.25, i,
               CASE WHEN i % 3 = 0 THEN {BIG.format("i")} END
        FROM generate_series(1, 20) i""",
    "UPDATE orders SET price = price + 1 WHERE id IN (3, 6)",  # note: unchanged TOAST
    "UPDATE orders SET name = 'renamed' WHERE id = 4",
    "UPDATE orders SET id = 100 WHERE id = 5",  # key change: delete 5, create 100
    "DELETE FROM orders WHERE id IN (7, 8)",
    """BEGIN;
       UPDATE orders SET qty = qty + 10 WHERE id = 9;
       UPDATE orders SET qty = qty + 10 WHERE id = 9;
       DELETE FROM orders WHERE id = 10;
       INSERT INTO orders VALUES (10, 'again', 1, 1, NULL);
       INSERT INTO items VALUES (1, 'one'), (2, 'two'), (3, 'three');
       COMMIT""",
    "UPDATE orders SET note = 'short' WHERE id = 12",
    "UPDATE orders SET qty = 0 WHERE id = 12",
    "UPDATE orders SET price = NULL WHERE id = 11",
    "UPDATE orders SET qty = qty + 1 WHERE id = 15",  # unchanged TOAST again, later batch
    "TRUNCATE items",
    "INSERT INTO items VALUES (2, 'two again'), (6, 'six'), (7, 'seven')",
    "UPDATE items SET label = 'seven!' WHERE id = 7",
    "ALTER TABLE items ADD COLUMN extra int",  # a column added mid-stream
    "INSERT INTO items VALUES (8, 'eight', 8)",
    "UPDATE items SET extra = 7 WHERE id = 7",
    f"""INSERT INTO tags VALUES ('a', 1, {BIG.format("'a'")}), ('a', 1, {BIG.format("'a'")}),
                               ('b', 2, NULL), ('c', 3, NULL)""",
    "UPDATE tags SET n = 5 WHERE ctid = (SELECT min(ctid) FROM tags WHERE name = 'a')",
    "DELETE FROM tags WHERE name = 'b'",
    "INSERT INTO tags VALUES ('c', 3, NULL)",
    "UPDATE orders SET qty = 99 WHERE id = 18",  # note: unchanged TOAST
    # key changes leaving the TOASTed body unchanged: chained within a transaction with an
    # update in between, and alone (test_key_changes_with_unchanged_toast)
    f"INSERT INTO docs SELECT i, {BIG.format('i')}, 0 FROM generate_series(1, 4) i",
    """BEGIN;
       UPDATE docs SET id = id + 100 WHERE id = 1;
       UPDATE docs SET n = n + 1 WHERE id = 101;
       UPDATE docs SET id = id + 100 WHERE id = 101;
       COMMIT""",
    "UPDATE docs SET id = 12 WHERE id = 2",
    "UPDATE docs SET n = 5 WHERE id = 12",
]


@pytest.fixture(scope="module")
def workload(
    pg_install: PgInstall, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Any:
    cluster = request.getfixturevalue("pg_cluster")
    db = create_database(cluster)
    s3 = launch_s3()
    try:
        s3_prefix = s3.new_prefix("spark")
        directory = tmp_path_factory.mktemp("spark-workload")
        db.execute(SCHEMA_SQL)
        cfg = write_config(
            directory,
            db.dsn,
            sinks=[
                # small files: the streaming test needs several micro-batches
                {"type": "file", "path": "out-jsonl", "format": "jsonl", "rollover_rows": 3},
                {"type": "file", "path": "out-parquet", "format": "parquet"},
                {"type": "file", "path": f"s3://{s3_prefix}", "storage": s3.storage()},
            ],
        )
        # The Kafka test streams the same changes later through a slot of its own.
        kafka_cfg = write_config(directory / "kafka", db.dsn, slot="cdcd_spark_kafka")
        run_cdcd("slot", "create", "--config", str(cfg))
        stream_cfg = write_config(directory / "stream", db.dsn, slot="cdcd_spark_stream")
        run_cdcd("slot", "create", "--config", str(kafka_cfg))
        run_cdcd("slot", "create", "--config", str(stream_cfg))
        mid = ""
        for sql in WORKLOAD_SQL:
            db.execute(sql)
            if sql == "TRUNCATE items":
                mid = db.fetchval("SELECT pg_current_wal_lsn()::text")
        endpos = db.fetchval("SELECT pg_current_wal_lsn()::text")
        run_cdcd("run", "--config", str(cfg), "--endpos", endpos)
        yield Workload(db, directory, kafka_cfg, stream_cfg, mid, s3, s3_prefix)
    finally:
        db.drop()
        s3.close()


# ------------------------------------------------------------------------------ comparing


def normal_rows(rows: list[dict[str, Any]]) -> list[tuple[tuple[str, Any], ...]]:
    """Rows as sorted tuples of (column, normalised value): comparable as multisets."""
    out = [tuple(sorted((c, normalize(v)) for c, v in row.items())) for row in rows]
    return sorted(out, key=repr)


def spark_rows(df: Any) -> list[dict[str, Any]]:
    return [row.asDict(recursive=True) for row in df.collect()]


def assert_same_state(df: Any, workload: Workload, table: str) -> None:
    got = spark_rows(df)
    expected = workload.source_rows(table)
    assert expected, f"{table} is empty at the source: the test would prove nothing"
    assert sorted(df.columns) == sorted(expected[0]), f"{table}: columns differ"
    assert Counter(normal_rows(got)) == Counter(normal_rows(expected)), table


# ---------------------------------------------------------------------------------- tests


def test_workload_has_the_interesting_events(workload: Workload) -> None:
    """Guard: the files hold what the other tests rely on (TOAST markers, a truncate, a
    key change as delete + create)."""
    orders = read_events(workload.jsonl, "public.orders")
    assert any(e["source"].get("unchanged_toast") == ["note"] for e in orders)
    assert any(e["op"] == "d" and e["before"]["id"] == 5 for e in orders)
    assert any(e["op"] == "c" and e["after"]["id"] == 100 for e in orders)
    assert [e["op"] for e in read_events(workload.jsonl, "public.items")].count("t") == 1
    tags = read_events(workload.jsonl, "public.tags")
    assert all(e["key"] is None for e in tags)
    # (With REPLICA IDENTITY FULL the server sends the complete new row: no TOAST markers.)


@pytest.mark.parametrize("table", list(TABLES))
def test_latest_state_from_jsonl(spark: Any, workload: Workload, table: str) -> None:
    events = events_from_files(spark, str(workload.jsonl), table, "jsonl")
    workload.schemas.setdefault(table, events.schema)
    assert_same_state(latest_state(events), workload, table)


@pytest.mark.parametrize("table", list(TABLES))
def test_latest_state_from_parquet(spark: Any, workload: Workload, table: str) -> None:
    if not data_files(workload.parquet / table, ".parquet"):
        pytest.fail(f"the Parquet sink wrote no files for {table}")
    events = events_from_files(spark, str(workload.parquet), table, "parquet")
    assert_same_state(latest_state(events, TABLES[table]), workload, table)


def test_hidden_names_are_not_read(spark: Any, workload: Workload, tmp_path: Path) -> None:
    """``_schema/`` and dot-files next to the data are skipped; counts match the files."""
    folder = tmp_path / "out" / "public.orders"
    shutil.copytree(workload.jsonl / "public.orders", folder)
    assert (folder / "_schema").is_dir()
    (folder / ".partial.jsonl").write_text('{"op": "c", "after": {"id": -1}}\n')
    (folder / "_notes.jsonl").write_text('{"op": "c", "after": {"id": -2}}\n')
    events = events_from_files(spark, str(tmp_path / "out"), "public.orders")
    assert events.count() == len(read_events(workload.jsonl, "public.orders"))


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_duplicates_are_dropped(spark: Any, workload: Workload, tmp_path: Path, fmt: str) -> None:
    """At-least-once delivery: a copy of a published file under another name (and, for
    orders, every file a second time) changes nothing. Parquet: orders only (time)."""
    out = workload.jsonl if fmt == "jsonl" else workload.parquet
    suffix = f".{fmt}"
    tables = TABLES if fmt == "jsonl" else {"public.orders": TABLES["public.orders"]}
    for table, keys in tables.items():
        shutil.copytree(out / table, tmp_path / table)
        files = data_files(out / table, suffix)
        shutil.copy(files[len(files) // 2], tmp_path / table / f"FFFFFFFFFFFFFFFF-00000000{suffix}")
        if table == "public.orders":
            for path in files:
                shutil.copy(path, tmp_path / table / f"{path.stem}-again{suffix}")
        events = events_from_files(spark, str(tmp_path), table, fmt).cache()
        published = len(read_events(workload.jsonl, table))  # both sinks hold the same events
        assert events.count() > published
        assert deduplicate(events).count() == published
        assert_same_state(latest_state(events, keys), workload, table)
        events.unpersist()


def test_apply_changes_in_batches_is_idempotent(spark: Any, workload: Workload) -> None:
    """Applying each table's events in overlapping batches of files (replays of the previous
    batch's last file), then the whole stream again, gives the source table. Tombstones stay
    in the state, hidden; the truncate of ``items`` falls inside a later batch."""
    for table, keys in TABLES.items():
        schema = workload.schema(spark, table)
        files = [str(p) for p in data_files(workload.jsonl / table)]
        step = max(1, len(files) // 2)
        state = None
        for i in range(0, len(files), step):
            batch = spark.read.schema(schema).json(files[max(0, i - 1) : i + step])
            state = apply_changes(state, batch, keys).localCheckpoint()
        assert state is not None
        state = apply_changes(state, spark.read.schema(schema).json(files), keys)
        assert_same_state(current_rows(state), workload, table)
        if table == "public.orders":
            deleted = {r["id"] for r in state.where("_cdc_deleted").select("id").collect()}
            assert {5, 7, 8} <= deleted


def test_streaming_available_now(spark: Any, workload: Workload, tmp_path: Path) -> None:
    """``stream_table`` into Delta with ``trigger(availableNow=True)`` and up to three files
    per micro-batch: first half the files of ``orders``, then the rest plus a replayed file,
    restarting from the checkpoint."""
    table = "public.orders"
    src, checkpoint = tmp_path / "src", str(tmp_path / "cp")
    target = table_ref(str(tmp_path / "orders"))
    shutil.copytree(workload.jsonl / table / "_schema", src / table / "_schema")
    files = data_files(workload.jsonl / table)
    half = len(files) // 2
    assert half >= 2, f"{table}: too few files ({len(files)}) for several micro-batches"

    def run_stream() -> None:
        query = stream_table(spark, table, target, checkpoint, str(src), max_files_per_trigger=3)
        query.awaitTermination()
        assert query.exception() is None

    for path in files[:half]:
        shutil.copy2(path, src / table / path.name)
    run_stream()
    first = events_from_files(spark, str(src), table)
    assert Counter(normal_rows(spark_rows(table_rows(spark, target)))) == Counter(
        normal_rows(spark_rows(latest_state(first, ["id"])))
    )
    for path in files[half:]:
        shutil.copy2(path, src / table / path.name)
    replay = src / table / "FFFFFFFFFFFFFFFF-00000000.jsonl"
    shutil.copy2(files[0], replay)  # a replay, published after the others
    os.utime(replay, (files[-1].stat().st_mtime + 1,) * 2)
    run_stream()
    assert_same_state(table_rows(spark, target), workload, table)


async def test_kafka_records(spark: Any, workload: Workload, kafka_broker: KafkaBroker) -> None:
    """cdcd's Kafka sink into the broker; the records, consumed by aiokafka, become a
    DataFrame of Kafka source columns; tombstones dropped, the state equals the source."""
    write_config(
        workload.kafka_cfg.parent,
        workload.db.dsn,
        slot="cdcd_spark_kafka",
        name="sparkjobs",
        sinks=[{"type": "kafka", "bootstrap_servers": kafka_broker.bootstrap}],
    )
    endpos = workload.db.fetchval("SELECT pg_current_wal_lsn()::text")
    run_cdcd("run", "--config", str(workload.kafka_cfg), "--endpos", endpos)
    for table, keys in TABLES.items():
        file_events = read_events(workload.jsonl, table)
        deletes = sum(e["op"] == "d" and e["key"] is not None for e in file_events)
        records = await consume(
            kafka_broker.bootstrap, f"sparkjobs.{table}", len(file_events) + deletes
        )
        assert sum(r.value is None for r in records) == deletes  # the tombstones
        frame = kafka_records_frame(spark, records + records[:3])  # and a redelivery
        events = events_from_kafka_records(spark, frame)
        assert events.count() == len(file_events) + 3
        assert_same_state(latest_state(events, keys), workload, table)
        if table != "public.orders":
            continue
        # with the schema of the files (as a streaming read would need)
        schema = workload.schema(spark, table)
        typed = events_from_kafka_records(spark, frame, schema=schema)
        assert_same_state(latest_state(typed), workload, table)


@pytest.mark.timeout(900)  # four streaming queries, each a JVM-side Kafka consumer
async def test_kafka_to_delta_streaming(
    spark: Any, workload: Workload, kafka_broker: KafkaBroker, tmp_path: Path
) -> None:
    """PostgreSQL → cdcd → Kafka → Structured Streaming (Spark's Kafka source,
    ``read_committed``) → Delta Lake, for ``items`` (a truncate, then a column added) and
    ``docs`` (key changes leaving the TOASTed body unchanged): cdcd first streams the workload
    up to the truncate and the query of ``items`` runs (availableNow) and stops; then cdcd
    streams the rest, the query of ``items`` restarts from its checkpoint and the one of
    ``docs`` starts. Each table equals the source."""
    write_config(
        workload.stream_cfg.parent,
        workload.db.dsn,
        slot="cdcd_spark_stream",
        name="sparkstream",
        sinks=[{"type": "kafka", "bootstrap_servers": kafka_broker.bootstrap}],
    )
    tables = ("public.items", "public.docs")

    def stream_all(tables: tuple[str, ...]) -> None:
        for table in tables:
            query = stream_table(
                spark,
                table,
                str(tmp_path / table),
                str(tmp_path / f"cp-{table}"),
                kafka_bootstrap=kafka_broker.bootstrap,
                topic=f"sparkstream.{table}",
                read_committed=True,
            )
            query.awaitTermination()
            assert query.exception() is None, table

    run_cdcd("run", "--config", str(workload.stream_cfg), "--endpos", workload.mid_lsn)
    stream_all(tables[:1])  # docs has no event (and no topic) yet
    items = table_ref(str(tmp_path / "public.items"))
    assert "extra" not in spark.table(items).columns
    assert table_rows(spark, items).count() == 0  # truncated, nothing inserted yet
    endpos = workload.db.fetchval("SELECT pg_current_wal_lsn()::text")
    run_cdcd("run", "--config", str(workload.stream_cfg), "--endpos", endpos)
    stream_all(tables)
    for table in tables:
        assert_same_state(table_rows(spark, table_ref(str(tmp_path / table))), workload, table)


def test_s3_files_to_iceberg(spark: Any, workload: Workload, tmp_path: Path) -> None:
    """The JSON Lines file sink on S3 (moto on loopback) → Structured Streaming over
    ``s3a://`` → Iceberg (the session's hadoop catalog): ``items`` (a truncate, a column
    added) equals the source."""
    from cdcd.spark.session import s3_conf

    store = workload.s3
    assert store.endpoint and store.access_key and store.secret_key
    settings = s3_conf(store.endpoint, store.access_key, store.secret_key, store.region)
    for key, value in settings.items():  # the session's Hadoop settings, at run time
        spark.conf.set(key.removeprefix("spark.hadoop."), value)
    spark.sql("CREATE NAMESPACE IF NOT EXISTS iceberg.cdcd_test")
    target = "iceberg.cdcd_test.items_from_s3"
    spark.sql(f"DROP TABLE IF EXISTS {target}")
    query = stream_table(
        spark,
        "public.items",
        target,
        str(tmp_path / "cp"),
        path=f"s3a://{workload.s3_prefix}",
        target_format="iceberg",
    )
    query.awaitTermination()
    assert query.exception() is None
    assert_same_state(table_rows(spark, target), workload, "public.items")


async def consume(bootstrap: str, topic: str, count: int) -> list[Any]:
    consumer = AIOKafkaConsumer(
        topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest", enable_auto_commit=False
    )
    await consumer.start()
    records: list[Any] = []
    try:
        for _ in range(120):
            if len(records) >= count:
                break
            for batch in (await consumer.getmany(timeout_ms=500)).values():
                records.extend(batch)
    finally:
        await consumer.stop()
    assert len(records) == count, f"{topic}: {len(records)} records, expected {count}"
    return records


def test_cli_state(spark: Any, workload: Workload, tmp_path: Path) -> None:
    """``python -m cdcd.spark state`` (in-process on the shared session) writes the state."""
    for table, keys in TABLES.items():
        output = tmp_path / table
        argv = ["state", "--input", str(workload.parquet), "--table", table]
        argv += ["--format", "parquet", "--output", str(output)]
        argv += [f"--key={k}" for k in keys]
        assert spark_cli.main(argv, spark=spark) == 0
        assert_same_state(spark.read.parquet(str(output)), workload, table)


def test_cli_help() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "cdcd.spark", "state", "--help"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    assert "--table" in proc.stdout


def synthetic(spark: Any, events: list[dict[str, Any]]) -> Any:
    """A DataFrame of contract-shaped events written here (cases a workload cannot force)."""
    import orjson
    from pyspark.sql import functions as F

    from cdcd.spark.sources import json_schema

    lines = spark.createDataFrame([(orjson.dumps(e).decode(),) for e in events], "value string")
    return lines.select(F.from_json("value", json_schema(lines)).alias("e")).select("e.*")


def event(op: str, lsn: int, seq: int, before: Any = None, after: Any = None, **src: Any) -> Any:
    key = None if before is None and after is None else {"id": (after or before)["id"]}
    return {
        "op": op,
        "before": before,
        "after": after,
        "key": key if "keyless" not in src else None,
        "source": {"commit_lsn": lsn, "seq": seq, "unchanged_toast": src.get("toast")},
    }


def test_key_changes_with_unchanged_toast(spark: Any, workload: Workload, tmp_path: Path):
    """``docs``: key changes whose new row leaves the TOASTed body unchanged, rebuilt from
    JSON Lines and Parquet, and by the streaming job one file per micro-batch (the delete and
    create of a pair can fall into different files), equal the source byte for byte."""
    table = "public.docs"
    events = read_events(workload.jsonl, table)
    creates = [e for e in events if e["op"] == "c" and e["source"].get("unchanged_toast")]
    assert creates, "the workload has no key change with an unchanged TOASTed column"
    assert all("old_key" in e["source"] for e in creates), creates  # docs/events.md
    for out, fmt in ((workload.jsonl, "jsonl"), (workload.parquet, "parquet")):
        state = latest_state(events_from_files(spark, str(out), table, fmt), ["id"])
        assert_same_state(state, workload, table)
    # Spark takes files by modification time, and files published in the same millisecond come
    # in listing order (docs/spark.md): here one second apart, in name order
    for i, path in enumerate(data_files(workload.jsonl / table)):
        os.utime(path, (1_700_000_000 + i, 1_700_000_000 + i))
    target = table_ref(str(tmp_path / "docs"))
    query = stream_table(
        spark, table, target, str(tmp_path / "cp"), str(workload.jsonl), max_files_per_trigger=1
    )
    query.awaitTermination()
    assert_same_state(table_rows(spark, target), workload, table)


def test_replays_across_batches_synthetic(spark: Any) -> None:
    """Replays delivered after newer events: a deleted key stays deleted, a keyless row is
    not deleted twice, an unchanged TOAST value is carried across batches from the state."""
    u = "__debezium_unavailable_value"
    keyed = [
        event("c", 10, 0, after={"id": 1, "t": "big", "n": 1}),
        event("c", 10, 1, after={"id": 2, "t": "two", "n": 2}),
        event("u", 20, 0, after={"id": 1, "t": u, "n": 3}, toast=["t"]),
        event("d", 30, 0, before={"id": 2, "t": None, "n": None}),
        event("u", 40, 0, after={"id": 1, "t": u, "n": 4}, toast=["t"]),
    ]
    frame = synthetic(spark, keyed)
    first = apply_changes(None, frame.where("source.commit_lsn <= 30"), ["id"]).localCheckpoint()
    state = apply_changes(first, frame, ["id"])  # replays 10..30, then 40 with a marker
    assert spark_rows(current_rows(state)) == [{"id": 1, "t": "big", "n": 4}]

    row = {"id": 0, "v": "a"}
    keyless = [
        event("c", 10, 0, after=row, keyless=True),
        event("c", 10, 1, after=row, keyless=True),
        event("d", 20, 0, before=row, keyless=True),
    ]
    frame = synthetic(spark, keyless)
    state = apply_changes(None, frame, []).localCheckpoint()
    state = apply_changes(state, frame.where("source.commit_lsn = 20"), [])  # the delete again
    assert spark_rows(current_rows(state)) == [row]


def test_reset_of_a_recreated_slot_synthetic(spark: Any) -> None:
    """docs/high-availability.md: after a slot is recreated, a reset (op t, source.snapshot
    reset) drops every earlier row, including rows deleted while no slot existed (no event
    says so); a delete may name a row not backfilled yet; the backfill (op r) refills. In one
    batch and with the reset and the backfill in later batches than the old rows."""
    reset = {
        "op": "t",
        "before": None,
        "after": None,
        "key": None,
        "source": {
            "commit_lsn": 99,
            "seq": 0,
            "snapshot": "reset",
            "truncate": {"cascade": False, "restart_identity": False},
        },
    }
    events = [
        event("c", 10, 0, after={"id": 1, "n": 1}),
        event("c", 10, 1, after={"id": 2, "n": 2}),  # deleted in the gap: must go
        event("c", 10, 2, after={"id": 3, "n": 3}),  # updated in the gap to 33
        reset,
        event("d", 110, 0, before={"id": 1, "n": None}),  # not backfilled yet
        event("r", 120, 0, after={"id": 3, "n": 33}),
        event("r", 120, 1, after={"id": 4, "n": 4}),  # inserted in the gap
        event("u", 130, 0, after={"id": 4, "n": 5}),
    ]
    frame = synthetic(spark, events)
    expected = [{"id": 3, "n": 33}, {"id": 4, "n": 5}]
    assert sorted(spark_rows(latest_state(frame, ["id"])), key=lambda r: r["id"]) == expected
    first = apply_changes(None, frame.where("source.commit_lsn < 99"), ["id"]).localCheckpoint()
    state = apply_changes(first, frame.where("source.commit_lsn >= 99"), ["id"])
    assert sorted(spark_rows(current_rows(state)), key=lambda r: r["id"]) == expected
