"""A Kafka stream restarted after a crash in a micro-batch (Spark 4.1.1's Kafka source fails
such a restart once the batch is done, SPARK-55271: :mod:`cdcd.spark.streaming` works around it).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import orjson
import pytest

from tests.kafkaharness import KafkaBroker
from tests.sparkutil import change_event

pytest.importorskip("pyspark")

from cdcd.spark import stream_table, table_ref, table_rows
from cdcd.spark.streaming import unfinished_batch

pytestmark = [pytest.mark.kafka, pytest.mark.spark, pytest.mark.timeout(300)]


async def test_kafka_stream_restarts_after_an_unfinished_batch(
    kafka_broker: KafkaBroker, spark: Any, tmp_path: Path
) -> None:
    """A Kafka stream restarted from a checkpoint whose newest micro-batch has offsets and no
    commit (a crash in it) runs that batch again and then reads on; Spark 4.1.1's Kafka source
    alone fails the query after such a batch (SPARK-55271)."""
    from aiokafka import AIOKafkaProducer
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    topic = f"unfinished{os.getpid()}.public.orders"
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_broker.bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, num_partitions=2, replication_factor=1)])
    finally:
        await admin.close()
    producer = AIOKafkaProducer(bootstrap_servers=kafka_broker.bootstrap)
    await producer.start()

    async def send(*events: dict[str, Any]) -> None:
        for event in events:
            key = orjson.dumps(event.pop("key"))
            await producer.send_and_wait(topic, orjson.dumps(event), key=key)

    target, checkpoint = str(tmp_path / "delta"), tmp_path / "checkpoint"

    def run() -> None:
        query = stream_table(
            spark,
            "public.orders",
            target,
            str(checkpoint),
            kafka_bootstrap=kafka_broker.bootstrap,
            topic=topic,
        )
        query.awaitTermination()
        assert query.exception() is None

    try:
        await send(
            change_event("c", (100, 0), after={"id": 1, "n": 1}),
            change_event("c", (100, 1), after={"id": 2, "n": 2}),
        )
        run()
        assert not unfinished_batch(spark, str(checkpoint))
        for name in ("0", ".0.crc"):  # as a crash before the commit leaves it
            (checkpoint / "commits" / name).unlink()
        assert unfinished_batch(spark, str(checkpoint))
        await send(
            change_event("u", (200, 0), after={"id": 1, "n": 10}),
            change_event("d", (200, 1), before={"id": 2, "n": None}),
            change_event("c", (200, 2), after={"id": 3, "n": 3}),
        )
        run()
    finally:
        await producer.stop()
    rows = sorted((r["id"], r["n"]) for r in table_rows(spark, table_ref(target)).collect())
    assert rows == [(1, 10), (3, 3)]
