"""End to end with three sinks at once: PostgreSQL -> ``cdcd run --endpos`` (the real CLI, a real
server, a real Kafka-protocol broker) -> JSON Lines files, Parquet files and Kafka topics.

One cdcd run writes the same workload to a ``file`` sink (jsonl, ``out-jsonl``), a ``file`` sink
(parquet, ``out-parquet``) and a ``kafka`` sink (its defaults: an idempotent producer,
``acks: all``; a unique ``name``, so topic prefix, per test). Then each is read back with an
independent client (:mod:`tests.e2e`: pyarrow, aiokafka's consumer) and checked against the JSON
Lines events, which :mod:`tests.integration.test_e2e_files` proves against the source:

* Parquet: the same events in the same order (positions, op, source, transaction, key,
  before/after values once native types are written in their JSON form);
* Kafka (docs/kafka.md): per table topic, the values are the JSON Lines events minus ``key``, in
  the same order, the record key is the event's ``key``; a tombstone with the same key and
  headers follows each delete with a key; headers carry the position, xid and op; logical
  messages go to ``<name>.message``; no other topic;
* the table state rebuilt from each sink equals the source table.

Also: per-key order across a 3-partition topic under concurrent updates, and bad input
(unreachable bootstrap server, a record over ``max_request_size``).

The sinks do not depend on the server version: the newest installed PostgreSQL only
(``version_independent``, tests/conftest.py).
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import orjson
import pytest

from cdcd.lsn import parse_lsn
from tests.e2e import (
    UNAVAILABLE,
    KafkaRecord,
    apply_events,
    checked_events,
    comparable,
    comparable_event,
    consume_prefix,
    native_to_json,
    parquet_events,
    position,
    run_cdcd,
    write_config,
)
from tests.kafkaharness import KafkaBroker, free_port
from tests.pgharness import PgDatabase

pytestmark = [
    pytest.mark.pg,
    pytest.mark.kafka,
    pytest.mark.version_independent,
    pytest.mark.timeout(300),
]

SLOT = "cdcd_e2e"


def unique_name() -> str:
    return "e2e" + uuid.uuid4().hex[:8]


def kafka_sink(broker: KafkaBroker, **options: Any) -> dict[str, Any]:
    return {
        "type": "kafka",
        "bootstrap_servers": broker.bootstrap,
        **options,
    }


def three_sinks(broker: KafkaBroker, **kafka: Any) -> list[dict[str, Any]]:
    return [
        {"type": "file", "path": "out-jsonl", "format": "jsonl"},
        {"type": "file", "path": "out-parquet", "format": "parquet"},
        kafka_sink(broker, **kafka),
    ]


#: cdcd's log events of a produce that failed, was retried or replayed, or got no answer
KAFKA_STALL_EVENTS = (
    "kafka_send_retry",
    "kafka_delivery_failed_replaying",
    "kafka_transaction_retry",
    "kafka_waiting_for_broker",
    "kafka_unreachable",
)


async def cdcd(*args: str, check: bool = True) -> Any:
    """The CLI in a thread, so the session's event loop (the broker fixture's) keeps running."""
    return await asyncio.to_thread(run_cdcd, *args, check=check)


async def sync(db: PgDatabase, cfg: Path, check: bool = True) -> Any:
    """``cdcd run --endpos`` the WAL insert position (a non-transactional message may not be
    written out yet, so ``pg_current_wal_lsn()`` may be before it)."""
    endpos = db.fetchval("SELECT pg_current_wal_insert_lsn()::text")
    return await cdcd("run", "--config", str(cfg), "--endpos", endpos, check=check)


def confirmed_flush(db: PgDatabase) -> int:
    return parse_lsn(
        db.fetchval(
            f"SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = '{SLOT}'"
        )
    )


def source_state(db: PgDatabase, table: str, columns: str = "*") -> list[dict[str, Any]]:
    """The source rows with values in their docs/events.md JSON form (psycopg2's native values
    through :func:`native_to_json`; json/jsonb columns selected as text by ``columns``)."""
    with db.connect() as conn, conn.cursor() as cur:
        cur.execute(f"SELECT {columns} FROM {table}")
        names = [d.name for d in cur.description]
        return [
            {n: native_to_json(v) for n, v in zip(names, row, strict=True)}
            for row in cur.fetchall()
        ]


def topic_folder(name: str, topic: str) -> str:
    """The file sink folder holding the events of a Kafka topic."""
    rest = topic[len(name) + 1 :]
    return "_messages" if rest == "message" else rest


def check_topic(records: list[KafkaRecord], expected: list[dict[str, Any]]) -> None:
    """A one-partition topic holds exactly ``expected`` (JSON Lines events) in order, a tombstone
    after each keyed delete, and headers that match each event."""
    values = [r for r in records if not r.is_tombstone]
    assert [r.position for r in values] == [position(e) for e in expected]
    for record, event in zip(values, expected, strict=True):
        assert record.event() == event, record
        src = event["source"]
        headers = {
            "cdcd.commit_lsn": str(src["commit_lsn"]),
            "cdcd.seq": str(src["seq"]),
            "cdcd.op": event["op"],
        }
        if src.get("txId") is not None:
            headers["cdcd.xid"] = str(src["txId"])
        for link, header in (("new_key", "__debezium.newkey"), ("old_key", "__debezium.oldkey")):
            if link in src:  # a key change's pair (docs/events.md): the other key as JSON
                headers[header] = orjson.dumps(src[link]).decode()
        assert record.headers == headers, record
    for i, record in enumerate(records):
        if record.is_tombstone:
            deleted = records[i - 1]
            assert deleted.value is not None and deleted.value["op"] == "d", record
            assert (record.key, record.headers) == (deleted.key, deleted.headers)
        elif record.value is not None and record.value["op"] == "d" and record.key is not None:
            assert i + 1 < len(records) and records[i + 1].is_tombstone, (
                f"no tombstone after {record}"
            )


# --------------------------------------------------------------------------- the workload

TYPED = "id int PRIMARY KEY, a text, n numeric(10,2), ts timestamptz, d date, b bytea, j jsonb, big text"
TYPED_COLUMNS = "id, a, n, ts, d, b, j::text AS j, big"


def run_workload(db: PgDatabase) -> None:
    """Every scenario of the file sink tests, once (the tables exist, the slot too)."""
    big = "".join(f"{i:05d}" for i in range(2000))  # 10 kB, stored out of line (EXTERNAL)
    for table in ("t_default", "t_full"):
        db.execute(
            f"""
            INSERT INTO {table} VALUES
              (1, 'a', 12.50, '2024-01-02 03:04:05.5+00', '2024-02-29', '\\x00ff10', '{{"k": [1, null]}}', '{big}'),
              (2, 'b', -0.01, '1999-12-31 23:59:59+05', '1970-01-01', '', 'null', 'short'),
              (3, NULL, NULL, NULL, NULL, NULL, NULL, NULL);
            UPDATE {table} SET a = 'a2', n = n + 1 WHERE id = 1;          -- big: unchanged TOAST
            UPDATE {table} SET id = 30 WHERE id = 3;                     -- key change
            DELETE FROM {table} WHERE id = 2;
            UPDATE {table} SET ts = ts + interval '1 day', b = '\\xdeadbeef' WHERE id = 1;
            """
        )
    db.execute(
        """
        INSERT INTO tr1 VALUES (1, 'x'), (2, 'y'); INSERT INTO tr2 VALUES (1, 'z');
        TRUNCATE tr1, tr2;
        INSERT INTO tr1 VALUES (3, 'after');
        """
    )
    with db.connect() as conn, conn.cursor() as cur:  # streamed, with a rolled-back savepoint
        cur.execute("BEGIN")
        cur.execute("INSERT INTO s SELECT g, 'kept' FROM generate_series(1, 1500) g")
        cur.execute("SAVEPOINT sp")
        cur.execute("INSERT INTO s SELECT g, 'rolled back' FROM generate_series(1501, 2000) g")
        cur.execute("UPDATE s SET tag = 'gone' WHERE id <= 100")
        cur.execute("ROLLBACK TO SAVEPOINT sp")
        cur.execute("UPDATE s SET tag = 'updated' WHERE id <= 10")
        cur.execute("DELETE FROM s WHERE id > 1490")
        cur.execute("SELECT pg_logical_emit_message(true, 'e2e', 'in the streamed one')")
        cur.execute("COMMIT")
    with db.connect() as conn, conn.cursor() as cur:  # two-phase
        cur.execute("BEGIN")
        cur.execute("INSERT INTO p SELECT g, 'prepared' FROM generate_series(1, 20) g")
        cur.execute("PREPARE TRANSACTION 'e2e_g1'")
    db.execute("INSERT INTO p VALUES (100, 'between')")
    db.execute("COMMIT PREPARED 'e2e_g1'")
    db.execute("SELECT pg_logical_emit_message(false, 'e2e', '\\x00ff'::bytea)")


TABLES = {
    "t_default": TYPED_COLUMNS,
    "t_full": TYPED_COLUMNS,
    "tr1": "*",
    "tr2": "*",
    "s": "*",
    "p": "*",
}


async def test_three_sinks_hold_the_same_events(
    pg_db: PgDatabase, kafka_broker: KafkaBroker, tmp_path: Path
) -> None:
    pg_db.enable_streaming()
    pg_db.execute(
        f"""
        CREATE TABLE t_default ({TYPED});
        CREATE TABLE t_full ({TYPED});
        ALTER TABLE t_full REPLICA IDENTITY FULL;
        ALTER TABLE t_default ALTER COLUMN big SET STORAGE EXTERNAL;
        ALTER TABLE t_full ALTER COLUMN big SET STORAGE EXTERNAL;
        CREATE TABLE tr1 (id int PRIMARY KEY, v text);
        CREATE TABLE tr2 (id int PRIMARY KEY, v text);
        CREATE TABLE s (id int PRIMARY KEY, tag text);
        CREATE TABLE p (id int PRIMARY KEY, gid text);
        """
    )
    name = unique_name()
    cfg = write_config(
        tmp_path, pg_db.dsn, sinks=three_sinks(kafka_broker), name=name, two_phase=True
    )
    await cdcd("slot", "create", "--config", str(cfg))
    run_workload(pg_db)
    await sync(pg_db, cfg)

    jsonl_out, parquet_out = tmp_path / "out-jsonl", tmp_path / "out-parquet"
    folders = sorted(p.name for p in jsonl_out.iterdir() if not p.name.startswith("."))
    assert folders == ["_messages", *sorted(f"public.{t}" for t in TABLES)]
    jsonl = {f: checked_events(jsonl_out, f) for f in folders}
    expected_records = sum(len(e) for e in jsonl.values()) + sum(
        1 for events in jsonl.values() for e in events if e["op"] == "d" and e["key"] is not None
    )
    topics = await consume_prefix(kafka_broker.bootstrap, name, expected_records)
    assert sum(len(r) for r in topics.values()) == expected_records
    assert sorted(topics) == sorted(
        f"{name}.{f}" if f != "_messages" else f"{name}.message" for f in folders
    )

    # the scenarios happened (the shapes themselves are test_e2e_files' business)
    t_default = jsonl["public.t_default"]
    assert "".join(e["op"] for e in t_default) == "cccudcdu"
    assert t_default[3]["after"]["big"] == UNAVAILABLE and t_default[3]["source"][
        "unchanged_toast"
    ] == ["big"]
    assert jsonl["public.t_full"][3]["before"]["big"] == jsonl["public.t_full"][3]["after"]["big"]
    truncates = [e for f in ("public.tr1", "public.tr2") for e in jsonl[f] if e["op"] == "t"]
    assert len({e["source"]["commit_lsn"] for e in truncates}) == 1 and len(truncates) == 2
    assert len(jsonl["public.s"]) == 1500 + 10 + 10 and len(jsonl["public.p"]) == 21
    assert [m["source"]["transactional"] for m in jsonl["_messages"]] == [True, False]
    assert (
        int(
            pg_db.fetchval(
                f"SELECT stream_txns FROM pg_stat_replication_slots WHERE slot_name = '{SLOT}'"
            )
        )
        >= 1
    )

    for folder, events in jsonl.items():
        # Kafka: the same events, in order, tombstones after deletes, headers = positions
        check_topic(topics[f"{name}.{'message' if folder == '_messages' else folder}"], events)
        if folder == "_messages":
            continue  # messages are JSON Lines in every file format
        # Parquet: the same events once native values are in JSON form
        from_parquet = parquet_events(parquet_out, folder)
        assert [position(e) for e in from_parquet] == [position(e) for e in events]
        for got, want in zip(from_parquet, events, strict=True):
            assert got == comparable_event(want), position(want)
        # the table state rebuilt from each sink equals the source table
        table = folder.removeprefix("public.")
        expected = comparable(source_state(pg_db, table, TABLES[table]))
        from_kafka = [r.event() for r in topics[f"{name}.{folder}"] if not r.is_tombstone]
        for label, rebuilt in (("jsonl", events), ("parquet", from_parquet), ("kafka", from_kafka)):
            assert comparable(apply_events(rebuilt)) == expected, f"{table} rebuilt from {label}"


# --------------------------------------------------------------------------- per-key order


async def test_per_key_order_across_three_partitions(
    pg_db: PgDatabase, kafka_broker: KafkaBroker, tmp_path: Path
) -> None:
    """Concurrent updates of a few keys from four connections: each key's records, in offset
    order within its partition, are in commit order, and its counter goes 1, 2, 3, ..."""
    keys, threads, rounds = 12, 4, 40
    pg_db.execute("CREATE TABLE ctr (id int PRIMARY KEY, n int NOT NULL, by text)")
    pg_db.execute(f"INSERT INTO ctr SELECT g, 0, 'init' FROM generate_series(1, {keys}) g")
    name = unique_name()
    cfg = write_config(
        tmp_path, pg_db.dsn, sinks=[kafka_sink(kafka_broker, partitions=3)], name=name
    )
    await cdcd("slot", "create", "--config", str(cfg))
    errors: list[BaseException] = []

    def worker(t: int) -> None:
        try:
            with pg_db.connect() as conn, conn.cursor() as cur:
                for r in range(rounds):
                    a, b = (t * 7 + r) % keys + 1, (t * 5 + r * 3) % keys + 1
                    cur.execute("BEGIN")  # two keys per transaction, in id order (no deadlock)
                    for k in sorted({a, b}):
                        cur.execute("UPDATE ctr SET n = n + 1, by = %s WHERE id = %s", (f"w{t}", k))
                    cur.execute("COMMIT")
        except BaseException as exc:
            errors.append(exc)

    workers = [threading.Thread(target=worker, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert not errors, errors
    done = await sync(pg_db, cfg)
    # a healthy broker: no produce retried, replayed or waited for (a timeout-driven wait
    # would be one of these; cdcd logs each as a warning)
    stalls = [event for event in KAFKA_STALL_EVENTS if event in done.stderr]
    assert not stalls, f"{stalls} on a healthy broker:\n{done.stderr[-4000:]}"

    final = dict(pg_db.fetch("SELECT id, n FROM ctr"))
    records = (await consume_prefix(kafka_broker.bootstrap, name, sum(final.values())))[
        f"{name}.public.ctr"
    ]
    by_key: dict[int, list[KafkaRecord]] = defaultdict(list)
    for record in records:  # sorted by (partition, offset)
        by_key[record.key["id"]].append(record)
    assert sorted(by_key) == sorted(final)
    for key, recs in by_key.items():
        assert len({r.partition for r in recs}) == 1, f"key {key} in several partitions"
        assert [r.position for r in recs] == sorted({r.position for r in recs}), f"key {key}"
        assert [r.value["after"]["n"] for r in recs if r.value] == list(range(1, final[key] + 1))
    assert len({r.partition for r in records}) > 1, "all keys in one partition: proves little"
    assert sum(final.values()) == len(records)


# --------------------------------------------------------------------------- bad input


async def test_unreachable_bootstrap_gives_up(pg_db: PgDatabase, tmp_path: Path) -> None:
    """No broker at the bootstrap address: cdcd retries for ``give_up_after``, then exits 1
    (README "Running against your database": anything but config and source problems) saying what it could not reach."""
    pg_db.execute("CREATE TABLE t (id int PRIMARY KEY)")
    bootstrap = f"127.0.0.1:{free_port()}"
    sink = {
        "type": "kafka",
        "bootstrap_servers": bootstrap,
        "give_up_after": "3s",
    }
    cfg = write_config(tmp_path, pg_db.dsn, sinks=[sink], name=unique_name())
    await cdcd("slot", "create", "--config", str(cfg))
    before = confirmed_flush(pg_db)
    pg_db.execute("INSERT INTO t VALUES (1)")
    proc = await sync(pg_db, cfg, check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output
    assert f"cannot reach {bootstrap}" in output and "give_up_after" in output, output
    assert "Traceback" not in output, output
    assert confirmed_flush(pg_db) == before


async def test_record_over_max_request_size(
    pg_db: PgDatabase, kafka_broker: KafkaBroker, tmp_path: Path
) -> None:
    """A 50 kB row with ``max_request_size: 10000``: a clear error naming the topic and the
    size, exit 1, and the slot stays before that transaction's end; with a larger limit the next
    run delivers it and everything after it, nothing lost."""
    pg_db.execute("CREATE TABLE t (id int PRIMARY KEY, body text)")
    name = unique_name()
    cfg = write_config(
        tmp_path, pg_db.dsn, sinks=[kafka_sink(kafka_broker, max_request_size=10000)], name=name
    )
    await cdcd("slot", "create", "--config", str(cfg))
    pg_db.execute("INSERT INTO t VALUES (1, 'small before')")
    small_end = parse_lsn(pg_db.fetchval("SELECT pg_current_wal_lsn()::text"))
    # random text: 50 kB that does not compress away
    pg_db.execute(
        "INSERT INTO t SELECT 2, string_agg(md5(random()::text), '') FROM generate_series(1, 1600)"
    )
    big_end = parse_lsn(pg_db.fetchval("SELECT pg_current_wal_lsn()::text"))
    pg_db.execute("INSERT INTO t VALUES (3, 'small after')")

    proc = await sync(pg_db, cfg, check=False)
    output = proc.stdout + proc.stderr
    topic = f"{name}.public.t"
    assert proc.returncode == 1, output
    assert f"topic '{topic}'" in output and "max_request_size" in output, output
    assert "Traceback" not in output, output
    confirmed = confirmed_flush(pg_db)
    assert confirmed < big_end, (
        f"confirmed {confirmed:X} passed the failed transaction ({big_end:X})"
    )

    bigger = write_config(
        tmp_path, pg_db.dsn, sinks=[kafka_sink(kafka_broker, max_request_size="1MiB")], name=name
    )
    await sync(pg_db, bigger)
    records = (await consume_prefix(kafka_broker.bootstrap, name, 3))[topic]
    ids = [r.value["after"]["id"] for r in records]
    assert ids[-2:] == [2, 3] and set(ids) == {1, 2, 3}, ids  # 1 may be there twice
    assert ids.count(1) == 1 or confirmed < small_end
    assert len(records[-2].value["after"]["body"]) == 51200
