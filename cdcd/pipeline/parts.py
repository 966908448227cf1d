"""A regular transaction handed to the writer in parts while it arrives, across reconnects.

The assembler releases a regular transaction in parts (docs/assembler.md, "Parts") when the
reader allows it (:meth:`Parts.may_part`): not past ``--endpos`` (never handed), not a resend
of one queued earlier (dropped), not while an incremental snapshot's watermark window is open
(it must see the transaction whole). The first part tells the progress tracker (``handing``).
If the connection drops in the middle, the server resends the transaction from its start:
:meth:`Parts.take` counts its changes again and drops those handed already, so the sinks see
each change once and the transaction goes on where it stopped (docs/progress.md, rule 10).

Pure: no I/O, no clock, no logging; the reader (:mod:`cdcd.pipeline.reader`) does those with
what this answers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from cdcd.assembler.transaction import Transaction
from cdcd.errors import AssemblyError
from cdcd.lsn import format_lsn
from cdcd.pipeline.progress import ProgressTracker


class Window(Protocol):
    """Whether an incremental snapshot's watermark window is open (:class:`~cdcd.snapshot.
    watermarks.Watermarks`)."""

    @property
    def window_open(self) -> bool: ...


@dataclass(slots=True)
class Handing:
    """The transaction being handed to the writer in parts."""

    commit_lsn: int
    handed: int = 0  # changes put to the writer
    seen: int = 0  # changes received of it in this session


class Parts:
    """The transaction being handed in parts, if any (:attr:`handing`), and what to put of
    each part the assembler releases."""

    def __init__(
        self,
        tracker: ProgressTracker,
        confirm_ceiling: Callable[[], int | None],
        *,
        endpos: int | None,
        watermarks: Window | None,
    ) -> None:
        self.tracker = tracker
        self._confirm_ceiling = confirm_ceiling  # the assembler's
        self.endpos = endpos
        self.watermarks = watermarks
        self.handing: Handing | None = None

    def session_started(self) -> Handing | None:
        """A new replication session: the transaction being handed comes again from its start.
        Returns it when it is lost with the slot (the tracker forgot it: the slot was
        recreated, :mod:`cdcd.pipeline.recreate`), and forgets it then."""
        handing = self.handing
        if handing is None:
            return None
        handing.seen = 0
        if self.tracker.handing_lsn is not None:
            return None
        self.handing = None
        return handing

    def may_part(self, commit_lsn: int) -> bool:
        """May the transaction committing at ``commit_lsn`` be handed over in parts? Not past
        --endpos (never handed), not a resend of one queued earlier (dropped), not while a
        watermark window is open (it must see the transaction whole)."""
        if self.endpos is not None and commit_lsn > self.endpos:
            return False
        handing = self.handing
        if handing is not None and handing.commit_lsn == commit_lsn:
            return True  # resent after a reconnect: goes on
        if commit_lsn < self.tracker.last_queued_end:
            return False
        return self.watermarks is None or not self.watermarks.window_open

    def take(self, txn: Transaction) -> tuple[Transaction | None, int]:
        """``txn`` is a part of a transaction handed in parts, or comes while one is: what to
        put of it (None: nothing), and how many changes handed before a reconnect it begins
        again with (dropped here; not 0 only on the first part after a reconnect)."""
        handing = self.handing
        if handing is None:  # the first part
            handing = self.handing = Handing(txn.commit_lsn)
            self.tracker.handing(self._confirm_ceiling() or txn.commit_lsn)
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
        elif txn.size == 0:
            txn.release()  # handed before the reconnect
            return None, resent
        return txn, resent
