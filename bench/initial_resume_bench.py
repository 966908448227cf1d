"""An interrupted initial snapshot, resumed: the S1 table (ten columns, ``--rows`` rows,
default 3,000,000) snapshotted by ``cdcd run`` with ``snapshot.mode: initial`` into JSON Lines
under a write workload of ``--write-rate`` rows/s (bench/backfill_bench.py's), the daemon killed
(SIGKILL) ``--kills`` times and started again each time: the first kill in the initial
snapshot once ``rows / (kills + 1)`` rows are recorded durable, the others while the rest is
read by the incremental snapshot it resumes with, at ``k * rows / (kills + 1)`` rows. Reported:

``r_events_per_row``  ``r`` events over the table's rows (1.0: nothing emitted twice)
``again``             ``r`` events beyond one per key
``resumed``           starts that resumed the snapshot (the log's ``resuming it``)
``rebuilt_equal``     the table rebuilt from every event (position order) equals the source
``confirmed_positions_during``  confirmed positions the slot showed while the rest was read

    python -m bench.initial_resume_bench [--rows N] [--kills 3] [--write-rate 2000] [--json F]

The host is shared: note the load next to figures written to bench/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.backfill_bench import TABLE, Writes, _cdcd, _config, _wait  # noqa: E402
from bench.run import W1_DDL, W1_ROWS  # noqa: E402
from tests.pgharness import PgCluster, PgDatabase, create_database, find_installations  # noqa: E402


def resumed(db: PgDatabase, rows: int, rate: int, kills: int) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="s1k-"))
    writes = Writes(db.dsn, rows, rate)
    confirmed: set[str] = set()
    log = work / "cdcd.log"

    def progress(kind: str) -> dict[str, Any]:
        try:
            return dict(
                json.loads((work / "state" / f"s2.{kind}.json").read_text())["tables"][TABLE]
            )
        except (FileNotFoundError, KeyError, ValueError, TypeError):
            return {}

    def start() -> subprocess.Popen[bytes]:
        with log.open("ab") as log_file:
            return subprocess.Popen(
                _cdcd("run", "--config", str(cfg)), stdout=log_file, stderr=log_file, cwd=REPO
            )

    try:
        cfg = _config(db, work, "jsonl", {})
        data = yaml.safe_load(cfg.read_text())
        data["snapshot"]["mode"] = "initial"
        cfg.write_text(yaml.safe_dump(data))
        writes.start()
        started = time.monotonic()
        proc = start()
        for k in range(1, kills + 1):

            def far(k: int = k) -> bool:
                if k == 1:
                    return int(progress("snapshot").get("rows") or 0) >= rows // (kills + 1)
                lsn = db.fetchval("SELECT confirmed_flush_lsn::text FROM pg_replication_slots")
                if lsn is not None and progress("incremental").get("status") == "running":
                    confirmed.add(str(lsn))
                return int(progress("incremental").get("rows") or 0) >= rows * k // (kills + 1)

            _wait(far, 3600, f"kill {k}", proc)
            proc.kill()
            proc.wait()
            proc = start()

        def done() -> bool:
            lsn = db.fetchval("SELECT confirmed_flush_lsn::text FROM pg_replication_slots")
            status = progress("incremental").get("status")
            if lsn is not None and status == "running":
                confirmed.add(str(lsn))
            return status == "done"

        _wait(done, 3600, "the rest of the snapshot", proc)
        seconds = time.monotonic() - started
        writes.stop.set()
        writes.join()
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
        subprocess.run(_cdcd("run", "--config", str(cfg), "--endpos"), check=True, cwd=REPO)
        rebuilt, reads, keys, resets = rebuild(work / "out" / TABLE)
        source = {i: (q, n) for i, q, n in db.fetch("SELECT id, qty, name FROM s1")}
        return {
            "workload": "S1-kill",
            "sink": "jsonl",
            "kills": kills,
            "write_rate": rate,
            "writes": writes.done,
            "rows": rows,
            "seconds": round(seconds, 2),
            "r_events": reads,
            "r_events_per_row": round(reads / rows, 4),
            "again": reads - keys,
            "resumed": log.read_text().count("resuming it"),
            "resets": resets,
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


def rebuild(folder: Path) -> tuple[dict[int, tuple[Any, Any]], int, int, int]:
    """The table applied from its JSON Lines files in position order, one line at a time (the
    events of millions of rows do not fit in memory as dicts): ``id -> (qty, name)``, the ``r``
    events, the keys they name, and the resets. A delete of a row never emitted is skipped (an
    incremental snapshot had not reached it)."""
    import orjson

    table: dict[int, tuple[Any, Any]] = {}
    read: set[int] = set()
    reads = resets = 0
    last = (-1, -1)
    for path in sorted(folder.glob("*.jsonl")):
        with path.open("rb") as lines:
            for line in lines:
                event = orjson.loads(line)
                source = event["source"]
                at = (source["commit_lsn"], source["seq"])
                assert at > last, (path, at, last)
                last = at
                op = event["op"]
                if op == "t":
                    table.clear()
                    resets += 1
                elif op == "d":
                    table.pop(event["before"]["id"], None)
                else:
                    after = event["after"]
                    table[after["id"]] = (after["qty"], after["name"])
                    if op == "r":
                        reads += 1
                        read.add(after["id"])
    return table, reads, len(read), resets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=3_000_000)
    parser.add_argument("--kills", type=int, default=3)
    parser.add_argument("--write-rate", type=int, default=2000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    install = next(i for i in find_installations() if i.major == 18)
    cluster = PgCluster(install, settings={"max_wal_size": "4GB", "shared_buffers": "512MB"})
    cluster.start()
    try:
        db = create_database(cluster)
        db.execute(W1_DDL.replace("w1", "s1") + "CREATE PUBLICATION bench_pub FOR ALL TABLES")
        db.execute(f"INSERT INTO s1 {W1_ROWS} FROM generate_series(1, {args.rows}) g")
        db.execute("VACUUM (FREEZE, ANALYZE) s1")
        result = resumed(db, args.rows, args.write_rate, args.kills)
        result["load_avg"] = os.getloadavg()[0]
        print(json.dumps(result), flush=True)
    finally:
        cluster.destroy()
    if args.json:
        args.json.write_text(json.dumps([result], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
