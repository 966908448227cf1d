"""Spark sessions and contract-shaped events for tests of :mod:`cdcd.spark`.

Fixtures (import them into a test module: ``from tests.sparkutil import spark``):

* ``spark``: a classic local SparkSession (one JVM per test session) or, when the environment
  variable ``CDCD_TEST_SPARK_REMOTE`` holds a Spark Connect URL, a Spark Connect session to it.
  (PySpark allows one kind per process: its functions build classic or Connect columns by a
  process-wide switch.)
* ``connect_server``: a local Spark Connect server started as a child process
  (``spark-submit --class ...SparkConnectServer`` from the pyspark wheel, on a free loopback
  port), its URL; stopped at the end. The jobs' Python functions (``foreachBatch``) run in
  workers the server starts with this interpreter. Tests run the Spark test modules again in
  a child pytest pointed at it.

All skip when pyspark is missing or no JVM can be found (``java`` on PATH or ``JAVA_HOME``).

:func:`change_event` builds an event exactly as cdcd's JSON Lines lines look (docs/events.md plus
the top-level ``key``), for cases a workload on a real server cannot force or time.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest

UNAVAILABLE = "__debezium_unavailable_value"

#: Java options of every Spark JVM the tests start (the session, the Connect server, the
#: ``spark-submit`` and streaming children): C1 only and the serial collector, as the Kafka
#: brokers of tests/kafkaharness.py run. These JVMs live minutes and run many small jobs, so
#: C2's compiles never pay back; without them the Spark tests took about a third more CPU.
TEST_JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
#: Settings of the shared session and the Connect server: no whole-stage code generation.
#: Each query's generated Java class was compiled (Janino, then the JIT) to process a few
#: rows; the operators give the same rows without it (the ``spark-submit`` and streaming
#: children still run it). The Spark tests took a sixth less CPU.
TEST_SQL_CONF = {"spark.sql.codegen.wholeStage": "false"}
#: One partition where Spark's defaults make many for a few rows, as the shared session has
#: them (:func:`cdcd.spark.session.session` with ``partitions=1``), for the JVMs that do not
#: build their session with it (the Connect server, the ``spark-submit`` child): shuffles,
#: and Delta Lake's snapshot of a table's log, rebuilt for each new version of a table, in
#: 50 partitions by default: 50 tasks each time. The Spark Connect run took 40% less CPU.
ONE_PARTITION_CONF = {
    "spark.sql.shuffle.partitions": "1",
    "spark.default.parallelism": "1",
    "spark.databricks.delta.snapshotPartitions": "1",
}


def _require_spark() -> None:
    pytest.importorskip("pyspark")
    from cdcd.spark.session import java_available

    if not java_available():
        pytest.skip("no JVM: Spark needs java 17 or 21 on PATH or in JAVA_HOME")


@pytest.fixture(scope="session")
def spark(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """A local SparkSession (``local[2]``, no UI, 1 shuffle partition: the data is tiny and
    every partition is a task to schedule; UTC) with Delta Lake, the Iceberg catalog
    ``iceberg``, the Kafka source and S3A (:func:`cdcd.spark.session.session`), shared by the
    test session (one JVM per xdist worker). The Iceberg catalog's warehouse is a folder of
    the test session's."""
    _require_spark()
    remote = os.environ.get("CDCD_TEST_SPARK_REMOTE")
    if remote:
        from pyspark.sql import SparkSession

        session = SparkSession.builder.remote(remote).getOrCreate()
    else:
        from cdcd.spark.session import session as spark_session

        session = spark_session(
            "cdcd-tests",
            master="local[2]",
            memory="768m",
            partitions=1,
            iceberg_warehouse=str(tmp_path_factory.mktemp("iceberg")),
            conf={"spark.driver.extraJavaOptions": TEST_JVM_OPTIONS, **TEST_SQL_CONF},
        )
    try:
        yield session
    finally:
        session.stop()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="session")
def connect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A local Spark Connect server for the test session, with the same packages and
    catalogs as :func:`spark` (the server's own Iceberg warehouse): its ``sc://`` URL."""
    _require_spark()
    import pyspark

    from cdcd.spark.session import jar_conf, table_conf

    home = Path(pyspark.__file__).parent
    port = _free_port()
    log = tmp_path_factory.mktemp("spark-connect") / "server.log"
    env = {**os.environ, "SPARK_HOME": str(home), "PYSPARK_PYTHON": sys.executable}
    env["SPARK_LOCAL_IP"] = "127.0.0.1"
    cmd = [str(home / "bin" / "spark-submit"), "--master", "local[2]"]
    cmd += ["--class", "org.apache.spark.sql.connect.service.SparkConnectServer"]
    for conf in (
        f"spark.connect.grpc.binding.port={port}",
        "spark.connect.grpc.binding.address=127.0.0.1",
        "spark.driver.memory=512m",
        f"spark.driver.extraJavaOptions={TEST_JVM_OPTIONS}",
        *(f"{k}={v}" for k, v in TEST_SQL_CONF.items()),
        "spark.ui.enabled=false",
        *(f"{k}={v}" for k, v in ONE_PARTITION_CONF.items()),
        "spark.sql.session.timeZone=UTC",
        "spark.log.level=ERROR",
        *(f"{k}={v}" for k, v in jar_conf().items()),
        *(f"{k}={v}" for k, v in table_conf(str(log.parent / "iceberg")).items()),
    ):
        cmd += ["--conf", conf]
    cmd.append("spark-internal")
    with log.open("wb") as out:
        server = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            if server.poll() is not None:
                pytest.fail(f"the Spark Connect server exited: {log.read_text()[-3000:]}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    pytest.fail(f"no Spark Connect server on {port}: {log.read_text()[-3000:]}")
                time.sleep(0.5)
        yield f"sc://127.0.0.1:{port}"
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def change_event(
    op: str,
    position: tuple[int, int],
    *,
    before: dict[str, Any] | None = None,
    after: dict[str, Any] | None = None,
    key: tuple[str, ...] | None = ("id",),
    toast: list[str] | None = None,
    old_key: dict[str, Any] | None = None,
    new_key: dict[str, Any] | None = None,
    ts_us: int | None = None,
    table: str = "orders",
) -> dict[str, Any]:
    """One JSON Lines event of ``public.<table>`` as cdcd writes it (``key`` names the key
    columns, None for a keyless table; ``toast`` the unchanged TOAST columns, whose ``after``
    values must be the marker; ``old_key``/``new_key`` link a key change's create/delete)."""
    commit_lsn, seq = position
    row = after if after is not None else before
    ts = ts_us if ts_us is not None else 1_732_233_600_000_000 + commit_lsn * 1000
    source: dict[str, Any] = {
        "version": "0.1.0",
        "connector": "postgresql",
        "name": "shop",
        "db": "shop",
        "schema": "public",
        "table": table,
        "ts_ms": ts // 1000,
        "ts_us": ts,
        "snapshot": "false",
        "txId": 700 + commit_lsn,
        "lsn": commit_lsn - 8 + seq,
        "sequence": None,
        "xmin": None,
        "commit_lsn": commit_lsn,
        "seq": seq,
    }
    if toast:
        source["unchanged_toast"] = toast
    if old_key is not None:
        source["old_key"] = old_key
    if new_key is not None:
        source["new_key"] = new_key
    if op == "t":
        source["truncate"] = {"cascade": False, "restart_identity": False}
    return {
        "before": before,
        "after": after,
        "source": source,
        "op": op,
        "ts_ms": ts // 1000 + 5,
        "transaction": {
            "id": f"{700 + commit_lsn}:{commit_lsn}",
            "total_order": seq + 1,
            "data_collection_order": seq + 1,
        },
        "key": None if key is None or row is None else {k: row[k] for k in key},
    }


def key_change(
    position: tuple[int, int],
    old: dict[str, Any],
    new: dict[str, Any],
    toast: list[str],
    key: tuple[str, ...] = ("id",),
) -> list[dict[str, Any]]:
    """The delete + create pair of an update that changes the key (REPLICA IDENTITY DEFAULT:
    the delete's ``before`` is the old key, other columns null; the create's ``toast``
    columns hold the marker). ``position`` is the delete's; the create follows at seq + 1."""
    old_key = {k: old[k] for k in key}
    new_key = {k: new[k] for k in key}
    before = {c: (old[c] if c in key else None) for c in new}
    after = {c: (UNAVAILABLE if c in toast else v) for c, v in new.items()}
    lsn, seq = position
    return [
        change_event("d", (lsn, seq), before=before, key=key, new_key=new_key),
        change_event("c", (lsn, seq + 1), after=after, key=key, toast=toast, old_key=old_key),
    ]


def write_jsonl(folder: Path, events: list[dict[str, Any]], per_file: int = 1000) -> list[Path]:
    """``events`` (in position order) as JSON Lines files named as the file sink names them,
    ``per_file`` events each, modification times in name order; returns the paths."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(0, len(events), per_file):
        chunk = events[i : i + per_file]
        source = chunk[0]["source"]
        path = folder / f"{source['commit_lsn']:016X}-{source['seq']:08X}.jsonl"
        path.write_bytes(b"".join(orjson.dumps(e) + b"\n" for e in chunk))
        # modification times in name order, as the sink publishes them (Spark's streaming
        # file source takes files by modification time)
        stamp = 1_700_000_000 + source["commit_lsn"] * 1000 + source["seq"]
        os.utime(path, (stamp, stamp))
        paths.append(path)
    return paths


def write_schema_file(
    folder: Path,
    position: tuple[int, int],
    columns: list[tuple[str, str, int, int]],
    key: list[str] | None,
    table: str = "orders",
) -> Path:
    """A ``_schema/`` file as the file sink writes it: ``columns`` are (name, type name,
    type oid, typmod)."""
    directory = folder / "_schema"
    directory.mkdir(parents=True, exist_ok=True)
    doc = {
        "schema": "public",
        "table": table,
        "relation_oid": 16384,
        "replica_identity": "d",
        "key": key,
        "columns": [
            {"name": n, "type": t, "type_oid": o, "typmod": m, "key": n in (key or [])}
            for n, t, o, m in columns
        ],
        "commit_lsn": position[0],
        "seq": position[1],
    }
    path = directory / f"{position[0]:016X}-{position[1]:08X}.json"
    path.write_bytes(orjson.dumps(doc, option=orjson.OPT_INDENT_2))
    return path
