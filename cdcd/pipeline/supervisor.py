"""Supervision of the source: reconnect with backoff, give up when told to.

Failures are classified by :mod:`cdcd.errors`, and this module acts on the class alone: a
:class:`~cdcd.errors.TransientSourceError` (connection lost, server restarting, standby not
promoted yet) reconnects after a backoff that doubles from ``source.reconnect_min_backoff`` to
``source.reconnect_max_backoff``, until ``source.give_up_after`` seconds of consecutive failures
(then it becomes definite); a :class:`~cdcd.errors.SlotLostError` goes to :attr:`on_slot_lost`
when set (``source.on_slot_lost: recreate``), then streaming resumes from the new slot; anything
else propagates and stops the daemon (``cdcd.runtime`` maps it to an exit code). A session that
streamed resets the backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

import structlog

from cdcd.errors import DefiniteSourceError, SlotLostError, TransientSourceError
from cdcd.pipeline.reader import Reader
from cdcd.replication.client import ReplicationClient
from cdcd.source.catalog import LiveCatalog
from cdcd.stats import Stats

log = structlog.get_logger("cdcd.supervisor")


class Supervisor:
    """Runs :class:`Reader` sessions on fresh connections until it returns normally."""

    def __init__(
        self,
        source: Any,
        reader: Reader,
        catalog: LiveCatalog,
        stats: Stats,
        stop: asyncio.Event,
    ) -> None:
        self.source = source
        self.reader = reader
        self.catalog = catalog
        self.stats = stats
        self._stop = stop
        self.client: ReplicationClient | None = None
        self._catalog_stale = False  # the source was lost: reconnect the catalog too
        #: source.on_slot_lost: recreate (cdcd.pipeline.recreate): replaces a lost slot, after
        #: which streaming resumes from the new one; None: a lost slot stops the daemon
        self.on_slot_lost: Callable[[SlotLostError], Awaitable[None]] | None = None

    async def run(self) -> None:
        src = self.source.config.source
        backoff = src.reconnect_min_backoff
        failing_since: float | None = None
        lost: SlotLostError | None = None
        while not self._stop.is_set():
            try:
                if self._catalog_stale:
                    self.catalog.use_connection(await self.source.reconnect_catalog())
                    self._catalog_stale = False
                if lost is not None:  # replace it (retried like a session when the source fails)
                    await self.on_slot_lost(lost)  # type: ignore[misc]
                    lost = None
                await self._session()
                return  # endpos reached or stop requested
            except SlotLostError as exc:
                if self.on_slot_lost is None or lost is not None:  # no policy, or it failed
                    raise
                self.stats.connected = self.stats.streaming = False
                await self.close_client()
                lost = exc
            except TransientSourceError as exc:
                stats = self.stats
                if stats.streaming:  # it had been streaming: a new run of failures starts
                    backoff = src.reconnect_min_backoff
                    failing_since = None
                stats.connected = False
                stats.streaming = False
                stats.waiting_for = str(exc)
                now = time.monotonic()
                failing_since = failing_since or now
                if src.give_up_after is not None and now - failing_since > src.give_up_after:
                    raise DefiniteSourceError(
                        f"giving up after {src.give_up_after:.0f} s of failed connections: {exc}"
                    ) from exc
                stats.reconnects += 1
                self._catalog_stale = True
                log.warning(
                    "source connection lost; reconnecting", error=str(exc), backoff_s=backoff
                )
                await self.close_client()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, src.reconnect_max_backoff)

    async def _session(self) -> None:
        client = await self.source.replication_client()
        self.client = client
        client.on_notice = self._on_server_notice
        await self.reader.stream(client)

    def _on_server_notice(self, fields: Any) -> None:
        # PostgreSQL 18 does not fail when the publication is missing at a WAL position: it
        # warns "skipped loading publication" (55000) and publishes nothing of those changes
        # (15-17 fail with an error, which ends the stream). The acker checks whether it was
        # dropped.
        if fields.code == "55000" and "publication" in fields.message:
            self.publication_check_due = True

    publication_check_due = False

    async def close_client(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            with contextlib.suppress(Exception):
                await client.close()
