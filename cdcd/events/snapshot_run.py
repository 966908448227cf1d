"""A batch of a snapshot's rows as their op ``r`` events, made only when asked for.

:meth:`cdcd.events.encoder.Encoder.snapshot_run` returns one per batch of rows read by the
initial snapshot. It is a sequence of :class:`~cdcd.events.change_event.ChangeEvent` like any
batch a sink is handed, with the events made on access (one by index; all of them, once, by
iterating or slicing), and a shortcut for the JSON Lines file writer: :meth:`SnapshotRun.jsonl`,
every event's record in one call of ``cdcd._rowjson.snapshot_lines`` without making an event,
or of ``copy_snapshot_lines`` from the COPY text of a :class:`~cdcd.decoder.copy_batch.CopyBatch`
without parsing it into rows (docs/development.md). All give the same bytes
(tests/unit/test_snapshot_run.py).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, overload

from cdcd.decoder.copy_batch import CopyBatch
from cdcd.events.change_event import ChangeEvent, RelInfo, TxnInfo
from cdcd.events.envelope import ROW

if TYPE_CHECKING:
    from cdcd.decoder.events import TupleData

__all__ = ["SnapshotRun"]


class SnapshotRun(Sequence[ChangeEvent]):
    """The events of ``rows`` (one table): event i has ``seq`` ``first_seq + i``; the row at
    ``final`` (-1: none) is marked ``snapshot: "last"``."""

    __slots__ = ("_events", "commit_lsn", "final", "first_seq", "info", "rel", "rows", "ts_ms")

    def __init__(
        self,
        rel: RelInfo,
        info: TxnInfo,
        rows: Sequence[TupleData],
        commit_lsn: int,
        first_seq: int,
        ts_ms: int,
        final: int,
    ) -> None:
        self.rel = rel
        self.info = info
        self.rows = rows
        self.commit_lsn = commit_lsn
        self.first_seq = first_seq
        self.ts_ms = ts_ms
        self.final = final
        self._events: list[ChangeEvent] | None = None

    def _event(self, index: int) -> ChangeEvent:
        commit_lsn = self.commit_lsn
        return ChangeEvent(
            "r",
            self.rel,
            self.info,
            commit_lsn,
            self.first_seq + index,
            index + 1,
            commit_lsn if index else None,
            self.ts_ms,
            None,
            self.rows[index],
            None,
            None,
            "last" if index == self.final else "true",
        )  # positional: keywords cost a native constructor more than the event itself

    def events(self) -> list[ChangeEvent]:
        """Every event, made once."""
        events = self._events
        if events is None:
            events = self._events = [self._event(i) for i in range(len(self.rows))]
        return events

    def __len__(self) -> int:
        return len(self.rows)

    @overload
    def __getitem__(self, index: int) -> ChangeEvent: ...

    @overload
    def __getitem__(self, index: slice) -> list[ChangeEvent]: ...

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice) or self._events is not None:
            return self.events()[index]
        count = len(self.rows)
        if not -count <= index < count:
            raise IndexError("snapshot run index out of range")
        return self._event(index % count)

    def __iter__(self) -> Iterator[ChangeEvent]:
        return iter(self.events())

    def jsonl(self) -> list[bytes] | None:
        """Every event's ``record_json()`` followed by a newline, in pieces of about 64 KiB to
        write one after the other (a record may span two; pieces that size are reused from
        the heap, where one large piece per batch was mapped and faulted in afresh), made from
        the rows without making the events; None where cdcd._rowjson is not in use, or a row
        needs the events' general path (an error then surfaces from there, naming the
        column)."""
        rel = self.rel
        info = self.info
        if self._events is not None or info.txid is not None:
            return None
        rows = self.rows
        dec = rel.decoder(False)
        key_idx = rel.key_idx if rel.key_names is not None else None
        head, last_head = info.source_head(rel, "true"), info.source_head(rel, "last")
        fixed = (self.final, self.commit_lsn, self.first_seq, self.ts_ms, info.origin_json, ROW)
        if isinstance(rows, CopyBatch) and not rows.parsed:  # from COPY's text, not parsed
            return dec.snapshot_lines(
                rows.text, True, key_idx, rel.key_prefixes, head, last_head, *fixed
            )
        batch = rows if isinstance(rows, list) else list(rows)
        return dec.snapshot_lines(batch, False, key_idx, rel.key_prefixes, head, last_head, *fixed)
