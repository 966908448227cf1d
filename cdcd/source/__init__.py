"""The PostgreSQL source over ordinary SQL: all of cdcd's catalog SQL lives in this package.

- :mod:`.prepare`: the start-up checks, publication and slot set-up (:class:`Source`).
- :mod:`.connect`: connections for SQL through the DSN's host list (:func:`open_sql`).
- :mod:`.slot`: slots, publications, privileges and failover settings (``pg_replication_slots``
  and friends, by server version).
- :mod:`.catalog`: what the pgoutput stream does not say (key columns, non-built-in types),
  read when a Relation message arrives.
- :mod:`.snapshot`: the published tables, their columns, primary keys and row estimates, and the
  snapshot reads (the exported snapshot's full reads, incremental snapshots' keyset chunks).
- :mod:`.queries`: the one-line questions (WAL positions, slot lag and health, grants, replica
  identities, a standby's slot synchronisation) and logical messages written to the WAL.

The walsender protocol itself (CREATE_REPLICATION_SLOT, START_REPLICATION) is
:mod:`cdcd.replication`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cdcd.source.connect import SESSION_GUCS, conn_params, open_sql
    from cdcd.source.prepare import SnapshotPlan, Source, wants_failover

__all__ = ["SESSION_GUCS", "SnapshotPlan", "Source", "conn_params", "open_sql", "wants_failover"]

_CONNECT = frozenset({"SESSION_GUCS", "conn_params", "open_sql"})


def __getattr__(name: str) -> Any:
    """The names above, imported when first asked for: importing a module of this package
    (``cdcd.source.connect`` for ``cdcd snapshot --table``) does not import the daemon's
    start-up (:mod:`.prepare`, the replication client, structlog)."""
    if name in _CONNECT:
        from cdcd.source import connect

        return getattr(connect, name)
    if name in __all__:
        from cdcd.source import prepare

        return getattr(prepare, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
