"""``cdcd check`` and ``cdcd slot create|drop|status``: one-shot commands on the source."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, replace
from typing import Any, TextIO

from cdcd.config import Config
from cdcd.directories import write_problem, written_dirs
from cdcd.errors import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_SOURCE,
    EXIT_USAGE,
    CdcdError,
    DefiniteSourceError,
)
from cdcd.lsn import format_lsn, parse_lsn
from cdcd.replication.client import SlotExists
from cdcd.snapshot.signals import KEY_ENV, key_path
from cdcd.source import publication as publications
from cdcd.source import queries
from cdcd.source import slot as slots
from cdcd.source.prepare import existing_slot_backfill, untaken_snapshot
from cdcd.source.snapshot import SnapshotState, incremental_state_path, slot_record_path

OK, WARN, FAIL = "ok", "warn", "FAIL"


@dataclass
class Finding:
    item: str
    status: str
    detail: str


def _table(findings: list[Finding], out: TextIO) -> None:
    width = max(len(f.item) for f in findings)
    for f in findings:
        out.write(f"{f.item:<{width}}  {f.status:<4}  {f.detail}\n")


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n = n / 1024  # type: ignore[assignment]
    return str(n)


async def check_async(config: Config, out: TextIO = sys.stdout) -> int:
    from cdcd.replication.options import stream_options
    from cdcd.source import Source

    src = config.source
    findings = _directory_findings(config)
    # a directory cdcd cannot write is a config/environment problem, as in `run` (exit 2)
    dirs_failed = any(f.status == FAIL for f in findings)
    findings += _sink_findings(config)
    source = Source(config)
    try:
        await source.connect_catalog()
    except CdcdError as exc:
        findings.append(Finding("connection", FAIL, str(exc)))
        _table(findings, out)
        if dirs_failed:
            return EXIT_USAGE
        return exc.exit_code if exc.exit_code != EXIT_FAILURE else EXIT_SOURCE
    conn = source.catalog_conn
    try:
        version_num = await slots.server_version(conn)
        version = await conn.fetchval("SHOW server_version")
        findings.append(
            Finding("connection", OK, f"{source.params.describe()} as {source.params.user}")
        )
        findings.append(Finding("server version", OK, str(version)))
        try:
            await slots.check_wal_level(conn)
            findings.append(Finding("wal_level", OK, "logical"))
        except DefiniteSourceError as exc:
            findings.append(Finding("wal_level", FAIL, str(exc)))
        try:
            opts = stream_options(src, version_num)
            detail = ", ".join(f"{k}={v}" for k, v in opts.options.items())
            findings.append(Finding("protocol", OK, detail))
        except CdcdError as exc:
            findings.append(Finding("protocol", FAIL, str(exc)))
        privileges = await slots.check_privileges(conn)
        if not privileges["can_replicate"]:
            findings.append(
                Finding(
                    "privileges",
                    FAIL,
                    f"role {source.params.user!r} lacks REPLICATION: ALTER ROLE ... REPLICATION",
                )
            )
        elif src.create_publication and not privileges["create_on_database"]:
            findings.append(
                Finding(
                    "privileges", WARN, "no CREATE on the database: cannot create the publication"
                )
            )
        else:
            findings.append(
                Finding(
                    "privileges",
                    OK,
                    "replication" + (", superuser" if privileges["rolsuper"] else ""),
                )
            )
        if config.snapshot.mode == "incremental" or config.snapshot.new_tables:
            findings.append(await _watermark_finding(conn, config.snapshot.mode))
        findings.append(_signal_finding(config))
        info = await slots.slot_info(conn, src.slot)
        if info is None:
            status = OK if src.create_slot else FAIL
            findings.append(
                Finding(
                    "slot",
                    status,
                    f"{src.slot!r} does not exist"
                    + (" (will be created)" if src.create_slot else ""),
                )
            )
        else:
            lag = await queries.slot_lag(conn, src.slot)
            detail = (
                f"{src.slot!r} active={info.active} wal_status={info.wal_status} "
                f"confirmed={format_lsn(info.confirmed_flush_lsn or 0)} lag={_size(lag)} "
                f"safe_wal_size={_size(info.safe_wal_size)}"
            )
            lost = info.invalidated
            if lost:
                detail += f" invalidated ({info.invalidation_reason or 'wal_removed'})"
                if src.on_slot_lost == "recreate":
                    detail += (
                        ": on_slot_lost is recreate, cdcd replaces it at start (reset, backfill)"
                    )
                    lost = False
            bad = lost or info.plugin not in (None, "pgoutput")
            status = FAIL if bad else WARN if info.invalidated else OK
            if status == OK and lag is not None and lag > src.retained_wal_warning:
                status = WARN
            findings.append(Finding("slot", status, detail))
            if untaken_snapshot(config):
                findings.append(await _untaken_snapshot_finding(conn, config))
        findings.extend(await _failover_findings(source, conn, info, version_num))
        findings.extend(await _publication_findings(conn, src))
    finally:
        await source.close()
    _table(findings, out)
    if dirs_failed:
        return EXIT_USAGE
    failed = [f for f in findings if f.status == FAIL]
    return EXIT_SOURCE if failed else EXIT_OK


async def _untaken_snapshot_finding(conn: Any, config: Config) -> Finding:
    """The slot exists, ``snapshot.mode`` asks for the existing rows, and no snapshot of this
    configuration was taken: what ``cdcd run`` will do (:func:`existing_slot_backfill`)."""
    tables, problem = await existing_slot_backfill(conn, config)
    if problem is not None:
        return Finding("snapshot", FAIL, problem)
    return Finding(
        "snapshot",
        WARN,
        f"the slot exists and no snapshot was taken: cdcd run backfills every published table "
        f"({len(tables)}) with an incremental snapshot",
    )


def _signal_finding(config: Config) -> Finding:
    """Where the key that signs ``cdcd snapshot --table`` requests comes from
    (:mod:`cdcd.snapshot.signals`); the key itself is never shown."""
    snap = config.snapshot
    if snap.signal_secret():
        where = "snapshot.signal_key"
    elif os.environ.get(KEY_ENV):
        where = KEY_ENV
    else:
        path = key_path(snap.state_dir, config.source.slot)
        where = f"{path}" + ("" if path.exists() else " (made at first use)")
    return Finding("signals", OK, f"cdcd snapshot --table requests signed with the key in {where}")


async def _watermark_finding(conn: Any, mode: str) -> Finding:
    """Incremental snapshots write watermarks with pg_logical_emit_message (docs/snapshots.md): EXECUTE on it (PUBLIC's by default), on a primary."""
    signature, allowed = await queries.emit_message_grant(conn)
    status = OK if allowed else FAIL if mode == "incremental" else WARN
    detail = (
        "pg_logical_emit_message: EXECUTE granted"
        if allowed
        else f"no EXECUTE on pg_logical_emit_message: GRANT EXECUTE ON FUNCTION {signature} "
        "TO this role"
    )
    return Finding("watermarks", status, detail)


def _directory_findings(config: Config) -> list[Finding]:
    """One line per directory cdcd writes (:mod:`cdcd.directories`): writable or why not."""
    findings = []
    for written in written_dirs(config):
        problem = write_problem(written.path)
        if problem is not None:
            findings.append(Finding(written.key, FAIL, problem))
        else:
            creates = "" if written.path.exists() else " (will be created)"
            findings.append(Finding(written.key, OK, f"{written.path} writable{creates}"))
    return findings


def _sink_findings(config: Config) -> list[Finding]:
    """What each sink checks before the stream starts (``Sink.preflight``: an object store's
    bucket); a definite problem there fails the check (exit 3)."""
    findings = []
    for index, spec in enumerate(config.sinks):
        key = f"sinks[{index}]"
        try:
            checked = spec.sink_class.preflight(spec.config, key)
        except CdcdError as exc:
            findings.append(Finding(key, FAIL, str(exc)))
            continue
        if checked is not None:
            findings.append(Finding(key, OK, checked))
    return findings


def preflight_sinks(config: Config) -> None:
    """``cdcd run``, before it connects: each sink's checks (``Sink.preflight``); the first
    problem raises, naming the sink's key."""
    for index, spec in enumerate(config.sinks):
        spec.sink_class.preflight(spec.config, f"sinks[{index}]")


async def current_wal_end(config: Config) -> int:
    """Where the server's WAL ends now: ``cdcd run --endpos`` without an LSN stops there.

    ``pg_current_wal_insert_lsn()``, not ``pg_current_wal_lsn()``: the latter is how far the
    WAL is written out, and with asynchronous commit a transaction other sessions already see
    can end past it; the insert position covers every commit made so far. On a standby (in
    recovery) it is how far WAL has been replayed.
    """
    from cdcd.source import Source

    source = Source(config)
    await source.connect_catalog()
    try:
        text = await queries.wal_end(source.catalog_conn)
    finally:
        await source.close()
    return parse_lsn(text)


async def _failover_findings(
    source: Any, conn: Any, info: slots.SlotInfo | None, version: int
) -> list[Finding]:
    """Failover slot, what protects it on the primary, each host of the DSN, and 18's
    ``idle_replication_slot_timeout`` (docs/high-availability.md)."""
    from cdcd.source import wants_failover

    src = source.config.source
    findings: list[Finding] = []
    wanted = wants_failover(src, version)
    setup = await slots.failover_setup(conn)
    if setup is None:
        status = FAIL if src.failover is True else OK
        findings.append(
            Finding(
                "failover",
                status,
                f"not available before PostgreSQL 17 (server {version // 10000})",
            )
        )
    else:
        if info is None:
            slot_state = "will be created " + ("with FAILOVER" if wanted else "without FAILOVER")
        else:
            slot_state = f"failover={info.failover} synced={info.synced}"
        protected = setup.protected and setup.active == setup.synchronized_standby_slots
        listed = ",".join(setup.synchronized_standby_slots) or "(none)"
        detail = f"slot {slot_state}; synchronized_standby_slots={listed}"
        status = OK
        if wanted and not setup.protected and not setup.physical_slots:
            detail += " (no physical slot: no standby synchronises slots from this server)"
        elif wanted and not setup.protected:
            status = WARN
            detail += (
                ": nothing holds changes back until a standby has them, so after a failover "
                "cdcd may have published transactions the new primary never had; list the "
                "standby's physical slot in synchronized_standby_slots"
            )
        elif wanted and not protected:
            status = WARN
            inactive = sorted(set(setup.synchronized_standby_slots) - set(setup.active))
            detail += (
                f": no standby streams from {', '.join(inactive)}; logical walsenders wait for "
                "it (cdcd stalls) until it is back or removed from the list"
            )
        elif not wanted:
            detail += " (source.failover is off: the slot is lost at a failover)"
        elif info is not None and not info.failover:
            status = WARN
            detail += " (cdcd run makes it a failover slot)"
        findings.append(Finding("failover", status, detail))
    findings.extend(await _host_findings(source, wanted))
    timeout = await slots.idle_slot_timeout(conn)
    if timeout is not None:
        off = timeout in ("0", "0ms", "0s", "0min")
        findings.append(
            Finding(
                "idle slot timeout",
                OK if off else WARN,
                "idle_replication_slot_timeout is off"
                if off
                else f"idle_replication_slot_timeout={timeout}: the slot is invalidated when "
                "cdcd stays away longer (changes are then lost)",
            )
        )
    return findings


async def _host_findings(source: Any, wanted: bool) -> list[Finding]:
    """One row per host of a multi-host DSN: primary or standby, and on a standby whether it
    synchronises the slot (``sync_replication_slots`` and what it needs)."""
    from cdcd.source import open_sql

    hosts = source.params.each_host()
    if len(hosts) < 2:
        return []
    src = source.config.source
    findings = []
    for host in hosts:
        where = f"  {host.host}:{host.port}"
        try:
            conn = await open_sql(replace(host, target_session_attrs="any"), src.connect_timeout)
        except CdcdError as exc:
            findings.append(Finding(where, WARN, f"unreachable: {exc}"))
            continue
        try:
            if not await slots.in_recovery(conn):
                findings.append(Finding(where, OK, "primary"))
                continue
            findings.append(await _standby_finding(conn, where, src.slot, wanted))
        finally:
            await conn.close()
    return findings


async def _standby_finding(conn: Any, where: str, slot: str, wanted: bool) -> Finding:
    version = await slots.server_version(conn)
    if version < 170000:
        return Finding(where, WARN if wanted else OK, "standby (no slot synchronisation before 17)")
    settings, synced = await queries.standby_slot_sync(conn, slot)
    missing = [
        name
        for name, value in settings.items()
        if (value in ("off", "") if name != "primary_slot_name" else not value)
    ]
    if missing:
        return Finding(where, WARN, f"standby; cannot synchronise slots: set {', '.join(missing)}")
    if synced is None or synced["temporary"]:
        return Finding(
            where,
            WARN if wanted else OK,
            f"standby; slot {slot!r} not synchronised yet (it becomes ready for a failover once "
            "cdcd has streamed from it on the primary; a slot lost at a failover now)",
        )
    if synced["invalidation_reason"]:
        reason = synced["invalidation_reason"]
        return Finding(where, WARN, f"standby; its copy of the slot is invalidated ({reason})")
    return Finding(where, OK, f"standby; slot {slot!r} synchronised, ready for a failover")


async def _publication_findings(conn: Any, src: Any) -> list[Finding]:
    """The publication (as it is, or as cdcd run would create it) and one row per table it
    covers with its replica identity; FAIL for a table whose UPDATE/DELETE would fail once
    published and that cdcd run would not fix (docs/keyless-tables.md)."""
    tables = list(src.tables) or None
    policy = src.keyless_tables
    exists = await slots.publication_exists(conn, src.publication)
    if not exists and not src.create_publication:
        return [Finding("publication", FAIL, f"{src.publication!r} does not exist")]
    try:
        pub = await publications.describe(conn, src.publication, tables)
    except DefiniteSourceError as exc:  # e.g. a table of source.tables that does not exist
        return [Finding("publication", FAIL, str(exc))]
    handled: dict[str, str] = {}  # table -> what cdcd run does about it
    if not exists:
        listed = bool(tables) or policy in ("insert_only", "exclude")
        try:
            planned = publications.plan(pub, policy, listed)
        except publications.BreakingTablesError:
            planned = None
        if planned is None:
            shape = "FOR ALL TABLES" if not tables else "FOR TABLE source.tables"
        elif planned.main is None:
            shape = "FOR ALL TABLES"
        else:
            shape = f"FOR TABLE {len(planned.main)} tables"
        if planned is not None and planned.insert_only is not None:
            twin = src.insert_only_publication()
            shape += f", and {twin!r} (inserts and truncates only)"
            handled.update(
                (t.qualified, f"published to {twin!r}: inserts and truncates only")
                for t in planned.insert_only
            )
        if planned is not None:
            handled.update((t.qualified, "left out of the publication") for t in planned.excluded)
            handled.update(
                (leaf.qualified, "cdcd run sets REPLICA IDENTITY FULL") for leaf in planned.full
            )
        head = Finding(
            "publication",
            OK,
            f"{src.publication!r} does not exist (will be created {shape}; "
            f"source.keyless_tables: {policy})",
        )
    else:
        owner = "managed by cdcd" if pub.managed else "created outside cdcd: cdcd leaves it as is"
        shape = "FOR ALL TABLES" if pub.all_tables else f"{len(pub.tables)} tables"
        if not pub.updates_or_deletes:
            shape += ", no updates or deletes"
        head = Finding("publication", OK, f"{src.publication!r}: {shape} ({owner})")
        if (
            pub.managed
            and policy != "refuse"
            and not (pub.all_tables and policy in ("insert_only", "exclude"))
        ):
            for leaf in pub.breaking:
                handled[leaf.qualified] = f"cdcd run fixes it (source.keyless_tables: {policy})"
    findings = [head]
    breaking = []
    for table in pub.tables:
        for leaf in table.leaves:
            item = f"  {leaf.qualified}"
            if leaf.qualified != table.qualified:
                item += f" (partition of {table.qualified})"
            fix = handled.get(leaf.qualified) or handled.get(table.qualified)
            if leaf.usable or not pub.updates_or_deletes:
                findings.append(Finding(item, OK, leaf.describe()))
            elif fix is not None:
                findings.append(Finding(item, WARN, f"{leaf.describe()}: {fix}"))
            else:
                breaking.append(leaf)
                findings.append(
                    Finding(
                        item,
                        FAIL,
                        f"{leaf.describe()}: UPDATE and DELETE "
                        f"{'fail' if exists else 'would fail'} once published. "
                        f"Fix: {publications.fixes(leaf)}",
                    )
                )
    if breaking:
        findings.append(
            Finding(
                "keyless tables",
                FAIL,
                f"{', '.join(leaf.qualified for leaf in breaking)}: "
                + (
                    "cdcd run refuses to create the publication. "
                    if not exists
                    else "the publication breaks their writes now. "
                )
                + "Fix them, or set source.keyless_tables (insert_only, exclude, "
                "replica_identity_full; docs/keyless-tables.md)",
            )
        )
    twin = src.insert_only_publication()
    if policy == "insert_only" and exists and await slots.publication_exists(conn, twin):
        for table in (await publications.describe(conn, twin, None)).tables:
            for leaf in table.leaves:
                findings.append(
                    Finding(
                        f"  {leaf.qualified}",
                        OK,
                        f"{leaf.describe()}; in {twin!r}: inserts and truncates only",
                    )
                )
    return findings


async def slot_async(config: Config, action: str, out: TextIO = sys.stdout) -> int:
    from cdcd.source import Source

    src = config.source
    source = Source(config)
    try:
        if action == "create":
            await source.connect_catalog()
            if src.create_publication:
                current = await publications.ensure(source.catalog_conn, src)
                publications.warn_breaking(current)
            if await source.create_slot():
                out.write(
                    f"created slot {src.slot!r} at {format_lsn(source.consistent_point or 0)}\n"
                )
            else:
                out.write(f"slot {src.slot!r} already exists\n")
            if untaken_snapshot(config):
                out.write(
                    f"snapshot.mode is {config.snapshot.mode}: with no snapshot taken yet, "
                    "cdcd run backfills every published table with an incremental snapshot "
                    "(cdcd check tells whether it can)\n"
                )
            return EXIT_OK
        if action == "drop":
            # cdcd starts over: a new slot and a new snapshot (see Source.prepare)
            SnapshotState(config.snapshot.state_dir, src.slot).path.unlink(missing_ok=True)
            incremental_state_path(config.snapshot.state_dir, src.slot).unlink(missing_ok=True)
            slot_record_path(config.snapshot.state_dir, src.slot).unlink(missing_ok=True)
            client = await source.replication_client()
            try:
                await client.drop_slot(src.slot)
            except DefiniteSourceError as exc:
                if "does not exist" in str(exc):
                    out.write(f"slot {src.slot!r} does not exist\n")
                    return EXIT_OK
                raise
            finally:
                await client.close()
            out.write(f"dropped slot {src.slot!r}\n")
            return EXIT_OK
        if action == "status":
            await source.connect_catalog()
            info = await slots.slot_info(source.catalog_conn, src.slot)
            if info is None:
                out.write(f"slot {src.slot!r} does not exist\n")
                return EXIT_SOURCE
            for field in (
                "name",
                "plugin",
                "database",
                "active",
                "active_pid",
                "two_phase",
                "failover",
                "synced",
                "wal_status",
                "safe_wal_size",
                "restart_lsn",
                "confirmed_flush_lsn",
                "invalidation_reason",
            ):
                value = getattr(info, field)
                if field.endswith("_lsn") and value is not None:
                    value = format_lsn(value)
                out.write(f"{field:<20} {value}\n")
            setup = await slots.failover_setup(source.catalog_conn)
            if setup is not None:
                listed = ",".join(setup.synchronized_standby_slots) or "(none)"
                active = ",".join(setup.active) or "(none)"
                out.write(f"{'standby_slots':<20} {listed} (streaming: {active})\n")
                if info.failover and not (
                    setup.protected or setup.in_recovery or not setup.physical_slots
                ):
                    out.write(
                        "warning: the slot is a failover slot but synchronized_standby_slots is "
                        "empty: cdcd may receive changes a standby does not have yet\n"
                    )
            return EXIT_SOURCE if info.invalidated else EXIT_OK
        raise ValueError(action)
    finally:
        await source.close()


__all__ = ["SlotExists", "check_async", "slot_async"]


# -- the entry points cdcd.cli dispatches to -----------------------------------------------------


def run(config: Config, endpos: int | None) -> int:
    """``cdcd run``: the daemon (:mod:`cdcd.runtime`). Every directory it will write is checked
    first (exit 2 naming the key, rather than an I/O error later), then what each sink checks
    before the stream (an object store's bucket: exit 3): nothing is created on the source
    before."""
    from cdcd import runtime
    from cdcd.directories import ensure_writable

    ensure_writable(config)
    preflight_sinks(config)
    return runtime.run(config, endpos)


def current_endpos(config: Config) -> int:
    """``cdcd run --endpos`` without an LSN (or ``now``): where the server's WAL ends now."""
    from cdcd.runtime import run_async

    return int(run_async(current_wal_end(config)))


def check(config: Config) -> int:
    """``cdcd check``: report on the source; non-zero on any blocking problem."""
    from cdcd.runtime import run_async

    return int(run_async(check_async(config)))


def slot(config: Config, action: str) -> int:
    """``cdcd slot create|drop|status``."""
    from cdcd.runtime import run_async

    return int(run_async(slot_async(config, action)))
