"""Which tables a publication covers, and whether publishing them breaks the application's writes.

PostgreSQL refuses an UPDATE or DELETE on a table that a publication publishes updates or
deletes for, unless the table has a usable replica identity ("cannot update table ... because it
does not have a replica identity and publishes updates"; executor/execReplication.c,
CheckCmdReplicaIdentity; docs "Logical Replication: Publication", "ALTER TABLE ... REPLICA
IDENTITY"). Usable means, per table the row lives in (a partition, never a partitioned table):

- ``REPLICA IDENTITY DEFAULT`` with a valid, non-deferrable primary key;
- ``REPLICA IDENTITY USING INDEX`` whose index is still there (unique, non-partial, on NOT NULL
  columns, non-deferrable: ALTER TABLE checks this when it is set);
- ``REPLICA IDENTITY FULL``.

``NOTHING`` is never usable, and neither is ``DEFAULT`` without a primary key: those tables
*break* once published. A partitioned table is judged by its partitions (the identity is each
partition's own, not inherited), whatever ``publish_via_partition_root`` says. The column-list
and row-filter rules of 15+ (columns they use must be in the identity) are not evaluated here.

``source.keyless_tables`` says what cdcd does about breaking tables in a publication it manages
(docs/keyless-tables.md): ``refuse`` to publish them, publish them to a second publication for
inserts and truncates only (``insert_only``), leave them out (``exclude``), or give them
``REPLICA IDENTITY FULL``. :func:`plan` decides (pure); :func:`apply_plan` and
:func:`reconcile` carry it out. A publication cdcd created carries :data:`MANAGED_COMMENT`; one
without it is the DBA's: cdcd reports its breaking tables and never alters it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import structlog

from cdcd.errors import DefiniteSourceError, SourceError
from cdcd.source.slot import run_sql
from cdcd.wire.frontend import quote_ident, quote_qualified

log = structlog.get_logger("cdcd.source")

#: the comment cdcd puts on the publications it creates (COMMENT ON PUBLICATION)
MANAGED_COMMENT = "managed by cdcd (source.keyless_tables)"


#: ordinary and partitioned tables FOR ALL TABLES publishes (pg_publication.c,
#: is_publishable_class): permanent, created after initdb; partitions through their root
_ALL_TABLES_SQL = """
SELECT c.oid FROM pg_class c
WHERE c.relkind IN ('r', 'p') AND c.relpersistence = 'p' AND c.oid >= 16384
  AND NOT c.relispartition
"""

#: the tables an existing publication lists (roots with publish_via_partition_root, else leaves)
_PUBLISHED_SQL = """
SELECT DISTINCT c.oid FROM pg_publication_tables pt
JOIN pg_namespace n ON n.nspname = pt.schemaname
JOIN pg_class c ON c.relnamespace = n.oid AND c.relname = pt.tablename
WHERE pt.pubname = $1
"""

#: per listed table, each leaf a row lives in (itself for a plain table; pg_partition_tree
#: lists nothing for one) and its identity
_COVERAGE_SQL = """
SELECT tn.nspname AS top_schema, tc.relname AS top_name,
       n.nspname AS schema, c.relname AS name, c.relreplident AS identity,
       EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid AND i.indisprimary) AS has_pk,
       CASE c.relreplident
         WHEN 'f' THEN true
         WHEN 'd' THEN EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid
                               AND i.indisprimary AND i.indisvalid AND i.indimmediate)
         WHEN 'i' THEN EXISTS (SELECT 1 FROM pg_index i WHERE i.indrelid = c.oid
                               AND i.indisreplident AND i.indisvalid AND i.indimmediate)
         ELSE false END AS usable
FROM unnest($1::oid[]) AS t(oid)
JOIN pg_class tc ON tc.oid = t.oid
JOIN pg_namespace tn ON tn.oid = tc.relnamespace
LEFT JOIN LATERAL (SELECT relid FROM pg_partition_tree(t.oid) WHERE isleaf
                   UNION SELECT t.oid WHERE tc.relkind <> 'p') l ON true
LEFT JOIN pg_class c ON c.oid = l.relid
LEFT JOIN pg_namespace n ON n.oid = c.relnamespace
ORDER BY 1, 2, 3, 4
"""

_IDENTITY_NAMES = {"d": "default", "n": "nothing", "f": "full", "i": "index"}


@dataclass(frozen=True, slots=True)
class Leaf:
    """A table rows live in, with its replica identity."""

    schema: str
    name: str
    identity: str  # default | index | full | nothing
    primary_key: bool
    usable: bool

    @property
    def qualified(self) -> str:
        return f"{self.schema}.{self.name}"

    def describe(self) -> str:
        if self.usable:
            if self.identity == "default":
                return "replica identity default (primary key)"
            if self.identity == "full":
                return "replica identity full (no key: consumers match by the whole row)"
            return f"replica identity {self.identity}"
        if self.identity == "default" and self.primary_key:
            return "replica identity default, but the primary key is deferrable or not valid"
        if self.identity == "default":
            return "replica identity default without a primary key"
        return f"replica identity {self.identity}" + (
            " (its index is gone)" if self.identity == "index" else ""
        )


@dataclass(frozen=True, slots=True)
class Listed:
    """A table a publication lists, and the leaves it covers (a partitioned table's partitions)."""

    schema: str
    name: str
    leaves: tuple[Leaf, ...]

    @property
    def qualified(self) -> str:
        return f"{self.schema}.{self.name}"

    @property
    def sql(self) -> str:
        return f"{quote_ident(self.schema)}.{quote_ident(self.name)}"

    @property
    def breaking(self) -> tuple[Leaf, ...]:
        return tuple(leaf for leaf in self.leaves if not leaf.usable)


@dataclass(frozen=True, slots=True)
class Publication:
    """A publication as it is (or would be): its flags, whether cdcd manages it, its tables."""

    name: str
    exists: bool
    all_tables: bool
    updates_or_deletes: bool
    managed: bool
    tables: tuple[Listed, ...]

    @property
    def breaking(self) -> list[Leaf]:
        """The leaves whose UPDATE/DELETE fail because this publication covers them."""
        if not self.updates_or_deletes:
            return []
        return [leaf for table in self.tables for leaf in table.breaking]


@dataclass
class Plan:
    """What to create or change so that no published table breaks (:func:`plan`)."""

    #: tables of the main publication; None: FOR ALL TABLES
    main: list[Listed] | None
    #: tables of the insert-only publication; None: there is none
    insert_only: list[Listed] | None = None
    #: leaves to give REPLICA IDENTITY FULL first
    full: list[Leaf] = field(default_factory=list)
    #: tables left out
    excluded: list[Listed] = field(default_factory=list)


class BreakingTablesError(DefiniteSourceError):
    """Publishing would make the application's UPDATE/DELETE on these tables fail."""

    def __init__(self, message: str, tables: list[str]) -> None:
        super().__init__(message)
        self.tables = tables


def fixes(leaf: Leaf) -> str:
    """The commands that make ``leaf``'s writes work while published, and what each costs."""
    table = f"{quote_ident(leaf.schema)}.{quote_ident(leaf.name)}"
    return (
        f"ALTER TABLE {table} ADD PRIMARY KEY (...); or ALTER TABLE {table} REPLICA IDENTITY "
        "USING INDEX <a unique, non-partial, non-deferrable index on NOT NULL columns>; or "
        f"ALTER TABLE {table} REPLICA IDENTITY FULL (the whole old row goes to the WAL on "
        "every update and delete, and consumers match rows by the whole row: the key is null)"
    )


def breaking_message(publication: Publication, leaves: list[Leaf]) -> str:
    """Why cdcd will not publish ``leaves``, with the fixes (also the check's summary)."""
    names = ", ".join(leaf.qualified for leaf in leaves)
    what = "would publish" if not publication.exists else "publishes"
    lines = [
        f"publication {publication.name!r} {what} updates and deletes of {names}, which have no "
        "usable replica identity: the application's UPDATE and DELETE on them would fail "
        '("cannot update table ... because it does not have a replica identity and publishes '
        'updates"). Fix each table, or set source.keyless_tables to insert_only, exclude or '
        "replica_identity_full (docs/keyless-tables.md):"
    ]
    lines += [f"  {leaf.qualified} ({leaf.describe()}): {fixes(leaf)}" for leaf in leaves]
    return "\n".join(lines)


def plan(publication: Publication, policy: str, listed: bool) -> Plan:
    """What to publish under ``source.keyless_tables`` = ``policy`` (pure).

    ``listed``: the main publication lists its tables (``source.tables``, or a policy that
    routes tables); otherwise it is FOR ALL TABLES. A FOR ALL TABLES publication cannot leave
    a table out (before PostgreSQL 19), so ``insert_only`` and ``exclude`` always list."""
    tables = list(publication.tables)
    broken = [t for t in tables if t.breaking]
    keyed = [t for t in tables if not t.breaking]
    if policy == "insert_only":
        return Plan(main=keyed, insert_only=broken)
    if policy == "exclude":
        return Plan(main=keyed, excluded=broken)
    main = tables if listed else None
    if policy == "replica_identity_full":
        return Plan(main=main, full=[leaf for t in broken for leaf in t.breaking])
    if broken:
        leaves = [leaf for t in broken for leaf in t.breaking]
        raise BreakingTablesError(
            breaking_message(publication, leaves), [leaf.qualified for leaf in leaves]
        )
    return Plan(main=main)


# -- reading the catalog ----------------------------------------------------------------------


async def _coverage(conn: Any, oids: list[int]) -> tuple[Listed, ...]:
    rows = await conn.fetch(_COVERAGE_SQL, oids)
    tables: dict[tuple[str, str], list[Leaf]] = {}
    for row in rows:
        leaves = tables.setdefault((row["top_schema"], row["top_name"]), [])
        if row["name"] is None:  # a partitioned table without partitions
            continue
        ident = row["identity"]
        ident = ident.decode() if isinstance(ident, bytes) else str(ident)
        leaves.append(
            Leaf(
                row["schema"],
                row["name"],
                _IDENTITY_NAMES.get(ident, ident),
                bool(row["has_pk"]),
                bool(row["usable"]),
            )
        )
    return tuple(Listed(s, n, tuple(leaves)) for (s, n), leaves in tables.items())


async def _configured_oids(conn: Any, names: Iterable[str]) -> list[int]:
    oids = []
    for name in names:
        oid = await conn.fetchval("SELECT to_regclass($1)::oid", quote_qualified(name))
        if oid is None:
            raise DefiniteSourceError(
                f"source.tables: table {name!r} does not exist in the source database"
            )
        oids.append(int(oid))
    return oids


async def describe(conn: Any, name: str, tables: list[str] | None) -> Publication:
    """Publication ``name`` as it is, or, when it does not exist, as cdcd would create it
    (FOR TABLE ``tables``, else FOR ALL TABLES) before any ``source.keyless_tables`` choice."""

    async def read() -> Publication:
        row = await conn.fetchrow(
            "SELECT puballtables, pubupdate OR pubdelete AS ud, "
            "obj_description(oid, 'pg_publication') AS comment "
            "FROM pg_publication WHERE pubname = $1",
            name,
        )
        if row is None:
            oids = (
                await _configured_oids(conn, tables)
                if tables
                else [int(r[0]) for r in await conn.fetch(_ALL_TABLES_SQL)]
            )
            return Publication(name, False, not tables, True, True, await _coverage(conn, oids))
        oids = [int(r[0]) for r in await conn.fetch(_PUBLISHED_SQL, name)]
        return Publication(
            name,
            True,
            bool(row["puballtables"]),
            bool(row["ud"]),
            row["comment"] == MANAGED_COMMENT,
            await _coverage(conn, oids),
        )

    return await run_sql(f"reading publication {name!r}", read)


async def intended(conn: Any, name: str, tables: list[str] | None) -> Publication:
    """The tables cdcd's publication should hold now: ``tables`` (``source.tables``), else every
    publishable table (the FOR ALL TABLES set), whatever it lists today."""

    async def read() -> Publication:
        oids = (
            await _configured_oids(conn, tables)
            if tables
            else [int(r[0]) for r in await conn.fetch(_ALL_TABLES_SQL)]
        )
        return Publication(name, True, not tables, True, True, await _coverage(conn, oids))

    return await run_sql(f"listing the tables for publication {name!r}", read)


async def _listed(conn: Any, name: str) -> set[tuple[str, str]]:
    rows = await conn.fetch(
        "SELECT n.nspname, c.relname FROM pg_publication_rel pr "
        "JOIN pg_publication p ON p.oid = pr.prpubid JOIN pg_class c ON c.oid = pr.prrelid "
        "JOIN pg_namespace n ON n.oid = c.relnamespace WHERE p.pubname = $1",
        name,
    )
    return {(r[0], r[1]) for r in rows}


# -- changing it ------------------------------------------------------------------------------


def _for(tables: list[Listed] | None) -> str:
    if tables is None:
        return " FOR ALL TABLES"
    if not tables:
        return ""  # an empty publication: tables are added as they appear
    return " FOR TABLE " + ", ".join(t.sql for t in tables)


async def _set_full(conn: Any, leaves: list[Leaf]) -> None:
    for leaf in leaves:
        table = f"{quote_ident(leaf.schema)}.{quote_ident(leaf.name)}"
        try:
            await conn.execute(f"ALTER TABLE {table} REPLICA IDENTITY FULL")
        except asyncpg.InsufficientPrivilegeError as exc:
            raise DefiniteSourceError(
                f"source.keyless_tables is replica_identity_full, but cdcd may not run ALTER "
                f"TABLE {table} REPLICA IDENTITY FULL: {exc}. Only the table's owner may; run "
                "it as the owner, or choose another source.keyless_tables "
                "(docs/keyless-tables.md)"
            ) from exc


async def apply_plan(conn: Any, name: str, planned: Plan, twin: str) -> None:
    """Create publication ``name`` (and its insert-only ``twin``) as ``planned``, in one
    transaction, marked as cdcd's (:data:`MANAGED_COMMENT`)."""

    async def create() -> None:
        async with conn.transaction():
            await _set_full(conn, planned.full)
            await conn.execute(f"CREATE PUBLICATION {quote_ident(name)}{_for(planned.main)}")
            await conn.execute(f"COMMENT ON PUBLICATION {quote_ident(name)} IS '{MANAGED_COMMENT}'")
            if planned.insert_only is not None:
                await _create_insert_only(conn, twin, planned.insert_only)

    await run_sql(f"CREATE PUBLICATION {name!r}", create)


async def _create_insert_only(conn: Any, twin: str, tables: list[Listed]) -> None:
    quoted = quote_ident(twin)
    await conn.execute(
        f"CREATE PUBLICATION {quoted}{_for(tables)} WITH (publish = 'insert, truncate')"
    )
    await conn.execute(f"COMMENT ON PUBLICATION {quoted} IS '{MANAGED_COMMENT}'")


@dataclass
class Changes:
    """What :func:`reconcile` changed: tables added to / dropped from each publication."""

    added: list[str] = field(default_factory=list)
    insert_only: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    full: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.added or self.insert_only or self.dropped or self.full)


async def reconcile(
    conn: Any, name: str, tables: list[str] | None, policy: str, twin: str
) -> Changes:
    """Bring a publication cdcd manages in line with ``policy``: under ``insert_only`` and
    ``exclude`` its list holds every table that should be published and keeps a usable
    identity (new tables, and tables whose identity came or went, move), under
    ``replica_identity_full`` breaking tables get REPLICA IDENTITY FULL. ``refuse`` changes
    nothing (the caller reports). One transaction."""
    changes = Changes()
    if policy == "refuse":
        return changes

    async def run() -> None:
        async with conn.transaction():
            wanted = await intended(conn, name, tables)
            if policy == "replica_identity_full":
                current = await describe(conn, name, tables)
                leaves = current.breaking
                await _set_full(conn, leaves)
                changes.full = [leaf.qualified for leaf in leaves]
                return
            if await conn.fetchval(
                "SELECT puballtables FROM pg_publication WHERE pubname = $1", name
            ):
                return  # cannot be listed (the caller says so)
            planned = plan(wanted, policy, listed=True)
            assert planned.main is not None
            main = {(t.schema, t.name): t for t in planned.main}
            has_main = await _listed(conn, name)
            routed = {(t.schema, t.name): t for t in planned.insert_only or []}
            if policy == "insert_only" and not await _exists(conn, twin):
                await _create_insert_only(conn, twin, [])
            has_twin = await _listed(conn, twin) if policy == "insert_only" else set()
            # first out of a publication, then in: never in both, never published for
            # updates while breaking
            leave_main = sorted(has_main - main.keys())
            leave_twin = sorted(has_twin - routed.keys())
            for key in leave_main:
                await _alter(conn, name, "DROP", key)
            for key in leave_twin:
                await _alter(conn, twin, "DROP", key)
            for key in sorted(main.keys() - has_main):
                await _alter(conn, name, "ADD", key)
                changes.added.append(".".join(key))
            for key in sorted(routed.keys() - has_twin):
                await _alter(conn, twin, "ADD", key)
                changes.insert_only.append(".".join(key))
            changes.dropped = [".".join(k) for k in leave_main if k not in routed and k not in main]

    await run_sql(f"updating publication {name!r}", run)
    return changes


async def _alter(conn: Any, publication: str, verb: str, key: tuple[str, str]) -> None:
    table = f"{quote_ident(key[0])}.{quote_ident(key[1])}"
    await conn.execute(f"ALTER PUBLICATION {quote_ident(publication)} {verb} TABLE {table}")


# -- what cdcd run and cdcd slot create do ----------------------------------------------------


async def ensure(conn: Any, src: Any) -> Publication:
    """Set up the publication of ``src`` (the config's ``source`` section) before streaming.

    Missing: created as :func:`plan` says, or :class:`BreakingTablesError` (exit 3) under
    ``refuse`` when a table would break. Managed by cdcd: :func:`reconcile`. The DBA's, or
    on a standby: left alone. Returns the publication as it now is; the caller warns about what still breaks."""
    tables = list(src.tables) or None
    policy = src.keyless_tables
    twin = src.insert_only_publication()
    current = await describe(conn, src.publication, tables)
    if current.exists and await _read_only(conn):
        return current  # a standby (logical decoding on a standby): the primary's to change
    if not current.exists:
        listed = bool(tables) or policy in ("insert_only", "exclude")
        planned = plan(current, policy, listed)
        try:
            await apply_plan(conn, src.publication, planned, twin)
        except SourceError as exc:
            if "already exists" not in str(exc):  # else created concurrently: as it is
                raise
        else:
            log.info(
                "publication created",
                publication=src.publication,
                tables="all" if planned.main is None else [t.qualified for t in planned.main],
                insert_only=[t.qualified for t in planned.insert_only or []] or None,
                excluded=[t.qualified for t in planned.excluded] or None,
                replica_identity_full=[leaf.qualified for leaf in planned.full] or None,
            )
            if planned.main is not None and not tables:
                log.info(
                    "the publication lists its tables (FOR TABLE, as source.keyless_tables needs):"
                    " cdcd adds tables created later while it runs, and at its next start",
                    publication=src.publication,
                    keyless_tables=policy,
                )
    elif current.managed:
        if current.all_tables and policy in ("insert_only", "exclude"):
            log.error(
                "the publication is FOR ALL TABLES, which cannot leave tables out or send only "
                f"their inserts: source.keyless_tables: {policy} needs a publication that lists "
                "its tables. Stop cdcd, DROP PUBLICATION it and start cdcd again to have it "
                "created that way (docs/keyless-tables.md)",
                publication=src.publication,
            )
        await log_changes(src, await reconcile(conn, src.publication, tables, policy, twin))
    elif policy == "insert_only" and not await _exists(conn, twin):
        await run_sql(f"CREATE PUBLICATION {twin!r}", lambda: _create_insert_only(conn, twin, []))
    return await describe(conn, src.publication, tables)


async def _read_only(conn: Any) -> bool:
    return bool(
        await run_sql("pg_is_in_recovery()", lambda: conn.fetchval("SELECT pg_is_in_recovery()"))
    )


async def _exists(conn: Any, name: str) -> bool:
    return bool(
        await conn.fetchval("SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)", name)
    )


async def log_changes(src: Any, changes: Changes) -> None:
    """Log what :func:`reconcile` did (nothing when it did nothing)."""
    if changes.full:
        log.warning(
            "tables without a usable replica identity set to REPLICA IDENTITY FULL "
            "(source.keyless_tables: replica_identity_full)",
            tables=changes.full,
        )
    if changes.added or changes.insert_only or changes.dropped:
        log.warning(
            "publication updated (source.keyless_tables)",
            publication=src.publication,
            keyless_tables=src.keyless_tables,
            added=changes.added or None,
            insert_only=changes.insert_only or None,
            removed=changes.dropped or None,
        )


def warn_breaking(
    publication: Publication, where: str = "start", known: Iterable[str] = ()
) -> list[str]:
    """Log an error for each table whose writes the publication breaks now (but those in
    ``known``, logged before); the names of all of them."""
    leaves = publication.breaking
    for leaf in leaves:
        if leaf.qualified in known:
            continue
        log.error(
            "a published table has no usable replica identity: the application's UPDATE and "
            "DELETE on it fail on the server while it is published for them",
            table=leaf.qualified,
            identity=leaf.describe(),
            publication=publication.name,
            publication_owner="cdcd" if publication.managed else "not cdcd (left unchanged)",
            seen_at=where,
            fix=fixes(leaf),
            docs="docs/keyless-tables.md",
        )
    return [leaf.qualified for leaf in leaves]
