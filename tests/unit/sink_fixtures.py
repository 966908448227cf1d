"""Builders for the sink unit tests: Relations, text TupleData and Transactions made directly
from pgoutput events, with no server. Values are converted by the real
:mod:`cdcd.values.types` (the tests use int4 and text columns)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cdcd.assembler.transaction import ChangeRecord, Transaction
from cdcd.decoder.events import (
    KIND_NULL,
    KIND_TEXT,
    KIND_UNCHANGED_TOAST,
    Column,
    Delete,
    Insert,
    Message,
    Relation,
    Truncate,
    TupleData,
    Update,
)
from cdcd.events.catalog import StaticCatalog
from cdcd.events.encoder import Encoder
from cdcd.sinks.base import SinkContext

INT4 = 23
INT8 = 20
TEXT = 25
BOOL = 16


CONTEXT = SinkContext(name="shop", database="shopdb", config_dir=Path("/nonexistent"))
U = object()  # marks an unchanged TOAST value in tup()


def relation(
    name: str = "orders",
    columns: Sequence[tuple[str, int]] = (("id", INT4), ("name", TEXT), ("note", TEXT)),
    key: Sequence[str] = ("id",),
    identity: str = "d",
    schema: str = "public",
    oid: int = 16400,
) -> Relation:
    flags = (lambda n: 1) if identity == "f" else (lambda n: 1 if n in key else 0)
    cols = tuple(Column(flags(n), n, t, -1) for n, t in columns)
    return Relation(None, oid, schema, name, identity, cols)


def tup(*values: Any) -> TupleData:
    """Text TupleData: None -> 'n', U -> 'u', anything else -> its str() as text."""
    kinds = bytearray()
    raw: list[bytes | None] = []
    for v in values:
        if v is None:
            kinds.append(KIND_NULL)
            raw.append(None)
        elif v is U:
            kinds.append(KIND_UNCHANGED_TOAST)
            raw.append(None)
        else:
            kinds.append(KIND_TEXT)
            raw.append(str(v).encode())
    return TupleData(bytes(kinds), tuple(raw))


class TxnBuilder:
    """Collects changes; ``build()`` makes the Transaction. LSNs grow by 8 per change."""

    def __init__(self, xid: int, first_lsn: int, *, origin: str | None = None) -> None:
        self.xid = xid
        self.lsn = first_lsn
        self.records: list[ChangeRecord] = []
        self.origin = origin

    def _add(self, change: Any, relations: tuple[Relation, ...]) -> TxnBuilder:
        self.lsn += 8
        self.records.append(ChangeRecord(self.lsn, change, relations))
        return self

    def insert(self, rel: Relation, new: TupleData) -> TxnBuilder:
        return self._add(Insert(None, rel.oid, new), (rel,))

    def update(
        self, rel: Relation, new: TupleData, old: TupleData | None = None, kind: str | None = None
    ) -> TxnBuilder:
        return self._add(Update(None, rel.oid, kind if old is not None else None, old, new), (rel,))

    def delete(self, rel: Relation, old: TupleData, kind: str = "K") -> TxnBuilder:
        return self._add(Delete(None, rel.oid, kind, old), (rel,))

    def truncate(self, rels: Sequence[Relation], options: int = 0) -> TxnBuilder:
        return self._add(Truncate(None, options, tuple(r.oid for r in rels)), tuple(rels))

    def message(self, prefix: str, content: bytes) -> TxnBuilder:
        self.lsn += 8
        self.records.append(
            ChangeRecord(self.lsn, Message(None, True, self.lsn, prefix, content), ())
        )
        return self

    def build(self) -> Transaction:
        commit_lsn = self.lsn + 8
        return Transaction(
            kind="regular",
            xid=self.xid,
            commit_lsn=commit_lsn,
            end_lsn=commit_lsn + 8,
            commit_time=790_000_000_000_000 + self.xid,
            size=len(self.records),
            origin=self.origin,
            _records=list(self.records),
        )


def standalone_message(lsn: int, prefix: str, content: bytes) -> Transaction:
    msg = Message(None, False, lsn, prefix, content)
    return Transaction(
        kind="message",
        xid=0,
        commit_lsn=lsn - 1,  # as the assembler releases it (cdcd.assembler.assembler)
        end_lsn=lsn,
        commit_time=790_000_000_000_000,
        size=1,
        _records=[ChangeRecord(lsn, msg, ())],
    )


def encoder(
    overrides: dict[tuple[str, str], Sequence[str]] | None = None, clock_ms: int = 1_700_000_000_000
) -> Encoder:
    return Encoder(CONTEXT, StaticCatalog(overrides=overrides), clock=lambda: clock_ms / 1000)
