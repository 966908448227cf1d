"""PySpark jobs that consume what cdcd's sinks write (needs ``pyspark`` and a JVM).

Read events (:mod:`cdcd.spark.sources`)::

    events_from_files(spark, path, "public.orders", format="jsonl" | "parquet")
    events_from_kafka_records(spark, kafka_records_df, schema=None)

Turn them into state (:mod:`cdcd.spark.state`)::

    deduplicate(events)                         one row per (source.commit_lsn, source.seq)
    latest_state(events, key_columns=None)      the table's current rows
    apply_changes(state, events, key_columns)   micro-batch upsert, with tombstones
    current_rows(state)                         visible rows of an apply_changes state

Stream (:mod:`cdcd.spark.streaming`)::

    stream_files_to_parquet(spark, src, "public.orders", dst, checkpoint)

Command line: ``python -m cdcd.spark state|stream ...`` (:mod:`cdcd.spark.cli`).
"""

from cdcd.spark.sources import (
    event_schema,
    events_from_files,
    events_from_kafka_records,
    kafka_records_frame,
)
from cdcd.spark.state import apply_changes, current_rows, deduplicate, latest_state
from cdcd.spark.streaming import read_state, stream_files_to_parquet

__all__ = [
    "apply_changes",
    "current_rows",
    "deduplicate",
    "event_schema",
    "events_from_files",
    "events_from_kafka_records",
    "kafka_records_frame",
    "latest_state",
    "read_state",
    "stream_files_to_parquet",
]
