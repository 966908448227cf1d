"""The streaming job: a file sink table folder kept as an incremental Parquet state.

:func:`stream_files_to_parquet` reads new files of ``<src>/<schema>.<table>`` with Spark's
streaming file source (oldest modification time first, which is the sink's publishing order,
``maxFilesPerTrigger`` files per micro-batch; files with the same modification time come in
listing order, docs/spark.md) and, in ``foreachBatch``, applies each micro-batch with
:func:`cdcd.spark.incremental.apply_batch`: only the buckets the batch touches are read and
rewritten, and a batch Spark replays after a crash changes nothing.
:func:`cdcd.spark.incremental.read_state` gives the current rows.

The JSON Lines schema comes from the table's ``_schema/`` files (:mod:`cdcd.spark.schema`)
unless given, read when the stream starts: restart the stream after a schema change that adds
columns (Spark's file source has one schema per query). Every micro-batch logs its figures, and
how far its newest position is behind the newest file in the folder (WAL bytes between the two
commit LSNs, from the file names). Only DataFrame APIs are used: it runs the same under Spark
Connect, where ``foreachBatch`` runs in a Python worker of the server.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming.query import StreamingQuery
from pyspark.sql.types import StructType

from cdcd.spark.incremental import apply_batch, read_state
from cdcd.spark.schema import table_folder
from cdcd.spark.sources import _check_format, event_schema

log = logging.getLogger("cdcd.spark")

__all__ = ["newest_file_lsn", "read_state", "stream_files_to_parquet"]


def newest_file_lsn(spark: SparkSession, folder: str, suffix: str) -> int | None:
    """The commit LSN in the name of the newest data file of ``folder`` (a listing, no data
    read: the binary file source reads no content unless asked)."""
    rows = (
        spark.read.format("binaryFile")
        .option("pathGlobFilter", f"*{suffix}")
        .load(folder)
        .select(F.max(F.element_at(F.split("path", "/"), -1)).alias("name"))
        .collect()
    )
    name = rows[0]["name"] if rows else None
    try:
        return int(name.split("-")[0], 16) if name else None
    except ValueError:
        return None


def _each_batch(
    folder: str, suffix: str, dst: str, keys: Sequence[str] | None, layout: str
) -> object:
    def each_batch(batch: DataFrame, batch_id: int) -> None:
        spark = batch.sparkSession
        figures = apply_batch(spark, batch, dst, keys, layout, batch_id)
        if figures["events"] and log.isEnabledFor(logging.INFO):
            newest = newest_file_lsn(spark, folder, suffix)
            lag = max(0, (newest or 0) - int(figures["commit_lsn"]))
            log.info("batch %d: %d WAL bytes behind the newest file", batch_id, lag)

    return each_batch


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
    layout: str = "auto",
    processing_time: str = "10 seconds",
) -> StreamingQuery:
    """Start the stream ``<src>/<table>`` → incremental Parquet state under ``dst`` and return
    the query. ``available_now`` processes what is there and stops (``awaitTermination()``);
    otherwise a micro-batch starts every ``processing_time`` until stopped."""
    folder = table_folder(src, table)
    suffix = f".{_check_format(format)}"
    if schema is None:
        schema = event_schema(spark, src, table, format)
    reader = spark.readStream.schema(schema).option("pathGlobFilter", f"*{suffix}")
    if max_files_per_trigger is not None:
        reader = reader.option("maxFilesPerTrigger", max_files_per_trigger)
    if format == "parquet":
        stream = reader.parquet(folder)
    else:
        stream = reader.option("mode", "FAILFAST").json(folder)
    writer = stream.writeStream.foreachBatch(
        _each_batch(folder, suffix, dst, key_columns, layout)  # type: ignore[arg-type]
    ).option("checkpointLocation", checkpoint)
    writer = (
        writer.trigger(availableNow=True)
        if available_now
        else writer.trigger(processingTime=processing_time)
    )
    return writer.start()
