"""What the pgoutput stream does not say, read from the source's catalog over asyncpg.

The Kafka key and the file sink's ``key`` are the table's primary-key columns (docs/protocol.md:
Relation flags mark replica-identity columns, and under REPLICA IDENTITY FULL every column is
flagged, so they cannot serve as the key). Non-built-in types need their kind, base type and
element type to be decoded in binary mode. Both are fetched when a Relation message arrives —
always before the first change that uses it — and cached, so encoding stays synchronous.
"""

from __future__ import annotations

from typing import Any

import asyncpg

from cdcd.decoder.events import Relation
from cdcd.errors import TransientSourceError
from cdcd.values.types import TypeInfo, TypeRegistry

_KEY_SQL = """
SELECT i.indisprimary, array_agg(a.attname ORDER BY k.ord) AS cols
FROM pg_index i
CROSS JOIN LATERAL unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, ord)
JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = k.attnum
WHERE i.indrelid = $1 AND (i.indisprimary OR i.indisreplident)
GROUP BY i.indexrelid, i.indisprimary
ORDER BY i.indisprimary DESC
"""

_TYPE_SQL = """
SELECT t.oid::int8, n.nspname, t.typname, t.typtype, t.typbasetype::int8,
       CASE WHEN t.typcategory = 'A' THEN t.typelem
            WHEN t.typtype = 'r' THEN (SELECT rngsubtype FROM pg_range WHERE rngtypid = t.oid)
            WHEN t.typtype = 'm' THEN (SELECT rngtypid FROM pg_range WHERE rngmultitypid = t.oid)
            ELSE 0 END::int8
FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace
WHERE t.oid = $1
"""

#: What a lost or broken connection raises (the server restarting, a cut connection, a
#: connection left mid-operation by an earlier failure): reconnect and retry.
_CONNECTION_LOST = (
    OSError,
    asyncpg.PostgresConnectionError,
    asyncpg.exceptions.OperatorInterventionError,
    asyncpg.InterfaceError,
    asyncpg.exceptions.InternalClientError,
)

#: OIDs below this are assigned at initdb (built-in types); user types get larger ones.
FIRST_NORMAL_OBJECT_ID = 16384


class LiveCatalog:
    """Implements :class:`cdcd.events.catalog.Catalog` from a live asyncpg connection."""

    def __init__(self, conn: Any, types: TypeRegistry | None = None) -> None:
        self._conn = conn
        self.types = types if types is not None else TypeRegistry()
        self._keys: dict[int, tuple[str, ...] | None] = {}
        self._known_types: set[int] = set()

    def use_connection(self, conn: Any) -> None:
        """Query through ``conn`` from now on (the pipeline reconnects after losing the source)."""
        self._conn = conn

    def knows(self, oid: int) -> bool:
        """Whether :meth:`on_relation` has seen the relation ``oid``."""
        return oid in self._keys

    def key_columns(self, relation: Relation) -> tuple[str, ...] | None:
        if relation.oid in self._keys:
            return self._keys[relation.oid]
        # Not fetched (should not happen): fall back to the replica identity flags.
        if relation.replica_identity in ("d", "i"):
            cols = tuple(c.name for c in relation.columns if c.is_identity)
            return cols or None
        return None

    async def on_relation(self, relation: Relation) -> None:
        """Fetch the key columns and unknown column types of a relation (cached per message)."""
        try:
            rows = await self._conn.fetch(_KEY_SQL, relation.oid)
            published = {c.name for c in relation.columns}
            key: tuple[str, ...] | None = None
            for row in rows:
                cols = tuple(row["cols"])
                if all(c in published for c in cols):
                    key = cols
                    break
            self._keys[relation.oid] = key
            for column in relation.columns:
                await self._ensure_type(column.type_oid)
        except _CONNECTION_LOST as exc:
            raise TransientSourceError(f"catalog query failed: {exc}") from exc

    async def _ensure_type(self, oid: int) -> None:
        if oid < FIRST_NORMAL_OBJECT_ID or oid in self._known_types:
            return
        self._known_types.add(oid)
        row = await self._conn.fetchrow(_TYPE_SQL, oid)
        if row is None:
            return
        info = TypeInfo(
            oid=row[0],
            namespace=row[1],
            name=row[2],
            category=row[3].decode() if isinstance(row[3], bytes) else str(row[3]),
            base_oid=row[4],
            elem_oid=row[5] or 0,  # array element, range subtype or multirange's range type
        )
        self.types.register(info)
        for dependency in (info.base_oid, info.elem_oid):
            if dependency:
                await self._ensure_type(dependency)
