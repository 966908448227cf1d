"""Password authentication (md5, scram-sha-256) and TLS (sslmode) against real servers.

Password tests run on the shared clusters (15/16/18) and restore ``pg_hba.conf`` afterwards.
TLS tests need a server built with OpenSSL (the system 15 here) and get their own cluster,
so turning ``ssl`` on does not change what other tests see.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import asyncpg
import pytest

from cdcd.errors import DefiniteSourceError
from cdcd.replication.client import ReplicationClient
from cdcd.wire.dsn import ConnParams, parse_dsn
from tests.pgharness import (
    PgCluster,
    PgDatabase,
    create_database,
    find_installations,
    quote_literal,
    unique_name,
)

pytestmark = pytest.mark.pg


@pytest.fixture
def hba(pg_cluster: PgCluster) -> Iterator[PgCluster]:
    """The shared cluster, with pg_hba.conf restored after the test."""
    path = pg_cluster.data_dir / "pg_hba.conf"
    saved = path.read_text()
    try:
        yield pg_cluster
    finally:
        path.write_text(saved)
        pg_cluster.reload()


def make_role(cluster: PgCluster, method: str, password: str) -> str:
    role = unique_name(f"r_{method.replace('-', '')}")
    cluster.execute(
        f"SET password_encryption = '{'md5' if method == 'md5' else 'scram-sha-256'}';"
        f"CREATE ROLE {role} LOGIN REPLICATION PASSWORD {quote_literal(password)}"
    )
    return role


def params(db: PgDatabase, user: str, password: str | None, **extra: str) -> ConnParams:
    return parse_dsn(
        db.dsn_for(user=user, password=password, **extra), environ={}, use_passfile=False
    )


@pytest.mark.parametrize("method", ["md5", "scram-sha-256"])
async def test_password_methods(hba: PgCluster, pg_db: PgDatabase, method: str) -> None:
    role = make_role(hba, method, "Pa ss'word")
    stored = hba.fetchval(f"SELECT rolpassword FROM pg_authid WHERE rolname = '{role}'")
    assert stored.startswith("md5" if method == "md5" else "SCRAM-SHA-256$")
    # For replication=database connections the database column matches the database name:
    # a 'replication' line must not catch them (it would reject).
    hba.add_hba(f"host all {role} 127.0.0.1/32 {method}")
    hba.add_hba(f"host replication {role} 127.0.0.1/32 reject")
    async with await ReplicationClient.connect(
        params(pg_db, role, "Pa ss'word", sslmode="disable")
    ) as c:
        info = await c.identify_system()
        assert info.dbname == pg_db.name
        assert await c.simple_query("SELECT current_user") == [[role]]

    with pytest.raises(DefiniteSourceError, match="authentication failed") as err:
        await ReplicationClient.connect(params(pg_db, role, "wrong", sslmode="disable"))
    assert role in str(err.value)
    with pytest.raises(DefiniteSourceError, match="requires a password"):
        await ReplicationClient.connect(params(pg_db, role, None, sslmode="disable"))


async def test_password_from_pgpass(hba: PgCluster, pg_db: PgDatabase, tmp_path: Path) -> None:
    role = make_role(hba, "scram-sha-256", "from-file")
    hba.add_hba(f"host all {role} 127.0.0.1/32 scram-sha-256")
    passfile = tmp_path / "pgpass"
    passfile.write_text(f"127.0.0.1:{hba.port}:{pg_db.name}:{role}:from-file\n")
    os.chmod(passfile, 0o600)
    p = parse_dsn(
        f"host=127.0.0.1 port={hba.port} dbname={pg_db.name} user={role} sslmode=disable",
        environ={"PGPASSFILE": str(passfile)},
    )
    async with await ReplicationClient.connect(p) as c:
        assert (await c.identify_system()).dbname == pg_db.name
    # The same parameters open an asyncpg connection for ordinary SQL.
    conn = await asyncpg.connect(**p.to_asyncpg_kwargs())
    try:
        assert await conn.fetchval("SELECT current_user") == role
    finally:
        await conn.close()


async def test_hba_rejection_and_missing_replication_privilege(
    hba: PgCluster, pg_db: PgDatabase
) -> None:
    role = make_role(hba, "scram-sha-256", "pw")
    hba.add_hba(f"host all {role} 127.0.0.1/32 reject")
    with pytest.raises(DefiniteSourceError, match=r"pg_hba\.conf"):
        await ReplicationClient.connect(params(pg_db, role, "pw", sslmode="disable"))
    hba.execute(f"ALTER ROLE {role} NOREPLICATION")
    hba.add_hba(f"host all {role} 127.0.0.1/32 scram-sha-256")
    with pytest.raises(DefiniteSourceError, match="REPLICATION"):
        await ReplicationClient.connect(params(pg_db, role, "pw", sslmode="disable"))


async def test_sslmode_against_server_without_tls(pg_db: PgDatabase) -> None:
    if pg_db.cluster.fetchval("SHOW ssl") == "on":
        pytest.skip("this cluster has TLS on")
    with pytest.raises(DefiniteSourceError, match="does not support TLS"):
        await ReplicationClient.connect(params(pg_db, "postgres", None, sslmode="require"))
    async with await ReplicationClient.connect(
        params(pg_db, "postgres", None, sslmode="prefer")
    ) as c:
        assert not c.tls
        assert (await c.identify_system()).dbname == pg_db.name


# --------------------------------------------------------------------------- TLS


def _ssl_install() -> object | None:
    return next((i for i in find_installations() if i.supports_ssl), None)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    trustme = pytest.importorskip("trustme")
    base = tmp_path_factory.mktemp("tls")
    ca, other_ca = trustme.CA(), trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    paths = {
        "ca": base / "ca.pem",
        "other_ca": base / "other-ca.pem",
        "cert": base / "server.crt",
        "key": base / "server.key",
    }
    ca.cert_pem.write_to_path(str(paths["ca"]))
    other_ca.cert_pem.write_to_path(str(paths["other_ca"]))
    server.private_key_pem.write_to_path(str(paths["key"]))
    with open(paths["cert"], "wb") as f:
        for blob in server.cert_chain_pems:
            f.write(blob.bytes())
    return paths


@pytest.fixture(scope="module")
def tls_db(certs: dict[str, Path]) -> Iterator[PgDatabase]:
    install = _ssl_install()
    if install is None:
        pytest.skip("no PostgreSQL built with OpenSSL")
    cluster = PgCluster(install)  # type: ignore[arg-type]
    try:
        cluster.start()
        cluster.enable_ssl(certs["cert"], certs["key"])
        assert cluster.fetchval("SHOW ssl") == "on"
        db = create_database(cluster)
        cluster.execute(
            "SET password_encryption = 'scram-sha-256'; CREATE ROLE tls_user LOGIN REPLICATION PASSWORD 'tlspw'"
        )
        # TLS only for this role; without TLS it is rejected.
        cluster.add_hba("host all tls_user 127.0.0.1/32 reject")
        cluster.add_hba("hostssl all tls_user 127.0.0.1/32 scram-sha-256")
        yield db
    finally:
        cluster.destroy()


def tls_params(db: PgDatabase, sslmode: str, **extra: str) -> ConnParams:
    cluster = db.cluster
    text = f"host=127.0.0.1 port={cluster.port} dbname={db.name} user=tls_user password=tlspw sslmode={sslmode}"
    for key, value in extra.items():
        text += f" {key}={value}"
    return parse_dsn(text, environ={"HOME": "/nonexistent"}, use_passfile=False)


async def _ssl_in_use(client: ReplicationClient, db: PgDatabase) -> bool:
    return bool(
        db.cluster.fetchval(f"SELECT ssl FROM pg_stat_ssl WHERE pid = {client.backend_pid}")
    )


@pytest.mark.parametrize("sslmode", ["require", "prefer", "allow"])
async def test_tls_without_verification(tls_db: PgDatabase, sslmode: str) -> None:
    async with await ReplicationClient.connect(tls_params(tls_db, sslmode)) as c:
        assert c.tls
        assert await _ssl_in_use(c, tls_db)
        assert (await c.identify_system()).dbname == tls_db.name


async def test_hostssl_line_forces_tls(tls_db: PgDatabase) -> None:
    with pytest.raises(DefiniteSourceError, match=r"pg_hba\.conf"):
        await ReplicationClient.connect(tls_params(tls_db, "disable"))


async def test_verify_full_and_verify_ca(tls_db: PgDatabase, certs: dict[str, Path]) -> None:
    ca = str(certs["ca"])
    async with await ReplicationClient.connect(
        tls_params(tls_db, "verify-full", sslrootcert=ca)
    ) as c:
        assert c.tls and await _ssl_in_use(c, tls_db)
    # Host name checked against the certificate, address from hostaddr.
    p = replace(
        tls_params(tls_db, "verify-full", sslrootcert=ca, hostaddr="127.0.0.1"), host="localhost"
    )
    async with await ReplicationClient.connect(p) as c:
        assert c.tls
    wrong_name = replace(p, host="db.invalid")
    with pytest.raises(DefiniteSourceError, match="verification failed"):
        await ReplicationClient.connect(wrong_name)
    # verify-ca does not check the name.
    ca_only = replace(wrong_name, sslmode="verify-ca")
    async with await ReplicationClient.connect(ca_only) as c:
        assert c.tls
    with pytest.raises(DefiniteSourceError, match="verification failed"):
        await ReplicationClient.connect(
            tls_params(tls_db, "verify-full", sslrootcert=str(certs["other_ca"]))
        )
    # require with a root certificate verifies the chain too (libpq semantics).
    with pytest.raises(DefiniteSourceError, match="verification failed"):
        await ReplicationClient.connect(
            tls_params(tls_db, "require", sslrootcert=str(certs["other_ca"]))
        )


async def test_asyncpg_kwargs_with_verify_full(tls_db: PgDatabase, certs: dict[str, Path]) -> None:
    p = tls_params(tls_db, "verify-full", sslrootcert=str(certs["ca"]))
    conn = await asyncpg.connect(**p.to_asyncpg_kwargs())
    try:
        assert await conn.fetchval("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
    finally:
        await conn.close()


def test_tls_streaming_under_uvloop(tls_db: PgDatabase, certs: dict[str, Path]) -> None:
    uvloop = pytest.importorskip("uvloop")
    tls_db.execute(
        "CREATE TABLE IF NOT EXISTS uv (id int PRIMARY KEY); CREATE PUBLICATION uvpub FOR TABLE uv"
    )

    async def main() -> list[bytes]:
        p = tls_params(tls_db, "verify-full", sslrootcert=str(certs["ca"]))
        async with await ReplicationClient.connect(p) as c:
            assert c.tls
            await c.create_slot("uvtls")
            tls_db.execute("INSERT INTO uv VALUES (1)")
            await c.start_replication(
                "uvtls", 0, {"proto_version": "1", "publication_names": "uvpub"}
            )
            kinds: list[bytes] = []
            async for msg in c.messages():
                data = getattr(msg, "data", None)
                if data is not None:
                    kinds.append(bytes(data[:1]))
                    if kinds[-1] == b"C":
                        break
            await c.close()
            async with await ReplicationClient.connect(p) as d:
                await d.drop_slot("uvtls")
            return kinds

    assert uvloop.run(main()) == [b"B", b"R", b"I", b"C"]
