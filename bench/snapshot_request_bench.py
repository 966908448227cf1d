"""The start-up of ``cdcd snapshot --table`` (part of workload S2's time): CPU and wall per request.

A PostgreSQL 18 cluster with a small published table; ``cdcd snapshot --config F --table
public.s1 --no-follow`` is run ``--runs`` times per sink (null, JSON Lines) and per checkout
given (default: this one), the checkouts in turn (ABBA...), with no daemon running: the request
only writes its signal. CPU is the command's user + system time (``wait4``); the wall time
includes connecting and the signal's commit.

    python -m bench.snapshot_request_bench [--runs 20] [--trees /path/a,/path/b] [--json FILE]

The host is shared: note the load next to figures written to bench/results/.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.pgharness import PgCluster, create_database, find_installations  # noqa: E402

SINKS = {
    "null": [{"type": "null"}],
    "jsonl": [{"type": "file", "path": "out", "format": "jsonl"}],
}


def request(tree: Path, config: Path) -> tuple[float, float]:
    """CPU and wall seconds of one request made with the checkout ``tree``."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, "-m", "cdcd", "snapshot", "--config", str(config)]
    started = time.monotonic()
    proc = subprocess.Popen(
        [*cmd, "--table", "public.s1", "--no-follow"], cwd=tree, env=env, stdout=subprocess.DEVNULL
    )
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.monotonic() - started
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"cdcd snapshot failed ({tree})")
    return usage.ru_utime + usage.ru_stime, wall


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--trees", default=str(REPO), help="checkouts, comma-separated")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    results = measure([Path(t).resolve() for t in args.trees.split(",")], args.runs)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


def measure(trees: list[Path], runs: int) -> list[dict[str, object]]:
    """Per sink and checkout: the CPU and wall medians and minima of ``runs`` requests."""
    install = next(i for i in find_installations() if i.major == 18)
    cluster = PgCluster(install)
    cluster.start()
    results: list[dict[str, object]] = []
    work = Path(tempfile.mkdtemp(prefix="s2req-"))
    try:
        db = create_database(cluster)
        db.execute(
            "CREATE TABLE s1 (id bigint PRIMARY KEY, v text);"
            "INSERT INTO s1 SELECT g, 'v' || g FROM generate_series(1, 1000) g;"
            "CREATE PUBLICATION bench_pub FOR ALL TABLES"
        )
        for sink, section in SINKS.items():
            config = work / f"{sink}.yaml"
            source = {"dsn": db.dsn, "slot": "s2", "publication": "bench_pub"}
            snapshot = {"mode": "never", "state_dir": str(work / "state")}
            cfg = {"source": source, "snapshot": snapshot, "sinks": section}
            config.write_text(yaml.safe_dump(cfg))
            request(trees[0], config)  # the signal key made, the caches warm
            seen: dict[Path, list[tuple[float, float]]] = {tree: [] for tree in trees}
            for i in range(runs):
                for tree in trees if i % 2 == 0 else trees[::-1]:
                    seen[tree].append(request(tree, config))
            for tree, made in seen.items():
                cpu = [c for c, _ in made]
                wall = [w for _, w in made]
                result = {
                    "sink": sink,
                    "tree": str(tree),
                    "runs": len(made),
                    "cpu_ms_median": round(1000 * statistics.median(cpu), 1),
                    "cpu_ms_min": round(1000 * min(cpu), 1),
                    "wall_ms_median": round(1000 * statistics.median(wall), 1),
                    "wall_ms_min": round(1000 * min(wall), 1),
                    "load_avg": os.getloadavg()[0],
                }
                print(json.dumps(result), flush=True)
                results.append(result)
    finally:
        cluster.destroy()
        shutil.rmtree(work, ignore_errors=True)
    return results


if __name__ == "__main__":
    raise SystemExit(main())
