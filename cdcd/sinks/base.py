"""The sink contract: how committed transactions leave cdcd.

``docs/sinks.md`` is the full description, with an example a third party can copy; in short:

* Delivery is **at-least-once**: after a crash PostgreSQL resends every transaction whose end LSN
  was not confirmed. Every event carries its unique, totally ordered position
  ``(commit_lsn, seq)``; a sink skips what it already holds (the file sinks) or publishes the
  duplicate with the same position (Kafka).
* Each sink runs in its own task, one transaction at a time, in commit order: ``begin(txn)``,
  ``write(batch)`` for each batch of at most 1,000 events, ``commit(txn)``; ``flush()`` when its
  ``flush_interval`` has passed; ``close()`` at the end. A transaction handed over while it
  arrives comes in parts: ``begin`` gets the first (``end_lsn`` 0, not known yet), ``commit``
  the last, which carries the end LSN (``Transaction.begins``/``ends``).
* ``durable_lsn()`` is the end LSN of the newest transaction whose every event the sink holds
  durably, and never decreases (``_mark_durable``). The LSN confirmed to PostgreSQL is the
  minimum over all sinks: a sink must never report a transaction before it is durable.
* :class:`~cdcd.errors.TransientSinkError` from any method: the pipeline calls that method again
  with the same arguments after a backoff (so a method raising it took nothing of the call).
  Anything else stops cdcd.
* Memory: ``buffered_bytes()`` is what the sink holds in memory of events handed to it and
  not yet written out or acknowledged; the writer counts it with its queued transactions
  against ``buffer.memory_limit`` and holds reading back meanwhile. ``memory_budget`` (set by
  the writer before the first transaction: a share of the limit) is what the sink should keep
  its own buffers within, even inside one huge transaction.
* ``writes_json = True`` says the sink writes events' JSON (``record_json``, ``key_json`` or
  ``value_json``): the pipeline then renders the rows of streamed transactions while they
  arrive, so that less is left to do at their Stream Commit (docs/assembler.md).
* Optional fast paths: ``wants_events = False`` and ``write_changes`` take decoded changes
  instead of events (the null sink, which measures decoding alone); ``write_transactions``
  takes a run of small, whole transactions in one call (the pipeline calls it only where a sink
  overrides it; otherwise it calls ``begin``, ``write`` and ``commit`` for each).

Sinks are chosen by ``type`` in the config: built-in and third-party classes register under the
``cdcd.sinks`` entry-point group (:mod:`cdcd.sinks.registry`). A sink class has a pydantic model
``Config`` (``extra="forbid"``; the ``type`` key is removed before validation) and is built as
``cls(config: cls.Config, context: SinkContext)``.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel

from cdcd.assembler.transaction import ChangeRecord, Transaction
from cdcd.events.context import SinkContext
from cdcd.lsn import Progress

if TYPE_CHECKING:
    from cdcd.events import ChangeEvent

__all__ = ["ChangeRecord", "Sink", "SinkContext", "Transaction", "run_events"]


def run_events(
    run: Sequence[tuple[Transaction, Sequence[Sequence[ChangeEvent]]]],
) -> list[ChangeEvent]:
    """The events of a run of transactions (``Sink.write_transactions``), in order, in one list."""
    events: list[ChangeEvent] = []
    for _, batches in run:
        for batch in batches:
            events += batch
    return events


class Sink(abc.ABC):
    """Base class of every sink. Subclasses implement the abstract methods."""

    #: short name for logs and metrics, e.g. ``"file"`` or ``"kafka"``
    type_name: str = "sink"
    #: the pydantic model of this sink's config section (without ``type``)
    Config: ClassVar[type[BaseModel]]
    #: False: the sink takes decoded changes (``write_changes``) rather than events
    wants_events: bool = True
    #: True: the sink writes the events' JSON (``record_json``, ``key_json``, ``value_json``),
    #: so rendering streamed transactions' rows on arrival serves it
    writes_json: bool = False
    #: seconds the pipeline lets pass between two flushes while something is not durable
    #: (0: flush whenever the sink has nothing more to do)
    flush_interval: float = 1.0
    #: True: the sink makes data durable on its own schedule (``durable_lsn`` rises without
    #: ``flush``); the pipeline then flushes it only after a quiet moment, as a safety net
    flushes_itself: bool = False
    #: True: ``flush`` may run while more is written (it makes durable what was handed before
    #: it began); the initial snapshot then flushes in the background (docs/snapshots.md)
    flushes_while_writing: bool = False

    #: bytes the sink should keep its own buffers within: a share of ``buffer.memory_limit``,
    #: set by the writer before the first transaction (None: no bound given)
    memory_budget: int | None = None
    #: called each time ``durable_lsn`` moves (set by the pipeline when it wants to know at
    #: once, e.g. the benchmark's latency log; None: nobody is told)
    durable_listener: Callable[[], None] | None = None

    def __init__(self, config: Any = None, context: SinkContext | None = None) -> None:
        """Subclasses are built as ``cls(config, context)`` and call ``super().__init__()``."""
        self._durable = Progress()

    async def start(self) -> None:  # noqa: B027 - optional hook
        """Open connections and files; recover what a previous run left behind."""

    @abc.abstractmethod
    async def begin(self, txn: Transaction) -> None:
        """A new committed transaction starts; its events follow through ``write``."""

    @abc.abstractmethod
    async def write(self, events: Sequence[ChangeEvent]) -> None:
        """Events of the current transaction, in ``seq`` order."""

    async def write_changes(self, records: Sequence[ChangeRecord]) -> None:
        """Decoded changes of the current transaction, in order (only if not ``wants_events``)."""
        raise NotImplementedError(f"{type(self).__name__} takes events, not changes")

    @abc.abstractmethod
    async def commit(self, txn: Transaction) -> None:
        """The current transaction has been handed over completely."""

    async def write_transactions(
        self, run: Sequence[tuple[Transaction, Sequence[Sequence[Any]]]]
    ) -> None:
        """Whole transactions in commit order, each with its batches (of events, or of decoded
        changes when not ``wants_events``): what ``begin``, ``write`` (``write_changes``) for
        each batch and ``commit`` do for each of them, which is what this default does. The
        pipeline hands runs of small transactions to a sink that overrides it, so that the
        per-call work is done once per run (docs/sinks.md, "Runs of small transactions").
        An override may make the run durable in one piece (``durable_lsn`` moving from before
        the run to its last end LSN), and like any method, may raise ``TransientSinkError``
        only when it took nothing of the call."""
        write = self.write if self.wants_events else self.write_changes
        for txn, batches in run:
            await self.begin(txn)
            for batch in batches:
                await write(batch)
            await self.commit(txn)

    @abc.abstractmethod
    async def flush(self) -> None:
        """Make everything handed over so far durable; ``durable_lsn`` covers it afterwards."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources. Does not imply ``flush``: the pipeline flushes first when draining."""

    @classmethod
    def directories(cls, config: Any) -> dict[str, Path]:
        """The local directories a sink with this ``config`` writes into, by config key:
        ``cdcd check`` and ``cdcd run`` make sure they are writable first. None by default."""
        return {}

    @classmethod
    def preflight(cls, config: Any, key: str) -> str | None:
        """Check, before cdcd creates anything on the source (``cdcd run``, ``cdcd check``),
        what a sink with this ``config`` needs and can check without the stream, such as an
        object store's bucket. Raise a :class:`~cdcd.errors.CdcdError` whose message starts
        with ``key`` (the sink's config key, ``sinks[0]``) or a key under it; return what was
        checked, for ``cdcd check``'s report, or None when there is nothing to check."""
        return None

    def durable_lsn(self) -> int:
        """End LSN of the newest transaction this sink holds durably (never decreases)."""
        return self._durable.value

    def _mark_durable(self, end_lsn: int) -> None:
        if self._durable.advance(end_lsn) and self.durable_listener is not None:
            self.durable_listener()

    def buffered_bytes(self) -> int:
        """Bytes of handed-over events the sink holds in memory, not yet written out or
        acknowledged (an estimate is fine); counted against ``buffer.memory_limit``. 0 unless
        a sink buffers."""
        return 0

    def stats(self) -> dict[str, Any]:
        """Numbers for metrics and logs (optional)."""
        return {}
