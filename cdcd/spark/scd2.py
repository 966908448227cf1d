"""SCD type 2 targets (AUTO CDC ``stored_as_scd_type=2``): every version of every row, kept up
to date with one ``MERGE INTO`` per micro-batch.

A type 2 table holds the written columns (:class:`cdcd.spark.autocdc.AutoCdc`), then

    __START_AT   struct<commit_lsn, seq>: position of the event that opened the version
    __END_AT     struct<commit_lsn, seq>: position of the event that closed it; null while
                 the version is current
    _cdc_commit_lsn, _cdc_seq   position of the newest event applied to the version (an
                 in-place update moves it; :mod:`cdcd.spark.tables`' hidden columns)

Rules, per key in position order (the sequence is always ``(commit_lsn, seq)``):

* an insert, snapshot read or update whose tracked columns differ from the current version's
  (or with no current version) closes the current version at its position and opens one;
  one that changes only untracked columns updates the current version in place;
* a delete closes the current version; a key change (the delete of the old key and the create
  of the new one) closes the old key's version and opens one under the new key;
* a truncate closes every version current at its position;
* unchanged TOAST values are those of the version before (:mod:`cdcd.spark.state`'s rules,
  key changes included: the create takes them from the old key's version).

Idempotent: an event at or before the newest position a key's versions know (its newest
version's ``_cdc_commit_lsn``/``_cdc_seq``, or its ``__END_AT``) changes nothing, so a replayed
micro-batch or a file delivered twice leaves the table as it was; a replayed truncate finds
no version current before it.

Each batch: the newest version of each key the batch touches is read, the batch's events are
folded onto it (:func:`cdcd.spark.state.row_versions`' machinery: TOAST and key changes), and
one MERGE writes the new versions and the changed current ones; with a truncate in the batch,
``WHEN NOT MATCHED BY SOURCE`` closes the other keys' current versions.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

from pyspark.sql import Column, DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from cdcd.spark.autocdc import END_AT, START_AT
from cdcd.spark.columns import COMMIT_LSN, DELETED, ROW_OPS, SEQ, row_type
from cdcd.spark.merge import _q, key_values
from cdcd.spark.state import OP, ORDER, _prepare, _versions

POSITION = "struct<commit_lsn:bigint,seq:bigint>"
SCD2_COLUMNS = (START_AT, END_AT, COMMIT_LSN, SEQ)


def _pos(lsn: str, seq: str) -> Column:
    return F.struct(F.col(lsn).alias("commit_lsn"), F.col(seq).alias("seq"))


def _lit(position: tuple[int, int]) -> Column:
    lsn, seq = (F.lit(p).cast("long") for p in position)
    return F.struct(lsn.alias("commit_lsn"), seq.alias("seq"))


def _first_cut_after(position: Column, cuts: list[tuple[int, int]]) -> Column:
    """The first truncate position after ``position`` (null when none)."""
    result: Column = F.lit(None).cast(POSITION)
    for cut in reversed(cuts):
        result = F.when(position < _lit(cut), _lit(cut)).otherwise(result)
    return result


def scd2_columns_ddl() -> list[str]:
    return [
        f"{START_AT} {POSITION}",
        f"{END_AT} {POSITION}",
        f"{COMMIT_LSN} bigint",
        f"{SEQ} bigint",
    ]


def newest_versions(target: DataFrame, keys: list[str]) -> DataFrame:
    """Per key, the newest version of a type 2 table as an
    :func:`~cdcd.spark.state.apply_changes` state row, plus its ``__START_AT``: a closed
    version is a tombstone (``_cdc_deleted``) at its ``__END_AT``, so its position is the
    newest one the key knows either way."""
    by_key = Window.partitionBy(*keys).orderBy(F.col(START_AT).desc())
    newest = target.withColumn("_cdc_rank", F.row_number().over(by_key)).where("_cdc_rank = 1")
    closed = F.col(END_AT).isNotNull()
    return newest.select(
        *(c for c in target.columns if c not in SCD2_COLUMNS),
        F.when(closed, F.col(f"{END_AT}.commit_lsn"))
        .otherwise(F.col(COMMIT_LSN))
        .alias(COMMIT_LSN),
        F.when(closed, F.col(f"{END_AT}.seq")).otherwise(F.col(SEQ)).alias(SEQ),
        closed.alias(DELETED),
        F.col(START_AT),
    )


def scd2_rows(
    state: DataFrame,
    events: DataFrame,
    keys: list[str],
    tracked: Sequence[str],
    cuts: list[tuple[int, int]],
) -> DataFrame:
    """The versions a batch of ``events`` opens or changes, given ``state`` (from
    :func:`newest_versions`, of the keys the batch touches) and the batch's truncate
    positions ``cuts`` (sorted): the written columns, ``__START_AT``, ``__END_AT`` and the
    hidden position, one row per version."""
    starts = state.select(*keys, F.col(START_AT).alias("_cdc_state_start"))
    base = state.drop(START_AT)
    _, types, prepared = _prepare(base, events, keys)
    rows = prepared.where(F.col("op").isin(*ROW_OPS))
    versions = _versions(base, rows, keys, types)
    others = [c for c in types if c not in keys]
    pos = _pos(COMMIT_LSN, SEQ)
    by_key = Window.partitionBy(*keys).orderBy(COMMIT_LSN, SEQ, ORDER)
    prev_pos = F.lag(pos).over(by_key)
    between = F.lit(False)
    for cut in cuts:
        between = between | ((prev_pos < _lit(cut)) & (_lit(cut) < pos))
    prev_open = prev_pos.isNotNull() & (F.lag(OP).over(by_key) != "d") & ~between
    if tracked:
        same = F.lag(F.struct(*tracked)).over(by_key).eqNullSafe(F.struct(*tracked))
    else:
        same = F.lit(True)
    opens = F.when(F.col(ORDER) == 0, F.col(OP) != "d").otherwise(
        (F.col(OP) != "d") & ~(prev_open & same)
    )
    marked = versions.withColumn("_cdc_opens", opens).withColumn("_cdc_pos", pos)
    ends_group = F.col("_cdc_opens") | (F.col(OP) == "d")
    running = by_key.rowsBetween(Window.unboundedPreceding, Window.currentRow)
    grouped = marked.select(
        "*",
        F.lead(ends_group).over(by_key).alias("_cdc_next_ends"),
        F.lead("_cdc_pos").over(by_key).alias("_cdc_next"),
        F.last(F.when(F.col("_cdc_opens"), F.struct("_cdc_pos", ORDER)), ignorenulls=True)
        .over(running)
        .alias("_cdc_open"),
    )
    last = grouped.where(
        (F.col(OP) != "d")
        & F.col("_cdc_open").isNotNull()
        & F.coalesce(F.col("_cdc_next_ends"), F.lit(True))
    )
    first_cut = _first_cut_after(F.col("_cdc_pos"), cuts)
    end = F.when(F.col("_cdc_next").isNull(), first_cut).otherwise(
        F.when(first_cut.isNotNull() & (first_cut < F.col("_cdc_next")), first_cut).otherwise(
            F.col("_cdc_next")
        )
    )
    from_state = F.col(f"_cdc_open.{ORDER}") == 0
    out = last.join(starts, on=keys, how="left").select(
        *keys,
        *others,
        F.when(from_state, F.col("_cdc_state_start"))
        .otherwise(F.col("_cdc_open._cdc_pos"))
        .cast(POSITION)
        .alias(START_AT),
        end.cast(POSITION).alias(END_AT),
        F.col(COMMIT_LSN),
        F.col(SEQ),
        (from_state & (F.col(ORDER) == 0) & end.isNull()).alias("_cdc_unchanged"),
    )
    return out.where(~F.col("_cdc_unchanged")).drop("_cdc_unchanged")


def scd2_merge_sql(
    target: str,
    source: str,
    keys: Sequence[str],
    columns: Sequence[str],
    cuts: list[tuple[int, int]],
) -> str:
    """The ``MERGE INTO`` writing :func:`scd2_rows` (in the view ``source``) to ``target``."""
    written = [*columns, START_AT, END_AT, COMMIT_LSN, SEQ]
    on = [f"t.{_q(k)} = s.{_q(k)}" for k in keys]
    on += [
        f"t.{START_AT}.commit_lsn = s.{START_AT}.commit_lsn",
        f"t.{START_AT}.seq = s.{START_AT}.seq",
    ]
    newer = (
        f"(s.{COMMIT_LSN} > t.{COMMIT_LSN} OR (s.{COMMIT_LSN} = t.{COMMIT_LSN} "
        f"AND s.{SEQ} > t.{SEQ}) OR (t.{END_AT} IS NULL AND s.{END_AT} IS NOT NULL))"
    )
    assign = ", ".join(f"t.{_q(c)} = s.{_q(c)}" for c in written if c != START_AT)
    names = ", ".join(_q(c) for c in written)
    values = ", ".join(f"s.{_q(c)}" for c in written)
    lines = [
        f"MERGE INTO {target} AS t",
        f"USING {source} AS s",
        f"ON {' AND '.join(on)}",
        f"WHEN MATCHED AND t.{END_AT} IS NULL AND {newer} THEN UPDATE SET {assign}",
        f"WHEN NOT MATCHED THEN INSERT ({names}) VALUES ({values})",
    ]
    if cuts:
        last_lsn, last_seq = cuts[-1]
        before_last = f"(t.{COMMIT_LSN} < {last_lsn} OR (t.{COMMIT_LSN} = {last_lsn} AND t.{SEQ} < {last_seq}))"
        case = ["CASE"]
        for lsn, seq in cuts:
            case.append(
                f"WHEN t.{COMMIT_LSN} < {lsn} OR (t.{COMMIT_LSN} = {lsn} AND t.{SEQ} < {seq}) "
                f"THEN named_struct('commit_lsn', CAST({lsn} AS BIGINT), 'seq', CAST({seq} AS BIGINT))"
            )
        case.append("END")
        lines.append(
            f"WHEN NOT MATCHED BY SOURCE AND t.{END_AT} IS NULL AND {before_last} "
            f"THEN UPDATE SET t.{END_AT} = {' '.join(case)}"
        )
    return "\n".join(lines)


def merge_scd2(
    spark: SparkSession,
    events: DataFrame,
    target: str,
    keys: list[str],
    tracked: Sequence[str],
) -> str:
    """Apply one batch of ``events`` (already narrowed to the written columns) to the type 2
    table ``target``; returns the statement that ran."""
    events = events.localCheckpoint()
    types = {f.name: f.dataType for f in row_type(events).fields}
    columns = list(types)
    table = spark.table(target)
    kept = [c for c in table.columns if c in types or c in SCD2_COLUMNS]
    touched = key_values(events, keys, types).distinct()
    held = table.select(*kept).join(touched, on=keys, how="left_semi")
    cuts = sorted(
        (int(r[0]), int(r[1]))
        for r in events.where(F.col("op") == "t")
        .select("source.commit_lsn", "source.seq")
        .distinct()
        .collect()
    )
    rows = scd2_rows(newest_versions(held, keys), events, keys, tracked, cuts)
    view = f"cdcd_scd2_{uuid.uuid4().hex[:12]}"
    rows.localCheckpoint().createOrReplaceTempView(view)
    try:
        sql = scd2_merge_sql(target, view, keys, columns, cuts)
        spark.sql(sql)
    finally:
        spark.catalog.dropTempView(view)
    return sql


__all__ = ["SCD2_COLUMNS", "merge_scd2", "newest_versions", "scd2_columns_ddl", "scd2_rows"]
