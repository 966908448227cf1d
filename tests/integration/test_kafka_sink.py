"""KafkaSink against Apache Kafka (tests/kafkaharness.py, or $CDCD_TEST_KAFKA_BOOTSTRAP), with the
sink's defaults (idempotent producer, ``acks: all``) unless a test says otherwise.

Records are read back with an independent AIOKafkaConsumer from the beginning of each topic.
"""

from __future__ import annotations

import asyncio
import itertools
import uuid
from collections.abc import Container, Iterable
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord

from cdcd.assembler.transaction import ChangeRecord, Transaction
from cdcd.decoder.events import Column, Delete, Insert, Message, Relation, TupleData, Update
from cdcd.errors import DefiniteSinkError
from cdcd.events import ChangeEvent
from cdcd.events.catalog import StaticCatalog
from cdcd.events.encoder import Encoder
from cdcd.sinks.base import SinkContext
from cdcd.sinks.kafka.sink import KafkaSink, KafkaSinkConfig
from cdcd.sinks.registry import load_sink_class
from tests.kafkaharness import KafkaBroker

pytestmark = pytest.mark.kafka


class TxnBuilder:
    """Builds consecutive transactions with increasing LSNs, and their real change events (the
    encoder's, as the pipeline hands them to the sink). A change is ``(op, table, row)``: ``c``
    insert, ``u`` update, ``d`` delete (the old key sent), ``m`` a logical message whose row
    holds its ``prefix``. Every column is text but ``id`` and ``n`` (bigint); ``id`` is the key,
    except for the changes whose index is in ``keyless`` (a table without one)."""

    def __init__(self) -> None:
        self.lsn = 0x1000
        self.xid = 700
        self.encoder = Encoder(context("builder"), StaticCatalog())
        self.relations: dict[tuple[str, tuple[str, ...], bool], Relation] = {}

    def relation(self, table: str, names: tuple[str, ...], keyed: bool) -> Relation:
        found = self.relations.get((table, names, keyed))
        if found is None:
            columns = tuple(
                Column(int(keyed and name == "id"), name, 20 if name in ("id", "n") else 25, -1)
                for name in names
            )
            oid = 16384 + len(self.relations)
            found = Relation(None, oid, "public", table, "d" if keyed else "n", columns)
            self.relations[(table, names, keyed)] = found
        return found

    def next(
        self,
        changes: list[tuple[str, str, dict[str, Any]]],
        *,
        big: int = 0,
        keyless: Container[int] = (),
    ) -> tuple[Transaction, list[ChangeEvent]]:
        self.xid += 1
        start = self.lsn
        commit_lsn = start + 16 * (len(changes) + 1)
        end_lsn = commit_lsn + 8
        self.lsn = end_lsn + 8
        records = []
        for seq, (op, table, row) in enumerate(changes):
            lsn = start + 16 * seq
            if op == "m":
                message = Message(self.xid, True, lsn, row["prefix"], b"hi")
                records.append(ChangeRecord(lsn, message, ()))
                continue
            if big:
                row = {**row, "blob": "x" * big}
            rel = self.relation(table, tuple(row), seq not in keyless)
            new = tuple_of(row.values())
            change: Insert | Update | Delete
            if op == "c":
                change = Insert(None, rel.oid, new)
            elif op == "u":
                change = Update(None, rel.oid, None, None, new)
            else:  # the old key, the other columns null (pgoutput's K image)
                old = tuple_of(v if name == "id" else None for name, v in row.items())
                change = Delete(None, rel.oid, "K", old)
            records.append(ChangeRecord(lsn, change, (rel,)))
        txn = Transaction("regular", self.xid, commit_lsn, end_lsn, 0, len(records))
        txn._records = records
        return txn, list(self.encoder.events(txn))


def tuple_of(values: Iterable[Any]) -> TupleData:
    """A row as pgoutput sends it: each value as text, None as null."""
    texts = [None if v is None else str(v).encode() for v in values]
    return TupleData(bytes(b"n"[0] if t is None else b"t"[0] for t in texts), tuple(texts))


def context(name: str) -> SinkContext:
    return SinkContext(name=name, database="shop", config_dir=Path("."))


def make_sink(broker: KafkaBroker, name: str, **options: Any) -> KafkaSink:
    options.setdefault("bootstrap_servers", broker.bootstrap)
    config = KafkaSinkConfig(**options)
    return KafkaSink(config, context(name))


async def run_txn(sink: KafkaSink, txn: Transaction, events: list[ChangeEvent]) -> None:
    await sink.begin(txn)
    await sink.write(events)
    await sink.commit(txn)


def position_of(record: ConsumerRecord[bytes, bytes]) -> tuple[int, int]:
    """The ``(commit_lsn, seq)`` of an event record."""
    source = orjson.loads(record.value or b"")["source"]
    return source["commit_lsn"], source["seq"]


async def consume(
    bootstrap: str,
    topics: list[str],
    count: int,
    timeout: float = 30.0,
    distinct: bool = False,
) -> list[ConsumerRecord[bytes, bytes]]:
    """Read ``count`` records from the beginning of ``topics`` (fewer if the timeout passes);
    ``distinct``: until ``count`` distinct positions (an at-least-once producer may have
    written a record twice, which would otherwise end the read before another partition's)."""
    consumer = AIOKafkaConsumer(
        *topics, bootstrap_servers=bootstrap, auto_offset_reset="earliest", enable_auto_commit=False
    )
    await consumer.start()
    records: list[ConsumerRecord[bytes, bytes]] = []

    def got() -> int:
        return len({position_of(r) for r in records}) if distinct else len(records)

    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while got() < count and loop.time() < deadline:
            batch = await consumer.getmany(timeout_ms=500)
            for recs in batch.values():
                records.extend(recs)
    finally:
        await consumer.stop()
    return records


def unique_name() -> str:
    return "t" + uuid.uuid4().hex[:8]


def test_registry_finds_kafka_sink() -> None:
    assert load_sink_class("kafka") is KafkaSink


async def test_records_keys_values_tombstones_headers_markers(kafka_broker: KafkaBroker) -> None:
    name = unique_name()
    sink = make_sink(kafka_broker, name, transaction_topic=True)
    await sink.start()
    try:
        build = TxnBuilder()
        t1, e1 = build.next([("c", "orders", {"id": 1, "v": "a"}), ("c", "items", {"id": 9})])
        t2, e2 = build.next(
            [
                ("u", "orders", {"id": 1, "v": "b"}),
                ("m", "", {"prefix": "pfx"}),
                ("d", "orders", {"id": 1, "v": None}),
            ]
        )
        await run_txn(sink, t1, e1)
        await run_txn(sink, t2, e2)
        await sink.flush()
        assert sink.durable_lsn() == t2.end_lsn
    finally:
        await sink.close()

    orders = await consume(kafka_broker.bootstrap, [f"{name}.public.orders"], 4)
    assert [r.value and orjson.loads(r.value)["op"] for r in orders] == ["c", "u", "d", None]
    assert {r.key for r in orders} == {b'{"id":1}'}
    tombstone = orders[3]
    assert tombstone.value is None
    assert dict(tombstone.headers) == dict(orders[2].headers)
    headers = dict(orders[1].headers)
    assert headers == {
        "cdcd.commit_lsn": str(t2.commit_lsn).encode(),
        "cdcd.seq": b"0",
        "cdcd.xid": str(t2.xid).encode(),
        "cdcd.op": b"u",
    }
    assert orjson.loads(orders[0].value or b"") == e1[0].value()

    items = await consume(kafka_broker.bootstrap, [f"{name}.public.items"], 1)
    assert [orjson.loads(r.value or b"")["after"] for r in items] == [{"id": 9}]

    messages = await consume(kafka_broker.bootstrap, [f"{name}.message"], 1)
    assert len(messages) == 1
    assert messages[0].key == b'{"prefix":"pfx"}'
    assert orjson.loads(messages[0].value or b"")["message"]["prefix"] == "pfx"

    markers = await consume(kafka_broker.bootstrap, [f"{name}.transaction"], 4)
    values = sorted(
        (orjson.loads(r.value or b"") for r in markers),
        key=lambda v: (v["id"], v["status"] != "BEGIN"),
    )
    assert [(v["status"], v["event_count"]) for v in values] == [
        ("BEGIN", None),
        ("END", 2),
        ("BEGIN", None),
        ("END", 2),
    ]
    assert values[1]["id"] == f"{t1.xid}:{t1.commit_lsn}"
    assert values[1]["data_collections"] == [
        {"data_collection": "public.orders", "event_count": 1},
        {"data_collection": "public.items", "event_count": 1},
    ]


async def test_no_tombstones_and_routing(kafka_broker: KafkaBroker) -> None:
    name = unique_name()
    routed = f"{name}-routed"
    sink = make_sink(
        kafka_broker, name, tombstones=False, routing={"public.orders": routed}, compression="gzip"
    )
    await sink.start()
    try:
        build = TxnBuilder()
        txn, events = build.next([("c", "orders", {"id": 1}), ("d", "orders", {"id": 1})])
        await run_txn(sink, txn, events)
        await sink.flush()
    finally:
        await sink.close()
    records = await consume(kafka_broker.bootstrap, [routed], 3, timeout=5)
    assert [orjson.loads(r.value or b"")["op"] for r in records] == ["c", "d"]


@pytest.mark.parametrize("runs", [False, True], ids=["one-by-one", "runs"])
async def test_per_key_order_across_partitions(kafka_broker: KafkaBroker, runs: bool) -> None:
    """``runs``: the transactions go in runs of 7 (``write_transactions``, docs/sinks.md)."""
    name = unique_name()
    sink = make_sink(kafka_broker, name, partitions=3, linger_ms=1, max_batch_size=4096)
    await sink.start()
    build = TxnBuilder()
    keys = 12
    written: dict[int, list[tuple[int, int]]] = {k: [] for k in range(keys)}
    run: list[tuple[Transaction, list[list[ChangeEvent]]]] = []
    try:
        counter = itertools.count()
        for _ in range(60):
            changes = [("u", "hot", {"id": (next(counter) * 7) % keys, "n": i}) for i in range(5)]
            txn, events = build.next(changes)
            for e in events:
                written[(e.key() or {})["id"]].append(e.position)
            if not runs:
                await run_txn(sink, txn, events)
                continue
            run.append((txn, [events]))
            if len(run) == 7:
                await sink.write_transactions(run)
                run = []
        if run:
            await sink.write_transactions(run)
        await sink.flush()
        assert sink.durable_lsn() == txn.end_lsn
    finally:
        await sink.close()
    records = await consume(kafka_broker.bootstrap, [f"{name}.public.hot"], 300)
    assert len(records) == 300
    assert len({r.partition for r in records}) > 1
    seen: dict[int, list[tuple[int, int]]] = {k: [] for k in range(keys)}
    partition_of: dict[int, int] = {}
    for r in sorted(records, key=lambda r: (r.partition, r.offset)):
        key = orjson.loads(r.key or b"")["id"]
        assert partition_of.setdefault(key, r.partition) == r.partition
        source = orjson.loads(r.value or b"")["source"]
        seen[key].append((source["commit_lsn"], source["seq"]))
    assert seen == written


async def test_oversized_record_is_definite_and_not_acknowledged(kafka_broker: KafkaBroker) -> None:
    name = unique_name()
    sink = make_sink(kafka_broker, name, max_request_size=4096)
    await sink.start()
    try:
        build = TxnBuilder()
        t1, e1 = build.next([("c", "orders", {"id": 1})])
        await run_txn(sink, t1, e1)
        t2, e2 = build.next([("c", "orders", {"id": 2}), ("c", "orders", {"id": 3})], big=10_000)
        await sink.begin(t2)
        with pytest.raises(DefiniteSinkError) as info:
            await sink.write(e2)
        message = str(info.value)
        assert f"{name}.public.orders" in message
        assert '{"id":2}' in message and "max_request_size" in message
        assert "seq 0" in message
        with pytest.raises(DefiniteSinkError):
            await sink.commit(t2)
        with pytest.raises(DefiniteSinkError):
            await sink.flush()
        assert sink.durable_lsn() == t1.end_lsn
    finally:
        await sink.close()


@pytest.mark.parametrize(
    ("request_timeout", "restart"),
    [("2s", False), ("30s", False), ("30s", True)],
    ids=["expiring-batches", "producer-retries", "broker-restart"],
)
async def test_broker_outage_blocks_then_resumes(
    restartable_kafka_broker: KafkaBroker, request_timeout: str, restart: bool
) -> None:
    """The broker goes away for 5 s while transactions are written, past a 2 s request
    timeout or within a 30 s one: the idempotent producer retries its batches (it never lets
    one expire while the partition has a leader) and nothing is durable meanwhile. With
    ``restart`` the broker's JVM is killed and started again on its log directories."""
    broker = restartable_kafka_broker
    name = unique_name()
    sink = make_sink(
        broker, name, request_timeout=request_timeout, retry_backoff="200ms", linger_ms=0
    )
    await sink.start()
    build = TxnBuilder()
    try:
        t1, e1 = build.next([("c", "orders", {"id": 1})])
        await run_txn(sink, t1, e1)
        await sink.flush()
        assert sink.durable_lsn() == t1.end_lsn

        await broker.stop()
        later = [
            build.next([("c", "orders", {"id": 10 + i}), ("u", "orders", {"id": 1, "n": i})])
            for i in range(5)
        ]

        async def write_all() -> None:
            for txn, events in later:
                await run_txn(sink, txn, events)
            await sink.flush()

        writer = asyncio.create_task(write_all())
        await asyncio.sleep(5)
        assert not writer.done()
        assert sink.durable_lsn() == t1.end_lsn
        await (broker.restart() if restart else broker.start())
        await asyncio.wait_for(writer, 60)
        assert sink.durable_lsn() == later[-1][0].end_lsn
    finally:
        await sink.close()

    expected = {e.position for _, events in later for e in events} | {e.position for e in e1}
    topic = f"{name}.public.orders"
    records = await consume(broker.bootstrap, [topic], len(expected), distinct=True)
    assert {position_of(r) for r in records} == expected
    updates = [
        orjson.loads(r.value or b"")["after"]["n"]
        for r in sorted(records, key=lambda r: (r.partition, r.offset))
        if r.key == b'{"id":1}' and r.value and orjson.loads(r.value)["op"] == "u"
    ]
    # per key: commit order, possibly followed by a replayed suffix in commit order
    assert updates[:5] == [0, 1, 2, 3, 4]
    assert updates[5:] == sorted(updates[5:]) and updates[-1] == 4


async def test_unreachable_at_start_gives_up(kafka_broker: KafkaBroker) -> None:
    from tests.kafkaharness import free_port

    config = KafkaSinkConfig(
        bootstrap_servers=f"127.0.0.1:{free_port()}",
        give_up_after="3s",
        retry_backoff="200ms",
        request_timeout="1s",
    )
    sink = KafkaSink(config, context(unique_name()))
    with pytest.raises(DefiniteSinkError, match="give_up_after"):
        await sink.start()
    await sink.close()


def test_config_rejects_unknown_keys_and_parses_durations() -> None:
    with pytest.raises(ValueError, match="extra"):
        KafkaSinkConfig(bootstrap_servers="x:1", nonsense=1)  # type: ignore[call-arg]
    config = KafkaSinkConfig(
        bootstrap_servers="x:1", give_up_after="2m", request_timeout="500ms", sasl_password="s3cret"
    )
    assert config.give_up_after == 120.0 and config.request_timeout == 0.5
    assert "s3cret" not in repr(config)


async def test_encoder_events_round_trip(kafka_broker: KafkaBroker) -> None:
    """Real ChangeEvents from cdcd.events.encoder: the record bytes are the encoder's."""
    from tests.unit.sink_fixtures import CONTEXT, encoder, relation, tup
    from tests.unit.sink_fixtures import TxnBuilder as PgTxn

    name = unique_name()
    sink = KafkaSink(
        KafkaSinkConfig(
            bootstrap_servers=kafka_broker.bootstrap,
            topic_prefix=name,
        ),
        CONTEXT,
    )
    orders = relation()
    txn = (
        PgTxn(900, 50_000)
        .insert(orders, tup(1, "ann", "x"))
        .message("audit", b"hello")
        .delete(orders, tup(1, None, None))
        .build()
    )
    events = list(encoder().events(txn))
    await sink.start()
    try:
        await run_txn(sink, txn, events)  # type: ignore[arg-type]
        await sink.flush()
        assert sink.durable_lsn() == txn.end_lsn
    finally:
        await sink.close()
    records = await consume(kafka_broker.bootstrap, [f"{name}.public.orders"], 3)
    table_events = [e for e in events if e.op != "m"]
    assert [(r.key, r.value) for r in records] == [
        (table_events[0].key_json(), table_events[0].value_json()),
        (table_events[1].key_json(), table_events[1].value_json()),
        (table_events[1].key_json(), None),
    ]
    (message,) = await consume(kafka_broker.bootstrap, [f"{name}.message"], 1)
    assert message.key == b'{"prefix":"audit"}' and message.value == events[1].value_json()


# --- the batch path: records grouped per topic-partition into record batches ------------------


def positions_by_key(records: list[ConsumerRecord[bytes, bytes]]) -> dict[bytes, list[Any]]:
    """Per key, the (commit_lsn, seq) of its records in partition-offset order."""
    seen: dict[bytes, list[Any]] = {}
    for r in sorted(records, key=lambda r: (r.partition, r.offset)):
        source = orjson.loads(r.value or b"")["source"]
        seen.setdefault(r.key or b"", []).append((source["commit_lsn"], source["seq"]))
    return seen


async def write_all_durably(
    sink: KafkaSink, txns: list[tuple[Transaction, list[ChangeEvent]]]
) -> None:
    """Start ``sink``, write ``txns``, flush: the last one is durable and nothing waits."""
    await sink.start()
    try:
        for txn, events in txns:
            await run_txn(sink, txn, events)
        await sink.flush()
        assert sink.durable_lsn() == txns[-1][0].end_lsn
        assert sink.stats()["window_records"] == 0
    finally:
        await sink.close()


async def test_batch_boundaries_and_a_record_larger_than_a_batch(kafka_broker: KafkaBroker) -> None:
    """max_batch_size 1 KiB: every few records close a batch, mid-transaction and across
    transactions; a 5 KB record goes alone in its batch. Everything arrives once, in order."""
    name = unique_name()
    sink = make_sink(kafka_broker, name, max_batch_size=1024, linger_ms=50, buffer_records=7)
    build = TxnBuilder()
    txns = []
    for n in range(12):
        changes = [("u", "orders", {"id": i % 4, "n": n, "pad": "p" * 100}) for i in range(n)]
        txns.append(build.next(changes, big=5000 if n == 7 else 0))
    written = [e.position for _, events in txns for e in events]
    await write_all_durably(sink, txns)
    records = await consume(kafka_broker.bootstrap, [f"{name}.public.orders"], len(written))
    assert len(records) == len(written)
    by_key = positions_by_key(records)
    for key, positions in by_key.items():
        assert positions == sorted(positions), key
    assert sorted(p for positions in by_key.values() for p in positions) == written
    assert max(len(r.value or b"") for r in records) > 5000


async def test_batches_cut_by_compressed_size_all_fit_the_topics_limit(
    kafka_broker: KafkaBroker,
) -> None:
    """A topic taking batches of at most 64 KiB (``max.message.bytes``) and the sink's
    ``max_request_size`` set to it, its ``max_batch_size`` the default 1 MiB: rows that compress
    go in batches several times the limit uncompressed, and rows that hardly compress, coming
    after them, in batches the broker takes (one cut for the compressible ones is split).
    Everything arrives once, in order."""
    import base64
    import os

    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    name = unique_name()
    topic = f"{name}.public.orders"
    limit = 64 * 1024
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_broker.bootstrap)
    await admin.start()
    try:
        config = {"max.message.bytes": str(limit)}
        await admin.create_topics([NewTopic(topic, 1, 1, topic_configs=config)])
    finally:
        await admin.close()
    sink = make_sink(kafka_broker, name, max_request_size=limit, linger_ms=50)
    build = TxnBuilder()
    txns = []
    for n in range(8):
        if n < 5:
            rows = [{"id": n * 1000 + i, "pad": "p" * 400} for i in range(1000)]
        else:  # base64 of random bytes: compressed, three quarters of the size
            rows = [
                {"id": n * 1000 + i, "pad": base64.b64encode(os.urandom(300)).decode()}
                for i in range(1000)
            ]
        txns.append(build.next([("c", "orders", row) for row in rows]))
    written = [e.position for _, events in txns for e in events]
    await write_all_durably(sink, txns)
    stats = sink.stats()
    assert stats["batches_split"] >= 1
    records = await consume(kafka_broker.bootstrap, [topic], len(written))
    assert [position_of(r) for r in records] == written
    # fewer batches than 64 KiB of records each would take
    raw = sum(len(r.value or b"") for r in records)
    assert stats["batches_sent"] < raw / limit


async def test_partition_is_kafkas_default_for_the_key(kafka_broker: KafkaBroker) -> None:
    """Keys land where Kafka's (and aiokafka's) default partitioner puts them; keyless records
    (a table without a key) are spread over the partitions."""
    from aiokafka.partitioner import DefaultPartitioner

    name = unique_name()
    sink = make_sink(kafka_broker, name, partitions=5, max_batch_size=2048)
    changes = [("c", "orders", {"id": i, "name": f"n{i}"}) for i in range(200)]
    txn, events = TxnBuilder().next(changes, keyless=range(100, 200))
    assert [e.key() is None for e in events] == [False] * 100 + [True] * 100
    await write_all_durably(sink, [(txn, events)])
    records = await consume(kafka_broker.bootstrap, [f"{name}.public.orders"], 200)
    assert len(records) == 200
    keyed = [r for r in records if r.key is not None]
    assert len(keyed) == 100
    partitions = list(range(5))
    for r in keyed:
        assert r.partition == DefaultPartitioner()(r.key, partitions, partitions), r.key
    assert len({r.partition for r in records if r.key is None}) > 1


async def test_broker_away_mid_transaction_nothing_durable(
    restartable_kafka_broker: KafkaBroker,
) -> None:
    """The broker goes away after part of a multi-batch, multi-partition transaction was
    acknowledged: its end is not durable (nor a later one) until every batch is acknowledged,
    batches that expired meanwhile are replayed, and then everything is there."""
    broker = restartable_kafka_broker
    name = unique_name()
    sink = make_sink(
        broker,
        name,
        partitions=3,
        max_batch_size=1024,
        linger_ms=0,
        request_timeout="2s",
        retry_backoff="200ms",
    )
    await sink.start()
    build = TxnBuilder()
    try:
        t1, e1 = build.next([("c", "orders", {"id": 0})])
        await run_txn(sink, t1, e1)
        await sink.flush()
        changes = [("c", "orders", {"id": i, "pad": "p" * 200}) for i in range(1, 41)]
        t2, e2 = build.next(changes)
        await sink.begin(t2)
        await sink.write(e2[:20])
        for _ in range(200):
            if sink.stats()["records_acked"] > 1:
                break
            await asyncio.sleep(0.05)
        assert sink.stats()["records_acked"] > 1  # part of t2 is on the broker
        await broker.stop()
        await sink.write(e2[20:])
        await sink.commit(t2)
        t3, e3 = build.next([("c", "orders", {"id": 99})])  # a known topic: no admin call
        await run_txn(sink, t3, e3)
        flushing = asyncio.create_task(sink.flush())
        await asyncio.sleep(4)  # past request_timeout: batches expire
        assert not flushing.done()
        assert sink.durable_lsn() == t1.end_lsn
        await broker.start()
        await asyncio.wait_for(flushing, 60)
        assert sink.durable_lsn() == t3.end_lsn
    finally:
        await sink.close()
    records = await consume(broker.bootstrap, [f"{name}.public.orders"], 42)
    positions = {e.position for e in e1 + e2 + e3}
    assert {
        (
            orjson.loads(r.value or b"")["source"]["commit_lsn"],
            orjson.loads(r.value or b"")["source"]["seq"],
        )
        for r in records
    } == positions
    for key, seen in positions_by_key(records).items():
        first = sorted(set(seen))
        assert seen[: len(first)] == first, key  # commit order, then maybe a replayed suffix


# --- exactly once: Kafka transactions with cdcd's position ----------------------------------


async def consume_committed(
    bootstrap: str, topics: list[str], count: int, timeout: float = 30.0
) -> list[ConsumerRecord[bytes, bytes]]:
    """As :func:`consume`, with ``read_committed`` (what an exactly-once consumer reads)."""
    consumer = AIOKafkaConsumer(
        *topics,
        bootstrap_servers=bootstrap,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        isolation_level="read_committed",
    )
    await consumer.start()
    records: list[ConsumerRecord[bytes, bytes]] = []
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while len(records) < count and loop.time() < deadline:
            for recs in (await consumer.getmany(timeout_ms=300)).values():
                records.extend(recs)
        # then a moment more, so that records beyond ``count`` show
        for recs in (await consumer.getmany(timeout_ms=1000)).values():
            records.extend(recs)
    finally:
        await consumer.stop()
    return records


async def test_exactly_once_resumes_after_an_uncommitted_crash(kafka_broker: KafkaBroker) -> None:
    """A sink that dies with a Kafka transaction open (no flush) leaves nothing visible to a
    read_committed consumer; the next one skips what the committed position covers, even
    inside a transaction cut by a Kafka commit, and everything is there exactly once."""
    name = unique_name()
    build = TxnBuilder()
    txns = [build.next([("c", "orders", {"id": 10 * t + i}) for i in range(3)]) for t in range(6)]
    topic = f"{name}.public.orders"

    # commits only in flush: none begins on its own at a transaction's end
    first = make_sink(kafka_broker, name, exactly_once=True, partitions=2, commit_interval="1h")
    await first.start()
    try:
        for txn, events in txns[:2]:
            await run_txn(first, txn, events)
        await first.flush()  # a Kafka commit: transactions 0 and 1
        assert first.durable_lsn() == txns[1][0].end_lsn
        txn, events = txns[2]
        await first.begin(txn)
        await first.write(events[:2])
        await first.flush()  # a commit in the middle of transaction 2
        assert first.durable_lsn() == txns[1][0].end_lsn
        await first.write(events[2:])
        await first.commit(txn)
        await run_txn(first, *txns[3])
        for _ in range(50):  # sent, not committed: a crash now
            if first.stats()["records_acked"] + first.stats()["records_sent"] > 12:
                break
            await asyncio.sleep(0.05)
        assert first.durable_lsn() == txns[1][0].end_lsn
    finally:
        await first.close()  # no flush: the open Kafka transaction is left behind
    assert len(await consume_committed(kafka_broker.bootstrap, [topic], 8, timeout=3)) == 8

    second = make_sink(kafka_broker, name, exactly_once=True, partitions=2)
    await second.start()
    try:
        for txn, events in txns[2:]:  # PostgreSQL resends from the confirmed LSN
            await run_txn(second, txn, events)
        await second.flush()
        assert second.durable_lsn() == txns[-1][0].end_lsn
    finally:
        await second.close()
    records = await consume_committed(kafka_broker.bootstrap, [topic], 18)
    positions = [(orjson.loads(r.value or b"")["source"]["commit_lsn"], r.headers) for r in records]
    assert len(positions) == 18
    written = sorted(e.position for _, events in txns for e in events)
    assert sorted((lsn, int(dict(headers)["cdcd.seq"])) for lsn, headers in positions) == written


async def test_exactly_once_commit_inside_a_write_claims_what_it_holds(
    kafka_broker: KafkaBroker,
) -> None:
    """A window that fills in the middle of a write commits the Kafka transaction there: the
    position committed with it is the last event added so far, not the last of the write (a
    crash right after would otherwise lose the rest: the next start skips it). The records
    added while a commit is under way go into the next Kafka transaction."""
    name = unique_name()
    txn, events = TxnBuilder().next([("c", "orders", {"id": i}) for i in range(10)])
    topic = f"{name}.public.orders"
    first = make_sink(kafka_broker, name, exactly_once=True, buffer_records=4)
    await first.start()
    try:
        await first.begin(txn)
        # half the window for the Kafka transaction being committed, half for the next:
        # a commit after every 2 records, the write waiting once both halves are full
        await first.write(events)
        assert first.stats()["kafka_commits"] >= 3
    finally:
        await first.close()  # a crash: the last records were never committed
    held = len(await consume_committed(kafka_broker.bootstrap, [topic], 10, timeout=3))
    assert 6 <= held <= 10 and held % 2 == 0  # whole Kafka transactions

    second = make_sink(kafka_broker, name, exactly_once=True, buffer_records=4)
    await second.start()
    try:
        await run_txn(second, txn, events)  # PostgreSQL resends the whole transaction
        await second.flush()
        assert second.durable_lsn() == txn.end_lsn
    finally:
        await second.close()
    records = await consume_committed(kafka_broker.bootstrap, [topic], 10)
    assert sorted(int(dict(r.headers)["cdcd.seq"]) for r in records) == [e.seq for e in events]


async def test_exactly_once_flush_while_the_writer_begins_a_commit(
    kafka_broker: KafkaBroker,
) -> None:
    """A flush waiting for the Kafka commit under way, while the writer, woken by the same
    commit, begins the next one (its window full): the flush waits for that one too and
    commits what was added after it, instead of failing "one commit at a time"."""
    name = unique_name()
    txn, events = TxnBuilder().next([("c", "orders", {"id": i}) for i in range(6)])
    sink = make_sink(kafka_broker, name, exactly_once=True)
    await sink.start()
    try:
        txns = sink._txns
        assert txns is not None
        await sink.begin(txn)
        await sink.write(events[:2])
        txns.begin_commit()

        async def writer() -> None:
            await txns.make_room()  # woken first: it waited first
            await sink.write(events[2:4])
            txns.begin_commit()

        task = asyncio.get_running_loop().create_task(writer())
        await asyncio.sleep(0)
        await sink.flush()
        await task
        await sink.write(events[4:])
        await sink.commit(txn)
        await sink.flush()
        assert sink.durable_lsn() == txn.end_lsn
    finally:
        await sink.close()
    records = await consume_committed(kafka_broker.bootstrap, [f"{name}.public.orders"], 6)
    assert sorted(int(dict(r.headers)["cdcd.seq"]) for r in records) == [e.seq for e in events]


async def test_exactly_once_start_after_a_commit_cut_short(kafka_broker: KafkaBroker) -> None:
    """cdcd killed while committing: its position record was sent, the commit never came, and
    the successor's InitProducerId aborts it. The position topic then ends with aborted
    records and a marker, which a read_committed consumer never moves past: the start takes
    the broker's last stable offset as the end instead of waiting for good."""
    name = unique_name()
    build = TxnBuilder()
    txns = [build.next([("c", "orders", {"id": 10 * t + i}) for i in range(3)]) for t in range(3)]
    first = make_sink(kafka_broker, name, exactly_once=True)
    await first.start()  # creates the position topic; killed before its first commit ended
    await first.close()
    cut = AIOKafkaProducer(
        bootstrap_servers=kafka_broker.bootstrap, transactional_id=first.transactional_id
    )
    await cut.start()
    try:
        await cut.begin_transaction()
        await cut.send_and_wait(
            first.position_topic, b'{"bogus": true}', key=first.transactional_id.encode()
        )
    finally:
        await cut.stop()  # no commit, no abort: the next producer's start aborts it

    second = make_sink(kafka_broker, name, exactly_once=True)
    await asyncio.wait_for(second.start(), 20)
    try:
        for txn, events in txns:  # nothing committed: all of them
            await run_txn(second, txn, events)
        await second.flush()
        assert second.durable_lsn() == txns[-1][0].end_lsn
    finally:
        await second.close()
    records = await consume_committed(kafka_broker.bootstrap, [f"{name}.public.orders"], 9)
    assert len(records) == 9


async def test_exactly_once_fences_the_older_sink(kafka_broker: KafkaBroker) -> None:
    """A second sink with the same transactional id takes over: the first one's next commit
    fails with a definite error that says so (exit 3), and its open transaction is aborted."""
    from cdcd.errors import SinkSetupError

    name = unique_name()
    build = TxnBuilder()
    older = make_sink(kafka_broker, name, exactly_once=True)
    newer = make_sink(kafka_broker, name, exactly_once=True)
    await older.start()
    try:
        t1, e1 = build.next([("c", "orders", {"id": 1})])
        await run_txn(older, t1, e1)
        await newer.start()
        t2, e2 = build.next([("c", "orders", {"id": 2})])
        with pytest.raises(SinkSetupError, match="fenced") as info:
            await run_txn(older, t2, e2)
            await older.flush()
        assert info.value.exit_code == 3
        assert older.durable_lsn() == 0
        await run_txn(newer, t1, e1)
        await newer.flush()
    finally:
        await older.close()
        await newer.close()
    records = await consume_committed(kafka_broker.bootstrap, [f"{name}.public.orders"], 1, 5)
    assert [r.key for r in records] == [b'{"id":1}']
