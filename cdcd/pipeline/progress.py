"""Which LSN may be confirmed to the server: the progress tracker.

This module is pure: no asyncio, no clock, no I/O. The pipeline tells it about the events that
move positions and asks it, without side effects, what may be confirmed. Everything that makes
cdcd lose nothing or resend little is decided here; the rules are those of docs/guarantees.md
and ``docs/progress.md``.

What confirming means
---------------------
The ``flush`` position of a standby status update is the slot's ``confirmed_flush_lsn``. On the
next START_REPLICATION the server skips every transaction whose commit record starts before it
and sends everything else again. So confirming position ``p`` promises that every transaction
committing before ``p`` is held durably by every sink, and that nothing the server would not
resend is still needed. Confirming a transaction's *end* LSN (the end of its commit record)
completes it; confirming less resends it, which the sinks recognise by position.

The inputs
----------
* **Durable positions, per sink** (:meth:`durable`): the end LSN of the newest transaction the
  sink holds durably. The confirmable position never passes their minimum.
* **The in-flight ceiling** (the argument of :meth:`confirmable`): the smallest first LSN of
  the transaction being received, the streamed transactions not yet committed or aborted, the
  prepared transactions not yet resolved, and a transaction being handed in parts (below); None
  when there is none. The assembler and the reader's handover own that state
  (``Handover.ceiling`` in :mod:`cdcd.pipeline.stream`); it is read when the question is asked,
  so it is never stale.
* **Queued transactions** (:meth:`queued`): a committed transaction handed from the reader to the
  writer. End LSNs strictly increase in delivery order; one whose end LSN is not beyond the last
  queued is a resend after a reconnect, and :meth:`queued` says to drop it. End LSNs are what
  identifies a resend: a non-transactional message's end LSN is its LSN (the end of its record,
  where the next commit record may start), and positions are made unique separately (the
  message's position is its LSN - 1, see docs/events.md). The reader reports a released transaction here before its next ``await``.
* **A transaction handed over while it arrives** (part of the ceiling): the reader hands a
  regular transaction to the writer in parts before its Commit arrives (docs/assembler.md,
  "Parts"). From its first part until it is queued whole it is in flight from its first LSN,
  whatever the assembler holds: after a reconnect the assembler has forgotten it (the server
  resends it from its start, and the reader drops what was handed already), but the sinks hold
  part of it. The sinks' durable positions are end LSNs of whole transactions, so a part being
  durable confirms nothing.
* **Committed prepared transactions** (``prepared_cap`` of :meth:`queued`): once the confirmed
  position passes a PREPARE, the server never resends that transaction's changes (at COMMIT
  PREPARED it sends only Commit Prepared). So until the *committed* transaction is durable in
  every sink, the position stays below the ceiling that held it before its Commit Prepared. A
  prepared transaction released past ``--endpos`` is never written: :meth:`past_endpos` keeps
  its cap for good, so the next run receives it again.
* **Keepalives** (:meth:`keepalive`): the server's WAL end. When nothing is in flight — no
  ceiling, every queued transaction durable in every sink — it may be confirmed, so an idle slot
  does not hold WAL forever.
* **The session** (:meth:`session_started`, :meth:`streamed`): only what the current replication
  session has streamed past may be confirmed. After a reconnect the assembler has forgotten the
  prepared and streamed transactions it held (the server sends them again from their start), so
  its ceiling no longer covers them; durable positions and old keepalives may lie past their
  PREPAREs. Until the new session has streamed past a position, the assembler has not seen again
  what lies before it.
* **The snapshot** (:meth:`snapshot_started`): the initial snapshot's events are positioned at the
  slot's consistent point; they are in flight like a queued transaction ending there.

Invariants (tested in ``tests/unit/test_progress.py``, scenario tables and a property test):
the confirmed position never moves backwards, and never passes the commit LSN of a queued
transaction some sink does not yet hold durably, nor the first LSN of anything the assembler
holds or of a transaction handed in parts and not yet queued whole (both in the ceiling).
"""

from __future__ import annotations

from dataclasses import dataclass

#: ``end_lsn`` of a cap that is never lifted (a prepared transaction released past ``--endpos``)
_FOREVER = 1 << 64


@dataclass(frozen=True, slots=True)
class Confirmable:
    """The answer of :meth:`ProgressTracker.confirmable`, with its reasons (for logs)."""

    position: int
    durable: int  # min over sinks of their durable end LSN
    idle: bool  # nothing in flight: the keepalive position counted


class ProgressTracker:
    """Positions reported by the reader, the writer and the sinks; see the module docstring."""

    __slots__ = (
        "_caps",
        "_confirmed",
        "_durable",
        "_handed",
        "_keepalive",
        "_last_queued_end",
        "_received",
        "_session",
    )

    def __init__(self, sinks: int) -> None:
        if sinks < 1:
            raise ValueError("a pipeline has at least one sink")
        self._durable = [0] * sinks
        self._handed = [0] * sinks
        self._last_queued_end = 0
        self._keepalive = 0
        self._received = 0
        self._session = 0
        self._confirmed = 0
        # (ceiling before its Commit Prepared, end LSN) of committed prepared transactions that
        # are not durable yet; end _FOREVER for one released past --endpos
        self._caps: list[tuple[int, int]] = []

    # -- the reader (through cdcd.pipeline.stream.Handover only) ------------------------------

    def session_started(self) -> None:
        """A new replication session (start or reconnect): nothing streamed in it yet."""
        self._session = 0

    def streamed(self, lsn: int) -> None:
        """The session has received, and the assembler taken in, everything before ``lsn``."""
        if lsn > self._session:
            self._session = lsn
        if lsn > self._received:
            self._received = lsn

    def received(self, lsn: int) -> None:
        """Data up to ``lsn`` arrived (the ``write`` position of status updates); unlike
        :meth:`streamed` it may be reported while a batch is still being taken in."""
        if lsn > self._received:
            self._received = lsn

    def keepalive(self, wal_end: int) -> None:
        """A primary keepalive: the server has sent everything before ``wal_end``."""
        if wal_end > self._keepalive:
            self._keepalive = wal_end
        self.received(wal_end)

    def queued(self, end_lsn: int, prepared_cap: int | None = None) -> bool:
        """A committed transaction is handed to the writer. False: it was queued before (a
        resend after a reconnect) and must be dropped. ``prepared_cap``: for a transaction
        released by Commit Prepared, the assembler's ceiling just before that message."""
        if end_lsn <= self._last_queued_end:
            return False
        self._last_queued_end = end_lsn
        if prepared_cap is not None:
            self._caps.append((prepared_cap, end_lsn))
        return True

    def past_endpos(self, prepared_cap: int | None) -> None:
        """A transaction released beyond ``--endpos``: never handed to the sinks. If it was a
        prepared one, the confirmed position stays before its PREPARE for good."""
        if prepared_cap is not None:
            self._caps.append((prepared_cap, _FOREVER))

    # -- the initial snapshot (before the first session) -------------------------------------

    def snapshot_started(self, point: int) -> None:
        """The initial snapshot's events (positioned at the slot's consistent ``point``) are
        being written: in flight until every sink holds ``point`` durably."""
        self.queued(point)

    # -- the writer and the sinks ------------------------------------------------------------

    def handed(self, sink: int, end_lsn: int) -> None:
        """Sink number ``sink`` has been handed the transaction ending at ``end_lsn``."""
        if end_lsn > self._handed[sink]:
            self._handed[sink] = end_lsn

    def durable(self, sink: int, end_lsn: int) -> None:
        """Sink number ``sink`` holds everything up to ``end_lsn`` durably."""
        if end_lsn > self._durable[sink]:
            self._durable[sink] = end_lsn

    # -- questions ---------------------------------------------------------------------------

    @property
    def confirmed_lsn(self) -> int:
        return self._confirmed

    @property
    def received_lsn(self) -> int:
        return self._received

    @property
    def last_queued_end(self) -> int:
        return self._last_queued_end

    def durable_lsn(self) -> int:
        """The minimum over the sinks of their durable positions."""
        return min(self._durable)

    def pending(self, sink: int) -> bool:
        """Sink number ``sink`` was handed something it does not hold durably yet."""
        return self._durable[sink] < self._handed[sink]

    def caught_up(self, in_flight_ceiling: int | None) -> bool:
        """Nothing in flight: the assembler holds nothing, no transaction is being handed in
        parts, and every sink holds durably every transaction ever queued."""
        return in_flight_ceiling is None and min(self._durable) >= self._last_queued_end

    def confirmable(self, in_flight_ceiling: int | None) -> Confirmable:
        """The position that may be confirmed now (never below what was confirmed before)."""
        durable = min(self._durable)
        position = durable if in_flight_ceiling is None else min(durable, in_flight_ceiling)
        idle = self.caught_up(in_flight_ceiling)
        if idle:
            position = max(position, min(self._keepalive, self._received))
        for cap, end_lsn in self._caps:
            if end_lsn > durable and cap < position:
                position = cap
        position = min(position, self._session)
        return Confirmable(max(position, self._confirmed), durable, idle)

    def confirm(self, position: int) -> bool:
        """Record that ``position`` was (or is about to be) confirmed; whether it moved. Caps
        of prepared transactions now durable everywhere are forgotten."""
        durable = min(self._durable)
        self._caps = [cap for cap in self._caps if cap[1] > durable]
        if position > self._confirmed:
            self._confirmed = position
            return True
        return False
