"""One transaction being assembled (:class:`TxnBuffer`), and how its changes are counted.

A buffer holds its changes as decoded records, or (once large) in spill format: in memory (the
compact form) or in a spill file (:mod:`cdcd.assembler.memory` moves it). A streamed
transaction's buffer also records its subtransactions (:mod:`cdcd.assembler.subxacts`) and the
Relations streamed with it.
"""

from __future__ import annotations

from typing import Literal

from cdcd.assembler.spill import SpillFile
from cdcd.assembler.subxacts import Subxact
from cdcd.assembler.transaction import ChangeRecord
from cdcd.decoder.events import Relation

__all__ = ["BufferKind", "TxnBuffer"]

BufferKind = Literal["regular", "prepare", "stream"]


class TxnBuffer:
    """One transaction being assembled: as decoded records, or (once large) in spill format,
    in memory (compact) or in a spill file."""

    __slots__ = (
        "commit_time",
        "count",
        "final_lsn",
        "first_lsn",
        "gid",
        "kind",
        "mem_bytes",
        "origin",
        "origin_lsn",
        "overlay",
        "parted",
        "parting",
        "raws",
        "records",
        "rel_log",
        "seq",
        "spill",
        "subxact_ids",
        "subxacts",
        "xid",
    )

    def __init__(
        self, kind: BufferKind, xid: int, first_lsn: int, *, final_lsn: int = 0, gid: str = ""
    ) -> None:
        self.kind = kind
        self.xid = xid
        self.first_lsn = first_lsn
        self.final_lsn = final_lsn  # Begin's final LSN, Begin Prepare's prepare LSN
        self.commit_time = 0  # Begin's (regular transactions)
        self.gid = gid
        # Regular transactions only: released in parts while they arrive (docs/assembler.md)
        self.parting = False
        self.parted = 0  # changes released in earlier parts
        self.records: list[ChangeRecord] = []
        # the pgoutput bytes of each record, when fed with them (None otherwise): a record
        # moved to a spill file is written as those bytes; dropped once released
        self.raws: list[bytes | None] = []
        self.count = 0
        self.mem_bytes = 0
        self.spill: SpillFile | None = None
        self.origin: str | None = None
        self.origin_lsn: int | None = None
        # Streamed transactions only: subtransactions, and the Relations streamed with them.
        self.seq = 0
        self.subxacts: list[Subxact] = []
        self.subxact_ids: set[int] = set()
        self.overlay: dict[int, Relation] = {}
        self.rel_log: list[tuple[int, Relation]] = []

    def count_change(self, xid: int | None) -> None:
        """One more change (and, streamed, one more in the subtransaction ``xid``)."""
        if self.kind == "stream":
            self.note_subxact(xid)
            self.seq += 1
        self.count += 1

    def spool_catalog(self, xid: int | None) -> None:
        """A Relation or Type message inside a stream block: spooled, like a change."""
        self.note_subxact(xid)
        self.seq += 1

    def note_subxact(self, xid: int | None) -> None:
        if xid is None or xid == self.xid or xid in self.subxact_ids:
            return
        offset = self.spill.tell() if self.spill is not None else None
        self.subxacts.append(Subxact(xid, self.count, self.seq, offset))
        self.subxact_ids.add(xid)
