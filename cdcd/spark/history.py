"""History of a table (slowly changing dimension, type 2): one row per version of each row.

:func:`history` turns one table's events into versions: every insert, snapshot read and update
opens a version holding the whole row after it (unchanged TOAST values filled as by
:func:`cdcd.spark.state.latest_state`, key changes included); the next event of the same key
closes it (an update opens the next version, a delete opens none), and so does a truncate
after it. Columns: the table's columns, then

    _cdc_valid_from_lsn, _cdc_valid_from_seq   position of the event that made the version
    _cdc_valid_from                            its commit time (timestamp, UTC)
    _cdc_valid_to_lsn, _cdc_valid_to_seq       position of the event that ended it (null: current)
    _cdc_valid_to                              its commit time
    _cdc_op                                    c, r or u: what made the version
    _cdc_current                               true for versions still valid

The current versions are exactly the rows of ``latest_state`` over the same events. A key
change (delete of the old key, create of the new one) closes the old key's version and opens
one under the new key. Needs a keyed table.
"""

from __future__ import annotations

from collections.abc import Sequence

from pyspark.sql import DataFrame, Window
from pyspark.sql import functions as F

from cdcd.spark.columns import COMMIT_LSN, SEQ, default_key_columns
from cdcd.spark.state import OP, TS_US, row_versions, truncates

FROM_LSN, FROM_SEQ, FROM_TS = "_cdc_valid_from_lsn", "_cdc_valid_from_seq", "_cdc_valid_from"
TO_LSN, TO_SEQ, TO_TS = "_cdc_valid_to_lsn", "_cdc_valid_to_seq", "_cdc_valid_to"
CURRENT = "_cdc_current"


def history(events: DataFrame, key_columns: Sequence[str] | None = None) -> DataFrame:
    """The versions of every row of the table ``events`` describe (see the module)."""
    versions = row_versions(events, key_columns)
    columns = [c for c in versions.columns if not c.startswith("_cdc_")]
    keys = list(key_columns) if key_columns is not None else default_key_columns(events)
    by_key = Window.partitionBy(*keys).orderBy(COMMIT_LSN, SEQ)
    ends = versions.select(
        "*",
        F.lead(COMMIT_LSN).over(by_key).alias(TO_LSN),
        F.lead(SEQ).over(by_key).alias(TO_SEQ),
        F.lead(TS_US).over(by_key).alias("_cdc_to_us"),
    ).where(F.col(OP) != "d")
    # a truncate after the version's start and before its end closes it
    cuts = truncates(events).select(
        F.col(COMMIT_LSN).alias("_t_lsn"), F.col(SEQ).alias("_t_seq"), F.col(TS_US).alias("_t_us")
    )
    start = F.struct(COMMIT_LSN, SEQ)
    end = F.struct(TO_LSN, TO_SEQ)
    cut = (
        ends.join(
            F.broadcast(cuts),
            (F.struct("_t_lsn", "_t_seq") > start)
            & (F.col(TO_LSN).isNull() | (F.struct("_t_lsn", "_t_seq") < end)),
            "left",
        )
        .groupBy(*keys, COMMIT_LSN, SEQ)
        .agg(
            F.min(F.when(F.col("_t_lsn").isNotNull(), F.struct("_t_lsn", "_t_seq", "_t_us"))).alias(
                "_cut"
            )
        )
    )
    closed = ends.join(cut, on=[*keys, COMMIT_LSN, SEQ], how="left")
    to_lsn = F.coalesce(F.col("_cut._t_lsn"), F.col(TO_LSN))
    to_seq = F.when(F.col("_cut").isNotNull(), F.col("_cut._t_seq")).otherwise(F.col(TO_SEQ))
    to_us = F.when(F.col("_cut").isNotNull(), F.col("_cut._t_us")).otherwise(F.col("_cdc_to_us"))
    return closed.select(
        *columns,
        F.col(COMMIT_LSN).alias(FROM_LSN),
        F.col(SEQ).alias(FROM_SEQ),
        F.timestamp_micros(F.col(TS_US)).alias(FROM_TS),
        to_lsn.alias(TO_LSN),
        to_seq.alias(TO_SEQ),
        F.timestamp_micros(to_us).alias(TO_TS),
        F.col(OP).alias(OP),
        to_lsn.isNull().alias(CURRENT),
    )
