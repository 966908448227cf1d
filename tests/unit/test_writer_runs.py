"""Runs of small transactions (docs/sinks.md, "Runs of small transactions"): what is waiting
goes to a sink that overrides ``write_transactions`` in one call, to the others call by call,
and both see the same events, commits and positions. The file sink's run writes what its
calls one by one would, byte for byte, and skips what it holds after a restart."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from cdcd.assembler.transaction import Transaction
from cdcd.pipeline.progress import ProgressTracker
from cdcd.pipeline.writer import _WHOLE_CHANGES, Writer
from cdcd.sinks.file.sink import FileSink
from cdcd.sinks.memory import MemorySink
from cdcd.sinks.null import NullSink
from cdcd.stats import Stats
from tests.unit.sink_fixtures import CONTEXT, TxnBuilder, encoder, relation, tup
from tests.unit.test_file_sink import feed, make_sink, spark_read, workload

ORDERS = relation()


class RunSink(MemorySink):
    """A memory sink that takes runs: records each run's transaction ids, then does what the
    calls one by one would (the default)."""

    def __init__(self) -> None:
        super().__init__(MemorySink.Config(), CONTEXT)
        self.runs: list[list[int]] = []

    async def write_transactions(self, run: Sequence[tuple[Transaction, Sequence[Any]]]) -> None:
        self.runs.append([txn.xid for txn, _ in run])
        await super().write_transactions(run)


class CallSink(MemorySink):
    """A memory sink without ``write_transactions``: records every call."""

    def __init__(self) -> None:
        super().__init__(MemorySink.Config(), CONTEXT)
        self.calls: list[tuple[str, int]] = []

    async def begin(self, txn: Transaction) -> None:
        self.calls.append(("begin", txn.xid))
        await super().begin(txn)

    async def commit(self, txn: Transaction) -> None:
        self.calls.append(("commit", txn.xid))
        await super().commit(txn)


def small(first_xid: int, count: int, rows: int = 3, lsn: int = 0x10000) -> list[Transaction]:
    txns = []
    for n in range(count):
        xid = first_xid + n
        b = TxnBuilder(xid, lsn + n * 0x10000)
        for r in range(rows):
            b.insert(ORDERS, tup(xid * 1000 + r, f"n{r}", None))
        txns.append(b.build())
    return txns


async def run_writer(sinks: list[Any], txns: list[Transaction], *, waiting: bool) -> Writer:
    """``waiting``: every transaction is queued before the writer starts (so runs form);
    otherwise each is put only once the previous one was handed to every sink."""
    stats = Stats()
    writer = Writer(
        sinks, encoder(), ProgressTracker(len(sinks)), stats, memory_limit=1 << 30,
        max_transactions=100_000,
    )  # fmt: skip
    for sink in sinks:
        await sink.start()
    if waiting:
        for txn in txns:
            await writer.put(txn)
        running = asyncio.create_task(writer.run())
    else:
        running = asyncio.create_task(writer.run())
        for txn in txns:
            await writer.put(txn)
            while writer.queued_transactions:
                await asyncio.sleep(0)
    writer.close()
    await asyncio.wait_for(running, 30)
    return writer


async def test_waiting_transactions_go_as_one_run_with_the_same_outcome() -> None:
    txns = small(1, 50)
    runs, calls = RunSink(), CallSink()
    writer = await run_writer([runs, calls], txns, waiting=True)
    assert runs.runs == [[t.xid for t in txns]]  # 150 changes: one run
    assert calls.calls == [(c, t.xid) for t in txns for c in ("begin", "commit")]
    assert (
        runs.positions()
        == calls.positions()
        == [(t.commit_lsn, seq) for t in txns for seq in range(3)]
    )
    assert runs.transactions == calls.transactions
    assert runs.values == calls.values
    assert runs.durable_lsn() == calls.durable_lsn() == txns[-1].end_lsn
    stats = writer._stats
    assert stats.transactions == 50 and stats.events == 150
    for sink_stats in stats.sinks:  # the write histogram counts transactions, not runs
        assert sum(sink_stats.write_seconds.counts) == 50
        assert sink_stats.handed_lsn == txns[-1].end_lsn
    assert writer.queued_transactions == 0
    assert all(t._records is None for t in txns)  # each released


async def test_a_run_stays_within_its_changes_and_leaves_out_big_and_snapshot_ones() -> None:
    per = 400  # two fit in a run (800), a third would pass _WHOLE_CHANGES
    assert 2 * per <= _WHOLE_CHANGES < 3 * per
    txns = small(1, 5, rows=per)
    big = small(10, 1, rows=_WHOLE_CHANGES + 1, lsn=0x900000)
    chunk = small(20, 2, lsn=0xA00000)
    snapshot = Transaction(
        kind="snapshot", xid=0, commit_lsn=chunk[0].commit_lsn, end_lsn=chunk[0].end_lsn,
        commit_time=0, size=chunk[0].size, _records=list(chunk[0].changes()),
    )  # fmt: skip
    after = small(30, 2, lsn=0xB00000)
    sink = RunSink()
    await run_writer([sink], [*txns, *big, snapshot, chunk[1], *after], waiting=True)
    # the big one is begin, batches, commit; the snapshot chunk a run of its own
    assert sink.runs == [[1, 2], [3, 4], [5], [0], [21, 30, 31]]
    assert [x for x, *_ in sink.transactions] == [1, 2, 3, 4, 5, 10, 0, 21, 30, 31]


async def test_nothing_waiting_means_runs_of_one() -> None:
    txns = small(1, 6)
    sink = RunSink()
    await run_writer([sink], txns, waiting=False)
    assert sink.runs == [[t.xid] for t in txns]


async def test_null_sink_runs_count_changes_and_end_durable() -> None:
    txns = small(1, 20)
    sink = NullSink(NullSink.Config(), CONTEXT)
    await run_writer([sink], txns, waiting=True)
    assert (sink.events, sink.transactions) == (60, 20)
    assert sink.durable_lsn() == txns[-1].end_lsn


async def write_runs(sink: FileSink, txns: list[Transaction], size: int) -> None:
    enc = encoder()
    await sink.start()
    for start in range(0, len(txns), size):
        part = txns[start : start + size]
        await sink.write_transactions([(t, list(enc.batches(t))) for t in part])


def files(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()}


@pytest.mark.parametrize(
    ("options", "one_table"),
    [({}, False), ({"rollover_rows": 7}, False), ({"rollover_rows": 7}, True)],
    ids=["one-file", "rollover-rows", "rollover-rows-one-table"],
)
async def test_file_sink_run_writes_what_calls_one_by_one_write(
    tmp_path: Path, options: dict[str, Any], one_table: bool
) -> None:
    """With ``rollover_rows`` too: files end after the transaction that reaches it (with one
    table, a run's events are one stretch of that table's folder)."""
    # two tables, messages, updates and deletes; or 3 inserts into one table each
    txns = small(1, 12) if one_table else workload(1, 12, 1000)
    one_by_one = make_sink(tmp_path / "a", **options)
    await one_by_one.start()
    await feed(one_by_one, encoder(), txns)
    await one_by_one.flush()
    if options:
        folder = tmp_path / "a" / ("public.orders" if one_table else "public.items")
        assert len(list(folder.glob("*.jsonl"))) > 3
    runs = make_sink(tmp_path / "b", **options)
    await write_runs(runs, txns, 5)
    await runs.flush()
    assert runs.durable_lsn() == one_by_one.durable_lsn() == txns[-1].end_lsn
    assert files(tmp_path / "b") == files(tmp_path / "a")
    assert runs.events_written == one_by_one.events_written


async def test_file_sink_run_after_a_restart_skips_what_was_published(tmp_path: Path) -> None:
    out = tmp_path / "out"
    txns = workload(1, 12, 1000)
    first = make_sink(out)
    await write_runs(first, txns[:7], 3)
    await first.flush()
    assert first.durable_lsn() == txns[6].end_lsn
    del first  # a crash: the server resends from the confirmed position, in other runs
    second = make_sink(out)
    await write_runs(second, txns[4:], 5)
    await second.flush()
    assert second.durable_lsn() == txns[-1].end_lsn
    assert second.events_skipped > 0
    got = [
        (r["source"]["commit_lsn"], r["source"]["seq"]) for r in spark_read(out / "public.orders")
    ]
    assert got == sorted(set(got)) and len(got) == 12 * 2  # each once: an insert, an update


async def test_file_sink_with_transaction_markers_writes_each_transaction(tmp_path: Path) -> None:
    out = tmp_path / "out"
    txns = workload(1, 4, 1000)
    sink = make_sink(out, transactions=True)
    await write_runs(sink, txns, 4)
    await sink.flush()
    markers = spark_read(out / "_transactions")
    assert [(m["status"], m["commit_lsn"]) for m in markers] == [
        (s, t.commit_lsn) for t in txns for s in ("BEGIN", "END")
    ]


class BufferingSink(MemorySink):
    """A memory sink that reports ``per_event`` bytes buffered for each event written until
    ``drain()``, counting how often it is asked."""

    def __init__(self, per_event: int) -> None:
        super().__init__(MemorySink.Config(), CONTEXT)
        self.per_event = per_event
        self.held = 0
        self.asked = 0

    async def write(self, events: Any) -> None:
        await super().write(events)
        self.held += self.per_event * len(events)

    def buffered_bytes(self) -> int:
        self.asked += 1
        return self.held

    def drain(self) -> None:  # what a background flush or acknowledgement does
        self.held = 0


async def test_the_sinks_buffers_are_summed_again_only_after_a_hand_over_or_while_waiting() -> None:
    txns = small(1, 4)  # 3 events each
    sink = BufferingSink(per_event=10_000)
    limit = sum(t.mem_bytes for t in txns) + 35_000  # room for one transaction's buffers
    writer = Writer(
        [sink], encoder(), ProgressTracker(1), Stats(), memory_limit=limit,
        max_transactions=100,
    )  # fmt: skip
    await sink.start()
    for txn in txns[:2]:  # nothing handed over in between: summed once
        await writer.put(txn)
    assert sink.asked == 1
    running = asyncio.create_task(writer.run())
    while writer.queued_transactions:
        await asyncio.sleep(0)
    assert sink.held == 60_000  # both written, buffered by the sink
    put = asyncio.create_task(writer.put(txns[2]))  # over the limit: waits
    await asyncio.sleep(0.1)
    assert not put.done() and sink.asked >= 3  # looked again while waiting (every 0.02 s)
    sink.drain()
    await asyncio.wait_for(put, 1)
    await writer.put(txns[3])
    writer.close()
    await asyncio.wait_for(running, 5)
    assert [x for x, *_ in sink.transactions] == [t.xid for t in txns]
