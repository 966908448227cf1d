"""Applying micro-batches to a Delta Lake or Apache Iceberg table with ``MERGE INTO``.

:func:`merge_changes` applies one batch of a table's events to a table format's table that
holds the table's columns plus ``_cdc_commit_lsn`` and ``_cdc_seq`` (the position of each
row's newest event; with ``tombstones=True`` also ``_cdc_deleted``):

1. one pass over the batch finds what it holds (:func:`batch_facts`): how many events, its
   newest truncate, the range of its keys, and whether some event takes values from the row
   the target holds (an unchanged TOAST value, the delete half of a key change);
2. :func:`cdcd.spark.state.apply_changes` folds the batch: the latest event per key by
   ``(commit_lsn, seq)``, deletes as tombstones, a truncate cutting every older row. Only when
   some event needs them are the target rows of the batch's keys (and of key-change creates'
   ``old_key``) read and folded under the batch, to fill unchanged TOAST values and key
   changes; then only the rows the batch changes are kept (a replay keeps none: no MERGE);
3. one ``MERGE INTO`` (:func:`merge_sql`) writes the result: a matched row is updated only
   when the incoming position is newer, deleted when the incoming row is a delete (or, with
   ``tombstones=True``, kept as a tombstone so that a replayed older event cannot insert it
   again), a new key is inserted unless deleted; with a truncate in the batch,
   ``WHEN NOT MATCHED BY SOURCE`` deletes every row older than the truncate. These position
   conditions alone make a batch folded on its own idempotent: an event at or before the
   position the target holds changes nothing.

What a batch costs is the fixed cost of each Spark job it runs (two before the MERGE's own
when no event needs the target rows: the pass of step 1, which also caches the batch, and
the fold) and what the MERGE scans and writes. With integral keys the MERGE's target side
(and the read of step 2) is bounded to the batch's key range (data skipping: files outside
it are not read); a batch of up to :data:`BROADCAST_KEYS` keys is broadcast to the joins. A
Delta table with deletion vectors (``delta.enableDeletionVectors``, set by
:func:`cdcd.spark.tables.prepare_table`) marks the replaced rows instead of copying every
other row of the files they sit in.

The statement is the same for Delta Lake and Iceberg (``WHEN NOT MATCHED BY SOURCE`` needs
Iceberg 1.5+); the suite runs it on the versions of :data:`cdcd.spark.session.PACKAGES`.
:mod:`cdcd.spark.tables` creates and evolves the target and always keeps tombstones.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from pyspark.sql import Column, DataFrame, SparkSession
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
    source_field,
    unchanged,
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


#: up to this many keys a batch's rows are broadcast to the joins with the target's rows
BROADCAST_KEYS = 100_000


@dataclass(frozen=True, slots=True)
class BatchFacts:
    """What a batch holds, found in one pass over its events (:func:`batch_facts`).

    ``needs_target``: some event takes values from the row the target holds (an unchanged
    TOAST value, or the delete half of a key change, whose tombstone keeps the row's values
    for the create of the new key); without one, the batch folds on its own and the MERGE's
    position conditions alone keep it idempotent. ``keys``: about how many distinct keys."""

    events: int
    row_events: int
    commit_lsn: int | None
    truncate: tuple[int, int] | None
    needs_target: bool
    keys: int
    key_range: KeyRange | None


def batch_facts(events: DataFrame, keys: Sequence[str]) -> BatchFacts:
    """:class:`BatchFacts` of ``events`` (one table's) with the key columns ``keys``."""
    is_row = F.col("op").isin(*ROW_OPS)
    position = F.struct(F.col("source.commit_lsn").cast("long"), F.col("source.seq").cast("long"))
    measures = [
        F.count(F.lit(1)),
        F.count(F.when(is_row, 1)),
        F.max("source.commit_lsn"),
        F.max(F.when(F.col("op") == "t", position)),
        F.max(F.when(is_row, _needs_target(events, keys)).cast("int")),
    ]
    types = {f.name: f.dataType for f in row_type(events).fields}
    if not all(k in types for k in keys):
        keys = []  # the fold names the missing key column
    if keys:
        key = F.struct(*(key_value(events, k, types[k]) for k in keys))
        measures.append(F.approx_count_distinct(F.when(is_row, key)))
    else:
        measures.append(F.lit(0))
    integral = bool(keys) and isinstance(types[keys[0]], _INTEGRAL)
    if integral:
        first = key_value(events, keys[0], types[keys[0]])
        old_key = source_field(events, "old_key")
        if isinstance(old_key, StructType) and keys[0] in old_key.names:
            old = F.col("source.old_key").getField(keys[0]).cast(types[keys[0]])
            low, high = F.least(first, old), F.greatest(first, old)
        else:
            low = high = first
        measures += [F.min(F.when(is_row, low)), F.max(F.when(is_row, high))]
    else:
        measures += [F.lit(None), F.lit(None)]
    count, rows, lsn, cut, needs, distinct, low, high = events.agg(*measures).collect()[0]
    return BatchFacts(
        events=int(count),
        row_events=int(rows),
        commit_lsn=None if lsn is None else int(lsn),
        truncate=None if cut is None else (int(cut[0]), int(cut[1])),
        needs_target=bool(needs),
        keys=int(distinct),
        key_range=None if low is None else (keys[0], int(low), int(high)),
    )


def _needs_target(events: DataFrame, keys: Sequence[str]) -> Column:
    """A row event that takes values from the target's row (:class:`BatchFacts`)."""
    found = F.lit(False)
    after = events.schema["after"].dataType if "after" in events.columns else None
    if isinstance(after, StructType):
        for c in after.names:
            if c not in keys:
                found = found | ((F.col("op") != "d") & unchanged(events, c))
    if source_field(events, "new_key") is not None:
        found = found | ((F.col("op") == "d") & F.col("source.new_key").isNotNull())
    return found


def merge_source(
    spark: SparkSession,
    events: DataFrame,
    target: str,
    keys: list[str],
    facts: BatchFacts,
    tombstones: bool = False,
    into_empty: bool = False,
) -> DataFrame:
    """The rows to merge: the batch folded on its own, or, when ``facts.needs_target`` (and
    the table is not ``into_empty``), onto the target rows of its keys (then only the rows the
    batch changes)."""
    if into_empty or not facts.needs_target:
        links = None if facts.needs_target else False  # key changes within the batch
        rows = apply_changes(None, events, keys, links=links)
        return F.broadcast(rows) if facts.keys <= BROADCAST_KEYS else rows
    types = {f.name: f.dataType for f in row_type(events).fields}
    current = spark.table(target)
    if not tombstones:
        current = current.withColumn(DELETED, F.lit(False))
    touched = key_values(events, keys, types).distinct()
    if facts.key_range is not None:
        name, low, high = facts.key_range
        current = current.where(F.col(name).between(low, high))
    if facts.keys <= BROADCAST_KEYS:
        touched = F.broadcast(touched)
    held = current.join(touched, on=keys, how="left_semi").localCheckpoint()
    rows = apply_changes(held, events, keys)
    # a key whose newest position is the one the table holds is unchanged: nothing to write
    position = [*keys, COMMIT_LSN, SEQ]
    return rows.join(held.select(*position), on=position, how="left_anti").localCheckpoint()


def merge_changes(
    spark: SparkSession,
    events: DataFrame,
    target: str,
    key_columns: Sequence[str] | None = None,
    tombstones: bool = False,
    into_empty: bool = False,
    facts: BatchFacts | None = None,
) -> str | None:
    """Apply one batch of ``events`` to the table ``target`` with ``MERGE INTO``; returns the
    statement that ran, or None when none ran: a batch without row events or truncates, or
    one folded onto the target's rows that changes nothing (a replay). ``into_empty``: the table is
    empty (just created), so the rows are appended instead, sorted by key into files of
    disjoint key ranges, which later batches' key ranges skip. ``facts``: the events'
    :func:`batch_facts` when the caller has them (the events are then read once more, by
    the MERGE: cache them when reading is expensive)."""
    keys = list(default_key_columns(events) if key_columns is None else key_columns)
    if not keys:
        raise ValueError("MERGE needs key columns (the table has no key)")
    if facts is None:
        events = events.localCheckpoint()
        facts = batch_facts(events, keys)
    if not facts.row_events and facts.truncate is None:
        return None
    rows = merge_source(spark, events, target, keys, facts, tombstones, into_empty)
    read = facts.needs_target and not into_empty
    if read and facts.truncate is None and rows.isEmpty():
        return None
    columns = row_type(events).names
    view = f"cdcd_merge_{uuid.uuid4().hex[:12]}"
    if into_empty:
        if not tombstones:
            rows = rows.where(~F.col(DELETED))
        rows = rows.localCheckpoint().repartitionByRange(*keys).sortWithinPartitions(*keys)
    rows.createOrReplaceTempView(view)
    try:
        if into_empty:
            written = ", ".join(_q(c) for c in (*columns, COMMIT_LSN, SEQ))
            written += f", {DELETED}" if tombstones else ""
            sql = f"INSERT INTO {target} ({written}) SELECT {written} FROM {view}"
        else:
            sql = merge_sql(
                target, view, keys, columns, facts.truncate, tombstones, facts.key_range
            )
        spark.sql(sql)
    finally:
        spark.catalog.dropTempView(view)
    return sql
