"""The sinks' own buffers count against ``buffer.memory_limit``.

A real PostgreSQL streams into the Parquet file sink or the Kafka sink (Apache Kafka) through
``cdcd run --endpos``, with a small limit; the cdcd process's peak RSS (``wait4``) must stay
within ``memory_limit + 150 MiB``, in the two shapes that used to pass it (docs/guarantees.md):

* TOASTed rows (the benchmark's W3): 4 KB out-of-line values in transactions of 1,000 rows,
  then updates leaving them unchanged. The Parquet sink used to keep up to 65,536 rows per
  file in memory, and the queue to the sinks did not count them;
* one huge transaction (the benchmark's W5): spilled by the assembler; the sink's buffers
  inside that one transaction are bounded by its ``memory_budget``.

Afterwards everything is there: every row in the Parquet files, and for Kafka the run's exit 0
(``--endpos`` ends only once every transaction is acknowledged and confirmed).

Marked ``slow``: on the newest PostgreSQL only (the sinks' buffers do not depend on the
server's version; ``CDCD_TEST_ALL_VERSIONS=1``: every version).

numpy and pandas are installed here (the test extras bring them): ``cdcd run`` keeps them out
(:func:`cdcd.runtime.keep_unused_modules_out`), without which pyarrow would load them and
the Parquet runs would peak about 50 MB higher (216 and 231 MiB against 169 and 176), and it
keeps glibc returning large freed blocks (:func:`cdcd.runtime.return_large_blocks`: the TOAST
run 170-176 MiB without, 160-165 with). The Parquet writer's own buffers come from the system
allocator, not mimalloc (``cdcd/sinks/file/__init__.py``; compiled modules, PostgreSQL 18:
huge 162-164 → 146-148 MiB, TOAST 154-159 → 143-149, the Kafka runs 88-106).
"""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from bench.run import W3_DDL, W5_DDL, load_w3, load_w5
from tests.e2e import cdcd_cmd, data_files, run_cdcd, write_config
from tests.kafkaharness import KafkaBroker
from tests.pgharness import PgDatabase

pytestmark = [pytest.mark.pg, pytest.mark.slow, pytest.mark.timeout(300)]

MiB = 1 << 20
LIMIT = 32 * MiB
BOUND_MB = (LIMIT + 150 * MiB) / MiB
SHAPES = {  # table, DDL, load, scale (W3: 20,000 rows of 4 KB; W5: 300,000 rows in one)
    "toast": ("w3", W3_DDL, load_w3, 0.2),
    "huge": ("w5", W5_DDL, load_w5, 0.03),
}


def _hwm_kib(pid: int) -> int:
    """The process's peak RSS so far (VmHWM, KiB), 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return 0


def peak_rss_run(config: Path, endpos: str) -> tuple[float, str]:
    """``cdcd run --endpos`` to completion; its peak RSS in MiB and its stderr.

    The peak is VmHWM, read while it runs: ``wait4``'s ``ru_maxrss`` would count the copy of
    this (possibly large) pytest process the child was before it exec'd cdcd."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(os.devnull, "wb") as out, open(config.parent / "stderr.log", "w+b") as err:
        proc = subprocess.Popen(
            cdcd_cmd("run", "--config", str(config), "--endpos", endpos),
            stdout=out,
            stderr=err,
            env=env,
            cwd=Path(__file__).resolve().parents[2],
        )
        deadline = time.monotonic() + 240
        peak = 0
        while True:
            peak = max(peak, _hwm_kib(proc.pid))
            pid, status, _ = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                proc.kill()
                os.wait4(proc.pid, 0)
                raise AssertionError("cdcd run --endpos did not finish in 240 s")
            time.sleep(0.01)
        err.seek(0)
        log = err.read().decode(errors="replace")
    code = os.waitstatus_to_exitcode(status)
    assert code == 0, f"cdcd run exited {code}\n{log[-4000:]}"
    return peak / 1024, log


@pytest.mark.parametrize(
    ("sink", "shape"),
    [(sink, shape) for sink in ("parquet", "kafka") for shape in sorted(SHAPES)]
    + [("kafka_eos", "huge")],  # exactly_once: the window waits for a Kafka commit
)
async def test_peak_rss_within_memory_limit(
    pg_db: PgDatabase, kafka_broker: KafkaBroker, tmp_path: Path, sink: str, shape: str
) -> None:
    table, ddl, load, scale = SHAPES[shape]
    pg_db.execute(ddl)
    pg_db.execute(f"CREATE PUBLICATION cdcd_e2e_pub FOR TABLE {table}")
    if sink == "parquet":
        sinks = [{"type": "file", "path": "out", "format": "parquet"}]
    else:
        prefix = f"mem{os.getpid()}{shape}"
        sinks = [
            {
                "type": "kafka",
                "bootstrap_servers": kafka_broker.bootstrap,
                "topic_prefix": prefix,
                "exactly_once": sink == "kafka_eos",
            }
        ]
    config = write_config(tmp_path, pg_db.dsn, sinks=sinks)
    cfg = yaml.safe_load(config.read_text())
    cfg["buffer"]["memory_limit"] = LIMIT
    cfg["log"]["level"] = "warning"
    config.write_text(yaml.safe_dump(cfg))
    run_cdcd("slot", "create", "--config", str(config))
    rows = load(pg_db, scale)
    endpos = pg_db.fetchval("SELECT pg_current_wal_insert_lsn()::text")

    peak_mb, log = peak_rss_run(config, endpos)

    assert peak_mb <= BOUND_MB, f"{sink} {shape}: peak RSS {peak_mb:.0f} MiB > {BOUND_MB:.0f}"
    if sink == "parquet":
        files = data_files(tmp_path / "out" / f"public.{table}", ".parquet")
        assert sum(pq.ParquetFile(f).metadata.num_rows for f in files) == rows, log[-2000:]
