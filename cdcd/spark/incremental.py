"""A table's state as Parquet partitioned by a bucket of the key: micro-batches rewrite only
the buckets they touch.

Layout of ``<dst>``::

    <dst>/_cdc_bucket=<n>/part-*.parquet   the state rows of bucket n (apply_changes' rows:
                                           tombstones and _cdc_* columns included)
    <dst>/_layout/                         the bucketing, written by the first batch (JSON)

Bucketing (``layout``, fixed when the state is created, read back afterwards):

* ``"range:<width>"`` — a single integer key: bucket ``floor(key / width)``. Rows inserted
  together (serial keys) and the recent rows most updates touch share a few buckets, so a
  micro-batch of an OLTP table rewrites a few buckets whatever the table's size.
* ``"hash:<n>"`` — any key: bucket ``pmod(xxhash64(key columns), n)``. Spreads evenly: a
  micro-batch of k events on random keys rewrites about ``n * (1 - (1 - 1/n) ** k)`` buckets.
* ``"auto"`` (default) — ``range:50000`` for a single integer key, ``hash:64`` otherwise;
  tables without a key have one bucket.

:func:`apply_batch` applies one batch of events: it finds the buckets of the batch's keys (and
of the ``old_key`` of key-change creates, whose row it needs for the unchanged TOAST values;
every bucket when the batch holds a truncate), reads only those buckets (partition pruning),
applies the batch with :func:`cdcd.spark.state.apply_changes` and writes them back with dynamic
partition overwrite (``partitionOverwriteMode=dynamic``: Spark replaces exactly the bucket
folders the output has). The result is materialised (``localCheckpoint``) before the write, as
Spark does not overwrite what it is reading. Idempotent on replay: every state row holds the
position of its newest event and older or equal events are dropped, so a batch run again after
a crash (Spark's streaming replays the same batch) changes nothing, also when the crash came
after some buckets were replaced. The one window that is not covered is Spark's own: dynamic
overwrite deletes a bucket folder and then renames the new one into place; a crash between the
two loses that bucket (recover with a rebuild, :func:`rebuild`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from pyspark.errors import AnalysisException
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import ByteType, DataType, IntegerType, LongType, ShortType, StructType

from cdcd.spark.columns import METADATA, ROW_OPS, default_key_columns, field, row_type
from cdcd.spark.state import apply_changes, current_rows

log = logging.getLogger("cdcd.spark")

BUCKET = "_cdc_bucket"
LAYOUT_FOLDER = "_layout"
DEFAULT_RANGE_WIDTH = 50_000
DEFAULT_HASH_BUCKETS = 64
_LAYOUTS: dict[str, str] = {}  # state folder -> its layout, once read in this process


def resolve_layout(layout: str, keys: Sequence[str], types: dict[str, DataType]) -> str:
    """``layout`` with ``auto`` resolved; ValueError for a malformed or unusable one."""
    if not keys:
        return "none"
    integer = len(keys) == 1 and isinstance(
        types[keys[0]], ByteType | ShortType | IntegerType | LongType
    )
    if layout == "auto":
        return f"range:{DEFAULT_RANGE_WIDTH}" if integer else f"hash:{DEFAULT_HASH_BUCKETS}"
    kind, _, number = layout.partition(":")
    if kind not in ("range", "hash") or not number.isdigit() or int(number) < 1:
        raise ValueError(f"layout must be auto, range:<width> or hash:<buckets>, got {layout!r}")
    if kind == "range" and not integer:
        raise ValueError(f"layout {layout!r} needs a single integer key column, not {keys}")
    return layout


def bucket_of(layout: str, columns: Sequence[Column]) -> Column:
    """The bucket of key values ``columns`` under a resolved ``layout``."""
    kind, _, number = layout.partition(":")
    if kind == "range":
        return F.floor(columns[0] / F.lit(int(number))).cast("long")
    if kind == "hash":
        return F.pmod(F.xxhash64(*columns), F.lit(int(number))).cast("long")
    return F.lit(0).cast("long")


def _stored_layout(spark: SparkSession, dst: str) -> str | None:
    try:
        rows = spark.read.schema("layout string").json(f"{dst}/{LAYOUT_FOLDER}").collect()
    except AnalysisException:
        return None
    return str(rows[0]["layout"]) if rows else None


def state_layout(
    spark: SparkSession, dst: str, layout: str, keys: Sequence[str], types: dict[str, DataType]
) -> str:
    """The state's bucketing: the stored one, else ``layout`` (resolved and stored)."""
    stored = _LAYOUTS.get(dst) or _stored_layout(spark, dst)
    wanted = resolve_layout(layout, keys, types)
    if stored is not None:
        if layout != "auto" and stored != wanted:
            raise ValueError(f"{dst} is bucketed as {stored!r}, not {wanted!r}: rebuild it")
        _LAYOUTS[dst] = stored
        return stored
    spark.createDataFrame([(wanted,)], "layout string").coalesce(1).write.mode("overwrite").json(
        f"{dst}/{LAYOUT_FOLDER}"
    )
    _LAYOUTS[dst] = wanted
    return wanted


def read_state(
    spark: SparkSession,
    dst: str,
    with_metadata: bool = False,
    columns: Sequence[str] | None = None,
) -> DataFrame | None:
    """The state under ``dst`` (visible rows, ``columns`` in that order when given, unless
    ``with_metadata``), or None when no batch has been applied."""
    try:
        state = spark.read.option("mergeSchema", "true").parquet(dst)
        state.schema  # noqa: B018  (Spark Connect analyses lazily: fail here, not later)
    except AnalysisException:  # no such folder, or no Parquet files in it yet
        return None
    if with_metadata:
        return state
    rows = current_rows(state.drop(BUCKET))
    return rows.select(*columns) if columns is not None else rows


def key_values(events: DataFrame, keys: list[str], types: dict[str, DataType]) -> DataFrame:
    """The key values of every row event and of every ``source.old_key``."""
    key_type = events.schema["key"].dataType if "key" in events.columns else None

    def value(k: str) -> Column:
        options = [field("after", k, events), field("before", k, events)]
        if isinstance(key_type, StructType) and k in key_type.fieldNames():
            options.append(F.col("key").getField(k))
        return F.coalesce(*(o for o in options if o is not None)).cast(types[k]).alias(k)

    rows = events.where(F.col("op").isin(*ROW_OPS))
    found = rows.select(*(value(k) for k in keys))
    source = events.schema["source"].dataType
    if isinstance(source, StructType) and "old_key" in source.fieldNames():
        old = rows.where(F.col("source.old_key").isNotNull()).select(
            *(F.col("source.old_key").getField(k).cast(types[k]).alias(k) for k in keys)
        )
        found = found.unionByName(old)
    return found


def apply_batch(
    spark: SparkSession,
    events: DataFrame,
    dst: str,
    key_columns: Sequence[str] | None = None,
    layout: str = "auto",
    batch_id: int | None = None,
) -> dict[str, float]:
    """Apply one batch of ``events`` to the bucketed state under ``dst``; returns figures
    (events, buckets rewritten: -1 for all, seconds, newest commit_lsn) also logged at INFO."""
    started = time.monotonic()
    events = events.localCheckpoint()  # read once, used for buckets, state and changes
    keys = list(default_key_columns(events) if key_columns is None else key_columns)
    types = {f.name: f.dataType for f in row_type(events).fields}
    layout = state_layout(spark, dst, layout, keys, types)
    figures = events.agg(
        F.count(F.lit(1)).alias("n"),
        F.max(F.struct("source.commit_lsn", "source.seq")).alias("p"),
        F.max(F.col("op") == "t").alias("t"),
    ).collect()[0]
    if not figures["n"]:
        return {"events": 0.0, "buckets": 0.0, "seconds": time.monotonic() - started}
    state = read_state(spark, dst, with_metadata=True)
    touched: list[int] = []
    if state is not None and not figures["t"]:  # a truncate touches every bucket
        touched = sorted(
            r[0]
            for r in key_values(events, keys, types)
            .select(bucket_of(layout, [F.col(k) for k in keys]).alias(BUCKET))
            .distinct()
            .collect()
        )
        state = state.where(F.col(BUCKET).isin(touched))
    if state is not None:
        state = state.drop(BUCKET)
    result = apply_changes(state, events, keys)
    result = result.withColumn(BUCKET, bucket_of(layout, [F.col(k) for k in keys]))
    result = result.repartition(BUCKET).localCheckpoint()
    buckets = len(touched) if state is not None and not figures["t"] else -1  # -1: all
    (
        result.write.mode("overwrite")
        .option("partitionOverwriteMode", "dynamic")
        .partitionBy(BUCKET)
        .parquet(dst)
    )
    out = {
        "events": float(figures["n"]),
        "buckets": float(buckets),
        "seconds": time.monotonic() - started,
        "commit_lsn": float(figures["p"][0] or 0),
    }
    log.info(
        "batch %s: %d events up to commit_lsn %s, %s buckets rewritten (%s), %.2fs",
        "-" if batch_id is None else batch_id,
        figures["n"],
        figures["p"][0],
        "all" if buckets < 0 else buckets,
        layout,
        out["seconds"],
    )
    return out


def rebuild(
    spark: SparkSession,
    events: DataFrame,
    dst: str,
    key_columns: Sequence[str] | None = None,
    layout: str = "auto",
) -> None:
    """Write the state of all ``events`` under ``dst`` from scratch (replacing what is there)."""
    keys = list(default_key_columns(events) if key_columns is None else key_columns)
    types = {f.name: f.dataType for f in row_type(events).fields}
    resolved = resolve_layout(layout, keys, types)
    state = apply_changes(None, events, keys)
    state = state.withColumn(BUCKET, bucket_of(resolved, [F.col(k) for k in keys]))
    state.repartition(BUCKET).write.mode("overwrite").partitionBy(BUCKET).parquet(dst)
    spark.createDataFrame([(resolved,)], "layout string").coalesce(1).write.mode("overwrite").json(
        f"{dst}/{LAYOUT_FOLDER}"
    )
    _LAYOUTS[dst] = resolved
    log.info("rebuilt %s (%s)", dst, resolved)


__all__ = ["BUCKET", "METADATA", "apply_batch", "read_state", "rebuild", "resolve_layout"]
