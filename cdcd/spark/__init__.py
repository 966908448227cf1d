"""PySpark jobs that consume what cdcd's sinks write (needs ``pyspark`` and a JVM).

Only DataFrame APIs are used (no ``SparkContext``, RDDs or py4j): every job runs on a classic
session and through Spark Connect alike. :func:`cdcd.spark.session.session` builds a local
session with the pinned Delta Lake, Iceberg, Kafka and S3A packages (docs/spark.md).

Read events (:mod:`cdcd.spark.sources`, schemas from ``_schema/`` files: :mod:`cdcd.spark.schema`)::

    events_from_files(spark, path, "public.orders", format="jsonl" | "parquet")
    events_from_kafka_records(spark, kafka_records_df, schema=None)

Keep a Delta Lake or Iceberg table up to date (:mod:`cdcd.spark.tables`,
:mod:`cdcd.spark.streaming`)::

    stream_table(spark, "public.orders", "/lake/orders", checkpoint, path=... | kafka_bootstrap=...)
    apply_to_table(spark, events, "delta.`/lake/orders`")   one MERGE INTO per batch
    table_rows(spark, "delta.`/lake/orders`")               the visible rows

Both take AUTO CDC's options (:mod:`cdcd.spark.autocdc`): ``column_list``,
``except_column_list``, ``stored_as_scd_type=1|2`` (type 2: :mod:`cdcd.spark.scd2`),
``track_history_column_list``, ``track_history_except_column_list``.

Batch jobs (:mod:`cdcd.spark.state`, :mod:`cdcd.spark.history`)::

    deduplicate(events)                         one row per (source.commit_lsn, source.seq)
    latest_state(events, key_columns=None)      the table's current rows
    apply_changes(state, events, key_columns)   fold a batch onto rows, with tombstones
    current_rows(state)                         visible rows of an apply_changes state
    history(events)                             SCD type 2 versions

Command line: ``python -m cdcd.spark stream|apply|state|history ...`` (:mod:`cdcd.spark.cli`).
"""

from cdcd.spark.autocdc import AutoCdc, AutoCdcError
from cdcd.spark.history import history
from cdcd.spark.merge import merge_changes, merge_sql
from cdcd.spark.schema import event_schema_from_files, spark_type
from cdcd.spark.sources import (
    event_schema,
    events_from_files,
    events_from_kafka_records,
    kafka_records_frame,
)
from cdcd.spark.state import apply_changes, current_rows, deduplicate, latest_state
from cdcd.spark.streaming import stream_table
from cdcd.spark.tables import SchemaChangeError, apply_to_table, table_ref, table_rows

__all__ = [
    "AutoCdc",
    "AutoCdcError",
    "SchemaChangeError",
    "apply_changes",
    "apply_to_table",
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
    "spark_type",
    "stream_table",
    "table_ref",
    "table_rows",
]
