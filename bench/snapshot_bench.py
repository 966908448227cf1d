"""Workload S1 of bench/run.py: the initial snapshot against the server's limit for one reader.

A table of 10,000,000 ten-column rows (``--scale`` multiplies; the columns of W1), read

``copy_stdout``        ``COPY (SELECT * FROM s1) TO STDOUT`` into /dev/null over one connection
                       (``psql``; asyncpg's ``copy_from_query`` where no psql is installed):
                       what one reader can get out of the server
``cdcd_null_w1``       ``cdcd run`` with ``snapshot.mode: initial_only``, null sink, one worker
``cdcd_null_w4``       the same with ``snapshot.workers: 4``
``cdcd_jsonl_w1``      file sink, JSON Lines, one worker
``cdcd_jsonl_w4``      the same with four workers

each run creating its own slot (dropped after it). ``ratio_vs_copy``: rows/s over
``copy_stdout``'s. Targets: null >= 0.8x, JSON Lines >= 0.5x with one worker, more
workers never slower.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from bench.run import Setup

SNAPSHOT_CONTENDERS = (
    "copy_stdout",
    "cdcd_null_w1",
    "cdcd_null_w4",
    "cdcd_jsonl_w1",
    "cdcd_jsonl_w4",
)
S1_SQL = "COPY (SELECT * FROM s1) TO STDOUT"


def _psql() -> str | None:
    return shutil.which("psql") or next(
        (str(p) for p in sorted(Path("/usr/lib/postgresql").glob("*/bin/psql"))), None
    )


def copy_command(dsn: str) -> list[str]:
    psql = _psql()
    if psql is not None:
        return [psql, "-X", "-q", "-d", dsn, "-c", S1_SQL, "-o", "/dev/null"]
    script = (
        "import asyncio, asyncpg, sys\n"
        "async def main():\n"
        "    conn = await asyncpg.connect(sys.argv[1])\n"
        "    await conn.copy_from_query(sys.argv[2], output='/dev/null')\n"
        "    await conn.close()\n"
        "asyncio.run(main())\n"
    )
    return [sys.executable, "-c", script, dsn, S1_SQL]


def cdcd_snapshot_config(setup: Setup, contender: str, slot: str, work: Path) -> Path:
    sink, _, workers = contender.removeprefix("cdcd_").partition("_w")
    sinks: list[dict[str, Any]] = (
        [{"type": "null"}]
        if sink == "null"
        else [{"type": "file", "path": str(work / "out"), "format": "jsonl"}]
    )
    cfg = {
        "name": "bench",
        "source": {
            "dsn": setup.db.dsn,
            "slot": slot,
            "publication": "bench_pub",
            "create_publication": False,
            "messages": False,
        },
        "snapshot": {
            "mode": "initial_only",
            "state_dir": str(work / "state"),
            "workers": int(workers),
        },
        "buffer": {"spill_dir": str(work / "spill")},
        "sinks": sinks,
        "http": {"listen": None},
        "log": {"format": "json", "level": "warning"},
    }
    path = work / "cdcd.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def add_ratios(rows: list[dict[str, Any]]) -> None:
    """``ratio_vs_copy`` on every S1 row: rows/s over copy_stdout's in the same run."""
    reference = next((r["rows_per_s"] for r in rows if r["contender"] == "copy_stdout"), None)
    for row in rows:
        row["ratio_vs_copy"] = round(row["rows_per_s"] / reference, 3) if reference else None
