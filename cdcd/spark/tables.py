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
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
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
    StructType,
)

from cdcd.spark.autocdc import START_AT, AutoCdc, AutoCdcError
from cdcd.spark.columns import (
    COMMIT_LSN,
    DELETED,
    METADATA,
    SEQ,
    default_key_columns,
    is_connect,
    row_type,
)
from cdcd.spark.merge import _q, checkpoint_with_facts, merge_changes
from cdcd.spark.scd2 import SCD2_COLUMNS, merge_scd2, scd2_columns_ddl
from cdcd.spark.session import setting
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


#: Table properties of a Delta table that cdcd creates (docs/spark.md "The target table"): a
#: widening retype is applied in place; a MERGE marks the rows it replaces in deletion vectors
#: instead of rewriting every file that holds one (readers need Delta 2.3+).
DELTA_PROPERTIES = {"delta.enableTypeWidening": "true", "delta.enableDeletionVectors": "true"}


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
    scd2: bool = False,
) -> bool:
    """Create ``target`` for the events' columns, or bring its columns up to them (the
    module's rules); True when it was created (it is empty). ``label`` names the source table in errors (default: the events').
    ``scd2``: a type 2 table (:mod:`cdcd.spark.scd2`); an existing table must be of that kind."""
    row = row_type(events)
    table = read_table(spark, target)
    if table is None:
        columns = [_ddl(f.name, f.dataType) for f in row.fields]
        if scd2:
            columns += scd2_columns_ddl()
        else:
            columns += [f"{COMMIT_LSN} bigint", f"{SEQ} bigint", f"{DELETED} boolean"]
        properties = (
            " TBLPROPERTIES ("
            + ", ".join(f"'{k}' = '{v}'" for k, v in DELTA_PROPERTIES.items())
            + ")"
            if format == "delta"
            else ""
        )
        spark.sql(
            f"CREATE TABLE IF NOT EXISTS {target} ({', '.join(columns)}) USING {format}"
            + properties
        )
        return True
    have = {f.name: f.dataType for f in table.schema.fields}
    if (START_AT in have) != scd2:
        kind, other = ("a type 2", "1") if START_AT in have else ("a type 1", "2")
        raise AutoCdcError(
            f"stored_as_scd_type={other}: {target} is {kind} table (it has "
            f"{'' if START_AT in have else 'no '}{START_AT}); write to another table"
        )
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
    return False


def _label(events: DataFrame) -> str:
    first = events.select("source.schema", "source.table").limit(1).collect()
    return f"{first[0][0]}.{first[0][1]}" if first else "the table"


def narrow(events: DataFrame, columns: Sequence[str]) -> DataFrame:
    """``events`` whose ``after`` and ``before`` hold only ``columns``."""
    for side in ("after", "before"):
        side_type = events.schema[side].dataType if side in events.columns else None
        if isinstance(side_type, StructType):
            kept = [F.col(side).getField(c).alias(c) for c in columns if c in side_type.names]
            events = events.withColumn(side, F.when(F.col(side).isNotNull(), F.struct(*kept)))
    return events


#: Events per shuffle partition when a batch is applied to a keyed table. What the fold and
#: the MERGE shuffle grows with the batch, not with the table, so a micro-batch of a few
#: thousand events runs its shuffles (about ten, with Delta's own) in one partition: each
#: partition is a task to schedule, for every one of them. A large batch (the first, into an
#: empty table) gets up to ``spark.sql.shuffle.partitions``.
EVENTS_PER_PARTITION = 100_000
SHUFFLE_PARTITIONS = "spark.sql.shuffle.partitions"


@contextmanager
def batch_partitions(spark: SparkSession, events: int) -> Iterator[int]:
    """Within the block, the session's shuffles of a batch of ``events`` have one partition
    per :data:`EVENTS_PER_PARTITION` events, at most as many as configured; yields that."""
    configured = int(spark.conf.get(SHUFFLE_PARTITIONS) or "200")
    wanted = max(1, min(configured, -(-events // EVENTS_PER_PARTITION)))
    with setting(spark, SHUFFLE_PARTITIONS, str(wanted)):
        yield wanted


#: Delta: a MERGE rewrites the files it touches whole (copy-on-write) when the table's last
#: MERGE touched files of at most this many bytes, and marks the rows it replaces in deletion
#: vectors otherwise. Deletion vectors spare copying a touched file's other rows but cost
#: Spark jobs of their own (the touched files scanned twice more, the vectors written): about
#: 0.5 s a batch on 2 cores, the time to rewrite a few megabytes. A stream whose changes
#: fall among its newest rows touches small files; one scattered over a large table does not.
COPY_ON_WRITE_BYTES = 8 << 20
DELETION_VECTORS = "spark.databricks.delta.merge.deletionVectors.persistent"


def last_merge_touched(spark: SparkSession, target: str) -> int | None:
    """The bytes of the files the newest version of the Delta table ``target`` touched, when
    a MERGE made it, else None: of the files it rewrote (``numTargetBytesRemoved``), or, when
    it wrote deletion vectors, as many files as it marked times the table's mean file size
    (Delta does not count their bytes)."""
    newest = spark.sql(f"DESCRIBE HISTORY {target} LIMIT 1").collect()
    if not newest or newest[0]["operation"] != "MERGE":
        return None
    metrics = newest[0]["operationMetrics"] or {}
    marked = sum(int(metrics.get(f"numTargetDeletionVectors{k}", 0)) for k in ("Added", "Updated"))
    if not marked:
        return int(metrics.get("numTargetBytesRemoved", 0))
    detail = spark.sql(f"DESCRIBE DETAIL {target}").collect()[0]
    files, size = int(detail["numFiles"] or 0), int(detail["sizeInBytes"] or 0)
    return marked * size // files if files else 0


#: Reading a table's history runs a Spark job (a tenth of a small batch): a process reads it
#: again after this many of its MERGEs into the table (a stream changing its shape is
#: followed within as many batches), and before each one until a MERGE has made a version.
RECHECK_AFTER = 10
_touched: dict[str, tuple[int, int]] = {}  # target: (MERGEs before reading again, bytes)


def _last_touched(spark: SparkSession, target: str) -> int | None:
    left, touched = _touched.get(target, (0, 0))
    if left > 0:
        _touched[target] = (left - 1, touched)
        return touched
    found = last_merge_touched(spark, target)
    if found is not None:
        _touched[target] = (RECHECK_AFTER - 1, found)
    return found


@contextmanager
def merge_strategy(spark: SparkSession, target: str) -> Iterator[bool]:
    """Within the block, the Delta table ``target``'s MERGE copies the files it touches
    (yields True) or writes deletion vectors (False): :data:`COPY_ON_WRITE_BYTES`, as the
    table's last MERGE (:data:`RECHECK_AFTER`) found."""
    touched = _last_touched(spark, target)
    if touched is None or touched > COPY_ON_WRITE_BYTES:
        yield False
        return
    with setting(spark, DELETION_VECTORS, "false"):
        yield True


def apply_to_table(
    spark: SparkSession,
    events: DataFrame,
    target: str,
    key_columns: Sequence[str] | None = None,
    format: str = "delta",
    label: str | None = None,
    *,
    column_list: Sequence[str] | str | None = None,
    except_column_list: Sequence[str] | str | None = None,
    stored_as_scd_type: int | str = 1,
    track_history_column_list: Sequence[str] | str | None = None,
    track_history_except_column_list: Sequence[str] | str | None = None,
) -> dict[str, Any]:
    """Apply one batch of one table's ``events`` to ``target`` (created when missing): the
    module's rules, with the AUTO CDC options of :class:`cdcd.spark.autocdc.AutoCdc`.
    Returns figures (events, seconds, newest commit_lsn), also logged."""
    cdc = AutoCdc(
        column_list,
        except_column_list,
        stored_as_scd_type,
        track_history_column_list,
        track_history_except_column_list,
    )
    started = time.monotonic()
    keys = list(default_key_columns(events) if key_columns is None else key_columns)
    events, facts = checkpoint_with_facts(events, keys)
    if not facts.events:
        return {"events": 0, "seconds": 0.0, "commit_lsn": None}
    if cdc.scd2 and not keys:
        raise AutoCdcError(
            f"stored_as_scd_type=2: {label or _label(events)} has no key (give key columns)"
        )
    available = row_type(events).names
    try:
        columns = cdc.columns(available, keys)
        tracked = cdc.tracked(columns, keys)
    except AutoCdcError as exc:
        raise AutoCdcError(f"{label or _label(events)}: {exc}") from None
    if columns != available:
        events = narrow(events, columns)
    created = prepare_table(spark, target, events, format, label, cdc.scd2)
    if keys:
        with batch_partitions(spark, facts.events) as partitions:
            if partitions == 1:  # in one partition the fold needs no shuffle at all
                events = events.coalesce(1)
            if cdc.scd2:
                merge_scd2(spark, events, target, keys, tracked)
            elif created or format != "delta":
                merge_changes(
                    spark, events, target, keys, tombstones=True, into_empty=created, facts=facts
                )
            else:
                with merge_strategy(spark, target):
                    merge_changes(spark, events, target, keys, tombstones=True, facts=facts)
    else:  # a multiset (cdcd.spark.keyless): the whole table, rewritten in one commit
        current = spark.table(target)
        state = apply_changes(current, events, []).localCheckpoint()
        view = f"cdcd_keyless_{uuid.uuid4().hex[:12]}"
        state.createOrReplaceTempView(view)
        try:
            names = ", ".join(_q(c) for c in current.columns)
            spark.sql(f"INSERT OVERWRITE {target} SELECT {names} FROM {view}")
        finally:
            spark.catalog.dropTempView(view)
    result = {
        "events": facts.events,
        "seconds": time.monotonic() - started,
        "commit_lsn": facts.commit_lsn,
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
    """The visible rows of a target table: no tombstones, no hidden columns; of a type 2
    table, every version with its ``__START_AT`` / ``__END_AT``."""
    table = spark.table(target)
    if START_AT in table.columns:
        return table.drop(*(c for c in SCD2_COLUMNS if c.startswith("_cdc_")))
    return current_rows(table)


#: Spark Connect's plan cache keys a plan by its message, plan id included. Each micro-batch's
#: ``foreachBatch`` runs in a new Python worker whose plan ids start again from the same
#: number, on the query's server session: a read that an earlier batch made (the ``_schema/``
#: files, the target table) comes back from the cache with that batch's file listing, and a
#: column added since is missing. The session's plan cache is turned off for the stream.
CONNECT_PLAN_CACHE = "spark.connect.session.planCache.enabled"


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
    cdc: AutoCdc | None = None,
    once: bool = False,
) -> StreamingQuery:
    """Start a streaming query applying each micro-batch of ``events`` (a streaming DataFrame
    of one table's events; or of records that ``prepare`` turns into events, per batch) to
    ``target`` with the AUTO CDC options ``cdc`` and return it. ``available_now`` processes
    what is there and stops; ``once`` runs one micro-batch (the one a crash left unfinished,
    if any) and stops. Through Spark Connect it turns off the session's plan cache
    (:data:`CONNECT_PLAN_CACHE`)."""
    options = (cdc or AutoCdc()).options()
    if is_connect(events):
        events.sparkSession.conf.set(CONNECT_PLAN_CACHE, "false")

    def each_batch(batch: DataFrame, batch_id: int) -> None:
        spark = batch.sparkSession
        batch_events = prepare(batch) if prepare is not None else batch
        figures = apply_to_table(spark, batch_events, target, key_columns, format, label, **options)
        if figures["events"]:
            log.info("batch %d: %d events", batch_id, figures["events"])

    writer = (
        events.writeStream.foreachBatch(each_batch)
        .option("checkpointLocation", checkpoint)
        .queryName(f"cdcd-{label or 'events'}".replace(".", "-"))
    )
    if once:
        writer = writer.trigger(once=True)
    elif available_now:
        writer = writer.trigger(availableNow=True)
    else:
        writer = writer.trigger(processingTime=processing_time)
    return writer.start()


__all__ = [
    "METADATA",
    "TABLE_FORMATS",
    "SchemaChangeError",
    "apply_to_table",
    "narrow",
    "prepare_table",
    "read_table",
    "stream_to_table",
    "table_ref",
    "table_rows",
    "widens",
]
