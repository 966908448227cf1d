"""Shared pytest fixtures: real PostgreSQL clusters (see ``tests/pgharness.py``).

``pg_cluster`` (session scope) is parametrized over :func:`find_installations` with ids
``pg18``/``pg16``/``pg15``; ``CDCD_TEST_PG=18`` or ``CDCD_TEST_PG=15,18`` restricts it.
``pg_install`` is that parameter; ``pg_cluster_factory`` makes private clusters of the same
version. ``pg_db`` (function scope) is a fresh database on that cluster, dropped afterwards together
with its replication slots and prepared transactions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.e2e import thorough
from tests.pgharness import (
    PgCluster,
    PgDatabase,
    PgInstall,
    create_database,
    find_installations,
    reap_stale_clusters,
)

_INSTALLS: list[PgInstall | None] = list(find_installations()) or [None]


def pytest_configure(config: pytest.Config) -> None:
    """Under ``--dist loadgroup`` (scripts/test), tests marked ``xdist_group`` must share a
    worker (the docker tests share one engine, stopped by the worker that started it).
    pytest-xdist (3.8) marks them by renaming the items, which pytest 9 ignores: the groups
    would split and fail at random. Refuse such a run."""
    if hasattr(config, "workerinput") or config.getoption("dist", None) != "loadgroup":
        return
    if int(pytest.__version__.split(".")[0]) >= 9:
        raise pytest.UsageError(
            f"pytest {pytest.__version__} ignores pytest-xdist's xdist_group marks under "
            "--dist loadgroup: install pytest<9, as pyproject.toml's test extra says"
        )


def _newest_only(item: pytest.Item) -> bool:
    """Tests marked ``slow`` (crash loops, million-row runs, memory peaks) or
    ``version_independent`` (what they prove does not differ between server versions: the
    sinks, Kafka, S3, Spark, the CLI, HTTP, metrics, shutdown, the snapshots' own logic)."""
    return any(item.get_closest_marker(m) is not None for m in ("slow", "version_independent"))


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests that :func:`_newest_only` selects run on the newest PostgreSQL only, unless
    ``CDCD_TEST_ALL_VERSIONS=1`` (:func:`tests.e2e.thorough`). Skipped here, before any
    fixture: no server starts for them. The tests of what differs between versions (protocol
    versions, streaming, two-phase, origins, binary, messages, publication features, slots,
    failover, type output) carry neither mark: every version (docs/testing.md).

    The ``slow`` and ``spark`` tests that do run go first (after pytest's grouping by version,
    hence ``trylast``): pytest-xdist hands tests out in this order, so the two workers start
    on the long ones and end together on short unit tests instead of one waiting for the
    other's Spark job or wheel build."""
    newest = _INSTALLS[0]
    skip = pytest.mark.skip(
        reason=f"newest PostgreSQL ({newest.major if newest else '?'}) only "
        "(CDCD_TEST_ALL_VERSIONS=1: all)"
    )
    first, rest = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        install = callspec.params.get("pg_install", newest) if callspec is not None else newest
        if install != newest and _newest_only(item) and not thorough():
            item.add_marker(skip)
            rest.append(item)
        elif item.get_closest_marker("slow") or item.get_closest_marker("spark"):
            first.append(item)
        else:
            rest.append(item)
    items[:] = first + rest


@pytest.fixture(
    scope="session",
    params=_INSTALLS,
    ids=[i.id if i is not None else "nopg" for i in _INSTALLS],
)
def pg_install(request: pytest.FixtureRequest) -> PgInstall:
    """One installed PostgreSQL major version (the parameter behind ``pg_cluster``)."""
    install: PgInstall | None = request.param
    if install is None:
        pytest.skip("no PostgreSQL installation found (or none matches CDCD_TEST_PG)")
    return install


@pytest.fixture(scope="session")
def _pg_clusters() -> Iterator[dict[PgInstall, PgCluster]]:
    """The shared clusters by installation, destroyed at the end of the session."""
    clusters: dict[PgInstall, PgCluster] = {}
    try:
        yield clusters
    finally:
        for cluster in clusters.values():
            cluster.destroy()


@pytest.fixture(scope="session")
def pg_cluster(pg_install: PgInstall, _pg_clusters: dict[PgInstall, PgCluster]) -> PgCluster:
    """A started cluster, one per installed major version, shared by the session. pytest
    finishes a parametrized session fixture whenever the next test takes another version;
    the cluster outlives that (in ``_pg_clusters``), so tests may run in any order."""
    cluster = _pg_clusters.get(pg_install)
    if cluster is None:
        reap_stale_clusters()
        cluster = _pg_clusters[pg_install] = PgCluster(pg_install)
        cluster.start()
    return cluster


@pytest.fixture
def pg_cluster_factory(pg_install: PgInstall) -> Iterator[Callable[..., PgCluster]]:
    """``factory(settings=None, start=True) -> PgCluster``: private clusters of the same
    version (for tests that crash, restart or reconfigure a server); destroyed afterwards."""
    made: list[PgCluster] = []

    def factory(settings: dict[str, Any] | None = None, start: bool = True) -> PgCluster:
        cluster = PgCluster(pg_install, settings=settings)
        made.append(cluster)
        return cluster.start() if start else cluster

    try:
        yield factory
    finally:
        for cluster in made:
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
