"""What a micro-batch MERGE into a Delta Lake table costs next to rebuilding the table.

    python -m bench.spark_microbatch [--rows 1000000] [--batch 1000] [--scd-type 1|2]
        [--warmup 5] [--batches 5]

Writes a table folder the way the file sink does (``_schema/`` file, JSON Lines files named by
position) holding ``--rows`` inserts, then times, on a local ``local[2]`` session with the
pinned Delta Lake (:func:`cdcd.spark.session.session`):

* **rebuild**: :func:`cdcd.spark.tables.apply_to_table` of all the files into a new Delta
  table (read, fold, one write);
* **micro-batch, OLTP**: ``apply_to_table`` of ``--batch`` events shaped like an OLTP
  table's stream: half inserts of new keys, 40% updates and 10% deletes of rows among the
  newest 20,000: ``--warmup`` batches (default 5, timed but not counted: the first MERGEs
  of a JVM compile and warm up; batch 1 costs about twice batch 10), then ``--batches``
  batches (default 5) whose median is reported, the steady batch of a long-running stream;
* **replay**: the last batch applied again (changes nothing);
* **micro-batch, random keys**: ``--batch`` updates of keys drawn uniformly from the whole
  table (every file of the table touched).

``--scd-type 2`` writes a type 2 table (AUTO CDC's ``stored_as_scd_type=2``: every version
kept, :mod:`cdcd.spark.scd2`) instead. Prints one JSON object with the seconds and the ratios
to the rebuild, the load averages at the start and the end (the machine may be shared), the
number of Spark jobs each apply ran, the CPU seconds the JVM spent in each (user + system,
from ``/proc``: steadier than seconds on a shared machine) and Delta's own timings of each
OLTP batch's commit (``DESCRIBE HISTORY``'s ``operationMetrics``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import orjson

TABLE = "public.orders"
COLUMNS = [("id", "int8", 20, -1), ("name", "text", 25, -1), ("qty", "int4", 23, -1)]
COLUMNS += [("note", "text", 25, -1)]


def _event(op: str, lsn: int, seq: int, row: dict[str, Any]) -> bytes:
    after = row if op != "d" else None
    before = {"id": row["id"], "name": None, "qty": None, "note": None} if op == "d" else None
    source = {"schema": "public", "table": "orders", "commit_lsn": lsn, "seq": seq}
    source["ts_us"] = 1_732_233_600_000_000 + lsn
    return orjson.dumps(
        {"before": before, "after": after, "source": source, "op": op, "key": {"id": row["id"]}}
    )


def _row(i: int, version: int = 0) -> dict[str, Any]:
    return {"id": i, "name": f"customer {i}", "qty": version, "note": f"note {i} " + "x" * 40}


def write_initial(spark: Any, folder: Path, rows: int) -> None:
    """``rows`` inserts at positions (i, 0), written by Spark as JSON Lines, renamed as the
    sink names files."""
    from pyspark.sql import functions as F

    (folder / "_schema").mkdir(parents=True)
    doc = {
        "schema": "public",
        "table": "orders",
        "key": ["id"],
        "commit_lsn": 1,
        "seq": 0,
        "columns": [
            {"name": n, "type": t, "type_oid": o, "typmod": m, "key": n == "id"}
            for n, t, o, m in COLUMNS
        ],
    }
    (folder / "_schema" / f"{1:016X}-{0:08X}.json").write_bytes(orjson.dumps(doc))
    i = F.col("id")
    after = F.struct(
        i.alias("id"),
        F.concat(F.lit("customer "), i).alias("name"),
        F.lit(0).alias("qty"),
        F.concat(F.lit("note "), i, F.lit(" " + "x" * 40)).alias("note"),
    )
    source = F.struct(
        F.lit("public").alias("schema"),
        F.lit("orders").alias("table"),
        i.alias("commit_lsn"),
        F.lit(0).alias("seq"),
        (F.lit(1_732_233_600_000_000) + i).alias("ts_us"),
    )
    event = F.struct(
        F.lit(None).cast("string").alias("before"),
        after.alias("after"),
        source.alias("source"),
        F.lit("c").alias("op"),
        F.struct(i.alias("id")).alias("key"),
    )
    staging = folder.parent / "_staging"
    spark.range(1, rows + 1, numPartitions=8).select(F.to_json(event)).write.text(str(staging))
    for n, part in enumerate(sorted(staging.glob("part-*.txt"))):
        part.rename(folder / f"{1 + n * (rows // 8):016X}-{0:08X}.jsonl")
    shutil.rmtree(staging)


def jvm_cpu_seconds() -> float:
    """User + system CPU seconds of this process's children (the Spark JVM), from ``/proc``."""
    ticks, me = 0, os.getpid()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me:
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


def write_batch(path: Path, events: list[bytes]) -> Path:
    path.write_bytes(b"\n".join(events) + b"\n")
    return path


def oltp_batch(rows: int, size: int, lsn: int, rng: random.Random, new_from: int) -> list[bytes]:
    events = []
    for seq in range(size):
        kind = rng.random()
        if kind < 0.5:
            events.append(_event("c", lsn, seq, _row(new_from + seq)))
        else:
            key = rng.randint(rows - 20_000, rows)
            events.append(_event("u" if kind < 0.9 else "d", lsn, seq, _row(key, lsn)))
    return events


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=1_000)
    parser.add_argument("--memory", default="2g")
    parser.add_argument("--scd-type", type=int, choices=(1, 2), default=1)
    parser.add_argument("--batches", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=5)
    args = parser.parse_args()

    from cdcd.spark.session import session
    from cdcd.spark.sources import event_schema, events_from_files
    from cdcd.spark.tables import apply_to_table, table_ref, table_rows

    load_start = os.getloadavg()
    spark = session("cdcd-bench", master="local[2]", memory=args.memory, partitions=8)
    work = Path(tempfile.mkdtemp(prefix="cdcd-spark-bench-"))

    tracker, jobs, cpu = spark.sparkContext.statusTracker(), [], []

    def apply_batch(events: Any, target: str) -> None:
        group = f"cdcd-bench-{len(jobs)}"
        spark.sparkContext.setJobGroup(group, group)
        before = jvm_cpu_seconds()
        apply_to_table(spark, events, target, format="delta", stored_as_scd_type=args.scd_type)
        cpu.append(round(jvm_cpu_seconds() - before, 2))
        jobs.append(len(tracker.getJobIdsForGroup(group)))
        spark.sparkContext.setJobGroup("cdcd-bench", "cdcd-bench")

    def last_commit(target: str) -> dict[str, Any]:
        """The newest commit's operation and Delta's own timings of it (milliseconds)."""
        row = spark.sql(f"DESCRIBE HISTORY {target} LIMIT 1").collect()[0]
        metrics = row["operationMetrics"] or {}
        timed = ("executionTimeMs", "scanTimeMs", "rewriteTimeMs", "materializeSourceTimeMs")
        found = {k: int(metrics[k]) for k in timed if k in metrics}
        return {"version": row["version"], "operation": row["operation"], **found}

    try:
        src, dst = work / "out", table_ref(str(work / "orders"))
        write_initial(spark, src / TABLE, args.rows)
        schema = event_schema(spark, str(src), TABLE)
        started = time.monotonic()
        apply_batch(events_from_files(spark, str(src), TABLE), dst)
        full = time.monotonic() - started
        rng = random.Random(17)
        lsn, new_from, oltp, commits = args.rows + 10, args.rows + 1, [], []
        for _ in range(args.warmup + args.batches):
            path = write_batch(
                work / f"b{lsn}.jsonl", oltp_batch(args.rows, args.batch, lsn, rng, new_from)
            )
            started = time.monotonic()
            apply_batch(spark.read.schema(schema).json(str(path)), dst)
            oltp.append(time.monotonic() - started)
            commits.append(last_commit(dst))
            lsn, new_from = lsn + 1, new_from + args.batch
        started = time.monotonic()
        apply_batch(spark.read.schema(schema).json(str(path)), dst)
        replay = time.monotonic() - started
        randoms = [
            _event("u", lsn, seq, _row(rng.randint(1, args.rows), lsn)) for seq in range(args.batch)
        ]
        path = write_batch(work / "random.jsonl", randoms)
        started = time.monotonic()
        apply_batch(spark.read.schema(schema).json(str(path)), dst)
        random_batch = time.monotonic() - started
        state = table_rows(spark, dst)
        oltp_count = args.warmup + args.batches
        names = ["rebuild", *(f"oltp_{n + 1}" for n in range(oltp_count)), "replay", "random"]
        counted, counted_cpu = oltp[args.warmup :], cpu[1 + args.warmup : 1 + oltp_count]
        result = {
            "rows": args.rows,
            "batch_events": args.batch,
            "target": "delta",
            "scd_type": args.scd_type,
            "rebuild_s": round(full, 2),
            "warmup_batches": args.warmup,
            "oltp_batch_s": [round(s, 2) for s in oltp],
            "oltp_batch_median_s": round(statistics.median(counted), 2),
            "oltp_ratio": round(statistics.median(counted) / full, 3),
            "oltp_batch_median_cpu_s": round(statistics.median(counted_cpu), 2),
            "oltp_cpu_ratio": round(statistics.median(counted_cpu) / cpu[0], 3),
            "replay_s": round(replay, 2),
            "random_batch_s": round(random_batch, 2),
            "random_ratio": round(random_batch / full, 3),
            "state_rows": state.count(),
            "spark_jobs": dict(zip(names, jobs, strict=True)),
            "jvm_cpu_s": dict(zip(names, cpu, strict=True)),
            "oltp_commits": commits,
            "loadavg_start": [round(x, 2) for x in load_start],
            "loadavg_end": [round(x, 2) for x in os.getloadavg()],
        }
        print(json.dumps(result, indent=2))
    finally:
        spark.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
