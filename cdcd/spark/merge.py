"""Applying micro-batches to a Delta Lake or Apache Iceberg table with ``MERGE INTO``.

:func:`merge_changes` applies one batch of a table's events to a table format's table that
holds the table's columns plus ``_cdc_commit_lsn`` and ``_cdc_seq`` (the position of each
row's newest event; with ``tombstones=True`` also ``_cdc_deleted``):

1. the target rows of the batch's keys (and of key-change creates' ``old_key``) are read;
2. :func:`cdcd.spark.state.apply_changes` folds the batch onto them: the latest event per key
   by ``(commit_lsn, seq)``, unchanged TOAST values and key changes filled, deletes as
   tombstones, a truncate cutting every older row;
3. one ``MERGE INTO`` (:func:`merge_sql`) writes the result: a matched row is updated only
   when the incoming position is newer, deleted when the incoming row is a delete (or, with
   ``tombstones=True``, kept as a tombstone so that a replayed older event cannot insert it
   again), a new key is inserted unless deleted; with a truncate in the batch,
   ``WHEN NOT MATCHED BY SOURCE`` deletes every row older than the truncate.

What a batch costs is what the MERGE rewrites and scans, so only the rows the batch changes
go into it (a replayed batch changes none and runs no MERGE), and with integral keys both the
read of step 1 and the MERGE's target side are bounded to the batch's key range (data
skipping: files and row groups outside it are not read). A Delta table with deletion vectors
(``delta.enableDeletionVectors``, set by :func:`cdcd.spark.tables.prepare_table`) marks the
replaced rows instead of copying every other row of the files they sit in.

The statement is the same for Delta Lake and Iceberg (``WHEN NOT MATCHED BY SOURCE`` needs
Iceberg 1.5+); the suite runs it on the versions of :data:`cdcd.spark.session.PACKAGES`.
:mod:`cdcd.spark.tables` creates and evolves the target and always keeps tombstones.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import ByteType, DataType, IntegerType, LongType, ShortType, StructType

from cdcd.spark.columns import (
    COMMIT_LSN,
    DELETED,
    ROW_OPS,
    SEQ,
    default_key_columns,
    key_value,
    row_type,
)
from cdcd.spark.state import apply_changes


def _q(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def _newer(a: str, b: str) -> str:
    return (
        f"({a}.{COMMIT_LSN} > {b}.{COMMIT_LSN} OR "
        f"({a}.{COMMIT_LSN} = {b}.{COMMIT_LSN} AND {a}.{SEQ} > {b}.{SEQ}))"
    )


#: A key range: the first key column and the smallest and largest value a batch touches.
KeyRange = tuple[str, int, int]
_INTEGRAL = (ByteType, ShortType, IntegerType, LongType)


def merge_sql(
    target: str,
    source: str,
    keys: Sequence[str],
    columns: Sequence[str],
    truncate: tuple[int, int] | None = None,
    tombstones: bool = False,
    key_range: KeyRange | None = None,
) -> str:
    """The ``MERGE INTO`` statement applying the rows of the view ``source`` (an
    :func:`~cdcd.spark.state.apply_changes` result) to the table ``target``. ``key_range``
    (every source row's key within it) bounds the target side of the join; it is left out
    with a truncate, whose ``WHEN NOT MATCHED BY SOURCE`` must see every row."""
    if not keys:
        raise ValueError("MERGE needs key columns (the table has no key)")
    written = [*columns, COMMIT_LSN, SEQ, *([DELETED] if tombstones else [])]
    on = " AND ".join(f"t.{_q(k)} = s.{_q(k)}" for k in keys)
    if key_range is not None and truncate is None:
        name, low, high = key_range
        on += f" AND t.{_q(name)} BETWEEN {int(low)} AND {int(high)}"
    assign = ", ".join(f"t.{_q(c)} = s.{_q(c)}" for c in written)
    names = ", ".join(_q(c) for c in written)
    values = ", ".join(f"s.{_q(c)}" for c in written)
    lines = [f"MERGE INTO {target} AS t", f"USING {source} AS s", f"ON {on}"]
    if not tombstones:
        lines.append(f"WHEN MATCHED AND s.{DELETED} AND {_newer('s', 't')} THEN DELETE")
    lines.append(f"WHEN MATCHED AND {_newer('s', 't')} THEN UPDATE SET {assign}")
    inserted = "" if tombstones else f" AND NOT s.{DELETED}"
    lines.append(f"WHEN NOT MATCHED{inserted} THEN INSERT ({names}) VALUES ({values})")
    if truncate is not None:
        lsn, seq = truncate
        older = f"(t.{COMMIT_LSN} < {lsn} OR (t.{COMMIT_LSN} = {lsn} AND t.{SEQ} < {seq}))"
        if tombstones:
            cleared = ", ".join(f"t.{_q(c)} = NULL" for c in columns if c not in keys)
            cut = f"t.{COMMIT_LSN} = {lsn}, t.{SEQ} = {seq}, t.{DELETED} = true"
            sets = f"{cleared}, {cut}" if cleared else cut
            lines.append(f"WHEN NOT MATCHED BY SOURCE AND {older} THEN UPDATE SET {sets}")
        else:
            lines.append(f"WHEN NOT MATCHED BY SOURCE AND {older} THEN DELETE")
    return "\n".join(lines)


def key_values(events: DataFrame, keys: list[str], types: dict[str, DataType]) -> DataFrame:
    """The key values of every row event and of every ``source.old_key``."""
    rows = events.where(F.col("op").isin(*ROW_OPS))
    found = rows.select(*(key_value(rows, k, types[k]) for k in keys))
    source = events.schema["source"].dataType
    if isinstance(source, StructType) and "old_key" in source.fieldNames():
        old = rows.where(F.col("source.old_key").isNotNull()).select(
            *(F.col("source.old_key").getField(k).cast(types[k]).alias(k) for k in keys)
        )
        found = found.unionByName(old)
    return found


#: up to this many keys a batch's keys are broadcast to the read of the target's rows
BROADCAST_KEYS = 100_000


def _touched(touched: DataFrame, keys: Sequence[str]) -> tuple[int, KeyRange | None]:
    """How many keys ``touched`` holds and the range of the first key column, when integral."""
    integral = isinstance(touched.schema[keys[0]].dataType, _INTEGRAL)
    bounds = (F.min(keys[0]), F.max(keys[0])) if integral else (F.lit(None), F.lit(None))
    count, low, high = touched.agg(F.count(F.lit(1)), *bounds).collect()[0]
    return int(count), (None if low is None else (keys[0], int(low), int(high)))


def merge_source(
    spark: SparkSession,
    events: DataFrame,
    target: str,
    key_columns: Sequence[str] | None = None,
    tombstones: bool = False,
) -> tuple[DataFrame, list[str], list[str], tuple[int, int] | None, KeyRange | None]:
    """The rows to merge (a DataFrame: only those the batch changes), the key and row
    columns, the batch's newest truncate position and the range of its keys."""
    keys = list(default_key_columns(events) if key_columns is None else key_columns)
    if not keys:
        raise ValueError("MERGE needs key columns (the table has no key)")
    types = {f.name: f.dataType for f in row_type(events).fields}
    columns = list(types)
    current = spark.table(target)
    if not tombstones:
        current = current.withColumn(DELETED, F.lit(False))
    touched = key_values(events, keys, types).distinct().localCheckpoint()
    count, bounds = _touched(touched, keys)
    if bounds is not None:
        current = current.where(F.col(bounds[0]).between(bounds[1], bounds[2]))
    if count <= BROADCAST_KEYS:
        touched = F.broadcast(touched)
    held = current.join(touched, on=keys, how="left_semi").localCheckpoint()
    rows = apply_changes(held, events, keys)
    # a key whose newest position is the one the table holds is unchanged: nothing to write
    position = [*keys, COMMIT_LSN, SEQ]
    rows = rows.join(held.select(*position), on=position, how="left_anti")
    cut = (
        events.where(F.col("op") == "t")
        .agg(F.max(F.struct("source.commit_lsn", "source.seq")).alias("p"))
        .collect()[0]["p"]
    )
    truncate = (int(cut[0]), int(cut[1])) if cut is not None else None
    return rows, keys, columns, truncate, bounds


def merge_changes(
    spark: SparkSession,
    events: DataFrame,
    target: str,
    key_columns: Sequence[str] | None = None,
    tombstones: bool = False,
    into_empty: bool = False,
) -> str | None:
    """Apply one batch of ``events`` to the table ``target`` with ``MERGE INTO``; returns the
    statement that ran, or None when the batch changes nothing (a replay). ``into_empty``:
    the table is empty (just created), so the rows are appended instead, sorted by key into
    files of disjoint key ranges, which later batches' key ranges skip."""
    events = events.localCheckpoint()
    rows, keys, columns, truncate, bounds = merge_source(
        spark, events, target, key_columns, tombstones
    )
    rows = rows.localCheckpoint()
    if truncate is None and rows.isEmpty():
        return None
    view = f"cdcd_merge_{uuid.uuid4().hex[:12]}"
    if into_empty:
        if not tombstones:
            rows = rows.where(~F.col(DELETED))
        rows = rows.repartitionByRange(*keys).sortWithinPartitions(*keys)
    rows.createOrReplaceTempView(view)
    try:
        if into_empty:
            written = ", ".join(_q(c) for c in (*columns, COMMIT_LSN, SEQ))
            written += f", {DELETED}" if tombstones else ""
            sql = f"INSERT INTO {target} ({written}) SELECT {written} FROM {view}"
        else:
            sql = merge_sql(target, view, keys, columns, truncate, tombstones, bounds)
        spark.sql(sql)
    finally:
        spark.catalog.dropTempView(view)
    return sql
