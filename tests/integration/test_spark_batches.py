"""What a steady stream's micro-batches cost Spark, on a real session with Delta Lake: a batch
whose keys stay within the coarse key range of the one before compiles no generated code
again, a small batch shuffles in few partitions, and a fold told the batch's newest truncate
gives the rows it would find itself. Seconds are measured by ``bench/spark_microbatch.py``,
never here."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.sparkutil import change_event, write_jsonl, write_schema_file

pytest.importorskip("pyspark")

from cdcd.spark import apply_changes, apply_to_table, events_from_files, table_rows, tables
from cdcd.spark.merge import batch_facts, checkpoint_with_facts, coarse_range
from cdcd.spark.tables import SHUFFLE_PARTITIONS, batch_partitions

pytestmark = [pytest.mark.spark, pytest.mark.timeout(600)]

TABLE = "public.orders"
COLUMNS = [("id", "int8", 20, -1), ("note", "text", 25, -1), ("n", "int4", 23, -1)]


def folder_of(root: Path, events: list[dict[str, Any]]) -> str:
    write_schema_file(root / TABLE, (10, 0), COLUMNS, ["id"])
    write_jsonl(root / TABLE, events, per_file=len(events))
    return str(root)


def compiled(spark: Any) -> int:
    """How many generated classes this JVM has compiled so far."""
    metrics = spark._jvm.org.apache.spark.metrics.source.CodegenMetrics
    return int(metrics.METRIC_COMPILATION_TIME().getCount())


def test_coarse_range_holds_the_keys_and_repeats() -> None:
    for low, high, bits in [(980_031, 1_004_997, 64), (-5, 3, 64), (7, 7, 64), (-100, 120, 8)]:
        wide_low, wide_high = coarse_range(low, high, bits)
        assert wide_low <= low <= high <= wide_high
        assert wide_high - wide_low <= (high - low) * 1.5 + 2
        assert -(2 ** (bits - 1)) <= wide_low and wide_high <= 2 ** (bits - 1) - 1
    # the next batches of a stream whose keys grow slowly get the same bounds
    assert coarse_range(980_031, 1_004_997) == coarse_range(980_009, 1_005_995)
    assert coarse_range(2**31 - 100, 2**31 - 1, 32) == (2**31 - 112, 2**31 - 1)


def test_next_batch_in_the_same_key_range_compiles_nothing(spark: Any, tmp_path: Path) -> None:
    """Three batches of updates and inserts among keys 1000..1063, each at new positions:
    the third runs the same statements as the second (same coarse key range), so every
    generated class it needs is already compiled."""
    target = f"delta.`{tmp_path / 'orders'}`"
    initial = [
        change_event("c", (10, i), after={"id": i, "note": "x", "n": 0}) for i in range(2000)
    ]
    apply_to_table(
        spark, events_from_files(spark, folder_of(tmp_path / "b0", initial), TABLE), target
    )
    counts = []
    for batch in range(1, 4):
        events = [
            change_event(
                "u", (10 + batch, i), after={"id": 1000 + 7 * i + batch, "note": "y", "n": batch}
            )
            for i in range(8)
        ]
        events.append(
            change_event("c", (10 + batch, 8), after={"id": 2000 + batch, "note": "z", "n": batch})
        )
        folder = folder_of(tmp_path / f"b{batch}", events)
        before = compiled(spark)
        apply_to_table(spark, events_from_files(spark, folder, TABLE), target)
        counts.append(compiled(spark) - before)
    assert counts[2] == 0, f"classes compiled per batch: {counts}"
    state = {r["id"]: r["n"] for r in table_rows(spark, target).collect()}
    assert len(state) == 2003
    assert state[1000 + 7 * 3 + 3] == 3 and state[2003] == 3 and state[999] == 0


def test_small_batch_shuffles_in_one_partition(spark: Any) -> None:
    configured = spark.conf.get(SHUFFLE_PARTITIONS)
    spark.conf.set(SHUFFLE_PARTITIONS, "8")
    try:
        with batch_partitions(spark, 1_000) as wanted:
            assert wanted == 1 and spark.conf.get(SHUFFLE_PARTITIONS) == "1"
        assert spark.conf.get(SHUFFLE_PARTITIONS) == "8"
        with batch_partitions(spark, 250_000) as wanted:
            assert wanted == 3 and spark.conf.get(SHUFFLE_PARTITIONS) == "3"
        with batch_partitions(spark, 10**9) as wanted:
            assert wanted == 8 and spark.conf.get(SHUFFLE_PARTITIONS) == "8"
        with pytest.raises(RuntimeError), batch_partitions(spark, 10):
            raise RuntimeError("a failed apply")
        assert spark.conf.get(SHUFFLE_PARTITIONS) == "8"
    finally:
        spark.conf.set(SHUFFLE_PARTITIONS, configured)


@pytest.mark.parametrize("with_truncate", [True, False])
def test_fold_told_the_truncate_equals_finding_it(
    spark: Any, tmp_path: Path, with_truncate: bool
) -> None:
    events = [
        change_event("c", (10, 0), after={"id": 1, "note": "a", "n": 1}),
        change_event("c", (10, 1), after={"id": 2, "note": "b", "n": 1}),
        change_event("u", (20, 0), after={"id": 1, "note": "a2", "n": 2}),
        change_event("c", (40, 0), after={"id": 3, "note": "c", "n": 1}),
        change_event("d", (40, 1), before={"id": 2, "note": None, "n": None}),
    ]
    if with_truncate:
        events.insert(3, change_event("t", (30, 0), key=None))
    frame = events_from_files(spark, folder_of(tmp_path, events), TABLE).localCheckpoint()
    facts = batch_facts(frame, ["id"])
    assert (facts.truncate is not None) == with_truncate
    found = apply_changes(None, frame.coalesce(1), ["id"], unknown=True)
    told = apply_changes(
        None, frame.coalesce(1), ["id"], unknown=True, newest_truncate=facts.truncate
    )
    assert sorted(map(tuple, told.collect())) == sorted(map(tuple, found.collect()))
    deleted = {r["id"]: r["_cdc_deleted"] for r in told.collect()}
    assert deleted == (
        {1: True, 2: True, 3: False} if with_truncate else {1: False, 2: True, 3: False}
    )


def newest_commit(spark: Any, target: str) -> dict[str, int]:
    row = spark.sql(f"DESCRIBE HISTORY {target} LIMIT 1").collect()[0]
    assert row["operation"] == "MERGE", row["operation"]
    return {k: int(v) for k, v in (row["operationMetrics"] or {}).items() if v.isdigit()}


def test_merge_copies_small_touched_files_and_marks_rows_in_large_ones(
    spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first MERGE into a table writes deletion vectors (nothing is known of what a MERGE
    touches); the next one, the last having touched small files, rewrites the files it
    touches; above the threshold, deletion vectors again. The rows are right each time."""
    target = f"delta.`{tmp_path / 'orders'}`"
    initial = [change_event("c", (10, i), after={"id": i, "note": "x", "n": 0}) for i in range(500)]
    apply_to_table(
        spark, events_from_files(spark, folder_of(tmp_path / "b0", initial), TABLE), target
    )
    dv_added = []
    for batch in range(1, 4):
        if batch == 3:
            monkeypatch.setattr(tables, "COPY_ON_WRITE_BYTES", 0)
            monkeypatch.setattr(tables, "_touched", {})
        events = [
            change_event(
                "u", (10 + batch, i), after={"id": 10 * i + batch, "note": "y", "n": batch}
            )
            for i in range(5)
        ]
        events.append(change_event("d", (10 + batch, 5), before={"id": 400 + batch}))
        apply_to_table(
            spark,
            events_from_files(spark, folder_of(tmp_path / f"b{batch}", events), TABLE),
            target,
        )
        commit = newest_commit(spark, target)
        dv_added.append(commit["numTargetDeletionVectorsAdded"])
        assert dv_added[-1] or commit["numTargetFilesRemoved"], commit
    assert dv_added[0] > 0 and dv_added[1] == 0 and dv_added[2] > 0, dv_added
    state = {r["id"]: r["n"] for r in table_rows(spark, target).collect()}
    assert len(state) == 497
    assert state[12] == 2 and state[23] == 3 and state[11] == 1 and state[5] == 0
    assert 401 not in state and 403 not in state


def test_session_records_no_python_call_sites(spark: Any) -> None:
    """cdcd builds each batch's plan anew: PySpark's recording of the call site of every
    DataFrame and Column call is off in its sessions."""
    from pyspark.errors.utils import is_debugging_enabled

    assert spark.conf.get("spark.python.sql.dataFrameDebugging.enabled") == "false"
    assert not is_debugging_enabled()


def test_facts_found_while_checkpointing_in_one_job(spark: Any, tmp_path: Path) -> None:
    events = [
        change_event("c", (10, i), after={"id": 100 + i, "note": "x", "n": i}) for i in range(6)
    ]
    events += [change_event("t", (11, 0), key=None), change_event("d", (12, 0), before={"id": 101})]
    frame = events_from_files(spark, folder_of(tmp_path, events), TABLE)
    tracker, group = spark.sparkContext.statusTracker(), "cdcd-test-facts"
    spark.sparkContext.setJobGroup(group, group)
    try:
        checkpointed, facts = checkpoint_with_facts(frame, ["id"])
        ran = len(tracker.getJobIdsForGroup(group))
    finally:
        spark.sparkContext.setJobGroup("cdcd-test", "cdcd-test")
    assert ran == 1
    assert facts == batch_facts(checkpointed, ["id"])
    assert (facts.events, facts.row_events, facts.truncate) == (8, 7, (11, 0))
    assert facts.key_range is not None and facts.key_range[1] <= 100 <= 105 <= facts.key_range[2]


def test_fold_of_a_batch_in_one_partition_shuffles_nothing(spark: Any, tmp_path: Path) -> None:
    events = [
        change_event("c", (10, i), after={"id": i % 3, "note": "x", "n": i}) for i in range(9)
    ]
    frame = events_from_files(spark, folder_of(tmp_path, events), TABLE).localCheckpoint()
    folded = apply_changes(None, frame.coalesce(1), ["id"], unknown=True, newest_truncate=None)
    plan = folded._jdf.queryExecution().executedPlan().toString()
    assert "Exchange" not in plan, plan
    assert {(r["id"], r["n"]) for r in folded.collect()} == {(0, 6), (1, 7), (2, 8)}
