"""Connections for ordinary SQL to the source (catalog queries, snapshots, watermarks): through
the DSN's host list to the first server that suits ``target_session_attrs``, with cdcd's session
GUCs. Apart from :mod:`.prepare` so that a short command (``cdcd snapshot --table``) connects
without importing the daemon's start-up."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import asyncpg

from cdcd.errors import DefiniteSourceError, TransientSourceError
from cdcd.replication.hosts import Role, connect_first
from cdcd.wire.dsn import DEFAULT_GUCS, ConnParams, parse_dsn

if TYPE_CHECKING:
    from cdcd.config import Config

#: GUCs every cdcd session on the source uses (the replication connection's, in one place),
#: so text values render the same everywhere.
SESSION_GUCS = DEFAULT_GUCS


def conn_params(config: Config) -> ConnParams:
    return parse_dsn(config.source.conninfo())


async def open_sql(params: ConnParams, timeout: float) -> Any:
    """An asyncpg connection for ordinary SQL, with the session GUCs set; with several hosts,
    to the first that suits ``target_session_attrs`` (:mod:`cdcd.replication.hosts`)."""
    return await connect_first(params, lambda host: _open_one(host, timeout), _role, _discard)


async def _role(conn: Any) -> Role:
    settings = conn.get_settings()
    standby = getattr(settings, "in_hot_standby", None)
    try:
        in_recovery = (
            standby == "on"
            if standby is not None
            else bool(await conn.fetchval("SELECT pg_catalog.pg_is_in_recovery()"))
        )
    except (OSError, asyncpg.InterfaceError, asyncpg.PostgresConnectionError) as exc:
        raise TransientSourceError(f"lost the connection to the source: {exc}") from exc
    return in_recovery, getattr(settings, "default_transaction_read_only", "off") == "on"


async def _discard(conn: Any) -> None:
    conn.terminate()


async def _open_one(params: ConnParams, timeout: float) -> Any:
    kwargs = params.to_asyncpg_kwargs()
    settings = dict(kwargs.pop("server_settings", None) or {})
    settings.update(SESSION_GUCS)
    settings.setdefault("application_name", "cdcd-catalog")
    try:
        return await asyncpg.connect(**kwargs, server_settings=settings, timeout=timeout)
    except (asyncpg.InvalidPasswordError, asyncpg.InvalidAuthorizationSpecificationError) as exc:
        raise DefiniteSourceError(
            f"authentication failed for user {params.user!r} on {params.host}:{params.port}: {exc}"
        ) from exc
    except asyncpg.InvalidCatalogNameError as exc:
        raise DefiniteSourceError(f"database {params.dbname!r} does not exist: {exc}") from exc
    except (
        OSError,
        TimeoutError,
        asyncpg.CannotConnectNowError,  # starting up, shutting down, in recovery
        asyncpg.TooManyConnectionsError,
        asyncpg.PostgresConnectionError,  # closed during start-up
        asyncpg.InterfaceError,
    ) as exc:
        raise TransientSourceError(f"cannot connect to {params.host}:{params.port}: {exc}") from exc
