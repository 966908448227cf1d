"""The pgoutput messages, as small frozen events: what the decoder hands to the assembler.

One class per message of "Logical Replication Message Formats" (PostgreSQL docs, protocol
section 55.9 / 54.9).
LSNs are ``int``; timestamps are ``int`` microseconds since the PostgreSQL epoch
(2000-01-01 UTC), converted only at the edges (``cdcd.lsn``).

``xid`` on Relation, Type, Insert, Update, Delete, Truncate and Message is the xid of the
(sub)transaction that made the change, present only inside a Stream Start .. Stream Stop
block (protocol >= 2); outside one it is ``None``.

The classes made once per row or per transaction (TupleData, Insert, Update, Delete, Begin,
Commit) spell out their ``__init__`` (``init=False``): compiled by mypyc (:mod:`cdcd.accel`)
it becomes a native constructor, about nine times faster than the one ``dataclasses``
generates, which stays interpreted. ``object.__setattr__`` (frozen dataclasses' own way to set a field in ``__init__``,
which mypyc turns into a plain store) keeps them frozen either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

# TupleData column kinds, as the byte values found in ``TupleData.kinds``.
KIND_NULL: Final = ord("n")
KIND_UNCHANGED_TOAST: Final = ord("u")
KIND_TEXT: Final = ord("t")
KIND_BINARY: Final = ord("b")


@dataclass(frozen=True, slots=True, init=False)
class TupleData:
    """One row image. ``kinds[i]`` is the column's kind byte (n/u/t/b); ``values[i]`` its raw
    bytes for ``t``/``b`` and ``None`` for ``n``/``u``. Values stay raw: conversion happens
    later, per relation, only when a sink asks for it."""

    kinds: bytes
    values: tuple[bytes | None, ...]

    def __init__(self, kinds: bytes, values: tuple[bytes | None, ...]) -> None:
        object.__setattr__(self, "kinds", kinds)
        object.__setattr__(self, "values", values)

    def __len__(self) -> int:
        return len(self.values)


@dataclass(frozen=True, slots=True)
class Column:
    """A column of a Relation message. ``flags & 1``: part of the replica identity."""

    flags: int
    name: str
    type_oid: int
    typmod: int

    @property
    def is_identity(self) -> bool:
        return bool(self.flags & 1)


# --- transaction framing -------------------------------------------------------------------


@dataclass(frozen=True, slots=True, init=False)
class Begin:
    final_lsn: int
    commit_time: int
    xid: int

    def __init__(self, final_lsn: int, commit_time: int, xid: int) -> None:
        object.__setattr__(self, "final_lsn", final_lsn)
        object.__setattr__(self, "commit_time", commit_time)
        object.__setattr__(self, "xid", xid)


@dataclass(frozen=True, slots=True, init=False)
class Commit:
    flags: int
    commit_lsn: int
    end_lsn: int
    commit_time: int

    def __init__(self, flags: int, commit_lsn: int, end_lsn: int, commit_time: int) -> None:
        object.__setattr__(self, "flags", flags)
        object.__setattr__(self, "commit_lsn", commit_lsn)
        object.__setattr__(self, "end_lsn", end_lsn)
        object.__setattr__(self, "commit_time", commit_time)


@dataclass(frozen=True, slots=True)
class Origin:
    origin_lsn: int
    name: str


# --- catalog ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Relation:
    """A relation's published shape. ``namespace`` is ``""`` for pg_catalog (as on the wire).
    ``replica_identity`` is relreplident: ``d`` default, ``n`` nothing, ``f`` full, ``i`` index."""

    xid: int | None
    oid: int
    namespace: str
    name: str
    replica_identity: str
    columns: tuple[Column, ...]


@dataclass(frozen=True, slots=True)
class Type:
    """Names a non-built-in type by OID (enums, domains, composites, extension types)."""

    xid: int | None
    oid: int
    namespace: str
    name: str


# --- changes ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, init=False)
class Insert:
    xid: int | None
    relation_oid: int
    new: TupleData

    def __init__(self, xid: int | None, relation_oid: int, new: TupleData) -> None:
        object.__setattr__(self, "xid", xid)
        object.__setattr__(self, "relation_oid", relation_oid)
        object.__setattr__(self, "new", new)


@dataclass(frozen=True, slots=True, init=False)
class Update:
    """``old_kind`` is ``"K"`` (old key: a key column changed), ``"O"`` (old row: REPLICA
    IDENTITY FULL) or ``None`` (neither was sent); ``old`` is set exactly when it is not None."""

    xid: int | None
    relation_oid: int
    old_kind: str | None
    old: TupleData | None
    new: TupleData

    def __init__(
        self,
        xid: int | None,
        relation_oid: int,
        old_kind: str | None,
        old: TupleData | None,
        new: TupleData,
    ) -> None:
        object.__setattr__(self, "xid", xid)
        object.__setattr__(self, "relation_oid", relation_oid)
        object.__setattr__(self, "old_kind", old_kind)
        object.__setattr__(self, "old", old)
        object.__setattr__(self, "new", new)


@dataclass(frozen=True, slots=True, init=False)
class Delete:
    """``old_kind`` is ``"K"`` (replica-identity key) or ``"O"`` (whole old row)."""

    xid: int | None
    relation_oid: int
    old_kind: str
    old: TupleData

    def __init__(self, xid: int | None, relation_oid: int, old_kind: str, old: TupleData) -> None:
        object.__setattr__(self, "xid", xid)
        object.__setattr__(self, "relation_oid", relation_oid)
        object.__setattr__(self, "old_kind", old_kind)
        object.__setattr__(self, "old", old)


TRUNCATE_CASCADE: Final = 1
TRUNCATE_RESTART_IDENTITY: Final = 2


@dataclass(frozen=True, slots=True)
class Truncate:
    xid: int | None
    options: int
    relation_oids: tuple[int, ...]

    @property
    def cascade(self) -> bool:
        return bool(self.options & TRUNCATE_CASCADE)

    @property
    def restart_identity(self) -> bool:
        return bool(self.options & TRUNCATE_RESTART_IDENTITY)


@dataclass(frozen=True, slots=True)
class Message:
    """A logical decoding message (pg_logical_emit_message)."""

    xid: int | None
    transactional: bool
    lsn: int
    prefix: str
    content: bytes


# --- streaming (protocol >= 2) ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class StreamStart:
    xid: int
    first_segment: bool


@dataclass(frozen=True, slots=True)
class StreamStop:
    pass


@dataclass(frozen=True, slots=True)
class StreamCommit:
    xid: int
    flags: int
    commit_lsn: int
    end_lsn: int
    commit_time: int


@dataclass(frozen=True, slots=True)
class StreamAbort:
    """``subxid == xid`` aborts the whole transaction; otherwise only that subtransaction and
    the subtransactions that began after it. ``abort_lsn``/``abort_time`` only with protocol 4
    and ``streaming = parallel``."""

    xid: int
    subxid: int
    abort_lsn: int | None = None
    abort_time: int | None = None


# --- two-phase commit (protocol >= 3) ---------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BeginPrepare:
    prepare_lsn: int
    end_lsn: int
    prepare_time: int
    xid: int
    gid: str


@dataclass(frozen=True, slots=True)
class Prepare:
    flags: int
    prepare_lsn: int
    end_lsn: int
    prepare_time: int
    xid: int
    gid: str


@dataclass(frozen=True, slots=True)
class CommitPrepared:
    flags: int
    commit_lsn: int
    end_lsn: int
    commit_time: int
    xid: int
    gid: str


@dataclass(frozen=True, slots=True)
class RollbackPrepared:
    flags: int
    prepare_end_lsn: int
    rollback_end_lsn: int
    prepare_time: int
    rollback_time: int
    xid: int
    gid: str


@dataclass(frozen=True, slots=True)
class StreamPrepare:
    flags: int
    prepare_lsn: int
    end_lsn: int
    prepare_time: int
    xid: int
    gid: str


Change = Insert | Update | Delete | Truncate | Message

PgOutputMessage = (
    Begin
    | Commit
    | Origin
    | Relation
    | Type
    | Insert
    | Update
    | Delete
    | Truncate
    | Message
    | StreamStart
    | StreamStop
    | StreamCommit
    | StreamAbort
    | BeginPrepare
    | Prepare
    | CommitPrepared
    | RollbackPrepared
    | StreamPrepare
)
