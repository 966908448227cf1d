"""Assembler parts (docs/assembler.md, "Parts"): a regular transaction released while it
arrives, and what is never released in parts (streamed, prepared, refused by the part policy)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cdcd.assembler.assembler import Assembler, PartPolicy
from cdcd.assembler.transaction import Transaction
from cdcd.decoder.events import (
    BeginPrepare,
    CommitPrepared,
    Insert,
    Message,
    Origin,
    PgOutputMessage,
    Prepare,
    StreamCommit,
    StreamStart,
    StreamStop,
    Truncate,
)
from cdcd.decoder.pgoutput import PgOutputDecoder
from tests.unit import test_pgoutput as wire
from tests.unit.test_assembler import OID_A, OID_B, Feeder, ins, relation, spill_files

PART = 4096  # accounted bytes: a part every few changes (an insert here is ~380 bytes)


def labels(txn: Transaction) -> list[str]:
    """Each change as a short label: the Insert's first value, ``m:<prefix>``, ``t``."""
    out = []
    for rec in txn.changes():
        change = rec.change
        if isinstance(change, Insert):
            out.append((change.new.values[0] or b"").decode())
        elif isinstance(change, Message):
            out.append(f"m:{change.prefix}")
        else:
            out.append("t")
    return out


def joined(parts: list[Transaction]) -> list[str]:
    return [label for part in parts for label in labels(part)]


def feeder(**kwargs: object) -> Feeder:
    f = Feeder(Assembler(**kwargs))  # type: ignore[arg-type]
    f(relation(OID_A), relation(OID_B))
    return f


def test_regular_transaction_released_in_parts() -> None:
    feed = feeder(part_bytes=PART)
    begin, commit = feed.begin(700)
    feed(begin, Origin(0xABC, "node1"))
    first_lsn = feed.lsn
    parts = feed(*[ins(str(i)) for i in range(40)])
    assert len(parts) >= 3
    for part in parts:
        assert (part.kind, part.xid, part.commit_lsn, part.end_lsn, part.ends) == (
            "regular",
            700,
            begin.final_lsn,
            0,
            False,
        )
        assert (part.commit_time, part.origin, part.origin_lsn) == (111, "node1", 0xABC)
        assert part.size == len(labels(part)) and part.mem_bytes > PART
    assert [p.begins for p in parts] == [True] + [False] * (len(parts) - 1)
    assert feed.asm.buffered_bytes <= PART  # what was released is not held here any more
    assert feed.asm.confirm_ceiling() == first_lsn - 8  # the Begin's, until the Commit
    (last,) = feed(commit)
    assert (last.begins, last.ends, last.end_lsn, last.commit_time) == (
        False,
        True,
        commit.end_lsn,
        222,
    )
    assert joined([*parts, last]) == [str(i) for i in range(40)]
    assert sum(p.size for p in [*parts, last]) == 40
    assert feed.asm.idle and feed.asm.confirm_ceiling() is None
    assert feed.asm.buffered_bytes == 0 and last.mem_bytes > 0  # the writer accounts it now


def test_small_transaction_is_one_whole_part() -> None:
    feed = feeder(part_bytes=PART)
    begin, commit = feed.begin(701)
    (txn,) = feed(begin, ins("a"), commit)
    assert (txn.begins, txn.ends, txn.size, labels(txn)) == (True, True, 1, ["a"])


def test_the_part_policy_refuses_per_transaction() -> None:
    feed = feeder(part_bytes=PART)
    b1, c1 = feed.begin(701)
    feed.asm.part_policy.since = b1.final_lsn + 1  # committed before the last one queued
    assert feed(b1, *[ins(str(i)) for i in range(40)]) == []
    (whole,) = feed(c1)
    assert (whole.begins, whole.ends, whole.size) == (True, True, 40)
    b2, c2 = feed.begin(702)
    assert len(feed(b2, *[ins(str(i)) for i in range(40)], c2)) > 1
    feed.asm.part_policy.hold = True  # a watermark window is open
    b3, c3 = feed.begin(703)
    assert len(feed(b3, *[ins(str(i)) for i in range(40)], c3)) == 1
    feed.asm.part_policy.resume = b3.final_lsn  # unless it is being handed already
    assert len(feed(b3, *[ins(str(i)) for i in range(40)], c3)) > 1
    feed.asm.part_policy.until = b3.final_lsn - 1  # never past --endpos
    assert len(feed(b3, *[ins(str(i)) for i in range(40)], c3)) == 1


def test_part_policy_allows() -> None:
    policy = PartPolicy()
    assert policy.allows(0) and policy.allows(500)
    policy.since, policy.until = 200, 400
    assert [policy.allows(lsn) for lsn in (199, 200, 400, 401)] == [False, True, True, False]
    policy.hold, policy.resume = True, 150
    assert [policy.allows(lsn) for lsn in (150, 300)] == [True, False]
    policy.resume = 450  # past until: never
    assert not policy.allows(450)


def test_no_parts_without_part_bytes() -> None:
    feed = feeder(compact_bytes=PART)
    begin, commit = feed.begin(700)
    assert feed(begin, *[ins(str(i)) for i in range(40)]) == []
    (txn,) = feed(commit)
    assert txn.begins and txn.ends and labels(txn) == [str(i) for i in range(40)]


def test_streamed_and_prepared_transactions_are_never_parted() -> None:
    feed = feeder(part_bytes=PART)
    many = [ins(str(i), xid=900) for i in range(40)]
    assert feed(StreamStart(900, True), *many, StreamStop()) == []
    (streamed,) = feed(StreamCommit(900, 0, 0x9000, 0x9010, 5))
    assert (streamed.kind, streamed.begins, streamed.ends, streamed.size) == (
        "streamed",
        True,
        True,
        40,
    )
    prep = BeginPrepare(0xA000, 0xA010, 5, 901, "g1")
    done = Prepare(0, 0xA000, 0xA010, 5, 901, "g1")
    assert feed(prep, *[ins(str(i)) for i in range(40)], done) == []
    (prepared,) = feed(CommitPrepared(0, 0xB000, 0xB010, 6, 901, "g1"))
    assert (prepared.kind, prepared.begins, prepared.ends, prepared.size) == (
        "prepared",
        True,
        True,
        40,
    )


def test_spilled_before_its_first_part_it_is_released_whole(tmp_path: Path) -> None:
    """Other buffered transactions leave less than ``part_bytes`` under the memory limit: the
    regular transaction spills before it has a part to release, then goes on in its file and is
    released whole at its Commit (what is buffered never passes the limit)."""
    feed = feeder(part_bytes=PART, memory_limit=3000, spill_dir=tmp_path, compact_bytes=1 << 30)
    feed(StreamStart(900, True), *[ins(f"x{i}", xid=900) for i in range(3)], StreamStop())
    begin, commit = feed.begin(702)
    assert feed(begin, *[ins(f"r{i}") for i in range(30)]) == []
    assert spill_files(tmp_path) and feed.asm.buffered_bytes <= 3000
    (txn,) = feed(commit)
    assert (txn.begins, txn.ends, labels(txn)) == (True, True, [f"r{i}" for i in range(30)])
    txn.release()
    assert len(spill_files(tmp_path)) <= 1  # the streamed one's, if it spilled


def test_truncates_and_messages_travel_in_parts() -> None:
    feed = feeder(part_bytes=PART)
    begin, commit = feed.begin(703)
    msgs: list[PgOutputMessage] = []
    for i in range(30):
        msgs.append(ins(str(i)))
        if i % 7 == 0:
            msgs.append(Message(None, True, 0x5000 + i, "p", b"x"))
        if i % 11 == 0:
            msgs.append(Truncate(None, 0, (OID_A, OID_B)))
    parts = feed(begin, *msgs, commit)
    got = joined(parts)
    assert got == labels_of(msgs)
    assert len(parts) > 1


def labels_of(msgs: list[PgOutputMessage]) -> list[str]:
    out = []
    for m in msgs:
        if isinstance(m, Insert):
            out.append((m.new.values[0] or b"").decode())
        elif isinstance(m, Message):
            out.append(f"m:{m.prefix}")
        else:
            out.append("t")
    return out


def test_drop_first_in_memory_and_from_a_spill_file(tmp_path: Path) -> None:
    feed = feeder()
    begin, commit = feed.begin(704)
    (txn,) = feed(begin, *[ins(str(i)) for i in range(5)], commit)
    txn.drop_first(2)
    assert (txn.size, labels(txn)) == (3, ["2", "3", "4"])
    txn.drop_first(10)
    assert (txn.size, labels(txn)) == (0, [])
    spilled = feeder(memory_limit=0, spill_dir=tmp_path)
    begin, commit = spilled.begin(705)
    (txn,) = spilled(begin, *[ins(str(i)) for i in range(5)], commit)
    assert spill_files(tmp_path)
    txn.drop_first(3)
    assert (txn.size, labels(txn)) == (2, ["3", "4"])
    assert labels(txn) == ["3", "4"]  # read back again, the same
    txn.release()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sizes=st.lists(st.integers(0, 60), min_size=1, max_size=4),
    part_bytes=st.integers(200, 6000),
)
def test_parts_concatenate_to_the_whole(sizes: list[int], part_bytes: int) -> None:
    """Whatever the threshold, the parts of each transaction, in order, are its changes."""
    whole, parted = feeder(), feeder(part_bytes=part_bytes)
    for n, size in enumerate(sizes):
        begin, commit = whole.begin(800 + n)
        msgs = [begin, *[ins(f"{n}.{i}") for i in range(size)], commit]
        (expected,) = whole(*msgs)
        parts = parted(*msgs)
        assert parts[-1].ends and all(not p.ends for p in parts[:-1])
        assert [p.begins for p in parts] == [True] + [False] * (len(parts) - 1)
        assert joined(parts) == labels(expected)
        assert parted.asm.idle


@pytest.mark.parametrize("part_bytes", [PART])
def test_reset_mid_transaction_forgets_the_rest(part_bytes: int) -> None:
    """After a reconnect the server resends the transaction from its start: the assembler
    starts it afresh (the reader drops what it handed already)."""
    feed = feeder(part_bytes=part_bytes)
    begin, commit = feed.begin(705)
    before = feed(begin, *[ins(str(i)) for i in range(20)])
    feed.asm.reset()
    assert feed.asm.buffered_bytes == 0 and feed.asm.confirm_ceiling() is None
    again = feed(begin, *[ins(str(i)) for i in range(30)], commit)
    assert again[0].begins  # the reader, not the assembler, knows it was handed before
    assert joined(again) == [str(i) for i in range(30)]
    assert len(before) >= 1


def _wire_stream(sizes: list[int]) -> list[tuple[int, int, int, bytes]]:
    """pgoutput bytes of a relation and two transactions (Inserts of ``sizes`` bytes, then a
    logical message, an update and a delete), as the replication client's XLogData tuples."""
    oid = 4242
    text = wire.tuple_bytes
    msgs = [wire.relation(oid, "public", "t", b"d", [(1, "v", 25, -1)])]
    msgs.append(wire.begin(0x9000, 1, 700))
    msgs += [wire.insert(oid, text(b"t", (b"%d" % i + b"x" * n,))) for i, n in enumerate(sizes)]
    msgs.append(wire.commit(0, 0x9000, 0x9008, 1))
    msgs.append(wire.begin(0x9100, 2, 701))
    msgs.append(wire.message(1, 0x9010, "p", b"m"))
    msgs.append(wire.update(oid, text(b"t", (b"u",))))
    msgs.append(wire.delete(oid, b"K", text(b"t", (b"d",))))
    msgs.append(wire.commit(0, 0x9100, 0x9108, 2))
    return [(0x1000 + 8 * i, 0x1000 + 8 * i, 0, data) for i, data in enumerate(msgs)]


def _released(asm: Assembler, items: list[tuple[int, int, int, bytes]], run: bool) -> list[Any]:
    decoder = PgOutputDecoder(1)
    out = []
    position = 0
    batch: list[Any] = list(items)
    while position < len(batch):
        txn = None
        if run:
            taken, size, wal, txn = asm.feed_run(batch, position, decoder.decode, False)
            assert size == sum(len(item[3]) for item in batch[position : position + taken])
            assert wal == max((item[1] for item in batch[position : position + taken]), default=0)
            position += taken
        if txn is None and not (run and taken):
            lsn, _, _, data = batch[position]
            position += 1
            txn = asm.feed(decoder.decode(data, lsn), lsn, data)
        if txn is not None:
            out.append((txn.kind, txn.commit_lsn, txn.end_lsn, txn.begins, txn.ends))
            out.append([(rec.lsn, type(rec.change).__name__) for rec in txn.changes()])
            txn.release()
    return out


@settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    sizes=st.lists(st.integers(0, 900), min_size=0, max_size=30),
    part_bytes=st.sampled_from([None, 300, 2000]),
    memory_limit=st.sampled_from([1 << 20, 3000]),
)
def test_feed_run_releases_what_feeding_one_by_one_does(
    sizes: list[int], part_bytes: int | None, memory_limit: int, tmp_path: Path
) -> None:
    """Assembler.feed_run (the reader's loop in compiled code) against decode-and-feed per
    message: the same parts, transactions and changes, in parts, whole, and spilled (where
    changes are taken undecoded)."""
    items = _wire_stream(sizes)
    kwargs = {"part_bytes": part_bytes, "memory_limit": memory_limit, "spill_dir": tmp_path}
    one_by_one = _released(Assembler(**kwargs), items, run=False)  # type: ignore[arg-type]
    in_runs = _released(Assembler(**kwargs), items, run=True)  # type: ignore[arg-type]
    assert in_runs == one_by_one
    assert sum(len(x) for x in in_runs[1::2]) == len(sizes) + 3
