"""Assembler rules on synthetic event sequences: every release path, every AssemblyError,
subtransaction aborts in streamed transactions, spilling, and random interleavings."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cdcd.assembler.assembler import Assembler
from cdcd.assembler.spill import SPILL_PREFIX, SPILL_SUFFIX
from cdcd.assembler.transaction import ChangeRecord, Transaction
from cdcd.decoder.events import (
    Begin,
    BeginPrepare,
    Column,
    Commit,
    CommitPrepared,
    Delete,
    Insert,
    Message,
    Origin,
    PgOutputMessage,
    Prepare,
    Relation,
    RollbackPrepared,
    StreamAbort,
    StreamCommit,
    StreamPrepare,
    StreamStart,
    StreamStop,
    Truncate,
    TupleData,
    Type,
    Update,
)
from cdcd.errors import AssemblyError

OID_A, OID_B = 16384, 16390


def relation(oid: int = OID_A, *cols: str, xid: int | None = None) -> Relation:
    names = cols or ("id", "v")
    columns = tuple(Column(1 if i == 0 else 0, n, 25, -1) for i, n in enumerate(names))
    return Relation(xid, oid, "public", f"t{oid}", "d", columns)


def ins(value: str, xid: int | None = None, oid: int = OID_A) -> Insert:
    return Insert(xid, oid, TupleData(b"tt", (value.encode(), b"x" * 20)))


def values(txn: Transaction) -> list[str]:
    """The first column of every Insert, in order."""
    out = []
    for rec in txn.changes():
        assert isinstance(rec.change, Insert)
        first = rec.change.new.values[0]
        assert first is not None
        out.append(first.decode())
    return out


class Feeder:
    """Feeds messages with increasing LSNs and collects what is released."""

    def __init__(self, asm: Assembler) -> None:
        self.asm = asm
        self.lsn = 0x1000
        self.released: list[Transaction] = []

    def __call__(self, *msgs: PgOutputMessage) -> list[Transaction]:
        out = []
        for msg in msgs:
            self.lsn += 8
            txn = self.asm.feed(msg, self.lsn)
            if txn is not None:
                out.append(txn)
        self.released += out
        return out

    def begin(self, xid: int) -> tuple[Begin, Commit]:
        final = 0x900000 + xid
        return Begin(final, 111, xid), Commit(0, final, final + 8, 222)


@pytest.fixture
def asm() -> Assembler:
    return Assembler()


@pytest.fixture
def feed(asm: Assembler) -> Feeder:
    f = Feeder(asm)
    f(relation(OID_A), relation(OID_B))
    return f


def spill_files(path: Path) -> list[str]:
    return sorted(p.name for p in path.glob(f"{SPILL_PREFIX}*{SPILL_SUFFIX}"))


# --- regular transactions ------------------------------------------------------------------


def test_regular_transaction_fields_and_changes(asm: Assembler, feed: Feeder) -> None:
    begin, commit = feed.begin(700)
    assert feed(begin, Origin(0xABC, "node1"), ins("1"), ins("2")) == []
    assert not asm.idle
    (txn,) = feed(commit)
    assert (txn.kind, txn.xid, txn.commit_lsn, txn.end_lsn, txn.commit_time) == (
        "regular",
        700,
        commit.commit_lsn,
        commit.end_lsn,
        222,
    )
    assert (txn.origin, txn.origin_lsn, txn.gid, txn.size) == ("node1", 0xABC, None, 2)
    assert values(txn) == ["1", "2"]
    assert values(txn) == ["1", "2"]  # iterable more than once
    assert [r.relations for r in txn.changes()] == [(asm.relations[OID_A],)] * 2
    assert asm.idle
    txn.release()
    assert list(txn.changes()) == []


def test_records_carry_relation_current_when_fed(asm: Assembler, feed: Feeder) -> None:
    old, new = asm.relations[OID_A], relation(OID_A, "id", "v", "w")
    begin, commit = feed.begin(1)
    (txn,) = feed(begin, ins("1"), new, ins("2"), commit)
    assert [r.relations[0] for r in txn.changes()] == [old, new]
    assert asm.relations[OID_A] is new


def test_truncate_carries_one_relation_per_oid_in_order(asm: Assembler, feed: Feeder) -> None:
    begin, commit = feed.begin(1)
    (txn,) = feed(begin, Truncate(None, 1, (OID_B, OID_A)), commit)
    (rec,) = txn.changes()
    assert rec.relations == (asm.relations[OID_B], asm.relations[OID_A])


def test_change_lsns_are_the_fed_lsns(asm: Assembler, feed: Feeder) -> None:
    begin, commit = feed.begin(1)
    asm.feed(begin, 100)
    asm.feed(ins("1"), 120)
    asm.feed(Update(None, OID_A, None, None, ins("2").new), 130)
    asm.feed(Delete(None, OID_A, "K", ins("2").new), 140)
    txn = asm.feed(commit, 150)
    assert txn is not None
    assert [r.lsn for r in txn.changes()] == [120, 130, 140]


def test_empty_regular_transaction_is_released(feed: Feeder) -> None:
    begin, commit = feed.begin(9)
    (txn,) = feed(begin, commit)
    assert txn.size == 0 and list(txn.changes()) == []


def test_type_messages_are_taken_everywhere_and_release_nothing() -> None:
    f = Feeder(Assembler())
    t1, t2 = Type(None, 900, "public", "mood"), Type(5, 901, "public", "color")
    begin, commit = f.begin(1)
    (txn,) = f(t1, begin, t2, commit, StreamStart(5, True), t2, StreamStop())
    assert txn.size == 0 and txn.kind == "regular"


# --- logical messages ------------------------------------------------------------------------


def test_messages_transactional_and_not(asm: Assembler, feed: Feeder) -> None:
    nontx = Message(None, False, 0x5000, "p", b"now")
    (single,) = feed(nontx)
    assert (single.kind, single.xid, single.commit_lsn, single.end_lsn, single.size) == (
        "message",
        0,
        0x4FFF,  # the message's LSN - 1: inside its own WAL record (docs/events.md)
        0x5000,  # acknowledged with the LSN as sent
        1,
    )
    (rec,) = single.changes()
    assert rec.change is nontx and rec.relations == ()

    begin, commit = feed.begin(3)
    tx = Message(None, True, 0x6000, "p", b"in txn")
    inside = Message(None, False, 0x6008, "p", b"inside but not transactional")
    assert feed(begin, tx, ins("1")) == []
    (released,) = feed(inside)
    assert released.kind == "message" and released.commit_lsn == 0x6007
    (txn,) = feed(commit)
    assert next(r.change for r in txn.changes()) is tx
    assert next(r.relations for r in txn.changes()) == ()

    streamed_nontx = Message(8, False, 0x7000, "p", b"x")
    out = feed(StreamStart(8, True), Message(8, True, 0x6FF0, "p", b"t"), streamed_nontx)
    assert [(t.kind, t.xid) for t in out] == [("message", 8)]
    (st_txn,) = feed(StreamStop(), StreamCommit(8, 0, 0x8000, 0x8008, 1))
    assert [r.change.content for r in st_txn.changes() if isinstance(r.change, Message)] == [b"t"]


# --- streaming -------------------------------------------------------------------------------


def test_interleaved_streams_and_regular_between_segments(asm: Assembler, feed: Feeder) -> None:
    begin, commit = feed.begin(50)
    feed(StreamStart(10, True), ins("10a", 10), StreamStop())
    feed(StreamStart(20, True), ins("20a", 20), StreamStop())
    assert asm.open_streams == 2
    (regular,) = feed(begin, ins("50a"), commit)
    feed(StreamStart(10, False), ins("10b", 10), StreamStop())
    (t20,) = feed(StreamCommit(20, 0, 0x20000, 0x20008, 5))
    feed(StreamStart(10, False), ins("10c", 10), StreamStop())
    (t10,) = feed(StreamCommit(10, 0, 0x30000, 0x30008, 6))
    assert values(regular) == ["50a"]
    assert (t20.kind, t20.xid, t20.commit_lsn, t20.end_lsn, t20.commit_time) == (
        "streamed",
        20,
        0x20000,
        0x20008,
        5,
    )
    assert values(t20) == ["20a"]
    assert values(t10) == ["10a", "10b", "10c"]
    assert t10.size == 3
    assert asm.idle and asm.open_streams == 0


def nested_savepoints(feed: Feeder, top: int = 100) -> list[Transaction]:
    """Top-level 100 with subxacts 101 < 102 < 103, interleaved over segments; abort 102."""
    s1, s2, s3 = top + 1, top + 2, top + 3
    feed(StreamStart(top, True), ins("top1", top), ins("s1a", s1), StreamStop())
    feed(StreamStart(top, False), ins("s2a", s2), ins("s1b", s1), ins("s3a", s3), StreamStop())
    feed(StreamStart(top, False), ins("s2b", s2), ins("top2", top), StreamStop())
    feed(StreamAbort(top, s2))
    feed(StreamStart(top, False), ins("top3", top), ins("s1c", s1), StreamStop())
    return feed(StreamCommit(top, 0, 0xA000, 0xA008, 7))


def test_subtransaction_abort_drops_it_and_later_ones(feed: Feeder) -> None:
    (txn,) = nested_savepoints(feed)
    # s2 first appeared after s1a: everything from there on went (s2, s1b, s3, s2b, top2),
    # as the apply worker truncates its spool file at s2's first change.
    assert values(txn) == ["top1", "s1a", "top3", "s1c"]
    assert txn.size == 4


def test_subtransaction_abort_variants(asm: Assembler, feed: Feeder) -> None:
    feed(StreamStart(1, True), ins("top", 1), ins("a", 2), ins("b", 3), StreamStop())
    feed(StreamAbort(1, 3))  # innermost only
    feed(StreamAbort(1, 99))  # a subxid that made no change: nothing
    feed(StreamAbort(1234, 1235))  # unknown xid: nothing
    feed(StreamAbort(1234, 1234))
    feed(StreamStart(1, False), ins("c", 3), StreamStop())  # 3 reused after abort? new entry
    feed(StreamAbort(1, 3))
    (txn,) = feed(StreamCommit(1, 0, 0xB000, 0xB008, 0))
    assert values(txn) == ["top", "a"]
    assert asm.buffered_bytes == 0


def test_whole_stream_abort_drops_everything(asm: Assembler, feed: Feeder) -> None:
    feed(StreamStart(1, True), ins("x", 1), StreamStop(), StreamAbort(1, 1))
    assert asm.idle and asm.buffered_bytes == 0
    with pytest.raises(AssemblyError, match="xid 1"):
        feed(StreamCommit(1, 0, 0xB000, 0xB008, 0))


def test_first_segment_again_restarts_the_xid(asm: Assembler, feed: Feeder) -> None:
    feed(StreamStart(1, True), ins("a", 1), StreamStop())
    feed(StreamStart(1, True), ins("a", 1), ins("b", 1), StreamStop())
    (txn,) = feed(StreamCommit(1, 0, 0xB000, 0xB008, 0))
    assert values(txn) == ["a", "b"]


def test_origin_inside_stream(feed: Feeder) -> None:
    feed(StreamStart(1, True), Origin(0, "up"), ins("a", 1), StreamStop())
    (txn,) = feed(StreamCommit(1, 0, 0xB000, 0xB008, 0))
    assert txn.origin == "up"


def test_stream_relation_applies_to_its_later_changes_only(asm: Assembler, feed: Feeder) -> None:
    base = asm.relations[OID_A]
    wide = relation(OID_A, "id", "v", "w", xid=1)
    begin, commit = feed.begin(50)
    feed(StreamStart(1, True), ins("a", 1), wide, ins("b", 1), StreamStop())
    (between,) = feed(begin, ins("r"), commit)
    feed(StreamStart(1, False), ins("c", 1), StreamStop())
    assert asm.relations[OID_A] is base
    (txn,) = feed(StreamCommit(1, 0, 0xB000, 0xB008, 0))
    assert [r.relations[0] for r in txn.changes()] == [base, wide, wide]
    assert [r.relations[0] for r in between.changes()] == [base]
    assert asm.relations[OID_A] is wide  # committed: now everyone's


def test_relation_of_aborted_subtransaction_is_dropped(asm: Assembler, feed: Feeder) -> None:
    base = asm.relations[OID_A]
    wide = relation(OID_A, "id", "v", "w", xid=2)
    feed(StreamStart(1, True), ins("a", 1), wide, ins("b", 2), StreamStop())
    feed(StreamAbort(1, 2))
    feed(StreamStart(1, False), ins("c", 1), StreamStop())
    (txn,) = feed(StreamCommit(1, 0, 0xB000, 0xB008, 0))
    assert values(txn) == ["a", "c"]
    assert [r.relations[0] for r in txn.changes()] == [base, base]
    assert asm.relations[OID_A] is base


def test_relation_of_aborted_stream_never_reaches_cache(asm: Assembler, feed: Feeder) -> None:
    base = asm.relations[OID_A]
    feed(StreamStart(1, True), relation(OID_A, "z", xid=1), ins("a", 1), StreamStop())
    feed(StreamAbort(1, 1))
    assert asm.relations[OID_A] is base


# --- two-phase -------------------------------------------------------------------------------


def test_prepare_then_commit_prepared(asm: Assembler, feed: Feeder) -> None:
    bp = BeginPrepare(0xC000, 0xC008, 5, 77, "g1")
    assert feed(bp, ins("p1"), Prepare(0, 0xC000, 0xC008, 5, 77, "g1")) == []
    assert asm.held_prepared == 1 and not asm.idle
    (txn,) = feed(CommitPrepared(0, 0xD000, 0xD008, 9, 77, "g1"))
    assert (txn.kind, txn.xid, txn.gid, txn.commit_lsn, txn.end_lsn, txn.commit_time) == (
        "prepared",
        77,
        "g1",
        0xD000,
        0xD008,
        9,
    )
    assert values(txn) == ["p1"]
    assert asm.idle


def test_rollback_prepared_and_unknown_gids(asm: Assembler, feed: Feeder) -> None:
    feed(BeginPrepare(0xC000, 0xC008, 5, 77, "g1"), ins("p1"))
    feed(Prepare(0, 0xC000, 0xC008, 5, 77, "g1"))
    assert feed(RollbackPrepared(0, 0xC008, 0xE000, 5, 6, 77, "g1")) == []
    assert asm.idle and asm.buffered_bytes == 0
    assert feed(CommitPrepared(0, 0xD000, 0xD008, 9, 78, "empty")) == []
    assert feed(RollbackPrepared(0, 0, 0, 0, 0, 79, "gone")) == []
    assert asm.unknown_gid_resolutions == 2


def test_begin_prepare_resent_replaces_held(asm: Assembler, feed: Feeder) -> None:
    for _ in range(2):
        feed(BeginPrepare(0xC000, 0xC008, 5, 77, "g1"), ins("p1"))
        feed(Prepare(0, 0xC000, 0xC008, 5, 77, "g1"))
    assert asm.held_prepared == 1
    (txn,) = feed(CommitPrepared(0, 0xD000, 0xD008, 9, 77, "g1"))
    assert values(txn) == ["p1"]


def test_stream_prepare_holds_streamed_changes(asm: Assembler, feed: Feeder) -> None:
    feed(StreamStart(5, True), ins("s1", 5), ins("s2", 6), StreamStop())
    feed(StreamPrepare(0, 0xC000, 0xC008, 5, 5, "gs"))
    assert asm.open_streams == 0 and asm.held_prepared == 1
    (txn,) = feed(CommitPrepared(0, 0xD000, 0xD008, 9, 5, "gs"))
    assert (txn.kind, txn.gid, txn.xid) == ("prepared", "gs", 5)
    assert values(txn) == ["s1", "s2"]


# --- positions -------------------------------------------------------------------------------


def test_confirm_ceiling_and_idle(asm: Assembler) -> None:
    rel = relation()
    asm.feed(rel, 10)
    assert asm.confirm_ceiling() is None and asm.idle
    asm.feed(StreamStart(1, True), 500)
    asm.feed(ins("a", 1), 500)
    asm.feed(StreamStop(), 510)
    asm.feed(BeginPrepare(0x900, 0x908, 0, 2, "g"), 300)
    asm.feed(Prepare(0, 0x900, 0x908, 0, 2, "g"), 0x900)
    assert asm.confirm_ceiling() == 300
    asm.feed(Begin(0x1000, 0, 3), 200)
    assert asm.confirm_ceiling() == 200
    asm.feed(Commit(0, 0x1000, 0x1008, 0), 0x1008)
    asm.feed(CommitPrepared(0, 0x1100, 0x1108, 0, 2, "g"), 0x1108)
    assert asm.confirm_ceiling() == 500
    asm.feed(StreamCommit(1, 0, 0x1200, 0x1208, 0), 0x1208)
    assert asm.confirm_ceiling() is None and asm.idle


def test_reset_drops_everything_in_flight(asm: Assembler, feed: Feeder) -> None:
    feed(StreamStart(1, True), ins("a", 1), StreamStop())
    feed(BeginPrepare(0xC000, 0xC008, 5, 77, "g1"), ins("p1"))
    feed(Prepare(0, 0xC000, 0xC008, 5, 77, "g1"))
    feed(Begin(0xF000, 0, 9), ins("o"))
    asm.reset()
    assert asm.idle and asm.buffered_bytes == 0 and asm.confirm_ceiling() is None
    assert OID_A in asm.relations
    assert feed(CommitPrepared(0, 0xD000, 0xD008, 9, 77, "g1")) == []
    # A fresh stream for xid 1 starts over.
    feed(StreamStart(1, True), ins("b", 1), StreamStop())
    (txn,) = feed(StreamCommit(1, 0, 0xB000, 0xB008, 0))
    assert values(txn) == ["b"]


# --- invariants ------------------------------------------------------------------------------


def error_cases() -> Iterator[tuple[str, list[PgOutputMessage], str]]:
    b = Begin(0x100, 0, 1)
    yield "nested begin", [b, b], "Begin inside the open transaction xid 1"
    yield "commit without begin", [Commit(0, 0x100, 0x108, 0)], "Commit without Begin"
    yield "commit lsn", [b, Commit(0, 0x101, 0x108, 0)], "final LSN 0/100"
    yield "insert outside", [ins("x")], "Insert outside any transaction"
    yield "truncate outside", [Truncate(None, 0, (OID_A,))], "Truncate outside"
    yield "tx message outside", [Message(None, True, 1, "p", b"")], "Message outside"
    yield "unknown relation", [b, ins("x", oid=999)], "relation OID 999"
    yield "origin outside", [Origin(0, "n")], "Origin outside"
    yield "prepare alone", [Prepare(0, 1, 2, 0, 1, "g")], "Prepare without Begin Prepare"
    bp = BeginPrepare(0x100, 0x108, 0, 1, "g")
    yield "prepare gid", [bp, Prepare(0, 0x100, 0x108, 0, 1, "h")], "does not match"
    yield "prepare xid", [bp, Prepare(0, 0x100, 0x108, 0, 2, "g")], "does not match"
    yield "commit in prepare", [bp, Commit(0, 0x100, 0x108, 0)], "Commit without Begin"
    yield "prepare in begin", [b, Prepare(0, 0x100, 0x108, 0, 1, "g")], "without Begin Prepare"
    s = StreamStart(1, True)
    yield "stream in stream", [s, s], "Stream Start inside the stream block of xid 1"
    yield "stream in txn", [b, s], "Stream Start inside the open transaction"
    yield "stop outside", [StreamStop()], "Stream Stop outside"
    yield "begin in stream", [s, b], "Begin inside the stream block"
    yield "commit in stream", [s, Commit(0, 0x100, 0x108, 0)], "Commit without Begin"
    yield "stream commit unknown", [StreamCommit(4, 0, 1, 2, 0)], "xid 4, which was never"
    yield "stream commit in block", [s, StreamCommit(1, 0, 1, 2, 0)], "inside the stream block"
    yield "stream abort in block", [s, StreamAbort(1, 1)], "inside the stream block"
    yield "stream prepare unknown", [StreamPrepare(0, 1, 2, 0, 4, "g")], "never streamed"
    yield "continuation unknown", [StreamStart(4, False)], "first segment was not seen"
    yield "commit prepared in txn", [b, CommitPrepared(0, 1, 2, 0, 1, "g")], "inside the open"


@pytest.mark.parametrize(
    ("msgs", "message"), [c[1:] for c in error_cases()], ids=[c[0] for c in error_cases()]
)
def test_assembly_errors(msgs: list[PgOutputMessage], message: str) -> None:
    asm = Assembler()
    asm.feed(relation(), 0x10)
    with pytest.raises(AssemblyError, match=message) as info:
        for i, msg in enumerate(msgs):
            asm.feed(msg, 0x20 + i)
    assert f"at LSN 0/{0x20 + len(msgs) - 1:X}" in str(info.value)


# --- spilling --------------------------------------------------------------------------------


def run_all(feed: Feeder, scenario: Iterable[PgOutputMessage]) -> list[list[ChangeRecord]]:
    feed(*scenario)
    return [list(t.changes()) for t in feed.released]


def big_scenario() -> list[PgOutputMessage]:
    msgs: list[PgOutputMessage] = [relation(OID_A), relation(OID_B)]
    msgs += [StreamStart(100, True), ins("top1", 100), ins("s1a", 101), StreamStop()]
    msgs += [Begin(0x5000, 0, 7), *(ins(f"r{i}") for i in range(30)), Commit(0, 0x5000, 1, 0)]
    msgs += [StreamStart(100, False), ins("s2a", 102), relation(OID_B, "k", xid=102)]
    msgs += [Truncate(102, 0, (OID_A, OID_B)), ins("s3a", 103), StreamStop()]
    msgs += [StreamStart(200, True), *(ins(f"x{i}", 200 + i % 3) for i in range(40))]
    msgs += [Update(201, OID_A, "O", ins("o").new, ins("n").new), StreamStop()]
    msgs += [StreamAbort(100, 102), StreamAbort(200, 202)]
    msgs += [BeginPrepare(0x6000, 0x6008, 0, 9, "g"), *(ins(f"p{i}") for i in range(20))]
    msgs += [Prepare(0, 0x6000, 0x6008, 0, 9, "g")]
    msgs += [StreamStart(100, False), ins("top2", 100), ins("s1b", 101), StreamStop()]
    msgs += [StreamCommit(100, 0, 0x7000, 0x7008, 0), StreamCommit(200, 0, 0x7100, 0x7108, 0)]
    msgs += [CommitPrepared(0, 0x7200, 0x7208, 0, 9, "g")]
    return msgs


@pytest.mark.parametrize("limit", [0, 1, 3000, 20000])
def test_spilling_gives_identical_output(tmp_path: Path, limit: int) -> None:
    expected = run_all(Feeder(Assembler()), big_scenario())
    asm = Assembler(memory_limit=limit, spill_dir=tmp_path)
    spilled = Feeder(asm)
    got = run_all(spilled, big_scenario())
    assert got == expected
    assert [len(t) for t in got] == [30, 4, 2, 20]
    if limit < 20000:
        assert asm.spill_count > 0
        assert spill_files(tmp_path)  # still held by the unreleased transactions
    for txn in spilled.released:
        txn.release()
    assert spill_files(tmp_path) == []


def test_spilled_nested_savepoints_match_memory(tmp_path: Path) -> None:
    memory = Feeder(Assembler())
    memory(relation(OID_A))
    spilled = Feeder(Assembler(memory_limit=1, spill_dir=tmp_path))
    spilled(relation(OID_A))
    (a,) = nested_savepoints(memory)
    (b,) = nested_savepoints(spilled)
    assert list(a.changes()) == list(b.changes())
    assert values(b) == ["top1", "s1a", "top3", "s1c"]


def test_spill_files_deleted_on_release_abort_rollback_reset(tmp_path: Path) -> None:
    asm = Assembler(memory_limit=0, spill_dir=tmp_path)
    feed = Feeder(asm)
    feed(relation())
    begin, commit = feed.begin(1)
    (txn,) = feed(begin, ins("a"), commit)
    assert len(spill_files(tmp_path)) == 1
    assert values(txn) == ["a"]
    txn.release()
    assert spill_files(tmp_path) == []

    feed(StreamStart(2, True), ins("b", 2), StreamStop())
    assert len(spill_files(tmp_path)) == 1 and asm.spilled_bytes > 0
    feed(StreamAbort(2, 2))
    assert spill_files(tmp_path) == [] and asm.spilled_bytes == 0

    feed(BeginPrepare(0xC000, 0xC008, 5, 77, "g1"), ins("p1"))
    feed(Prepare(0, 0xC000, 0xC008, 5, 77, "g1"))
    feed(RollbackPrepared(0, 0, 0, 0, 0, 77, "g1"))
    assert spill_files(tmp_path) == []

    feed(StreamStart(3, True), ins("c", 3), StreamStop(), Begin(0x9000, 0, 4), ins("d"))
    assert len(spill_files(tmp_path)) == 2
    asm.reset()
    assert spill_files(tmp_path) == []

    feed(StreamStart(3, True), ins("c", 3), StreamStop())
    feed(StreamStart(3, True), ins("c", 3), StreamStop())  # re-streamed: old file goes
    assert len(spill_files(tmp_path)) == 1


def test_stale_spill_files_removed_at_start(tmp_path: Path) -> None:
    (tmp_path / f"{SPILL_PREFIX}17{SPILL_SUFFIX}").write_bytes(b"old")
    (tmp_path / "other").write_bytes(b"keep")
    Assembler(spill_dir=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other"]


def test_accounting_stays_under_limit(tmp_path: Path) -> None:
    limit = 5000
    asm = Assembler(memory_limit=limit, spill_dir=tmp_path)
    feed = Feeder(asm)
    feed(relation())
    feed(StreamStart(1, True))
    for i in range(200):
        feed(ins(str(i), 1 + i % 4))
        assert asm.buffered_bytes <= limit
    feed(StreamStop(), Begin(0x9000, 0, 4), *(ins(str(i)) for i in range(100)))
    assert asm.buffered_bytes <= limit
    assert asm.spill_count >= 1


def test_large_transaction_goes_compact_in_memory_then_spills(tmp_path: Path) -> None:
    """Past ``compact_bytes`` a transaction is held in spill format in memory, accounted by
    the stream's length, with no file; past ``memory_limit`` it moves to a file."""
    asm = Assembler(memory_limit=20_000, spill_dir=tmp_path, compact_bytes=3_000)
    feed = Feeder(asm)
    feed(relation(), Begin(0x9000, 0, 4))
    for i in range(5):
        feed(ins(str(i)))
    buf = asm._current
    assert buf is not None and buf.spill is None and asm.buffered_bytes == buf.mem_bytes
    for i in range(5, 40):
        feed(ins(str(i)))
    assert buf.spill is not None and buf.spill.in_memory and buf.records == []
    assert asm.buffered_bytes == buf.mem_bytes == buf.spill.tell()
    assert spill_files(tmp_path) == [] and asm.spilled_bytes == 0 and asm.spill_count == 0
    for i in range(40, 1000):
        feed(ins(str(i)))
        assert asm.buffered_bytes <= 20_000
    assert not buf.spill.in_memory and asm.buffered_bytes == 0 and asm.spill_count == 1
    assert len(spill_files(tmp_path)) == 1 and asm.spilled_bytes == buf.spill.tell()
    (txn,) = feed(Commit(0, 0x9000, 0x9008, 0))
    assert values(txn) == [str(i) for i in range(1000)] and txn.mem_bytes == 0
    txn.release()
    assert spill_files(tmp_path) == []


def test_compact_transaction_released_holds_its_bytes(tmp_path: Path) -> None:
    asm = Assembler(memory_limit=1 << 30, spill_dir=tmp_path, compact_bytes=0)
    feed = Feeder(asm)
    feed(relation(), Begin(0x9000, 0, 4), ins("a"), ins("b"))
    buf = asm._current
    assert buf is not None and buf.spill is not None and buf.spill.in_memory
    size = buf.spill.tell()
    (txn,) = feed(Commit(0, 0x9000, 0x9008, 0))
    assert txn.mem_bytes == size > 0 and asm.buffered_bytes == 0
    assert values(txn) == values(txn) == ["a", "b"]
    assert spill_files(tmp_path) == [] and asm.total_spilled_bytes == 0
    txn.release()
    assert list(txn.changes()) == []


def test_the_last_reading_of_a_compact_transaction_frees_it(tmp_path: Path) -> None:
    """take_changes (the writer's reading) gives the same changes as changes(), drops the
    stream's chunks as it reads them, and leaves nothing to read again: a second reading
    is an error, not a silently empty or partial transaction. drop_first applies to it too."""
    asm = Assembler(memory_limit=1 << 30, spill_dir=tmp_path, compact_bytes=0)
    feed = Feeder(asm)
    names = [f"v{i}" for i in range(5000)]

    def wide(value: str) -> Insert:  # 1 KB rows: the stream's chunks are 1 MiB
        return Insert(None, OID_A, TupleData(b"tt", (value.encode(), b"x" * 1000)))

    feed(relation(), Begin(0x9000, 0, 4), *(wide(n) for n in names))
    spill = asm._current.spill  # type: ignore[union-attr]
    assert spill is not None and spill.in_memory
    (txn,) = feed(Commit(0, 0x9000, 0x9008, 0))
    assert values(txn) == names  # read as often as wanted before the last reading
    chunks = len(spill._chunks)
    assert chunks >= 4
    taken = txn.take_changes()
    first = next(taken)
    assert first.change.new.values[0] == b"v0"  # type: ignore[union-attr]
    assert len(spill._chunks) == chunks - 1
    rest = [r.change.new.values[0].decode() for r in taken]  # type: ignore[union-attr]
    assert ["v0", *rest] == names and spill._chunks == []
    with pytest.raises(RuntimeError, match="taken"):
        list(txn.changes())
    txn.release()
    assert list(txn.changes()) == []

    feed(Begin(0x9100, 0, 5), *(wide(n) for n in names))
    (resent,) = feed(Commit(0, 0x9100, 0x9108, 0))
    resent.drop_first(4990)  # handed over before a reconnect
    assert (
        [r.change.new.values[0] for r in resent.take_changes()]
        == [  # type: ignore[union-attr]
            n.encode() for n in names[4990:]
        ]
    )

    spilled = Feeder(Assembler(memory_limit=1, spill_dir=tmp_path, compact_bytes=0))
    spilled(relation(), Begin(0x9200, 0, 6), ins("a"), ins("b"))
    (on_disk,) = spilled(Commit(0, 0x9200, 0x9208, 0))
    assert [r.lsn for r in on_disk.take_changes()] == [r.lsn for r in on_disk.changes()]
    on_disk.release()


def test_compact_subtransaction_abort_gives_back_its_bytes() -> None:
    asm = Assembler(memory_limit=1 << 30, compact_bytes=0)
    feed = Feeder(asm)
    feed(relation(), StreamStart(1, True), ins("top", 1))
    kept = asm.buffered_bytes
    feed(ins("sub1", 2), ins("sub2", 2), StreamStop())
    assert asm.buffered_bytes > kept
    feed(StreamAbort(1, 2))
    assert asm.buffered_bytes == kept
    (txn,) = feed(StreamCommit(1, 0, 0x7000, 0x7008, 0))
    assert values(txn) == ["top"]


def test_without_spill_dir_memory_is_unbounded() -> None:
    asm = Assembler(memory_limit=0)
    feed = Feeder(asm)
    feed(relation(), Begin(0x9000, 0, 4), ins("a"))
    assert asm.buffered_bytes > 0 and asm.spilled_bytes == 0


# --- random interleavings ----------------------------------------------------------------------


@st.composite
def interleavings(draw: st.DrawFn) -> tuple[list[PgOutputMessage], dict[int, list[str]]]:
    """Several streamed xids (with subxacts, some aborted) and regular transactions, randomly
    interleaved; returns the messages and, per committed xid, its expected values."""
    n_streams = draw(st.integers(1, 4))
    plans = {}
    for s in range(n_streams):
        xid = 1000 * (s + 1)
        n_segments = draw(st.integers(1, 4))
        segments = [
            draw(st.lists(st.integers(0, 3), min_size=0, max_size=6)) for _ in range(n_segments)
        ]
        plans[xid] = segments
    outcome = {xid: draw(st.sampled_from(["commit", "abort", "subabort"])) for xid in plans}
    msgs: list[PgOutputMessage] = [relation()]
    expected: dict[int, list[str]] = {}
    live: dict[int, list[tuple[int, str]]] = {xid: [] for xid in plans}
    progress = dict.fromkeys(plans, 0)
    regular = 1
    counter = 0
    while any(progress[x] < len(plans[x]) for x in plans) or regular < 3:
        pending = [x for x in plans if progress[x] < len(plans[x])]
        if not pending or draw(st.booleans()):
            xid = 50 + regular
            regular += 1
            vals = [f"r{xid}.{i}" for i in range(draw(st.integers(0, 3)))]
            msgs += [Begin(0x100000 + xid, 0, xid), *(ins(v) for v in vals)]
            msgs.append(Commit(0, 0x100000 + xid, 0x100008 + xid, 0))
            expected[xid] = vals
            continue
        xid = draw(st.sampled_from(pending))
        seg = plans[xid][progress[xid]]
        msgs.append(StreamStart(xid, progress[xid] == 0))
        for sub in seg:
            counter += 1
            value = f"{xid}.{sub}.{counter}"
            msgs.append(ins(value, xid + sub))
            live[xid].append((xid + sub, value))
        msgs.append(StreamStop())
        progress[xid] += 1
        if progress[xid] == len(plans[xid]):
            kept = [v for _, v in live[xid]]
            if outcome[xid] == "abort":
                msgs.append(StreamAbort(xid, xid))
                continue
            if outcome[xid] == "subabort":
                victim = xid + draw(st.integers(1, 3))
                msgs.append(StreamAbort(xid, victim))
                first = next((i for i, (s, _) in enumerate(live[xid]) if s == victim), None)
                if first is not None:  # truncated at that subxact's first change
                    kept = kept[:first]
            msgs.append(StreamCommit(xid, 0, 0x200000 + xid, 0x200008 + xid, 0))
            expected[xid] = kept
    return msgs, expected


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(interleavings(), st.sampled_from([None, 0, 600, 4000]), st.sampled_from([0, 800, 1 << 20]))
def test_random_interleavings(
    tmp_path_factory: pytest.TempPathFactory,
    case: tuple[list[PgOutputMessage], dict[int, list[str]]],
    limit: int | None,
    compact: int,
) -> None:
    """``limit``: memory limit (None: no spill directory); ``compact``: compact form threshold."""
    msgs, expected = case
    if limit is None:
        asm = Assembler(compact_bytes=compact)
    else:
        spill_dir = tmp_path_factory.mktemp("spill")
        asm = Assembler(memory_limit=limit, spill_dir=spill_dir, compact_bytes=compact)
    feed = Feeder(asm)
    feed(*msgs)
    got = {t.xid: values(t) for t in feed.released}
    assert got == expected
    assert asm.idle and asm.buffered_bytes == 0
    for txn in feed.released:
        txn.release()
