"""PySpark jobs that consume what cdcd's sinks write (needs ``pyspark`` and a JVM).

Only DataFrame APIs are used (no ``SparkContext``, RDDs or py4j): every job runs on a classic
session and through Spark Connect alike.

Read events (:mod:`cdcd.spark.sources`, schemas from ``_schema/`` files: :mod:`cdcd.spark.schema`)::

    events_from_files(spark, path, "public.orders", format="jsonl" | "parquet")
    events_from_kafka_records(spark, kafka_records_df, schema=None)

Turn them into state (:mod:`cdcd.spark.state`), history, table formats::

    deduplicate(events)                         one row per (source.commit_lsn, source.seq)
    latest_state(events, key_columns=None)      the table's current rows
    apply_changes(state, events, key_columns)   micro-batch upsert, with tombstones
    current_rows(state)                         visible rows of an apply_changes state
    history(events)                             SCD type 2 versions (cdcd.spark.history)
    merge_changes(spark, events, "db.orders")   MERGE INTO Delta/Iceberg (cdcd.spark.merge)

Incremental state and streaming (:mod:`cdcd.spark.incremental`, :mod:`cdcd.spark.streaming`)::

    apply_batch(spark, events, dst)             rewrite only the buckets a batch touches
    stream_files_to_parquet(spark, src, "public.orders", dst, checkpoint)
    read_state(spark, dst)

Command line: ``python -m cdcd.spark state|apply|history|stream ...`` (:mod:`cdcd.spark.cli`).
"""

from cdcd.spark.history import history
from cdcd.spark.incremental import apply_batch, read_state, rebuild
from cdcd.spark.merge import merge_changes, merge_sql
from cdcd.spark.schema import event_schema_from_files, spark_type
from cdcd.spark.sources import (
    event_schema,
    events_from_files,
    events_from_kafka_records,
    kafka_records_frame,
)
from cdcd.spark.state import apply_changes, current_rows, deduplicate, latest_state
from cdcd.spark.streaming import stream_files_to_parquet

__all__ = [
    "apply_batch",
    "apply_changes",
    "current_rows",
    "deduplicate",
    "event_schema",
    "event_schema_from_files",
    "events_from_files",
    "events_from_kafka_records",
    "history",
    "kafka_records_frame",
    "latest_state",
    "merge_changes",
    "merge_sql",
    "read_state",
    "rebuild",
    "spark_type",
    "stream_files_to_parquet",
]
