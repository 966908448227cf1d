"""The Kafka sink: every change event becomes a record on a per-table topic (docs/kafka.md).

Records::

    topic   <prefix>.<schema>.<table>     (or ``routing["schema.table"]``); prefix = pipeline name
    key     event.key_json()              JSON object of the key columns; null without a key
    value   event.value_json()            the Debezium-compatible event (docs/events.md)
    headers cdcd.commit_lsn, cdcd.seq, cdcd.xid, cdcd.op   (ASCII decimal; op as its letter;
                                          cdcd.xid is left out when the event has no xid)
            __debezium.newkey             on the delete of a key change: the new key as JSON
            __debezium.oldkey             on the create of a key change: the old key as JSON
                                          (Debezium's headers; the value's source.new_key /
                                          source.old_key hold the same objects)
    after a delete with a key: a tombstone (same key and headers, null value) unless
    ``tombstones: false``

Logical decoding messages go to ``<prefix>.message`` keyed by ``{"prefix": <message prefix>}``
(Debezium's key, ``event.key_json()``), so messages of one prefix stay in order. With
``transaction_topic: true``, BEGIN and END markers in Debezium's transaction-metadata shape
(plus ``commit_lsn`` and ``end_lsn``, as in the file sink's ``_transactions``) go to
``<prefix>.transaction`` keyed by ``{"id": "<xid>:<commit_lsn>"}``; END carries
``event_count`` and per-table ``data_collections`` counts (logical messages not counted).

Batches. The sink builds Kafka record batches itself, one open batch per topic-partition, and
hands each to aiokafka whole (``send_batch``), instead of one ``send()`` per record: that path
costs a coroutine, a future and a partitioner call per record. The per-record work is compiled
with mypyc: :mod:`cdcd.sinks.kafka.batches` makes records of events and picks their batch,
:mod:`cdcd.sinks.kafka.recordbatch` writes them into the batch's buffer in Kafka's record
format (v2), compressed and checksummed when the batch is sent; no object is kept per record.
A record's partition is what Kafka's default partitioner gives its key
(:mod:`cdcd.sinks.kafka.partition`: murmur2 of the key bytes, made positive, modulo the topic's
partition count, learnt once per topic); a keyless record goes to a random partition. A batch is
closed when the next record does not fit in ``max_batch_size`` (a larger record goes alone in
its batch), uncompressed, or, when that is set over ``max_request_size`` (the broker's limit,
which applies to the compressed batch), once its compressed size, estimated from the topic's
batches before, would reach 90 % of ``max_request_size``; such a batch is compressed as it
closes and split in two while it came out over the limit (:meth:`Batches.close`), as Kafka's
Java producer splits a batch the broker refused as too large.

Hand-over, ordering, durability and failures: :mod:`cdcd.sinks.kafka.sender` (the producer, the
window of unacknowledged batches and transaction ends, replays, the one place aiokafka's
exceptions are translated); ``exactly_once``: :mod:`cdcd.sinks.kafka.exactly_once`. The window
is bounded by ``buffer_records`` and ``buffer_bytes`` (key and value bytes plus 64 per record; a
batch's buffer, grown by doubling, holds up to twice its records' bytes, a batch writing into
the buffer of a built one counts a third of it besides, and ``buffered_bytes`` reports
three times the counted bytes; ``buffer_bytes`` is lowered to a third of the sink's
``memory_budget``, its share of ``buffer.memory_limit``, when that is smaller): ``write`` waits
for acknowledgements beyond them, which blocks the pipeline while the broker is away instead of
growing memory.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import orjson
import structlog
from aiokafka import errors as kerrors

from cdcd.errors import ConfigError
from cdcd.lsn import pg_to_unix_us
from cdcd.sinks.base import Sink, SinkContext, run_events
from cdcd.sinks.kafka.batches import Batches
from cdcd.sinks.kafka.client import KafkaSinkConfig, compression_available
from cdcd.sinks.kafka.exactly_once import KafkaTransactions
from cdcd.sinks.kafka.recordbatch import CODECS, Record, Where, encode_headers, record_size
from cdcd.sinks.kafka.sender import Sender

if TYPE_CHECKING:
    from cdcd.assembler.transaction import Transaction
    from cdcd.events import ChangeEvent

__all__ = ["KafkaSink", "KafkaSinkConfig"]

log = structlog.get_logger(__name__)


class KafkaSink(Sink):
    """Writes change events to Kafka; see the module docstring for records and guarantees."""

    type_name = "kafka"
    writes_json = True
    Config = KafkaSinkConfig

    def __init__(self, config: KafkaSinkConfig, context: SinkContext) -> None:
        super().__init__()
        self.config = config
        self.context = context
        self.prefix = config.topic_prefix or context.name
        self.message_topic = config.message_topic or f"{self.prefix}.message"
        self.transaction_topic = f"{self.prefix}.transaction"
        if not compression_available(config.compression):
            raise ConfigError(
                f"sinks.kafka.compression: {config.compression!r} needs the cramjam package "
                "(pip install 'aiokafka[lz4]'); or choose gzip or none"
            )
        self._batches = Batches(
            prefix=self.prefix,
            message_topic=self.message_topic,
            routing=config.routing,
            tombstones=config.tombstones,
            count_tables=config.transaction_topic,
            max_batch_size=config.max_batch_size,
            max_request_size=config.max_request_size,
            check_size=self._check_size,
            codec=CODECS[config.compression],
            level=config.level(),
        )
        self._window = self._batches.window  # batches and transaction end LSNs
        # exactly once (docs/kafka.md): the window is released only by a Kafka commit
        self.exactly_once = config.exactly_once
        self.transactional_id = config.transactional_id or f"cdcd-{context.name}"
        self.position_topic = config.position_topic or f"{self.prefix}.cdcd-positions"
        self._sender = Sender(
            config,
            context,
            self._batches,
            self._mark_durable,
            transactional_id=self.transactional_id if self.exactly_once else None,
            position_topic=self.position_topic,
        )
        # Acknowledgements make records durable (Sender.pump), exactly once the Kafka commits
        # the sink begins itself (KafkaTransactions.commit_when_due): a flush, which waits for
        # all of them, would only stall the pipeline once a second.
        self.flushes_itself = True
        self._txns: KafkaTransactions | None = None
        if self.exactly_once:
            self._txns = KafkaTransactions(self._sender, self.transactional_id, self.position_topic)

    async def start(self) -> None:
        """Connect, retrying with backoff while the broker is unreachable; after
        ``give_up_after`` seconds (if set) raise DefiniteSinkError."""
        await self._sender.connect()
        if self._txns is not None:
            await self._txns.start()
        self._sender.run()
        log.info("kafka_connected", bootstrap=self._sender.bootstrap(), prefix=self.prefix)

    async def close(self) -> None:
        if self._txns is not None:
            self._txns.close()
        await self._sender.close()

    # --- the pipeline's calls ----------------------------------------------------------------

    async def begin(self, txn: Transaction) -> None:
        self._sender.raise_failure()
        self._batches.txn_counts = {}
        if self._txns is not None and self._txns.skips_begin(txn):
            return
        if self._markers_for(txn):
            await self._add_marker(txn, "BEGIN")

    async def write(self, events: Sequence[ChangeEvent]) -> None:
        sender = self._sender
        sender.raise_failure()
        txns = self._txns
        if txns is not None:
            events = txns.unsent(events)
        batches = self._batches
        self._set_limits()
        i = 0
        while i < len(events):
            i = batches.add_events(events, i)
            if txns is not None and i:
                # the last event added: a full window commits the Kafka transaction below, in
                # the middle of ``events``, and its position must not claim what follows
                txns.added(events[i - 1])
            topic = batches.missing_topic
            if topic is not None:
                batches.missing_topic = None
                event = events[i]
                await sender.prepare_topic(topic, (event.commit_lsn, event.seq, event.lsn, ""))
            elif batches.full():
                await self._wait_for_room()
        if batches.ready:
            await asyncio.sleep(0)  # let the submitter hand the closed batches over

    async def write_transactions(
        self, run: Sequence[tuple[Transaction, Sequence[Sequence[ChangeEvent]]]]
    ) -> None:
        """A run of small transactions (docs/sinks.md): their records added in one pass, and
        the run durable once all of them are acknowledged. Call by call with
        ``transaction_topic`` (a marker before and after each transaction)."""
        txns = self._txns
        if self.config.transaction_topic or (txns is not None and txns.resume is not None):
            await super().write_transactions(run)
            return
        self._sender.raise_failure()
        events = run_events(run)
        if events:
            await self.write(events)
        self._sender.raise_failure()
        last = run[-1][0]
        if txns is not None:
            seq = events[-1].seq if events and events[-1].commit_lsn == last.commit_lsn else -1
            txns.completed(last, seq)
        self._window.append(last.end_lsn)
        self._sender.pump()
        if txns is not None:
            txns.commit_when_due(self.config.commit_interval)

    async def commit(self, txn: Transaction) -> None:
        self._sender.raise_failure()
        txns = self._txns
        if txns is not None and txns.held_whole():  # in Kafka already: durable there
            if not self._window:
                self._mark_durable(txn.end_lsn)
            else:
                self._window.append(txn.end_lsn)
            return
        if self._markers_for(txn):
            await self._add_marker(txn, "END")
        if txns is not None:
            txns.completed(txn)
        self._window.append(txn.end_lsn)
        self._sender.pump()
        if txns is not None:
            txns.commit_when_due(self.config.commit_interval)

    async def flush(self) -> None:
        """Wait until the broker acknowledged every record handed over. After a definite
        failure, first let what precedes the failing record become durable, then raise.
        Exactly once: commit the Kafka transaction."""
        if self._txns is not None:
            await self._txns.commit()
            return
        sender = self._sender
        sender.flushing += 1
        self._batches.wake.set()
        try:
            while True:
                if not self._window:
                    sender.raise_failure()
                    return
                if sender.failure is not None and sender.head_is_stuck():
                    raise sender.failure
                sender.changed.clear()
                await sender.changed.wait()
        finally:
            sender.flushing -= 1

    def stats(self) -> dict[str, Any]:
        return {
            **self._sender.stats,
            "window_records": self._batches.window_records,
            "window_bytes": self._batches.window_bytes,
            "batches_split": self._batches.splits,
        }

    # --- building records --------------------------------------------------------------------

    def _markers_for(self, txn: Transaction) -> bool:
        return self.config.transaction_topic and txn.kind != "message"

    async def _add_marker(self, txn: Transaction, status: str) -> None:
        txn_id = f"{txn.xid}:{txn.commit_lsn}"
        value: dict[str, Any] = {
            "status": status,
            "id": txn_id,
            "event_count": None,
            "data_collections": None,
            "ts_ms": pg_to_unix_us(txn.commit_time) // 1000,
            "commit_lsn": txn.commit_lsn,
            "end_lsn": txn.end_lsn if txn.ends else None,  # a first part does not know it
        }
        if status == "END":
            counts = self._batches.txn_counts
            value["event_count"] = sum(counts.values())
            value["data_collections"] = [
                {"data_collection": name, "event_count": count} for name, count in counts.items()
            ]
        headers = encode_headers(
            [("cdcd.commit_lsn", b"%d" % txn.commit_lsn), ("cdcd.xid", b"%d" % txn.xid)]
        )
        where = f"transaction {txn_id} {status}"
        if self.transaction_topic not in self._batches.partitions:
            await self._sender.prepare_topic(self.transaction_topic, where)
        key, ts = orjson.dumps({"id": txn_id}), value["ts_ms"]
        self._batches.add(
            self.transaction_topic, ts, key, orjson.dumps(value), headers, -1, b"", 2, where
        )
        await self._wait_for_room()

    # --- the window's bounds ---------------------------------------------------------------------

    def _check_size(self, topic: str, record: Record, headers: bytes, where: Where) -> None:
        key, value = record
        size = record_size(key, value, headers)
        if size > self.config.max_request_size:
            error = kerrors.MessageSizeTooLargeError(size)
            err = self._sender.translate(error, topic=topic, record=record, where=where)
            self._sender.failure = err
            self._sender.changed.set()
            raise err

    @property
    def _buffer_bytes(self) -> int:
        """``buffer_bytes``, or less when the sink's ``memory_budget`` is smaller (a record
        holds about three times its counted bytes in memory)."""
        budget = self.memory_budget
        limit = self.config.buffer_bytes
        return limit if budget is None else max(1024, min(limit, budget // 3))

    def buffered_bytes(self) -> int:
        return 3 * self._batches.window_bytes

    async def _wait_for_room(self) -> None:
        batches = self._batches
        sender = self._sender
        while True:
            sender.raise_failure()
            self._set_limits()
            if not batches.full():
                return
            if self._txns is not None:
                await self._txns.make_room()
                continue
            sender.changed.clear()
            await sender.changed.wait()

    def _set_limits(self) -> None:
        """``buffer_records`` and ``buffer_bytes`` for the window. Exactly once, half of each
        for the Kafka transaction being committed and half for the next one, whose records
        are written while the commit waits for the broker."""
        records, size = self.config.record_bound(), self._buffer_bytes
        txns = self._txns
        if txns is not None:
            records = max(1, records // 2) + txns.held_records
            size = max(1, size // 2) + txns.held_bytes
        self._batches.record_limit = records
        self._batches.byte_limit = size
