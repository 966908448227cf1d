"""Crash safety with the Kafka sink: the real ``cdcd`` daemon, a real PostgreSQL, a real
Apache Kafka broker (behind a proxy, :mod:`tests.kafkaharness`), a random workload
(:class:`tests.integration.test_crash_safety.Workload`, which counts what it commits), and real
faults:

* the broker goes away for 15 s (three request timeouts; ``CDCD_TEST_ALL_VERSIONS=1``: 30 s)
  in the middle of the workload: cdcd holds (a bounded window, nothing confirmed that the
  broker does not hold) and resumes when it is back;
* ``kill -9`` of the daemon at random moments, 8 times (``CDCD_TEST_ALL_VERSIONS=1``: 22), with
  Kafka and JSON Lines files as sinks at once; with ``exactly_once``, 4 times (8).

Then, after a final ``cdcd run --endpos``, exact checks (docs/kafka.md, docs/progress.md): every committed event
is in Kafka (counts per table and op equal what the workload committed; the tables rebuilt
from Kafka equal the source); a duplicate always carries the position ``(commit_lsn, seq)`` of
an identical event (only the processing time ``ts_ms`` may differ); a tombstone follows every
delete; the files hold every event exactly once.

The newest installed PostgreSQL only (``slow``; ``CDCD_TEST_ALL_VERSIONS=1``: every version);
``CDCD_CRASH_SEED`` fixes the seed.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from aiokafka import AIOKafkaConsumer, TopicPartition

from cdcd.lsn import parse_lsn
from tests.e2e import (
    KafkaRecord,
    consume_prefix,
    position,
    rebuild,
    run_cdcd,
    thorough,
    write_config,
)
from tests.integration.test_crash_safety import (
    SEED,
    SLOT,
    TABLES,
    Daemon,
    Workload,
    assert_exactly_once,
    finish_to_endpos,
    prepare_database,
    source_rows,
    truth,
)
from tests.kafkaharness import KafkaBroker
from tests.pgharness import PgDatabase

pytestmark = [pytest.mark.pg, pytest.mark.kafka, pytest.mark.slow, pytest.mark.timeout(400)]

OUTAGE_SECONDS = 30 if thorough() else 15  # request_timeout is 5 s
KILLS = 22 if thorough() else 8
EOS_KILLS = 8 if thorough() else 4


@pytest.fixture
def daemons() -> Iterator[Callable[[Path, Path], Daemon]]:
    made: list[Daemon] = []

    def make(cfg: Path, log_path: Path) -> Daemon:
        made.append(Daemon(cfg, log_path))
        return made[-1]

    yield make
    for daemon in made:
        daemon.stop_quietly()


def make_config(
    directory: Path, db: PgDatabase, broker: KafkaBroker, name: str, *, files: bool, **kafka: Any
) -> Path:
    """Kafka (and, with ``files``, a JSON Lines file sink that publishes and flushes often);
    the slot is created."""
    sinks: list[dict[str, Any]] = [
        {
            "type": "kafka",
            "bootstrap_servers": broker.bootstrap,
            **kafka,
        }
    ]
    if files:
        sinks.append({"type": "file", "path": "out", "flush_interval": 0.2, "rollover_rows": 200})
    path = write_config(
        directory,
        db.dsn,
        sinks=sinks,
        name=name,
        two_phase=True,
        reconnect_min_backoff=0.2,
        reconnect_max_backoff=1.0,
    )
    cfg = yaml.safe_load(path.read_text())
    cfg["shutdown"] = {"grace_period": 20}
    cfg["log"] = {"format": "json", "level": "debug"}  # confirmations, prepared transactions
    path.write_text(yaml.safe_dump(cfg))
    run_cdcd("slot", "create", "--config", str(path))
    return path


def confirmed_flush(db: PgDatabase) -> int:
    return parse_lsn(
        db.fetchval(
            f"SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = '{SLOT}'"
        )
    )


def topic_folder(name: str, topic: str) -> str:
    rest = topic[len(name) + 1 :]
    return "_messages" if rest == "message" else rest


def without_ts(event: dict[str, Any]) -> dict[str, Any]:
    """An event without its processing time (a resent event is encoded again after a crash)."""
    return {k: v for k, v in event.items() if k != "ts_ms"}


def check_kafka(
    db: PgDatabase, name: str, records: dict[str, list[KafkaRecord]], workload: Workload
) -> int:
    """Every committed event in Kafka, duplicates only as identical events at the same position,
    a tombstone after each keyed delete, tables rebuilt from Kafka equal the source. Returns the
    number of duplicate records."""
    events: dict[tuple[int, int], dict[str, Any]] = {}
    tombstones: set[tuple[str, tuple[int, int]]] = set()
    topic_of: dict[tuple[int, int], str] = {}
    duplicates = 0
    for topic, recs in records.items():
        for record in recs:
            if record.is_tombstone:
                tombstones.add((topic, record.position))
                continue
            event = record.event()
            pos = position(event)
            assert pos == record.position, f"{record}: headers do not match the value"
            first = events.setdefault(pos, event)
            if first is not event:
                duplicates += 1
                assert without_ts(first) == without_ts(event), f"{record}: a different event"
            topic_of[pos] = topic
    counts = Counter((topic_folder(name, topic_of[p]), e["op"]) for p, e in events.items())
    expected = {k: v for k, v in workload.committed.items() if v}
    have = Counter(e["source"]["txId"] for e in events.values() if e["source"]["txId"])
    missing = {x: (f"{end:X}", n, have[x]) for x, (end, n) in truth(db).items() if have[x] != n}
    assert dict(counts) == expected, f"events per table and op in Kafka; differ: {missing}"
    deletes = {(topic_of[p], p) for p, e in events.items() if e["op"] == "d"}
    assert deletes == tombstones, "a tombstone for each delete, and none otherwise"
    for table, key in TABLES.items():
        table_events = [e for p, e in events.items() if topic_of[p] == f"{name}.public.{table}"]
        assert rebuild(table_events, key) == source_rows(db, table), f"{table} from Kafka"
    return duplicates


async def read_kafka(
    broker: KafkaBroker, name: str, workload: Workload, isolation_level: str = "read_uncommitted"
) -> dict[str, list[Any]]:
    deletes = sum(n for (_, op), n in workload.committed.items() if op == "d")
    return await consume_prefix(
        broker.bootstrap, name, workload.total + deletes, 120, isolation_level
    )


async def high_watermarks(broker: KafkaBroker, topics: list[str]) -> dict[str, int]:
    """The high watermark of each topic's partition 0, asked on the brokers' internal
    listeners (so also while clients are kept out by :meth:`KafkaBroker.stop`)."""
    consumer = AIOKafkaConsumer(bootstrap_servers=broker.direct_bootstrap)
    await consumer.start()
    try:
        ends = await consumer.end_offsets([TopicPartition(topic, 0) for topic in topics])
    finally:
        await consumer.stop()
    return {tp.topic: offset for tp, offset in ends.items()}


async def wait_until(condition: Callable[[], bool], what: str, timeout: float = 60) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not condition():
        assert loop.time() < deadline, f"timed out after {timeout} s waiting for {what}"
        await asyncio.sleep(0.05)


def finish(db: PgDatabase, cfg: Path, log: Path) -> None:
    """``cdcd run --endpos`` the WAL insert position, its output appended to ``log``."""
    endpos = db.fetchval("SELECT pg_current_wal_insert_lsn()::text")
    proc = run_cdcd("run", "--config", str(cfg), "--endpos", endpos, timeout=180, check=False)
    with log.open("a") as out:
        out.write(proc.stdout + proc.stderr)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-6000:]


# --------------------------------------------------------------------------- the tests


async def test_broker_outage_holds_then_everything_arrives(
    pg_db: PgDatabase,
    restartable_kafka_broker: KafkaBroker,
    tmp_path: Path,
    daemons: Callable[[Path, Path], Daemon],
) -> None:
    broker = restartable_kafka_broker
    prepare_database(pg_db)
    name = "outage" + uuid.uuid4().hex[:6]
    # request_timeout below the outage: the idempotent producer retries its batches past it; a
    # small window: the pipeline blocks instead of buffering the whole outage
    cfg = make_config(
        tmp_path, pg_db, broker, name, files=False, request_timeout="5s", buffer_records=1000
    )
    topics = [f"{name}.public.{t}" for t in TABLES] + [f"{name}.message"]
    workload = Workload(pg_db.cluster, pg_db.name, SEED + 10)
    daemon = daemons(cfg, tmp_path / "cdcd.log")
    start = confirmed_flush(pg_db)
    daemon.start()
    workload.start()
    try:
        # a transaction with changes confirmed (not only a keepalive's position): the checks
        # below need one the broker held before the outage
        await wait_until(
            lambda: any(
                n and start < end <= confirmed_flush(pg_db) for end, n in truth(pg_db).values()
            ),
            "a first transaction confirmed",
        )
        await broker.stop()
        await asyncio.sleep(OUTAGE_SECONDS)
        daemon.assert_running()
        confirmed = confirmed_flush(pg_db)  # while the broker is still away
        held = await high_watermarks(broker, topics)  # what the broker holds now
        wal_during_outage = parse_lsn(pg_db.fetchval("SELECT pg_current_wal_insert_lsn()::text"))
        await broker.start()
        # resumed: the broker receives records again (the confirmed LSN may stay behind an
        # unresolved prepared transaction for long, so it is no sign)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 90
        while sum((await high_watermarks(broker, topics)).values()) <= sum(held.values()):
            assert loop.time() < deadline, "cdcd did not resume sending after the outage"
            daemon.assert_running()
            await asyncio.sleep(0.5)
        daemon.assert_running()
    finally:
        await asyncio.to_thread(workload.finish)
    assert daemon.terminate() == 0, daemon.log()[-8000:]
    await asyncio.to_thread(finish_to_endpos, pg_db, cfg)

    records = await read_kafka(broker, name, workload)
    duplicates = check_kafka(pg_db, name, records, workload)
    # Confirmed means held by the broker: every transaction ending at or before what the slot
    # confirmed during the outage was, complete, below the broker's high watermarks then.
    before_marks = Counter(
        r.value["source"]["txId"]
        for topic, recs in records.items()
        for r in recs
        if r.value is not None and r.offset < held[topic] and r.value["source"]["txId"]
    )
    unique_before = {
        (r.value["source"]["txId"], r.position)
        for topic, recs in records.items()
        for r in recs
        if r.value is not None and r.offset < held[topic] and r.value["source"]["txId"]
    }
    per_xid = Counter(xid for xid, _ in unique_before)
    ends = truth(pg_db)
    covered = [xid for xid, (end, n) in ends.items() if end <= confirmed and n]
    for xid in covered:
        end, n = ends[xid]
        assert per_xid[xid] == n, (
            f"confirmed {confirmed:X} during the outage covers transaction {xid} (ends {end:X}, "
            f"{n} changes) but the broker held {per_xid[xid]} of its events"
        )
    assert covered and before_marks
    # cdcd held: transactions committed during the outage were not confirmed before it ended
    assert any(confirmed < end <= wal_during_outage for end, _ in ends.values()), (
        "no transaction committed during the outage: the test proves nothing"
    )
    log = daemon.log()
    assert "kafka_waiting_for_broker" in log, log[-4000:]
    print(f"outage: {workload.transactions} transactions, {duplicates} duplicate records")


async def test_sigkill_loop_kafka_and_files(
    pg_db: PgDatabase,
    kafka_broker: KafkaBroker,
    tmp_path: Path,
    daemons: Callable[[Path, Path], Daemon],
) -> None:
    prepare_database(pg_db)
    name = "kill" + uuid.uuid4().hex[:6]
    cfg = make_config(tmp_path, pg_db, kafka_broker, name, files=True)
    rng = random.Random(SEED + 11)
    workload = Workload(pg_db.cluster, pg_db.name, SEED + 11)
    daemon = daemons(cfg, tmp_path / "cdcd.log")
    workload.start()
    try:
        for _ in range(KILLS):
            daemon.start()
            # kill at a random moment of streaming (not while the interpreter starts)
            await wait_until(
                lambda: daemon.log().count('"event":"streaming"') >= daemon.starts, "cdcd to stream"
            )
            await asyncio.sleep(rng.uniform(0.0, 1.2))
            daemon.assert_running()
            daemon.kill()
    finally:
        await asyncio.to_thread(workload.finish)
    await asyncio.to_thread(finish, pg_db, cfg, tmp_path / "cdcd.log")
    assert workload.transactions > 50 and workload.committed[("public.item", "c")] > 0

    records = await read_kafka(kafka_broker, name, workload)
    duplicates = check_kafka(pg_db, name, records, workload)
    assert_exactly_once(pg_db, tmp_path / "out", workload)
    print(f"kill loop: {workload.transactions} transactions, {duplicates} duplicate records")


async def test_sigkill_loop_exactly_once(
    pg_db: PgDatabase,
    kafka_broker: KafkaBroker,
    tmp_path: Path,
    daemons: Callable[[Path, Path], Daemon],
) -> None:
    """``exactly_once: true``: kill -9 at random moments; a read_committed consumer then sees
    every committed event once (no duplicate at all), the tables rebuilt from Kafka equal the
    source."""
    prepare_database(pg_db)
    name = "eos" + uuid.uuid4().hex[:6]
    cfg = make_config(tmp_path, pg_db, kafka_broker, name, files=False, exactly_once=True)
    rng = random.Random(SEED + 12)
    workload = Workload(pg_db.cluster, pg_db.name, SEED + 12)
    daemon = daemons(cfg, tmp_path / "cdcd.log")
    workload.start()
    try:
        for _ in range(EOS_KILLS):
            daemon.start()
            await wait_until(
                lambda: daemon.log().count('"event":"streaming"') >= daemon.starts, "cdcd to stream"
            )
            await asyncio.sleep(rng.uniform(0.3, 2.5))
            daemon.assert_running()
            daemon.kill()
    finally:
        await asyncio.to_thread(workload.finish)
    await asyncio.to_thread(finish, pg_db, cfg, tmp_path / "cdcd.log")
    assert workload.transactions > 20

    records = await read_kafka(kafka_broker, name, workload, "read_committed")
    duplicates = check_kafka(pg_db, name, records, workload)
    assert duplicates == 0, f"{duplicates} duplicate records for a read_committed consumer"
    log = (tmp_path / "cdcd.log").read_text()
    assert log.count('"event":"kafka_exactly_once"') >= EOS_KILLS, "every start resumed"
    print(f"exactly-once kill loop: {workload.transactions} transactions")


async def test_second_daemon_fences_the_first(
    pg_db: PgDatabase,
    kafka_broker: KafkaBroker,
    tmp_path: Path,
    daemons: Callable[[Path, Path], Daemon],
) -> None:
    """``exactly_once: true``, two daemons on one config (so one slot and one transactional
    id): the newer one's producer fences the older, which exits 3 saying so at its next write;
    the newer one takes the slot over, and a read_committed consumer sees every change once."""
    prepare_database(pg_db)
    name = "fence" + uuid.uuid4().hex[:6]
    cfg = make_config(tmp_path, pg_db, kafka_broker, name, files=False, exactly_once=True)
    workload = Workload(pg_db.cluster, pg_db.name, SEED + 13)
    older = daemons(cfg, tmp_path / "older.log")
    newer = daemons(cfg, tmp_path / "newer.log")
    older.start()
    workload.start()
    try:
        await wait_until(lambda: '"event":"streaming"' in older.log(), "the first to stream")
        newer.start()
        assert older.proc is not None
        await wait_until(lambda: older.proc.poll() is not None, "the first to stop", 120)
        # cdcd's own errors: aiokafka's noise about fenced futures would fill a log tail
        errors = [line for line in older.log().splitlines() if '"logger":"cdcd.' in line]
        assert older.proc.returncode == 3, "\n".join(errors[-20:])[-6000:]
        assert "fenced" in older.log(), older.log()[-4000:]
        await wait_until(lambda: '"event":"streaming"' in newer.log(), "the second to stream")
        await asyncio.sleep(1)
        newer.assert_running()
    finally:
        await asyncio.to_thread(workload.finish)
    assert newer.terminate() == 0, newer.log()[-8000:]
    await asyncio.to_thread(finish, pg_db, cfg, tmp_path / "newer.log")
    records = await read_kafka(kafka_broker, name, workload, "read_committed")
    assert check_kafka(pg_db, name, records, workload) == 0
