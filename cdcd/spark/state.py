"""From change events to table state: deduplicate, rebuild, and apply micro-batches.

Events are the DataFrames of :mod:`cdcd.spark.sources` (one table's events, docs/events.md).

Position. ``(source.commit_lsn, source.seq)`` is unique per event and orders all events:
delivery is at-least-once, so a consumer deduplicates on it (:func:`deduplicate`) and applies
events in its order. Nothing else (file order, Kafka offsets, ``ts_ms``) is used for ordering.

State rows. :func:`apply_changes` keeps, per key, the row after the newest event and that
event's position in ``_cdc_commit_lsn``/``_cdc_seq``. A delete leaves a *tombstone*
(``_cdc_deleted`` true), so that replaying an older event of that key (a duplicate delivered
after the delete) cannot bring the row back: events at or before a key's position in the
state are dropped. A tombstone's other columns are null, except after the delete half of a
key change (it carries ``source.new_key``): that tombstone keeps the row's last values, for
the create of the new key (see below) that may come in a later micro-batch. Tombstones are
kept for ever; :func:`current_rows` hides them (and the metadata columns).
:func:`latest_state` is ``current_rows(apply_changes(None, events))``.

Keys. ``key_columns`` (default: the fields of the events' ``key`` struct) identify a row. An
event's key values are taken from ``after``, else ``before``, else ``key`` (a delete carries
the key in ``before`` and ``key``).

Unchanged TOAST values. An update's ``after`` holds ``"__debezium_unavailable_value"`` (JSON
Lines) or null (Parquet) for a TOASTed column PostgreSQL did not send; the column is listed in
``source.unchanged_toast``. Such a value is the column's value in the newest earlier event (or
state row) of the same row (with REPLICA IDENTITY FULL: the value in the event's own complete
``before``): a window ``last(..., ignorenulls)`` over the row's events in position order; each
value is wrapped in a one-field struct first so that a real SQL null still counts as a value.

Key changes. An update that changes the key is a delete of the old key carrying
``source.new_key`` followed, at the next ``seq``, by a create of the new key carrying
``source.old_key`` (docs/events.md). The create's unchanged TOAST columns are the values the row
had under the old key just before: the create *continues* the old key's row. Rows are grouped
into segments (a key's events from an insert, snapshot read or state row up to the next one);
a create with ``old_key`` and unchanged TOAST columns links its segment to the segment holding
the old key's event at the position just before it (the delete, or the state's tombstone of
that delete when it came in an earlier micro-batch). Links are followed to their first segment
(pointer doubling, one small Spark job per round: chains of key changes within one batch are
short), and the carry-forward window runs over these lineages instead of over keys. So a key
changed twice in one transaction, updated in between, or changed in a batch after the delete
half of the pair, rebuilds exactly. Without ``old_key`` (files from before the field existed)
the create's unchanged columns are null, as is any unchanged TOAST value whose row the state
never held (a stream read from its middle). Finding out whether a batch has such creates costs one pass over
its events (cache them when reading them is expensive).

Truncate (op ``t``). Every row whose position is before the newest truncate of the batch
becomes a tombstone at the truncate's position.

Tables without a key: :mod:`cdcd.spark.keyless`.
"""

from __future__ import annotations

from collections.abc import Sequence

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F
from pyspark.sql.types import ArrayType, DataType, StructType

from cdcd.spark.columns import (
    COMMIT_LSN,
    DELETED,
    METADATA,
    ROW_OPS,
    SEQ,
    TRUNC_LSN,
    TRUNC_SEQ,
    UNAVAILABLE,
    default_key_columns,
    field,
    key_value,
    later,
    row_type,
    source_field,
    state_value,
    unchanged,
    with_position,
)
from cdcd.spark.keyless import apply_keyless

__all__ = [
    "COMMIT_LSN",
    "DELETED",
    "METADATA",
    "SEQ",
    "UNAVAILABLE",
    "apply_changes",
    "current_rows",
    "deduplicate",
    "default_key_columns",
    "latest_state",
    "row_versions",
]

ORDER = "_cdc_order"  # state rows (0) sort before events (1) at the same position
OP = "_cdc_op"
KEEP = "_cdc_keep"  # a tombstone keeps its values (the delete half of a key change)
TS_US = "_cdc_ts_us"  # commit time of the event (source.ts_us), null for state rows
_OLD = "_cdc_old"
_SEG = "_cdc_seg"
_LINE = "_cdc_line"
#: the columns of a row that its batch gave no value for (``apply_changes(unknown=True)``)
UNKNOWN = "_cdc_unknown"
_FIND = "find"  # apply_changes(newest_truncate=): look for it in the events
MAX_LINK_ROUNDS = 64  # pointer doubling: resolves chains of up to 2**64 key changes


def deduplicate(events: DataFrame) -> DataFrame:
    """One event per position ``(source.commit_lsn, source.seq)`` (duplicates are identical
    by contract, any one is kept). On a streaming DataFrame the state of seen positions grows
    without bound; deduplicate micro-batches instead (:func:`apply_changes` does)."""
    return with_position(events).dropDuplicates([COMMIT_LSN, SEQ]).drop(COMMIT_LSN, SEQ)


def latest_state(events: DataFrame, key_columns: Sequence[str] | None = None) -> DataFrame:
    """The table's current rows (the columns of ``after``) after applying ``events`` of one
    table in position order; duplicates are dropped first."""
    return current_rows(apply_changes(None, events, key_columns))


def current_rows(state: DataFrame) -> DataFrame:
    """The visible rows of a state from :func:`apply_changes`: no tombstones, no metadata."""
    return state.where(~F.col(DELETED)).drop(*METADATA)


def _prepare(
    state: DataFrame | None, events: DataFrame, key_columns: Sequence[str] | None
) -> tuple[list[str], dict[str, DataType], DataFrame]:
    keys = list(default_key_columns(events) if key_columns is None else key_columns)
    rtype = row_type(events)
    missing = [k for k in keys if k not in rtype.fieldNames()]
    if missing:
        raise ValueError(
            f"key columns {missing} are not columns of the table {rtype.simpleString()}"
        )
    types = {f.name: f.dataType for f in rtype.fields}
    if state is not None:
        types.update({f.name: f.dataType for f in state.schema.fields if f.name not in METADATA})
    events = with_position(deduplicate(events)).where(F.col("op").isin(*ROW_OPS, "t"))
    return keys, types, events


def apply_changes(
    state: DataFrame | None,
    events: DataFrame,
    key_columns: Sequence[str] | None = None,
    *,
    unknown: bool = False,
    newest_truncate: tuple[int, int] | str | None = _FIND,
) -> DataFrame:
    """The state after applying a batch of ``events`` to ``state`` (a previous result of this
    function, or None for an empty table). Idempotent: events at or before a key's position in
    the state are ignored, duplicates within the batch are dropped.

    ``newest_truncate``: the position of the batch's newest truncate, or None when it has
    none, when the caller already knows (a keyed table's fold then skips finding it); by
    default it is found in the events.

    ``unknown`` (with ``state`` None, for a batch without key-change creates leaving TOASTed
    columns unchanged): each row also carries :data:`UNKNOWN`, the names of the columns whose
    value no event of the batch gave (an unchanged TOAST value, or the values a key change's
    delete half keeps), null in the row: a MERGE takes them from the target row."""
    if unknown and state is not None:
        raise ValueError("unknown columns are for a batch folded on its own (no state)")
    keys, types, events = _prepare(state, events, key_columns)
    rows = events.where(F.col("op").isin(*ROW_OPS))
    if not keys:
        truncate_positions = events.where(F.col("op") == "t").select(COMMIT_LSN, SEQ)
        return apply_keyless(state, rows, _newest_truncate(events), truncate_positions, types)
    others = [c for c in types if c not in keys]
    versions = _versions(state, rows, keys, types, unknown)
    by_key = Window.partitionBy(*keys).orderBy(COMMIT_LSN, SEQ, ORDER)
    newest = versions.withColumn("_cdc_last", F.lead(COMMIT_LSN).over(by_key).isNull()).where(
        "_cdc_last"
    )
    if isinstance(newest_truncate, str):
        newest = newest.crossJoin(F.broadcast(_newest_truncate(events)))
    else:  # the caller knows it: no pass over the events to find it
        lsn, seq = newest_truncate or (None, None)
        newest = newest.withColumn(TRUNC_LSN, F.lit(lsn).cast("long"))
        newest = newest.withColumn(TRUNC_SEQ, F.lit(seq).cast("long"))
    cut = F.col(TRUNC_LSN).isNotNull() & later(TRUNC_LSN, TRUNC_SEQ, COMMIT_LSN, SEQ)
    deleted = cut | (F.col(OP) == "d")
    shown = ~deleted | (~cut & F.col(KEEP))
    marks = [F.when(shown & F.col(_unknown(c)), F.lit(c)) for c in others] if unknown else []
    return newest.select(
        *(F.col(k) for k in keys),
        *(F.when(shown, F.col(c)).alias(c) for c in others),
        F.when(cut, F.col(TRUNC_LSN)).otherwise(F.col(COMMIT_LSN)).alias(COMMIT_LSN),
        F.when(cut, F.col(TRUNC_SEQ)).otherwise(F.col(SEQ)).alias(SEQ),
        deleted.alias(DELETED),
        *([F.array_compact(F.array(*marks)).alias(UNKNOWN)] if marks else []),
    ).select(*types, *METADATA, *([UNKNOWN] if marks else []))


def _newest_truncate(events: DataFrame) -> DataFrame:
    """One row: the position of the newest truncate among ``events`` (nulls without one)."""
    return (
        events.where(F.col("op") == "t")
        .agg(F.max(F.struct(F.col(COMMIT_LSN), F.col(SEQ))).alias("t"))
        .select(F.col("t")[COMMIT_LSN].alias(TRUNC_LSN), F.col("t")[SEQ].alias(TRUNC_SEQ))
    )


def row_versions(events: DataFrame, key_columns: Sequence[str] | None = None) -> DataFrame:
    """Every row event (``c r u d``) of ``events`` with the whole row after it (unchanged TOAST
    values filled as by :func:`apply_changes`): the key and row columns, ``_cdc_commit_lsn``,
    ``_cdc_seq``, ``_cdc_op`` and ``_cdc_ts_us`` (commit time). Duplicates dropped; needs a key."""
    keys, types, events = _prepare(None, events, key_columns)
    if not keys:
        raise ValueError("row versions need key columns (the table has no key)")
    rows = events.where(F.col("op").isin(*ROW_OPS))
    return _versions(None, rows, keys, types).drop(ORDER, KEEP)


def truncates(events: DataFrame) -> DataFrame:
    """The positions and commit times of the truncates among ``events``."""
    return (
        with_position(deduplicate(events))
        .where(F.col("op") == "t")
        .select(COMMIT_LSN, SEQ, F.col("source.ts_us").cast("long").alias(TS_US))
    )


# ------------------------------------------------------------------------------ keyed tables


def _unknown(column: str) -> str:
    return f"_cdc_unknown_{column}"


def _versions(
    state: DataFrame | None,
    rows: DataFrame,
    keys: list[str],
    types: dict[str, DataType],
    unknown: bool = False,
) -> DataFrame:
    """State rows and events of a keyed table, each with the whole row after it; with
    ``unknown``, per column whether no earlier event gave its value (``_cdc_unknown_<c>``),
    and key-change creates are not linked to their old key (the caller has none)."""
    others = [c for c in types if c not in keys]
    changes = _changes(state, rows, keys, types)
    if state is not None:  # drop replays: events at or before the state row of their key
        seen = F.max(F.when(F.col(ORDER) == 0, F.struct(COMMIT_LSN, SEQ))).over(
            Window.partitionBy(*keys)
        )
        changes = (
            changes.withColumn("_cdc_seen", seen)
            .where(
                (F.col(ORDER) == 0)
                | F.col("_cdc_seen").isNull()
                | (F.struct(COMMIT_LSN, SEQ) > F.col("_cdc_seen"))
            )
            .drop("_cdc_seen")
        )
    lineage: list[str | Column] = list(keys)
    if (
        not unknown
        and _links_possible(rows)
        and not rows.where(_link_candidate(rows, keys)).isEmpty()
    ):
        changes = _with_lineage(changes, keys)
        lineage = [_LINE]
    line = (
        Window.partitionBy(*lineage)
        .orderBy(COMMIT_LSN, SEQ, ORDER)
        .rowsBetween(Window.unboundedPreceding, Window.currentRow)
    )
    return changes.select(
        COMMIT_LSN,
        SEQ,
        OP,
        ORDER,
        KEEP,
        TS_US,
        *keys,
        *(F.last(c, ignorenulls=True).over(line)["v"].alias(c) for c in others),
        *(
            F.last(c, ignorenulls=True).over(line).isNull().alias(_unknown(c))
            for c in (others if unknown else [])
        ),
    )


def _changes(
    state: DataFrame | None, rows: DataFrame, keys: list[str], types: dict[str, DataType]
) -> DataFrame:
    """One row per event and state row: position, op, key columns, and each other column as
    a struct ``v`` (a value, possibly null) or null (carried forward from earlier)."""
    others = [c for c in types if c not in keys]
    after_fields = set(row_type(rows).fieldNames())

    def event_value(c: str) -> Column:
        if c not in after_fields:  # a column the batch does not know: a null value
            return F.struct(F.lit(None).cast(types[c]).alias("v")).alias(c)
        value = F.struct(F.col("after").getField(c).cast(types[c]).alias("v"))
        changed = (F.col("op") != "d") & ~unchanged(rows, c)
        before = field("before", c, rows)
        if before is None:
            return F.when(changed, value).alias(c)
        # REPLICA IDENTITY FULL: the old row is complete, its value is the unchanged one
        full = (F.col("op") != "d") & F.col("before").isNotNull()
        old = F.when(full, F.struct(before.cast(types[c]).alias("v")))
        return F.when(changed, value).otherwise(old).alias(c)

    old_key = (
        F.when(
            _link_candidate(rows, keys),
            F.struct(*(F.col("source.old_key").getField(k).cast(types[k]).alias(k) for k in keys)),
        )
        if _links_possible(rows)
        else F.lit(None)
    )
    keep = (
        (F.col("op") == "d") & F.col("source.new_key").isNotNull()
        if source_field(rows, "new_key") is not None
        else F.lit(False)
    )
    ts = F.col("source.ts_us") if source_field(rows, "ts_us") is not None else F.lit(None)
    changes = rows.select(
        F.col(COMMIT_LSN),
        F.col(SEQ),
        F.col("op").alias(OP),
        F.lit(1).alias(ORDER),
        keep.alias(KEEP),
        ts.cast("long").alias(TS_US),
        *(key_value(rows, k, types[k]) for k in keys),
        *(event_value(c) for c in others),
        old_key.alias(_OLD),
    )
    if state is None:
        return changes
    old_type = changes.schema[_OLD].dataType
    return changes.unionByName(
        state.select(
            F.col(COMMIT_LSN).cast("long"),
            F.col(SEQ).cast("long"),
            F.when(F.col(DELETED), "d").otherwise("r").alias(OP),
            F.lit(0).alias(ORDER),
            F.lit(True).alias(KEEP),
            F.lit(None).cast("long").alias(TS_US),
            *(state_value(state, k, types[k]) for k in keys),
            *(F.struct(state_value(state, c, types[c]).alias("v")).alias(c) for c in others),
            F.lit(None).cast(old_type).alias(_OLD),
        )
    )


def _links_possible(rows: DataFrame) -> bool:
    return isinstance(source_field(rows, "old_key"), StructType) and isinstance(
        source_field(rows, "unchanged_toast"), ArrayType
    )


def _link_candidate(rows: DataFrame, keys: list[str]) -> Column:
    """A create of a new key (``old_key`` set) with unchanged TOAST columns to fill."""
    return (
        (F.col("op") == "c")
        & F.col("source.old_key").isNotNull()
        & (F.coalesce(F.size("source.unchanged_toast"), F.lit(0)) > 0)
    )


def _with_lineage(changes: DataFrame, keys: list[str]) -> DataFrame:
    """``changes`` plus ``_cdc_line``: the first segment of the row each change belongs to,
    following key-change creates back to the segment of their old key (see the module
    docstring)."""
    by_key = (
        Window.partitionBy(*keys)
        .orderBy(COMMIT_LSN, SEQ, ORDER)
        .rowsBetween(Window.unboundedPreceding, Window.currentRow)
    )
    start = (F.col(ORDER) == 0) | F.col(OP).isin("c", "r")
    segment = F.struct(
        F.struct(*keys).alias("k"),
        F.last(F.when(start, F.struct(COMMIT_LSN, SEQ, ORDER)), ignorenulls=True)
        .over(by_key)
        .alias("p"),
    )
    changes = changes.withColumn(_SEG, segment)
    parents = changes.select(
        F.struct(*keys).alias(_OLD), COMMIT_LSN, F.col(SEQ).alias("_cdc_pseq"), F.col(_SEG)
    )
    links = (
        changes.where(F.col(_OLD).isNotNull())
        .select(F.col(_SEG).alias("_c"), _OLD, COMMIT_LSN, (F.col(SEQ) - 1).alias("_cdc_pseq"))
        .join(parents, on=[_OLD, COMMIT_LSN, "_cdc_pseq"])
        .select("_c", F.col(_SEG).alias("_p"))
        .dropDuplicates(["_c"])
        .localCheckpoint()
    )
    for _ in range(MAX_LINK_ROUNDS):
        step = links.join(
            links.select(F.col("_c").alias("_p"), F.col("_p").alias("_pp")), on="_p", how="left"
        )
        if step.where(F.col("_pp").isNotNull()).isEmpty():
            break
        links = step.select("_c", F.coalesce("_pp", "_p").alias("_p")).localCheckpoint()
    roots = links.select(F.col("_c").alias(_SEG), F.col("_p").alias("_cdc_root"))
    return (
        changes.join(roots, on=_SEG, how="left")
        .withColumn(_LINE, F.coalesce(F.col("_cdc_root"), F.col(_SEG)))
        .drop("_cdc_root", _SEG)
    )
