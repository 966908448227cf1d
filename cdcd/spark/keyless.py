"""Tables without a key (REPLICA IDENTITY FULL without a primary key): rows as a multiset.

Rows are matched by their whole value. Every insert adds its ``after`` row, every delete
removes its ``before`` row, an update does both (unchanged TOAST values in ``after`` come from
``before``, which the server sends complete). The state is the rows with a positive count,
repeated count times. Limits: identical rows cannot be told apart (which of two equal rows an
update touched does not matter to the result); rows whose values cannot be grouped (maps) are
not supported; a count going negative (a delete of a row never seen) is dropped silently. In
place of tombstones the state of a keyless table holds one hidden *watermark* row (all columns
null, ``_cdc_deleted`` true) at the newest position applied so far, and
:func:`cdcd.spark.state.apply_changes` skips events at or before the newest position in the
state: right when batches arrive in position order (a table folder read in name order, one
Kafka partition), possibly with replays of earlier events, not when older events come after
newer ones for the first time.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import DataType, StructType

from cdcd.spark.columns import (
    COMMIT_LSN,
    DELETED,
    SEQ,
    TRUNC_LSN,
    TRUNC_SEQ,
    field,
    later,
    row_type,
    state_value,
    unchanged,
)

_SIGN = "_cdc_sign"


def apply_keyless(
    state: DataFrame | None,
    rows: DataFrame,
    truncate: DataFrame,
    truncate_positions: DataFrame,
    types: dict[str, DataType],
) -> DataFrame:
    columns = list(types)
    rtype = row_type(rows)
    has_before = isinstance(rows.schema["before"].dataType, StructType)

    def image(side: str, fill_from_before: bool) -> Column:
        values = []
        for c in columns:
            value = field(side, c, rows)
            if value is None:
                value = F.lit(None)
            if fill_from_before and has_before and c in rtype.fieldNames():
                value = F.when(unchanged(rows, c), field("before", c, rows)).otherwise(value)
            values.append(value.cast(types[c]).alias(c))
        return F.struct(*values)

    plus = F.when(
        F.col("op").isin("c", "r", "u"),
        F.struct(F.lit(1).alias(_SIGN), image("after", True).alias("row")),
    )
    entries = [plus]
    if has_before:
        minus = F.when(
            F.col("op").isin("u", "d"),
            F.struct(F.lit(-1).alias(_SIGN), image("before", False).alias("row")),
        )
        entries.insert(0, minus)
    present = F.filter(F.array(*entries), lambda e: e.isNotNull())
    changes = rows.select(COMMIT_LSN, SEQ, F.explode(present).alias("e")).select(
        COMMIT_LSN, SEQ, F.col("e")[_SIGN].alias(_SIGN), F.col("e.row").alias("row")
    )
    newest = rows.select(COMMIT_LSN, SEQ).unionByName(truncate_positions)
    if state is not None:
        seen = state.select(F.col(COMMIT_LSN).cast("long"), F.col(SEQ).cast("long"))
        high = seen.agg(F.max(F.struct(COMMIT_LSN, SEQ)).alias("h")).select(
            F.col("h")[COMMIT_LSN].alias("_cdc_h_lsn"), F.col("h")[SEQ].alias("_cdc_h_seq")
        )
        changes = (
            changes.crossJoin(F.broadcast(high))
            .where(
                F.col("_cdc_h_lsn").isNull() | later(COMMIT_LSN, SEQ, "_cdc_h_lsn", "_cdc_h_seq")
            )
            .drop("_cdc_h_lsn", "_cdc_h_seq")
        )
        live = state.where(~F.col(DELETED))
        changes = changes.unionByName(
            live.select(
                F.col(COMMIT_LSN).cast("long"),
                F.col(SEQ).cast("long"),
                F.lit(1).alias(_SIGN),
                F.struct(*(state_value(live, c, types[c]) for c in columns)).alias("row"),
            )
        )
        newest = newest.unionByName(seen)
    kept = changes.crossJoin(F.broadcast(truncate)).where(
        F.col(TRUNC_LSN).isNull() | later(COMMIT_LSN, SEQ, TRUNC_LSN, TRUNC_SEQ)
    )
    counted = kept.groupBy("row").agg(
        F.sum(_SIGN).alias("n"), F.max(F.struct(F.col(COMMIT_LSN), F.col(SEQ))).alias("p")
    )
    rows_now = (
        counted.where(F.col("n") > 0)
        .select(
            "row.*",
            F.col("p")[COMMIT_LSN].alias(COMMIT_LSN),
            F.col("p")[SEQ].alias(SEQ),
            F.lit(False).alias(DELETED),
            F.explode(F.array_repeat(F.lit(0), F.col("n").cast("int"))).alias("_cdc_copy"),
        )
        .drop("_cdc_copy")
    )
    # The watermark: a hidden row at the newest position applied so far (replays stop there).
    mark = newest.agg(F.max(F.struct(COMMIT_LSN, SEQ)).alias("p")).where(F.col("p").isNotNull())
    watermark = mark.select(
        *(F.lit(None).cast(types[c]).alias(c) for c in columns),
        F.col("p")[COMMIT_LSN].alias(COMMIT_LSN),
        F.col("p")[SEQ].alias(SEQ),
        F.lit(True).alias(DELETED),
    )
    return rows_now.unionByName(watermark)
