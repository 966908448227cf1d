"""The end-to-end benchmark: cdcd against pg_recvlogical and a psycopg2 peer, same machine, same run.

Usage::

    python bench/run.py [--quick] [--workload W1,W1s,W2,W3,W4,W4h,W5] [--json FILE]
                        [--pg 18,15] [--contenders NAMES] [--scale F] [--peer PATH]
                        [--repeat N] [--baseline DIR] [--broker-warmup N]

For each PostgreSQL version (default: 18 and 15, those installed; see tests/pgharness.py) it
starts a cluster with the test harness's settings, then for each workload:

1. creates a fresh database, the workload's tables and a publication, and one logical slot per
   contender, all at the same LSN (the first is created, the others are copies of it:
   ``pg_copy_logical_replication_slot``), so every contender consumes the same backlog;
2. runs the workload once (server-side SQL and procedures, so the load generator costs
   nothing on the client), records ``pg_current_wal_insert_lsn()`` as the end LSN (what
   ``cdcd run --endpos`` without an LSN takes: every commit so far ends at or before it),
   and commits one sentinel row after it (so the peer, which stops at the first message at
   or past the end, has a message to stop at);
3. times each contender draining its slot up to the end LSN, one after the other, as its own
   process (wall time from spawn to exit; CPU time from ``wait4``, peak RSS from VmHWM):

   ``pg_recvlogical``       the cluster's own, pgoutput with the same options, to /dev/null
   ``psycopg2_raw``         the peer script (``--peer``), no decoding
   ``psycopg2_pypgoutput``  the peer script with pypgoutput decoding
   ``cdcd_null``            ``cdcd run --endpos``: decode + assemble, null sink (decoded
                            changes, no event objects)
   ``cdcd_jsonl``           file sink, JSON Lines
   ``cdcd_parquet``         file sink, Parquet
   ``cdcd_kafka``           Kafka sink to a fresh Apache Kafka broker (the sink's defaults:
                            idempotent producer, ``acks: all``), warmed first: every Kafka
                            contender's broker gets ``--broker-warmup`` records (600,000)
                            before its timed drain (bench/broker_warmup.py), none below
                            ``--scale`` 0.05
   ``cdcd_kafka_eos``       the same with ``exactly_once: true`` (Kafka transactions with
                            cdcd's position, one per flush)
   ``debezium_null``        W1, W2 and S1: Debezium's PostgreSQL connector (pgoutput) in its
                            embedded engine, JSON records counted and discarded
   ``debezium_kafka``       W1, W2: the same, each record produced to a fresh broker,
                            warmed as ``cdcd_kafka``'s (bench/debezium_bench.py; ``ratio_vs_debezium`` on cdcd's rows)

Workloads (``--quick`` divides sizes by 50; ``--scale`` sets the factor):

``W1``  one transaction of 1,000,000 ten-column rows, streaming off (proto_version 1)
``W1s`` the same with streaming on (proto_version 2; the peer only speaks 1 and reads it
        unstreamed)
``W2``  200,000 small transactions, 1-5 rows each: inserts, updates, deletes
``W3``  100,000 rows with 4 KB of out-of-line (TOASTed) text, then updates leaving it unchanged
``W4``  latency: 2,000 transactions/s of 5 rows (10,000 rows/s) for 60 s while cdcd runs live
        with the JSON Lines (``flush_interval: 0.02``) and Kafka sinks; commit-to-durable
        p50/p99/max from ``CDCD_LATENCY_LOG`` (cdcd.benchlog), and ``handed_p50_ms`` /
        ``handed_p99_ms``: commit to handed to every sink (the server, the network, decoding);
        ``file_publish_slow``: how often cdcd's log said publishing turned slow (a disk stall)
``W4h`` the same at 6,000 transactions/s (30,000 rows/s), each sink alone with its own load;
        ``p99_ms_by_third`` (the p99 of each third of the run) and ``keeps_up`` (the last
        third's p99 at most 1.5 x the first's + 20 ms: the lag did not grow), and
        ``load_rows_per_s``, the rate the load reached
``W5``  memory: one 10,000,000-row transaction through ``buffer.memory_limit: 256MiB``, into
        each sink; peak RSS and spilled bytes
``S1``  the initial snapshot of a 10,000,000-row ten-column table by cdcd (null sink, JSON
        Lines; one and four ``snapshot.workers``) against ``COPY (SELECT ...) TO STDOUT`` into
        /dev/null, ``ratio_vs_copy`` (bench/snapshot_bench.py); not in the default list

``--repeat N`` (default 3, 1 with ``--quick``) drains N copies of each contender's slot, the
contenders taking turns (run 1 of each, then run 2 of each, ...), and reports the run with the
median wall time, with every run's seconds in ``runs_seconds``: noise on the host cannot pass or
fail a target. Live workloads (W4, W4h) run once. ``--baseline DIR`` adds a ``base_<name>`` contender
for each cdcd contender, running the cdcd of another checkout (e.g. ``git worktree add DIR
<commit>`` and ``python -m cdcd.accel build`` there), so a change is compared in the same run.

Output: one JSON object per (server, workload, contender) on stdout (and to ``--json FILE`` as
a JSON array), then a table. Keys: workload, contender, rows, seconds, rows_per_s,
wal_mb_per_s, peak_rss_mb, ratio_vs_pg_recvlogical, ratio_vs_psycopg2_pypgoutput,
server_version, plus cpu_seconds, cpu_us_per_row (the contender's CPU per row), runs_seconds,
streaming, and where they apply p50_ms/p99_ms/max_ms,
spilled_bytes, memory_limit_mb, rendered (streamed changes whose rows' JSON cdcd made as they
arrived), fast_paths (``compiled`` or ``pure Python``: cdcd's modules ran compiled or from
source), broker_cpu_seconds (the Kafka broker's JVM, while a Kafka contender ran; of it
broker_jit_cpu_seconds, its JIT compiler threads), broker_warmup_records (produced to the
fresh broker before, untimed),
kafka_send_retry / kafka_delivery_failed_replaying / kafka_transaction_retry /
kafka_waiting_for_broker / kafka_unreachable (how often cdcd's log said a produce was retried,
replayed or got no answer: a timeout-driven wait shows here), and cdcd_commit / cdcd_dirty (the commit measured, and whether
its ``cdcd/`` had uncommitted changes). ``rows`` counts row changes: the peer's count of I/U/D
messages, cdcd's events (``CDCD_BENCH_STATS``), and for pg_recvlogical (which writes opaque
bytes) the count the workload reports. A cdcd contender whose count differs from the workload's
fails the run, as does an edit to ``cdcd/`` while the benchmark runs (each contender would run
other code); cdcd's modules are compiled to bytecode first, as an installed wheel has them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import orjson
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.broker_warmup import WARMUP_RECORDS, JitCpu, warm_broker  # noqa: E402
from bench.debezium_bench import (  # noqa: E402
    DEBEZIUM_CONTENDERS,
    add_debezium_ratios,
    debezium_missing,
    run_debezium,
)
from bench.snapshot_bench import (  # noqa: E402
    SNAPSHOT_CONTENDERS,
    add_ratios,
    cdcd_snapshot_config,
    copy_command,
)
from tests.pgharness import (  # noqa: E402
    PgCluster,
    PgDatabase,
    create_database,
    get_installation,
)

STREAM_CONTENDERS = (
    "pg_recvlogical",
    "psycopg2_raw",
    "psycopg2_pypgoutput",
    "cdcd_null",
    "cdcd_jsonl",
    "cdcd_parquet",
    "cdcd_kafka",
    "cdcd_kafka_eos",
)
ALL_CONTENDERS = STREAM_CONTENDERS + SNAPSHOT_CONTENDERS + DEBEZIUM_CONTENDERS
PUBLICATION = "bench_pub"
PG_EPOCH_OFFSET_US = 946_684_800_000_000  # 2000-01-01 minus 1970-01-01


# --------------------------------------------------------------------------- workloads


@dataclass
class Workload:
    """One workload: tables, the load (run once), which contenders, how cdcd is configured."""

    name: str
    ddl: str
    load: Callable[[PgDatabase, float], int]  # returns the number of row changes
    contenders: tuple[str, ...] = STREAM_CONTENDERS
    streaming: bool = False
    snapshot: bool = False  # S1: cdcd takes an initial snapshot (no load to stream)
    live: bool = False  # cdcd runs during the load (W4)
    alone: bool = False  # live: each contender with its own load, not side by side (W4h)
    memory_limit_mb: float | None = None  # W5
    file_flush_interval: float | None = None


W1_DDL = """
CREATE TABLE w1 (id bigint PRIMARY KEY, qty int, name text, created timestamptz,
                 amount numeric(12,2), active bool, score float8, ref uuid, attrs jsonb, day date);
"""
W1_ROWS = """
SELECT g, g % 1000, 'name-' || g, timestamptz '2024-01-01 00:00:00+00' + g * interval '1 second',
       (g % 100000) / 100.0, g % 2 = 0, g * 0.5, md5(g::text)::uuid,
       jsonb_build_object('k', g, 's', 'v' || g % 10), date '2024-01-01' + (g % 365)::int
"""


def load_w1(db: PgDatabase, scale: float) -> int:
    n = max(1, int(1_000_000 * scale))
    db.execute(f"INSERT INTO w1 {W1_ROWS} FROM generate_series(1, {n}) g")
    return n


W2_DDL = """
CREATE TABLE w2 (id bigint PRIMARY KEY, qty int, note text, updated timestamptz);
CREATE PROCEDURE bench_w2(ntx int) LANGUAGE plpgsql AS $$
DECLARE
  k int; next_id bigint := 0; del bigint := 0; total bigint := 0; c bigint;
BEGIN
  FOR i IN 0 .. ntx - 1 LOOP
    k := 1 + i % 5;
    IF i % 4 < 2 OR next_id - del < 20 THEN
      INSERT INTO w2 SELECT next_id + g, g, 'note ' || (next_id + g), now()
        FROM generate_series(1, k) g;
      next_id := next_id + k;
    ELSIF i % 4 = 2 THEN  -- the newest rows (deletes eat the oldest)
      UPDATE w2 SET qty = qty + 1, updated = clock_timestamp() WHERE id > next_id - k;
    ELSE
      DELETE FROM w2 WHERE id > del AND id <= del + k;
      del := del + k;
    END IF;
    GET DIAGNOSTICS c = ROW_COUNT;
    total := total + c;
    COMMIT;
  END LOOP;
  RAISE NOTICE 'bench_rows=%', total;
END $$;
"""


def load_w2(db: PgDatabase, scale: float) -> int:
    return _call_counting(db, f"CALL bench_w2({max(4, int(200_000 * scale))})")


W3_DDL = """
CREATE TABLE w3 (id int PRIMARY KEY, counter int, body text);
ALTER TABLE w3 ALTER COLUMN body SET STORAGE EXTERNAL;  -- out of line, uncompressed
CREATE PROCEDURE bench_w3(n int, batch int) LANGUAGE plpgsql AS $$
BEGIN
  FOR lo IN 0 .. n - 1 BY batch LOOP
    INSERT INTO w3 SELECT g, 0, repeat(md5(g::text), 128)
      FROM generate_series(lo + 1, least(lo + batch, n)) g;
    COMMIT;
  END LOOP;
  FOR lo IN 0 .. n - 1 BY batch LOOP
    UPDATE w3 SET counter = counter + 1 WHERE id > lo AND id <= lo + batch;
    COMMIT;
  END LOOP;
END $$;
"""


def load_w3(db: PgDatabase, scale: float) -> int:
    n = max(10, int(100_000 * scale))
    db.execute(f"CALL bench_w3({n}, 1000)")
    return 2 * n


W4_DDL = """
CREATE TABLE w4 (id bigint PRIMARY KEY, qty int, note text, created timestamptz);
CREATE PROCEDURE bench_w4(per_second int, seconds float8) LANGUAGE plpgsql AS $$
DECLARE
  t0 timestamptz := clock_timestamp(); n int := (per_second * seconds)::int; ahead float8;
BEGIN
  FOR i IN 0 .. n - 1 LOOP
    INSERT INTO w4 SELECT i * 5 + g, g, 'note ' || i, clock_timestamp()
      FROM generate_series(1, 5) g;
    COMMIT;
    IF i % 10 = 9 THEN
      ahead := (i + 1)::float8 / per_second - extract(epoch FROM clock_timestamp() - t0);
      IF ahead > 0 THEN PERFORM pg_sleep(ahead); END IF;
    END IF;
  END LOOP;
END $$;
"""


def load_w4(db: PgDatabase, scale: float, seconds: float = 60.0, per_second: int = 2000) -> int:
    """``per_second`` transactions of 5 rows a second for ``seconds`` (scaled)."""
    duration = max(3.0, seconds * min(1.0, scale * 5))
    ntx = int(per_second * duration)
    db.execute(f"CALL bench_w4({per_second}, {duration})")
    return 5 * ntx


def load_w4h(db: PgDatabase, scale: float) -> int:
    return load_w4(db, scale, per_second=6000)


W5_DDL = "CREATE TABLE w5 (id bigint, qty int, note text);"


def load_s1(db: PgDatabase, scale: float) -> int:
    n = max(1, int(10_000_000 * scale))
    db.execute(f"INSERT INTO s1 {W1_ROWS} FROM generate_series(1, {n}) g")
    db.execute("VACUUM (FREEZE, ANALYZE) s1")  # hint bits set: no reader pays for them
    return n


def load_w5(db: PgDatabase, scale: float) -> int:
    n = max(1, int(10_000_000 * scale))
    db.execute(f"INSERT INTO w5 SELECT g, g % 1000, 'note ' || g FROM generate_series(1, {n}) g")
    return n


WORKLOADS: dict[str, Workload] = {
    "W1": Workload("W1", W1_DDL, load_w1, contenders=STREAM_CONTENDERS + DEBEZIUM_CONTENDERS),
    "W1s": Workload("W1s", W1_DDL, load_w1, streaming=True),
    "W2": Workload("W2", W2_DDL, load_w2, contenders=STREAM_CONTENDERS + DEBEZIUM_CONTENDERS),
    "W3": Workload("W3", W3_DDL, load_w3),
    "W4": Workload(
        "W4",
        W4_DDL,
        load_w4,
        contenders=("cdcd_jsonl", "cdcd_kafka"),
        live=True,
        file_flush_interval=0.02,
    ),
    "W4h": Workload(  # 30,000 rows/s: one sink at a time, or they would share the 2 cores
        "W4h",
        W4_DDL,
        load_w4h,
        contenders=("cdcd_jsonl", "cdcd_kafka"),
        live=True,
        alone=True,
        file_flush_interval=0.02,
    ),
    "W5": Workload(  # every sink: their buffers count against the limit too
        "W5",
        W5_DDL,
        load_w5,
        contenders=("pg_recvlogical", "cdcd_null", "cdcd_jsonl", "cdcd_parquet", "cdcd_kafka"),
        memory_limit_mb=256,
    ),
    "S1": Workload(
        "S1",
        W1_DDL.replace("w1", "s1"),
        load_s1,
        contenders=(*SNAPSHOT_CONTENDERS, "debezium_null"),
        snapshot=True,
    ),
}


def _call_counting(db: PgDatabase, sql: str) -> int:
    """Run a procedure that reports ``bench_rows=N`` in a NOTICE; return N."""
    with db.connect() as conn, conn.cursor() as cur:
        cur.execute(sql)
        for notice in conn.notices:
            if "bench_rows=" in notice:
                return int(notice.rsplit("bench_rows=", 1)[1].strip())
    raise RuntimeError(f"{sql}: no bench_rows notice")


# --------------------------------------------------------------------------- measuring


@dataclass
class Measured:
    returncode: int
    seconds: float
    cpu_seconds: float
    peak_rss_mb: float
    stdout: str
    stderr: str
    minor_faults: int = 0  # page faults served without I/O: fresh memory touched (wait4)


def run_measured(
    cmd: list[str],
    *,
    env: dict[str, str] | None = None,
    timeout: float = 3600,
    cwd: Path = REPO,
) -> Measured:
    """Run ``cmd`` to completion; wall time, the child's CPU time (wait4) and peak RSS (VmHWM)."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, env=env, cwd=cwd)
        return _wait_measured(proc, t0, out, err, timeout)


def _hwm_kib(pid: int) -> int:
    """The process's peak RSS so far (VmHWM, KiB); 0 once it has exited.

    Read while it runs, because ``wait4``'s ``ru_maxrss`` also counts the copy of this bench
    process the child was between fork and exec, a floor of this process's own size."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def _wait_measured(
    proc: subprocess.Popen[bytes], t0: float, out: Any, err: Any, timeout: float
) -> Measured:
    deadline = time.monotonic() + timeout
    hwm_kib = 0
    while True:
        hwm_kib = max(hwm_kib, _hwm_kib(proc.pid))
        pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        if time.monotonic() > deadline:
            proc.kill()
            pid, status, usage = os.wait4(proc.pid, 0)
            break
        time.sleep(0.005)
    seconds = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    out.seek(0)
    err.seek(0)
    return Measured(
        proc.returncode,
        seconds,
        usage.ru_utime + usage.ru_stime,
        (hwm_kib or usage.ru_maxrss) / 1024,
        out.read().decode(errors="replace"),
        err.read().decode(errors="replace"),
        usage.ru_minflt,
    )


# --------------------------------------------------------------------------- contenders


@dataclass
class Setup:
    """Everything a contender needs to drain its slot."""

    cluster: PgCluster
    db: PgDatabase
    workload: Workload
    end_lsn: str
    expected_rows: int
    scale: float
    peer: Path
    work: Path
    kafka: Any = None  # a started broker, for cdcd_kafka
    profile: Path | None = None  # --profile: run cdcd under py-spy, collapsed stacks here
    profile_native: bool = True  # --profile without --profile-python: py-spy --native
    checkout: Path = REPO  # whose cdcd runs
    baseline: Path | None = None  # --baseline
    broker_warmup: int = WARMUP_RECORDS  # --broker-warmup: records produced to a fresh broker


@dataclass
class Result:
    contender: str
    rows: int
    measured: Measured
    extra: dict[str, Any] = field(default_factory=dict)


def slot_name(workload: str, contender: str, run: int = 0) -> str:
    return f"bench_{workload.lower()}_{contender}" + (f"_{run}" if run else "")


def pg_recvlogical_cmd(setup: Setup, slot: str) -> list[str]:
    proto = "2" if setup.workload.streaming else "1"
    cmd = [
        str(setup.cluster.bin("pg_recvlogical")),
        "-d",
        setup.db.dsn,
        "--slot",
        slot,
        "--start",
        "--no-loop",
        "-f",
        "/dev/null",
        "-F",
        "0",
        "--endpos",
        setup.end_lsn,
        "-o",
        f"proto_version={proto}",
        "-o",
        f"publication_names={PUBLICATION}",
    ]
    if setup.workload.streaming:
        cmd += ["-o", "streaming=on"]
    return cmd


def run_pg_recvlogical(setup: Setup, slot: str) -> Result:
    m = run_measured(pg_recvlogical_cmd(setup, slot))
    _check(m, "pg_recvlogical")
    return Result("pg_recvlogical", setup.expected_rows, m)


def run_peer(setup: Setup, slot: str, decode: bool) -> Result:
    name = "psycopg2_pypgoutput" if decode else "psycopg2_raw"
    cmd = [sys.executable, str(setup.peer), setup.db.dsn, slot, PUBLICATION, setup.end_lsn]
    if decode:
        cmd.append("--decode")
    m = run_measured(cmd)
    _check(m, name)
    fields = dict(part.split("=", 1) for part in m.stdout.split() if "=" in part)
    return Result(name, int(fields["rows"]), m, {"peer_rows_per_s": float(fields["rows_per_s"])})


def cdcd_sinks(setup: Setup, contender: str, out: Path) -> list[dict[str, Any]]:
    flush = setup.workload.file_flush_interval
    files: dict[str, Any] = {"type": "file", "path": str(out)}
    if flush is not None:
        files["flush_interval"] = flush
    if contender == "cdcd_null":
        return [{"type": "null"}]
    if contender == "cdcd_jsonl":
        return [files | {"format": "jsonl"}]
    if contender == "cdcd_parquet":
        return [files | {"format": "parquet"}]
    if contender in ("cdcd_kafka", "cdcd_kafka_eos"):
        return [
            {
                "type": "kafka",
                "bootstrap_servers": setup.kafka.bootstrap,
                "topic_prefix": f"bench{os.getpid()}{setup.workload.name.lower()}",
                "exactly_once": contender == "cdcd_kafka_eos",
            }
        ]
    raise ValueError(contender)


def cdcd_config(setup: Setup, contender: str, slot: str, work: Path) -> Path:
    wl = setup.workload
    buffer: dict[str, Any] = {"spill_dir": str(work / "spill")}
    if wl.memory_limit_mb is not None:
        buffer["memory_limit"] = int(wl.memory_limit_mb * max(setup.scale, 0.02) * 2**20)
    cfg = {
        "name": "bench",
        "source": {
            "dsn": setup.db.dsn,
            "slot": slot,
            "create_slot": False,
            "publication": PUBLICATION,
            "create_publication": False,
            "proto_version": 2 if wl.streaming else 1,
            "streaming": "on" if wl.streaming else "off",
            "messages": False,
        },
        "snapshot": {"mode": "never", "state_dir": str(work / "state")},
        "buffer": buffer,
        "sinks": cdcd_sinks(setup, contender, work / "out"),
        "http": {"listen": None},
        "log": {"format": "json", "level": "warning"},
    }
    path = work / "cdcd.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def cdcd_env(work: Path, latency: bool, checkout: Path = REPO) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1", CDCD_BENCH_STATS=str(work / "stats.json"))
    if checkout != REPO:  # its cdcd package first on the path, before the installed one
        env["PYTHONPATH"] = str(checkout)
    if latency:
        env["CDCD_LATENCY_LOG"] = str(work / "latency.jsonl")
    env.pop("CDCD_CONFIG", None)
    return env


def check_package(stats: dict[str, Any], checkout: Path, contender: str) -> None:
    """A contender must have run the cdcd package of the checkout it stands for (its bench
    stats name the package directory; a baseline commit older than that field cannot say)."""
    ran = stats.get("cdcd_package")
    if ran is not None and Path(ran).resolve() != (checkout / "cdcd").resolve():
        raise RuntimeError(f"{contender} ran the cdcd package in {ran}, not {checkout / 'cdcd'}")


#: warnings of cdcd's that a run reports, counted in its log (a W4 run's tail: did the disk stall?)
#: cdcd's log events counted into the results: a slow disk, and a Kafka produce that failed,
#: was retried or replayed, or got no answer for a while (a timeout-driven wait shows here)
COUNTED_LOG_EVENTS = (
    "file_publish_slow",
    "kafka_send_retry",
    "kafka_delivery_failed_replaying",
    "kafka_transaction_retry",
    "kafka_waiting_for_broker",
    "kafka_unreachable",
)


def counted_log_events(log_text: str) -> dict[str, int]:
    """How many times each of ``COUNTED_LOG_EVENTS`` is in cdcd's JSON log (only those seen)."""
    counts: dict[str, int] = {}
    for line in log_text.splitlines():
        if not line.startswith("{"):
            continue
        try:
            event = orjson.loads(line).get("event")
        except orjson.JSONDecodeError:
            continue
        if event in COUNTED_LOG_EVENTS:
            counts[event] = counts.get(event, 0) + 1
    return counts


def cdcd_result(setup: Setup, contender: str, work: Path, m: Measured) -> Result:
    _check(m, contender)
    stats = orjson.loads((work / "stats.json").read_bytes())
    check_package(stats, setup.checkout, contender)
    extra: dict[str, Any] = {"socket_reads": stats.get("socket_reads")}
    extra["fast_paths"] = stats.get("fast_paths")  # "pure Python": figures of the source
    extra |= counted_log_events(m.stderr)
    if stats.get("rendered_changes"):  # streamed rows made into JSON as they arrived
        extra["rendered"] = stats["rendered_changes"]
    if setup.workload.memory_limit_mb is not None:
        extra["spilled_bytes"] = stats["spilled_bytes"]
        extra["memory_limit_mb"] = round(setup.workload.memory_limit_mb * max(setup.scale, 0.02), 1)
    latency = work / "latency.jsonl"
    if latency.exists():
        extra |= latency_summary(latency, setup.end_lsn)
        if setup.profile is not None:  # kept next to the stacks, to see latency over time
            shutil.copy(latency, setup.profile / f"{setup.workload.name}-{contender}-latency.jsonl")
    # Live runs (W4) go on past the end LSN, to the sentinel row: not a row of the workload.
    sentinel = stats.get("events_by_table", {}).get("public.bench_sentinel", 0)
    return Result(contender, stats["events"] - sentinel, m, extra)


def run_cdcd(setup: Setup, slot: str, contender: str) -> Result:
    work = Path(tempfile.mkdtemp(prefix=f"{contender}-", dir=setup.work))
    try:
        config = cdcd_config(setup, contender, slot, work)
        cmd = _profiled(
            setup, contender, [sys.executable, "-m", "cdcd", "run", "--config", str(config)]
        )
        env = cdcd_env(work, False, setup.checkout)
        m = run_measured([*cmd, "--endpos", setup.end_lsn], env=env, cwd=setup.checkout)
        result = cdcd_result(setup, contender, work, m)
        if result.rows != setup.expected_rows:  # a fast run that lost (or doubled) rows
            raise RuntimeError(f"{contender} emitted {result.rows} rows of {setup.expected_rows}")
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _profiled(setup: Setup, contender: str, cmd: list[str]) -> list[str]:
    """``cmd`` under py-spy with ``--profile``: collapsed stacks into that folder."""
    if setup.profile is None:
        return cmd
    setup.profile.mkdir(parents=True, exist_ok=True)
    base = "base_" if setup.baseline is not None and setup.checkout == setup.baseline else ""
    raw = setup.profile / f"{setup.workload.name}-{base}{contender}.txt"
    # --native: time in compiled modules and C extensions attributed to their functions (it
    # slows a process with Arrow's threads down many times: --profile-python leaves it out)
    return [
        "py-spy",
        "record",
        *(["--native"] if setup.profile_native else []),
        "--format",
        "raw",
        "-r",
        "250",
        "-o",
        str(raw),
        "--",
        *cmd,
    ]


def run_snapshot(setup: Setup, slot: str, contender: str) -> Result:
    """An S1 contender: COPY to /dev/null, or cdcd's initial snapshot on a slot of its own."""
    if contender == "copy_stdout":
        m = run_measured(copy_command(setup.db.dsn))
        _check(m, contender)
        return Result(contender, setup.expected_rows, m)
    work = Path(tempfile.mkdtemp(prefix=f"{contender}-", dir=setup.work))
    try:
        config = cdcd_snapshot_config(setup, contender, slot, work)
        cmd = _profiled(
            setup, contender, [sys.executable, "-m", "cdcd", "run", "--config", str(config)]
        )
        # cwd: ``python -m`` puts the working directory first on the path, before PYTHONPATH
        m = run_measured(cmd, env=cdcd_env(work, False, setup.checkout), cwd=setup.checkout)
        _check(m, contender)
        stats = orjson.loads((work / "stats.json").read_bytes())
        check_package(stats, setup.checkout, contender)
        rows = stats["events_by_table"]["public.s1"]
        if rows != setup.expected_rows:  # a fast snapshot that lost rows is no result
            raise RuntimeError(f"{contender} emitted {rows} rows of {setup.expected_rows}")
        return Result(contender, rows, m)
    finally:
        setup.db.execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
            f"WHERE slot_name = '{slot}'"
        )
        shutil.rmtree(work, ignore_errors=True)


def latency_summary(path: Path, end_lsn: str) -> dict[str, Any]:
    """p50/p99/max commit-to-durable milliseconds of the transactions up to ``end_lsn``, and
    whether cdcd kept up: the p99 of each third of the run (in commit order) and ``keeps_up``,
    true when the last third's p99 is at most 1.5 times the first's plus 20 ms (a lag that
    grows over the run fails it)."""
    end = parse_lsn(end_lsn)
    timed = []
    handed = []  # commit to handed to every sink: the source's part (server, network, decoding)
    for line in path.read_bytes().splitlines():
        rec = orjson.loads(line)
        if rec["end_lsn"] <= end:
            commit_unix_us = rec["commit_time_us"] + PG_EPOCH_OFFSET_US
            timed.append((commit_unix_us, (rec["durable_us"] - commit_unix_us) / 1000))
            if "handed_us" in rec:
                handed.append((rec["handed_us"] - commit_unix_us) / 1000)
    if not timed:
        return {}
    handed.sort()
    timed.sort()
    thirds = [
        _pct(sorted(ms for _, ms in timed[i * len(timed) // 3 : (i + 1) * len(timed) // 3]), 0.99)
        for i in range(3)
    ]
    samples = sorted(ms for _, ms in timed)
    return {
        "p50_ms": _pct(samples, 0.50),
        "p99_ms": _pct(samples, 0.99),
        "max_ms": round(samples[-1], 2),
        "handed_p50_ms": _pct(handed, 0.50),
        "handed_p99_ms": _pct(handed, 0.99),
        "p99_ms_by_third": thirds,
        "keeps_up": thirds[2] <= 1.5 * thirds[0] + 20,
    }


def _pct(samples: list[float], p: float) -> float:
    if not samples:
        return 0.0
    return round(samples[min(len(samples) - 1, int(p * len(samples)))], 2)


def _check(m: Measured, what: str) -> None:
    if m.returncode != 0:
        raise RuntimeError(
            f"{what} exited {m.returncode}\n--- stdout\n{m.stdout[-3000:]}\n"
            f"--- stderr\n{m.stderr[-3000:]}"
        )


def parse_lsn(text: str) -> int:
    hi, lo = text.split("/")
    return (int(hi, 16) << 32) | int(lo, 16)


# --------------------------------------------------------------------------- one workload


def prepare(
    cluster: PgCluster, wl: Workload, contenders: list[str], repeat: int = 1
) -> tuple[PgDatabase, str]:
    """A fresh database with the workload's tables, publication and slots (same LSN): one per
    contender and run."""
    db = create_database(cluster, f"bench_{wl.name.lower()}")
    db.execute(wl.ddl)
    tables = ", ".join(t for t in ("w1", "w2", "w3", "w4", "w5", "s1") if t in wl.ddl)
    db.execute("CREATE TABLE bench_sentinel (id int)")
    db.execute(f"CREATE PUBLICATION {PUBLICATION} FOR TABLE {tables}, bench_sentinel")
    if wl.snapshot:  # cdcd creates its slot
        return db, str(db.fetchval("SELECT pg_current_wal_insert_lsn()::text"))
    first, *rest = (slot_name(wl.name, c, i) for i in range(repeat) for c in contenders)
    start = db.fetchval(
        f"SELECT lsn::text FROM pg_create_logical_replication_slot('{first}', 'pgoutput')"
    )
    for slot in rest:
        db.execute(f"SELECT pg_copy_logical_replication_slot('{first}', '{slot}')")
    return db, start


def finish_load(db: PgDatabase) -> str:
    """The end LSN after the load, then a sentinel row past it (see the module docstring)."""
    end = db.fetchval("SELECT pg_current_wal_insert_lsn()::text")
    db.execute("INSERT INTO bench_sentinel VALUES (1)")
    return str(end)


def run_workload(
    cluster: PgCluster, wl: Workload, args: argparse.Namespace, contenders: list[str]
) -> list[dict[str, Any]]:
    if wl.alone and len(contenders) > 1:
        return [row for c in contenders for row in run_workload(cluster, wl, args, [c])]
    repeat = 1 if wl.live else args.repeat
    db, start_lsn = prepare(cluster, wl, contenders, repeat)
    work = Path(tempfile.mkdtemp(prefix="cdcd-bench-"))
    setup = Setup(
        cluster,
        db,
        wl,
        "",
        0,
        args.scale,
        args.peer,
        work,
        profile=args.profile,
        profile_native=not args.profile_python,
        baseline=args.baseline,
        broker_warmup=args.broker_warmup,
    )
    try:
        if wl.live:
            results = run_live(setup, contenders)
        else:
            t0 = time.perf_counter()
            setup.expected_rows = wl.load(db, args.scale)
            setup.end_lsn = finish_load(db)
            log(f"  {wl.name}: load {setup.expected_rows} rows in {time.perf_counter() - t0:.1f}s")
            runs: dict[str, list[Result]] = {c: [] for c in contenders}
            for i in range(repeat):
                for contender in contenders:
                    runs[contender].append(run_contender(setup, contender, i))
                    log(f"    {contender} #{i + 1}: {summary_line(runs[contender][-1])}")
            results = [median_run(runs[c]) for c in contenders]
        wal = parse_lsn(setup.end_lsn) - parse_lsn(start_lsn)
        rows = report(cluster, wl, results, wal)
        if wl.snapshot:
            add_ratios(rows)
        add_debezium_ratios(rows)
        return rows
    finally:
        shutil.rmtree(work, ignore_errors=True)
        db.drop()


def median_run(runs: list[Result]) -> Result:
    """The run with the median wall time, knowing every run's seconds."""
    ordered = sorted(runs, key=lambda r: r.measured.seconds)
    chosen = ordered[(len(ordered) - 1) // 2]
    chosen.extra["runs_seconds"] = [round(r.measured.seconds, 3) for r in runs]
    return chosen


def run_contender(setup: Setup, contender: str, run: int = 0) -> Result:
    """Drain the contender's slot; also sample its walsender's CPU time (the server's side)."""
    slot = slot_name(setup.workload.name, contender, run)
    if setup.workload.snapshot:  # no walsender at work
        return _run_contender(setup, contender, slot)
    with WalsenderCpu(setup.db, slot) as server:
        result = _run_contender(setup, contender, slot)
    result.extra["server_cpu_seconds"] = round(server.seconds, 3)
    return result


class WalsenderCpu:
    """Samples the CPU time of the walsender serving ``slot`` (``/proc``) every 0.1 s while
    the contender runs; ``seconds`` is the last sample (the final < 0.1 s is missed)."""

    def __init__(self, db: PgDatabase, slot: str) -> None:
        self._db, self._slot = db, slot
        self.seconds = 0.0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def __enter__(self) -> WalsenderCpu:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()

    def _sample(self) -> None:
        import psycopg2

        tick = os.sysconf("SC_CLK_TCK")
        with contextlib.suppress(psycopg2.Error), self._db.connect() as conn:
            pid = None
            while not self._done.wait(0.1):
                with conn.cursor() as cur:
                    cur.execute(
                        "SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s",
                        (self._slot,),
                    )
                    row = cur.fetchone()
                pid = row[0] if row and row[0] else pid
                if pid is None:
                    continue
                with contextlib.suppress(OSError, IndexError, ValueError):
                    with open(f"/proc/{pid}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                    self.seconds = (int(fields[11]) + int(fields[12])) / tick


def prepare_checkout(checkout: Path) -> dict[str, Any]:
    """Compile the checkout's cdcd to bytecode, as installing a wheel does (otherwise, with
    ``PYTHONDONTWRITEBYTECODE`` set or ``__pycache__`` not writable, every contender would
    compile each module from source at start-up, about 70 ms here), and record which commit it
    is and whether its ``cdcd/`` differs from it. Its fingerprint is checked before every run
    (:func:`check_checkout`)."""
    git = ["git", "-C", str(checkout)]
    commit = subprocess.run(
        [*git, "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    changed = subprocess.run(
        [*git, "status", "--porcelain", "--", "cdcd"], capture_output=True, text=True
    ).stdout.strip()
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", str(checkout / "cdcd")],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    _FINGERPRINTS[checkout] = fingerprint(checkout)
    return {"commit": commit or None, "dirty": bool(changed)}


_FINGERPRINTS: dict[Path, str] = {}


def fingerprint(checkout: Path) -> str:
    """Every file of the checkout's ``cdcd/`` package (bytecode caches apart): path, size and
    modification time."""
    digest = hashlib.sha256()
    for path in sorted((checkout / "cdcd").rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            st = path.stat()
            digest.update(f"{path}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()


def check_checkout(checkout: Path) -> None:
    """Refuse to go on when the cdcd a contender runs changed since the run began: the
    contenders would run different code (an edit in the checkout while the benchmark runs)."""
    known = _FINGERPRINTS.get(checkout)
    if known is not None and fingerprint(checkout) != known:
        raise RuntimeError(
            f"{checkout / 'cdcd'} changed while the benchmark ran: the contenders would run "
            "different code; run the benchmark from a checkout nobody edits (git worktree add)"
        )


def _run_contender(setup: Setup, contender: str, slot: str) -> Result:
    if contender.startswith("base_"):  # --baseline: the same contender, another checkout's cdcd
        result = _run_contender(replace(setup, checkout=setup.baseline), contender[5:], slot)
        result.contender = contender
        return result
    if contender.startswith("cdcd_"):
        check_checkout(setup.checkout)
    if contender in DEBEZIUM_CONTENDERS:
        if contender == "debezium_kafka":
            with kafka_broker(setup) as broker:
                setup.kafka = broker
                return with_broker_cpu(broker, run_debezium, setup, slot, contender, PUBLICATION)
        return run_debezium(setup, slot, contender, PUBLICATION)
    if contender in SNAPSHOT_CONTENDERS:
        return run_snapshot(setup, slot, contender)
    if contender == "pg_recvlogical":
        return run_pg_recvlogical(setup, slot)
    if contender.startswith("psycopg2_"):
        return run_peer(setup, slot, decode=contender == "psycopg2_pypgoutput")
    if contender in ("cdcd_kafka", "cdcd_kafka_eos"):
        with kafka_broker(setup) as broker:
            setup.kafka = broker
            return with_broker_cpu(broker, run_cdcd, setup, slot, contender)
    return run_cdcd(setup, slot, contender)


def with_broker_cpu(broker: Any, run: Callable[..., Result], *args: Any) -> Result:
    """``run(*args)``, its result with ``broker_cpu_seconds``: the CPU time the broker's JVMs
    spent meanwhile (on a shared host: how much of the wall time the broker took), of which
    ``broker_jit_cpu_seconds`` its JIT compilers, and ``broker_warmup_records``, the records
    produced to the fresh broker before (:func:`kafka_broker`)."""
    before = broker_cpu_seconds(broker)
    with JitCpu(broker) as jit:
        result = run(*args)
    result.extra["broker_cpu_seconds"] = round(broker_cpu_seconds(broker) - before, 3)
    result.extra["broker_jit_cpu_seconds"] = round(jit.seconds, 3)
    result.extra["broker_warmup_records"] = getattr(broker, "bench_warmup_records", 0)
    return result


def broker_cpu_seconds(broker: Any) -> float:
    """User and system CPU seconds of the broker's node processes so far (``/proc``)."""
    total = 0.0
    for node in broker.nodes:
        if node.proc is None:
            continue
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{node.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def run_live(setup: Setup, contenders: list[str]) -> list[Result]:
    """W4: cdcd runs during the load; stopped (SIGTERM) once its slot confirmed the end."""
    procs = []
    check_checkout(setup.checkout)
    with contextlib.ExitStack() as stack:
        if "cdcd_kafka" in contenders:
            setup.kafka = stack.enter_context(kafka_broker(setup))
        for contender in contenders:
            if not contender.startswith("cdcd_"):
                continue
            work = Path(tempfile.mkdtemp(prefix=f"{contender}-", dir=setup.work))
            slot = slot_name(setup.workload.name, contender)
            config = cdcd_config(setup, contender, slot, work)
            out = stack.enter_context(tempfile.TemporaryFile())
            err = stack.enter_context(tempfile.TemporaryFile())
            t0 = time.perf_counter()
            proc = subprocess.Popen(
                [sys.executable, "-m", "cdcd", "run", "--config", str(config)],
                stdout=out,
                stderr=err,
                env=cdcd_env(work, True),
                cwd=REPO,
            )
            stack.callback(_kill_quietly, proc)
            if setup.profile is not None:  # attach: cdcd must get the SIGTERM itself
                stack.callback(_stop_profiler, _attach_profiler(setup, contender, proc.pid))
            procs.append((contender, slot, work, proc, t0, out, err))
        wait_streaming(setup.db, [p[1] for p in procs])
        t_load = time.perf_counter()
        setup.expected_rows = setup.workload.load(setup.db, setup.scale)
        load_seconds = time.perf_counter() - t_load
        setup.end_lsn = finish_load(setup.db)
        log(f"  {setup.workload.name}: load {setup.expected_rows} rows in {load_seconds:.1f}s")
        end = parse_lsn(setup.end_lsn)
        results = []
        for contender, slot, work, proc, t0, out, err in procs:
            wait_confirmed(setup.db, slot, end, proc)
            proc.send_signal(signal.SIGTERM)
            m = _wait_measured(proc, t0, out, err, 120)
            results.append(cdcd_result(setup, contender, work, m))
            # the rate the load reached (it falls short of the target on a saturated host)
            results[-1].extra["load_rows_per_s"] = round(setup.expected_rows / load_seconds)
            log(f"    {contender}: {summary_line(results[-1])}")
        return results


def _attach_profiler(setup: Setup, contender: str, pid: int) -> subprocess.Popen[bytes]:
    """py-spy sampling a running process (all its threads) until it exits."""
    assert setup.profile is not None
    setup.profile.mkdir(parents=True, exist_ok=True)
    raw = setup.profile / f"{setup.workload.name}-{contender}.txt"
    cmd = ["py-spy", "record", "--format", "raw", "-r", "250", "-o", str(raw), "--pid", str(pid)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _stop_profiler(profiler: subprocess.Popen[bytes]) -> None:
    """py-spy writes its output once the profiled process exited: give it time to."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        profiler.wait(30)
    _kill_quietly(profiler)


def _kill_quietly(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        with contextlib.suppress(Exception):
            proc.wait(10)


def wait_streaming(db: PgDatabase, slots: list[str], timeout: float = 60) -> None:
    names = ", ".join(f"'{s}'" for s in slots)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        active = db.fetchval(
            f"SELECT count(*) FROM pg_replication_slots WHERE active AND slot_name IN ({names})"
        )
        if active == len(slots):
            return
        time.sleep(0.1)
    raise RuntimeError(f"cdcd did not start streaming from {slots}")


def wait_confirmed(
    db: PgDatabase, slot: str, end: int, proc: subprocess.Popen[bytes], timeout: float = 600
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lsn = db.fetchval(
            f"SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = '{slot}'"
        )
        if lsn is not None and parse_lsn(lsn) >= end:
            return
        if proc.poll() is not None:
            raise RuntimeError(f"cdcd on slot {slot} exited early with {proc.returncode}")
        time.sleep(0.05)
    raise RuntimeError(f"slot {slot} did not confirm the end LSN in {timeout}s")


@contextlib.contextmanager
def kafka_broker(setup: Setup | None = None) -> Any:
    """A fresh Apache Kafka broker (tests/kafkaharness.py), clients connecting to it directly
    (no test proxy in between): the JVM options for throughput, or at the smoke test's tiny
    sizes (``--scale`` below 0.05) the test suite's, which start in half the time.

    With a ``setup``, the broker is warmed first (bench/broker_warmup.py: ``setup.broker_warmup``
    W1-like records produced to a topic of its own, untimed, as a long-running broker's JIT
    would have compiled its produce path), except at those tiny sizes."""
    from tests.kafkaharness import BENCH_JVM_OPTIONS, TEST_JVM_OPTIONS, KafkaBroker

    quick = setup is not None and setup.scale < 0.05
    options = TEST_JVM_OPTIONS if quick else BENCH_JVM_OPTIONS
    broker = asyncio.run(KafkaBroker.launch(jvm_options=options, external_ok=False, proxy=False))
    try:
        records = 0 if setup is None or quick else setup.broker_warmup
        if records:
            done = warm_broker(broker, records)
            log(
                f"    broker warm-up: {records} records, {done['seconds']:.1f}s, "
                f"broker {done['broker_cpu_seconds']:.1f} CPU s"
            )
        broker.bench_warmup_records = records
        yield broker
    finally:
        asyncio.run(broker.close())


# --------------------------------------------------------------------------- reporting


def report(
    cluster: PgCluster, wl: Workload, results: list[Result], wal_bytes: int
) -> list[dict[str, Any]]:
    rates = {r.contender: r.rows / r.measured.seconds for r in results}
    rows = []
    for r in results:
        rate = rates[r.contender]
        row: dict[str, Any] = {
            "workload": wl.name,
            "contender": r.contender,
            "rows": r.rows,
            "seconds": round(r.measured.seconds, 3),
            "rows_per_s": round(rate),
            "wal_mb_per_s": round(wal_bytes / 2**20 / r.measured.seconds, 2),
            "peak_rss_mb": round(r.measured.peak_rss_mb, 1),
            "ratio_vs_pg_recvlogical": _ratio(rate, rates.get("pg_recvlogical")),
            "ratio_vs_psycopg2_pypgoutput": _ratio(rate, rates.get("psycopg2_pypgoutput")),
            "server_version": cluster.version,
            "cpu_seconds": round(r.measured.cpu_seconds, 3),
            "cpu_us_per_row": round(r.measured.cpu_seconds / r.rows * 1e6, 2) if r.rows else None,
            "minor_faults_per_krow": (
                round(r.measured.minor_faults / r.rows * 1000, 1) if r.rows else None
            ),
            "streaming": wl.streaming,
        }
        row |= r.extra
        rows.append(row)
    return rows


def _ratio(rate: float, reference: float | None) -> float | None:
    return round(rate / reference, 3) if reference else None


def summary_line(r: Result) -> str:
    m = r.measured
    extra = " ".join(f"{k}={v}" for k, v in r.extra.items() if k != "peer_rows_per_s")
    return (
        f"rows={r.rows} {m.seconds:.2f}s {r.rows / m.seconds:,.0f} rows/s "
        f"cpu={m.cpu_seconds:.2f}s rss={m.peak_rss_mb:.0f}MB faults={m.minor_faults} {extra}"
    )


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'pg':>4} {'workload':<8} {'contender':<20} {'rows':>9} {'seconds':>8} {'rows/s':>9} "
        f"{'cpu s':>7} {'us/row':>7} {'rss MB':>7} {'x pg_recv':>9} {'x pypgout':>9}  extra"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        extra = " ".join(
            f"{k}={r[k]}"
            for k in (
                "server_cpu_seconds",
                "broker_cpu_seconds",
                "broker_jit_cpu_seconds",
                *COUNTED_LOG_EVENTS[1:],
                "p50_ms",
                "p99_ms",
                "max_ms",
                "keeps_up",
                "load_rows_per_s",
                "spilled_bytes",
                "rendered",
                "startup_seconds",
                "ratio_vs_debezium",
            )
            if k in r
        )
        lines.append(
            f"{r['server_version']:>4} {r['workload']:<8} {r['contender']:<20} {r['rows']:>9} "
            f"{r['seconds']:>8.2f} {r['rows_per_s']:>9} {r['cpu_seconds']:>7.2f} "
            f"{r.get('cpu_us_per_row') or 0:>7.2f} "
            f"{r['peak_rss_mb']:>7.0f} {_fmt(r['ratio_vs_pg_recvlogical']):>9} "
            f"{_fmt(r['ratio_vs_psycopg2_pypgoutput']):>9}  {extra}"
        )
    return "\n".join(lines)


def _fmt(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="sizes / 50 (CI smoke test)")
    parser.add_argument("--scale", type=float, help="size factor (default 1, --quick 0.02)")
    parser.add_argument(
        "--workload", default="W1,W1s,W2,W3,W4,W4h,W5", help="comma list of " + ",".join(WORKLOADS)
    )
    parser.add_argument(
        "--contenders", default=",".join(ALL_CONTENDERS), help="comma list (default: all)"
    )
    parser.add_argument("--pg", default="18,15", help="PostgreSQL majors (default 18,15)")
    parser.add_argument("--json", type=Path, help="also write the results here (JSON array)")
    parser.add_argument(
        "--peer",
        type=Path,
        default=REPO.parent / "shared" / "bench" / "peer_psycopg2.py",
        help="the psycopg2 peer script (default ../shared/bench/peer_psycopg2.py)",
    )
    parser.add_argument(
        "--profile",
        type=Path,
        help="run cdcd under py-spy (pip install py-spy); collapsed stacks into this folder "
        "(timings are then not comparable)",
    )
    parser.add_argument(
        "--profile-python",
        action="store_true",
        help="with --profile: Python frames only (no --native, which slows the Parquet sink's "
        "Arrow threads many times over; compiled code is then counted in its Python caller)",
    )
    parser.add_argument(
        "--repeat", type=int, help="runs per contender, median reported (default 3; --quick 1)"
    )
    parser.add_argument(
        "--baseline",
        type=Path,
        help="another checkout of cdcd: adds base_<contender> runs of its cdcd, same slots",
    )
    parser.add_argument(
        "--broker-warmup",
        type=int,
        default=WARMUP_RECORDS,
        metavar="N",
        help=f"records produced to each fresh Kafka broker before its timed drain (default "
        f"{WARMUP_RECORDS:,}; 0: a cold broker; none below --scale 0.05)",
    )
    args = parser.parse_args(argv)
    if args.scale is None:
        args.scale = 0.02 if args.quick else 1.0
    if args.repeat is None:
        args.repeat = 1 if args.quick else 3
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")
    unknown = [w for w in args.workload.split(",") if w not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workload(s) {unknown}; choose from {', '.join(WORKLOADS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    wanted = [c for c in args.contenders.split(",") if c]
    bad = [c for c in wanted if c not in ALL_CONTENDERS]
    if bad:
        raise SystemExit(f"unknown contender(s) {bad}")
    if not args.peer.exists():
        log(f"peer script {args.peer} not found: skipping the psycopg2 contenders")
        wanted = [c for c in wanted if not c.startswith("psycopg2_")]
    missing = debezium_missing() if any(c in DEBEZIUM_CONTENDERS for c in wanted) else None
    if missing is not None:
        log(f"{missing}: skipping the Debezium contenders")
        wanted = [c for c in wanted if c not in DEBEZIUM_CONTENDERS]
    checkout = prepare_checkout(REPO)
    baseline = checkout if args.baseline is None else prepare_checkout(args.baseline)
    log(
        f"cdcd at {checkout['commit']}" + (" with uncommitted changes" if checkout["dirty"] else "")
    )
    all_rows: list[dict[str, Any]] = []
    for major in (int(m) for m in args.pg.split(",") if m):
        install = get_installation(major)
        if install is None:
            log(f"PostgreSQL {major} is not installed: skipped")
            continue
        cluster = PgCluster(install, settings={"max_wal_size": "4GB"})
        cluster.start()
        log(f"PostgreSQL {cluster.version} on port {cluster.port}")
        try:
            for name in args.workload.split(","):
                wl = WORKLOADS[name]
                contenders = [c for c in wl.contenders if c in wanted]
                if args.baseline is not None and not wl.live:
                    contenders += [f"base_{c}" for c in contenders if c.startswith("cdcd_")]
                if not contenders:
                    continue
                rows = run_workload(cluster, wl, args, contenders)
                for row in rows:
                    measured = baseline if row["contender"].startswith("base_") else checkout
                    row["cdcd_commit"], row["cdcd_dirty"] = measured["commit"], measured["dirty"]
                    print(orjson.dumps(row).decode(), flush=True)
                all_rows.extend(rows)
                if args.json:
                    args.json.write_bytes(orjson.dumps(all_rows, option=orjson.OPT_INDENT_2))
        finally:
            cluster.destroy()
    print(table(all_rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
