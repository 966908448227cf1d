"""The source's one-line questions: WAL positions, slot lag and health, grants, a standby's
slot synchronisation, and logical messages written to the WAL.

Every function takes an open asyncpg connection on the source database. PostgreSQL docs:
"System Administration Functions" (pg_current_wal_insert_lsn, pg_last_wal_replay_lsn,
pg_logical_emit_message), "pg_replication_slots", "pg_publication_tables", "Replica Identity".
"""

from __future__ import annotations

from typing import Any

import asyncpg

from cdcd.errors import DefiniteSourceError

#: the server's WAL position now: replayed on a standby, written on a primary
_WAL_NOW = (
    "CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() ELSE pg_current_wal_lsn() END"
)

_SLOT_LAG_SQL = (
    f"SELECT pg_wal_lsn_diff({_WAL_NOW}, confirmed_flush_lsn)::int8 "
    "FROM pg_replication_slots WHERE slot_name = $1"
)

#: the slot's wal_status, safe_wal_size, the server's WAL position and the WAL the slot retains
_SLOT_HEALTH_SQL = (
    "SELECT wal_status, safe_wal_size, w.lsn::text, pg_wal_lsn_diff(w.lsn, restart_lsn)::int8 "
    f"FROM pg_replication_slots, (SELECT {_WAL_NOW} AS lsn) w WHERE slot_name = $1"
)

_WAL_END_SQL = (
    "SELECT (CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() "
    "ELSE pg_current_wal_insert_lsn() END)::text"
)

_EMIT_GRANT_SQL = (
    "SELECT p.oid::regprocedure::text, has_function_privilege(p.oid, 'EXECUTE') "
    "FROM pg_proc p WHERE p.proname = 'pg_logical_emit_message' "
    "AND p.proargtypes[2] = 'text'::regtype"
)

_SYNCED_SLOT_SQL = (
    "SELECT synced, temporary, invalidation_reason FROM pg_replication_slots WHERE slot_name = $1"
)

#: the settings a standby needs to keep a synchronised copy of a failover slot (17+)
STANDBY_SETTINGS = ("sync_replication_slots", "hot_standby_feedback", "primary_slot_name")

#: pg_logical_emit_message's text signature, for the GRANT cdcd's messages advise
EMIT_SIGNATURE = (
    "pg_logical_emit_message(boolean, text, text) (17+: (boolean, text, text, boolean); "
    "cdcd check shows the signature)"
)


async def wal_end(conn: Any) -> str:
    """Where the WAL ends now, as text: ``pg_current_wal_insert_lsn()`` on a primary (it covers
    every commit made so far, asynchronous ones included), the replayed position on a standby."""
    return str(await conn.fetchval(_WAL_END_SQL))


async def slot_lag(conn: Any, slot: str) -> int | None:
    """Bytes of WAL between the server's position and the slot's ``confirmed_flush_lsn``."""
    lag = await conn.fetchval(_SLOT_LAG_SQL, slot)
    return None if lag is None else int(lag)


async def slot_health(conn: Any, slot: str) -> Any:
    """``(wal_status, safe_wal_size, server WAL position as text, retained bytes)`` or None."""
    return await conn.fetchrow(_SLOT_HEALTH_SQL, slot)


async def emit_message_grant(conn: Any) -> tuple[str, bool]:
    """pg_logical_emit_message's text signature and whether this role may EXECUTE it."""
    signature, allowed = await conn.fetchrow(_EMIT_GRANT_SQL)
    return str(signature), bool(allowed)


async def standby_slot_sync(conn: Any, slot: str) -> tuple[dict[str, str], Any]:
    """On a standby (17+): the slot-synchronisation settings, and the synchronised copy of
    ``slot`` (``synced, temporary, invalidation_reason``) or None."""
    settings = {name: str(await conn.fetchval(f"SHOW {name}")) for name in STANDBY_SETTINGS}
    return settings, await conn.fetchrow(_SYNCED_SLOT_SQL, slot)


async def emit_message(conn: Any, prefix: str, content: str, what: str) -> str:
    """Write a transactional logical message to the WAL; its LSN as text.

    ``what`` names the caller in errors: a role without EXECUTE, or a standby (which cannot
    write WAL), get a :class:`DefiniteSourceError` saying what to do.
    """
    try:
        return str(
            await conn.fetchval(
                "SELECT pg_logical_emit_message(true, $1, $2)::text", prefix, content
            )
        )
    except (asyncpg.InsufficientPrivilegeError, asyncpg.ReadOnlySQLTransactionError) as exc:
        raise emit_refused(exc, what) from exc


def emit_refused(exc: Exception, what: str) -> DefiniteSourceError:
    """What to say when writing a logical message failed with ``exc``: a role without EXECUTE
    (InsufficientPrivilegeError) or a standby (ReadOnlySQLTransactionError)."""
    if isinstance(exc, asyncpg.ReadOnlySQLTransactionError):
        return DefiniteSourceError(
            f"{what}: {exc}; logical messages are written to the WAL, which a standby cannot "
            "do: this needs the primary"
        )
    return DefiniteSourceError(
        f"{what}: {exc}; it writes a logical message: GRANT EXECUTE ON FUNCTION "
        f"{EMIT_SIGNATURE} TO the role"
    )
