"""Watching the slot: wal_status, safe_wal_size and retained WAL, for metrics and warnings.

Best effort: a failed poll is logged at debug level and tried again at the next interval.
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog

from cdcd.lsn import parse_lsn
from cdcd.source import open_sql
from cdcd.source.queries import slot_health
from cdcd.stats import Stats

log = structlog.get_logger("cdcd.slot_watch")


async def watch_slot(source: Any, stats: Stats, interval: float = 15.0) -> None:
    src = source.config.source
    warned = False
    conn: Any = None
    while True:
        row = None
        try:
            if conn is None or conn.is_closed():
                conn = await open_sql(source.params, src.connect_timeout)
            row = await slot_health(conn, src.slot)
        except asyncio.CancelledError:
            if conn is not None:
                conn.terminate()
            raise
        except Exception as exc:  # best effort: metrics only
            log.debug("slot poll failed", error=str(exc))
        if row is not None:
            stats.slot_wal_status = row[0]
            stats.slot_safe_wal_size = row[1]
            stats.server_wal_end = max(stats.server_wal_end, parse_lsn(row[2]))
            stats.slot_retained_bytes = row[3] or 0
            if stats.slot_retained_bytes > src.retained_wal_warning and not warned:
                log.warning(
                    "the slot retains more WAL than source.retained_wal_warning",
                    retained_bytes=stats.slot_retained_bytes,
                    budget_bytes=src.retained_wal_warning,
                    wal_status=row[0],
                    safe_wal_size=row[1],
                )
                warned = True
            elif stats.slot_retained_bytes <= src.retained_wal_warning:
                warned = False
        await asyncio.sleep(interval)
