"""Warming a fresh Kafka broker before a timed drain, and counting its JIT compilers' CPU.

The benchmark starts a fresh broker JVM for each Kafka contender run. A cold JVM spends much
of its CPU compiling (a recorded W1 run: the JIT compiler threads took 4.8 of the broker's
11.1 CPU s), which no long-running production broker does, and which competes for the two
cores with the contender being timed. So before the timed drain the benchmark produces
:data:`WARMUP_RECORDS` records shaped like a W1 change event (a JSON key, a ~700-byte JSON
value, cdcd's four headers) to topics of its own: zstd-compressed 1 MiB batches from an
idempotent producer with ``acks=all``, as every Kafka contender sends (cdcd and Debezium
alike), the last third in Kafka transactions of 50,000 records (the exactly-once paths:
InitProducerId with a transactional id, AddPartitionsToTxn, EndTxn, the markers); then it
waits until the broker is idle again (its compilers done with their queue), at most
``settle_timeout`` seconds. Nothing of this is timed, and it is the same for every Kafka
contender.

Why 600,000 (this 2-core VM, 2026-11-29; broker CPU s for 300,000 more records in 1 MiB
batches, of which its compilers in brackets): after a warm-up of 300,000, 0.54 (0.25); after
400,000 and 200,000 in transactions, 0.58-0.62 (0.16-0.19); after 900,000, 0.60 (0.15): the
rest is the steady state. A first 300,000 in transactions took 0.8-1.0 (0.45-0.57) after any
amount produced without.

:class:`JitCpu` samples the CPU time of the broker's JIT compiler threads (``C1 CompilerThre``,
``C2 CompilerThre``) while a contender runs, so a result can show how much of the broker's
CPU was compiling.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from pathlib import Path
from typing import Any

import orjson

WARMUP_TOPIC = "bench-warmup"
WARMUP_RECORDS = 600_000
_TICK = os.sysconf("SC_CLK_TCK")


def _node_pids(broker: Any) -> list[int]:
    return [node.proc.pid for node in broker.nodes if node.proc is not None]


def _process_cpu(pid: int) -> float:
    with contextlib.suppress(OSError, IndexError, ValueError):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK
    return 0.0


def _value(i: int) -> bytes:
    """A change event like cdcd's for a W1 row (same columns, envelope and size)."""
    return orjson.dumps(
        {
            "before": None,
            "after": {
                "id": i,
                "qty": i % 1000,
                "name": f"name-{i}",
                "created": f"2024-01-{1 + i % 28:02d}T{i % 24:02d}:{i % 60:02d}:{i % 60:02d}Z",
                "amount": f"{(i % 100000) / 100:.2f}",
                "active": i % 2 == 0,
                "score": i * 0.5,
                "ref": f"{i * 2654435761 % (1 << 128):032x}",
                "attrs": f'{{"k": {i}, "s": "v{i % 10}"}}',
                "day": f"2024-{1 + i % 12:02d}-{1 + i % 28:02d}",
            },
            "source": {
                "version": "0.1.0",
                "connector": "postgresql",
                "name": "bench",
                "db": "bench",
                "schema": "public",
                "table": "w1",
                "ts_ms": 1732233600123,
                "ts_us": 1732233600123456,
                "snapshot": "false",
                "txId": 771,
                "lsn": 24023128 + 200 * i,
                "sequence": f'[null,"{24023128 + 200 * i}"]',
                "xmin": None,
                "commit_lsn": 924023200,
                "seq": i,
            },
            "op": "c",
            "ts_ms": 1732233600150,
            "transaction": {
                "id": "771:924023200",
                "total_order": i + 1,
                "data_collection_order": i + 1,
            },
        }
    )


async def _produce(
    bootstrap: str,
    records: int,
    topic: str = WARMUP_TOPIC,
    transaction: int = 0,
) -> None:
    """``records`` records to a new ``topic``, in Kafka transactions of ``transaction``
    records if set."""
    from aiokafka import AIOKafkaProducer
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, 1, 1)])
    finally:
        await admin.close()
    producer = AIOKafkaProducer(
        transactional_id=f"{topic}-txn" if transaction else None,
        bootstrap_servers=bootstrap,
        enable_idempotence=True,
        acks="all",
        compression_type="zstd",
        max_batch_size=1 << 20,
        max_request_size=1 << 20,
        linger_ms=5,
    )
    await producer.start()
    try:
        pending = []
        i = 0
        while i < records:
            if transaction and i % transaction == 0:
                if i:
                    await asyncio.gather(*pending)
                    await producer.commit_transaction()
                await producer.begin_transaction()
            batch = producer.create_batch()
            while i < records:
                headers = [
                    ("cdcd.commit_lsn", b"924023200"),
                    ("cdcd.seq", str(i).encode()),
                    ("cdcd.xid", b"771"),
                    ("cdcd.op", b"c"),
                ]
                key = b'{"id":%d}' % i
                if batch.append(key=key, value=_value(i), timestamp=None, headers=headers) is None:
                    break
                i += 1
                if transaction and i % transaction == 0:
                    break
            pending.append(await producer.send_batch(batch, topic, partition=0))
        await asyncio.gather(*pending)
        if transaction:
            await producer.commit_transaction()
    finally:
        await producer.stop()


def warm_broker(
    broker: Any, records: int = WARMUP_RECORDS, settle_timeout: float = 15.0
) -> dict[str, float]:
    """Produce ``records`` W1-like records on ``broker`` (see the module's doc): two thirds to
    :data:`WARMUP_TOPIC`, a third to another topic in Kafka transactions of 50,000; then wait
    until the broker's JVMs use less than a fifth of a core over half a second (its compilers
    done), at most ``settle_timeout`` seconds. Returns the seconds and the broker's CPU
    seconds this took."""
    pids = _node_pids(broker)
    cpu0 = sum(_process_cpu(pid) for pid in pids)
    t0 = time.perf_counter()
    in_transactions = records // 3
    asyncio.run(_produce(broker.direct_bootstrap, records - in_transactions))
    if in_transactions:
        asyncio.run(
            _produce(
                broker.direct_bootstrap, in_transactions, f"{WARMUP_TOPIC}-txn", transaction=50_000
            )
        )
    deadline = time.monotonic() + settle_timeout
    last = sum(_process_cpu(pid) for pid in pids)
    while time.monotonic() < deadline:
        time.sleep(0.5)
        now = sum(_process_cpu(pid) for pid in pids)
        if now - last < 0.1:
            break
        last = now
    return {
        "seconds": round(time.perf_counter() - t0, 2),
        "broker_cpu_seconds": round(sum(_process_cpu(pid) for pid in pids) - cpu0, 2),
    }


class JitCpu:
    """Samples the CPU time of the broker's JIT compiler threads every 0.2 s while in the
    ``with``; ``seconds`` is what they took meanwhile. HotSpot starts and stops compiler
    threads as its queue grows and shrinks: a thread's time counts from its first sample to
    its last (one that ends between two samples loses at most 0.2 s)."""

    def __init__(self, broker: Any) -> None:
        self._pids = _node_pids(broker)
        self._first: dict[tuple[int, int], float] = {}
        self._last: dict[tuple[int, int], float] = {}
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @property
    def seconds(self) -> float:
        return sum(self._last[t] - self._first.get(t, 0.0) for t in self._last)

    def __enter__(self) -> JitCpu:
        self._sample(first=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        self._sample()

    def _run(self) -> None:
        while not self._done.wait(0.2):
            self._sample()

    def _sample(self, first: bool = False) -> None:
        for pid in self._pids:
            tids: list[str] = []
            with contextlib.suppress(OSError):
                tids = os.listdir(f"/proc/{pid}/task")
            for tid in tids:
                with contextlib.suppress(OSError, IndexError, ValueError):
                    text = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
                    name = text[text.index("(") + 1 : text.rindex(")")]
                    if "CompilerThre" not in name:
                        continue
                    fields = text.rsplit(")", 1)[1].split()
                    cpu = (int(fields[11]) + int(fields[12])) / _TICK
                    key = (pid, int(tid))
                    if first:
                        self._first[key] = cpu
                    self._last[key] = cpu
