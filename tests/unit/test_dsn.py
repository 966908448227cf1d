"""libpq connection strings, environment defaults and the password file."""

from __future__ import annotations

import os
import ssl
from pathlib import Path
from typing import Any

import pytest

from cdcd.errors import ConfigError
from cdcd.wire.dsn import ConnParams, Endpoint, accepts, lookup_pgpass, parse_dsn, ssl_context

BASE_ENV = {"HOME": "/nonexistent-home"}


def parse(dsn: str, env: dict[str, str] | None = None, **kw: Any) -> ConnParams:
    return parse_dsn(dsn, environ={**BASE_ENV, **(env or {})}, **kw)


@pytest.mark.parametrize(
    ("dsn", "expected"),
    [
        (
            "postgresql://cdc:s3cret@db.example:6543/shop?sslmode=require&application_name=x",
            dict(
                user="cdc",
                password="s3cret",
                host="db.example",
                port=6543,
                dbname="shop",
                sslmode="require",
                application_name="x",
            ),
        ),
        ("postgres://db/shop", dict(host="db", port=5432, dbname="shop")),
        (
            "postgresql://us%40r:p%3Aw%2Fd%25@h/d%20b",
            dict(user="us@r", password="p:w/d%", host="h", dbname="d b"),
        ),
        ("postgresql://[::1]:5433/x", dict(host="::1", port=5433, dbname="x")),
        ("postgresql://%2Fvar%2Frun%2Fpostgresql/x", dict(host="/var/run/postgresql", dbname="x")),
        ("postgresql:///x?host=/tmp&port=5555", dict(host="/tmp", port=5555, dbname="x")),
        ("postgresql://h/x?ssl=true", dict(sslmode="require")),
        ("postgresql://u@h", dict(user="u", dbname="u")),
        ("postgresql://u:@h/d", dict(password="")),
        (
            "host=h port=5433 dbname=shop user=cdc password=pw sslmode=verify-full "
            "sslrootcert=/ca.pem sslcert=/c.pem sslkey=/k.pem connect_timeout=5 application_name=a",
            dict(
                host="h",
                port=5433,
                dbname="shop",
                user="cdc",
                password="pw",
                sslmode="verify-full",
                sslrootcert="/ca.pem",
                sslcert="/c.pem",
                sslkey="/k.pem",
                connect_timeout=5.0,
                application_name="a",
            ),
        ),
        (
            "host = h   password = 'it\\'s a \\\\ secret' dbname=''  user=a\\ b",
            dict(host="h", password="it's a \\ secret", user="a b", dbname="a b"),
        ),
        ("host=h connect_timeout=1", dict(connect_timeout=2.0)),
        ("host=h connect_timeout=0", dict(connect_timeout=None)),
        ("host=h keepalives=1 target_session_attrs=any", dict(host="h")),
        ("host=h hostaddr=10.0.0.1", dict(host="h", hostaddr="10.0.0.1")),
        ("host=h options='-c work_mem=4MB'", dict(options="-c work_mem=4MB")),
    ],
)
def test_parse_forms(dsn: str, expected: dict[str, Any]) -> None:
    params = parse(dsn, use_passfile=False)
    for key, value in expected.items():
        assert getattr(params, key) == value, key


def test_defaults() -> None:
    params = parse("", {"PGUSER": "me"}, use_passfile=False)
    assert params == ConnParams(host="localhost", port=5432, dbname="me", user="me")
    assert params.sslmode == "prefer"


def test_environment_defaults_and_precedence() -> None:
    env = {
        "PGHOST": "envhost",
        "PGPORT": "7000",
        "PGDATABASE": "envdb",
        "PGUSER": "envuser",
        "PGPASSWORD": "envpw",
        "PGSSLMODE": "verify-ca",
        "PGSSLROOTCERT": "/env/ca.pem",
        "PGAPPNAME": "envapp",
        "PGCONNECT_TIMEOUT": "9",
    }
    params = parse("", env)
    assert (params.host, params.port, params.dbname, params.user, params.password) == (
        "envhost",
        7000,
        "envdb",
        "envuser",
        "envpw",
    )
    assert (
        params.sslmode,
        params.sslrootcert,
        params.application_name,
        params.connect_timeout,
    ) == (
        "verify-ca",
        "/env/ca.pem",
        "envapp",
        9.0,
    )
    params = parse("postgresql://u@h:1/d?sslmode=disable", env)
    assert (params.host, params.port, params.dbname, params.user, params.sslmode) == (
        "h",
        1,
        "d",
        "u",
        "disable",
    )
    assert params.password == "envpw"  # not in the string: the environment supplies it
    assert parse("host=h", env, port=9999).port == 9999  # explicit overrides win


@pytest.mark.parametrize(
    ("dsn", "message"),
    [
        ("host=a,b,c port=1,2", "could not match 2 port numbers to 3 hosts"),
        ("host=a,b hostaddr=10.0.0.1", "could not match 2 host names to 1 hostaddr"),
        ("postgresql://a:1,b:x/db", "invalid port 'x'"),
        ("host=a,b target_session_attrs=master", "invalid target_session_attrs 'master'"),
        ("host=h bogus=1", "'bogus'"),
        ("host", 'missing "="'),
        ("password='abc", "unterminated"),
        ("postgresql://h:notaport/db", "invalid port"),
        ("port=70000", "invalid port"),
        ("sslmode=sometimes", "invalid sslmode"),
        ("postgresql://h/db%zz", "percent"),
        ("postgresql://h/db%00", "%00"),
        ("connect_timeout=soon", "connect_timeout"),
        ("sslrootcert=system sslmode=require", "verify-full"),
        ("channel_binding=require", "channel_binding"),
        ("postgresql://[::1/db", "]"),
    ],
)
def test_errors(dsn: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace("[", r"\[")):
        parse(dsn, use_passfile=False)


def test_sslrootcert_system_defaults_to_verify_full() -> None:
    assert parse("sslrootcert=system", use_passfile=False).sslmode == "verify-full"


def test_repr_hides_password() -> None:
    params = parse("postgresql://cdc:topsecret@h/d", use_passfile=False)
    assert "topsecret" not in repr(params)
    assert "topsecret" not in str(params)
    assert "topsecret" not in params.describe()
    assert "password='***'" in repr(params)
    assert "password=None" in repr(parse("host=h", use_passfile=False))


def _pgpass(tmp_path: Path, text: str, mode: int = 0o600) -> Path:
    path = tmp_path / "pgpass"
    path.write_text(text)
    os.chmod(path, mode)
    return path


def test_pgpass_lookup(tmp_path: Path) -> None:
    path = _pgpass(
        tmp_path,
        "# comment\n"
        "other:5432:*:*:wrong\n"
        "h:5432:shop:cdc:first\\:colon\\\\bs\n"
        "*:*:*:cdc:fallback\n"
        "localhost:5432:*:sock:viasocket\n",
    )
    env = {"PGPASSFILE": str(path)}
    assert parse("host=h dbname=shop user=cdc", env).password == "first:colon\\bs"
    assert parse("host=h dbname=other user=cdc", env).password == "fallback"
    assert parse("host=h dbname=other user=nobody", env).password is None
    assert parse("host=/tmp user=sock", env).password == "viasocket"  # Unix socket = localhost
    assert parse("host=h user=cdc password=given", env).password == "given"
    assert parse(f"host=h dbname=shop user=cdc passfile={path}").password == "first:colon\\bs"


def test_pgpass_from_home_and_permissions(tmp_path: Path) -> None:
    _pgpass(tmp_path, "*:*:*:*:pw\n").rename(tmp_path / ".pgpass")
    assert parse("host=h", {"HOME": str(tmp_path)}).password == "pw"
    os.chmod(tmp_path / ".pgpass", 0o644)  # readable by others: libpq ignores it
    assert parse("host=h", {"HOME": str(tmp_path)}).password is None
    params = ConnParams(host="h", user="u", dbname="d")
    assert lookup_pgpass(str(tmp_path / "missing"), params) is None


def test_to_asyncpg_kwargs() -> None:
    params = parse(
        "postgresql://cdc:pw@h:6000/shop?application_name=app&connect_timeout=7&sslmode=disable",
        use_passfile=False,
    )
    assert params.to_asyncpg_kwargs() == {
        "host": "h",
        "port": 6000,
        "user": "cdc",
        "password": "pw",
        "database": "shop",
        "ssl": "disable",
        "timeout": 7.0,
        "server_settings": {"application_name": "app"},
    }
    assert parse("host=h", use_passfile=False).to_asyncpg_kwargs()["ssl"] == "prefer"
    ctx = parse("host=h sslmode=require", use_passfile=False).to_asyncpg_kwargs()["ssl"]
    assert isinstance(ctx, ssl.SSLContext)


def test_ssl_context_modes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.postgresql/root.crt
    assert ssl_context(parse("sslmode=disable", use_passfile=False)) is None
    ctx = ssl_context(parse("sslmode=require", use_passfile=False))
    assert ctx is not None and ctx.verify_mode == ssl.CERT_NONE and not ctx.check_hostname
    with pytest.raises(ConfigError, match="root certificate"):
        ssl_context(parse("sslmode=verify-full", use_passfile=False))
    with pytest.raises(ConfigError, match="cannot load"):
        ssl_context(parse(f"sslmode=verify-ca sslrootcert={tmp_path}/none.pem", use_passfile=False))
    trustme = pytest.importorskip("trustme")
    ca = trustme.CA()
    ca_path = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_path))
    ctx = ssl_context(parse(f"sslmode=verify-ca sslrootcert={ca_path}", use_passfile=False))
    assert ctx is not None and ctx.verify_mode == ssl.CERT_REQUIRED and not ctx.check_hostname
    ctx = ssl_context(parse(f"sslmode=verify-full sslrootcert={ca_path}", use_passfile=False))
    assert ctx is not None and ctx.check_hostname


# --------------------------------------------------------------------------- several hosts


def hosts(params: ConnParams) -> list[tuple[str, int, str | None]]:
    return [(e.host, e.port, e.hostaddr) for e in params.endpoints()]


@pytest.mark.parametrize(
    ("dsn", "expected"),
    [
        ("host=a,b port=5432,5433", [("a", 5432, None), ("b", 5433, None)]),
        ("host=a,b port=6000", [("a", 6000, None), ("b", 6000, None)]),
        ("host=a,b", [("a", 5432, None), ("b", 5432, None)]),
        ("host=a,b port=,5433", [("a", 5432, None), ("b", 5433, None)]),
        ("host=a,,c", [("a", 5432, None), ("localhost", 5432, None), ("c", 5432, None)]),
        (
            "host=a,b hostaddr=10.0.0.1,10.0.0.2",
            [("a", 5432, "10.0.0.1"), ("b", 5432, "10.0.0.2")],
        ),
        ("postgresql://a:5432,b:5433/db", [("a", 5432, None), ("b", 5433, None)]),
        ("postgresql://a,b:5433/db", [("a", 5432, None), ("b", 5433, None)]),
        ("postgresql://a,b/db?port=7000", [("a", 7000, None), ("b", 7000, None)]),
        ("postgresql://[::1]:5432,[::2]:5433/db", [("::1", 5432, None), ("::2", 5433, None)]),
        ("postgresql://u:pw@a:1,b:2/db", [("a", 1, None), ("b", 2, None)]),
        ("postgresql:///db?host=a,b&port=1,2", [("a", 1, None), ("b", 2, None)]),
        ("postgresql://a:5432/db", [("a", 5432, None)]),
    ],
)
def test_several_hosts(dsn: str, expected: list[tuple[str, int, str | None]]) -> None:
    params = parse(dsn, use_passfile=False)
    assert hosts(params) == expected
    assert [(p.host, p.port, p.hostaddr) for p in params.each_host()] == expected
    assert all(not p.hosts for p in params.each_host())
    assert (params.host, params.port) == expected[0][:2]  # the first host's, for messages


def test_several_hosts_from_the_environment() -> None:
    params = parse("dbname=x", {"PGHOST": "a,b", "PGPORT": "1,2"}, use_passfile=False)
    assert hosts(params) == [("a", 1, None), ("b", 2, None)]
    assert params.target_session_attrs == "any"
    env = {"PGTARGETSESSIONATTRS": "primary"}
    assert parse("host=a,b", env, use_passfile=False).target_session_attrs == "primary"
    assert parse("host=a target_session_attrs=standby", env).target_session_attrs == "standby"


@pytest.mark.parametrize(
    "attrs", ["any", "read-write", "read-only", "primary", "standby", "prefer-standby"]
)
def test_target_session_attrs_values(attrs: str) -> None:
    url = parse(f"postgresql://a,b/db?target_session_attrs={attrs}", use_passfile=False)
    kv = parse(f"host=a,b target_session_attrs={attrs}", use_passfile=False)
    assert url.target_session_attrs == kv.target_session_attrs == attrs


def test_several_hosts_describe_and_password() -> None:
    params = parse("postgresql://cdc:pw@a:1,b:2/shop", use_passfile=False)
    assert params.describe() == "cdc@a:1,b:2/shop"
    assert "pw" not in repr(params)
    assert [p.password for p in params.each_host()] == ["pw", "pw"]
    assert [p.password for p in params.with_password("new").each_host()] == ["new", "new"]
    assert params.each_host()[1].describe() == "cdc@b:2/shop"


def test_several_hosts_password_file_per_host(tmp_path: Path) -> None:
    passfile = _pgpass(tmp_path, "a:1:shop:cdc:for-a\nb:2:shop:cdc:for-b\n")
    params = parse("host=a,b,c port=1,2,3 dbname=shop user=cdc", {"PGPASSFILE": str(passfile)})
    assert [p.password for p in params.each_host()] == ["for-a", "for-b", None]
    assert params.password == "for-a"
    explicit = parse(
        "host=a,b port=1,2 dbname=shop user=cdc password=x", {"PGPASSFILE": str(passfile)}
    )
    assert [p.password for p in explicit.each_host()] == ["x", "x"]


def test_one_host_keeps_hosts_empty() -> None:
    params = parse("host=a port=1", use_passfile=False)
    assert params.hosts == ()
    assert params.endpoints() == (Endpoint("a", 1),)
    assert params.each_host() == [params]


@pytest.mark.parametrize(
    ("target", "primary", "read_only_primary", "standby"),
    [
        ("any", True, True, True),
        ("primary", True, True, False),
        ("read-write", True, False, False),
        ("read-only", False, True, True),
        ("standby", False, False, True),
        ("prefer-standby", False, False, True),  # the first pass; the second takes any
    ],
)
def test_accepts(target: str, primary: bool, read_only_primary: bool, standby: bool) -> None:
    assert accepts(target, in_hot_standby=False, read_only=False) is primary
    assert accepts(target, in_hot_standby=False, read_only=True) is read_only_primary
    assert accepts(target, in_hot_standby=True, read_only=False) is standby
