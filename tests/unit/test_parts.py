"""A transaction handed to the writer in parts across reconnects (cdcd.pipeline.parts): real
assembler parts, the real progress tracker, the reader's calls without a server."""

from __future__ import annotations

import pytest

from cdcd.assembler.assembler import Assembler
from cdcd.assembler.transaction import Transaction
from cdcd.decoder.events import Begin, Commit
from cdcd.errors import AssemblyError
from cdcd.pipeline.parts import Parts
from cdcd.pipeline.progress import ProgressTracker
from tests.unit.test_assembler import OID_A, Feeder, ins, relation
from tests.unit.test_assembler_parts import PART, labels


class Session:
    """The reader's use of :class:`Parts`: each released transaction (or part) that is part of
    a transaction handed in parts goes through :meth:`Parts.take`; what comes out is handed."""

    def __init__(self, endpos: int | None = None) -> None:
        self.tracker = ProgressTracker(1)
        self.asm = Assembler(part_bytes=PART)
        self.parts = Parts(self.tracker, self.asm.confirm_ceiling, endpos=endpos, watermarks=None)
        self.asm.may_part = self.parts.may_part
        self.handed: list[Transaction] = []
        self.resent: list[int] = []
        self.reconnect()

    def reconnect(self) -> None:
        self.asm.reset()
        self.tracker.session_started()
        self.parts.session_started()
        self.feed = Feeder(self.asm)
        self.feed(relation(OID_A))

    def __call__(self, *msgs: object) -> None:
        for txn in self.feed(*msgs):  # type: ignore[arg-type]
            if txn.ends and self.parts.handing is None:
                put: Transaction | None = txn
            else:
                put, resent = self.parts.take(txn)
                self.resent.append(resent)
            if put is None:
                continue
            if put.ends and not self.tracker.queued(put.end_lsn):
                continue  # a resend of one queued before
            self.handed.append(put)


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
    assert before >= 2 and s.parts.handing is not None
    handed = s.parts.handing.handed
    assert handed == sum(t.size for t in s.handed) and 0 < handed <= 25
    s.reconnect()  # the server sends it again from its start
    s(begin, *rows)
    assert len(s.handed) > before  # still in parts: nothing waits for the commit
    s(commit)
    assert handed_rows(s) == [f"7:{i}" for i in range(60)]  # every change once, in order
    assert [t.begins for t in s.handed] == [True] + [False] * (len(s.handed) - 1)
    assert [t.ends for t in s.handed] == [False] * (len(s.handed) - 1) + [True]
    assert s.resent[before] == handed  # the first part after the reconnect dropped them
    assert s.parts.handing is None and s.tracker.handing_lsn is None


def test_the_first_part_tells_the_tracker_and_the_last_is_queued() -> None:
    s = Session()
    begin, rows, commit = transaction(8, 40)
    s(begin, *rows)
    assert s.tracker.handing_lsn is not None  # in flight from the Begin
    assert s.tracker.handing_lsn <= s.handed[0].commit_lsn
    s(commit)
    assert s.tracker.last_queued_end == commit.end_lsn and s.tracker.handing_lsn is None


def test_whole_transactions_queued_before_are_never_parted_again() -> None:
    s = Session()
    begin, rows, commit = transaction(9, 40)
    s(begin, *rows, commit)
    count = len(s.handed)
    s.reconnect()
    assert not s.parts.may_part(begin.final_lsn - 8)  # committed before the last queued one
    s(begin, *rows, commit)  # the server resends it: released whole and dropped
    assert len(s.handed) == count


def test_never_in_parts_past_endpos() -> None:
    begin, rows, commit = transaction(10, 40)
    s = Session(endpos=begin.final_lsn - 1)
    assert not s.parts.may_part(begin.final_lsn)
    s(begin, *rows, commit)
    assert [t.ends for t in s.handed] == [True]  # released whole (the reader then stops)


def test_a_lost_slot_forgets_the_transaction_being_handed() -> None:
    s = Session()
    begin, rows, _ = transaction(11, 40)
    s(begin, *rows)
    handing = s.parts.handing
    assert handing is not None and s.parts.session_started() is None  # still in the tracker
    s.tracker.queued(begin.final_lsn + 8)  # what a recreated slot's reset does to the tracker
    assert s.parts.session_started() is handing and s.parts.handing is None


def test_another_transaction_while_one_is_expected_again_is_an_error() -> None:
    s = Session()
    begin, rows, _ = transaction(12, 40)
    s(begin, *rows)
    s.reconnect()
    other, other_rows, _ = transaction(13, 40)
    with pytest.raises(AssemblyError, match="partly handed to the sinks, was expected again"):
        s(other, *other_rows)
