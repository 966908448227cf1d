"""The example sink of docs/sinks.md, copied from the page exactly as printed, installed through
the ``cdcd.sinks`` entry-point group (a dist-info folder on the path, as pip would leave it), and
streamed into from a real PostgreSQL: a third party can write a sink from the docs alone."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.e2e import REPO, run_cdcd, write_config
from tests.pgharness import PgDatabase

pytestmark = [pytest.mark.pg, pytest.mark.version_independent, pytest.mark.timeout(180)]


def install_example(site: Path) -> None:
    """The page's code block, and the entry point its pyproject snippet declares."""
    page = (REPO / "docs" / "sinks.md").read_text()
    (code,) = re.findall(r"```python example_sink\.py\n(.*?)```", page, re.S)
    (entry,) = re.findall(r'\[project\.entry-points\."cdcd\.sinks"\]\n(.*?)\n```', page, re.S)
    site.mkdir()
    (site / "example_sink.py").write_text(code)
    dist = site / "example_sink-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: example-sink\nVersion: 1.0\n")
    name, _, target = entry.partition("=")
    (dist / "entry_points.txt").write_text(
        f"[cdcd.sinks]\n{name.strip()} = {target.strip().strip(chr(34))}\n"
    )


def events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_example_sink_from_the_docs(
    pg_db: PgDatabase, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    site = tmp_path / "site"
    install_example(site)
    monkeypatch.setenv("PYTHONPATH", str(site))
    out = tmp_path / "cfg" / "events.jsonl"
    cfg = str(
        write_config(tmp_path / "cfg", pg_db.dsn, sinks=[{"type": "lines", "path": "events.jsonl"}])
    )
    pg_db.execute(
        "CREATE TABLE t (id int PRIMARY KEY, v text); CREATE PUBLICATION cdcd_e2e_pub FOR TABLE t"
    )
    run_cdcd("slot", "create", "--config", cfg)
    pg_db.execute("INSERT INTO t SELECT g, 'v' || g FROM generate_series(1, 500) g")
    pg_db.execute("UPDATE t SET v = 'changed' WHERE id <= 10")
    pg_db.execute("DELETE FROM t WHERE id > 490")
    endpos = pg_db.fetchval("SELECT pg_current_wal_insert_lsn()::text")
    run_cdcd("run", "--config", cfg, "--endpos", endpos)

    first = events(out)
    assert [e["op"] for e in first] == ["c"] * 500 + ["u"] * 10 + ["d"] * 10
    assert first[0]["after"] == {"id": 1, "v": "v1"} and first[0]["key"] == {"id": 1}
    positions = [(e["source"]["commit_lsn"], e["source"]["seq"]) for e in first]
    assert positions == sorted(set(positions))

    # a second run continues after what was confirmed: nothing twice
    pg_db.execute("INSERT INTO t VALUES (1000, 'later')")
    endpos = pg_db.fetchval("SELECT pg_current_wal_insert_lsn()::text")
    run_cdcd("run", "--config", cfg, "--endpos", endpos)
    second = events(out)
    assert second[: len(first)] == first
    assert [e["after"] for e in second[len(first) :]] == [{"id": 1000, "v": "later"}]
