"""Ordinary SQL about slots, publications and privileges, over an asyncpg connection.

PostgreSQL docs, "pg_replication_slots" (catalog views 54.19), "pg_publication" /
"pg_publication_tables", "CREATE PUBLICATION", "Logical Replication: Security" (31.10),
"wal_level" (20.5.1).

Everything takes an open asyncpg connection (``conn``) on the source database. Which columns
of ``pg_replication_slots`` exist depends on the server version: ``wal_status``/
``safe_wal_size`` since 13, ``two_phase`` 14, ``conflicting`` 16, ``invalidation_reason``,
``failover``, ``synced`` and ``inactive_since`` 17; absent ones read as None.

Errors: asyncpg's exceptions are translated here (one place) through the same SQLSTATE
classification as the replication connection (:func:`cdcd.wire.session.source_error`);
connection failures are :class:`TransientSourceError`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import asyncpg

from cdcd.errors import DefiniteSourceError, SourceError, TransientSourceError
from cdcd.lsn import parse_lsn
from cdcd.wire.frontend import quote_ident, quote_qualified
from cdcd.wire.session import ServerMessage, source_error

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class SlotInfo:
    """One row of ``pg_replication_slots``; LSNs as int (None when unset)."""

    name: str
    plugin: str | None
    slot_type: str
    database: str | None
    temporary: bool
    active: bool
    active_pid: int | None
    restart_lsn: int | None
    confirmed_flush_lsn: int | None
    wal_status: str | None = None
    safe_wal_size: int | None = None
    two_phase: bool | None = None
    conflicting: bool | None = None
    invalidation_reason: str | None = None
    failover: bool | None = None
    synced: bool | None = None

    @property
    def exists(self) -> bool:
        return True

    @property
    def invalidated(self) -> bool:
        return self.wal_status == "lost" or bool(self.invalidation_reason)


@asynccontextmanager
async def _translated(what: str) -> AsyncIterator[None]:
    try:
        yield
    except asyncpg.PostgresError as exc:
        fields = ServerMessage(
            severity=str(getattr(exc, "severity", None) or "ERROR"),
            code=str(getattr(exc, "sqlstate", None) or "XX000"),
            message=str(getattr(exc, "message", None) or exc),
            detail=getattr(exc, "detail", None),
            hint=getattr(exc, "hint", None),
        )
        raise source_error(fields, context=what) from exc
    except (OSError, asyncpg.InterfaceError) as exc:
        raise TransientSourceError(f"{what}: lost the connection to the source: {exc}") from exc


async def _run(what: str, call: Callable[[], Awaitable[T]]) -> T:
    async with _translated(what):
        return await call()


#: for the other catalog modules of cdcd.source: a call with asyncpg's errors translated
run_sql = _run


async def server_version(conn: Any) -> int:
    """``server_version_num`` of the server behind ``conn``."""
    return int(await _run("server_version_num", lambda: conn.fetchval("SHOW server_version_num")))


async def in_recovery(conn: Any) -> bool:
    """Whether the server behind ``conn`` is a standby."""
    return bool(
        await _run("pg_is_in_recovery()", lambda: conn.fetchval("SELECT pg_is_in_recovery()"))
    )


async def slot_info(conn: Any, name: str) -> SlotInfo | None:
    """The slot called ``name``, or None when there is none."""
    version = await server_version(conn)
    optional = [
        ("wal_status", 130000),
        ("safe_wal_size", 130000),
        ("two_phase", 140000),
        ("conflicting", 160000),
        ("invalidation_reason", 170000),
        ("failover", 170000),
        ("synced", 170000),
    ]
    extra = "".join(f", {col}" for col, since in optional if version >= since)
    sql = (
        "SELECT slot_name, plugin, slot_type, database, temporary, active, active_pid, "
        "restart_lsn::text, confirmed_flush_lsn::text"
        f"{extra} FROM pg_replication_slots WHERE slot_name = $1"
    )
    row = await _run(f"reading slot {name!r}", lambda: conn.fetchrow(sql, name))
    if row is None:
        return None
    values = dict(row)
    return SlotInfo(
        name=values["slot_name"],
        plugin=values["plugin"],
        slot_type=values["slot_type"],
        database=values["database"],
        temporary=bool(values["temporary"]),
        active=bool(values["active"]),
        active_pid=values["active_pid"],
        restart_lsn=_lsn(values["restart_lsn"]),
        confirmed_flush_lsn=_lsn(values["confirmed_flush_lsn"]),
        wal_status=values.get("wal_status"),
        safe_wal_size=values.get("safe_wal_size"),
        two_phase=values.get("two_phase"),
        conflicting=values.get("conflicting"),
        invalidation_reason=values.get("invalidation_reason"),
        failover=values.get("failover"),
        synced=values.get("synced"),
    )


def _lsn(text: str | None) -> int | None:
    return None if text is None else parse_lsn(text)


async def publication_exists(conn: Any, name: str) -> bool:
    return bool(
        await _run(
            f"reading publication {name!r}",
            lambda: conn.fetchval(
                "SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)", name
            ),
        )
    )


async def ensure_publication(conn: Any, name: str, tables: list[str] | None) -> bool:
    """Create publication ``name`` (FOR ALL TABLES, or FOR TABLE ``tables``) when missing.

    ``tables`` are ``schema.table`` (or ``table``) names taken exactly as in the catalog.
    Returns True when it created the publication, False when it existed (left unchanged).
    """
    if await publication_exists(conn, name):
        return False
    target = ("TABLE " + ", ".join(quote_qualified(t) for t in tables)) if tables else "ALL TABLES"
    sql = f"CREATE PUBLICATION {quote_ident(name)} FOR {target}"
    try:
        await _run(f"CREATE PUBLICATION {name!r}", lambda: conn.execute(sql))
    except SourceError as exc:
        if "already exists" in str(exc):  # created concurrently by someone else
            return False
        raise
    return True


async def publication_tables(conn: Any, name: str) -> list[str]:
    """``schema.table`` of every table publication ``name`` publishes, sorted."""
    rows = await _run(
        f"reading tables of publication {name!r}",
        lambda: conn.fetch(
            "SELECT schemaname, tablename FROM pg_publication_tables WHERE pubname = $1 "
            "ORDER BY 1, 2",
            name,
        ),
    )
    return [f"{r['schemaname']}.{r['tablename']}" for r in rows]


async def check_wal_level(conn: Any) -> str:
    """The server's ``wal_level``; DefiniteSourceError unless it is ``logical``."""
    level = str(await _run("SHOW wal_level", lambda: conn.fetchval("SHOW wal_level")))
    if level != "logical":
        raise DefiniteSourceError(
            f"wal_level is {level!r} but logical replication needs 'logical': set "
            "wal_level=logical in postgresql.conf and restart the server"
        )
    return level


async def check_privileges(conn: Any, user: str | None = None) -> dict[str, bool]:
    """What ``user`` (default: the connected role) may do.

    Keys: ``rolreplication``, ``rolsuper``, ``create_on_database`` (needed to create a
    publication), ``can_replicate`` (replication attribute or superuser).
    """
    row = await _run(
        "reading role privileges",
        lambda: conn.fetchrow(
            "SELECT r.rolreplication, r.rolsuper, "
            "has_database_privilege(r.rolname, current_database(), 'CREATE') AS create_on_database "
            "FROM pg_roles r WHERE r.rolname = coalesce($1, current_user)",
            user,
        ),
    )
    if row is None:
        raise DefiniteSourceError(f"role {user!r} does not exist on the source")
    result = {
        "rolreplication": bool(row["rolreplication"]),
        "rolsuper": bool(row["rolsuper"]),
        "create_on_database": bool(row["create_on_database"]),
    }
    result["can_replicate"] = result["rolreplication"] or result["rolsuper"]
    return result


@dataclass(frozen=True, slots=True)
class FailoverSetup:
    """What protects a failover slot on the primary (17+): the physical slots listed in
    ``synchronized_standby_slots`` (logical walsenders send nothing before those standbys
    received it) and which of them a standby is streaming from right now."""

    synchronized_standby_slots: tuple[str, ...]
    active: tuple[str, ...]
    in_recovery: bool
    #: physical slots on the server: a standby that synchronises slots streams through one
    physical_slots: int = 0

    @property
    def protected(self) -> bool:
        return bool(self.synchronized_standby_slots)


async def failover_setup(conn: Any) -> FailoverSetup | None:
    """The failover set-up of the server behind ``conn``; None before 17."""
    if await server_version(conn) < 170000:
        return None

    async def read() -> FailoverSetup:
        listed = str(await conn.fetchval("SHOW synchronized_standby_slots") or "")
        names = tuple(n.strip().strip('"') for n in listed.split(",") if n.strip())
        active = await conn.fetch(
            "SELECT slot_name FROM pg_replication_slots WHERE slot_type = 'physical' "
            "AND active AND slot_name = ANY($1::text[]) ORDER BY 1",
            list(names),
        )
        in_recovery = bool(await conn.fetchval("SELECT pg_is_in_recovery()"))
        physical = await conn.fetchval(
            "SELECT count(*) FROM pg_replication_slots WHERE slot_type = 'physical'"
        )
        return FailoverSetup(names, tuple(r[0] for r in active), in_recovery, int(physical))

    return await _run("reading the failover set-up", read)


async def idle_slot_timeout(conn: Any) -> str | None:
    """``idle_replication_slot_timeout`` (18+; "0" when off), None before 18."""
    if await server_version(conn) < 180000:
        return None
    return str(
        await _run(
            "SHOW idle_replication_slot_timeout",
            lambda: conn.fetchval("SHOW idle_replication_slot_timeout"),
        )
    )
