"""Connections to the source, its start-up checks, and publication and slot set-up.

Everything here is ordinary SQL over asyncpg except slot creation and streaming, which need
the replication connection (:mod:`cdcd.replication.client`). Problems an operator must fix
(wal_level, missing or invalidated slot, missing publication, privileges) raise
:class:`DefiniteSourceError` with what to do; lost connections raise
:class:`TransientSourceError`.

Every connection goes through the DSN's host list (:mod:`cdcd.replication.hosts`), so after a
failover the next connection finds the promoted standby. :meth:`Source.prepare` retries
transient errors with the reconnect backoff, bounded by ``source.give_up_after``, so a daemon
started before its database (or during a failover) waits instead of exiting.

Failover slots (PostgreSQL 17+, docs/high-availability.md): with ``source.failover`` on, the
slot is created with ``FAILOVER`` in CREATE_REPLICATION_SLOT itself (altering it later on the
exporting connection would destroy the exported snapshot); a slot that exists without it is
altered on a connection of its own. 17 refuses FAILOVER together with TWO_PHASE, 18 allows it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import structlog

from cdcd.config import Config, SourceConfig
from cdcd.errors import ConfigError, DefiniteSourceError, SlotLostError, TransientSourceError
from cdcd.lsn import format_lsn
from cdcd.replication.client import ReplicationClient, SlotExists
from cdcd.source import publication as publications
from cdcd.source import slot as slots
from cdcd.source.connect import conn_params, open_sql
from cdcd.source.resume import Resume, incremental_unavailable, resume_plan
from cdcd.source.snapshot import (
    RecreateState,
    SnapshotState,
    primary_key,
    published_tables,
    record_slot,
    streamed_before,
)

log = structlog.get_logger("cdcd.source")


def wants_failover(src: SourceConfig, server_version: int) -> bool:
    """Whether the slot should be a failover slot: ``source.failover``, where ``auto`` means
    on for 17+ (18+ when ``two_phase`` is on, since 17 cannot have both)."""
    if src.failover == "auto":
        return server_version >= 180000 or (server_version >= 170000 and not src.two_phase)
    return bool(src.failover)


def untaken_snapshot(config: Config) -> bool:
    """Whether ``snapshot.mode`` asks for the existing rows and ``snapshot.state_dir`` shows
    no snapshot of this configuration taken or under way, nor any streaming from the slot: a
    slot that exists then was made outside cdcd's start (``cdcd slot create``, a DBA), and
    streaming from it alone would skip every row that existed before it."""
    cfg = config.snapshot
    if cfg.mode not in ("initial", "initial_only"):
        return False
    slot = config.source.slot
    return (
        streamed_before(cfg.state_dir, slot) is None
        and not SnapshotState(cfg.state_dir, slot).running()
    )


async def existing_slot_backfill(conn: Any, config: Config) -> tuple[list[str], str | None]:
    """For a slot found existing with no snapshot taken (:func:`untaken_snapshot`): the
    published tables an incremental snapshot backfills, and why it cannot (with what to do),
    or None. ``cdcd check`` reports the same."""
    src = config.source
    tables = await published_tables(conn, src.publication)
    names = [f"{t.relation.namespace}.{t.relation.name}" for t in tables]
    why: str | None = "snapshot.mode initial_only reads the snapshot a new slot exports"
    if config.snapshot.mode != "initial_only":
        why = await incremental_unavailable(conn, config)
    if why is None:
        keyless = [
            name
            for name, t in zip(names, tables, strict=True)
            if not await primary_key(conn, t.relation.oid)
        ]
        if keyless:
            why = (
                f"{', '.join(keyless)} {'has' if len(keyless) == 1 else 'have'} neither a "
                "primary key nor a replica identity index, which an incremental snapshot "
                "reads by"
            )
    if why is None:
        return names, None
    return names, (
        f"replication slot {src.slot!r} already exists and no snapshot of this configuration "
        f"was taken ({config.snapshot.state_dir} records none), so streaming from it would skip "
        f"the rows that existed before it; cdcd backfills such a slot with an incremental "
        f"snapshot of every published table, but not here: {why}. Drop the slot ('cdcd slot "
        "drop') and let cdcd create it with a snapshot of its own at start, or set "
        "snapshot.mode: never to stream only the changes from the slot's position"
    )


class SnapshotPlan:
    """A slot just created with an exported snapshot, waiting to be read.

    ``client`` is the replication connection that exported it: it must stay open and idle
    until the snapshot has been read."""

    def __init__(
        self, client: ReplicationClient, name: str, consistent_point: int, state: SnapshotState
    ) -> None:
        self.client = client
        self.name = name
        self.consistent_point = consistent_point
        self.state = state
        #: an earlier attempt did not finish, and its rows may be in the sinks: the snapshot
        #: first resets every table (consumers forget them, deleted rows included)
        self.reset = False

    async def close(self) -> None:
        await self.client.close()


class Source:
    """Owns the catalog connection and opens replication connections on demand."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.params = conn_params(config)
        self.catalog_conn: Any = None
        self.database = self.params.dbname or ""
        self.slot_created = False
        self.consistent_point: int | None = None
        #: set by :meth:`recreate_slot`: why the slot was replaced, for the pipeline's reset
        self.recreated: str | None = None
        #: set by :meth:`prepare` when the slot existed but no snapshot of this configuration
        #: was taken: the tables the pipeline backfills with an incremental snapshot
        self.backfill: list[str] | None = None
        #: set by :meth:`prepare`: an interrupted initial snapshot that resumes (the pipeline
        #: requests the rest as incremental snapshots, then :meth:`resumed`)
        self.resume: Resume | None = None
        #: published tables whose UPDATE/DELETE fail (logged at start; cdcd.pipeline watches)
        self.breaking: list[str] = []

    def where(self) -> str:
        """The server the catalog connection reached (``host:port``), else the DSN's hosts."""
        addr = getattr(self.catalog_conn, "_addr", None) if self.catalog_conn else None
        if isinstance(addr, tuple) and len(addr) >= 2:
            return f"{addr[0]}:{addr[1]}"
        return self.params.describe()

    async def connect_catalog(self) -> None:
        if self.catalog_conn is None:
            self.catalog_conn = await open_sql(self.params, self.config.source.connect_timeout)
            self.database = await self.catalog_conn.fetchval("SELECT current_database()")

    async def reconnect_catalog(self) -> Any:
        """A new catalog connection in place of one that may be broken (after a lost source)."""
        old, self.catalog_conn = self.catalog_conn, None
        if old is not None:
            old.terminate()
        await self.connect_catalog()
        return self.catalog_conn

    async def prepare(self) -> SnapshotPlan | None:
        """Check the server and set up the publication and slot as configured.

        Returns a :class:`SnapshotPlan` when the slot was created here and the snapshot mode
        asks for the existing rows. A server that cannot be reached (down, restarting, only a
        standby answering while ``target_session_attrs`` wants a primary) is retried with the
        reconnect backoff until ``source.give_up_after``; definite problems raise at once."""
        src = self.config.source
        backoff = src.reconnect_min_backoff
        started = time.monotonic()
        while True:
            try:
                return await self._prepare_once()
            except TransientSourceError as exc:
                waited = time.monotonic() - started
                if src.give_up_after is not None and waited + backoff > src.give_up_after:
                    raise DefiniteSourceError(
                        f"giving up after {waited:.0f} s of failed connections: {exc}"
                    ) from exc
                log.warning(
                    "source not ready at start-up; retrying", error=str(exc), backoff_s=backoff
                )
                old, self.catalog_conn = self.catalog_conn, None
                if old is not None:
                    old.terminate()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, src.reconnect_max_backoff)

    async def _prepare_once(self) -> SnapshotPlan | None:
        src = self.config.source
        await self.connect_catalog()
        conn = self.catalog_conn
        await slots.check_wal_level(conn)
        if await slots.in_recovery(conn) and not (
            await slots.publication_exists(conn, src.publication)
        ):
            raise DefiniteSourceError(
                f"publication {src.publication!r} does not exist, and cdcd is connected to a "
                "standby, which cannot create it: create it on the primary (CREATE PUBLICATION "
                "... FOR ALL TABLES)"
            )
        if src.create_publication:
            # refuses (exit 3) to publish a table whose writes it would break
            current = await publications.ensure(conn, src)
        elif not await conn.fetchval(
            "SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)", src.publication
        ):
            raise DefiniteSourceError(
                f"publication {src.publication!r} does not exist in database {self.database!r}; "
                "create it (CREATE PUBLICATION ... FOR ALL TABLES) or set "
                "source.create_publication: true"
            )
        else:
            current = await publications.describe(conn, src.publication, None)
        # already in effect (the DBA's publication, or a table created since): loud, not fatal
        self.breaking = publications.warn_breaking(current)
        info = await slots.slot_info(conn, src.slot)
        state = SnapshotState(self.config.snapshot.state_dir, src.slot)
        wants_snapshot = self.config.snapshot.mode in ("initial", "initial_only")
        redo = wants_snapshot and state.running()  # an earlier attempt did not finish
        if info is not None and redo:
            self.resume, why = await resume_plan(conn, self.config, state, info)
            if self.resume is not None:  # the rest incrementally, on the same slot
                redo = False
                log.warning(
                    "the previous initial snapshot did not finish; resuming it: what every "
                    "sink holds stays, the rest is read by an incremental snapshot",
                    slot=src.slot,
                    tables_left=len(self.resume.tables),
                )
            else:
                log.warning("the interrupted initial snapshot cannot be resumed", reason=why)
        if info is not None and redo:
            log.warning(
                "the previous initial snapshot did not finish and cannot be resumed; dropping "
                "the slot and snapshotting again",
                slot=src.slot,
            )
            await self.drop_slot()
            info = None
        plan: SnapshotPlan | None = None
        if src.on_slot_lost == "recreate":
            lost = self._lost_reason(info)
            if lost is not None:
                await self.recreate_slot(lost)
                info = await slots.slot_info(conn, src.slot)
        history = streamed_before(self.config.snapshot.state_dir, src.slot)
        if info is None and history is not None:
            # This cdcd streamed from the slot before: it was dropped, or lost in a failover
            # to a server that did not have it. A new slot would silently skip everything in
            # between.
            raise SlotLostError(
                f"replication slot {src.slot!r} no longer exists on {self.where()}, but cdcd "
                f"streamed from it before ({history}): it was dropped, or lost in a failover "
                "(not a failover slot, or not synchronised to the promoted standby). Changes "
                "since were lost. To start over with a new slot and a new snapshot, run 'cdcd "
                f"slot drop' (or remove {history}); or set source.on_slot_lost: recreate "
                "(docs/high-availability.md)",
                reason="missing",
            )
        if info is None:
            if not src.create_slot:
                raise DefiniteSourceError(
                    f"replication slot {src.slot!r} does not exist; create it with "
                    "'cdcd slot create' or set source.create_slot: true"
                )
            if wants_snapshot:
                state.start()  # before the slot exists: a crash from here on snapshots again
                plan = await self.create_slot_with_snapshot(state)
                plan.reset = redo
            else:
                await self.create_slot()
            try:
                info = await slots.slot_info(conn, src.slot)
            except BaseException:
                if plan is not None:  # the next attempt snapshots again (state: running)
                    await plan.close()
                raise
        if info is not None:
            self._check_slot(info)
            if plan is None and not self.slot_created and untaken_snapshot(self.config):
                self.backfill = await self._take_untaken_snapshot(conn)
            if plan is None:
                await self._ensure_failover(info)
                if self.backfill is None:  # else once the backfill is requested (next start)
                    record_slot(
                        self.config.snapshot.state_dir, src.slot, info.confirmed_flush_lsn or 0
                    )
        await self._warn_unprotected()
        return plan

    def resumed(self) -> None:
        """The rest of an interrupted initial snapshot is recorded as incremental snapshots
        to take: the initial one is over."""
        assert self.resume is not None
        SnapshotState(self.config.snapshot.state_dir, self.config.source.slot).finish(
            self.resume.point
        )

    async def _take_untaken_snapshot(self, conn: Any) -> list[str]:
        """The slot existed before cdcd ever used it (``cdcd slot create``, a DBA's) and
        ``snapshot.mode`` asks for the existing rows: every published table, to be backfilled
        by an incremental snapshot (the slot's position does not matter to it); or refuse,
        saying what to do, when that cannot be done."""
        tables, problem = await existing_slot_backfill(conn, self.config)
        if problem is not None:
            raise DefiniteSourceError(problem)
        log.warning(
            "the replication slot existed before and no snapshot of this configuration was "
            "taken: every published table is backfilled by an incremental snapshot",
            slot=self.config.source.slot,
            tables=len(tables),
        )
        return tables

    async def _warn_unprotected(self) -> None:
        """A failover slot on a primary without ``synchronized_standby_slots`` may send cdcd
        changes no standby has: after a failover the new primary would not have them."""
        setup = await slots.failover_setup(self.catalog_conn)
        if setup is None or setup.in_recovery or setup.protected or not setup.physical_slots:
            return  # no standby streams through a physical slot: nothing to protect
        if wants_failover(self.config.source, await slots.server_version(self.catalog_conn)):
            log.warning(
                "the slot is a failover slot but synchronized_standby_slots is empty on the "
                "primary: cdcd may publish changes no standby has yet (docs/high-availability.md)",
                slot=self.config.source.slot,
            )

    def _lost_reason(self, info: Any) -> str | None:
        """Why the slot must be replaced (``source.on_slot_lost: recreate``), or None: it is
        invalidated, it is gone although cdcd streamed from it before, or a recreation did not
        finish (its reset events may not be durable: done again on a fresh slot)."""
        pending = RecreateState(self.config.snapshot.state_dir, self.config.source.slot).pending()
        if pending is not None:
            return pending
        if info is None:
            history = streamed_before(self.config.snapshot.state_dir, self.config.source.slot)
            return "missing" if history is not None else None
        if info.invalidated:
            return str(info.invalidation_reason or "wal_removed")
        return None

    async def _refuse_keyless(self, reason: str) -> None:
        """A table without a key cannot be backfilled by an incremental snapshot, so its reset
        would leave consumers with an empty table: refuse before anything is touched."""
        src = self.config.source
        await self.connect_catalog()
        conn = self.catalog_conn
        keyless = [
            f"{t.relation.namespace}.{t.relation.name}"
            for t in await published_tables(conn, src.publication)
            if not await primary_key(conn, t.relation.oid)
        ]
        if keyless:
            raise SlotLostError(
                f"replication slot {src.slot!r} is lost ({reason}); source.on_slot_lost: recreate "
                f"cannot backfill {', '.join(keyless)}: without a primary key or a replica "
                "identity index an incremental snapshot cannot read them, and their reset would "
                "leave consumers without their rows. Give them a key (or ALTER TABLE ... REPLICA "
                "IDENTITY USING INDEX), or drop the slot ('cdcd slot drop') and take a new "
                "initial snapshot",
                reason=reason,
            )

    async def recreate_slot(self, reason: str) -> int:
        """Replace a lost slot (``source.on_slot_lost: recreate``): drop it if it is still
        there, create a new one (no exported snapshot: the pipeline backfills every table with
        an incremental snapshot) and return its consistent point. :class:`RecreateState` is
        written first, so an interruption from here until the reset is durable recreates the
        slot again at the next start."""
        src = self.config.source
        client = await self.replication_client()
        try:
            if client.in_hot_standby:
                raise SlotLostError(
                    f"replication slot {src.slot!r} is lost ({reason}) and cdcd is connected to "
                    "a standby: on_slot_lost: recreate backfills with incremental snapshots, "
                    "whose watermarks only the primary can write. Point cdcd at the primary, "
                    "or drop the slot ('cdcd slot drop') and take a new initial snapshot",
                    reason=reason,
                )
            await self._refuse_keyless(reason)
            RecreateState(self.config.snapshot.state_dir, src.slot).start(reason)
            log.warning(
                "replication slot lost; source.on_slot_lost is recreate: replacing it, then "
                "resetting and backfilling every published table",
                slot=src.slot,
                reason=reason,
            )
            try:
                await client.drop_slot(src.slot)
            except DefiniteSourceError as exc:
                if "does not exist" not in str(exc):
                    raise
            failover = self._failover_for(client)
            created = await client.create_slot(src.slot, two_phase=src.two_phase, failover=failover)
        finally:
            await client.close()
        self.slot_created = True
        self.consistent_point = created.consistent_point
        self.recreated = reason
        log.warning(
            "replication slot recreated",
            slot=src.slot,
            reason=reason,
            consistent_point=format_lsn(created.consistent_point),
        )
        return created.consistent_point

    async def create_slot_with_snapshot(self, state: SnapshotState) -> SnapshotPlan:
        """Create the slot exporting its snapshot; the connection stays open for the reader."""
        src = self.config.source
        client = await self.replication_client()
        try:
            created = await client.create_slot(
                src.slot,
                two_phase=src.two_phase,
                snapshot="export",
                failover=self._failover_for(client),
            )
        except BaseException:
            await client.close()
            raise
        if not created.snapshot_name:
            await client.close()
            raise DefiniteSourceError("the server did not export a snapshot for the new slot")
        self.slot_created = True
        self.consistent_point = created.consistent_point
        state.start(created.consistent_point)
        log.info("replication slot created with an exported snapshot", slot=src.slot)
        return SnapshotPlan(client, created.snapshot_name, created.consistent_point, state)

    async def drop_slot(self) -> None:
        client = await self.replication_client()
        try:
            await client.drop_slot(self.config.source.slot)
        finally:
            await client.close()

    def _check_slot(self, info: Any) -> None:
        src = self.config.source
        if info.database and info.database != self.database:
            raise DefiniteSourceError(
                f"replication slot {src.slot!r} belongs to database {info.database!r}, "
                f"not {self.database!r}; choose another source.slot"
            )
        if info.plugin and info.plugin != "pgoutput":
            raise DefiniteSourceError(
                f"replication slot {src.slot!r} uses plugin {info.plugin!r}; cdcd needs pgoutput"
            )
        if info.invalidated:
            reason = info.invalidation_reason or "wal_removed"
            why = {
                "wal_removed": "the server removed WAL it still needed (max_slot_wal_keep_size)",
                "idle_timeout": "it stayed inactive longer than idle_replication_slot_timeout",
                "rows_removed": "rows it needed were vacuumed away (a standby's slot conflict)",
                "wal_level_insufficient": "wal_level was lowered below logical",
            }.get(reason, reason)
            raise SlotLostError(
                f"replication slot {src.slot!r} is invalidated ({reason}): {why}. Changes were "
                "lost; drop the slot ('cdcd slot drop'), re-create it and re-snapshot the "
                "tables, or set source.on_slot_lost: recreate to have cdcd do it (docs/high-"
                "availability.md)",
                reason=reason,
            )
        if src.two_phase and info.two_phase is False:
            log.warning(
                "source.two_phase is on but the slot was created without TWO_PHASE; prepared "
                "transactions arrive at COMMIT PREPARED. Re-create the slot to change this",
                slot=src.slot,
            )

    async def create_slot(self) -> bool:
        """Create the slot; False when it already exists."""
        src = self.config.source
        client = await self.replication_client()
        try:
            failover = self._failover_for(client)
            created = await client.create_slot(src.slot, two_phase=src.two_phase, failover=failover)
        except SlotExists:
            return False
        finally:
            await client.close()
        self.slot_created = True
        self.consistent_point = created.consistent_point
        log.info(
            "replication slot created", slot=src.slot, two_phase=src.two_phase, failover=failover
        )
        return True

    def _failover_for(self, client: ReplicationClient) -> bool:
        src = self.config.source
        server_version = client.server_version
        if client.in_hot_standby:  # logical decoding on a standby (16+): a local slot
            if src.failover is True:
                raise ConfigError(
                    "source.failover: a slot created on a standby cannot be a failover slot; "
                    "set source.failover to auto or false, or connect to the primary"
                )
            log.warning(
                "the slot is created on a standby: it is not a failover slot and is lost when "
                "another server is promoted",
                slot=src.slot,
            )
            return False
        failover = wants_failover(src, server_version)
        if src.failover == "auto" and not failover and server_version >= 170000:
            log.warning(
                "PostgreSQL 17 cannot create a slot with both FAILOVER and TWO_PHASE: the slot "
                "is not a failover slot and will not survive a failover (18 allows both)",
                slot=src.slot,
            )
        return failover

    async def _ensure_failover(self, info: Any) -> None:
        """Make an existing slot a failover slot when asked to (it was created without)."""
        src = self.config.source
        if info.failover is None or info.failover or info.synced:
            return
        version = await slots.server_version(self.catalog_conn)
        if not wants_failover(src, version):
            return
        client = await self.replication_client()
        try:
            await client.alter_slot_failover(src.slot, True)
            log.info("replication slot made a failover slot", slot=src.slot)
        except DefiniteSourceError as exc:
            log.warning(
                "could not make the slot a failover slot; it will not survive a failover",
                slot=src.slot,
                error=str(exc),
            )
        finally:
            await client.close()

    async def replication_client(self) -> ReplicationClient:
        src = self.config.source
        return await ReplicationClient.connect(
            self.params,
            application_name=src.application_name,
            connect_timeout=src.connect_timeout,
            status_interval=src.status_interval,
        )

    async def close(self) -> None:
        if self.catalog_conn is not None:
            conn, self.catalog_conn = self.catalog_conn, None
            try:
                await conn.close(timeout=5)
            except Exception:
                conn.terminate()

    # -- questions asked while streaming (cdcd.pipeline) --------------------------------------

    async def publication_exists(self) -> bool:
        conn = await open_sql(self.params, self.config.source.connect_timeout)
        try:
            return bool(
                await conn.fetchval(
                    "SELECT EXISTS (SELECT 1 FROM pg_publication WHERE pubname = $1)",
                    self.config.source.publication,
                )
            )
        finally:
            await conn.close()
