"""The replication client against real PostgreSQL 15/16/18: commands, streaming, feedback, errors."""

from __future__ import annotations

import asyncio
import struct
import time
from collections.abc import AsyncIterator

import asyncpg
import pytest

from cdcd.errors import DefiniteSourceError, TransientSourceError
from cdcd.lsn import format_lsn, parse_lsn
from cdcd.replication.client import ReplicationClient, SlotExists
from cdcd.replication.transport import HIGH_WATER
from cdcd.source import slot as slots
from cdcd.wire.copydata import PrimaryKeepalive, XLogData
from cdcd.wire.dsn import ConnParams, parse_dsn
from tests.pgharness import PgDatabase, free_port

pytestmark = pytest.mark.pg

#: Highest pgoutput protocol by server major.
MAX_PROTO = {15: 3, 16: 4, 17: 4, 18: 4}


def params_for(db: PgDatabase, **kw: str) -> ConnParams:
    return parse_dsn(db.dsn_for(**kw) if kw else db.dsn, environ={}, use_passfile=False)


@pytest.fixture
async def client(pg_db: PgDatabase) -> AsyncIterator[ReplicationClient]:
    c = await ReplicationClient.connect(params_for(pg_db), application_name="cdcd-test")
    try:
        yield c
    finally:
        await c.close()


def setup_table(db: PgDatabase, publication: str = "pub") -> None:
    db.execute(
        'CREATE TABLE "Items" (id int PRIMARY KEY, name text);'
        f'CREATE PUBLICATION "{publication}" FOR TABLE "Items";'
    )


async def read_transaction(
    client: ReplicationClient, timeout: float = 30
) -> list[tuple[int, bytes]]:
    """(wal_start, payload) of XLogData up to and including the next Commit."""
    out: list[tuple[int, bytes]] = []
    async with asyncio.timeout(timeout):
        async for msg in client.messages():
            if isinstance(msg, XLogData):
                data = bytes(msg.data)
                out.append((msg.wal_start, data))
                if data[:1] == b"C":
                    return out
    raise AssertionError("stream ended")


def commit_end_lsn(commit: bytes) -> int:
    # Commit: 'C', Int8 flags, Int64 commit LSN, Int64 end LSN, Int64 timestamp
    return struct.unpack_from("!QQ", commit, 2)[1]


def wait_for(db: PgDatabase, sql: str, expected: object, timeout: float = 30) -> object:
    deadline = time.monotonic() + timeout
    while True:
        value = db.fetchval(sql)
        if value == expected or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


async def test_identify_system_and_version(client: ReplicationClient, pg_db: PgDatabase) -> None:
    info = await client.identify_system()
    assert info.dbname == pg_db.name
    assert info.timeline >= 1
    assert info.xlogpos > 0
    assert info.systemid.isdigit()
    assert client.server_version // 10000 == pg_db.cluster.major
    assert client.backend_pid == pg_db.fetchval(
        "SELECT pid FROM pg_stat_activity WHERE application_name = 'cdcd-test'"
    )
    # The session GUCs arrived through the startup options.
    rows = await client.simple_query("SHOW TimeZone")
    assert rows == [["UTC"]]
    assert await client.simple_query("SHOW extra_float_digits") == [["3"]]


async def test_slot_lifecycle_stream_and_feedback(
    client: ReplicationClient, pg_db: PgDatabase
) -> None:
    setup_table(pg_db)
    major = pg_db.cluster.major
    created = await client.create_slot("s1", two_phase=major >= 15)
    assert created.slot_name == "s1"
    assert created.snapshot_name is None
    assert created.consistent_point > 0
    with pytest.raises(SlotExists, match="already exists"):
        await client.create_slot("s1")

    conn = await asyncpg.connect(**params_for(pg_db).to_asyncpg_kwargs())
    try:
        info = await slots.slot_info(conn, "s1")
        assert info is not None
        assert (info.plugin, info.database, info.active) == ("pgoutput", pg_db.name, False)
        assert info.two_phase is True
        assert info.wal_status == "reserved"
        assert await slots.slot_info(conn, "missing") is None
    finally:
        await conn.close()

    pg_db.execute("INSERT INTO \"Items\" VALUES (1, 'a'), (2, 'b')")
    await client.start_replication(
        "s1", 0, {"proto_version": str(MAX_PROTO[major]), "publication_names": '"pub"'}
    )
    txn = await read_transaction(client)
    kinds = [data[:1] for _, data in txn]
    assert kinds == [b"B", b"R", b"I", b"I", b"C"]
    end = commit_end_lsn(txn[-1][1])
    assert end > created.consistent_point
    assert pg_db.fetchval("SELECT active FROM pg_replication_slots WHERE slot_name = 's1'")

    # Feedback: confirmed_flush_lsn moves exactly to what we said is flushed, never further.
    begin_lsn = txn[0][0]
    client.set_positions(written=end, flushed=begin_lsn)
    await client.send_status()
    sql = "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = 's1'"
    assert wait_for(pg_db, sql, format_lsn(begin_lsn)) == format_lsn(begin_lsn)
    client.set_positions(written=end, flushed=end)
    client.set_positions(written=0, flushed=begin_lsn)  # going back is ignored
    assert client.positions == (end, end, end)
    await client.send_status()
    assert wait_for(pg_db, sql, format_lsn(end)) == format_lsn(end)
    assert parse_lsn(str(pg_db.fetchval(sql))) == end

    await client.close()
    # close() ended the stream cleanly: the walsender goes away, the slot becomes inactive.
    active = "SELECT active FROM pg_replication_slots WHERE slot_name = 's1'"
    assert wait_for(pg_db, active, False) is False

    other = await ReplicationClient.connect(params_for(pg_db))
    try:
        await other.drop_slot("s1")
        assert pg_db.slots() == []
        with pytest.raises(DefiniteSourceError, match="does not exist"):
            await other.drop_slot("s1")
    finally:
        await other.close()


async def test_every_protocol_version(pg_db: PgDatabase) -> None:
    setup_table(pg_db)
    params = params_for(pg_db)
    async with await ReplicationClient.connect(params) as c:
        await c.create_slot("protos")
    pg_db.execute("INSERT INTO \"Items\" VALUES (1, 'x')")
    for proto in range(1, MAX_PROTO[pg_db.cluster.major] + 1):
        # Nothing is confirmed, so every connection receives the same transaction again.
        async with await ReplicationClient.connect(params) as c:
            await c.start_replication(
                "protos", 0, {"proto_version": str(proto), "publication_names": ["pub"]}
            )
            kinds = [data[:1] for _, data in await read_transaction(c)]
            assert kinds == [b"B", b"R", b"I", b"C"], proto


async def test_keepalive_reply_keeps_connection_alive(pg_db: PgDatabase) -> None:
    """wal_sender_timeout=2s (USERSET, via the startup options) and no timer-driven status:
    only the answers to reply-requested keepalives keep the walsender from timing out."""
    setup_table(pg_db)
    client = await ReplicationClient.connect(
        params_for(pg_db), extra_gucs={"wal_sender_timeout": "2s"}, status_interval=3600
    )
    try:
        assert await client.simple_query("SHOW wal_sender_timeout") == [["2s"]]
        await client.create_slot("ka")
        await client.start_replication("ka", 0, {"proto_version": "1", "publication_names": "pub"})
        requested = 0
        started = time.monotonic()
        async with asyncio.timeout(60):
            async for msg in client.messages():
                if isinstance(msg, PrimaryKeepalive) and msg.reply_requested:
                    requested += 1
                if time.monotonic() - started > 5 and requested >= 2:
                    break
        # Still streaming after more than twice the timeout: a change arrives.
        pg_db.execute("INSERT INTO \"Items\" VALUES (7, 'late')")
        kinds = [data[:1] for _, data in await read_transaction(client)]
        assert b"I" in kinds
        assert (
            pg_db.fetchval(
                "SELECT count(*) FROM pg_stat_replication WHERE application_name = 'cdcd'"
            )
            == 1
        )
    finally:
        await client.close()


async def test_second_consumer_is_transient_error(pg_db: PgDatabase) -> None:
    setup_table(pg_db)
    params = params_for(pg_db)
    first = await ReplicationClient.connect(params)
    second = await ReplicationClient.connect(params)
    try:
        await first.create_slot("busy")
        await first.start_replication("busy", 0, {"proto_version": "1", "publication_names": "pub"})
        with pytest.raises(TransientSourceError, match="active") as info:
            await second.start_replication(
                "busy", 0, {"proto_version": "1", "publication_names": "pub"}
            )
        assert "55006" not in str(info.value) or "active for PID" in str(info.value)
        # The failed command left the connection usable.
        assert (await second.identify_system()).dbname == pg_db.name
    finally:
        await second.close()
        await first.close()


async def test_missing_slot_and_publication_are_definite(
    client: ReplicationClient, pg_db: PgDatabase
) -> None:
    with pytest.raises(DefiniteSourceError, match="does not exist"):
        await client.start_replication(
            "nope", 0, {"proto_version": "1", "publication_names": "pub"}
        )
    if pg_db.cluster.major >= 18:
        return  # 18 only warns ("skipped loading publication") and streams on
    await client.create_slot("nopub")
    await client.start_replication(
        "nopub", 0, {"proto_version": "1", "publication_names": '"missing_pub"'}
    )
    pg_db.execute("CREATE TABLE t (id int PRIMARY KEY); INSERT INTO t VALUES (1)")
    with pytest.raises(DefiniteSourceError, match="missing_pub"):
        async with asyncio.timeout(30):
            async for _ in client.messages():
                pass


async def test_terminated_walsender_is_transient(pg_db: PgDatabase) -> None:
    setup_table(pg_db)
    client = await ReplicationClient.connect(params_for(pg_db), application_name="to-kill")
    try:
        await client.create_slot("kill")
        await client.start_replication(
            "kill", 0, {"proto_version": "1", "publication_names": "pub"}
        )
        pg_db.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_replication WHERE application_name = 'to-kill'"
        )
        with pytest.raises(TransientSourceError):
            async with asyncio.timeout(30):
                async for _ in client.messages():
                    pass
    finally:
        await client.close()


async def test_connection_refused_is_transient() -> None:
    params = ConnParams(host="127.0.0.1", port=free_port(), user="x", dbname="x", sslmode="disable")
    with pytest.raises(TransientSourceError, match="cannot connect"):
        await ReplicationClient.connect(params, connect_timeout=5)


async def test_unix_socket_connection(pg_db: PgDatabase) -> None:
    cluster = pg_db.cluster
    params = ConnParams(
        host=str(cluster.socket_dir), port=cluster.port, user="postgres", dbname=pg_db.name
    )
    async with await ReplicationClient.connect(params) as c:
        assert (await c.identify_system()).dbname == pg_db.name
        assert not c.tls


def test_under_uvloop(pg_db: PgDatabase) -> None:
    uvloop = pytest.importorskip("uvloop")
    setup_table(pg_db)

    async def main() -> list[bytes]:
        async with await ReplicationClient.connect(params_for(pg_db)) as c:
            await c.create_slot("uv")
            pg_db.execute("INSERT INTO \"Items\" VALUES (1, 'uv')")
            await c.start_replication("uv", 0, {"proto_version": "1", "publication_names": "pub"})
            return [data[:1] for _, data in await read_transaction(c)]

    assert uvloop.run(main()) == [b"B", b"R", b"I", b"C"]


async def test_sql_helpers(pg_db: PgDatabase) -> None:
    pg_db.execute(
        'CREATE SCHEMA "Sales"; CREATE TABLE "Sales"."Orders" (id int PRIMARY KEY); CREATE TABLE plain (id int PRIMARY KEY)'
    )
    conn = await asyncpg.connect(**params_for(pg_db).to_asyncpg_kwargs())
    try:
        assert await slots.check_wal_level(conn) == "logical"
        assert await slots.ensure_publication(conn, "Pub One", ["Sales.Orders", "public.plain"])
        assert not await slots.ensure_publication(conn, "Pub One", None)
        assert await slots.publication_tables(conn, "Pub One") == ["Sales.Orders", "public.plain"]
        assert await slots.ensure_publication(conn, "all", None)
        assert await slots.publication_exists(conn, "all")
        privileges = await slots.check_privileges(conn)
        assert privileges["rolsuper"] and privileges["can_replicate"]
        pg_db.execute("CREATE ROLE plain_user LOGIN")
        privileges = await slots.check_privileges(conn, "plain_user")
        assert privileges == {
            "rolreplication": False,
            "rolsuper": False,
            "create_on_database": False,
            "can_replicate": False,
        }
        with pytest.raises(DefiniteSourceError):
            await slots.ensure_publication(conn, "bad", ["public.no_such_table"])
    finally:
        await conn.close()
        pg_db.execute("DROP ROLE IF EXISTS plain_user")


async def test_backpressure_bounds_buffering(pg_db: PgDatabase) -> None:
    """A consumer that does not pull leaves the data in the socket: the client buffers about
    HIGH_WATER bytes, then the whole transaction still arrives once it is consumed."""
    setup_table(pg_db)
    rows = 150_000
    async with await ReplicationClient.connect(params_for(pg_db)) as c:
        await c.create_slot("bp")
        pg_db.execute(
            f"INSERT INTO \"Items\" SELECT g, repeat('x', 40) FROM generate_series(1, {rows}) g"
        )
        await c.start_replication("bp", 0, {"proto_version": "1", "publication_names": "pub"})
        async with asyncio.timeout(60):
            while c.buffered < HIGH_WATER:
                await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # reading is paused: nothing more piles up
        assert c.buffered < HIGH_WATER + (1 << 20)
        inserts = 0
        async with asyncio.timeout(120):
            async for msg in c.messages():
                if isinstance(msg, XLogData):
                    kind = bytes(msg.data[:1])
                    inserts += kind == b"I"
                    if kind == b"C":
                        break
        assert inserts == rows


async def test_invalidated_slot_is_definite(pg_db: PgDatabase) -> None:
    """A slot that fell behind max_slot_wal_keep_size is lost: START_REPLICATION fails with a
    definite error telling the operator to re-create it and re-snapshot."""
    cluster = pg_db.cluster
    setup_table(pg_db)
    async with await ReplicationClient.connect(params_for(pg_db)) as c:
        await c.create_slot("lost")
    cluster.set_settings(max_slot_wal_keep_size="1MB")
    cluster.reload()
    try:
        status = "SELECT wal_status FROM pg_replication_slots WHERE slot_name = 'lost'"
        for i in range(10):
            pg_db.execute(f"INSERT INTO \"Items\" VALUES ({i}, 'x'); SELECT pg_switch_wal()")
            pg_db.execute("CHECKPOINT")
            if pg_db.fetchval(status) == "lost":
                break
        assert pg_db.fetchval(status) == "lost"
    finally:
        cluster.set_settings(max_slot_wal_keep_size=None)
        cluster.reload()
    async with await ReplicationClient.connect(params_for(pg_db)) as c:
        with pytest.raises(DefiniteSourceError, match="re-create") as err:
            await c.start_replication("lost", 0, {"proto_version": "1", "publication_names": "pub"})
            async with asyncio.timeout(30):
                async for _ in c.messages():
                    pass
        assert "lost" in str(err.value)
