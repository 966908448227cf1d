"""Names and column expressions shared by the state, history and MERGE jobs.

State and history rows carry the position of the event that made them in ``_cdc_commit_lsn``
and ``_cdc_seq`` (docs/events.md: ``(source.commit_lsn, source.seq)`` is unique per event and
orders all events of a table) and ``_cdc_deleted`` for tombstones.
"""

from __future__ import annotations

from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import ArrayType, DataType, StringType, StructType

UNAVAILABLE = "__debezium_unavailable_value"
COMMIT_LSN = "_cdc_commit_lsn"
SEQ = "_cdc_seq"
DELETED = "_cdc_deleted"
METADATA = (COMMIT_LSN, SEQ, DELETED)
ROW_OPS = ("c", "r", "u", "d")
TRUNC_LSN = "_cdc_trunc_lsn"
TRUNC_SEQ = "_cdc_trunc_seq"


def is_connect(frame: DataFrame) -> bool:
    """Whether ``frame`` is a Spark Connect DataFrame (not a classic one)."""
    return type(frame).__module__.startswith("pyspark.sql.connect")


def with_position(events: DataFrame) -> DataFrame:
    """``events`` plus the position as top-level columns ``_cdc_commit_lsn``, ``_cdc_seq``."""
    return events.withColumn(COMMIT_LSN, F.col("source.commit_lsn").cast("long")).withColumn(
        SEQ, F.col("source.seq").cast("long")
    )


def default_key_columns(events: DataFrame) -> list[str]:
    """The fields of the events' ``key`` struct; empty for a keyless table."""
    if "key" not in events.columns:
        return []
    key_type = events.schema["key"].dataType
    return list(key_type.fieldNames()) if isinstance(key_type, StructType) else []


def source_field(events: DataFrame, name: str) -> DataType | None:
    """The type of ``source.<name>``, None when the events' ``source`` has no such field
    (``old_key``/``new_key`` are absent in files written before they existed)."""
    source = events.schema["source"].dataType if "source" in events.columns else None
    if isinstance(source, StructType) and name in source.fieldNames():
        return source[name].dataType
    return None


def key_value(events: DataFrame, column: str, data_type: DataType) -> Column:
    """A key column's value: from ``after``, else ``before``, else the event's ``key``."""
    sources = [field("after", column, events), field("before", column, events)]
    key_type = events.schema["key"].dataType if "key" in events.columns else None
    if isinstance(key_type, StructType) and column in key_type.fieldNames():
        sources.append(F.col("key").getField(column))
    found = [s for s in sources if s is not None]
    return F.coalesce(*found).cast(data_type).alias(column)


def later(lsn: str, seq: str, ref_lsn: str, ref_seq: str) -> Column:
    """Position ``(lsn, seq)`` is after ``(ref_lsn, ref_seq)`` (column names)."""
    return (F.col(lsn) > F.col(ref_lsn)) | (
        (F.col(lsn) == F.col(ref_lsn)) & (F.col(seq) > F.col(ref_seq))
    )


def row_type(events: DataFrame) -> StructType:
    """The table's columns: the type of ``after`` (or ``before`` when no event has ``after``)."""
    for side in ("after", "before"):
        if side in events.columns and isinstance(events.schema[side].dataType, StructType):
            return events.schema[side].dataType  # type: ignore[return-value]
    raise ValueError("the events carry no row images (no 'after' or 'before' struct)")


def field(side: str, column: str, events: DataFrame | None = None) -> Column | None:
    """``side.column`` when ``side`` is a struct having that field (``events`` given)."""
    if events is not None:
        side_type = events.schema[side].dataType if side in events.columns else None
        if not isinstance(side_type, StructType) or column not in side_type.fieldNames():
            return None
    return F.col(side).getField(column)


def unchanged(events: DataFrame, column: str) -> Column:
    """True when ``after.column`` is an unchanged TOAST value PostgreSQL did not send."""
    conditions: list[Column] = []
    listed = source_field(events, "unchanged_toast")
    if isinstance(listed, ArrayType):
        conditions.append(F.array_contains(F.col("source.unchanged_toast"), column))
    after = events.schema["after"].dataType
    if isinstance(after, StructType) and isinstance(after[column].dataType, StringType):
        conditions.append(F.col("after").getField(column) == F.lit(UNAVAILABLE))
    result = F.lit(False)
    for condition in conditions:
        result = result | F.coalesce(condition, F.lit(False))
    return result


def state_value(state: DataFrame, column: str, data_type: DataType) -> Column:
    """``state.column`` cast to ``data_type``; a null of that type when the state lacks it."""
    if column in state.columns:
        return F.col(column).cast(data_type).alias(column)
    return F.lit(None).cast(data_type).alias(column)
