"""What encoding needs to know about tables beyond what the replication stream says.

The stream names columns and marks replica-identity columns (``Column.flags & 1``), but under
REPLICA IDENTITY FULL *every* column is flagged (docs/protocol.md, "Tuples and types"), so the event
key (docs/events.md: primary key, else replica-identity index columns, else none) must come from
the catalog. A :class:`Catalog` answers that question, and carries the
:class:`~cdcd.values.types.TypeRegistry` that names types and builds value converters.

Two implementations:

- the application's live catalog, which queries ``pg_index`` through asyncpg and caches the
  answer per relation OID (it implements the same Protocol; ``key_columns`` must not block);
- :class:`StaticCatalog`, for tests and for running without a catalog connection: keys from
  the Relation message's identity flags when the replica identity is ``d`` (default, the
  primary key) or ``i`` (an index), none for ``f`` (full) and ``n`` (nothing), unless an
  explicit override names the key columns of a table.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from cdcd.decoder.events import Relation
from cdcd.values.types import TypeRegistry


def schema_name(relation: Relation) -> str:
    """The relation's schema as users write it: pgoutput sends ``""`` for pg_catalog."""
    return relation.namespace or "pg_catalog"


class Catalog(Protocol):
    """Keys and types for the encoder."""

    @property
    def types(self) -> TypeRegistry: ...

    def key_columns(self, relation: Relation) -> tuple[str, ...] | None:
        """The key columns of ``relation`` in key order: primary key, else replica-identity
        index columns, else None (REPLICA IDENTITY FULL without a primary key, or NOTHING)."""
        ...


class StaticCatalog:
    """A catalog that needs no server: keys from the Relation message itself.

    ``overrides`` maps ``(schema, table)`` to the key column names of that table (an empty
    sequence means "no key"); it wins over the identity flags.
    """

    def __init__(
        self,
        types: TypeRegistry | None = None,
        overrides: Mapping[tuple[str, str], Sequence[str]] | None = None,
    ) -> None:
        self._types = types if types is not None else TypeRegistry()
        self._overrides = {k: tuple(v) for k, v in (overrides or {}).items()}

    @property
    def types(self) -> TypeRegistry:
        return self._types

    def key_columns(self, relation: Relation) -> tuple[str, ...] | None:
        override = self._overrides.get((schema_name(relation), relation.name))
        if override is not None:
            return override or None
        if relation.replica_identity not in ("d", "i"):
            return None
        keys = tuple(c.name for c in relation.columns if c.is_identity)
        return keys or None
