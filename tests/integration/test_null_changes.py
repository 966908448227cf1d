"""The null sink alone takes decoded changes: the pipeline builds no events, yet every change
is decoded and counted, and the slot is confirmed as far as the sink got.

With a memory sink (which wants events) on the same stream, the per-table counters agree,
except that an Update of the key is one change but two events (delete + create).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from cdcd.config import load_config
from cdcd.lsn import parse_lsn
from cdcd.pipeline.service import Pipeline
from cdcd.sinks.memory import MemorySink
from cdcd.sinks.null import NullSink
from tests.e2e import run_cdcd, write_config
from tests.pgharness import PgDatabase

pytestmark = [pytest.mark.pg, pytest.mark.version_independent, pytest.mark.timeout(120)]


def config(db: PgDatabase, tmp_path: Path, sink: str, slot: str) -> Path:
    path = write_config(tmp_path / sink, db.dsn, sinks=[{"type": sink}])
    cfg = yaml.safe_load(path.read_text())
    cfg["source"]["slot"] = slot
    cfg["buffer"]["memory_limit"] = 4096  # the big transaction goes compact, then spills
    path.write_text(yaml.safe_dump(cfg))
    return path


async def test_null_sink_counts_every_change_without_events(
    pg_db: PgDatabase, tmp_path: Path
) -> None:
    pg_db.execute(
        "CREATE TABLE t (id int PRIMARY KEY, v text); CREATE TABLE u (k int PRIMARY KEY);"
        "CREATE PUBLICATION cdcd_e2e_pub FOR TABLE t, u"
    )
    paths = {sink: config(pg_db, tmp_path, sink, f"cdcd_{sink}") for sink in ("null", "memory")}
    for path in paths.values():
        run_cdcd("slot", "create", "--config", str(path))
    pg_db.execute("INSERT INTO t SELECT g, repeat('x', 200) FROM generate_series(1, 3000) g")
    pg_db.execute("UPDATE t SET v = 'y' WHERE id <= 10")
    pg_db.execute("UPDATE t SET id = -1 WHERE id = 11")  # the key changes
    pg_db.execute("DELETE FROM t WHERE id BETWEEN 20 AND 24")
    pg_db.execute("INSERT INTO u VALUES (1), (2)")
    pg_db.execute("TRUNCATE u")
    pg_db.execute("SELECT pg_logical_emit_message(true, 'p', 'hello')")
    endpos = parse_lsn(pg_db.fetchval("SELECT pg_current_wal_insert_lsn()::text"))

    counted = {}
    for sink, path in paths.items():
        pipeline = Pipeline(load_config(path), endpos=endpos)
        await pipeline.run()
        counted[sink] = dict(pipeline.stats.events_by)
        (only,) = pipeline.sinks
        if sink == "null":
            assert isinstance(only, NullSink) and not only.wants_events
            assert only.stats()["events"] == pipeline.stats.events == 3000 + 10 + 1 + 5 + 2 + 1 + 1
        else:
            assert isinstance(only, MemorySink)
        confirmed = pg_db.fetchval(
            f"SELECT confirmed_flush_lsn::text FROM pg_replication_slots "
            f"WHERE slot_name = 'cdcd_{sink}'"
        )
        assert parse_lsn(confirmed) >= endpos

    assert counted["null"] == {
        ("public.t", "c"): 3000,
        ("public.t", "u"): 11,
        ("public.t", "d"): 5,
        ("public.u", "c"): 2,
        ("public.u", "t"): 1,
        ("_messages", "m"): 1,
    }
    assert counted["memory"] == counted["null"] | {
        ("public.t", "u"): 10,
        ("public.t", "c"): 3001,
        ("public.t", "d"): 6,
    }
