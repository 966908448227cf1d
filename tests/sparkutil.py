"""The shared SparkSession for tests of :mod:`cdcd.spark` (one JVM per test session).

Import the fixture into a test module: ``from tests.sparkutil import spark``. Skips when
pyspark is missing or no JVM can be found (``java`` on PATH or ``JAVA_HOME``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """A local SparkSession (``local[2]``, no UI, 1 shuffle partition: the data is tiny and
    every partition is a task to schedule; UTC), shared by the test session."""
    pytest.importorskip("pyspark")
    from cdcd.spark.session import java_available, local_session

    if not java_available():
        pytest.skip("no JVM: Spark needs java 17 or 21 on PATH or in JAVA_HOME")
    session = local_session("cdcd-tests", master="local[2]", memory="512m", partitions=1)
    try:
        yield session
    finally:
        session.stop()
