"""``cdcd snapshot --table schema.table ...`` and ``cdcd snapshot status``.

The request is a signal in the replication stream (docs/snapshots.md): a
transactional logical message with the prefix ``cdcd-signal`` naming the slot and the tables,
signed with the signal key (:mod:`cdcd.snapshot.signals`). The running
daemon sees it in commit order with the changes, records the request in ``snapshot.state_dir``
at once, and snapshots the tables incrementally; a daemon that is not running sees it when it
next starts (the slot keeps it until confirmed). ``status`` reads what the daemon recorded.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, TextIO

from cdcd.errors import EXIT_OK, EXIT_USAGE, ConfigError, DefiniteSourceError
from cdcd.lsn import parse_lsn
from cdcd.progress_rate import (
    STATISTICS,
    duration,
    estimate_source,
    show_estimate,
    show_percent,
)
from cdcd.snapshot.signals import KEY_ENV, SIGNAL, sign, signal_key
from cdcd.source.connect import conn_params, open_sql
from cdcd.source.queries import emit_message
from cdcd.source.snapshot import NO_KEY, key_problem, primary_key, published_tables

if TYPE_CHECKING:
    from cdcd.config import Config


def qualified(tables: list[str]) -> list[str]:
    """``schema.table`` names (``public`` when none is given)."""
    return [t if "." in t else f"public.{t}" for t in tables]


async def request_async(config: Config, tables: list[str], out: TextIO = sys.stdout) -> int:
    """Check every table (published, with a key it can page through), then write the signal;
    returns the signal's LSN."""
    names = qualified(tables)
    if not config.source.messages:
        raise DefiniteSourceError(
            "cdcd snapshot --table: source.messages is off, so the daemon would never see the "
            "request (a logical message) nor the snapshot's watermarks (turn it on)"
        )
    conn = await open_sql(conn_params(config), config.source.connect_timeout)
    try:
        published = {
            f"{t.relation.namespace}.{t.relation.name}": t
            for t in await published_tables(conn, config.source.publication)
        }
        for name in names:
            table = published.get(name)
            if table is None:
                raise DefiniteSourceError(
                    f"--table {name}: not in publication {config.source.publication!r} "
                    "(add it: ALTER PUBLICATION ... ADD TABLE)"
                )
            key = await primary_key(conn, table.relation.oid)
            if not key:
                raise DefiniteSourceError(f"--table {name}: not snapshotted: {NO_KEY}")
            problem = await key_problem(conn, table, [(str(k[0]), str(k[1])) for k in key])
            if problem is not None:
                raise DefiniteSourceError(f"--table {name}: {problem}")
        snap = config.snapshot
        try:
            secret, made = signal_key(snap.signal_secret(), snap.state_dir, config.source.slot)
        except OSError as exc:
            raise ConfigError(
                f"snapshot.signal_key: not set, nor {KEY_ENV}, and the key file in "
                f"snapshot.state_dir {snap.state_dir} cannot be read or made: {exc}"
            ) from exc
        if made is not None:
            out.write(
                f"made a signal key in {made}: the daemon must sign with the same key (it reads "
                f"this file, or snapshot.signal_key / {KEY_ENV})\n"
            )
        content = sign(secret, config.source.slot, names)
        lsn = await emit_message(conn, SIGNAL, content, "cdcd snapshot --table")
    finally:
        await conn.close()
    out.write(f"requested a snapshot of {', '.join(names)} (signal at {lsn})\n")
    out.flush()
    return parse_lsn(lsn)


def status(config: Config, out: TextIO = sys.stdout, follow: bool = False) -> int:
    """Per table: status, rows durable in every sink / estimated rows, percent, bytes read,
    and while running the last rate and the ETA at it; with ``follow``, then the progress of
    those running until they end."""
    from tqdm import tqdm

    from cdcd import snapshot_follow
    from cdcd.snapshot.state import IncrementalState

    if follow:
        return snapshot_follow.follow(config, None, out=out)
    state = IncrementalState(config.snapshot.state_dir, config.source.slot)
    if not state.tables:
        out.write(f"no incremental snapshot recorded in {state.path}\n")
        return EXIT_OK
    width = max(len(name) for name in state.tables)
    out.write(
        f"{'table':<{width}}  {'status':<8}  {'rows':>10}  {'estimate':>10}  {'done':>5}  "
        f"{'bytes':>7}  {'rows/s':>8}  ETA\n"
    )
    for name, t in state.tables.items():
        estimate = int(t.get("estimate") or 0)
        source = estimate_source(t)
        rows = int(t.get("rows") or 0)
        pct = show_percent(t["status"], rows, estimate, source)
        size = tqdm.format_sizeof(int(t.get("bytes") or 0), "B", 1024)
        rate = t.get("rows_per_s") if t["status"] == "running" else None
        eta = (estimate - rows) / rate if rate and source and estimate > rows else None
        speed = "-" if rate is None else f"{rate:,}"
        shown = show_estimate(estimate, source, separators=False)
        out.write(
            f"{name:<{width}}  {t['status']:<8}  {rows:>10}  {shown:>10}  {pct:>5}  "
            f"{size:>7}  {speed:>8}  {duration(eta) if rate else '-'}\n"
        )
    if any(estimate_source(t) != STATISTICS for t in state.tables.values()):
        out.write(
            "~: estimated from the table's size (never analysed); ?: no estimate (ANALYZE the "
            "table for one)\n"
        )
    return EXIT_OK


def request(config: Config, tables: list[str], follow: bool = False) -> int:
    """Request the snapshot; with ``follow``, then show its progress until it ends."""
    from cdcd.runtime import run_async

    if not tables:
        print("cdcd snapshot: name at least one --table schema.table", file=sys.stderr)
        return EXIT_USAGE
    lsn = int(run_async(request_async(config, tables)))
    if not follow:
        return EXIT_OK
    from cdcd import snapshot_follow  # the state file's reader: only to follow

    return snapshot_follow.follow(config, qualified(tables), after_signal=lsn)
