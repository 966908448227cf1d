"""The null sink: discards everything, durable at once (benchmarks, dry runs).

It takes the decoded changes (``wants_events`` False), so on its own it measures decoding and
assembly: no event objects are built. With ``encode: true`` it takes events and builds each
one's JSON Lines record, so a benchmark can measure decoding and encoding without any I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict

from cdcd.assembler.transaction import ChangeRecord, Transaction
from cdcd.events import ChangeEvent
from cdcd.sinks.base import Sink, SinkContext


class NullSinkConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    encode: bool = False  # build every event's record_json() (measures the encoder)


class NullSink(Sink):
    """Discards events; a transaction is durable as soon as it is committed."""

    type_name = "null"
    Config = NullSinkConfig
    flush_interval = 0.0
    flushes_while_writing = True

    def __init__(self, config: NullSinkConfig, context: SinkContext) -> None:
        super().__init__()
        self.config = config
        self.wants_events = config.encode
        self.writes_json = config.encode
        self.events = 0  # events, or changes when it takes changes
        self.transactions = 0

    async def begin(self, txn: Transaction) -> None:
        pass

    async def write(self, events: Sequence[ChangeEvent]) -> None:
        self.events += len(events)
        if self.config.encode:
            for event in events:
                event.record_json()

    async def write_changes(self, records: Sequence[ChangeRecord]) -> None:
        self.events += len(records)

    async def commit(self, txn: Transaction) -> None:
        self.transactions += 1
        self._mark_durable(txn.end_lsn)

    async def write_transactions(
        self, run: Sequence[tuple[Transaction, Sequence[Sequence[Any]]]]
    ) -> None:
        for _, batches in run:
            for batch in batches:
                if self.config.encode:
                    await self.write(batch)
                else:
                    self.events += len(batch)
        self.transactions += len(run)
        self._mark_durable(run[-1][0].end_lsn)

    async def flush(self) -> None:
        pass

    def stats(self) -> dict[str, Any]:
        return {"events": self.events, "transactions": self.transactions}
