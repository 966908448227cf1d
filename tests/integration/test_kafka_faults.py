"""The Kafka sink against Apache Kafka's faults (tests/kafkaharness.py), each with nothing lost:
a broker of three killed mid-stream, all three down while the daemon streams, a partition
without a leader, a missing topic, a wrong
SASL password, a topic the principal may not write, and the daemon started with no broker.

The three-node cluster (replication factor 3, ``min.insync.replicas`` 2) is the session's
(shared with the end-to-end Spark tests); the broker with SASL/SCRAM and an authorizer is
started once for this module.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
import pytest

from cdcd.errors import DefiniteSinkError, SinkSetupError
from cdcd.lsn import parse_lsn
from tests.e2e import start_cdcd, write_config
from tests.integration.test_kafka_sink import (
    TxnBuilder,
    consume,
    make_sink,
    positions_by_key,
    run_txn,
    unique_name,
)
from tests.kafkaharness import KafkaBroker, free_port
from tests.pgharness import PgDatabase

pytestmark = [pytest.mark.kafka, pytest.mark.version_independent, pytest.mark.timeout(240)]

USER, PASSWORD = "cdcd", "cdcd-secret"


@pytest.fixture
def cluster(kafka_cluster: KafkaBroker) -> KafkaBroker:
    """The session's three-node cluster (tests/integration/conftest.py)."""
    return kafka_cluster


@pytest.fixture(scope="module")
async def secured() -> AsyncIterator[KafkaBroker]:
    """SCRAM user ``cdcd`` on SASL_PLAINTEXT and SASL_SSL listeners (a trustme CA); an
    authorizer, so ``cdcd`` may do only what a test grants it."""
    broker = await KafkaBroker.launch(
        scram_users={USER: PASSWORD}, tls=True, authorizer=True, external_ok=False
    )
    try:
        yield broker
    finally:
        await broker.close()


def positions(records: list) -> set[tuple[int, int]]:
    return {
        (
            orjson.loads(r.value or b"")["source"]["commit_lsn"],
            orjson.loads(r.value or b"")["source"]["seq"],
        )
        for r in records
        if r.value is not None
    }


async def log_says(proc: subprocess.Popen[bytes], log_path: Path, text: str) -> None:
    """Wait (60 s at most) until the daemon's log holds ``text``; it must keep running."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 60
    while text not in log_path.read_text(errors="replace"):
        assert proc.poll() is None, log_path.read_text()[-4000:]
        assert loop.time() < deadline, log_path.read_text()[-4000:]
        await asyncio.sleep(0.1)


async def terminated(proc: subprocess.Popen[bytes], log_path: Path) -> str:
    """Stop the daemon with SIGTERM; its log, once it exited 0 (killed if it does not stop)."""
    proc.send_signal(signal.SIGTERM)
    try:
        code = await asyncio.to_thread(proc.wait, 60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    output = log_path.read_text(errors="replace")
    assert code == 0, output[-4000:]
    return output


async def test_one_broker_of_three_killed_and_restarted_mid_stream(cluster: KafkaBroker) -> None:
    """Replication factor 3: a node dies while transactions are written (its partitions' leaders
    move), and comes back; every record is there, per key in commit order (a replayed suffix
    at most), and the last transaction durable."""
    name = unique_name()
    sink = make_sink(
        cluster, name, partitions=3, replication_factor=3, linger_ms=1, max_batch_size=2048
    )
    await sink.start()
    build = TxnBuilder()
    txns = [
        build.next([("u", "orders", {"id": (7 * t + i) % 9, "n": t}) for i in range(4)])
        for t in range(60)
    ]
    try:
        for t, (txn, events) in enumerate(txns):
            if t == 20:
                await cluster.kill(0)
            if t == 40:
                await cluster.revive(0)
            await run_txn(sink, txn, events)
            await asyncio.sleep(0.02)
        await asyncio.wait_for(sink.flush(), 120)
        assert sink.durable_lsn() == txns[-1][0].end_lsn
    finally:
        await sink.close()
    written = {e.position for _, events in txns for e in events}
    records = await consume(cluster.bootstrap, [f"{name}.public.orders"], len(written))
    assert positions(records) == written
    for key, seen in positions_by_key(records).items():
        first = sorted(set(seen))
        assert seen[: len(first)] == first, key


async def test_whole_cluster_down_while_the_daemon_streams(
    pg_db: PgDatabase, cluster: KafkaBroker, tmp_path: Path
) -> None:
    """All three nodes killed (SIGKILL) while ``cdcd run`` streams small transactions, started
    again seconds later. cdcd holds: the slot's confirmed LSN passes no transaction committed
    during the outage; once the cluster is back every change arrives, per key in commit order,
    and a SIGTERM confirms all of it. Duplicates: the idempotent producer retries its batches
    for ``request_timeout`` with the same producer id and sequence numbers, and the broker drops
    the repeats, so none unless aiokafka gave a batch up and cdcd replayed from a new producer
    (``kafka_delivery_failed_replaying``); then only exact repeats of a position."""
    pg_db.execute("CREATE TABLE t (id int PRIMARY KEY, n int NOT NULL)")
    name = unique_name()
    sink = {
        "type": "kafka",
        "bootstrap_servers": cluster.bootstrap,
        "partitions": 3,
        "replication_factor": 3,
        "linger_ms": 1,
        "retry_backoff": "200ms",
        "request_timeout": "60s",  # longer than the outage: the same producer retries
    }
    cfg = write_config(tmp_path, pg_db.dsn, sinks=[sink], name=name)
    log_path = tmp_path / "cdcd.log"
    topic = f"{name}.public.t"
    before, during = 20, 30

    def upsert(n: int) -> None:  # one transaction; keys repeat, so per-key order shows
        pg_db.execute(f"INSERT INTO t VALUES ({n % 7}, {n}) ON CONFLICT (id) DO UPDATE SET n = {n}")

    def confirmed() -> int:
        lsn = pg_db.fetchval(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots "
            "WHERE slot_name = 'cdcd_e2e'"
        )
        return 0 if lsn is None else parse_lsn(lsn)

    proc = start_cdcd("run", "--config", str(cfg), log_path=log_path)
    try:
        await log_says(proc, log_path, '"event":"streaming"')
        for n in range(before):
            upsert(n)
        assert len(await consume(cluster.bootstrap, [topic], before, 60)) == before
        for index in range(len(cluster.nodes)):
            await cluster.kill(index)
        held = confirmed()
        for n in range(before, before + during):  # about 6 s of writes with no broker
            upsert(n)
            held = max(held, confirmed())
            await asyncio.sleep(0.2)
        assert proc.poll() is None, log_path.read_text()[-4000:]
        await cluster.heal()
        records = await consume(cluster.bootstrap, [topic], before + during, 120)
        arrived = {orjson.loads(r.value or b"")["after"]["n"] for r in records}
        if len(arrived) < before + during:  # duplicates took places: read on
            more = len(records) + before + during - len(arrived)
            records = await consume(cluster.bootstrap, [topic], more, 20)
        output = await terminated(proc, log_path)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        await cluster.heal()
    values = [orjson.loads(r.value or b"") for r in records]
    seen = {(v["source"]["commit_lsn"], v["source"]["seq"]): v["after"]["n"] for v in values}
    assert sorted(seen.values()) == list(range(before + during)), "every change arrived"
    outage = [pos for pos, n in seen.items() if n >= before]
    assert held <= min(outage)[0], f"confirmed {held:X} during the outage, past a change not held"
    assert confirmed() > max(seen)[0], "the SIGTERM confirmed all that Kafka holds"
    for key, order in positions_by_key(records).items():
        first = sorted(set(order))
        assert order[: len(first)] == first, key
    duplicates = len(records) - len(seen)
    if "kafka_delivery_failed_replaying" not in output:
        assert duplicates == 0, "the idempotent producer's retries left duplicates"
    unique = {(r.partition, r.offset) for r in records}
    assert len(unique) == len(records)
    by_position: dict[tuple[int, int], dict[str, object]] = {}
    for v in values:
        again = by_position.setdefault((v["source"]["commit_lsn"], v["source"]["seq"]), v)
        assert {**again, "ts_ms": 0} == {**v, "ts_ms": 0}, "a duplicate is an exact repeat"
    print(f"cluster outage: {during} transactions during it, {duplicates} duplicate records")


async def test_a_partition_without_leader_is_replayed_by_a_new_producer(
    cluster: KafkaBroker,
) -> None:
    """A topic of replication factor 1 loses the leader of its partition for longer than the
    request timeout: aiokafka fails the waiting batch (its sequence number gone with it), the
    sink resends from a new idempotent producer, and once the node is back all is there."""
    name = unique_name()
    sink = make_sink(
        cluster, name, replication_factor=1, request_timeout="2s", retry_backoff="200ms"
    )
    await sink.start()
    build = TxnBuilder()
    try:
        t1, e1 = build.next([("c", "orders", {"id": 1})])
        await run_txn(sink, t1, e1)
        await sink.flush()
        leader = await leader_of(cluster, f"{name}.public.orders")
        await cluster.kill(leader)
        later = [build.next([("c", "orders", {"id": 10 + i})]) for i in range(3)]
        for txn, events in later:
            await run_txn(sink, txn, events)
        flushing = asyncio.create_task(sink.flush())
        for _ in range(300):
            if sink.stats()["replays"]:
                break
            await asyncio.sleep(0.05)
        assert sink.stats()["replays"] >= 1
        assert sink.durable_lsn() == t1.end_lsn
        await cluster.revive(leader)
        await asyncio.wait_for(flushing, 120)
        assert sink.durable_lsn() == later[-1][0].end_lsn
    finally:
        await sink.close()
        await cluster.heal()
    expected = {e.position for _, events in [(t1, e1), *later] for e in events}
    records = await consume(cluster.bootstrap, [f"{name}.public.orders"], len(expected))
    assert positions(records) == expected


async def leader_of(cluster: KafkaBroker, topic: str) -> int:
    """The index (in ``cluster.nodes``) of the leader of ``topic``'s partition 0."""
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=cluster.bootstrap)
    await admin.start()
    try:
        (info,) = await admin.describe_topics([topic])
    finally:
        await admin.close()
    (partition,) = [p for p in info["partitions"] if p["partition"] == 0]
    return [n.node_id for n in cluster.nodes].index(partition["leader"])


async def test_missing_topic_without_create_topics_names_it(kafka_broker: KafkaBroker) -> None:
    """``create_topics: false`` and a topic that does not exist (the broker does not create
    topics either): a definite error naming the topic, nothing durable."""
    name = unique_name()
    sink = make_sink(kafka_broker, name, create_topics=False)
    await sink.start()
    try:
        txn, events = TxnBuilder().next([("c", "orders", {"id": 1})])
        await sink.begin(txn)
        with pytest.raises(DefiniteSinkError, match=f"{name}.public.orders") as info:
            await sink.write(events)
        assert "create_topics" in str(info.value)
        assert sink.durable_lsn() == 0
    finally:
        await sink.close()


async def test_wrong_sasl_password_is_a_definite_error(secured: KafkaBroker) -> None:
    """A wrong password is not retried for ever: SinkSetupError (exit 3) naming the user."""
    sink = make_sink(
        secured,
        unique_name(),
        bootstrap_servers=secured.sasl_bootstrap,
        security_protocol="SASL_PLAINTEXT",
        sasl_mechanism="SCRAM-SHA-256",
        sasl_username=USER,
        sasl_password="not-the-password",
        retry_backoff="200ms",
        give_up_after="20s",
    )
    try:
        with pytest.raises(SinkSetupError, match="sasl_password") as info:
            await sink.start()
        assert info.value.exit_code == 3 and repr(USER) in str(info.value)
    finally:
        await sink.close()


async def test_topic_acl_denial_is_a_definite_error(secured: KafkaBroker) -> None:
    """SCRAM authentication works; the principal may write topics ``<name>.allowed*`` only
    (and the cluster's idempotent writes): records for another topic fail with
    SinkSetupError (exit 3) naming the topic and what to grant, nothing durable; the allowed
    topic gets its records."""
    name = unique_name()
    await secured.grant(USER, "IDEMPOTENT_WRITE")
    for operation in ("CREATE", "WRITE", "DESCRIBE", "READ"):
        await secured.grant(USER, operation, topic=f"{name}.public.allowed", prefix=True)
    options = dict(
        bootstrap_servers=secured.sasl_bootstrap,
        security_protocol="SASL_PLAINTEXT",
        sasl_mechanism="SCRAM-SHA-512",
        sasl_username=USER,
        sasl_password=PASSWORD,
    )
    sink = make_sink(secured, name, **options)
    await sink.start()
    build = TxnBuilder()
    try:
        t1, e1 = build.next([("c", "allowed", {"id": 1})])
        await run_txn(sink, t1, e1)
        await sink.flush()
        assert sink.durable_lsn() == t1.end_lsn
        t2, e2 = build.next([("c", "denied", {"id": 2})])
        await sink.begin(t2)
        with pytest.raises(SinkSetupError, match=f"{name}.public.denied") as info:
            await sink.write(e2)
            await sink.commit(t2)
            await sink.flush()
        assert info.value.exit_code == 3 and "grant" in str(info.value)
        assert sink.durable_lsn() == t1.end_lsn
    finally:
        await sink.close()
    records = await consume(secured.bootstrap, [f"{name}.public.allowed"], 1)
    assert [r.key for r in records] == [b'{"id":1}']


async def test_daemon_waits_for_an_unreachable_broker_and_stops_on_sigterm(
    pg_db: PgDatabase, tmp_path: Path
) -> None:
    """No broker at start-up (and no ``give_up_after``): cdcd says in its log that it waits
    for the broker, confirms nothing, and a SIGTERM stops it with exit 0."""
    pg_db.execute("CREATE TABLE t (id int PRIMARY KEY)")
    bootstrap = f"127.0.0.1:{free_port()}"
    sink = {"type": "kafka", "bootstrap_servers": bootstrap, "retry_backoff": "200ms"}
    cfg = write_config(tmp_path, pg_db.dsn, sinks=[sink], name=unique_name())
    log_path = tmp_path / "cdcd.log"
    proc = start_cdcd("run", "--config", str(cfg), log_path=log_path)
    try:
        await log_says(proc, log_path, "kafka_unreachable")
        assert bootstrap in log_path.read_text()
        output = await terminated(proc, log_path)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "Traceback" not in output, output[-4000:]


async def test_scram_over_tls(secured: KafkaBroker) -> None:
    """SASL_SSL: TLS checked against ``ssl_cafile``, SCRAM-SHA-512 login; records arrive."""
    name = unique_name()
    await secured.grant(USER, "IDEMPOTENT_WRITE")
    for operation in ("CREATE", "WRITE", "DESCRIBE"):
        await secured.grant(USER, operation, topic=f"{name}.", prefix=True)
    sink = make_sink(
        secured,
        name,
        bootstrap_servers=secured.sasl_ssl_bootstrap,
        security_protocol="SASL_SSL",
        sasl_mechanism="SCRAM-SHA-512",
        sasl_username=USER,
        sasl_password=PASSWORD,
        ssl_cafile=str(secured.ca_file),
    )
    await sink.start()
    try:
        txn, events = TxnBuilder().next([("c", "orders", {"id": 1}), ("c", "orders", {"id": 2})])
        await run_txn(sink, txn, events)
        await sink.flush()
        assert sink.durable_lsn() == txn.end_lsn
    finally:
        await sink.close()
    records = await consume(secured.bootstrap, [f"{name}.public.orders"], 2)
    assert sorted(r.key for r in records) == [b'{"id":1}', b'{"id":2}']
