"""Delta Lake and Iceberg tables kept up to date from change events with ``MERGE INTO``.

A target table holds the source table's columns plus three hidden ones:

    _cdc_commit_lsn, _cdc_seq   position ``(source.commit_lsn, source.seq)`` of the row's newest
                                event: an event at or before it changes nothing
    _cdc_deleted                true for a tombstone: a deleted (or truncated) row, kept so that
                                an older event of that key delivered again cannot bring it back

:func:`current_rows` (or a view over ``WHERE NOT _cdc_deleted``) shows the visible rows.

:func:`apply_to_table` applies one batch of one table's events in one ``MERGE INTO``
(:mod:`cdcd.spark.merge`): one commit of the table format, so a batch is applied whole or not at
all, and a batch applied twice (Spark replays the last micro-batch after a crash; cdcd delivers
at least once) changes nothing. Before the MERGE the target follows the events' columns
(:func:`prepare_table`): it is created on the first batch; a column the events have and the
table lacks is added (null in the rows written before); a dropped column stays in the table
and is null in rows written after the drop (nothing is deleted); a column whose type widened
(``int`` → ``bigint``, ``float`` → ``double``, a decimal's precision) is widened in place
(Delta's type widening, Iceberg's schema evolution). Any other type change stops the batch
with :class:`SchemaChangeError`, naming the table, the column, both types and the first
position of the batch: convert the column (or rebuild the table) and restart the stream.

A table without a key (rows as a multiset, :mod:`cdcd.spark.keyless`) is rewritten whole by
each batch, in one ``INSERT OVERWRITE`` (one commit as well).

:func:`stream_to_table` runs a streaming query whose ``foreachBatch`` does this per
micro-batch: the table is the query's sink, the checkpoint its progress.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

from pyspark.errors import AnalysisException
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.streaming.query import StreamingQuery
from pyspark.sql.types import (
    ByteType,
    DataType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    ShortType,
)

from cdcd.spark.columns import COMMIT_LSN, DELETED, METADATA, SEQ, default_key_columns, row_type
from cdcd.spark.merge import _q, merge_changes
from cdcd.spark.state import apply_changes, current_rows

log = logging.getLogger("cdcd.spark")

TABLE_FORMATS = ("delta", "iceberg")
_INTEGRAL = (ByteType, ShortType, IntegerType, LongType)
#: how Spark, Delta and Iceberg say that a table does not exist
_MISSING = (
    "TABLE_OR_VIEW_NOT_FOUND",
    "PATH_NOT_FOUND",
    "DELTA_MISSING_DELTA_TABLE",
    "DELTA_TABLE_NOT_FOUND",
    "is not a Delta table",
)


class SchemaChangeError(ValueError):
    """A column's type changed in a way the target table cannot follow in place."""


def table_ref(target: str, format: str = "delta") -> str:
    """The SQL name of ``target``: a Delta path (``/…``, ``s3a://…``) becomes ``delta.`path```;
    a table name is used as it is."""
    if format not in TABLE_FORMATS:
        raise ValueError(f"table format must be one of {', '.join(TABLE_FORMATS)}: {format!r}")
    if "/" in target and not target.startswith(("delta.`", "`")):
        if format != "delta":
            raise ValueError(f"an Iceberg target is a catalog table name, not a path: {target}")
        return "delta.`" + target.replace("`", "``") + "`"
    return target


def read_table(spark: SparkSession, target: str) -> DataFrame | None:
    """The target table, or None when it does not exist yet."""
    try:
        table = spark.table(target)
        table.schema  # noqa: B018  (Spark Connect analyses lazily: fail here, not later)
    except AnalysisException as exc:
        text = str(exc)
        if any(word in text for word in _MISSING):
            return None
        raise
    return table


def widens(old: DataType, new: DataType) -> bool:
    """Whether a column of type ``old`` can take values of type ``new`` by widening in place."""
    if old == new:
        return True
    if isinstance(old, _INTEGRAL) and isinstance(new, _INTEGRAL):
        return _INTEGRAL.index(type(new)) > _INTEGRAL.index(type(old))
    if isinstance(old, FloatType) and isinstance(new, DoubleType):
        return True
    if isinstance(old, DecimalType) and isinstance(new, DecimalType):
        return new.scale == old.scale and new.precision >= old.precision
    return False


def _first_position(events: DataFrame) -> str:
    first = events.agg(F.min(F.struct("source.commit_lsn", "source.seq")).alias("p")).collect()
    p = first[0]["p"] if first else None
    if p is None:
        return "unknown"
    lsn = int(p[0])
    return f"commit_lsn {lsn >> 32:X}/{lsn & 0xFFFFFFFF:X} ({lsn}), seq {int(p[1])}"


def _ddl(name: str, data_type: DataType) -> str:
    return f"{_q(name)} {data_type.simpleString()}"


def prepare_table(
    spark: SparkSession,
    target: str,
    events: DataFrame,
    format: str = "delta",
    label: str | None = None,
) -> None:
    """Create ``target`` for the events' columns, or bring its columns up to them (the
    module's rules). ``label`` names the source table in errors (default: the events')."""
    row = row_type(events)
    table = read_table(spark, target)
    if table is None:
        columns = [_ddl(f.name, f.dataType) for f in row.fields]
        columns += [f"{COMMIT_LSN} bigint", f"{SEQ} bigint", f"{DELETED} boolean"]
        properties = (
            " TBLPROPERTIES ('delta.enableTypeWidening' = 'true')" if format == "delta" else ""
        )
        spark.sql(
            f"CREATE TABLE IF NOT EXISTS {target} ({', '.join(columns)}) USING {format}"
            + properties
        )
        return
    have = {f.name: f.dataType for f in table.schema.fields}
    missing = [f for f in row.fields if f.name not in have]
    for f in row.fields:
        old = have.get(f.name)
        if old is None or old == f.dataType or widens(f.dataType, old):
            continue  # new, same, or narrower values into a wider column
        if not widens(old, f.dataType):
            where = label or _label(events)
            raise SchemaChangeError(
                f"{where}: column {f.name!r} changed type from {old.simpleString()} to "
                f"{f.dataType.simpleString()} at or after {_first_position(events)}; "
                f"{target} cannot take it in place (only widening is): convert the column "
                "or rebuild the table, then restart"
            )
        new_type = f.dataType.simpleString()
        spark.sql(f"ALTER TABLE {target} ALTER COLUMN {_q(f.name)} TYPE {new_type}")
    if missing:
        added = ", ".join(_ddl(f.name, f.dataType) for f in missing)
        spark.sql(f"ALTER TABLE {target} ADD COLUMNS ({added})")


def _label(events: DataFrame) -> str:
    first = events.select("source.schema", "source.table").limit(1).collect()
    return f"{first[0][0]}.{first[0][1]}" if first else "the table"


def apply_to_table(
    spark: SparkSession,
    events: DataFrame,
    target: str,
    key_columns: Sequence[str] | None = None,
    format: str = "delta",
    label: str | None = None,
) -> dict[str, Any]:
    """Apply one batch of one table's ``events`` to ``target`` (created when missing): the
    module's rules. Returns figures (events, seconds, newest commit_lsn), also logged."""
    started = time.monotonic()
    events = events.localCheckpoint()
    figures = events.agg(
        F.count(F.lit(1)).alias("events"), F.max("source.commit_lsn").alias("commit_lsn")
    ).collect()[0]
    if not figures["events"]:
        return {"events": 0, "seconds": 0.0, "commit_lsn": None}
    keys = list(default_key_columns(events) if key_columns is None else key_columns)
    prepare_table(spark, target, events, format, label)
    if keys:
        merge_changes(spark, events, target, keys, tombstones=True)
    else:  # a multiset (cdcd.spark.keyless): the whole table, rewritten in one commit
        current = spark.table(target)
        state = apply_changes(current, events, []).localCheckpoint()
        view = f"cdcd_keyless_{uuid.uuid4().hex[:12]}"
        state.createOrReplaceTempView(view)
        try:
            columns = ", ".join(_q(c) for c in current.columns)
            spark.sql(f"INSERT OVERWRITE {target} SELECT {columns} FROM {view}")
        finally:
            spark.catalog.dropTempView(view)
    result = {
        "events": int(figures["events"]),
        "seconds": time.monotonic() - started,
        "commit_lsn": figures["commit_lsn"],
    }
    log.info(
        "%s: %d events merged in %.2fs (up to commit_lsn %s)",
        target,
        result["events"],
        result["seconds"],
        result["commit_lsn"],
    )
    return result


def table_rows(spark: SparkSession, target: str) -> DataFrame:
    """The visible rows of a target table: no tombstones, no hidden columns."""
    return current_rows(spark.table(target))


def stream_to_table(
    events: DataFrame,
    target: str,
    checkpoint: str,
    key_columns: Sequence[str] | None = None,
    format: str = "delta",
    available_now: bool = True,
    processing_time: str = "10 seconds",
    prepare: Callable[[DataFrame], DataFrame] | None = None,
    label: str | None = None,
) -> StreamingQuery:
    """Start a streaming query applying each micro-batch of ``events`` (a streaming DataFrame
    of one table's events; or of records that ``prepare`` turns into events, per batch) to
    ``target`` and return it. ``available_now`` processes what is there and stops."""

    def each_batch(batch: DataFrame, batch_id: int) -> None:
        spark = batch.sparkSession
        batch_events = prepare(batch) if prepare is not None else batch
        figures = apply_to_table(spark, batch_events, target, key_columns, format, label)
        if figures["events"]:
            log.info("batch %d: %d events", batch_id, figures["events"])

    writer = (
        events.writeStream.foreachBatch(each_batch)
        .option("checkpointLocation", checkpoint)
        .queryName(f"cdcd-{label or 'events'}".replace(".", "-"))
    )
    writer = (
        writer.trigger(availableNow=True)
        if available_now
        else writer.trigger(processingTime=processing_time)
    )
    return writer.start()


__all__ = [
    "METADATA",
    "TABLE_FORMATS",
    "SchemaChangeError",
    "apply_to_table",
    "prepare_table",
    "read_table",
    "stream_to_table",
    "table_ref",
    "table_rows",
    "widens",
]
