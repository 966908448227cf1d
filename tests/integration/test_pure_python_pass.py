"""The compiled modules' tests again on their pure-Python form: the decoder, spill, assembler,
type, encoder and Kafka record tests run in a child pytest with ``CDCD_PURE_PYTHON=1`` (cdcd
picks the form at import, once per process, hence the child). A test of the suite rather than
a second pytest after it, so that it runs beside the other tests on the pytest-xdist workers.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cdcd.accel import pure_python_requested
from tests.e2e import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

#: The modules whose tests exercise the compiled code (cdcd/_purepy.py's lists) or its callers.
FILES = (
    "tests/unit/test_accel.py",
    "tests/unit/test_pgoutput.py",
    "tests/unit/test_decoder_corpus.py",
    "tests/unit/test_spill.py",
    "tests/unit/test_assembler.py",
    "tests/integration/test_assembler_corpus.py",
    "tests/unit/test_types.py",
    "tests/unit/test_encoding.py",
    "tests/unit/test_encoding_fast_paths.py",
    "tests/unit/test_parquet_columns.py",
    "tests/unit/test_parquet_types.py",
    "tests/unit/test_kafka_recordbatch.py",
    "tests/unit/test_kafka_partition.py",
    "tests/unit/test_snapshot_run.py",
    "tests/unit/test_copy_lazy.py",
)


def test_compiled_modules_tests_on_the_pure_python_form(tmp_path: Path) -> None:
    if pure_python_requested():
        pytest.skip("this run is on the pure-Python form already (CDCD_PURE_PYTHON=1)")
    env = {**os.environ, "CDCD_PURE_PYTHON": "1"}
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q"]
    cmd += ["--basetemp", str(tmp_path / "t"), *FILES]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=850)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert " passed" in summary and "failed" not in summary and "error" not in summary, summary
