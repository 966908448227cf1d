"""What the reader hands on: a sans-I/O state machine between the assembler and the writer.

::

    Assembler ──released (whole or a part)──▶ Handover ──Put / Drop / Endpos──▶ Reader ──▶ Writer
    keepalives, batch ends, reconnects,   ──▶    │
    a replaced slot                              └──▶ ProgressTracker (the reader's side)

The common answer to a released transaction is the transaction itself: put it to the writer as
it is (no action object is made for it, on the reader's hot path).

The reader (:mod:`cdcd.pipeline.reader`) does the I/O: it feeds the assembler, tells this object
what happened, and carries out the action it answers (put to the writer, release, stop). This
object decides, and holds the only copy of the state those decisions need:

* **Resends.** After a reconnect the server sends again what was not confirmed. A transaction
  whose end LSN is not past the last one queued is dropped (the tracker's :meth:`~cdcd.pipeline.
  progress.ProgressTracker.queued` says so; docs/progress.md, rule 6).
* **The transaction handed in parts** (:class:`Handing`). A regular transaction goes to the
  writer in parts while it arrives (docs/assembler.md, "Parts"). Whether the assembler may part
  one is :attr:`~cdcd.assembler.assembler.Assembler.part_policy`, plain data kept up to date
  here: not past ``--endpos`` (never handed), not a resend of one queued earlier (dropped), not
  while an incremental snapshot's watermark window is open (it must see the transaction whole).
  If the connection drops in the middle, the server resends the transaction from its start: its
  changes are counted again and those handed already dropped, so the sinks see each change once
  and the transaction goes on where it stopped. From its first part until its last is queued it
  is in flight from its first LSN (:meth:`Handover.ceiling`, docs/progress.md, rule 10).
* **Watermarks and snapshot chunks.** A transaction observed by an incremental snapshot's
  watermarks may be dropped (a watermark or signal) or replaced by a snapshot chunk
  (docs/snapshots.md).
* **--endpos.** A transaction committed past it is never handed and ends the session, as does a
  keepalive at or past it outside any transaction.
* **A replaced slot** (:meth:`Handover.slot_replaced`, :mod:`cdcd.pipeline.recreate`): the
  reset pseudo-transaction is queued, and a transaction being handed in parts is lost with the
  old slot (the new one never sends it).

It is the only caller of the tracker's reader-side methods. Pure: no I/O, no clock, no logging
(the actions carry what the reader logs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from cdcd.assembler.assembler import PartPolicy
from cdcd.assembler.transaction import Transaction
from cdcd.decoder.events import Message, Relation
from cdcd.errors import AssemblyError, DefiniteSourceError
from cdcd.lsn import format_lsn
from cdcd.pipeline.progress import ProgressTracker


class Window(Protocol):
    """An incremental snapshot's watermark windows (:class:`~cdcd.snapshot.watermarks.
    Watermarks`)."""

    @property
    def window_open(self) -> bool: ...

    def observe(self, txn: Transaction, mark: Message | None) -> Transaction | None: ...


@dataclass(slots=True)
class Handing:
    """The transaction being handed to the writer in parts."""

    commit_lsn: int
    first_lsn: int  # in flight from there (at most its first LSN) until queued whole
    handed: int = 0  # changes put to the writer
    seen: int = 0  # changes received of it in this session


@dataclass(slots=True)
class Put:
    """Put ``txn`` (a part resumed after a reconnect, a snapshot chunk) to the writer (a plain
    put is answered with the transaction itself). ``relation``: a snapshot chunk's, to register
    with the catalog first when it does not know it yet (no change of its table streamed yet).
    ``replaced``: the transaction the chunk replaces, to release."""

    txn: Transaction
    resumed: int = 0  # changes handed before a reconnect that this part began with (dropped)
    relation: Relation | None = None
    replaced: Transaction | None = None


@dataclass(slots=True)
class Drop:
    """Release ``txn``: not for the sinks (a resend, a watermark or signal, a part handed
    before a reconnect)."""

    txn: Transaction
    resumed: int = 0


@dataclass(slots=True)
class Endpos:
    """``--endpos`` reached: release ``txn`` (if any; committed past it, never handed) and end
    the session."""

    txn: Transaction | None


#: a Transaction: put it to the writer as it is
Action = Transaction | Put | Drop | Endpos


def no_marker(txn: Transaction) -> Message | None:
    return None


class Handover:
    """See the module docstring. ``policy`` and ``in_flight``: the assembler's
    :attr:`~cdcd.assembler.assembler.Assembler.part_policy` and
    :meth:`~cdcd.assembler.assembler.Assembler.confirm_ceiling`; ``marker``:
    :func:`cdcd.snapshot.watermarks.marker`."""

    def __init__(
        self,
        tracker: ProgressTracker,
        policy: PartPolicy,
        in_flight: Callable[[], int | None],
        *,
        endpos: int | None,
        watermarks: Window | None = None,
        marker: Callable[[Transaction], Message | None] = no_marker,
    ) -> None:
        self.tracker = tracker
        self.policy = policy
        self._in_flight = in_flight
        self.endpos = endpos
        self.watermarks = watermarks
        self._marker = marker
        self.handing: Handing | None = None
        self._marked = False  # the transaction being received carries a watermark or signal
        policy.until = endpos
        self._sync()

    # -- events ------------------------------------------------------------------------------

    def session_started(self) -> None:
        """A new replication session (start or reconnect): the transaction being handed comes
        again from its start."""
        self.tracker.session_started()
        self._marked = False
        if self.handing is not None:
            self.handing.seen = 0
        self._sync()

    def before_feed(self) -> None:
        """The assembler is about to be fed: the watermark windows may have opened or closed
        meanwhile (the snapshot arms a chunk while the reader waits)."""
        watermarks = self.watermarks
        if watermarks is not None:
            self.policy.hold = watermarks.window_open

    def marked(self) -> None:
        """A watermark or signal message arrived in the transaction being received."""
        self._marked = True

    def received(self, lsn: int) -> None:
        """Data up to ``lsn`` arrived (the batch is still being taken in)."""
        self.tracker.received(lsn)

    def streamed(self, lsn: int) -> None:
        """The session has received, and the assembler taken in, everything before ``lsn``."""
        self.tracker.streamed(lsn)

    def keepalive(self, wal_end: int, streamed: int, in_transaction: bool) -> Endpos | None:
        """A primary keepalive; ``streamed``: the session's position with it. Past --endpos and
        outside any transaction the session ends. Unresolved prepared and uncommitted streamed
        transactions may remain: they commit after the server's position, so after endpos; the
        confirmed position stays before them (the assembler's ceiling), so the next run receives
        them again."""
        self.tracker.keepalive(wal_end)
        endpos = self.endpos
        if endpos is not None and wal_end >= endpos and not in_transaction:
            return self._end(None, streamed)
        return None

    def released(self, txn: Transaction, streamed: int, cap: int | None = None) -> Action:
        """The assembler released ``txn`` (whole, or a part), with the session at ``streamed``.
        ``cap``: for a transaction released by Commit Prepared, the assembler's ceiling just
        before that message. Raises :class:`AssemblyError` when a new transaction comes while one partly handed is
        expected again."""
        resumed = 0
        continued = not txn.ends or self.handing is not None
        if continued:
            taken, resumed = self._take(txn)
            if taken is None:
                return Drop(txn, resumed)
            if not txn.ends:
                return Put(txn, resumed) if resumed else txn
            continued = not txn.begins
        tracker = self.tracker
        tracker.received(streamed)
        endpos = self.endpos
        if endpos is not None and txn.commit_lsn > endpos:
            tracker.past_endpos(cap)  # never handed to the sinks
            return self._end(txn, streamed)  # (never parted: resumed is 0)
        watermarks = self.watermarks
        if watermarks is not None and (self._marked or watermarks.window_open):
            # never for the last part of a transaction handed in parts (no window was open at
            # its Begin, and a transaction of watermark or signal has one change)
            mark = self._marker(txn) if self._marked and not continued else None
            self._marked = False
            if txn.end_lsn > tracker.last_queued_end:  # else a resend: below
                taken = watermarks.observe(txn, mark)
                if taken is None:  # a watermark or signal: not for the sinks
                    return Drop(txn, resumed)
                if taken is not txn:  # a snapshot chunk in place of a high watermark
                    self._queued(taken.end_lsn, cap)  # past the last queued: checked above
                    rows = taken.rows  # the chunk's table, without parsing a row
                    rel = rows[0] if rows is not None else next(taken.changes()).relations[0]
                    return Put(taken, resumed, relation=rel, replaced=txn)
        end_lsn = txn.end_lsn
        if not tracker.queued(end_lsn, cap):
            return Drop(txn, resumed)  # resent after a reconnect; the sinks have it
        self.policy.since = end_lsn
        return Put(txn, resumed) if resumed else txn

    def slot_replaced(self, point: int, *, reset: bool) -> Handing | None:
        """The slot was recreated with its consistent point at ``point``; ``reset``: the reset
        pseudo-transaction (ending at ``point``) is queued. Returns the transaction being
        handed in parts, lost with the old slot (the new one never sends it), and forgets it.
        Raises :class:`DefiniteSourceError` when the new slot starts before what was already
        queued."""
        lost, self.handing = self.handing, None
        if reset and not self.tracker.queued(point):
            raise DefiniteSourceError(
                f"the recreated slot starts at {format_lsn(point)}, before what cdcd already "
                f"delivered (up to {format_lsn(self.tracker.last_queued_end)}): the server's "
                "WAL is behind (a standby promoted without what cdcd had read?). Reset the "
                "consumers and start over ('cdcd slot drop')"
            )
        self._sync()
        return lost

    # -- questions ---------------------------------------------------------------------------

    def ceiling(self) -> int | None:
        """The in-flight ceiling for :meth:`ProgressTracker.confirmable`: the assembler's, and
        the first LSN of a transaction being handed in parts (whatever the assembler forgot)."""
        ceiling = self._in_flight()
        handing = self.handing
        if handing is None:
            return ceiling
        return handing.first_lsn if ceiling is None else min(ceiling, handing.first_lsn)

    # -- the transaction handed in parts -----------------------------------------------------

    def _take(self, txn: Transaction) -> tuple[Transaction | None, int]:
        """``txn`` is a part of a transaction handed in parts, or comes while one is: what to
        put of it (None: nothing), and how many changes handed before a reconnect it begins
        again with (dropped here; not 0 only on the first part after a reconnect)."""
        handing = self.handing
        if handing is None:  # the first part
            first = self._in_flight() or txn.commit_lsn
            handing = self.handing = Handing(txn.commit_lsn, first)
            self.policy.resume = txn.commit_lsn
        elif txn.commit_lsn != handing.commit_lsn:
            if txn.ends and txn.end_lsn <= self.tracker.last_queued_end:
                return txn, 0  # a resend of a transaction queued before it: dropped as usual
            raise AssemblyError(
                f"the server sent the transaction committing at {format_lsn(txn.commit_lsn)} "
                "while the one committing at "
                f"{format_lsn(handing.commit_lsn)}, partly handed to the sinks, was expected "
                "again (was the slot advanced or replaced?)"
            )
        else:
            txn.begins = txn.begins and handing.handed == 0
        start = handing.seen
        handing.seen += txn.size
        resent = handing.handed if start == 0 else 0
        txn.drop_first(handing.handed - start)
        handing.handed = max(handing.handed, handing.seen)
        if txn.ends:
            self.handing = None
            self.policy.resume = None
        elif txn.size == 0:
            return None, resent  # handed before the reconnect
        return txn, resent

    def _queued(self, end_lsn: int, cap: int | None) -> bool:
        if not self.tracker.queued(end_lsn, cap):
            return False
        self.policy.since = end_lsn
        return True

    def _end(self, txn: Transaction | None, streamed: int) -> Endpos:
        self.tracker.streamed(streamed)
        return Endpos(txn)

    def _sync(self) -> None:
        """The policy's data from the state here (and the tracker's last queued end, which the
        initial snapshot may have moved before the first session)."""
        policy = self.policy
        policy.since = self.tracker.last_queued_end
        policy.resume = None if self.handing is None else self.handing.commit_lsn
        self.before_feed()
