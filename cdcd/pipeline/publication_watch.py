"""Watching the publication for tables whose writes it breaks (docs/keyless-tables.md).

A FOR ALL TABLES (or FOR TABLES IN SCHEMA) publication covers a table the moment it is
created; if that table has no usable replica identity, the application's UPDATE and DELETE on
it fail from then on. Every :data:`POLL_SECONDS` this looks at what the publication covers:
each table that starts breaking is logged as an error with its fix, and counted in
``Stats.breaking_tables`` (``/metrics``, the status page). When cdcd manages the publication
and ``source.keyless_tables`` is ``insert_only``, ``exclude`` or ``replica_identity_full``, the
choice is applied to new tables first (:func:`cdcd.source.publication.reconcile`), so a listed
publication gains each new table, in the right publication.

Best effort: a failed look is logged and tried again at the next one; it never stops cdcd.
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog

from cdcd.errors import CdcdError
from cdcd.source import open_sql
from cdcd.source import publication as publications
from cdcd.source.slot import in_recovery
from cdcd.stats import Stats

log = structlog.get_logger("cdcd.publication_watch")

#: seconds between looks at the publication
POLL_SECONDS = 2.0


async def watch_publication(source: Any, stats: Stats, interval: float = POLL_SECONDS) -> None:
    src = source.config.source
    tables = list(src.tables) or None
    known = set(source.breaking)
    stats.breaking_tables = sorted(known)
    conn: Any = None
    while True:
        try:
            if conn is None or conn.is_closed():
                conn = await open_sql(source.params, src.connect_timeout)
            pub = await publications.describe(conn, src.publication, tables)
            if not pub.exists:  # dropped: the reader stops with what to do
                stats.breaking_tables = []
                await asyncio.sleep(interval)
                continue
            if pub.managed and src.create_publication and not await in_recovery(conn):
                changes = await publications.reconcile(
                    conn, src.publication, tables, src.keyless_tables, src.insert_only_publication()
                )
                if changes:
                    await publications.log_changes(src, changes)
                    pub = await publications.describe(conn, src.publication, tables)
            breaking = publications.warn_breaking(pub, "while running", known)
            known = set(breaking)
            stats.breaking_tables = breaking
        except asyncio.CancelledError:
            if conn is not None:
                conn.terminate()
            raise
        except CdcdError as exc:  # e.g. no right to ALTER TABLE ... REPLICA IDENTITY FULL
            log.error("could not apply source.keyless_tables", error=str(exc))
        except Exception as exc:  # best effort: the next look tries again
            log.warning("could not look at the publication", error=str(exc))
            if conn is not None:
                conn.terminate()
                conn = None
        await asyncio.sleep(interval)
