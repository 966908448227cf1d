"""Applying micro-batches to a Delta Lake or Apache Iceberg table with ``MERGE INTO``.

:func:`merge_changes` applies one batch of a table's events to a table format's table that
holds the table's columns plus ``_cdc_commit_lsn`` and ``_cdc_seq`` (the position of each
row's newest event; with ``tombstones=True`` also ``_cdc_deleted``):

1. one pass over the batch (:func:`batch_facts`; :func:`checkpoint_with_facts` makes it while
   checkpointing the batch) finds how many events it holds, its newest truncate, the range
   of its keys and whether a key-change create in it leaves TOASTed
   columns unchanged (its values are those of the old key's row);
2. :func:`cdcd.spark.state.apply_changes` folds the batch: the latest event per key by
   ``(commit_lsn, seq)``, unchanged TOAST values filled from earlier events of the batch,
   deletes as tombstones, a truncate cutting every older row. Without such a create the
   batch is folded on its own, and each row names the columns no event gave a value for
   (an unchanged TOAST value, the values a key change's delete half keeps): the MERGE takes
   them from the target row (``CASE WHEN ... THEN t.c``). With one, the target rows of the
   batch's keys (and of the creates' ``old_key``) are read and the batch folded onto them,
   keeping only the rows the batch changes (a replayed batch changes none: no MERGE);
3. one ``MERGE INTO`` (:func:`merge_sql`) writes the result: a matched row is updated only
   when the incoming position is newer, deleted when the incoming row is a delete (or, with
   ``tombstones=True``, kept as a tombstone so that a replayed older event cannot insert it
   again), a new key is inserted unless deleted; with a truncate in the batch,
   ``WHEN NOT MATCHED BY SOURCE`` deletes every row older than the truncate. These position
   conditions alone keep a batch folded on its own idempotent.

What a batch costs is the fixed cost of each Spark job it runs and what the MERGE scans and
writes. With integral keys the MERGE's target side (and the read of step 2) is bounded to the
batch's key range (data skipping: files and row groups outside it are not read). A Delta
table with deletion vectors (``delta.enableDeletionVectors``, set by
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
from typing import Any

from pyspark.sql import Column, DataFrame, Observation, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import (
    ArrayType,
    ByteType,
    DataType,
    IntegerType,
    LongType,
    ShortType,
    StructType,
)

from cdcd.spark.columns import (
    COMMIT_LSN,
    DELETED,
    ROW_OPS,
    SEQ,
    default_key_columns,
    is_connect,
    key_value,
    row_type,
    source_field,
)
from cdcd.spark.state import UNKNOWN, apply_changes


def _q(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def _newer(a: str, b: str) -> str:
    return (
        f"({a}.{COMMIT_LSN} > {b}.{COMMIT_LSN} OR "
        f"({a}.{COMMIT_LSN} = {b}.{COMMIT_LSN} AND {a}.{SEQ} > {b}.{SEQ}))"
    )


#: A key range: the first key column and bounds holding every value a batch touches.
KeyRange = tuple[str, int, int]
_INTEGRAL = (ByteType, ShortType, IntegerType, LongType)
_BITS: dict[type[DataType], int] = {ByteType: 8, ShortType: 16, IntegerType: 32, LongType: 64}


def coarse_range(low: int, high: int, bits: int = 64) -> tuple[int, int]:
    """``[low, high]`` widened to multiples of a power of two no smaller than an eighth of
    its span. Spark writes a statement's integer literals into the Java code it generates and
    compiles: a key range of new bounds each micro-batch made every stage reading the target
    a new class to compile (a tenth of a steady batch's CPU). A stream's next batches mostly
    fall within the same coarse bounds; the range grows by at most a quarter plus one step
    (a few more rows to read, no more files in practice), within the values of a ``bits``-bit
    integer column."""
    step = 1 << max(0, ((high - low) // 8).bit_length())
    smallest, largest = -(2 ** (bits - 1)), 2 ** (bits - 1) - 1
    return max(smallest, low - low % step), min(largest, high - high % step + step - 1)


def merge_sql(
    target: str,
    source: str,
    keys: Sequence[str],
    columns: Sequence[str],
    truncate: tuple[int, int] | None = None,
    tombstones: bool = False,
    key_range: KeyRange | None = None,
    unknown: bool = False,
) -> str:
    """The ``MERGE INTO`` statement applying the rows of the view ``source`` (an
    :func:`~cdcd.spark.state.apply_changes` result) to the table ``target``. ``key_range``
    (every source row's key within it) bounds the target side of the join; it is left out
    with a truncate, whose ``WHEN NOT MATCHED BY SOURCE`` must see every row. ``unknown``:
    the source has :data:`~cdcd.spark.state.UNKNOWN`, the columns an update keeps from the
    target row."""
    if not keys:
        raise ValueError("MERGE needs key columns (the table has no key)")
    written = [*columns, COMMIT_LSN, SEQ, *([DELETED] if tombstones else [])]
    on = " AND ".join(f"t.{_q(k)} = s.{_q(k)}" for k in keys)
    if key_range is not None and truncate is None:
        name, low, high = key_range
        on += f" AND t.{_q(name)} BETWEEN {int(low)} AND {int(high)}"

    def value(c: str) -> str:
        if not unknown or c in keys or c not in columns:
            return f"s.{_q(c)}"
        kept = "'" + c.replace("\\", "\\\\").replace("'", "\\'") + "'"
        return f"CASE WHEN array_contains(s.{UNKNOWN}, {kept}) THEN t.{_q(c)} ELSE s.{_q(c)} END"

    assign = ", ".join(f"t.{_q(c)} = {value(c)}" for c in written)
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


@dataclass(frozen=True, slots=True)
class BatchFacts:
    """What one pass over a batch's events finds (:func:`batch_facts`): how many events and
    row events, the newest ``commit_lsn``, the newest truncate, a range of the first key
    column (when integral) holding its values in the batch (key-change creates' ``old_key``
    included; :func:`coarse_range`) and ``links``: some
    key-change create leaves TOASTed columns unchanged (its values come from the old key's
    row, which only a read of the target finds)."""

    events: int
    row_events: int
    commit_lsn: int | None
    truncate: tuple[int, int] | None
    key_range: KeyRange | None
    links: bool


def _fact_measures(events: DataFrame, keys: Sequence[str]) -> tuple[list[Column], DataType | None]:
    """The aggregates :func:`batch_facts` computes, named ``f0``…, and the type of the first
    key column when its range is among them."""
    is_row = F.col("op").isin(*ROW_OPS)
    position = F.struct(F.col("source.commit_lsn").cast("long"), F.col("source.seq").cast("long"))
    old_key = source_field(events, "old_key")
    links = F.lit(False)
    if isinstance(old_key, StructType) and isinstance(
        source_field(events, "unchanged_toast"), ArrayType
    ):
        links = (
            (F.col("op") == "c")
            & F.col("source.old_key").isNotNull()
            & (F.coalesce(F.size("source.unchanged_toast"), F.lit(0)) > 0)
        )
    measures = [
        F.count(F.lit(1)),
        F.count(F.when(is_row, 1)),
        F.max("source.commit_lsn"),
        F.max(F.when(F.col("op") == "t", position)),
        F.max(links.cast("int")),
    ]
    types = {f.name: f.dataType for f in row_type(events).fields} if keys else {}
    key_type = types.get(keys[0]) if keys else None
    if not isinstance(key_type, _INTEGRAL):
        return [m.alias(f"f{i}") for i, m in enumerate(measures)], None
    low = high = key_value(events, keys[0], key_type)
    if isinstance(old_key, StructType) and keys[0] in old_key.names:
        old = F.col("source.old_key").getField(keys[0]).cast(key_type)
        low, high = F.least(low, old), F.greatest(high, old)
    measures += [F.min(F.when(is_row, low)), F.max(F.when(is_row, high))]
    return [m.alias(f"f{i}") for i, m in enumerate(measures)], key_type


def _facts(values: Sequence[Any], keys: Sequence[str], key_type: DataType | None) -> BatchFacts:
    count, rows, lsn, cut, linked, *bounds = values
    low, high = bounds if bounds else (None, None)
    return BatchFacts(
        events=int(count),
        row_events=int(rows),
        commit_lsn=None if lsn is None else int(lsn),
        truncate=None if cut is None else (int(cut[0]), int(cut[1])),
        key_range=None
        if low is None or high is None or key_type is None
        else (keys[0], *coarse_range(int(low), int(high), _BITS[type(key_type)])),
        links=bool(linked),
    )


def batch_facts(events: DataFrame, keys: Sequence[str]) -> BatchFacts:
    """:class:`BatchFacts` of one table's ``events`` with the key columns ``keys`` (empty for
    a table without a key), in one Spark job."""
    measures, key_type = _fact_measures(events, keys)
    return _facts(list(events.agg(*measures).collect()[0]), keys, key_type)


def checkpoint_with_facts(events: DataFrame, keys: Sequence[str]) -> tuple[DataFrame, BatchFacts]:
    """``events`` checkpointed locally (they are read several times) and their
    :class:`BatchFacts`, observed while the checkpoint is written: one Spark job, not two.
    Through Spark Connect the facts take a job of their own."""
    if is_connect(events):
        checkpointed = events.localCheckpoint()
        return checkpointed, batch_facts(checkpointed, keys)
    measures, key_type = _fact_measures(events, keys)
    observed = Observation(f"cdcd_facts_{uuid.uuid4().hex[:12]}")
    checkpointed = events.observe(observed, *measures).localCheckpoint()
    found = observed.get
    return checkpointed, _facts([found[f"f{i}"] for i in range(len(measures))], keys, key_type)


def held_rows(
    spark: SparkSession,
    events: DataFrame,
    target: str,
    keys: list[str],
    facts: BatchFacts,
    tombstones: bool = False,
) -> DataFrame:
    """The batch folded onto the target rows of its keys (and of key-change creates'
    ``old_key``): only the rows the batch changes."""
    types = {f.name: f.dataType for f in row_type(events).fields}
    current = spark.table(target)
    if not tombstones:
        current = current.withColumn(DELETED, F.lit(False))
    touched = key_values(events, keys, types).distinct()
    if facts.key_range is not None:
        name, low, high = facts.key_range
        current = current.where(F.col(name).between(low, high))
    if facts.row_events <= BROADCAST_KEYS:
        touched = F.broadcast(touched)
    held = current.join(touched, on=keys, how="left_semi").localCheckpoint()
    rows = apply_changes(held, events, keys, newest_truncate=facts.truncate)
    # a key whose newest position is the one the table holds is unchanged: nothing to write
    position = [*keys, COMMIT_LSN, SEQ]
    return rows.join(held.select(*position), on=position, how="left_anti")


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
    statement that ran, or None when none ran (a batch without row events or truncates, or a
    replay found to change nothing). ``into_empty``: the table is empty (just created), so the
    rows are appended instead, sorted by key into files of disjoint key ranges, which later
    batches' key ranges skip. ``facts``: the events' :func:`batch_facts` when the caller has
    them; the events are then taken as cached (checkpoint them: they are read several
    times)."""
    keys = list(default_key_columns(events) if key_columns is None else key_columns)
    if not keys:
        raise ValueError("MERGE needs key columns (the table has no key)")
    if facts is None:
        events = events.localCheckpoint()
        facts = batch_facts(events, keys)
    if not facts.row_events and facts.truncate is None:
        return None
    columns = row_type(events).names
    unknown = not facts.links and not into_empty
    if into_empty:
        rows = apply_changes(None, events, keys, newest_truncate=facts.truncate)
    elif unknown:
        rows = apply_changes(None, events, keys, unknown=True, newest_truncate=facts.truncate)
    else:
        rows = held_rows(spark, events, target, keys, facts, tombstones)
    if not unknown:  # read twice (emptiness, then the MERGE or the append)
        rows = rows.localCheckpoint()
        if facts.truncate is None and rows.isEmpty():
            return None
    # folded on its own, the rows go to the MERGE as a plan: Delta materializes a source
    # that reads more than Delta tables once itself (merge.materializeSource "auto")
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
            sql = merge_sql(
                target, view, keys, columns, facts.truncate, tombstones, facts.key_range, unknown
            )
        spark.sql(sql)
    finally:
        spark.catalog.dropTempView(view)
    return sql
