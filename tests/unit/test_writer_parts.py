"""The writer with a transaction in parts (docs/assembler.md "Parts"): each sink sees one
``begin`` (the first part), the events of every part with ``seq`` going on, one ``commit``
(the last part, with the end LSN); parts are released on their own and count in the limits."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence
from typing import Any

import pytest

from cdcd.assembler.assembler import Assembler
from cdcd.assembler.transaction import Transaction
from cdcd.decoder.copy_batch import CopyBatch
from cdcd.decoder.events import Begin, Commit, Delete, Insert, TupleData, Update
from cdcd.events.change_event import ChangeEvent
from cdcd.pipeline.progress import ProgressTracker
from cdcd.pipeline.writer import _WHOLE_CHANGES, Writer
from cdcd.sinks.memory import MemorySink
from cdcd.sinks.null import NullSink
from cdcd.snapshot.watermarks import snapshot_transaction
from cdcd.stats import Stats
from tests.unit.sink_fixtures import CONTEXT, encoder
from tests.unit.test_assembler import OID_A, OID_B, relation


def parts_of_one_transaction(rows: int) -> list[Transaction]:
    """A transaction of inserts, an update changing a key (two events) and a delete, released
    by the assembler in parts of ~4 KiB."""
    asm = Assembler(part_bytes=4096)
    lsn = 0x1000
    out: list[Transaction] = []
    msgs = [relation(OID_A), Begin(0x900000, 111, 7)]
    msgs += [Insert(None, OID_A, TupleData(b"tt", (b"%d" % i, b"x" * 20))) for i in range(rows)]
    old = TupleData(b"tn", (b"0", None))
    msgs += [
        Update(None, OID_A, "K", old, TupleData(b"tt", (b"new", b"y"))),
        Delete(None, OID_A, "K", TupleData(b"tn", (b"1", None))),
        Commit(0, 0x900000, 0x900008, 222),
    ]
    for msg in msgs:
        lsn += 8
        txn = asm.feed(msg, lsn)
        if txn is not None:
            out.append(txn)
    return out


async def write_all(sinks: list, parts: list[Transaction], **limits: int) -> Writer:  # type: ignore[type-arg]
    tracker = ProgressTracker(len(sinks))
    writer = Writer(
        sinks,
        encoder(),
        tracker,
        Stats(),
        memory_limit=limits.get("memory_limit", 1 << 30),
        max_transactions=limits.get("max_transactions", 64),
    )
    for sink in sinks:
        await sink.start()
    running = asyncio.create_task(writer.run())
    for part in parts:
        await writer.put(part)
    writer.close()
    await asyncio.wait_for(running, 30)
    return writer


async def test_one_begin_and_commit_seq_going_on() -> None:
    parts = parts_of_one_transaction(60)
    assert len(parts) > 3 and parts[-1].ends and parts[0].begins
    sink = MemorySink(MemorySink.Config(), CONTEXT)
    writer = await write_all([sink], parts)
    events = 60 + 2 + 1  # the key-changing update is a delete and a create
    assert sink.positions() == [(0x900000, seq) for seq in range(events)]
    assert sink.transactions == [(7, 0x900000, 0x900008, events)]  # one commit, with its end
    assert [v["op"] for v in sink.values[-4:]] == ["c", "d", "c", "d"]
    dco = [v["transaction"]["data_collection_order"] for v in sink.values]
    assert dco == list(range(1, events + 1))  # per table, going on across parts
    assert writer.queued_transactions == 0  # every part released
    assert all(part._records is None for part in parts)


async def test_parts_pass_a_queue_of_one() -> None:
    """``buffer.queue_transactions: 1``: each part waits for the one before it."""
    parts = parts_of_one_transaction(60)
    memory, null = MemorySink(MemorySink.Config(), CONTEXT), NullSink(NullSink.Config(), CONTEXT)
    await write_all([memory, null], parts, max_transactions=1, memory_limit=1)
    assert len(memory.positions()) == 63 and null.stats() == {"events": 63, "transactions": 1}
    assert memory.durable_lsn() == null.durable_lsn() == 0x900008


async def test_a_sink_durable_at_commit_is_not_flushed_per_transaction() -> None:
    """The null sink holds a transaction durably once committed: the writer learns that from
    the sink, and flushes it only when something is still not durable (here: never)."""
    flushes = 0

    class CountingNull(NullSink):
        async def flush(self) -> None:
            nonlocal flushes
            flushes += 1

    txns = []
    for n in range(50):
        asm = Assembler()
        lsn = 0x1000 + n * 0x100
        for msg in (
            relation(OID_A),
            relation(OID_B),
            Begin(lsn + 0x80, lsn, 100 + n),
            Insert(None, OID_A, TupleData(b"tt", (b"%d" % n, b"x"))),
            Insert(None, OID_B, TupleData(b"tt", (b"%d" % n, b"x"))),
            Update(None, OID_A, None, None, TupleData(b"tt", (b"%d" % n, b"y"))),
            Commit(0, lsn + 0x80, lsn + 0x88, lsn),
        ):
            lsn += 8
            txn = asm.feed(msg, lsn)
            if txn is not None:
                txns.append(txn)
    sink = CountingNull(NullSink.Config(), CONTEXT)
    writer = await write_all([sink], txns)
    assert sink.transactions == 50
    assert writer._tracker.durable_lsn() == txns[-1].end_lsn
    assert flushes == 0
    assert writer._stats.events == 150
    assert writer._stats.events_by == {
        (f"public.t{OID_A}", "c"): 50,
        (f"public.t{OID_A}", "u"): 50,
        (f"public.t{OID_B}", "c"): 50,
    }


async def test_a_transient_failure_in_a_small_transaction_retries_that_call_only() -> None:
    """A small transaction is one item of the window (begin, its batches, commit): a
    TransientSinkError from any of the three calls repeats that call alone, so the sink sees
    each begin, event and commit once."""
    from cdcd.errors import TransientSinkError

    failing = {"begin", "write", "commit"}

    class Flaky(MemorySink):
        async def begin(self, txn: Transaction) -> None:
            if "begin" in failing:
                failing.discard("begin")
                raise TransientSinkError("begin")
            await super().begin(txn)

        async def write(self, events):  # type: ignore[no-untyped-def]
            if "write" in failing:
                failing.discard("write")
                raise TransientSinkError("write")
            await super().write(events)

        async def commit(self, txn: Transaction) -> None:
            if "commit" in failing:
                failing.discard("commit")
                raise TransientSinkError("commit")
            await super().commit(txn)

    parts = parts_of_one_transaction(3)
    assert len(parts) == 1 and parts[0].begins and parts[0].ends  # small: one item
    sink = Flaky(MemorySink.Config(), CONTEXT)
    writer = await write_all([sink], parts)
    events = 3 + 2 + 1
    assert sink.positions() == [(0x900000, seq) for seq in range(events)]
    assert sink.transactions == [(7, 0x900000, 0x900008, events)]
    assert writer._stats.sinks[0].retries == 3
    assert not failing


class _LoggingSink(MemorySink):
    """A memory sink that notes each write in ``log``."""

    def __init__(self, log: list[str]) -> None:
        super().__init__(MemorySink.Config(), CONTEXT)
        self.log = log

    async def write(self, events: Sequence[ChangeEvent]) -> None:
        self.log.append("write")
        await super().write(events)


@pytest.mark.parametrize("sink_type", ["events", "null"])
async def test_loop_runs_between_a_snapshot_chunks_batches(sink_type: str) -> None:
    """A backfill chunk's batches are written one loop turn apart: rendered in one go, they
    held the loop while the next chunk's COPY waited to be read (docs/snapshots.md)."""
    log: list[str] = []
    rel = relation(OID_A)
    n = _WHOLE_CHANGES // 2  # a chunk larger than the writer's runs of small transactions
    batches = [
        CopyBatch(b"\n".join(b"%d\tx" % (n * b + i) for i in range(n)), n, 2) for b in range(3)
    ]
    txn = snapshot_transaction(
        rel, list(batches), 3 * n, commit_lsn=0x900000, end_lsn=0x900008, commit_time=1, mem_bytes=0
    )
    sink: Any
    if sink_type == "events":
        sink = _LoggingSink(log)
    else:
        sink = NullSink(NullSink.Config(), CONTEXT)
        counted = sink.write_changes

        async def write_changes(records: Any) -> None:
            log.append("write")
            await counted(records)

        sink.write_changes = write_changes
    ticking = True

    async def tick() -> None:
        while ticking:
            log.append("tick")
            await asyncio.sleep(0)

    ticker = asyncio.create_task(tick())
    try:
        await write_all([sink], [txn])
    finally:
        ticking = False
        await ticker
    writes = [i for i, entry in enumerate(log) if entry == "write"]
    assert len(writes) == 3
    assert all("tick" in log[a:b] for a, b in itertools.pairwise(writes))
    if sink_type == "events":
        assert [v["after"]["id"] for v in sink.values] == [str(i) for i in range(3 * n)]
