"""Subtransactions of a streamed transaction, and Stream Abort of one (docs/assembler.md).

A subtransaction's first change (or Relation, or Type message) in a streamed transaction is
recorded as a :class:`Subxact`: how many changes and spooled items came before it, and, once the
transaction is in spill format, the offset of its first change in the stream. ``Stream
Abort(xid, subxid)`` drops that subtransaction and every one that first appeared after it, as
PostgreSQL's apply worker truncates its spool file (``src/backend/replication/logical/worker.c``,
``stream_abort_internal``). Not compiled: it runs once per aborted subtransaction.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from cdcd.assembler.sizes import record_size

if TYPE_CHECKING:
    from cdcd.assembler.spill import SpillFile
    from cdcd.assembler.transaction import ChangeRecord
    from cdcd.decoder.events import Relation


@dataclass(slots=True)
class Subxact:
    """Where a subtransaction first appeared in a streamed transaction."""

    xid: int
    index: int  # changes buffered before it
    seq: int  # spooled items (changes, Relation and Type messages) before it
    offset: int | None  # spill stream offset of its first change, once in spill format


class Buffer(Protocol):
    """What an abort changes of a streamed transaction's buffer (the assembler's ``_Buffer``)."""

    records: list[ChangeRecord]
    raws: list[bytes | None]
    count: int
    mem_bytes: int
    spill: SpillFile | None
    subxacts: list[Subxact]
    subxact_ids: set[int]
    overlay: dict[int, Relation]
    rel_log: list[tuple[int, Relation]]


def abort_subxact(buf: Buffer, subxid: int) -> int:
    """Drop subtransaction ``subxid`` of ``buf`` and those that first appeared after it; return
    the accounted bytes of memory this frees (0 when it made no change that was streamed)."""
    position = next((i for i, s in enumerate(buf.subxacts) if s.xid == subxid), None)
    if position is None:
        return 0  # the subtransaction made no change that was streamed
    sub = buf.subxacts[position]
    for later in buf.subxacts[position:]:
        buf.subxact_ids.discard(later.xid)
    del buf.subxacts[position:]
    dropped = 0
    if buf.spill is not None:
        assert sub.offset is not None, "a subtransaction in spill format has an offset"
        buf.spill.truncate(sub.offset)
        if buf.spill.in_memory:
            dropped = buf.mem_bytes - buf.spill.tell()
    else:
        dropped = sum(
            record_size(r.change, raw)
            for r, raw in zip(buf.records[sub.index :], buf.raws[sub.index :], strict=True)
        )
        del buf.records[sub.index :]
        del buf.raws[sub.index :]
    buf.mem_bytes -= dropped
    buf.count = sub.index
    if buf.rel_log and buf.rel_log[-1][0] >= sub.seq:
        buf.rel_log = [(seq, rel) for seq, rel in buf.rel_log if seq < sub.seq]
        buf.overlay = {rel.oid: rel for _, rel in buf.rel_log}
    return dropped
