"""What an initial snapshot has handed to the sinks, table by table, so that an interruption
costs only what was not durable yet (docs/snapshots.md, "Interrupted").

The writer of :mod:`cdcd.snapshot.initial` tells :class:`InitialProgress` each batch it hands
over and each table it finishes. Every ``every // 2`` rows handed, a record starts: the sinks
flush, and once that is done, the state file (:meth:`cdcd.source.snapshot.SnapshotState.progress`)
says, per table, ``done``, or how many rows and, for a table read in key order, the key of the
last one: every row of the table up to that key is durable. When ``every`` rows are handed but
not durable, the writer waits for the record under way: a kill emits at most that many rows
again (and one batch). A table is never recorded by block range: a row updated after the
snapshot's point can move to a block already read, so only a key says what is done.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from cdcd.decoder.events import TupleData


class InitialProgress:
    """``keys``: for each table read in key order (``schema.name``), the indexes of its key
    columns in its rows, in key order."""

    def __init__(self, keys: dict[str, list[int]], every: int) -> None:
        self.keys = keys
        self.every = max(every, 2)
        self.handed = 0  # rows handed to the sinks so far
        self.started = 0  # ``handed`` when the last record started
        self.durable = 0  # ``handed`` as of the last record done: every sink holds those
        self._tables: dict[str, dict[str, Any]] = {}
        self._last: dict[str, Sequence[TupleData]] = {}  # each running table's last batch

    def hand(self, name: str, rows: Sequence[TupleData]) -> None:
        """The writer handed ``rows`` of table ``name`` to every sink."""
        entry = self._tables.setdefault(name, {"status": "running", "last_key": None, "rows": 0})
        entry["rows"] += len(rows)
        self.handed += len(rows)
        if rows and name in self.keys:
            self._last[name] = rows

    def finish(self, name: str) -> None:
        """Every row of table ``name`` is handed."""
        entry = self._tables.get(name)
        self._tables[name] = {"status": "done", "rows": entry["rows"] if entry else 0}
        self._last.pop(name, None)

    def due(self) -> bool:
        """Whether a record should start (half of ``every`` handed since the last one)."""
        return self.handed - self.started >= self.every // 2

    def must_wait(self) -> bool:
        """Whether ``every`` rows are handed but not durable: the writer waits."""
        return self.handed - self.durable >= self.every

    def take(self) -> tuple[int, dict[str, dict[str, Any]]]:
        """A record starting now: the rows handed, and each table's entry for the state file."""
        self.started = self.handed
        for name, rows in self._last.items():  # only the last line is parsed
            values = rows[-1].values
            self._tables[name]["last_key"] = [
                None if (v := values[i]) is None else bytes(v).decode() for i in self.keys[name]
            ]
        self._last.clear()
        return self.handed, {name: dict(entry) for name, entry in self._tables.items()}

    def recorded(self, handed: int) -> None:
        """The record taken at ``handed`` rows is durable (sinks flushed, state written)."""
        self.durable = max(self.durable, handed)


def key_indexes(columns: Sequence[str], keys: Sequence[tuple[str, str]]) -> list[int]:
    """Where each key column (``(name, type)``, in key order) is among ``columns``."""
    return [list(columns).index(name) for name, _ in keys]
