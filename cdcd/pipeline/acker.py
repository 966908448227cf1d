"""Acknowledgement: the standby status updates that confirm positions to the server.

Every 0.2 s (and once more when draining) it asks the sinks what they hold durably, asks the
progress tracker (:mod:`cdcd.pipeline.progress`) what may therefore be confirmed, records it, and
sends it: sink durable ▶ tracker ▶ flush position reported, in that order, never the other way.
With ``--endpos`` it finishes the run once the reader has reached it: everything handed over
made durable, confirmed, then the pipeline stops.
"""

from __future__ import annotations

import asyncio
import contextlib

import structlog

from cdcd.errors import CdcdError, DefiniteSourceError, TransientSourceError
from cdcd.lsn import format_lsn
from cdcd.pipeline.progress import ProgressTracker
from cdcd.pipeline.reader import Reader
from cdcd.pipeline.supervisor import Supervisor
from cdcd.pipeline.writer import Writer
from cdcd.stats import Stats

log = structlog.get_logger("cdcd.acker")

TICK_SECONDS = 0.2


class Acker:
    def __init__(
        self,
        tracker: ProgressTracker,
        writer: Writer,
        reader: Reader,
        supervisor: Supervisor,
        stats: Stats,
        stop: asyncio.Event,
    ) -> None:
        self.tracker = tracker
        self.writer = writer
        self.reader = reader
        self.supervisor = supervisor
        self.stats = stats
        self._stop = stop

    async def acknowledge(self, *, final: bool = False) -> None:
        """Confirm what may be confirmed; send a status update if it moved (or ``final``)."""
        tracker = self.tracker
        self.writer.poll_durable()
        ceiling = self.reader.handover.ceiling()  # the assembler's, and parts being handed
        answer = tracker.confirmable(ceiling)
        if answer.position > tracker.confirmed_lsn:
            log.debug(
                "confirming",
                position=format_lsn(answer.position),
                durable=format_lsn(answer.durable),
                ceiling=None if ceiling is None else format_lsn(ceiling),
                idle=answer.idle,
            )
        moved = tracker.confirm(answer.position)
        self.stats.confirmed_lsn = tracker.confirmed_lsn
        self.stats.caught_up = tracker.caught_up(ceiling)
        client = self.supervisor.client
        if client is None:
            return
        confirmed = tracker.confirmed_lsn
        client.set_positions(written=max(tracker.received_lsn, confirmed), flushed=confirmed)
        if moved or final:
            with contextlib.suppress(CdcdError, OSError):
                await client.send_status()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(TICK_SECONDS)
            if self.supervisor.publication_check_due:
                self.supervisor.publication_check_due = False
                try:
                    await self._check_publication()
                except TransientSourceError as exc:  # check again at the next tick
                    log.warning("could not check the publication", error=str(exc))
                    self.supervisor.publication_check_due = True
            await self.acknowledge()
            if self.reader.endpos_reached:
                await self._finish_endpos()
                return

    async def _finish_endpos(self) -> None:
        """With --endpos: wait until everything handed over is durable, confirm, stop."""
        while self.writer.queued_transactions:
            await asyncio.sleep(0.05)
        await self.writer.flush_all()
        await self.acknowledge(final=True)
        self._stop.set()

    async def _check_publication(self) -> None:
        """A definite error when the publication does not exist (any more)."""
        source = self.supervisor.source
        name = source.config.source.publication
        if not await source.publication_exists():
            raise DefiniteSourceError(
                f"publication {name!r} does not exist: it was dropped while streaming, and the "
                "server skips the changes it would have published. Re-create it and "
                "re-snapshot the tables (changes since the drop were not captured)"
            )
        log.warning(
            "the server skipped the publication at an earlier WAL position (created "
            "after the slot?); changes before its creation are not published",
            publication=name,
        )
