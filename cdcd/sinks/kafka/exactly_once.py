"""The Kafka sink's exactly-once mode (``exactly_once: true``, docs/kafka.md): what it adds to
the hand-over of :mod:`cdcd.sinks.kafka.sender`.

The producer is transactional (``transactional_id``). A commit ends the open Kafka transaction
with one more record, cdcd's position (:mod:`cdcd.sinks.kafka.position`) on the position topic:
the records added so far and the position become visible to read_committed consumers at once.
Only that commit releases the window: the source transactions it completes become durable
then, and no earlier. A commit begins in the background at the end of a source transaction
once ``commit_interval`` passed since the last one began, and whenever half the window filled
up; a flush of the sink commits and waits for the commit.

A batch failing inside a Kafka transaction aborts it: a new producer (whose InitProducerId
aborts the old one's transaction) sends every batch of it again. A failed commit may still have
committed at the broker, so it stops cdcd; the next start reads the position back and skips, of
what PostgreSQL resends, whatever Kafka already holds (:meth:`KafkaTransactions.skips_begin`,
:meth:`~KafkaTransactions.unsent`, :meth:`~KafkaTransactions.held_whole`).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import structlog

from cdcd.errors import DefiniteSinkError, SinkSetupError, TransientSinkError
from cdcd.sinks.kafka.batches import Batch
from cdcd.sinks.kafka.position import Position, read_position
from cdcd.sinks.kafka.sender import Sender

if TYPE_CHECKING:
    from cdcd.assembler.transaction import Transaction
    from cdcd.events import ChangeEvent

log = structlog.get_logger(__name__)


class KafkaTransactions:
    """The Kafka transactions of one sink: cdcd's position in them, the commit that releases
    the window, and what to skip after a restart."""

    def __init__(self, sender: Sender, transactional_id: str, position_topic: str) -> None:
        self.sender = sender
        self.transactional_id = transactional_id
        self.position_topic = position_topic
        self.resume: Position | None = None  # what Kafka held at the start, until passed
        self.position: Position | None = None  # the last event added
        self._skip_txn = False  # the current transaction is in Kafka already
        self._skip_seq = -1  # its events up to this seq are in Kafka already
        self._commit_task: asyncio.Task[None] | None = None  # the Kafka commit under way
        self._began = 0.0  # loop time the last commit began
        # what the window held when it began (its records and bytes; KafkaSink's bounds)
        self.held_records = 0
        self.held_bytes = 0

    async def start(self) -> None:
        """Create (or check) the position topic, read what Kafka holds (the producer's start
        aborted what a previous one left open), open the first Kafka transaction."""
        sender = self.sender
        assert sender.producer is not None
        await sender.prepare_topic(self.position_topic, "the position topic")
        delay = sender.config.retry_backoff
        while True:
            try:
                self.resume = await read_position(
                    sender.client_kwargs(),
                    self.position_topic,
                    self.transactional_id.encode(),
                    int(sender.config.request_timeout * 1000),
                )
                break
            except Exception as exc:
                err = sender.translate(exc, topic=self.position_topic, starting=True)
                if not isinstance(err, TransientSinkError):
                    raise err from exc
                log.warning("kafka_position_retry", topic=self.position_topic, error=str(err))
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
        log.info(
            "kafka_exactly_once",
            transactional_id=self.transactional_id,
            position_topic=self.position_topic,
            resume=None if self.resume is None else str(self.resume),
        )
        await sender.producer.begin_transaction()
        self._began = self._loop_time()

    # --- the pipeline's calls, as the sink passes them on --------------------------------

    def skips_begin(self, txn: Transaction) -> bool:
        """At ``begin``: True when Kafka holds the start of ``txn`` already (all of it, or its
        BEGIN marker and events up to the position's ``seq``: :meth:`unsent` drops those)."""
        resume = self.resume
        if resume is not None:
            held = resume.holds(txn.commit_lsn)
            if held == "all":
                self._skip_txn = True
                return True
            if held == "part":
                self._skip_seq = resume.seq  # its BEGIN marker is in Kafka too
                return True
            self.resume = None
        self.position = Position(txn.commit_lsn, -1, False)
        return False

    def unsent(self, events: Sequence[ChangeEvent]) -> Sequence[ChangeEvent]:
        """At ``write``: the events Kafka does not hold yet."""
        if self._skip_txn:
            return ()
        if self._skip_seq >= 0:
            return [e for e in events if e.seq > self._skip_seq]
        return events

    def added(self, last: ChangeEvent) -> None:
        """The sink added the records of the events up to ``last``: a commit from now on
        claims them, and no more."""
        self.position = Position(last.commit_lsn, last.seq, False)

    def held_whole(self) -> bool:
        """At ``commit``: True when Kafka held the whole transaction already."""
        if self._skip_txn:
            self._skip_txn = False
            return True
        self._skip_seq = -1
        self.resume = None
        return False

    def completed(self, txn: Transaction, seq: int | None = None) -> None:
        """``txn`` is whole in the sink; ``seq``: of its last event (default: as added)."""
        if seq is None:
            seq = self.position.seq if self.position is not None else -1
        self.position = Position(txn.commit_lsn, seq, True, txn.end_lsn)

    # --- the commit ------------------------------------------------------------------------

    async def commit(self) -> None:
        """Commit everything added so far, and wait until it is committed (a flush). The
        writer may begin a commit of its own (a full window) while this waits for the one
        under way: that one holds only what was added before it began, so wait for it too
        and begin one after it."""
        await self.committed()
        while self._commit_task is not None:
            await self.committed()
        self.begin_commit()
        await self.committed()

    def commit_when_due(self, interval: float) -> None:
        """At the end of a source transaction: begin a commit in the background once
        ``interval`` passed since the last one began and none is under way. (The pipeline's
        flush once a second did this and waited for the broker's answer, the stream stopped.)"""
        if self._commit_task is None and self._loop_time() - self._began >= interval:
            self.begin_commit()

    async def make_room(self) -> None:
        """The window is full: wait for the Kafka commit under way, or begin one."""
        if self._commit_task is not None:
            await self.committed()
        else:
            self.begin_commit()

    async def committed(self) -> None:
        """Wait for the Kafka commit under way, if any (its failure raised here)."""
        task = self._commit_task
        if task is not None:
            try:
                await asyncio.shield(task)
            finally:
                if task.done() and self._commit_task is task:
                    self._commit_task = None
        self.sender.raise_failure()

    def begin_commit(self) -> None:
        """End the open Kafka transaction with cdcd's position, in the background: it holds
        everything added so far, and nothing added from now on (the next Kafka transaction's
        records are written meanwhile and handed over once it begins)."""
        sender = self.sender
        sender.raise_failure()
        assert self._commit_task is None or self._commit_task.done(), "one commit at a time"
        self._began = self._loop_time()
        window = sender.window
        if not any(isinstance(entry, Batch) for entry in window):
            while window:  # transactions without records: nothing to hold in Kafka
                entry = window.popleft()
                assert isinstance(entry, int)
                sender.mark_durable(entry)
            return
        batches = sender.batches
        if self.position is not None:
            assert self.position_topic in sender.partitions  # learnt at start
            batches.add(
                self.position_topic,
                int(time.time() * 1000),
                self.transactional_id.encode(),
                self.position.encode(),
                b"",
                -1,
                b"",
                0,
                "cdcd's position",
            )
        batches.close_open()
        sender.barrier = len(batches.ready)  # all of them, and no later one, in this one
        self.held_records, self.held_bytes = batches.window_records, batches.window_bytes
        task = asyncio.get_running_loop().create_task(self._commit(len(window)))
        task.add_done_callback(self._commit_done)
        self._commit_task = task

    @staticmethod
    def _loop_time() -> float:
        return asyncio.get_running_loop().time()

    def _commit_done(self, task: asyncio.Task[None]) -> None:
        if self._commit_task is task:
            self._commit_task = None
        error = None if task.cancelled() else task.exception()  # also marks it retrieved
        if error is not None:
            if self.sender.failure is None:  # a bug: make it visible to the pipeline
                self.sender.failure = DefiniteSinkError(f"kafka: commit failed: {error!r}")
            self.sender.changed.set()

    def close(self) -> None:
        if self._commit_task is not None:
            self._commit_task.cancel()

    async def _commit(self, count: int) -> None:
        """Hand over the Kafka transaction's batches, wait for their acknowledgements, commit,
        mark the source transactions it completes durable (the window's first ``count``
        entries) and begin the next Kafka transaction. A failed batch, or a failed commit that
        may pass, aborts it (a new producer) and sends it all again."""
        sender = self.sender
        window = sender.window
        batches = sender.batches
        mine = [entry for entry in itertools.islice(window, count) if isinstance(entry, Batch)]
        async with sender.send_lock:
            try:
                while True:
                    assert sender.producer is not None
                    await sender.submit_ready()
                    sender.raise_failure()
                    results = await asyncio.gather(
                        *(b.future for b in mine if b.future is not None), return_exceptions=True
                    )
                    failed = next((r for r in results if isinstance(r, BaseException)), None)
                    if failed is None:
                        try:
                            await sender.producer.commit_transaction()
                        except Exception as exc:
                            # it may have committed at the broker: only a restart, which reads
                            # the position back, can tell what Kafka holds
                            err = sender.translate(exc, topic=self.position_topic)
                            if not isinstance(err, SinkSetupError):
                                err = DefiniteSinkError(
                                    f"kafka: committing the Kafka transaction failed ({err}); "
                                    "cdcd stops, its next start reads back what Kafka holds"
                                )
                            sender.failure = err
                            sender.changed.set()
                            raise err from exc
                        break
                    err = sender.translate(failed, topic=mine[0].topic, batch=mine[0])
                    if not isinstance(err, TransientSinkError):
                        sender.failure = err
                        sender.changed.set()
                        raise err from failed
                    log.warning("kafka_transaction_retry", error=str(err))
                    sender.stats["replays"] += 1
                    await sender.renew_producer()
                    for batch in mine:
                        batch.future = None
                    batches.ready.extendleft(reversed(mine))  # before the next one's
                    sender.barrier = len(mine)
                sender.stats["kafka_commits"] += 1
                for _ in range(count):
                    entry = window.popleft()
                    if isinstance(entry, int):
                        sender.mark_durable(entry)
                    else:
                        sender.acknowledged(entry)
                self.held_records = self.held_bytes = 0
                sender.changed.set()
                try:
                    await sender.producer.begin_transaction()
                except Exception as exc:
                    sender.failure = sender.translate(exc)
                    sender.changed.set()
                    raise sender.failure from exc
            finally:
                sender.barrier = None
                batches.wake.set()  # the next Kafka transaction's batches, if any
