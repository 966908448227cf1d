"""cdcd.pipeline.stream: a transaction handed to the writer in parts across reconnects, resends,
--endpos, a replaced slot. Real assembler parts, the real progress tracker, the reader's calls
without a server (tests/unit/test_stream_model.py drives it at random against invariants)."""

from __future__ import annotations

import pytest

from cdcd.assembler.assembler import Assembler
from cdcd.assembler.transaction import ChangeRecord, Transaction
from cdcd.decoder.events import Begin, Commit
from cdcd.errors import AssemblyError, DefiniteSourceError
from cdcd.pipeline.progress import ProgressTracker
from cdcd.pipeline.stream import Drop, Endpos, Handover, Put
from tests.unit.test_assembler import OID_A, Feeder, ins, relation
from tests.unit.test_assembler_parts import PART, labels


class Session:
    """The reader's use of :class:`Handover`: each released transaction (or part) goes through
    :meth:`Handover.released`; what it says to put is handed."""

    def __init__(self, endpos: int | None = None) -> None:
        self.tracker = ProgressTracker(1)
        self.asm = Assembler(part_bytes=PART)
        self.handover = Handover(
            self.tracker, self.asm.part_policy, self.asm.confirm_ceiling, endpos=endpos
        )
        self.handed: list[Transaction] = []
        self.resent: list[int] = []
        self.ended = False
        self.reconnect()

    def reconnect(self) -> None:
        self.asm.reset()
        self.handover.session_started()
        self.feed = Feeder(self.asm)
        self.feed(relation(OID_A))

    def __call__(self, *msgs: object) -> None:
        for txn in self.feed(*msgs):  # type: ignore[arg-type]
            action = self.handover.released(txn, txn.end_lsn)
            resumed = action.resumed if isinstance(action, Put | Drop) else 0
            if not txn.ends or self.handover.handing is not None or resumed:
                self.resent.append(resumed)
            match action:
                case Transaction() | Put():
                    self.handed.append(txn)
                case Drop():
                    pass
                case Endpos():
                    self.ended = True


def transaction(xid: int, rows: int) -> tuple[Begin, list[object], Commit]:
    final = 0x900000 + xid
    return (
        Begin(final, 111, xid),
        [ins(f"{xid}:{i}") for i in range(rows)],
        Commit(0, final, final + 8, 222),
    )


def handed_rows(session: Session) -> list[str]:
    return [label for txn in session.handed for label in labels(txn)]


def test_a_transaction_resent_after_a_reconnect_goes_on_where_it_stopped() -> None:
    s = Session()
    begin, rows, commit = transaction(7, 60)
    s(begin, *rows[:25])  # the connection drops after a few parts
    before = len(s.handed)
    assert before >= 2 and s.handover.handing is not None
    handed = s.handover.handing.handed
    assert handed == sum(t.size for t in s.handed) and 0 < handed <= 25
    s.reconnect()  # the server sends it again from its start
    s(begin, *rows)
    assert len(s.handed) > before  # still in parts: nothing waits for the commit
    s(commit)
    assert handed_rows(s) == [f"7:{i}" for i in range(60)]  # every change once, in order
    assert [t.begins for t in s.handed] == [True] + [False] * (len(s.handed) - 1)
    assert [t.ends for t in s.handed] == [False] * (len(s.handed) - 1) + [True]
    assert s.resent[before] == handed  # the first part after the reconnect dropped them
    assert s.handover.handing is None and s.handover.ceiling() is None


def test_the_first_part_tells_the_tracker_and_the_last_is_queued() -> None:
    s = Session()
    begin, rows, commit = transaction(8, 40)
    s(begin, *rows)
    first = s.handover.ceiling()
    assert first is not None and first <= s.handed[0].commit_lsn  # in flight from the Begin
    s.reconnect()  # the assembler forgets it; the handover does not
    assert s.asm.confirm_ceiling() is None and s.handover.ceiling() == first
    s(begin, *rows, commit)
    assert s.tracker.last_queued_end == commit.end_lsn and s.handover.ceiling() is None


def test_whole_transactions_queued_before_are_never_parted_again() -> None:
    s = Session()
    begin, rows, commit = transaction(9, 40)
    s(begin, *rows, commit)
    count = len(s.handed)
    s.reconnect()
    assert not s.asm.part_policy.allows(begin.final_lsn - 8)  # committed before the last one
    s(begin, *rows, commit)  # the server resends it: released whole and dropped
    assert len(s.handed) == count


def test_never_in_parts_past_endpos() -> None:
    begin, rows, commit = transaction(10, 40)
    s = Session(endpos=begin.final_lsn - 1)
    assert not s.asm.part_policy.allows(begin.final_lsn)
    s(begin, *rows, commit)
    assert s.handed == [] and s.ended  # released whole, never handed; the session ends


def test_a_lost_slot_forgets_the_transaction_being_handed() -> None:
    s = Session()
    begin, rows, _ = transaction(11, 40)
    s(begin, *rows)
    handing = s.handover.handing
    assert handing is not None
    s.reconnect()
    assert s.handover.handing is handing  # the server sends it again
    point = begin.final_lsn + 8
    assert s.handover.slot_replaced(point, reset=True) is handing  # lost with the old slot
    assert s.handover.handing is None and s.handover.ceiling() is None
    assert s.tracker.last_queued_end == point  # the reset
    assert s.asm.part_policy.resume is None and s.asm.part_policy.since == point
    with pytest.raises(DefiniteSourceError, match="before what cdcd already delivered"):
        s.handover.slot_replaced(point - 1, reset=True)


def test_another_transaction_while_one_is_expected_again_is_an_error() -> None:
    s = Session()
    begin, rows, _ = transaction(12, 40)
    s(begin, *rows)
    s.reconnect()
    other, other_rows, _ = transaction(13, 40)
    with pytest.raises(AssemblyError, match="partly handed to the sinks, was expected again"):
        s(other, *other_rows)


class Windows:
    """A stand-in for the snapshot's watermarks (pure, as the real ones): a window is open
    while ``open``; a transaction committing at ``mark_at`` is a watermark (dropped), one at
    ``chunk_at`` a high watermark replaced by ``chunk``."""

    def __init__(self) -> None:
        self.open = False
        self.mark_at = -1
        self.chunk_at = -1
        self.chunk: Transaction | None = None
        self.observed: list[int] = []

    @property
    def window_open(self) -> bool:
        return self.open

    def observe(self, txn: Transaction, mark: object) -> Transaction | None:
        self.observed.append(txn.commit_lsn)
        if txn.commit_lsn == self.mark_at:
            return None
        if txn.commit_lsn == self.chunk_at:
            return self.chunk
        return txn


def test_watermark_windows_hold_parts_and_replace_transactions() -> None:
    tracker = ProgressTracker(1)
    asm = Assembler(part_bytes=PART)
    windows = Windows()
    handover = Handover(
        tracker, asm.part_policy, asm.confirm_ceiling, endpos=None, watermarks=windows
    )
    feed = Feeder(asm)
    feed(relation(OID_A))
    windows.open = True  # armed while the reader waited: read before the next feed
    handover.before_feed()
    begin, rows, commit = transaction(20, 40)
    (whole,) = feed(begin, *rows, commit)  # never in parts while a window is open
    assert whole.begins and whole.ends and handover.released(whole, whole.end_lsn) is whole
    assert windows.observed == [whole.commit_lsn]
    begin, rows, commit = transaction(21, 1)
    windows.mark_at = begin.final_lsn
    (mark,) = feed(begin, *rows, commit)
    action = handover.released(mark, mark.end_lsn)
    assert isinstance(action, Drop) and action.txn is mark  # a watermark: not for the sinks
    assert tracker.last_queued_end == whole.end_lsn  # and not queued
    begin, rows, commit = transaction(22, 1)
    (high,) = feed(begin, *rows, commit)
    rel = relation(OID_A)
    windows.chunk_at = begin.final_lsn
    windows.chunk = Transaction(
        kind="snapshot",
        xid=0,
        commit_lsn=high.commit_lsn,
        end_lsn=high.end_lsn,
        commit_time=0,
        size=1,
        _records=[ChangeRecord(high.commit_lsn, ins("r"), (rel,))],
    )
    action = handover.released(high, high.end_lsn)
    assert isinstance(action, Put) and action.txn is windows.chunk and action.replaced is high
    assert action.relation is rel  # for the reader to register before putting the chunk
    assert tracker.last_queued_end == high.end_lsn == asm.part_policy.since  # queued already
    windows.open = False
    handover.before_feed()
    begin, rows, commit = transaction(40, 40)  # committed after the chunk's position
    assert len(feed(begin, *rows, commit)) > 1  # parts again
