"""Fixtures for integration tests that need Apache Kafka (see tests/kafkaharness.py) or Spark
(tests/sparkutil.py: registered here, once, so that every module shares the one session; a
fixture imported into several test modules is a separate fixture in each, and a second
``getOrCreate`` would change the shared session's settings under the first one's catalogs)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from tests.kafkaharness import KafkaBroker
from tests.sparkutil import connect_server, spark  # noqa: F401  (fixtures)


@pytest.fixture(scope="session")
async def kafka_broker() -> AsyncIterator[KafkaBroker]:
    """One broker for the session, so one per xdist worker (a JVM takes seconds to start), or
    ``$CDCD_TEST_KAFKA_BOOTSTRAP``. Tests use their own topic prefixes; tests that stop or
    restart a broker use ``restartable_kafka_broker``."""
    broker = await KafkaBroker.launch()
    try:
        yield broker
    finally:
        await broker.close()


@pytest.fixture(scope="session")
async def kafka_cluster() -> AsyncIterator[KafkaBroker]:
    """Three nodes (replication factor 3, ``min.insync.replicas`` 2) for the session, started
    when a test first asks for them. Tests that kill nodes leave them all running again
    (:meth:`KafkaBroker.heal`)."""
    broker = await KafkaBroker.launch(brokers=3, external_ok=False)
    try:
        yield broker
    finally:
        await broker.close()


@pytest.fixture
async def restartable_kafka_broker(kafka_broker: KafkaBroker) -> AsyncIterator[KafkaBroker]:
    """The session's broker, for a test that stops, starts or restarts it (skipped with an
    external broker). Tests of a worker run one at a time, so the outage touches no other
    test; afterwards the broker is running and reachable again."""
    if not kafka_broker.can_restart:
        pytest.skip("an external broker ($CDCD_TEST_KAFKA_BOOTSTRAP) cannot be restarted")
    try:
        yield kafka_broker
    finally:
        await kafka_broker.heal()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The Spark tests share one worker (``--dist loadgroup``), so one Spark session and one
    Spark jobs workload serve them all, not one per worker; a Spark test with an
    ``xdist_group`` of its own keeps it (the Spark Connect run, whose server is its own JVM,
    runs beside them on the other worker). ``tryfirst``: pytest-xdist reads the
    ``xdist_group`` marks in its own hook."""
    for item in items:
        in_spark = item.get_closest_marker("spark") is not None
        if in_spark and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group("spark"))
