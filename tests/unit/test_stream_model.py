"""The real :class:`cdcd.pipeline.stream.Handover`, with the real assembler and progress tracker,
driven at random (hypothesis stateful) by a model of the server, the sink and the acker, against
the invariants: the confirmed position never passes what the sink holds durably, parts resent
after a reconnect are dropped exactly (every change reaches the sink once, in order), --endpos
is honoured, and the handing state is consistent (also after the slot was replaced).

The server model: regular transactions committed one after the other (some large enough to be
handed in parts); a session sends them from the confirmed position on (skipping those whose
commit record starts before it), a few messages per batch; keepalives carry the position the
server has sent everything before (a walsender's ``sentPtr``). A reconnect can come between any
two messages; a replaced slot starts past everything committed so far."""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from cdcd.assembler.assembler import Assembler
from cdcd.assembler.transaction import Transaction
from cdcd.decoder.events import Begin, Commit, PgOutputMessage
from cdcd.pipeline.progress import ProgressTracker
from cdcd.pipeline.stream import Drop, Endpos, Handover, Put
from tests.unit.test_assembler import OID_A, ins, relation
from tests.unit.test_assembler_parts import PART, labels

START = 0x1000


@dataclass
class Txn:
    """A transaction in the server's WAL: Begin at ``first``, a change every 8 bytes, the
    commit record at ``commit``, ending at ``end``."""

    xid: int
    rows: int
    first: int
    gone: bool = False  # before a replaced slot's start: never sent again

    @property
    def commit(self) -> int:
        return self.first + 8 * (self.rows + 1)

    @property
    def end(self) -> int:
        return self.commit + 8

    def messages(self) -> list[tuple[int, PgOutputMessage]]:
        """(XLogData position, message): Begin at its first LSN, each change at its own, the
        Commit at the transaction's end (what the walsender sends as the position)."""
        out: list[tuple[int, PgOutputMessage]] = [(self.first, Begin(self.commit, 111, self.xid))]
        out += [(self.first + 8 * (i + 1), ins(f"{self.xid}:{i}")) for i in range(self.rows)]
        out.append((self.end, Commit(0, self.commit, self.end, 222)))
        return out


@dataclass
class Sink:
    """What the writer was handed: each transaction's changes (labels), the ends of those
    handed whole (and of resets), and the durable position."""

    changes: dict[int, list[str]] = field(default_factory=dict)  # commit LSN -> labels
    order: list[str] = field(default_factory=list)
    whole: list[int] = field(default_factory=list)
    durable: int = 0


class HandoverMachine(RuleBasedStateMachine):
    @initialize(endpos=st.one_of(st.none(), st.integers(START, START + 3000)))
    def start(self, endpos: int | None) -> None:
        self.endpos = endpos
        self.tracker = ProgressTracker(1)
        self.asm = Assembler(part_bytes=PART)
        self.handover = Handover(
            self.tracker, self.asm.part_policy, self.asm.confirm_ceiling, endpos=endpos
        )
        self.wal: list[Txn] = []
        self.next_lsn = START
        self.sink = Sink()
        self.confirmed = 0
        self.slot_start = 0  # a replaced slot's consistent point
        self.ended = False  # --endpos reached: the run is over
        self.lost: list[int] = []  # commit LSNs of transactions partly handed, lost with a slot
        self.reconnect()

    # -- the server --------------------------------------------------------------------------

    @precondition(lambda self: len(self.wal) < 8)
    @rule(rows=st.integers(1, 40))
    def commit_transaction(self, rows: int) -> None:
        txn = Txn(len(self.wal) + 1, rows, self.next_lsn)
        self.wal.append(txn)
        self.next_lsn = txn.end + 8

    def pending(self) -> list[tuple[int, PgOutputMessage]]:
        """What the session has still to send, in order."""
        out = []
        for txn in self.wal:
            if txn.commit >= self.session_from and not txn.gone:
                out += txn.messages()
        return out[self.sent :]

    @precondition(lambda self: not self.ended)
    @rule(count=st.integers(1, 30))
    def send(self, count: int) -> None:
        """A batch of ``count`` messages (fewer when the session has sent everything)."""
        streamed = 0
        for lsn, msg in self.pending()[:count]:
            self.sent += 1
            streamed = max(streamed, lsn)
            if isinstance(msg, Commit):
                self.sent_pos = msg.end_lsn
            self.before = {k: len(v) for k, v in self.sink.changes.items()}
            self.handover.before_feed()
            txn = self.asm.feed(msg, lsn)
            if txn is None:
                continue
            action = self.handover.released(txn, streamed)
            resumed = action.resumed if isinstance(action, Put | Drop) else 0
            if resumed:  # exactly the changes handed before the reconnect were dropped
                assert resumed == self.before.get(txn.commit_lsn, 0)
            match action:
                case Transaction() as put:
                    self.put(put)
                case Put(txn=put):
                    self.put(put)
                case Drop():
                    pass
                case Endpos():
                    assert self.endpos is not None and txn.commit_lsn > self.endpos
                    self.end_run()
                    return
        self.handover.streamed(streamed)

    def put(self, put: Transaction) -> None:
        assert self.endpos is None or put.commit_lsn <= self.endpos
        handed = labels(put)
        self.sink.changes.setdefault(put.commit_lsn, []).extend(handed)
        self.sink.order += handed
        if put.ends:
            self.sink.whole.append(put.end_lsn)

    @precondition(lambda self: not self.ended)
    @rule()
    def keepalive(self) -> None:
        wal_end = self.sent_pos
        if self.handover.keepalive(wal_end, wal_end, self.asm.in_transaction) is not None:
            assert self.endpos is not None and wal_end >= self.endpos
            self.end_run()
            return
        self.handover.streamed(wal_end)

    @precondition(lambda self: not self.ended)
    @rule()
    def reconnect(self) -> None:
        """A new session from the confirmed position (the connection dropped anywhere)."""
        self.asm.reset()
        self.handover.session_started()
        self.asm.feed(relation(OID_A), 0)
        self.session_from = max(self.confirmed, self.slot_start)
        self.sent = 0
        self.sent_pos = self.session_from

    @precondition(lambda self: not self.ended)
    @rule(reset=st.booleans())
    def replace_slot(self, reset: bool) -> None:
        """The slot is lost and recreated (cdcd.pipeline.recreate): its consistent point is past
        everything committed; the reset (when tables are published) ends there."""
        point = self.next_lsn
        self.next_lsn += 16
        for txn in self.wal:
            txn.gone = True
        self.tracker.confirm(point)  # the new slot's position (docs/progress.md)
        handing = self.handover.handing
        lost = self.handover.slot_replaced(point, reset=reset)
        assert lost is handing
        if lost is not None:
            self.lost.append(lost.commit_lsn)
            assert lost.handed == len(self.sink.changes.get(lost.commit_lsn, []))
        if reset:
            self.sink.whole.append(point)
        self.slot_start = point
        self.confirmed = self.tracker.confirmed_lsn
        self.check_handing()
        assert self.handover.handing is None and self.asm.part_policy.resume is None
        self.reconnect()

    # -- the sink and the acker --------------------------------------------------------------

    @rule(index=st.integers(0, 8))
    def make_durable(self, index: int) -> None:
        whole = self.sink.whole
        if whole:
            self.sink.durable = max(self.sink.durable, whole[min(index, len(whole) - 1)])
            self.tracker.durable(0, self.sink.durable)

    @rule()
    def acknowledge(self) -> None:
        answer = self.tracker.confirmable(self.handover.ceiling())
        self.tracker.confirm(answer.position)
        assert self.tracker.confirmed_lsn >= self.confirmed, "moved backwards"
        self.confirmed = self.tracker.confirmed_lsn

    def end_run(self) -> None:
        """--endpos reached: everything committed at or before it was handed whole."""
        self.ended = True
        assert self.endpos is not None
        for txn in self.wal:
            if txn.commit <= self.endpos and not txn.gone:
                assert txn.end in self.sink.whole, f"{txn} not handed before endpos"

    # -- invariants --------------------------------------------------------------------------

    @invariant()
    def never_confirmed_past_durable(self) -> None:
        if not hasattr(self, "tracker"):
            return
        for txn in self.wal:
            if txn.commit < self.confirmed and not txn.gone:
                # the server would never send it again: the sink must hold it durably, whole
                assert self.sink.durable >= txn.end, f"confirmed {self.confirmed} past {txn}"
                assert len(self.sink.changes.get(txn.commit, [])) == txn.rows

    @invariant()
    def every_change_once_in_order(self) -> None:
        if not hasattr(self, "tracker"):
            return
        assert len(set(self.sink.order)) == len(self.sink.order), "a change handed twice"
        for txn in self.wal:
            got = self.sink.changes.get(txn.commit, [])
            assert got == [f"{txn.xid}:{i}" for i in range(len(got))]
            if self.endpos is not None and txn.commit > self.endpos:
                assert not got, f"{txn} past endpos handed"

    @invariant()
    def check_handing(self) -> None:
        if not hasattr(self, "tracker"):
            return
        policy = self.asm.part_policy
        handing = self.handover.handing
        assert policy.until == self.endpos
        assert policy.since == self.tracker.last_queued_end
        partial = [
            (commit, len(got))
            for commit, got in self.sink.changes.items()
            if commit not in self.lost
            and any(t.commit == commit and t.end not in self.sink.whole for t in self.wal)
        ]
        if handing is None:
            assert policy.resume is None
            assert partial == [], "a transaction partly handed and forgotten"
        else:
            assert policy.resume == handing.commit_lsn
            assert partial == [(handing.commit_lsn, handing.handed)]
            ceiling = self.handover.ceiling()
            assert ceiling is not None and ceiling <= handing.first_lsn < handing.commit_lsn


TestHandover = HandoverMachine.TestCase
TestHandover.settings = settings(max_examples=200, stateful_step_count=60, deadline=None)
