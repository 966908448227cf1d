"""The memory sink: keeps every event's value in a list (tests and embedding).

``values`` holds each event's value dict (docs/events.md), ``keys`` the matching key dicts (or
None), ``events`` the ChangeEvent objects, ``transactions`` the ``(xid, commit_lsn, end_lsn,
event_count)`` of every committed transaction. A transaction is durable as soon as it is
committed. Values are built in ``write``, while the transaction's rows are still held.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict

from cdcd.assembler.transaction import Transaction
from cdcd.events import ChangeEvent
from cdcd.sinks.base import Sink, SinkContext


class MemorySinkConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")


class MemorySink(Sink):
    """Collects events in memory; durable at commit."""

    type_name = "memory"
    Config = MemorySinkConfig
    flush_interval = 0.0

    def __init__(self, config: MemorySinkConfig, context: SinkContext) -> None:
        super().__init__()
        self.config = config
        self.context = context
        self.values: list[dict[str, Any]] = []
        self.keys: list[dict[str, Any] | None] = []
        self.events: list[ChangeEvent] = []
        self.transactions: list[tuple[int, int, int, int]] = []
        self._current = 0

    async def begin(self, txn: Transaction) -> None:
        self._current = 0

    async def write(self, events: Sequence[ChangeEvent]) -> None:
        for event in events:
            self.values.append(event.value())
            self.keys.append(event.key())
        self.events.extend(events)
        self._current += len(events)

    async def commit(self, txn: Transaction) -> None:
        self.transactions.append((txn.xid, txn.commit_lsn, txn.end_lsn, self._current))
        self._mark_durable(txn.end_lsn)

    async def flush(self) -> None:
        pass

    def positions(self) -> list[tuple[int, int]]:
        """``(commit_lsn, seq)`` of every event received, in order."""
        return [event.position for event in self.events]

    def stats(self) -> dict[str, Any]:
        return {"events": len(self.events), "transactions": len(self.transactions)}
