"""bench/run.py's Debezium contenders: Debezium's PostgreSQL connector side by side with cdcd.

``debezium_null``   Debezium 3.6.1.Final's PostgreSQL connector (``plugin.name=pgoutput``) in
                    its asynchronous embedded engine (``ConvertingAsyncEngineBuilderFactory``),
                    records converted to JSON without schemas, counted and discarded
``debezium_kafka``  the same, each record produced with a ``KafkaProducer`` (``acks=all``,
                    ``enable.idempotence=true``, zstd like cdcd's sink) to the topic the
                    connector names, ``<prefix>.<schema>.<table>`` (cdcd's layout), on a fresh
                    broker like ``cdcd_kafka``'s

The Java main is bench/debezium/DebeziumBench.java, compiled with ``javac`` once (cached by
the digest of its source and the jar names) against the jars of
``scripts/maven/debezium/pom.xml`` that ``scripts/setup`` fetched. On the slot workloads it
streams the contender's slot (a copy made at the same LSN as every other contender's) with
``snapshot.mode=no_data``, offsets in memory, so it reads the same backlog; on S1 it takes its
initial snapshot (``snapshot.mode=initial`` on a slot of its own) of ``s1``. It stops once it has
handled the workload's row count (into Kafka: acknowledged).

Timing: ``seconds`` (and so rows/s) runs from the first record to the last one handled or
acknowledged: the JVM's start, the connector's start-up and, on S1, the snapshot's set-up are
left out, in Debezium's favour (cdcd's seconds are its whole process's). ``startup_seconds``
(JVM start to first record) and ``wall_seconds`` (spawn to exit) are reported apart.
``cpu_seconds`` is the whole JVM's (``wait4``, as for every contender), ``cpu_seconds_streaming``
the part after the first record. The JVM runs with ``JVM_OPTIONS`` (Kafka Connect's heap).
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlparse

import orjson

from cdcd.jars import jars

if TYPE_CHECKING:
    from bench.run import Result, Setup

DEBEZIUM_CONTENDERS = ("debezium_null", "debezium_kafka")
DEBEZIUM_VERSION = "3.6.1.Final"
SOURCE = Path(__file__).resolve().parent / "debezium" / "DebeziumBench.java"
SENTINEL = "public.bench_sentinel"  # bench/run.py's row past the end LSN: not counted
#: the heap Kafka Connect's start scripts give a worker (KAFKA_HEAP_OPTS of connect-*.sh); the
#: JVM's own default here would be a quarter of the RAM, which G1 fills before it collects
JVM_OPTIONS = ("-Xms256m", "-Xmx2g")


def java_home() -> Path:
    """A JDK (17 or later) with ``javac``: ``$JAVA_HOME``, else the one ``javac`` on PATH is in."""
    home = os.environ.get("JAVA_HOME")
    if home and (Path(home) / "bin" / "javac").exists():
        return Path(home)
    javac = shutil.which("javac")
    if javac is None:
        raise FileNotFoundError("no JDK: the Debezium contenders need javac (JAVA_HOME or PATH)")
    return Path(javac).resolve().parent.parent


def debezium_missing() -> str | None:
    """Why the Debezium contenders cannot run here (no JDK, no jars), or None."""
    try:
        java_home()
        jars("debezium")
    except FileNotFoundError as error:
        return str(error)
    return None


def classpath() -> str:
    return os.pathsep.join(str(jar) for jar in jars("debezium"))


@functools.cache
def compiled() -> Path:
    """The folder holding DebeziumBench.class, compiled once per source and jar set."""
    cp = classpath()
    digest = hashlib.sha256(SOURCE.read_bytes() + cp.encode()).hexdigest()[:16]
    out = Path(tempfile.gettempdir()) / f"cdcd-debezium-bench-{digest}"
    if not (out / "DebeziumBench.class").exists():
        building = Path(tempfile.mkdtemp(prefix="cdcd-debezium-bench-"))
        javac = java_home() / "bin" / "javac"
        cmd = [str(javac), "-nowarn", "--release", "17", "-d", str(building), "-cp", cp]
        subprocess.run([*cmd, str(SOURCE)], check=True)
        try:
            building.rename(out)
        except OSError:  # another bench compiled it meanwhile
            shutil.rmtree(building, ignore_errors=True)
    return out


def debezium_properties(
    setup: Setup, contender: str, slot: str, publication: str
) -> dict[str, str]:
    """The engine's, the connector's and DebeziumBench's properties for one run."""
    dsn = urlparse(setup.db.dsn)
    props = {
        "name": "bench",
        "connector.class": "io.debezium.connector.postgresql.PostgresConnector",
        "offset.storage": "org.apache.kafka.connect.storage.MemoryOffsetBackingStore",
        "offset.flush.interval.ms": "60000",
        "database.hostname": dsn.hostname or "127.0.0.1",
        "database.port": str(dsn.port or 5432),
        "database.user": unquote(dsn.username or ""),
        "database.password": unquote(dsn.password or ""),
        "database.dbname": unquote(dsn.path.lstrip("/")),
        "topic.prefix": f"dbz{os.getpid()}{setup.workload.name.lower()}",
        "plugin.name": "pgoutput",
        "slot.name": slot,
        "publication.name": publication,
        "publication.autocreate.mode": "disabled",  # bench/run.py made it
        # the slot workloads: the slot's backlog only; S1: the table, then stop
        "snapshot.mode": "initial" if setup.workload.snapshot else "no_data",
        # a delete is one record, as in cdcd's count (no tombstone after it)
        "tombstones.on.delete": "false",
        # numeric as text, as cdcd writes it (the default would be base64 of the unscaled bytes)
        "decimal.handling.mode": "string",
        "converter.schemas.enable": "false",
        "key.converter.schemas.enable": "false",
        "value.converter.schemas.enable": "false",
        "bench.rows": str(setup.expected_rows),
        "bench.sink": contender.removeprefix("debezium_"),
        "bench.sentinel": SENTINEL,
        "bench.timeout.seconds": "3600",
    }
    if setup.workload.snapshot:
        props["table.include.list"] = "public.s1"
    if contender == "debezium_kafka":
        props |= {
            "bench.kafka.bootstrap.servers": setup.kafka.bootstrap,
            "bench.kafka.acks": "all",
            "bench.kafka.enable.idempotence": "true",
            "bench.kafka.compression.type": "zstd",  # cdcd's sink's default
            "bench.kafka.client.id": "debezium-bench",
        }
    return props


def run_debezium(setup: Setup, slot: str, contender: str, publication: str) -> Result:
    """Run DebeziumBench on ``slot`` (S1: a slot it creates); its figures as a Result."""
    from bench.run import Result, _check, run_measured

    work = Path(tempfile.mkdtemp(prefix=f"{contender}-", dir=setup.work))
    try:
        props = work / "debezium.properties"
        text = "".join(
            f"{key}={_escape(value)}\n"
            for key, value in debezium_properties(setup, contender, slot, publication).items()
        )
        props.write_text(text)
        cmd = [
            str(java_home() / "bin" / "java"),
            *JVM_OPTIONS,
            "-Dorg.slf4j.simpleLogger.defaultLogLevel=warn",
            "-cp",
            f"{compiled()}{os.pathsep}{classpath()}",
            "DebeziumBench",
            str(props),
        ]
        m = run_measured(cmd, cwd=work)
        _check(m, contender)
        figures = orjson.loads(m.stdout.strip().splitlines()[-1])
        if figures["rows"] != setup.expected_rows:
            raise RuntimeError(f"{contender} handled {figures['rows']} of {setup.expected_rows}")
        extra: dict[str, Any] = {
            "wall_seconds": round(m.seconds, 3),
            "startup_seconds": figures["startup_seconds"],
            "cpu_seconds_streaming": round(m.cpu_seconds - figures["cpu_seconds_at_first"], 3),
            "json_bytes": figures["bytes"],
            "debezium_version": DEBEZIUM_VERSION,
        }
        return Result(contender, figures["rows"], replace(m, seconds=figures["seconds"]), extra)
    finally:
        if setup.workload.snapshot:  # its own slot, made by the connector
            setup.db.execute(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots "
                f"WHERE slot_name = '{slot}'"
            )
        shutil.rmtree(work, ignore_errors=True)


def _escape(value: str) -> str:
    """A value for a .properties file (backslashes and leading blanks kept as they are)."""
    return value.replace("\\", "\\\\").replace("\n", "\\n")


def add_debezium_ratios(rows: list[dict[str, Any]]) -> None:
    """On each cdcd row with a Debezium counterpart in the same run (the same sink: null or
    kafka; S1's cdcd_null_w* against debezium_null): ``ratio_vs_debezium``, rows/s over
    Debezium's, and ``cpu_ratio_vs_debezium``, Debezium's CPU per row over cdcd's."""
    debezium = {
        r["contender"].removeprefix("debezium_"): r
        for r in rows
        if r["contender"] in DEBEZIUM_CONTENDERS
    }
    for row in rows:
        name = row["contender"]
        if not name.startswith("cdcd_"):
            continue
        sink = name.removeprefix("cdcd_").split("_w")[0]
        other = debezium.get(sink)
        if other is None:
            continue
        row["ratio_vs_debezium"] = round(row["rows_per_s"] / other["rows_per_s"], 3)
        if row.get("cpu_us_per_row") and other.get("cpu_us_per_row"):
            row["cpu_ratio_vs_debezium"] = round(other["cpu_us_per_row"] / row["cpu_us_per_row"], 3)
