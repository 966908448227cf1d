"""Fixtures for integration tests that need a Kafka-protocol broker (see tests/kafkaharness.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.kafkaharness import KafkaBroker


@pytest.fixture(scope="session")
async def kafka_broker() -> AsyncIterator[KafkaBroker]:
    """One broker for the session (tansu, or ``$CDCD_TEST_KAFKA_BOOTSTRAP``). Tests use their own
    topic prefixes; tests that stop or restart a broker use ``restartable_kafka_broker``."""
    broker = await KafkaBroker.launch()
    try:
        yield broker
    finally:
        await broker.close()


@pytest.fixture
async def restartable_kafka_broker() -> AsyncIterator[KafkaBroker]:
    """A private tansu broker this test may stop and start (skipped with an external broker)."""
    broker = await KafkaBroker.launch()
    if not broker.can_restart:
        pytest.skip("an external broker ($CDCD_TEST_KAFKA_BOOTSTRAP) cannot be restarted")
    try:
        yield broker
    finally:
        await broker.close()
