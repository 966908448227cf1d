"""The memory of the transactions being assembled, accounted and bounded (docs/assembler.md,
"Memory").

:class:`Memory` keeps the accounted bytes of every buffer held in memory, moves a buffer to the
compact form once it passes ``compact_bytes``, moves the largest buffers to spill files while the
total is over ``limit``, and turns a buffer into the :class:`Transaction` (or part) it releases,
or drops it. What a change is accounted is :mod:`cdcd.assembler.sizes`; the spill format is
:mod:`cdcd.assembler.spill`.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from pathlib import Path

from cdcd.assembler.buffer import TxnBuffer
from cdcd.assembler.spill import SPILL_PREFIX, SPILL_SUFFIX, compact, remove_stale
from cdcd.assembler.transaction import Transaction, TransactionKind

__all__ = ["Memory"]


class Memory:
    """Accounted bytes of the buffers held in memory (:attr:`buffered`), and what moves them.
    With ``spill_dir`` None nothing spills (unbounded; for tests); stale spill files in it are
    deleted at construction."""

    __slots__ = (
        "_file_numbers",
        "buffered",
        "compact_bytes",
        "limit",
        "spill_count",
        "spill_dir",
        "total_spilled_bytes",
    )

    def __init__(self, limit: int, spill_dir: Path | None, compact_bytes: int) -> None:
        self.limit = limit
        self.spill_dir = spill_dir
        self.compact_bytes = compact_bytes
        self.buffered = 0
        self._file_numbers = itertools.count(1)
        #: Spill events, and the size of the spill files closed (released or dropped).
        self.spill_count = 0
        self.total_spilled_bytes = 0
        if spill_dir is not None:
            spill_dir.mkdir(parents=True, exist_ok=True)
            remove_stale(spill_dir)

    def grow(self, buf: TxnBuffer, size: int) -> bool:
        """Account ``size`` more bytes to ``buf`` held in memory, compact it if it passed
        ``compact_bytes``; return whether the total is now over the limit with somewhere to
        spill (then :meth:`spill_until_under`)."""
        buf.mem_bytes += size
        self.buffered += size
        if buf.spill is None and buf.mem_bytes > self.compact_bytes and not buf.parting:
            self.compact(buf)
        return self.buffered > self.limit and self.spill_dir is not None

    def spill_until_under(self, buffers: Iterable[TxnBuffer]) -> None:
        """Move the largest of ``buffers`` to spill files until the total is under the limit."""
        spill_dir = self.spill_dir
        assert spill_dir is not None
        candidates = list(buffers)
        while self.buffered > self.limit:
            largest = max(candidates, key=lambda b: b.mem_bytes, default=None)
            if largest is None or largest.mem_bytes == 0:
                return
            self._spill(largest, spill_dir)

    def _spill(self, buf: TxnBuffer, spill_dir: Path) -> None:
        """Move ``buf`` to a new spill file; it holds no accounted memory afterwards."""
        if buf.spill is None:
            self.compact(buf)
        spill = buf.spill
        assert spill is not None and spill.in_memory
        spill.move_to(spill_dir / f"{SPILL_PREFIX}{next(self._file_numbers)}{SPILL_SUFFIX}")
        self.buffered -= buf.mem_bytes
        buf.mem_bytes = 0
        self.spill_count += 1

    def compact(self, buf: TxnBuffer) -> None:
        """Move ``buf``'s decoded records into a spill stream held in memory."""
        pending = [sub for sub in buf.subxacts if sub.offset is None]
        spill, offsets = compact(buf.records, buf.raws, [sub.index for sub in pending])
        for sub, offset in zip(pending, offsets, strict=True):
            sub.offset = offset
        buf.spill = spill
        self.buffered += spill.tell() - buf.mem_bytes
        buf.mem_bytes = spill.tell()
        buf.records = []
        buf.raws = []

    def discard(self, buf: TxnBuffer) -> None:
        """Drop ``buf`` (aborted, rolled back, or resent after a reconnect)."""
        self.buffered -= buf.mem_bytes
        buf.mem_bytes = 0
        buf.records = []
        buf.raws = []
        if buf.spill is not None:
            if not buf.spill.in_memory:
                self.total_spilled_bytes += buf.spill.size
            buf.spill.delete()
            buf.spill = None

    def release(
        self,
        buf: TxnBuffer,
        kind: TransactionKind,
        commit_lsn: int,
        end_lsn: int,
        commit_time: int,
    ) -> Transaction:
        """``buf`` as the :class:`Transaction` it releases (its memory goes with it)."""
        self.buffered -= buf.mem_bytes
        # positional (kind, xid, commit_lsn, end_lsn, commit_time, size, origin, origin_lsn,
        # gid, mem_bytes, begins): keywords double what a compiled class's constructor costs
        txn = Transaction(
            kind,
            buf.xid,
            commit_lsn,
            end_lsn,
            commit_time,
            buf.count - buf.parted,
            buf.origin,
            buf.origin_lsn,
            buf.gid or None,
            0,
            buf.parted == 0,
        )
        spill = buf.spill
        if spill is None:
            txn.mem_bytes = buf.mem_bytes
            txn._records = buf.records
            buf.raws = []  # needed only while the transaction might still spill
        else:
            spill.finish()
            if spill.in_memory:
                txn.mem_bytes = buf.mem_bytes
            else:
                self.total_spilled_bytes += spill.size
            txn._reader = spill.reader()
            txn._drain = spill.draining_reader()
            txn._on_release = spill.delete
        return txn

    def release_part(self, buf: TxnBuffer) -> Transaction:
        """The changes buffered so far of the regular transaction ``buf`` (decoded records: a
        parting buffer never compacts, and one that spilled holds no memory), as a part."""
        part = self.release(buf, "regular", buf.final_lsn, 0, buf.commit_time)
        part.ends = False
        buf.parted, buf.mem_bytes, buf.records, buf.raws = buf.count, 0, [], []
        return part
