"""Workload S2: a backfill (``cdcd snapshot --table``) against a running daemon.

The S1 table (ten columns, ``--rows`` rows, default 2,000,000) is backfilled by a daemon that
streams meanwhile (``snapshot.mode: never``, defaults otherwise, unless ``--snapshot`` sets
keys), with and without a concurrent write workload of ``--write-rate`` rows/s (inserts,
updates, deletes of random keys in one statement each). Reported per run:

``rows_per_s``      rows of the table over the seconds from the request to the table's snapshot
                    recorded done in the state file
``ratio_vs_copy``   over ``COPY (SELECT * FROM s1) TO STDOUT`` into /dev/null over one
                    connection, timed in the same run
``table_seconds``   the daemon's own seconds for the table, from its first query to done (the
                    ``cdcd snapshot`` command's start-up and the request's way through the
                    stream left out); ``table_ratio_vs_copy``: COPY's seconds over these
``cpu_us_per_row``  the daemon's user + system CPU over the backfill, per row
``peak_rss_mb``     the daemon's peak RSS (VmHWM)
``dropped``         rows the watermark windows dropped (the stream carried newer images)
``rebuilt_equal``   under the workload, JSON Lines only: the table rebuilt from every event
                    equals the source afterwards

    python -m bench.backfill_bench [--rows N] [--sinks null,jsonl] [--write-rate 0,2000]
                                   [--snapshot chunk_rows=50000,workers=2] [--json FILE]
                                   [--kills N]

``--kills N``: instead, one run into JSON Lines under the write workload with the daemon killed
(SIGKILL) N times along the way and started again: ``r`` events per row of the table, whether
the rebuilt table equals the source, how many confirmed positions the slot showed meanwhile.

The host is shared: note the load next to figures written to bench/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.run import W1_DDL, W1_ROWS  # noqa: E402
from tests.pgharness import PgCluster, PgDatabase, create_database, find_installations  # noqa: E402

TABLE = "public.s1"
_PY_SPY = ("py-spy", "record", "-r", "200", "-f", "raw")
#: one new row as load_s1 makes them (``%`` doubled: psycopg2's placeholders)
_INSERT = "INSERT INTO s1 " + W1_ROWS.replace("%", "%%") + " FROM (SELECT %s::bigint AS g) x"


class Writes(threading.Thread):
    """About ``rate`` single-row statements per second on s1 until stopped: a third inserts
    new keys, a third updates, a third deletes random existing keys."""

    def __init__(self, dsn: str, rows: int, rate: int) -> None:
        super().__init__(daemon=True)
        self.dsn, self.rows, self.rate = dsn, rows, rate
        self.stop = threading.Event()
        self.done = 0

    def run(self) -> None:
        import psycopg2

        conn = psycopg2.connect(self.dsn)
        conn.autocommit = True
        cur = conn.cursor()
        rng = random.Random(7)
        next_key = self.rows + 1
        started = time.monotonic()
        while not self.stop.is_set():
            op = self.done % 3
            if op == 0:
                cur.execute(_INSERT, (next_key,))
                next_key += 1
            elif op == 1:
                cur.execute(
                    "UPDATE s1 SET qty = qty + 1, name = name || 'u' WHERE id = %s",
                    (rng.randrange(1, next_key),),
                )
            else:
                cur.execute("DELETE FROM s1 WHERE id = %s", (rng.randrange(1, next_key),))
            self.done += 1
            ahead = self.done / self.rate - (time.monotonic() - started)
            if ahead > 0:
                time.sleep(ahead)
        conn.close()


def copy_seconds(db: PgDatabase) -> float:
    from bench.snapshot_bench import copy_command

    started = time.monotonic()
    subprocess.run(copy_command(db.dsn), check=True, stdout=subprocess.DEVNULL)
    return time.monotonic() - started


def _proc_stat(pid: int) -> tuple[float, int]:
    """CPU seconds (user + system) and peak RSS (KiB) of ``pid``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    cpu = (int(fields[11]) + int(fields[12])) / ticks
    hwm = 0
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            hwm = int(line.split()[1])
    return cpu, hwm


def _config(db: PgDatabase, work: Path, sink: str, snapshot: dict[str, Any]) -> Path:
    sinks: list[dict[str, Any]] = (
        [{"type": "null"}]
        if sink == "null"
        else [{"type": "file", "path": str(work / "out"), "format": "jsonl"}]
    )
    cfg = {
        "name": "bench",
        "source": {"dsn": db.dsn, "slot": "s2", "publication": "bench_pub"},
        "snapshot": {"mode": "never", "state_dir": str(work / "state"), **snapshot},
        "buffer": {"spill_dir": str(work / "spill")},
        "sinks": sinks,
        "http": {"listen": None},
        "log": {"format": "json", "level": os.environ.get("S2_LOG_LEVEL", "info")},
    }
    path = work / "cdcd.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _cdcd(*args: str) -> list[str]:
    return [sys.executable, "-m", "cdcd", *args]


def _wait(predicate: Any, timeout: float, what: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise RuntimeError(f"cdcd exited ({proc.returncode}) waiting for {what}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


def backfill(
    db: PgDatabase, rows: int, sink: str, rate: int, snapshot: dict[str, Any]
) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="s2-"))
    writes = None
    try:
        cfg = _config(db, work, sink, snapshot)
        log_path = work / "cdcd.log"
        with log_path.open("wb") as log_file:
            cmd = _cdcd("run", "--config", str(cfg))
            proc = subprocess.Popen(cmd, stdout=log_file, stderr=log_file, cwd=REPO)
        try:
            _wait(lambda: b'"streaming"' in log_path.read_bytes(), 60, "streaming", proc)
            if rate:
                writes = Writes(db.dsn, rows, rate)
                writes.start()
                time.sleep(1.0)
            profile = os.environ.get("S2_PROFILE")  # the daemon's collapsed stacks, here
            profiler = (
                subprocess.Popen(
                    [*_PY_SPY, "-o", profile, "--pid", str(proc.pid)],
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                )
                if profile
                else None
            )
            cpu0, _ = _proc_stat(proc.pid)
            started = time.monotonic()
            subprocess.run(
                _cdcd("snapshot", "--config", str(cfg), "--table", TABLE, "--no-follow"),
                check=True,
                cwd=REPO,
                stdout=subprocess.DEVNULL,
            )
            state = work / "state" / "s2.incremental.json"

            def done() -> bool:
                try:
                    return bool(json.loads(state.read_text())["tables"][TABLE]["status"] == "done")
                except (FileNotFoundError, KeyError, ValueError):
                    return False

            _wait(done, 3600, "the backfill", proc)
            _wait(lambda: b"of table done" in log_path.read_bytes(), 60, "the backfill's end", proc)
            seconds = time.monotonic() - started
            cpu1, hwm = _proc_stat(proc.pid)
            if profiler is not None:
                profiler.send_signal(signal.SIGINT)
                profiler.wait(60)
            if writes is not None:
                writes.stop.set()
                writes.join()
            proc.send_signal(signal.SIGTERM)
            proc.wait(120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        done_line = next(
            (
                json.loads(line)
                for line in log_path.read_text().splitlines()
                if '"incremental snapshot of table done"' in line
            ),
            None,
        )
        if done_line is None:
            raise RuntimeError(
                f"no end of the backfill in the log:\n{log_path.read_text()[-3000:]}"
            )
        result: dict[str, Any] = {
            "workload": "S2",
            "sink": sink,
            "write_rate": rate,
            "snapshot": snapshot,
            "rows": rows,
            "emitted": done_line["rows"],
            "dropped": done_line["dropped"],
            "chunks": done_line["chunks"],
            "seconds": round(seconds, 2),
            "rows_per_s": round(done_line["rows"] / seconds),
            "table_seconds": done_line["seconds"],
            "cpu_us_per_row": round(1e6 * (cpu1 - cpu0) / max(done_line["rows"], 1), 2),
            "peak_rss_mb": round(hwm / 1024, 1),
            "writes": writes.done if writes is not None else 0,
        }
        if rate and sink == "jsonl":
            result["rebuilt_equal"] = _rebuilt_equal(db, cfg, work)
        return result
    finally:
        db.execute("SELECT pg_drop_replication_slot('s2')")
        if not os.environ.get("S2_KEEP"):
            shutil.rmtree(work, ignore_errors=True)


def killed(db: PgDatabase, rows: int, rate: int, kills: int) -> dict[str, Any]:
    """The backfill into JSON Lines under the write workload, the daemon killed (SIGKILL)
    ``kills`` times along the way and started again: ``r`` events over the table's rows, the
    rebuilt table against the source, and the slot's confirmed positions seen meanwhile."""
    work = Path(tempfile.mkdtemp(prefix="s2k-"))
    writes = Writes(db.dsn, rows, rate)
    state = work / "state" / "s2.incremental.json"
    confirmed: set[str] = set()

    def table() -> dict[str, Any]:
        try:
            return dict(json.loads(state.read_text())["tables"][TABLE])
        except (FileNotFoundError, KeyError, ValueError):
            return {}

    def start() -> subprocess.Popen[bytes]:
        with (work / "cdcd.log").open("ab") as log_file:
            return subprocess.Popen(
                _cdcd("run", "--config", str(cfg)), stdout=log_file, stderr=log_file, cwd=REPO
            )

    try:
        cfg = _config(db, work, "jsonl", {})
        proc = start()
        _wait(lambda: b'"streaming"' in (work / "cdcd.log").read_bytes(), 60, "streaming", proc)
        writes.start()
        started = time.monotonic()
        subprocess.run(
            _cdcd("snapshot", "--config", str(cfg), "--table", TABLE, "--no-follow"),
            check=True,
            cwd=REPO,
            stdout=subprocess.DEVNULL,
        )
        for k in range(1, kills + 1):

            def far(k: int = k) -> bool:
                lsn = db.fetchval("SELECT confirmed_flush_lsn::text FROM pg_replication_slots")
                if lsn is not None and table().get("status") == "running":
                    confirmed.add(str(lsn))
                return int(table().get("rows") or 0) >= rows * k // (kills + 1)

            _wait(far, 3600, f"kill {k}", proc)
            proc.kill()
            proc.wait()
            proc = start()
        _wait(lambda: table().get("status") == "done", 3600, "the backfill", proc)
        seconds = time.monotonic() - started
        writes.stop.set()
        writes.join()
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
        from tests.e2e import checked_events
        from tests.integration.test_incremental_snapshot import apply_events_lenient

        subprocess.run(_cdcd("run", "--config", str(cfg), "--endpos"), check=True, cwd=REPO)
        events = checked_events(work / "out", TABLE)
        reads = [e for e in events if e["op"] == "r"]
        rebuilt = {r["id"]: (r["qty"], r["name"]) for r in apply_events_lenient(events)}
        source = {i: (q, n) for i, q, n in db.fetch("SELECT id, qty, name FROM s1")}
        return {
            "workload": "S2-kill",
            "sink": "jsonl",
            "kills": kills,
            "write_rate": rate,
            "writes": writes.done,
            "rows": rows,
            "seconds": round(seconds, 2),
            "rows_per_s_with_kills": round(rows / seconds),
            "r_events": len(reads),
            "r_events_per_row": round(len(reads) / rows, 3),
            "rebuilt_equal": rebuilt == source,
            "confirmed_positions_during": len(confirmed),
        }
    finally:
        writes.stop.set()
        db.execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
            "WHERE slot_name = 's2' AND NOT active"
        )
        if not os.environ.get("S2_KEEP"):
            shutil.rmtree(work, ignore_errors=True)


def _rebuilt_equal(db: PgDatabase, cfg: Path, work: Path) -> bool:
    """Catch up, rebuild s1 from its events (deletes of rows never emitted skipped), compare."""
    from tests.e2e import checked_events
    from tests.integration.test_incremental_snapshot import apply_events_lenient

    subprocess.run(_cdcd("run", "--config", str(cfg), "--endpos"), check=True, cwd=REPO)
    events = checked_events(work / "out", TABLE)
    rebuilt = {r["id"]: (r["qty"], r["name"]) for r in apply_events_lenient(events)}
    source = {i: (q, n) for i, q, n in db.fetch("SELECT id, qty, name FROM s1")}
    return rebuilt == source


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--sinks", default="null,jsonl")
    parser.add_argument("--write-rate", default="0,2000")
    parser.add_argument("--snapshot", default="", help="snapshot keys, k=v,k=v")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--kills", type=int, default=0, help="a run killed (SIGKILL) N times")
    args = parser.parse_args(argv)
    snapshot = {
        k: yaml.safe_load(v)
        for k, _, v in (kv.partition("=") for kv in args.snapshot.split(",") if kv)
    }
    install = next(i for i in find_installations() if i.major == 18)
    cluster = PgCluster(install, settings={"max_wal_size": "4GB", "shared_buffers": "512MB"})
    cluster.start()
    results = []
    try:
        for sink in args.sinks.split(","):
            for rate in (int(r) for r in args.write_rate.split(",")):
                db = create_database(cluster)
                db.execute(
                    W1_DDL.replace("w1", "s1") + "CREATE PUBLICATION bench_pub FOR ALL TABLES"
                )
                db.execute(f"INSERT INTO s1 {W1_ROWS} FROM generate_series(1, {args.rows}) g")
                db.execute("VACUUM (FREEZE, ANALYZE) s1")
                copy = copy_seconds(db)
                if args.kills:
                    result = killed(db, args.rows, rate, args.kills)
                else:
                    result = backfill(db, args.rows, sink, rate, snapshot)
                result["copy_rows_per_s"] = round(args.rows / copy)
                if "rows_per_s" in result:  # not for a killed run
                    result["ratio_vs_copy"] = round(result["rows_per_s"] * copy / args.rows, 3)
                    result["table_ratio_vs_copy"] = round(copy / result["table_seconds"], 3)
                result["load_avg"] = os.getloadavg()[0]
                print(json.dumps(result), flush=True)
                results.append(result)
                db.drop()
    finally:
        cluster.destroy()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
