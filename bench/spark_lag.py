"""Sustained lag from PostgreSQL to Delta Lake through cdcd, Apache Kafka and Structured
Streaming.

    python -m bench.spark_lag [--rate 10000] [--seconds 90] [--trigger "1 second"]

All real and all on this machine: a PostgreSQL cluster (tests/pgharness.py), the cdcd daemon
(``python -m cdcd run``) with its Kafka sink into one Apache Kafka broker
(tests/kafkaharness.py), and :func:`cdcd.spark.stream_table` (Spark's Kafka source, one
``MERGE INTO`` per micro-batch) into a Delta table, on a ``local[2]`` session in this process.

A writer inserts ``--rate`` rows per second into ``public.lag`` for ``--seconds`` seconds, in
one transaction every 100 ms; each row holds ``written_at DEFAULT clock_timestamp()``. A row
is *visible* when the Delta commit that adds it is: the modification time of its
``_delta_log/<version>.json`` (written by rename, so it is there whole or not at all). The
rows a commit adds are read from the Parquet files it adds (inserts only: with deletion
vectors a MERGE adds new rows in new files), so each row's lag is ``visible - written_at``,
without running a query. After the writer stops, the bench waits for the last row.

Prints one JSON object: the rate asked for and the rate written, rows landed, the lag's
p50/p90/p99/max overall and per 10-second window of writing (a lag that keeps growing means
the pipeline does not sustain the rate), and the micro-batch times (Spark's progress:
rows, ``addBatch`` and whole trigger milliseconds).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.kafkaharness import BENCH_JVM_OPTIONS, KafkaBroker  # noqa: E402
from tests.pgharness import PgCluster, create_database, find_installations  # noqa: E402

TABLE = "public.lag"
NAME = "lagbench"
TICK = 0.1  # one transaction per tick


class DeltaWatcher:
    """Reads the commits of a Delta table's log as they appear: per commit, when it became
    visible and the ids and ``written_at`` (µs) of the rows its added files hold."""

    def __init__(self, table: Path) -> None:
        self.log = table / "_delta_log"
        self.next = 0
        self.rows: list[tuple[int, float, float]] = []  # (id, written_at s, visible s)
        self.commits: list[dict[str, Any]] = []

    def poll(self) -> None:
        while True:
            entry = self.log / f"{self.next:020d}.json"
            try:
                visible = entry.stat().st_mtime
                actions = [json.loads(line) for line in entry.read_text().splitlines() if line]
            except FileNotFoundError:
                return
            added = 0
            for action in actions:
                add = action.get("add")
                if add is None or not add.get("dataChange", True):
                    continue
                part = pq.read_table(self.log.parent / add["path"], columns=["id", "written_at"])
                ids = part.column("id").to_pylist()
                for i, w in zip(ids, part.column("written_at").to_pylist(), strict=True):
                    self.rows.append((i, _seconds(w), visible))
                added += len(ids)
            self.commits.append({"version": self.next, "visible": visible, "rows": added})
            self.next += 1

    def max_id(self) -> int:
        return max((r[0] for r in self.rows), default=0)


def _seconds(value: Any) -> float:
    """A ``written_at`` value as Unix seconds: the Kafka batches' inferred schema makes the
    column a string (ISO 8601), a timestamp once the table has one."""
    if isinstance(value, str):
        return datetime.fromisoformat(value).timestamp()
    return float(value.timestamp())


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _lag_figures(lags: list[float]) -> dict[str, Any]:
    if not lags:
        return {"rows": 0}
    return {
        "rows": len(lags),
        "p50_s": round(_pct(lags, 0.5), 2),
        "p90_s": round(_pct(lags, 0.9), 2),
        "p99_s": round(_pct(lags, 0.99), 2),
        "max_s": round(max(lags), 2),
    }


def write_rows(
    cluster: PgCluster,
    db: str,
    rate: int,
    seconds: float,
    stop: threading.Event,
    written: dict[str, Any],
) -> None:
    """Insert ``rate`` rows a second for ``seconds``, one transaction per tick, paced on the
    clock (a late tick is caught up by the next ones)."""
    per_tick = max(1, round(rate * TICK))
    sql = (
        f"INSERT INTO {TABLE} (payload) SELECT repeat('x', 40) || g "
        f"FROM generate_series(1, {per_tick}) AS g"
    )
    rows = 0
    with cluster.connect(db) as conn, conn.cursor() as cur:
        started = time.time()
        written["started"] = started
        tick = 0
        while not stop.is_set() and time.time() - started < seconds:
            cur.execute(sql)
            rows += per_tick
            tick += 1
            delay = started + tick * TICK - time.time()
            if delay > 0:
                time.sleep(delay)
        written["seconds"] = time.time() - started
    written["rows"] = rows


def cdcd_config(work: Path, dsn: str, bootstrap: str) -> Path:
    cfg = {
        "name": NAME,
        "source": {"dsn": dsn, "slot": "cdcd_lag", "publication": "cdcd_lag_pub"},
        "snapshot": {"mode": "never", "state_dir": str(work / "state")},
        "sinks": [{"type": "kafka", "bootstrap_servers": bootstrap}],
        "buffer": {"spill_dir": str(work / "spill")},
        "http": {"listen": None},
        "log": {"format": "json", "level": "warning"},
    }
    path = work / "cdcd.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def wait_for(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise TimeoutError(f"{what} did not happen within {timeout:.0f}s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rate", type=int, default=10_000, help="rows per second written")
    parser.add_argument("--seconds", type=float, default=90.0, help="how long to write")
    parser.add_argument("--trigger", default="1 second", help="micro-batch trigger interval")
    parser.add_argument("--drain", type=float, default=300.0, help="wait for the last row")
    parser.add_argument("--memory", default="2g", help="Spark driver memory")
    args = parser.parse_args()

    from cdcd.spark.session import session
    from cdcd.spark.streaming import stream_table

    work = Path(tempfile.mkdtemp(prefix="cdcd-spark-lag-"))
    cluster = PgCluster(find_installations()[0], settings={"max_wal_size": "4GB"})
    cluster.start()
    broker = asyncio.run(
        KafkaBroker.launch(jvm_options=BENCH_JVM_OPTIONS, external_ok=False, proxy=False)
    )
    daemon = None
    spark = None
    stop = threading.Event()
    stack = contextlib.ExitStack()
    try:
        db = create_database(cluster, "lagbench")
        db.execute(
            f"CREATE TABLE {TABLE} (id bigserial PRIMARY KEY, "
            "written_at timestamptz NOT NULL DEFAULT clock_timestamp(), payload text)"
        )
        log_file = stack.enter_context((work / "cdcd.log").open("wb"))
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("CDCD_CONFIG", None)
        daemon = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "cdcd",
                "run",
                "--config",
                str(cdcd_config(work, db.dsn, broker.bootstrap)),
            ],
            cwd=REPO,
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
        wait_for(
            lambda: db.fetchval("SELECT count(*) FROM pg_replication_slots") == 1, 60, "cdcd's slot"
        )
        db.execute(f"INSERT INTO {TABLE} (payload) VALUES ('warm-up')")

        spark = session(
            "cdcd-lag",
            master="local[2]",
            memory=args.memory,
            partitions=2,
            conf={
                "spark.sql.streaming.numRecentProgressUpdates": "100000",
                # a run on a loaded machine once overflowed the stream thread's stack in a
                # regular expression (java.util.regex recursion); more stack for every thread
                "spark.driver.extraJavaOptions": "-Xss16m",
            },
        )
        target = work / "lag"
        query = stream_table(
            spark,
            TABLE,
            str(target),
            str(work / "checkpoint"),
            kafka_bootstrap=broker.bootstrap,
            topic=f"{NAME}.{TABLE}",
            available_now=False,
            processing_time=args.trigger,
        )
        watcher = DeltaWatcher(target)

        def warmed_up() -> bool:
            if query.exception() is not None:
                raise RuntimeError(f"the streaming query failed: {query.exception()}")
            watcher.poll()
            return watcher.max_id() >= 1

        wait_for(warmed_up, 300, "the warm-up row")
        load_before = os.getloadavg()

        written: dict[str, Any] = {}
        writer = threading.Thread(
            target=write_rows, args=(cluster, db.name, args.rate, args.seconds, stop, written)
        )
        writer.start()
        while writer.is_alive():
            watcher.poll()
            if query.exception() is not None:
                raise RuntimeError(f"the streaming query failed: {query.exception()}")
            time.sleep(0.5)
        load_during = os.getloadavg()
        last = 1 + written["rows"]
        drained_in = None
        deadline = time.time() + args.drain
        while time.time() < deadline:
            watcher.poll()
            if watcher.max_id() >= last:
                drained_in = time.time() - written["started"] - written["seconds"]
                break
            time.sleep(0.5)
        progress = [p for p in query.recentProgress if p.numInputRows]
        query.stop()

        started = written["started"]
        rows = [r for r in watcher.rows if r[0] > 1]
        lags = [visible - at for _, at, visible in rows]
        windows = []
        for w in range(int(written["seconds"] // 10) + 1):
            part = [v - a for _, a, v in rows if w * 10 <= a - started < (w + 1) * 10]
            if part:
                windows.append({"written_s": f"{w * 10}-{w * 10 + 10}", **_lag_figures(part)})
        batch_ms = [p.durationMs.get("triggerExecution", 0) for p in progress]
        add_ms = [p.durationMs.get("addBatch", 0) for p in progress]
        sizes = [p.numInputRows for p in progress]
        result = {
            "rate_asked": args.rate,
            "seconds": round(written["seconds"], 1),
            "rows_written": written["rows"],
            "rate_written": round(written["rows"] / written["seconds"]),
            "rows_landed": len(rows),
            "drained_s_after_writer": None if drained_in is None else round(drained_in, 1),
            "trigger": args.trigger,
            "lag": _lag_figures(lags),
            "lag_per_10s_of_writing": windows,
            "delta_commits": len(watcher.commits) - 1,
            "micro_batches": {
                "count": len(progress),
                "kafka_records_median": statistics.median(sizes) if sizes else None,
                "kafka_records_max": max(sizes, default=None),
                "trigger_ms_median": statistics.median(batch_ms) if batch_ms else None,
                "trigger_ms_p90": _pct(batch_ms, 0.9) if batch_ms else None,
                "trigger_ms_max": max(batch_ms, default=None),
                "add_batch_ms_median": statistics.median(add_ms) if add_ms else None,
            },
            "loadavg_before": [round(x, 2) for x in load_before],
            "loadavg_end_of_writing": [round(x, 2) for x in load_during],
            "postgresql": cluster.version,
        }
        print(json.dumps(result, indent=2))
    finally:
        stop.set()
        if spark is not None:
            for active in spark.streams.active:
                active.stop()
            spark.stop()
        if daemon is not None:
            daemon.send_signal(signal.SIGTERM)
            try:
                daemon.wait(30)
            except subprocess.TimeoutExpired:
                daemon.kill()
        asyncio.run(broker.close())
        cluster.destroy()
        stack.close()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
