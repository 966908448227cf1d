"""The PostgreSQL source over ordinary SQL: all of cdcd's catalog SQL lives in this package.

- :mod:`.prepare`: connections through the DSN's host list, the start-up checks, publication
  and slot set-up (:class:`Source`).
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

from cdcd.source.prepare import (
    SESSION_GUCS,
    SnapshotPlan,
    Source,
    conn_params,
    open_sql,
    wants_failover,
)

__all__ = ["SESSION_GUCS", "SnapshotPlan", "Source", "conn_params", "open_sql", "wants_failover"]
