"""End to end, every part real, with faults: PostgreSQL → ``cdcd run`` → Apache Kafka (three
brokers, replication factor 3, ``min.insync.replicas`` 2, ``exactly_once: true``) → Spark
Structured Streaming (``python -m cdcd.spark stream --read-committed``) → Delta Lake; and
PostgreSQL → cdcd → JSON Lines files on S3 (moto) → Spark → Iceberg (hadoop catalog).

A workload runs in a thread while the faults come: inserts, updates leaving a TOASTed value
(> 2 KB, stored out of line) unchanged, deletes, key changes leaving it unchanged, a truncate, a
column added. ``kill -9`` of the daemon (restarted at once), of one Kafka broker (started
again later), and of the Spark stream, a ``python -m cdcd.spark stream --continuous`` child
process, while a micro-batch is running (its offsets written, its commit not). The query is
then run to the end from its checkpoint (``availableNow``, on the test session). The target
equals the source table, every column, TOASTed values and the added column included, and holds
each key once (a replayed micro-batch or a redelivered file wrote nothing twice). The Iceberg
table keeps history (SCD type 2): its current versions equal the source, each version is there
once and each key has one open version at most.

The newest installed PostgreSQL only (``slow``), in the Spark worker (``spark``).
"""

# ruff: noqa: F811  (the ``spark`` fixture is imported, then used as a parameter)
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cdcd.lsn import parse_lsn
from tests.e2e import normalize, run_cdcd, write_config
from tests.integration.test_crash_safety import Daemon
from tests.integration.test_s3_crash import s3  # noqa: F401
from tests.kafkaharness import KafkaBroker
from tests.pgharness import PgDatabase
from tests.s3harness import S3Store
from tests.sparkutil import TEST_JVM_OPTIONS

pytest.importorskip("pyspark")

from cdcd.spark import stream_table, table_ref, table_rows
from cdcd.spark.autocdc import END_AT, START_AT

pytestmark = [
    pytest.mark.pg,
    pytest.mark.kafka,
    pytest.mark.spark,
    pytest.mark.slow,
    pytest.mark.timeout(600),
]

TABLE = "public.e2e_orders"
BODY = "repeat(md5(({})::text), 80)"  # 2,560 characters, stored out of line: TOASTed
SCHEMA_SQL = """
CREATE TABLE e2e_orders (id int PRIMARY KEY, n int NOT NULL, body text);
ALTER TABLE e2e_orders ALTER COLUMN body SET STORAGE EXTERNAL;
"""


def workload_sql() -> Iterator[str]:
    """The workload, one transaction per item: about 3,000 events."""
    for start in range(1, 601, 60):  # inserts, every other row with a TOASTed body
        yield (
            f"INSERT INTO e2e_orders SELECT i, 0, CASE WHEN i % 2 = 0 THEN {BODY.format('i')} END"
            f" FROM generate_series({start}, {start + 59}) i"
        )
        yield f"UPDATE e2e_orders SET n = n + 1 WHERE id % 7 = {start % 7}"  # body unchanged
        yield f"DELETE FROM e2e_orders WHERE id = {start + 3}"
    yield "TRUNCATE e2e_orders"
    for start in range(1, 1001, 100):
        yield (
            f"INSERT INTO e2e_orders SELECT i, i, {BODY.format('i + 7')}"
            f" FROM generate_series({start}, {start + 99}) i"
        )
        yield f"UPDATE e2e_orders SET n = n + 1 WHERE id BETWEEN {start} AND {start + 30}"
    # key changes leaving the TOASTed body unchanged, one alone, some chained in a transaction
    yield "UPDATE e2e_orders SET id = id + 10000 WHERE id % 50 = 0"
    yield """UPDATE e2e_orders SET id = id + 20000 WHERE id % 50 = 1;
             UPDATE e2e_orders SET n = -n WHERE id > 20000;
             UPDATE e2e_orders SET id = id + 1000 WHERE id > 20000"""
    yield "DELETE FROM e2e_orders WHERE id % 50 = 2"
    yield "ALTER TABLE e2e_orders ADD COLUMN extra int"  # a column added mid-stream
    for start in range(1001, 1401, 100):
        yield (
            f"INSERT INTO e2e_orders SELECT i, i, {BODY.format('i')}, i % 3"
            f" FROM generate_series({start}, {start + 99}) i"
        )
        yield f"UPDATE e2e_orders SET extra = 7 WHERE id BETWEEN {start - 500} AND {start - 450}"
    yield "UPDATE e2e_orders SET id = id + 30000, extra = 1 WHERE id % 50 = 3"  # after the add
    yield "UPDATE e2e_orders SET n = n + 1 WHERE id % 9 = 0"


class Workload(threading.Thread):
    """The workload in a thread: ``done`` counts the transactions committed; it waits at
    ``gate`` (a transaction index) until :attr:`go` is set."""

    def __init__(self, db: PgDatabase, gate: int) -> None:
        super().__init__(daemon=True)
        self.db = db
        self.gate = gate
        self.go = threading.Event()
        self.done = 0
        self.error: BaseException | None = None
        self.statements = list(workload_sql())

    def run(self) -> None:
        try:
            with self.db.connect() as conn:
                conn.autocommit = False
                for i, sql in enumerate(self.statements):
                    if i == self.gate:
                        self.go.wait(300)
                    with conn.cursor() as cur:
                        cur.execute(sql)
                    conn.commit()
                    self.done = i + 1
                    time.sleep(0.02)
        except BaseException as exc:  # the test reports it
            self.error = exc

    def finish(self) -> None:
        self.go.set()
        self.join(300)
        assert not self.is_alive(), "the workload did not finish"
        if self.error is not None:
            raise self.error


async def until(condition: Callable[[], bool], what: str, timeout: float = 240) -> None:
    print(f"{time.strftime('%H:%M:%S')} waiting for {what}", flush=True)
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        await asyncio.sleep(0.05)


class SparkStream:
    """``python -m cdcd.spark stream --continuous`` as a child process (its own JVM), killable."""

    def __init__(self, args: list[str], log_path: Path, checkpoint: Path, submit: str = ""):
        """``submit``: spark-submit options for the child's JVM (``PYSPARK_SUBMIT_ARGS``)."""
        self.checkpoint = checkpoint
        self.log_path = log_path
        submit = f"--driver-java-options '{TEST_JVM_OPTIONS}' {submit} pyspark-shell"
        with log_path.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "cdcd.spark", "stream", *args, "--continuous"],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYSPARK_SUBMIT_ARGS": submit},
            )

    def batches(self, kind: str) -> set[int]:
        folder = self.checkpoint / kind
        if not folder.is_dir():
            return set()
        return {int(p.name) for p in folder.iterdir() if p.name.isdigit()}

    def running(self) -> bool:
        assert self.proc.poll() is None, self.log_path.read_text(errors="replace")[-6000:]
        return True

    def committed(self) -> bool:
        return self.running() and bool(self.batches("commits"))

    def mid_batch(self) -> bool:
        """A micro-batch after the first is under way: its offsets written, its commit not."""
        started = self.batches("offsets") - self.batches("commits")
        return self.running() and any(b > 0 for b in started)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop_quietly(self) -> None:
        if self.proc.poll() is None:
            self.kill()


@pytest.fixture
def children() -> Iterator[list[Daemon | SparkStream]]:
    made: list[Daemon | SparkStream] = []
    yield made
    for child in made:
        child.stop_quietly()


def config(directory: Path, db: PgDatabase, sink: dict[str, Any], name: str) -> Daemon:
    path = write_config(
        directory,
        db.dsn,
        sinks=[sink],
        name=name,
        slot=f"cdcd_{name}",
        publication=name,
        reconnect_min_backoff=0.2,
        reconnect_max_backoff=1.0,
    )
    db.execute(SCHEMA_SQL)
    run_cdcd("slot", "create", "--config", str(path))
    return Daemon(path, directory / "cdcd.log")


async def drained(db: PgDatabase, daemon: Daemon, slot: str) -> None:
    """Wait until the slot's confirmed position passes everything committed (the sink holds
    it all durably), then stop the daemon."""
    end = parse_lsn(db.fetchval("SELECT pg_current_wal_lsn()::text"))

    def confirmed() -> bool:
        daemon.assert_running()
        lsn = db.fetchval(
            f"SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = '{slot}'"
        )
        return lsn is not None and parse_lsn(lsn) >= end

    await until(confirmed, "cdcd to confirm the whole workload")
    assert daemon.terminate() == 0, daemon.log()[-6000:]


async def faults(
    db: PgDatabase,
    daemon: Daemon,
    stream: SparkStream,
    slot: str,
    cluster: KafkaBroker | None = None,
) -> None:
    """The workload with the faults: kill -9 of cdcd (started again at once) early on, of a
    Kafka broker of ``cluster`` (started again once the Spark stream is killed), and of the
    Spark stream in a micro-batch after its first one; the workload's last two thirds wait
    for the stream's first micro-batch. Returns once cdcd confirmed the workload and stopped."""
    workload = Workload(db, gate=len(list(workload_sql())) // 3)
    daemon.start()
    daemon.wait_streaming()
    workload.start()
    try:
        await until(lambda: workload.done >= workload.gate // 2, "the workload to start")
        daemon.kill()
        daemon.start()
        if cluster is not None:
            await until(lambda: workload.done >= workload.gate, "the workload to go on")
            await cluster.kill(1)  # one of three: the topics stay writable (min ISR 2)
        await until(stream.committed, "the Spark stream's first micro-batch", 300)
        workload.go.set()
        await until(stream.mid_batch, "a micro-batch of the Spark stream under way", 300)
        stream.kill()
        if cluster is not None:
            await cluster.revive(1)
        workload.finish()
        await drained(db, daemon, slot)
    finally:
        workload.go.set()
        if cluster is not None:
            await cluster.heal()


def assert_equals_source(spark: Any, target: str, db: PgDatabase) -> None:
    """The target's visible rows (of a type 2 table: its current versions) equal the source
    table's, every column; each key is once in a type 1 target (tombstones included), each
    version once in a type 2 one."""
    with db.connect() as conn, conn.cursor() as cur:
        cur.execute(f"SELECT * FROM {TABLE}")
        names = [d[0] for d in cur.description]
        source = [dict(zip(names, row, strict=True)) for row in cur.fetchall()]
    assert len(source) > 1000 and "extra" in names
    assert any(len(r["body"] or "") > 2048 for r in source if r["id"] > 30000)
    table = table_rows(spark, target)
    history = START_AT in table.columns
    if history:
        table = table.where(f"{END_AT} IS NULL").drop(START_AT, END_AT)
    rows = [r.asDict() for r in table.collect()]
    assert rows and sorted(rows[0]) == sorted(names), "the target's columns differ"

    def normal(rows: list[dict[str, Any]]) -> Counter[tuple[tuple[str, Any], ...]]:
        return Counter(tuple(sorted((c, normalize(v)) for c, v in r.items())) for r in rows)

    got, expected = normal(rows), normal(source)
    assert got == expected, (
        f"{len(got - expected)} rows only in the target, e.g. {list(got - expected)[:2]}; "
        f"{len(expected - got)} only in the source, e.g. {list(expected - got)[:2]}"
    )
    version = f"id, {START_AT}" if history else "id"
    twice = spark.sql(f"SELECT {version} FROM {target} GROUP BY {version} HAVING count(*) > 1")
    assert not twice.collect(), f"held more than once: {twice.take(5)}"
    if history:  # the versions of a key follow each other, none left open but the current
        gaps = spark.sql(
            f"SELECT id FROM {target} GROUP BY id HAVING count(*) - count({END_AT}) > 1"
        )
        assert not gaps.collect(), f"keys with two open versions: {gaps.take(5)}"


async def test_postgres_to_kafka_to_delta_with_faults(
    pg_db: PgDatabase,
    kafka_cluster: KafkaBroker,
    spark: Any,
    tmp_path: Path,
    children: list[Daemon | SparkStream],
) -> None:
    """Three brokers, exactly-once cdcd, Spark's Kafka source with read_committed into Delta:
    kill -9 of cdcd, of a broker and of the Spark stream mid-batch; the Delta table equals the
    source."""
    name = f"e2ek{os.getpid()}"
    sink = {
        "type": "kafka",
        "bootstrap_servers": kafka_cluster.bootstrap,
        "exactly_once": True,
        "partitions": 3,
        "replication_factor": 3,
        "linger_ms": 5,
    }
    daemon = config(tmp_path / "cdcd", pg_db, sink, name)
    children.append(daemon)
    output, checkpoint = tmp_path / "delta", tmp_path / "checkpoint"
    args = ["--kafka-bootstrap", kafka_cluster.bootstrap, "--name", name, "--table", TABLE]
    args += ["--output", str(output), "--checkpoint", str(checkpoint), "--read-committed"]
    args += ["--master", "local[1]"]
    stream = SparkStream(args, tmp_path / "spark.log", checkpoint)
    children.append(stream)
    await faults(pg_db, daemon, stream, f"cdcd_{name}", kafka_cluster)
    query = stream_table(
        spark,
        TABLE,
        str(output),
        str(checkpoint),
        kafka_bootstrap=kafka_cluster.bootstrap,
        topic=f"{name}.{TABLE}",
        read_committed=True,
    )
    query.awaitTermination()
    assert query.exception() is None
    assert_equals_source(spark, table_ref(str(output)), pg_db)


async def test_postgres_to_s3_files_to_iceberg_with_faults(
    pg_db: PgDatabase,
    s3: S3Store,
    spark: Any,
    tmp_path: Path,
    children: list[Daemon | SparkStream],
) -> None:
    """The file sink's JSON Lines on S3 (moto) → Spark over ``s3a://`` → Iceberg, SCD type 2:
    kill -9 of cdcd and of the Spark stream mid-batch; the current versions equal the source,
    each version is there once."""
    from cdcd.spark.session import ICEBERG_CATALOG, s3_conf

    assert s3.endpoint and s3.access_key and s3.secret_key
    prefix = s3.new_prefix("e2e")
    sink = {
        "type": "file",
        "path": f"s3://{prefix}",
        "storage": s3.storage(),
        "format": "jsonl",
        "rollover_rows": 300,
        "flush_interval": 0.5,
    }
    name = f"e2es{os.getpid()}"
    daemon = config(tmp_path / "cdcd", pg_db, sink, name)
    children.append(daemon)
    settings = s3_conf(s3.endpoint, s3.access_key, s3.secret_key, s3.region)
    warehouse = spark.conf.get(f"spark.sql.catalog.{ICEBERG_CATALOG}.warehouse")
    target = f"{ICEBERG_CATALOG}.e2e.{name}"
    checkpoint = tmp_path / "checkpoint"
    args = ["--input", f"s3a://{prefix}", "--table", TABLE, "--output", target]
    args += ["--target-format", "iceberg", "--iceberg-warehouse", warehouse]
    args += ["--checkpoint", str(checkpoint), "--master", "local[1]"]
    args += ["--stored-as-scd-type", "2"]  # history: a replayed batch must not double a version
    submit = " ".join(f"--conf {k}={v}" for k, v in settings.items())
    spark.sql(f"CREATE NAMESPACE IF NOT EXISTS {ICEBERG_CATALOG}.e2e")
    stream = SparkStream(args, tmp_path / "spark.log", checkpoint, submit)
    children.append(stream)
    await faults(pg_db, daemon, stream, f"cdcd_{name}")
    for key, value in settings.items():  # the session's Hadoop settings, at run time
        spark.conf.set(key.removeprefix("spark.hadoop."), value)
    query = stream_table(
        spark,
        TABLE,
        target,
        str(checkpoint),
        path=f"s3a://{prefix}",
        target_format="iceberg",
        stored_as_scd_type=2,
    )
    query.awaitTermination()
    assert query.exception() is None
    assert_equals_source(spark, target, pg_db)
