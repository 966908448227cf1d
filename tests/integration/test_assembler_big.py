"""A 500,000-row transaction through the assembler with an 8 MiB memory limit.

No server needed: the events are generated. Asserts that the transaction spilled, that every
change comes back in order, that the assembler's accounted memory never passed the limit by
more than one change, and that the process's resident memory (sampled from /proc every 1024
rows) grows by a bounded amount instead of with the transaction: held in memory, these
500,000 records would take about 200 MB, three times the bound. A memory assertion, not a
timing one.

tracemalloc would measure allocations more precisely but slows this loop tenfold (about
70 us instead of 6 us per row); ``test_traced_memory_of_a_spilled_transaction`` runs it on a
smaller transaction instead.
"""

from __future__ import annotations

import os
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest

from cdcd.assembler.assembler import Assembler, change_size
from cdcd.assembler.spill import SPILL_PREFIX
from cdcd.decoder.events import Begin, Column, Commit, Insert, Relation, TupleData

pytestmark = pytest.mark.slow

LIMIT = 8 << 20
GROWTH_BOUND = 64 << 20
PAYLOAD = b"p" * 40
KINDS = b"ttn"
REL = Relation(
    None,
    16384,
    "public",
    "big",
    "d",
    (Column(1, "id", 20, -1), Column(0, "payload", 25, -1), Column(0, "note", 25, -1)),
)
FIRST_LSN = 0x10_0000_0000
PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * PAGE


def run(rows: int, spill_dir: Path, measure: Callable[[], int]) -> dict[str, int]:
    """Feed a ``rows``-row transaction, read it back; return the figures the tests check.
    ``measure()`` is sampled every 1024 rows and its largest value reported."""
    asm = Assembler(memory_limit=LIMIT, spill_dir=spill_dir)
    final_lsn = FIRST_LSN + 16 * (rows + 1)
    feed = asm.feed
    base = measure()
    feed_peak = read_peak = base
    feed(REL, FIRST_LSN)
    feed(Begin(final_lsn, 0, 4242), FIRST_LSN)
    max_buffered = 0
    for i in range(rows):
        feed(
            Insert(None, REL.oid, TupleData(KINDS, (str(i).encode(), PAYLOAD, None))),
            FIRST_LSN + 16 * (i + 1),
        )
        if i & 1023 == 0:
            max_buffered = max(max_buffered, asm.buffered_bytes)
            feed_peak = max(feed_peak, measure())
    spilled = asm.spilled_bytes
    txn = feed(Commit(0, final_lsn, final_lsn + 8, 0), final_lsn)
    assert txn is not None
    assert len(list(spill_dir.glob(f"{SPILL_PREFIX}*"))) == 1

    count = 0
    expected_lsn = FIRST_LSN + 16
    for record in txn.changes():
        change = record.change
        assert isinstance(change, Insert)
        assert record.lsn == expected_lsn
        assert change.new.values[0] == str(count).encode()
        assert record.relations == (REL,)
        expected_lsn += 16
        count += 1
        if count & 1023 == 0:
            read_peak = max(read_peak, measure())
    assert count == rows == txn.size
    txn.release()
    assert list(spill_dir.iterdir()) == []
    return {
        "spill_count": asm.spill_count,
        "spilled": spilled,
        "max_buffered": max_buffered,
        "feed_growth": feed_peak - base,
        "read_growth": read_peak - base,
    }


def report(name: str, rows: int, figures: dict[str, int]) -> None:
    mib = {k: f"{v / 2**20:.1f} MiB" for k, v in figures.items() if k != "spill_count"}
    print(f"\n{name}: rows={rows} limit={LIMIT >> 20} MiB {mib}")


def test_half_a_million_row_transaction_spills_within_bounds(tmp_path: Path) -> None:
    rows = 500_000
    one_change = change_size(Insert(None, REL.oid, TupleData(KINDS, (b"500000", PAYLOAD, None))))
    figures = run(rows, tmp_path, rss)
    report("rss", rows, figures)
    assert figures["spill_count"] >= 1 and figures["spilled"] > 0
    assert figures["max_buffered"] <= LIMIT + one_change
    assert figures["feed_growth"] < GROWTH_BOUND
    assert figures["read_growth"] < GROWTH_BOUND


def test_traced_memory_of_a_spilled_transaction(tmp_path: Path) -> None:
    rows = 100_000  # about 40 MB if it were all held in memory
    tracemalloc.start()
    try:
        figures = run(rows, tmp_path, lambda: tracemalloc.get_traced_memory()[0])
    finally:
        tracemalloc.stop()
    report("tracemalloc", rows, figures)
    assert figures["spill_count"] >= 1
    # The 8 MiB of accounted records, the 1 MiB write buffer and the Python overhead the
    # estimate leaves out; without spilling this would be about 40 MB.
    assert figures["feed_growth"] < 16 << 20
    assert figures["read_growth"] < 4 << 20
