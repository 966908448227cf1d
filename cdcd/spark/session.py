"""SparkSessions for cdcd's jobs, with Delta Lake, Iceberg, the Kafka source and S3A.

PySpark starts a JVM: it needs ``java`` (17 or 21) on ``PATH`` or ``JAVA_HOME``.
:func:`java_available` says whether one is there.

The Java packages are pinned for the PySpark version in pyproject.toml (:data:`PACKAGES`,
docs/spark.md "Versions"). ``scripts/setup`` fetches them once from Maven Central into
``~/.cache/cdcd/jars/spark/`` (``scripts/maven/spark/pom.xml``, without what PySpark already
ships); :func:`session` puts that folder on the class path. Where they are not there (a
machine that did not run the setup) it names the same packages in ``spark.jars.packages`` and
Spark fetches them itself. On a cluster of your own, pass :func:`packages_option` to
``spark-submit --packages`` and the settings of :func:`table_conf` with ``--conf``.

Catalogs: ``spark_catalog`` is Delta's (``CREATE TABLE ... USING delta``, paths as
``delta.`/path```); ``iceberg`` is an Iceberg catalog of type ``hadoop`` under
``iceberg_warehouse`` (tables ``iceberg.<namespace>.<table>``).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

SPARK_VERSION = "4.1.1"  # the pyspark pin in pyproject.toml
HADOOP_VERSION = "3.4.2"  # the hadoop-client jars that PySpark ships
#: Maven coordinates of the packages the jobs use, for this Spark version (Scala 2.13).
PACKAGES = (
    "io.delta:delta-spark_4.1_2.13:4.3.1",
    "org.apache.iceberg:iceberg-spark-runtime-4.1_2.13:1.11.0",
    f"org.apache.spark:spark-sql-kafka-0-10_2.13:{SPARK_VERSION}",
    f"org.apache.hadoop:hadoop-aws:{HADOOP_VERSION}",
)
JAR_SET = "spark"  # scripts/maven/spark/pom.xml
ICEBERG_CATALOG = "iceberg"


def java_available() -> bool:
    """Whether Spark can start a JVM: ``$JAVA_HOME/bin/java`` or ``java`` on ``PATH``."""
    home = os.environ.get("JAVA_HOME")
    if home:
        return (Path(home) / "bin" / "java").exists()
    return shutil.which("java") is not None


def packages_option() -> str:
    """The ``--packages`` value for ``spark-submit``/``pyspark`` on a cluster of your own."""
    return ",".join(PACKAGES)


def cached_jars() -> list[Path]:
    """The jars ``scripts/setup`` fetched (empty when it has not run)."""
    from cdcd.jars import jars

    try:
        return jars(JAR_SET)
    except FileNotFoundError:
        return []


#: Generated classes Spark keeps compiled (``spark.sql.codegen.cache.maxEntries``, default 100,
#: a setting of the JVM: give it when the session starts). A micro-batch's fold and Delta's
#: MERGE compile about 150 classes; with the default each batch evicted the classes of the batch
#: before and compiled them all again, a third of a steady batch's CPU (docs/spark.md).
CODEGEN_CACHE_ENTRIES = 2000


def table_conf(iceberg_warehouse: str | None = None) -> dict[str, str]:
    """The settings that turn on Delta Lake (in ``spark_catalog``) and, with a warehouse
    path, the Iceberg catalog ``iceberg`` (type hadoop), with a code cache large enough for
    a micro-batch's MERGE (:data:`CODEGEN_CACHE_ENTRIES`)."""
    extensions = ["io.delta.sql.DeltaSparkSessionExtension"]
    conf = {
        "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
        # schema evolution in MERGE: a column added to the source table is added to the target
        "spark.databricks.delta.schema.autoMerge.enabled": "true",
        "spark.sql.codegen.cache.maxEntries": str(CODEGEN_CACHE_ENTRIES),
    }
    if iceberg_warehouse is not None:
        extensions.append("org.apache.iceberg.spark.extensions.IcebergSparkSessionExtensions")
        prefix = f"spark.sql.catalog.{ICEBERG_CATALOG}"
        conf[prefix] = "org.apache.iceberg.spark.SparkCatalog"
        conf[f"{prefix}.type"] = "hadoop"
        conf[f"{prefix}.warehouse"] = iceberg_warehouse
    conf["spark.sql.extensions"] = ",".join(extensions)
    return conf


def jar_conf() -> dict[str, str]:
    """The cached jars on the driver's and executors' class path (read in place: ``spark.jars``
    would copy all of them, the AWS SDK's 600 MB included, into every session's work folder),
    else ``spark.jars.packages`` naming the packages (Spark fetches them)."""
    found = cached_jars()
    if found:
        path = f"{found[0].parent}/*"
        return {"spark.driver.extraClassPath": path, "spark.executor.extraClassPath": path}
    return {"spark.jars.packages": packages_option()}


def s3_conf(
    endpoint: str, access_key: str, secret_key: str, region: str = "us-east-1"
) -> dict[str, str]:
    """S3A settings for an S3-compatible endpoint (path-style addressing, static keys)."""
    return {
        "spark.hadoop.fs.s3a.endpoint": endpoint,
        "spark.hadoop.fs.s3a.endpoint.region": region,
        "spark.hadoop.fs.s3a.access.key": access_key,
        "spark.hadoop.fs.s3a.secret.key": secret_key,
        "spark.hadoop.fs.s3a.path.style.access": "true",
        "spark.hadoop.fs.s3a.connection.ssl.enabled": str(endpoint.startswith("https")).lower(),
        "spark.hadoop.fs.s3a.aws.credentials.provider": (
            "org.apache.hadoop.fs.s3a.SimpleAWSCredentialsProvider"
        ),
    }


def log_tasks(master: str, partitions: int) -> int:
    """How many tasks Delta reads a table's log with: ``partitions``, at most the cores of a
    ``local[N]`` master (``local``: one; ``local[*]``: the machine's)."""
    if master == "local":
        return 1
    if master.startswith("local["):
        cores = master[len("local[") :].split(",")[0].rstrip("]")
        if cores == "*":
            return max(1, min(partitions, os.cpu_count() or 1))
        if cores.isdigit():
            return max(1, min(partitions, int(cores)))
    return partitions


def session(
    app_name: str = "cdcd",
    master: str = "local[2]",
    memory: str = "768m",
    partitions: int = 2,
    iceberg_warehouse: str | None = None,
    warehouse: str | None = None,
    conf: Mapping[str, str] | None = None,
) -> SparkSession:
    """A local classic SparkSession with Delta Lake, Iceberg (when ``iceberg_warehouse`` is
    given), the Kafka source and S3A: no UI, ``partitions`` shuffle partitions, UTC time zone,
    no Python call sites recorded for error messages.
    ``warehouse`` is ``spark.sql.warehouse.dir`` (managed tables); ``conf`` adds settings."""
    from pyspark.sql import SparkSession

    builder = (
        SparkSession.builder.master(master)
        .appName(app_name)
        .config("spark.ui.enabled", "false")
        .config("spark.driver.memory", memory)
        .config("spark.sql.shuffle.partitions", str(partitions))
        .config("spark.default.parallelism", str(partitions))
        .config("spark.sql.session.timeZone", "UTC")
        .config("spark.sql.adaptive.enabled", "true")
        .config("spark.log.level", "ERROR")
        # Delta rebuilds a table's state from its log (every new version: each micro-batch)
        # with this many tasks (default 50); more tasks than the cores only add overhead
        .config("spark.databricks.delta.snapshotPartitions", str(log_tasks(master, partitions)))
        .config("spark.ui.showConsoleProgress", "false")
        # PySpark records the Python call site of every DataFrame and Column call for error
        # messages: several JVM calls and a failing IPython import each time, about 0.1 s of a
        # micro-batch, whose plan cdcd builds anew each batch (docs/spark.md)
        .config("spark.python.sql.dataFrameDebugging.enabled", "false")
    )
    settings = {**jar_conf(), **table_conf(iceberg_warehouse), **(conf or {})}
    if warehouse is not None:
        settings["spark.sql.warehouse.dir"] = warehouse
    for key, value in settings.items():
        builder = builder.config(key, value)
    return builder.getOrCreate()


@contextmanager
def setting(spark: SparkSession, key: str, value: str) -> Iterator[None]:
    """Within the block, the session's ``key`` is ``value``; afterwards what it was (unset if
    it was)."""
    before = spark.conf.get(key, None)
    spark.conf.set(key, value)
    try:
        yield
    finally:
        if before is None:
            spark.conf.unset(key)
        else:
            spark.conf.set(key, before)


def local_session(
    app_name: str = "cdcd", master: str = "local[2]", memory: str = "768m", partitions: int = 2
) -> SparkSession:
    """:func:`session` with its defaults (Delta Lake, no Iceberg catalog)."""
    return session(app_name, master=master, memory=memory, partitions=partitions)
