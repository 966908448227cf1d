"""Connection parameters: libpq connection strings, environment variables and ``~/.pgpass``.

PostgreSQL docs, libpq "Connection Strings" (34.1.1), "Parameter Key Words" (34.1.2),
"Environment Variables" (34.15), "The Password File" (34.16), "SSL Support" (34.19).

Both forms of a connection string are accepted:

* URL: ``postgresql://user:secret@host:5432/db?sslmode=require&application_name=x``
  (also ``postgres://``); every part is percent-decoded; ``[::1]`` for IPv6 hosts;
  ``ssl=true`` means ``sslmode=require`` as in libpq.
* key/value: ``host=db port=5432 dbname=shop user=cdc password='it''s'`` with libpq's
  rules: spaces around ``=`` allowed, values in single quotes may hold spaces, a backslash
  escapes the next character (quoted or not).

Several hosts, as libpq reads them (34.1.1.3 "Specifying Multiple Hosts"): ``host=a,b
port=5432,5433`` (one port for all hosts, or one per host; an empty item is the default),
``hostaddr`` likewise, and the URL form ``postgresql://a:5432,b:5433/db``.
``target_session_attrs`` (``any``, ``read-write``, ``read-only``, ``primary``, ``standby``,
``prefer-standby``) says which of them a connection may use; :meth:`ConnParams.each_host`
gives the hosts in order and :func:`accepts` decides, from what the server reports, whether
one will do (the connecting itself is :mod:`cdcd.replication.hosts`).

Precedence, as in libpq: what the string says, then ``PG*`` environment variables, then
defaults (host ``localhost``, port 5432, user = OS user, dbname = user, sslmode ``prefer``).
The password, when neither string nor ``PGPASSWORD`` has one, comes from the password file
(``passfile``/``PGPASSFILE``/``~/.pgpass``), which is ignored when group or world can read it.

Invariants: the result is a frozen :class:`ConnParams`; its ``repr`` never shows the password;
the password file is consulted per host; unknown
keywords are a :class:`ConfigError` naming the keyword. This module reads files (password
file, certificates for :func:`ssl_context`) but opens no sockets.
"""

from __future__ import annotations

import getpass
import os
import re
import ssl
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, cast, get_args

from cdcd.errors import ConfigError

#: GUCs every connection to the source sets (replication and SQL), so text values decode the
#: same on every server.
DEFAULT_GUCS: dict[str, str] = {
    "DateStyle": "ISO,MDY",
    "TimeZone": "UTC",
    "IntervalStyle": "iso_8601",
    "extra_float_digits": "3",
    "bytea_output": "hex",
    "lc_monetary": "C",
}


SslMode = Literal["disable", "allow", "prefer", "require", "verify-ca", "verify-full"]
SSL_MODES: tuple[str, ...] = get_args(SslMode)
TargetSessionAttrs = Literal[
    "any", "read-write", "read-only", "primary", "standby", "prefer-standby"
]
TARGET_SESSION_ATTRS: tuple[str, ...] = get_args(TargetSessionAttrs)

DEFAULT_PORT = 5432

#: Keywords cdcd uses, with the environment variable libpq reads for each.
_ENV = {
    "host": "PGHOST",
    "hostaddr": "PGHOSTADDR",
    "port": "PGPORT",
    "dbname": "PGDATABASE",
    "user": "PGUSER",
    "password": "PGPASSWORD",
    "passfile": "PGPASSFILE",
    "sslmode": "PGSSLMODE",
    "sslrootcert": "PGSSLROOTCERT",
    "sslcert": "PGSSLCERT",
    "sslkey": "PGSSLKEY",
    "connect_timeout": "PGCONNECT_TIMEOUT",
    "application_name": "PGAPPNAME",
    "options": "PGOPTIONS",
    "target_session_attrs": "PGTARGETSESSIONATTRS",
}

#: libpq keywords cdcd accepts and ignores (they tune things cdcd does its own way).
_IGNORED = frozenset(
    {
        "client_encoding",  # cdcd always speaks UTF8
        "fallback_application_name",
        "gssencmode",
        "keepalives",
        "keepalives_count",
        "keepalives_idle",
        "keepalives_interval",
        "krbsrvname",
        "load_balance_hosts",
        "sslcompression",
        "sslcrl",
        "sslcrldir",
        "sslsni",
        "tcp_user_timeout",
        "channel_binding",
    }
)


@dataclass(frozen=True, slots=True)
class Endpoint:
    """One host of a multi-host connection string, with the password that applies to it."""

    host: str
    port: int = DEFAULT_PORT
    hostaddr: str | None = None
    password: str | None = field(default=None, repr=False)

    def describe(self) -> str:
        return f"{self.host}:{self.port}" if not self.hostaddr else f"{self.hostaddr}:{self.port}"


@dataclass(frozen=True, slots=True)
class ConnParams:
    """Everything needed to open a connection to a PostgreSQL server.

    ``host`` starting with ``/`` is a Unix-socket directory. ``hostaddr`` (optional) is the
    numeric address to connect to while ``host`` stays the name checked against the server
    certificate. ``connect_timeout`` is seconds or None (wait as long as the OS does).

    With several hosts, ``hosts`` lists them all in order (``host``/``port``/``hostaddr``/
    ``password`` are the first one's); with one host ``hosts`` is empty.
    ``target_session_attrs`` says which server a connection may use (see :func:`accepts`).
    """

    host: str = "localhost"
    port: int = DEFAULT_PORT
    dbname: str = ""
    user: str = ""
    password: str | None = field(default=None, repr=False)
    hostaddr: str | None = None
    sslmode: SslMode = "prefer"
    sslrootcert: str | None = None
    sslcert: str | None = None
    sslkey: str | None = None
    connect_timeout: float | None = None
    application_name: str | None = None
    options: str | None = None
    hosts: tuple[Endpoint, ...] = ()
    target_session_attrs: TargetSessionAttrs = "any"

    def __repr__(self) -> str:
        shown = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "password":
                value = None if value is None else "***"
            shown.append(f"{f.name}={value!r}")
        return f"ConnParams({', '.join(shown)})"

    __str__ = __repr__

    @property
    def is_unix_socket(self) -> bool:
        return self.host.startswith("/") and not self.hostaddr

    @property
    def socket_path(self) -> str:
        """The Unix-socket file for a socket-directory host: ``<dir>/.s.PGSQL.<port>``."""
        return os.path.join(self.host, f".s.PGSQL.{self.port}")

    def describe(self) -> str:
        """A password-free ``user@host:port/db`` (``user@a:1,b:2/db``) for logs and errors."""
        if len(self.hosts) > 1:
            where = ",".join(e.describe() for e in self.hosts)
            return f"{self.user}@{where}/{self.dbname}"
        host = self.host if not self.hostaddr else f"{self.host} ({self.hostaddr})"
        return f"{self.user}@{host}:{self.port}/{self.dbname}"

    def with_password(self, password: str | None) -> ConnParams:
        hosts = tuple(replace(e, password=password) for e in self.hosts)
        return replace(self, password=password, hosts=hosts)

    def endpoints(self) -> tuple[Endpoint, ...]:
        """Every host, in the order connections try them."""
        if self.hosts:
            return self.hosts
        return (Endpoint(self.host, self.port, self.hostaddr, self.password),)

    def each_host(self) -> list[ConnParams]:
        """One single-host :class:`ConnParams` per host, in order (libpq tries them so)."""
        if not self.hosts:
            return [self]
        return [
            replace(
                self, host=e.host, port=e.port, hostaddr=e.hostaddr, password=e.password, hosts=()
            )
            for e in self.hosts
        ]

    def to_asyncpg_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``asyncpg.connect`` opening the same server, same TLS rules."""
        kwargs: dict[str, Any] = {
            "host": self.hostaddr or self.host,
            "port": self.port,
            "user": self.user,
            "password": self.password,
            "database": self.dbname,
        }
        if self.sslmode in ("disable", "allow", "prefer") or self.is_unix_socket:
            # asyncpg implements disable/allow/prefer itself, without verification like libpq
            # when no root certificate is configured.
            kwargs["ssl"] = "disable" if self.is_unix_socket else self.sslmode
        else:
            kwargs["ssl"] = ssl_context(self)
        if self.connect_timeout is not None:
            kwargs["timeout"] = self.connect_timeout
        settings: dict[str, str] = {}
        if self.application_name:
            settings["application_name"] = self.application_name
        if settings:
            kwargs["server_settings"] = settings
        return kwargs


# --------------------------------------------------------------------------- parsing


def parse_dsn(
    dsn: str = "",
    *,
    environ: Mapping[str, str] | None = None,
    use_passfile: bool = True,
    **overrides: str | int | float | None,
) -> ConnParams:
    """Parse a libpq connection string (URL or key/value) into :class:`ConnParams`.

    ``environ`` defaults to ``os.environ``; ``overrides`` (keyword -> value, None ignored)
    win over the string, like later keywords in a libpq string do.
    """
    env = os.environ if environ is None else environ
    dsn = dsn.strip()
    if dsn.startswith(("postgresql://", "postgres://")):
        given = _parse_url(dsn)
    elif dsn:
        given = _parse_keyvalue(dsn)
    else:
        given = {}
    for key, value in overrides.items():
        if value is not None:
            given[key] = str(value)
    for key in given:
        if key not in _ENV and key not in _IGNORED:
            raise ConfigError(f"invalid connection option {key!r} in the connection string")
    if given.get("channel_binding") == "require":
        raise ConfigError(
            "channel_binding=require is not supported by cdcd (SCRAM without channel binding)"
        )

    values: dict[str, str] = {}
    for key, var in _ENV.items():
        if key in given:
            values[key] = given[key]
        elif env.get(var):
            values[key] = env[var]
    return _build(values, env, use_passfile)


def _build(values: dict[str, str], env: Mapping[str, str], use_passfile: bool) -> ConnParams:
    endpoints = _endpoints(values)
    user = values.get("user") or _os_user()
    dbname = values.get("dbname") or user

    sslrootcert = values.get("sslrootcert") or None
    sslmode_text = values.get("sslmode")
    if sslmode_text is None:
        sslmode_text = "verify-full" if sslrootcert == "system" else "prefer"
    if sslmode_text not in SSL_MODES:
        raise ConfigError(
            f"invalid sslmode {sslmode_text!r}: expected one of {', '.join(SSL_MODES)}"
        )
    if sslrootcert == "system" and sslmode_text != "verify-full":
        raise ConfigError(
            f"sslmode={sslmode_text} may not be used with sslrootcert=system (use verify-full)"
        )

    timeout: float | None = None
    if values.get("connect_timeout"):
        try:
            timeout = float(values["connect_timeout"])
        except ValueError:
            raise ConfigError(
                f"invalid connect_timeout {values['connect_timeout']!r}: expected seconds"
            ) from None
        # libpq: 0 (or negative) means wait indefinitely; values below 2 act as 2.
        timeout = None if timeout <= 0 else max(timeout, 2.0)

    target = values.get("target_session_attrs") or "any"
    if target not in TARGET_SESSION_ATTRS:
        raise ConfigError(
            f"invalid target_session_attrs {target!r}: expected one of "
            f"{', '.join(TARGET_SESSION_ATTRS)}"
        )

    first = endpoints[0]
    params = ConnParams(
        host=first.host,
        port=first.port,
        dbname=dbname,
        user=user,
        password=values.get("password"),
        hostaddr=first.hostaddr,
        sslmode=cast(SslMode, sslmode_text),
        sslrootcert=sslrootcert,
        sslcert=values.get("sslcert") or None,
        sslkey=values.get("sslkey") or None,
        connect_timeout=timeout,
        application_name=values.get("application_name") or None,
        options=values.get("options") or None,
        target_session_attrs=cast(TargetSessionAttrs, target),
    )
    passfile = values.get("passfile") or _default_passfile(env)
    if params.password is not None or not use_passfile or not passfile:
        passwords = [params.password] * len(endpoints)
    else:  # the password file is read per host, as libpq does
        passwords = [
            lookup_pgpass(passfile, replace(params, host=e.host, port=e.port)) for e in endpoints
        ]
    hosts = tuple(replace(e, password=pw) for e, pw in zip(endpoints, passwords, strict=True))
    return replace(params, password=passwords[0], hosts=hosts if len(hosts) > 1 else ())


def _endpoints(values: dict[str, str]) -> list[Endpoint]:
    """The hosts of ``host``/``hostaddr``/``port`` (comma lists, libpq's matching rules)."""
    names = values["host"].split(",") if values.get("host") else None
    addrs = values["hostaddr"].split(",") if values.get("hostaddr") else None
    if names is not None and addrs is not None and len(names) != len(addrs):
        raise ConfigError(
            f"could not match {len(names)} host names to {len(addrs)} hostaddr values "
            "in the connection string"
        )
    count = len(names or addrs or [""])
    ports = (values.get("port") or "").split(",")
    if len(ports) == 1:
        ports *= count
    elif len(ports) != count:
        raise ConfigError(
            f"could not match {len(ports)} port numbers to {count} hosts in the connection string"
        )
    endpoints = []
    for i in range(count):
        port_text = ports[i].strip() or str(DEFAULT_PORT)
        try:
            port = int(port_text)
            if not 0 < port < 65536:
                raise ValueError
        except ValueError:
            raise ConfigError(f"invalid port {port_text!r} in the connection string") from None
        host = (names[i] if names else "") or "localhost"
        endpoints.append(Endpoint(host, port, (addrs[i] if addrs else "") or None))
    return endpoints


def accepts(target: str, *, in_hot_standby: bool, read_only: bool) -> bool:
    """Whether a server suits ``target_session_attrs`` (libpq's meaning): ``read_only`` is
    ``default_transaction_read_only``, ``in_hot_standby`` whether it is a standby.
    ``prefer-standby`` accepts a standby here; failing one, any server will do (a second
    pass with ``any``)."""
    if target in ("primary", "read-write") and in_hot_standby:
        return False
    if target in ("standby", "prefer-standby"):
        return in_hot_standby
    if target == "read-write":
        return not read_only
    if target == "read-only":
        return read_only or in_hot_standby
    return True


def _os_user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "postgres"


def _parse_keyvalue(text: str) -> dict[str, str]:
    """libpq ``key=value`` strings (fe-connect.c conninfo_parse)."""
    out: dict[str, str] = {}
    i, n = 0, len(text)
    while i < n:
        while i < n and text[i].isspace():
            i += 1
        if i >= n:
            break
        start = i
        while i < n and not text[i].isspace() and text[i] != "=":
            i += 1
        key = text[start:i]
        while i < n and text[i].isspace():
            i += 1
        if i >= n or text[i] != "=":
            raise ConfigError(f'missing "=" after {key!r} in the connection string')
        i += 1
        while i < n and text[i].isspace():
            i += 1
        value: list[str] = []
        if i < n and text[i] == "'":
            i += 1
            while True:
                if i >= n:
                    raise ConfigError(
                        f"unterminated quoted string for {key!r} in the connection string"
                    )
                ch = text[i]
                if ch == "\\" and i + 1 < n:
                    value.append(text[i + 1])
                    i += 2
                elif ch == "'":
                    i += 1
                    break
                else:
                    value.append(ch)
                    i += 1
        else:
            while i < n and not text[i].isspace():
                if text[i] == "\\" and i + 1 < n:
                    value.append(text[i + 1])
                    i += 2
                else:
                    value.append(text[i])
                    i += 1
        out[key] = "".join(value)
    return out


_PERCENT = re.compile(r"%(?![0-9A-Fa-f]{2})")


def _decode(part: str, what: str) -> str:
    if _PERCENT.search(part):
        raise ConfigError(f"invalid percent-encoded token in the {what} of the connection URL")
    raw = bytearray()
    i = 0
    while i < len(part):
        if part[i] == "%":
            raw.append(int(part[i + 1 : i + 3], 16))
            i += 3
        else:
            raw += part[i].encode()
            i += 1
    if 0 in raw:
        raise ConfigError(f"forbidden %00 in the {what} of the connection URL")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"the {what} of the connection URL is not valid UTF-8") from None


def _parse_url(url: str) -> dict[str, str]:
    """libpq URLs (fe-connect.c conninfo_uri_parse_options)."""
    out: dict[str, str] = {}
    rest = url.split("://", 1)[1]
    rest, _, query = rest.partition("?")
    authority, slash, path = rest.partition("/")
    if "@" in authority:
        userinfo, _, authority = authority.rpartition("@")
        user, colon, password = userinfo.partition(":")
        if user:
            out["user"] = _decode(user, "user")
        if colon:
            out["password"] = _decode(password, "password")
    hosts, ports = [], []
    for spec in authority.split(","):  # host[:port], one per host (libpq 34.1.1.3)
        if spec.startswith("["):
            host, bracket, after = spec[1:].partition("]")
            if not bracket:
                raise ConfigError("missing ']' after an IPv6 host in the connection URL")
            if after and not after.startswith(":"):
                raise ConfigError(f"unexpected {after!r} after the IPv6 host in the connection URL")
            port = after[1:]
        else:
            host, _, port = spec.partition(":")
        hosts.append(_decode(host, "host"))
        ports.append(_decode(port, "port"))
    if any(hosts):
        out["host"] = ",".join(hosts)
    if any(ports):
        out["port"] = ",".join(ports)
    if slash and path:
        out["dbname"] = _decode(path, "database name")
    if query:
        for item in query.split("&"):
            if not item:
                continue
            key, eq, value = item.partition("=")
            if not eq:
                raise ConfigError(f'missing "=" in URL parameter {item!r}')
            key = _decode(key, "parameters")
            value = _decode(value, "parameters")
            if key == "ssl" and value == "true":
                key, value = "sslmode", "require"
            out[key] = value
    return out


# --------------------------------------------------------------------------- password file


def _default_passfile(env: Mapping[str, str]) -> str | None:
    if env.get("PGPASSFILE"):
        return env["PGPASSFILE"]
    home = env.get("HOME") or os.path.expanduser("~")
    return os.path.join(home, ".pgpass") if home and home != "~" else None


def _split_pgpass_line(line: str) -> list[str]:
    parts: list[str] = []
    current: list[str] = []
    i = 0
    while i < len(line):
        ch = line[i]
        if ch == "\\" and i + 1 < len(line):
            current.append(line[i + 1])
            i += 2
            continue
        if ch == ":" and len(parts) < 4:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
        i += 1
    parts.append("".join(current))
    return parts


def lookup_pgpass(path: str, params: ConnParams) -> str | None:
    """The password for ``params`` from a libpq password file, or None.

    Lines are ``hostname:port:database:username:password``; ``*`` matches anything; ``\\``
    escapes ``:`` and ``\\``; a Unix-socket connection matches hostname ``localhost``. A
    missing file, a file that is not a regular file, or one readable by group or others (as
    libpq insists) gives None.
    """
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        return None
    host = "localhost" if params.is_unix_socket else params.host
    wanted = (host, str(params.port), params.dbname, params.user)
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            lines = fh.read().splitlines()
    except OSError:
        return None
    for line in lines:
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        parts = _split_pgpass_line(line)
        if len(parts) != 5:
            continue
        if all(p == "*" or p == w for p, w in zip(parts[:4], wanted, strict=True)):
            return parts[4]
    return None


# --------------------------------------------------------------------------- TLS


def _dot_postgresql(name: str) -> str | None:
    path = os.path.expanduser(os.path.join("~", ".postgresql", name))
    return path if os.path.exists(path) else None


def ssl_context(params: ConnParams) -> ssl.SSLContext | None:
    """The TLS context libpq would use for ``params.sslmode``, or None for ``disable``.

    Verification follows libpq: a root certificate (``sslrootcert`` or
    ``~/.postgresql/root.crt``) turns on chain verification for any mode; ``verify-ca`` and
    ``verify-full`` demand one; only ``verify-full`` checks the host name;
    ``sslrootcert=system`` uses the system's trusted CAs. A client certificate comes from
    ``sslcert``/``sslkey`` or ``~/.postgresql/postgresql.crt``/``.key`` when present.
    """
    if params.sslmode == "disable":
        return None
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    rootcert = params.sslrootcert or _dot_postgresql("root.crt")
    try:
        if rootcert == "system":
            ctx.load_default_certs(ssl.Purpose.SERVER_AUTH)
            ctx.verify_mode = ssl.CERT_REQUIRED
        elif rootcert:
            ctx.load_verify_locations(cafile=rootcert)
            ctx.verify_mode = ssl.CERT_REQUIRED
        elif params.sslmode in ("verify-ca", "verify-full"):
            raise ConfigError(
                f"sslmode={params.sslmode} needs a root certificate: set sslrootcert "
                "(or PGSSLROOTCERT, or put it at ~/.postgresql/root.crt)"
            )
        if params.sslmode == "verify-full":
            ctx.check_hostname = True
        cert = params.sslcert or _dot_postgresql("postgresql.crt")
        if cert:
            key = params.sslkey or (None if params.sslcert else _dot_postgresql("postgresql.key"))
            ctx.load_cert_chain(cert, key)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"cannot load TLS certificates for {params.describe()}: {exc}") from exc
    return ctx
