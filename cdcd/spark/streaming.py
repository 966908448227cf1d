"""The streaming job: one table's events, from files or Kafka, kept in a Delta Lake or Iceberg
table with Structured Streaming (:mod:`cdcd.spark.tables`: one ``MERGE INTO`` per micro-batch,
idempotent by position).

Sources:

* **JSON Lines files** (``path``, the file sink's output, local or ``s3a://``): new files of
  ``<path>/<schema>.<table>`` are read as text with Spark's streaming file source (oldest
  modification time first, the sink's publishing order; ``max_files_per_trigger`` files per
  micro-batch) and parsed *per micro-batch* with the schema of the table's ``_schema/`` files
  as they are then: a column added while the stream runs appears in the next batch.
* **Parquet files**: the same folder, read with the schema of its files when the stream starts
  (restart the stream after a column is added).
* **Kafka** (``kafka_bootstrap``, topic ``<name>.<schema>.<table>``): Spark's Kafka source,
  ``kafka.isolation.level=read_committed`` with ``read_committed`` (cdcd's exactly-once mode:
  aborted transactions are never seen). Each micro-batch's values are parsed with the
  ``_schema/`` files of ``schema_from`` (a file sink path, when one is written too), else with
  the target table's columns plus, for fields the table lacks, types inferred from the batch's
  values (a type 2 target's ``__START_AT`` / ``__END_AT`` are not source columns). Tombstones
  (null values) are dropped; the headers ``cdcd.commit_lsn``/``cdcd.seq``
  repeat what the value's ``source`` holds.

Restarting a query from its checkpoint resumes after the last committed micro-batch; the one
that was running when it stopped is run again and changes nothing it already changed. Spark
4.1's Kafka source then fails the query once that batch is committed (a null pointer reporting
its progress, SPARK-55271: its latest offsets are unknown because the batch came from the
checkpoint): a Kafka stream whose checkpoint holds an unfinished batch runs that batch alone
first (``trigger(once=True)``) and then starts the query, which reads on from the commit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

from pyspark.errors import AnalysisException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming.query import StreamingQuery
from pyspark.sql.types import DataType, StructField, StructType

from cdcd.spark.autocdc import END_AT, START_AT, AutoCdc
from cdcd.spark.columns import METADATA
from cdcd.spark.schema import event_schema_for, event_schema_from_files, table_folder
from cdcd.spark.sources import (
    _check_format,
    _infer_event_schema,
    event_schema,
    events_from_kafka_records,
)
from cdcd.spark.tables import read_table, stream_to_table, table_ref

log = logging.getLogger("cdcd.spark")

__all__ = ["kafka_batch_schema", "stream_table"]


def kafka_batch_schema(
    spark: SparkSession, records: DataFrame, target: str, table: str
) -> StructType:
    """The event schema for a batch of Kafka records of ``table`` without ``_schema/`` files:
    the target's columns and types, then the fields it lacks with types inferred from the
    values (a new column); the key columns are those of the records' keys."""
    values = records.where(F.col("value").isNotNull()).select(
        F.col("value").cast("string").alias("value"), F.col("key").cast("string").alias("key")
    )
    inferred = _infer_event_schema(spark, values)
    seen: dict[str, DataType] = {}
    for side in ("after", "before"):
        side_type = inferred[side].dataType if side in inferred.fieldNames() else None
        if isinstance(side_type, StructType):
            for f in side_type.fields:
                seen.setdefault(f.name, f.dataType)
    existing = read_table(spark, target)
    have = {
        f.name: f.dataType
        for f in (existing.schema.fields if existing is not None else [])
        if f.name not in METADATA and f.name not in (START_AT, END_AT)
    }
    columns = {**have, **{name: t for name, t in seen.items() if name not in have}}
    key_type = inferred["key"].dataType
    key = tuple(key_type.fieldNames()) if isinstance(key_type, StructType) else ()
    if any(k not in columns for k in key):
        raise ValueError(f"{table}: the Kafka keys name columns the values lack: {key}")
    row = StructType([StructField(name, t) for name, t in columns.items()])
    return event_schema_for(row, key)


def stream_table(
    spark: SparkSession,
    table: str,
    target: str,
    checkpoint: str,
    path: str | None = None,
    format: str = "jsonl",
    kafka_bootstrap: str | None = None,
    topic: str | None = None,
    read_committed: bool = False,
    schema_from: str | None = None,
    key_columns: Sequence[str] | None = None,
    target_format: str = "delta",
    available_now: bool = True,
    max_files_per_trigger: int | None = None,
    processing_time: str = "10 seconds",
    kafka_options: Mapping[str, str] | None = None,
    *,
    column_list: Sequence[str] | str | None = None,
    except_column_list: Sequence[str] | str | None = None,
    stored_as_scd_type: int | str = 1,
    track_history_column_list: Sequence[str] | str | None = None,
    track_history_except_column_list: Sequence[str] | str | None = None,
) -> StreamingQuery:
    """Start the stream of ``table`` (``schema.table``) into ``target`` (a Delta folder or a
    table name, :func:`cdcd.spark.tables.table_ref`) and return the query (see the module).
    The keyword-only options are AUTO CDC's (:mod:`cdcd.spark.autocdc`), checked here."""
    cdc = AutoCdc(
        column_list,
        except_column_list,
        stored_as_scd_type,
        track_history_column_list,
        track_history_except_column_list,
    )
    ref = table_ref(target, target_format)
    prepare: Callable[[DataFrame], DataFrame] | None = None
    if kafka_bootstrap is not None:
        reader = (
            spark.readStream.format("kafka")
            .option("kafka.bootstrap.servers", kafka_bootstrap)
            .option("subscribe", topic or table)
            .option("startingOffsets", "earliest")
            .option("includeHeaders", "true")
            .option("failOnDataLoss", "true")
        )
        if read_committed:
            reader = reader.option("kafka.isolation.level", "read_committed")
        for key, value in (kafka_options or {}).items():
            reader = reader.option(key, value)
        records = reader.load()

        def from_kafka(batch: DataFrame) -> DataFrame:
            batch_spark = batch.sparkSession
            if schema_from is not None:
                schema = event_schema_from_files(batch_spark, schema_from, table)
            else:
                schema = kafka_batch_schema(batch_spark, batch, ref, table)
            return events_from_kafka_records(batch_spark, batch, schema)

        source, prepare = records, from_kafka
    else:
        if path is None:
            raise ValueError("a stream needs a file sink path or a Kafka bootstrap address")
        folder = table_folder(path, table)
        suffix = f".{_check_format(format)}"
        files = spark.readStream.option("pathGlobFilter", f"*{suffix}")
        if max_files_per_trigger is not None:
            files = files.option("maxFilesPerTrigger", max_files_per_trigger)
        if format == "parquet":
            source = files.schema(event_schema(spark, path, table, format)).parquet(folder)
        else:
            source, prepare = files.text(folder), _parse_lines(path, table)

    def start(once: bool = False) -> StreamingQuery:
        return stream_to_table(
            source,
            ref,
            checkpoint,
            key_columns,
            target_format,
            available_now,
            processing_time,
            prepare=prepare,
            label=table,
            cdc=cdc,
            once=once,
        )

    if kafka_bootstrap is not None and unfinished_batch(spark, checkpoint):
        _finish_batch(spark, checkpoint, table, start)
    return start()


def unfinished_batch(spark: SparkSession, checkpoint: str) -> bool:
    """Whether the newest micro-batch of the query checkpointed in ``checkpoint`` has its
    offsets written and no commit (the query stopped in it)."""

    def batches(kind: str) -> set[int]:
        try:
            found = spark.read.format("binaryFile").load(f"{checkpoint.rstrip('/')}/{kind}")
            paths = [row["path"] for row in found.select("path").collect()]
        except AnalysisException:  # no such folder: no batch yet
            return set()
        names = (path.rstrip("/").rsplit("/", 1)[-1] for path in paths)
        return {int(name) for name in names if name.isdigit()}

    offsets = batches("offsets")
    return bool(offsets) and max(offsets) not in batches("commits")


def _finish_batch(
    spark: SparkSession, checkpoint: str, table: str, start: Callable[[bool], StreamingQuery]
) -> None:
    """Run the unfinished micro-batch of ``checkpoint`` alone (see the module: SPARK-55271).
    An error is raised unless the batch got committed."""
    query = start(True)
    try:
        query.awaitTermination()
    except Exception as exc:
        if unfinished_batch(spark, checkpoint):
            raise
        log.info("%s: the unfinished micro-batch is done (then: %s)", table, str(exc)[:200])


def _parse_lines(path: str, table: str) -> Callable[[DataFrame], DataFrame]:
    """Parse a micro-batch of JSON Lines with the ``_schema/`` files as they are now."""

    def from_lines(batch: DataFrame) -> DataFrame:
        schema = event_schema_from_files(batch.sparkSession, path, table)
        parsed = batch.select(F.from_json("value", schema, {"mode": "FAILFAST"}).alias("e"))
        return parsed.select("e.*")

    return from_lines
