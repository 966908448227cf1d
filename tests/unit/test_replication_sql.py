"""CREATE_REPLICATION_SLOT by server version, with TWO_PHASE and FAILOVER."""

from __future__ import annotations

import pytest

from cdcd.config import SourceConfig
from cdcd.errors import ConfigError
from cdcd.replication.sql import create_slot_sql
from cdcd.source import wants_failover


@pytest.mark.parametrize(
    ("version", "kw", "sql"),
    [
        (140000, {}, 'CREATE_REPLICATION_SLOT "s" LOGICAL pgoutput NOEXPORT_SNAPSHOT'),
        (160000, {}, "CREATE_REPLICATION_SLOT \"s\" LOGICAL pgoutput (SNAPSHOT 'nothing')"),
        (
            170000,
            {"failover": True, "snapshot": "export"},
            "CREATE_REPLICATION_SLOT \"s\" LOGICAL pgoutput (FAILOVER true, SNAPSHOT 'export')",
        ),
        (
            180000,
            {"failover": True, "two_phase": True},
            'CREATE_REPLICATION_SLOT "s" LOGICAL pgoutput '
            "(FAILOVER true, TWO_PHASE true, SNAPSHOT 'nothing')",
        ),
    ],
)
def test_create_slot_sql(version: int, kw: dict[str, object], sql: str) -> None:
    assert create_slot_sql("s", version, **kw) == sql  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("version", "kw", "message"),
    [
        (160000, {"failover": True}, "need PostgreSQL 17"),
        (140000, {"failover": True}, "failover slots need PostgreSQL 17"),
        (170000, {"failover": True, "two_phase": True}, "both FAILOVER and TWO_PHASE"),
    ],
)
def test_create_slot_sql_refuses(version: int, kw: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        create_slot_sql("s", version, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("failover", "two_phase", "version", "expected"),
    [
        ("auto", False, 160000, False),
        ("auto", False, 170000, True),
        ("auto", True, 170000, False),  # 17 cannot have both
        ("auto", True, 180000, True),
        (False, False, 180000, False),
        (True, True, 170000, True),  # asked for: create_slot_sql says why it cannot be
    ],
)
def test_wants_failover(failover: object, two_phase: bool, version: int, expected: bool) -> None:
    src = SourceConfig(dsn="host=x", failover=failover, two_phase=two_phase)
    assert wants_failover(src, version) is expected


@pytest.mark.parametrize(("given", "expected"), [("auto", "auto"), ("on", True), (False, False)])
def test_failover_config(given: object, expected: object) -> None:
    assert SourceConfig(dsn="host=x", failover=given).failover == expected


def test_on_slot_lost_config() -> None:
    assert SourceConfig(dsn="host=x").on_slot_lost == "fail"
    assert SourceConfig(dsn="host=x", on_slot_lost="Recreate").on_slot_lost == "recreate"
    with pytest.raises(ValueError, match="incremental snapshots, which do not work with"):
        SourceConfig(dsn="host=x", binary=True, on_slot_lost="recreate")
    with pytest.raises(ValueError, match="on_slot_lost"):
        SourceConfig(dsn="host=x", on_slot_lost="ignore")
