"""From change events to table state: deduplicate, rebuild, and apply micro-batches.

Events are the DataFrames of :mod:`cdcd.spark.sources` (one table's events, CONTRACT §3).

Position. ``(source.commit_lsn, source.seq)`` is unique per event and orders all events:
delivery is at-least-once, so a consumer deduplicates on it (:func:`deduplicate`) and applies
events in its order. Nothing else (file order, Kafka offsets, ``ts_ms``) is used for ordering.

State rows. :func:`apply_changes` keeps, per key, the row after the newest event and that
event's position in ``_cdc_commit_lsn``/``_cdc_seq``. A delete leaves a *tombstone*
(``_cdc_deleted`` true, key columns set, other columns null), so that replaying an older
event of that key (a duplicate delivered after the delete) cannot bring the row back: an
event only wins over a state row when its position is greater or equal. Tombstones are kept
for ever; :func:`current_rows` hides them (and the metadata columns).
:func:`latest_state` is ``current_rows(apply_changes(None, events))``.

Keys. ``key_columns`` (default: the fields of the events' ``key`` struct) identify a row. An
event's key values are taken from ``after``, else ``before``, else ``key`` (a delete carries
the key in ``before`` and ``key``). An update that changes the key arrives as a delete and a
create (CONTRACT §3), so a key never moves within one event.

Unchanged TOAST values. An update's ``after`` holds ``"__debezium_unavailable_value"`` (JSON
Lines) or null (Parquet) for a TOASTed column PostgreSQL did not send; the column is listed in
``source.unchanged_toast``. Such a value is replaced by the column's value in the newest
earlier event (or state row) of the same key (or, with REPLICA IDENTITY FULL, by the
value in the event's own complete ``before``), by a window ``last(..., ignorenulls)`` over the
key's events ordered by position; each value is wrapped in a one-field struct first so that
a real SQL null still counts as a value.

Truncate (op ``t``). Every row whose position is before the newest truncate of the batch
becomes a tombstone at the truncate's position.

Tables without a key (REPLICA IDENTITY FULL without a primary key): rows are matched by their
whole value, as a multiset. Every insert adds its ``after`` row, every delete removes its
``before`` row, an update does both (unchanged TOAST values in ``after`` come from ``before``,
which the server sends complete). The state is the rows with a positive count, repeated
count times. Limits: identical rows cannot be told apart (which of two equal rows an update
touched does not matter to the result); rows whose values cannot be grouped (maps) are not
supported; a count going negative (a delete of a row never seen) is dropped silently. In
place of tombstones the state of a keyless table holds one hidden *watermark* row (all columns
null, ``_cdc_deleted`` true) at the newest position applied so far, and :func:`apply_changes`
skips events at or before the newest position in the state: right when batches arrive in
position order (a table folder read in name order, one Kafka partition), possibly with
replays of earlier events, not when older events come after newer ones for the first time.
"""

from __future__ import annotations

from collections.abc import Sequence

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F
from pyspark.sql.types import ArrayType, DataType, StringType, StructType

UNAVAILABLE = "__debezium_unavailable_value"
COMMIT_LSN = "_cdc_commit_lsn"
SEQ = "_cdc_seq"
DELETED = "_cdc_deleted"
METADATA = (COMMIT_LSN, SEQ, DELETED)
ROW_OPS = ("c", "r", "u", "d")
_ORDER = "_cdc_order"  # state rows (0) sort before events (1) at the same position
_OP = "_cdc_op"
_SIGN = "_cdc_sign"
_TRUNC_LSN = "_cdc_trunc_lsn"
_TRUNC_SEQ = "_cdc_trunc_seq"


def with_position(events: DataFrame) -> DataFrame:
    """``events`` plus the position as top-level columns ``_cdc_commit_lsn``, ``_cdc_seq``."""
    return events.withColumn(COMMIT_LSN, F.col("source.commit_lsn").cast("long")).withColumn(
        SEQ, F.col("source.seq").cast("long")
    )


def deduplicate(events: DataFrame) -> DataFrame:
    """One event per position ``(source.commit_lsn, source.seq)`` (duplicates are identical
    by contract, any one is kept). On a streaming DataFrame the state of seen positions grows
    without bound; deduplicate micro-batches instead (:func:`apply_changes` does)."""
    return with_position(events).dropDuplicates([COMMIT_LSN, SEQ]).drop(COMMIT_LSN, SEQ)


def default_key_columns(events: DataFrame) -> list[str]:
    """The fields of the events' ``key`` struct; empty for a keyless table."""
    if "key" not in events.columns:
        return []
    key_type = events.schema["key"].dataType
    return list(key_type.fieldNames()) if isinstance(key_type, StructType) else []


def latest_state(events: DataFrame, key_columns: Sequence[str] | None = None) -> DataFrame:
    """The table's current rows (the columns of ``after``) after applying ``events`` of one
    table in position order; duplicates are dropped first."""
    return current_rows(apply_changes(None, events, key_columns))


def current_rows(state: DataFrame) -> DataFrame:
    """The visible rows of a state from :func:`apply_changes`: no tombstones, no metadata."""
    return state.where(~F.col(DELETED)).drop(*METADATA)


def apply_changes(
    state: DataFrame | None, events: DataFrame, key_columns: Sequence[str] | None = None
) -> DataFrame:
    """The state after applying a batch of ``events`` to ``state`` (a previous result of this
    function, or None for an empty table). Idempotent: events at or before a key's position in
    the state are ignored, duplicates within the batch are dropped."""
    keys = list(default_key_columns(events) if key_columns is None else key_columns)
    row_type = _row_type(events)
    missing = [k for k in keys if k not in row_type.fieldNames()]
    if missing:
        raise ValueError(
            f"key columns {missing} are not columns of the table {row_type.simpleString()}"
        )
    types = {f.name: f.dataType for f in row_type.fields}
    if state is not None:
        types.update({f.name: f.dataType for f in state.schema.fields if f.name not in METADATA})
    events = with_position(deduplicate(events)).where(F.col("op").isin(*ROW_OPS, "t"))
    truncate = (
        events.where(F.col("op") == "t")
        .agg(F.max(F.struct(F.col(COMMIT_LSN), F.col(SEQ))).alias("t"))
        .select(F.col("t")[COMMIT_LSN].alias(_TRUNC_LSN), F.col("t")[SEQ].alias(_TRUNC_SEQ))
    )
    rows = events.where(F.col("op").isin(*ROW_OPS))
    if keys:
        return _apply_keyed(state, rows, truncate, keys, types)
    truncate_positions = events.where(F.col("op") == "t").select(COMMIT_LSN, SEQ)
    return _apply_keyless(state, rows, truncate, truncate_positions, types)


# ------------------------------------------------------------------------------ keyed tables


def _apply_keyed(
    state: DataFrame | None,
    rows: DataFrame,
    truncate: DataFrame,
    keys: list[str],
    types: dict[str, DataType],
) -> DataFrame:
    columns = list(types)
    others = [c for c in columns if c not in keys]
    after_fields = set(_row_type(rows).fieldNames())
    key_type = rows.schema["key"].dataType if "key" in rows.columns else None

    def key_value(k: str) -> Column:
        sources = [_field("after", k, rows), _field("before", k, rows)]
        if isinstance(key_type, StructType) and k in key_type.fieldNames():
            sources.append(F.col("key").getField(k))
        return F.coalesce(*(s for s in sources if s is not None)).cast(types[k]).alias(k)

    def event_value(c: str) -> Column:
        if c not in after_fields:  # a column the batch does not know: a null value
            return F.struct(F.lit(None).cast(types[c]).alias("v")).alias(c)
        value = F.struct(F.col("after").getField(c).cast(types[c]).alias("v"))
        before = _field("before", c, rows)
        if before is None:
            return F.when(~_unchanged(rows, c), value).alias(c)
        # REPLICA IDENTITY FULL: the old row is complete, its value is the unchanged one
        old = F.when(F.col("before").isNotNull(), F.struct(before.cast(types[c]).alias("v")))
        return F.when(~_unchanged(rows, c), value).otherwise(old).alias(c)

    changes = rows.select(
        F.col(COMMIT_LSN),
        F.col(SEQ),
        F.col("op").alias(_OP),
        F.lit(1).alias(_ORDER),
        *(key_value(k) for k in keys),
        *(event_value(c) for c in others),
    )
    if state is not None:
        changes = changes.unionByName(
            state.select(
                F.col(COMMIT_LSN).cast("long"),
                F.col(SEQ).cast("long"),
                F.when(F.col(DELETED), "d").otherwise("r").alias(_OP),
                F.lit(0).alias(_ORDER),
                *(_state_value(state, k, types[k]) for k in keys),
                *(F.struct(_state_value(state, c, types[c]).alias("v")).alias(c) for c in others),
            )
        )
    by_key = Window.partitionBy(*keys).orderBy(COMMIT_LSN, SEQ, _ORDER)
    so_far = by_key.rowsBetween(Window.unboundedPreceding, Window.currentRow)
    filled = changes.select(
        COMMIT_LSN,
        SEQ,
        _OP,
        *keys,
        *(F.last(c, ignorenulls=True).over(so_far)["v"].alias(c) for c in others),
        F.lead(COMMIT_LSN).over(by_key).isNull().alias("_cdc_last"),
    )
    newest = filled.where("_cdc_last").crossJoin(F.broadcast(truncate))
    cut = F.col(_TRUNC_LSN).isNotNull() & _later(_TRUNC_LSN, _TRUNC_SEQ, COMMIT_LSN, SEQ)
    deleted = cut | (F.col(_OP) == "d")
    return newest.select(
        *(F.col(k) for k in keys),
        *(F.when(~deleted, F.col(c)).alias(c) for c in others),
        F.when(cut, F.col(_TRUNC_LSN)).otherwise(F.col(COMMIT_LSN)).alias(COMMIT_LSN),
        F.when(cut, F.col(_TRUNC_SEQ)).otherwise(F.col(SEQ)).alias(SEQ),
        deleted.alias(DELETED),
    ).select(*columns, *METADATA)


# ---------------------------------------------------------------------------- keyless tables


def _apply_keyless(
    state: DataFrame | None,
    rows: DataFrame,
    truncate: DataFrame,
    truncate_positions: DataFrame,
    types: dict[str, DataType],
) -> DataFrame:
    columns = list(types)
    row_type = _row_type(rows)
    has_before = isinstance(rows.schema["before"].dataType, StructType)

    def image(side: str, fill_from_before: bool) -> Column:
        values = []
        for c in columns:
            value = _field(side, c, rows)
            if value is None:
                value = F.lit(None)
            if fill_from_before and has_before and c in row_type.fieldNames():
                value = F.when(_unchanged(rows, c), _field("before", c, rows)).otherwise(value)
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
                F.col("_cdc_h_lsn").isNull() | _later(COMMIT_LSN, SEQ, "_cdc_h_lsn", "_cdc_h_seq")
            )
            .drop("_cdc_h_lsn", "_cdc_h_seq")
        )
        live = state.where(~F.col(DELETED))
        changes = changes.unionByName(
            live.select(
                F.col(COMMIT_LSN).cast("long"),
                F.col(SEQ).cast("long"),
                F.lit(1).alias(_SIGN),
                F.struct(*(_state_value(live, c, types[c]) for c in columns)).alias("row"),
            )
        )
        newest = newest.unionByName(seen)
    kept = changes.crossJoin(F.broadcast(truncate)).where(
        F.col(_TRUNC_LSN).isNull() | _later(COMMIT_LSN, SEQ, _TRUNC_LSN, _TRUNC_SEQ)
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


def _later(lsn: str, seq: str, ref_lsn: str, ref_seq: str) -> Column:
    """Position ``(lsn, seq)`` is after ``(ref_lsn, ref_seq)`` (column names)."""
    return (F.col(lsn) > F.col(ref_lsn)) | (
        (F.col(lsn) == F.col(ref_lsn)) & (F.col(seq) > F.col(ref_seq))
    )


# ---------------------------------------------------------------------------------- helpers


def _row_type(events: DataFrame) -> StructType:
    """The table's columns: the type of ``after`` (or ``before`` when no event has ``after``)."""
    for side in ("after", "before"):
        if side in events.columns and isinstance(events.schema[side].dataType, StructType):
            return events.schema[side].dataType  # type: ignore[return-value]
    raise ValueError("the events carry no row images (no 'after' or 'before' struct)")


def _field(side: str, column: str, events: DataFrame | None = None) -> Column | None:
    """``side.column`` when ``side`` is a struct having that field (``events`` given) ."""
    if events is not None:
        side_type = events.schema[side].dataType if side in events.columns else None
        if not isinstance(side_type, StructType) or column not in side_type.fieldNames():
            return None
    return F.col(side).getField(column)


def _unchanged(events: DataFrame, column: str) -> Column:
    """True when ``after.column`` is an unchanged TOAST value PostgreSQL did not send."""
    conditions: list[Column] = []
    source = events.schema["source"].dataType
    listed = (
        source["unchanged_toast"].dataType
        if isinstance(source, StructType) and "unchanged_toast" in source.fieldNames()
        else None
    )
    if isinstance(listed, ArrayType):
        conditions.append(F.array_contains(F.col("source.unchanged_toast"), column))
    after = events.schema["after"].dataType
    if isinstance(after, StructType) and isinstance(after[column].dataType, StringType):
        conditions.append(F.col("after").getField(column) == F.lit(UNAVAILABLE))
    result = F.lit(False)
    for condition in conditions:
        result = result | F.coalesce(condition, F.lit(False))
    return result


def _state_value(state: DataFrame, column: str, data_type: DataType) -> Column:
    if column in state.columns:
        return F.col(column).cast(data_type).alias(column)
    return F.lit(None).cast(data_type).alias(column)
