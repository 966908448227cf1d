"""Shared pytest fixtures: real PostgreSQL clusters (see ``tests/pgharness.py``).

``pg_cluster`` (session scope) is parametrized over :func:`find_installations` with ids
``pg18``/``pg16``/``pg15``; ``CDCD_TEST_PG=18`` or ``CDCD_TEST_PG=15,18`` restricts it.
``pg_db`` (function scope) is a fresh database on that cluster, dropped afterwards together
with its replication slots and prepared transactions.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.pgharness import (
    PgCluster,
    PgDatabase,
    PgInstall,
    create_database,
    find_installations,
    reap_stale_clusters,
)

_INSTALLS: list[PgInstall | None] = list(find_installations()) or [None]


@pytest.fixture(
    scope="session",
    params=_INSTALLS,
    ids=[i.id if i is not None else "nopg" for i in _INSTALLS],
)
def pg_cluster(request: pytest.FixtureRequest) -> Iterator[PgCluster]:
    """A started cluster, one per installed major version, shared by the session."""
    install: PgInstall | None = request.param
    if install is None:
        pytest.skip("no PostgreSQL installation found (or none matches CDCD_TEST_PG)")
    reap_stale_clusters()
    cluster = PgCluster(install)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.destroy()


@pytest.fixture
def pg_db(pg_cluster: PgCluster) -> Iterator[PgDatabase]:
    """A fresh, uniquely named database on ``pg_cluster``; dropped with its slots."""
    if not pg_cluster.is_running():  # a previous test crashed it and did not restart it
        pg_cluster.start()
    db = create_database(pg_cluster)
    try:
        yield db
    finally:
        if not pg_cluster.is_running():
            pg_cluster.start()
        db.drop()
