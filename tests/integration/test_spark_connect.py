"""The Spark jobs through Spark Connect (the way Spark 4 and Databricks serverless run
PySpark): a local Connect server is started (``tests.sparkutil.connect_server``) and
``test_spark_incremental.py`` runs again in a child pytest whose ``spark`` fixture is a
Spark Connect session to it. PySpark allows one kind of session per process, hence the child.
The jobs use DataFrame APIs only (no SparkContext, RDD or py4j): the module below checks that
too, by source.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.spark, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
#: Tests of test_spark_incremental.py that run again under Spark Connect: the batch jobs, MERGE
#: into Delta in batches with a replay and the stream into Delta with schema changes (its
#: ``foreachBatch`` runs in Python workers of the server). (The CLI help and the spark-submit
#: run start no session of the test's; the command line's apply and history run the jobs
#: tested here; the other MERGE paths run the same statements.)
UNDER_CONNECT = (
    "(latest_state or history or schema_from_files or apply_to_delta_in_batches"
    " or stream_to_delta) and not cli"
)


def test_no_classic_only_apis() -> None:
    """Nothing in cdcd.spark reaches into py4j, the SparkContext or RDDs."""
    pattern = re.compile(r"\._jvm|\._jsc|\.sparkContext|SparkContext[.(]|\.rdd\b")
    found = [
        f"{path.name}:{n}: {line.strip()}"
        for path in sorted((ROOT / "cdcd" / "spark").glob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line)
    ]
    assert not found, found


# its own xdist group: the server is a JVM of its own, so this long run need not queue behind
# the other Spark tests on their worker (tests/integration/conftest.py)
@pytest.mark.xdist_group("spark-connect")
def test_jobs_under_spark_connect(connect_server: str, tmp_path: Path) -> None:
    env = {**os.environ, "CDCD_TEST_SPARK_REMOTE": connect_server}
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-x"]
    cmd += ["--basetemp", str(tmp_path / "t"), "-k", UNDER_CONNECT]
    cmd.append(str(ROOT / "tests" / "integration" / "test_spark_incremental.py"))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=850)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-2000:]
    assert " passed" in summary and "skipped" not in summary, summary
