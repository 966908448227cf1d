"""Structured streaming example: a table folder of the file sink kept as a Parquet table.

:func:`stream_files_to_parquet` reads new files of ``<src>/<schema>.<table>`` with Spark's
streaming file source (``maxFilesPerTrigger`` files per micro-batch, oldest first) and, in
``foreachBatch``, applies each micro-batch to the state with
:func:`cdcd.spark.state.apply_changes`.

Plain Parquet cannot be updated in place, so the state lives in versions:
``<dst>/v<batch id:010d>/`` is the state after micro-batch ``batch id`` (tombstones and
``_cdc_*`` columns included), complete when Spark's ``_SUCCESS`` marker is in it. A batch reads
the newest complete version older than itself and writes its own, then removes all but the
two newest. A batch that is run again after a crash (Spark replays the same batch id with the
same files) rewrites its version from the same input; :func:`apply_changes` is idempotent, so
duplicates across batches are harmless too. :func:`read_state` gives the current rows.
With Delta Lake or Iceberg one would ``MERGE`` the ``apply_changes`` result instead.

The streaming file source cannot infer a schema: pass ``schema`` (the event schema, e.g.
:func:`cdcd.spark.sources.event_schema` of the files already there, or a DDL string),
or leave it None to infer it from the files present when the stream starts.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.streaming.query import StreamingQuery
from pyspark.sql.types import StructType

from cdcd.spark.sources import event_schema, table_folder
from cdcd.spark.state import apply_changes, current_rows

VERSION_PREFIX = "v"
KEEP_VERSIONS = 2


def _hadoop_path(spark: SparkSession, *parts: Any) -> Any:
    """``org.apache.hadoop.fs.Path(*parts)`` (classic PySpark: the JVM is reachable)."""
    jvm = spark.sparkContext._jvm
    if jvm is None:
        raise RuntimeError("the versioned Parquet state needs classic PySpark (a local JVM)")
    return jvm.org.apache.hadoop.fs.Path(*parts)


def _fs(spark: SparkSession, path: str) -> tuple[Any, Any]:
    """The Hadoop FileSystem of ``path`` and the Path (works for any Hadoop URI, not only local)."""
    hpath = _hadoop_path(spark, path)
    return hpath.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration()), hpath


def state_versions(spark: SparkSession, dst: str) -> list[tuple[int, str]]:
    """Complete state versions under ``dst``: (batch id, path), oldest first."""
    fs, root = _fs(spark, dst)
    if not fs.exists(root):
        return []
    versions = []
    for status in fs.listStatus(root):
        name = status.getPath().getName()
        if status.isDirectory() and name.startswith(VERSION_PREFIX) and name[1:].isdigit():
            path = status.getPath()
            if fs.exists(_hadoop_path(spark, path, "_SUCCESS")):
                versions.append((int(name[1:]), path.toString()))
    return sorted(versions)


def read_state(spark: SparkSession, dst: str, with_metadata: bool = False) -> DataFrame | None:
    """The newest complete state under ``dst`` (visible rows unless ``with_metadata``), or
    None when no batch has completed."""
    versions = state_versions(spark, dst)
    if not versions:
        return None
    state = spark.read.parquet(versions[-1][1])
    return state if with_metadata else current_rows(state)


def apply_batch(
    spark: SparkSession,
    batch: DataFrame,
    batch_id: int,
    dst: str,
    key_columns: Sequence[str] | None = None,
) -> None:
    """Apply one micro-batch of events to the versioned state under ``dst``."""
    older = [(i, p) for i, p in state_versions(spark, dst) if i < batch_id]
    state = spark.read.parquet(older[-1][1]) if older else None
    target = f"{dst.rstrip('/')}/{VERSION_PREFIX}{batch_id:010d}"
    apply_changes(state, batch, key_columns).write.mode("overwrite").parquet(target)
    fs, _ = _fs(spark, dst)
    for _, path in state_versions(spark, dst)[:-KEEP_VERSIONS]:
        fs.delete(_hadoop_path(spark, path), True)


def stream_files_to_parquet(
    spark: SparkSession,
    src: str,
    table: str,
    dst: str,
    checkpoint: str,
    key_columns: Sequence[str] | None = None,
    schema: StructType | str | None = None,
    format: str = "jsonl",
    available_now: bool = True,
    max_files_per_trigger: int | None = None,
) -> StreamingQuery:
    """Start the stream ``<src>/<table>`` → versioned Parquet state under ``dst`` and return
    the query. ``available_now`` processes what is there and stops (``awaitTermination()``);
    otherwise it runs every 10 seconds until stopped."""
    folder = table_folder(src, table)
    if schema is None:
        schema = event_schema(spark, src, table, format)
    reader = spark.readStream.schema(schema)
    if max_files_per_trigger is not None:
        reader = reader.option("maxFilesPerTrigger", max_files_per_trigger)
    if format == "parquet":
        stream = reader.option("pathGlobFilter", "*.parquet").parquet(folder)
    else:
        stream = reader.option("pathGlobFilter", "*.jsonl").json(folder)

    def each_batch(batch: DataFrame, batch_id: int) -> None:
        apply_batch(batch.sparkSession, batch, batch_id, dst, key_columns)

    writer = stream.writeStream.foreachBatch(each_batch).option("checkpointLocation", checkpoint)
    writer = (
        writer.trigger(availableNow=True)
        if available_now
        else writer.trigger(processingTime="10 seconds")
    )
    return writer.start()
