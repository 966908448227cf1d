"""Smoke test of the benchmark harness: ``bench/run.py --quick --workload W1,W2`` at a small size.

Runs the real harness (a real PostgreSQL, pg_recvlogical, the psycopg2 peer, cdcd with every
sink, a tansu broker) and checks its JSON: every contender reports each workload, with the same
positive number of rows (the harness itself fails a cdcd contender whose count differs
from the workload's), and the commit measured. No timing assertion: this only proves the harness works.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from bench.run import STREAM_CONTENDERS
from tests.pgharness import find_installations

REPO = Path(__file__).resolve().parents[2]
PEER = REPO.parent / "shared" / "bench" / "peer_psycopg2.py"


pytestmark = [pytest.mark.slow, pytest.mark.pg, pytest.mark.kafka]


def test_bench_quick(tmp_path: Path) -> None:
    installs = find_installations()
    if not installs:
        pytest.skip("no PostgreSQL installation")
    if not PEER.exists():
        pytest.skip(f"the psycopg2 peer script is not at {PEER}")
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "run.py"),
            "--quick",
            "--scale",
            "0.005",
            "--workload",
            "W1,W2",
            "--pg",
            str(installs[0].major),
            "--peer",
            str(PEER),
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=900,
        cwd=REPO,
    )
    assert proc.returncode == 0, (
        f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"
    )
    results = orjson.loads(out.read_bytes())
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
