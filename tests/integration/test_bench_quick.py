"""Smoke tests of the benchmark harness: ``bench/run.py --quick --workload W1,W2`` at a small size,
and the Debezium contender on W1 (200 rows) and S1 (2,000 rows).

Runs the real harness (a real PostgreSQL, pg_recvlogical, the psycopg2 peer, cdcd with every
sink, an Apache Kafka broker; Debezium's embedded engine in a JVM) and checks its JSON: every contender
reports each workload, with the same positive number of rows (the harness itself fails a cdcd or
Debezium contender whose count differs from the workload's), and the commit measured. No timing
assertion: this only proves the harness works.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from bench.debezium_bench import debezium_missing
from bench.run import STREAM_CONTENDERS
from tests.pgharness import find_installations

REPO = Path(__file__).resolve().parents[2]
PEER = REPO.parent / "shared" / "bench" / "peer_psycopg2.py"


pytestmark = [pytest.mark.slow, pytest.mark.pg, pytest.mark.kafka]


def run_bench(tmp_path: Path, major: int, *args: str) -> list[dict[str, Any]]:
    """``bench/run.py`` on PostgreSQL ``major`` with ``args``; its JSON results."""
    out = tmp_path / "bench.json"
    run = [sys.executable, str(REPO / "bench" / "run.py"), "--pg", str(major), "--json", str(out)]
    proc = subprocess.run(
        [*run, *args],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
    )
    assert proc.returncode == 0, (
        f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"
    )
    results: list[dict[str, Any]] = orjson.loads(out.read_bytes())
    return results


def test_bench_quick(tmp_path: Path) -> None:
    installs = find_installations()
    if not installs:
        pytest.skip("no PostgreSQL installation")
    if not PEER.exists():
        pytest.skip(f"the psycopg2 peer script is not at {PEER}")
    results = run_bench(
        tmp_path,
        installs[0].major,
        "--quick",
        "--scale",
        "0.005",
        "--workload",
        "W1,W2",
        "--peer",
        str(PEER),
        "--contenders",
        ",".join(STREAM_CONTENDERS),
    )
    contenders = set(STREAM_CONTENDERS)
    for workload in ("W1", "W2"):
        rows = {r["contender"]: r for r in results if r["workload"] == workload}
        assert set(rows) == contenders, f"{workload}: contenders {sorted(rows)}"
        counts = {name: r["rows"] for name, r in rows.items()}
        assert len(set(counts.values())) == 1, f"{workload}: row counts differ: {counts}"
        assert next(iter(counts.values())) > 0
        for r in rows.values():
            assert r["server_version"].startswith(str(installs[0].major))
            assert r["seconds"] > 0 and r["rows_per_s"] > 0 and r["peak_rss_mb"] > 0
            assert r["cdcd_commit"], "each result names the commit it measured"


def test_bench_quick_debezium(tmp_path: Path) -> None:
    """debezium_null drains the same slot backlog as cdcd_null (W1) and takes S1's snapshot."""
    installs = find_installations()
    if not installs:
        pytest.skip("no PostgreSQL installation")
    missing = debezium_missing()
    if missing is not None:
        pytest.skip(missing)
    results = run_bench(
        tmp_path,
        installs[0].major,
        "--workload",
        "W1,S1",
        "--scale",
        "0.0002",  # W1: 200 rows in one transaction; S1: a table of 2,000
        "--repeat",
        "1",
        "--contenders",
        "cdcd_null,cdcd_null_w1,debezium_null",
    )
    by_name = {(r["workload"], r["contender"]): r for r in results}
    assert set(by_name) == {
        ("W1", "cdcd_null"),
        ("W1", "debezium_null"),
        ("S1", "cdcd_null_w1"),
        ("S1", "debezium_null"),
    }
    assert by_name["W1", "debezium_null"]["rows"] == by_name["W1", "cdcd_null"]["rows"] == 200
    assert by_name["S1", "debezium_null"]["rows"] == by_name["S1", "cdcd_null_w1"]["rows"] == 2000
    for workload, cdcd in (("W1", "cdcd_null"), ("S1", "cdcd_null_w1")):
        debezium = by_name[workload, "debezium_null"]
        assert debezium["startup_seconds"] > 0 and debezium["wall_seconds"] > debezium["seconds"]
        assert debezium["cpu_seconds"] > 0 and debezium["peak_rss_mb"] > 0
        assert by_name[workload, cdcd]["ratio_vs_debezium"] > 0
