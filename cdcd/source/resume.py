"""Whether an interrupted initial snapshot can be resumed rather than taken again
(docs/snapshots.md, "Interrupted").

The interrupted attempt recorded, per table, what every sink holds durably
(:meth:`cdcd.source.snapshot.SnapshotState.progress`): ``done``, or the rows up to a key for a
table read in key order. Its slot still exists and was never confirmed past the snapshot's
consistent point P (nothing streams before the snapshot ends), so streaming from it carries
every change after P. The rest of each table is then read by an incremental snapshot
(:mod:`cdcd.snapshot.incremental`) after the recorded key: the rows up to it were emitted at
P - 1, every later change of them is streamed, and the incremental snapshot's rows come at
their own, later positions. That needs what an incremental snapshot needs (a key for every
table not done, ``source.messages``, text keys, a primary), and ``snapshot.mode: initial``
(``initial_only`` does not stream); otherwise the snapshot is taken again on a new slot.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cdcd.config import Config
from cdcd.source import slot as slots
from cdcd.source.snapshot import SnapshotState, published_tables, usable_key


@dataclass(slots=True)
class Resume:
    """An interrupted initial snapshot to finish incrementally: its consistent point, and
    for each table not done ``(schema.name)``, the key its rows are durable up to (None: from
    the first) and how many rows that was."""

    point: int
    tables: dict[str, tuple[list[Any] | None, int]]


async def incremental_unavailable(conn: Any, config: Config) -> str | None:
    """Why an incremental snapshot cannot run against this source and configuration, or
    None."""
    if not config.source.messages:
        return "source.messages is off, and an incremental snapshot's watermarks need it"
    if config.source.binary:
        return "source.binary is on, and an incremental snapshot compares keys as text"
    if await slots.in_recovery(conn):
        return (
            "cdcd is connected to a standby, where an incremental snapshot cannot write its "
            "watermarks"
        )
    return None


async def resume_plan(
    conn: Any, config: Config, state: SnapshotState, info: Any
) -> tuple[Resume | None, str]:
    """How the interrupted snapshot recorded in ``state`` resumes on the slot ``info``, or
    None and why it cannot."""
    recorded = state.recorded()
    if recorded is None:
        return None, "its progress was not recorded"
    point, progress = recorded
    src = config.source
    why: str | None
    if config.snapshot.mode != "initial":
        why = f"snapshot.mode is {config.snapshot.mode} (only initial streams the rest)"
    elif info.confirmed_flush_lsn != point:
        why = "the slot moved since the snapshot was exported"
    else:
        why = await incremental_unavailable(conn, config)
    if why is not None:
        return None, why
    rest: dict[str, tuple[list[Any] | None, int]] = {}
    for publication in src.publication_names():
        for table in await published_tables(conn, publication):
            name = f"{table.relation.namespace}.{table.relation.name}"
            entry = progress.get(name) or {}
            if entry.get("status") == "done" or name in rest:
                continue
            if await usable_key(conn, table) is None:
                return None, f"{name} has no usable key and was not done"
            rest[name] = (entry.get("last_key"), int(entry.get("rows") or 0))
    return Resume(point, rest), ""
