"""cdcd.benchlog: the opt-in latency log and stats summary that bench/run.py reads."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import orjson
import pytest

from cdcd import accel
from cdcd.benchlog import LATENCY_ENV, STATS_ENV, LatencyLog, write_stats
from cdcd.sinks.null import NullSink
from cdcd.stats import Stats
from tests.unit.sink_fixtures import CONTEXT


def test_latency_log_records_each_transaction_once_when_durable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert LatencyLog.from_env() is None
    path = tmp_path / "latency.jsonl"
    monkeypatch.setenv(LATENCY_ENV, str(path))
    log = LatencyLog.from_env()
    assert log is not None
    log.handed(100, 1_000)
    log.handed(200, 2_000)
    log.handed(300, 3_000)
    log.durable(50)  # nothing yet
    log.durable(200)  # the first two
    log.durable(200)  # nothing new
    log.durable(1000)  # the third
    log.close()
    records = [orjson.loads(line) for line in path.read_bytes().splitlines()]
    assert [(r["end_lsn"], r["commit_time_us"]) for r in records] == [
        (100, 1_000),
        (200, 2_000),
        (300, 3_000),
    ]
    assert all(r["durable_us"] > 1_600_000_000_000_000 for r in records)  # Unix microseconds
    assert all(r["durable_us"] >= r["handed_us"] > 1_600_000_000_000_000 for r in records)
    assert records[0]["durable_us"] == records[1]["durable_us"]  # made durable together


def test_a_sink_tells_its_listener_each_time_its_position_moves() -> None:
    sink = NullSink(NullSink.Config(), CONTEXT)
    told: list[int] = []
    sink._mark_durable(10)  # nobody listening: nothing happens
    sink.durable_listener = lambda: told.append(sink.durable_lsn())
    sink._mark_durable(20)
    sink._mark_durable(20)  # did not move
    sink._mark_durable(15)  # older
    sink._mark_durable(30)
    assert told == [20, 30]


def test_write_stats(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    stats = Stats(
        events=5,
        events_by={("public.a", "c"): 3, ("public.a", "u"): 1, ("public.b", "c"): 1},
        transactions=2,
        received_messages=9,
        received_bytes=999,
        socket_reads=7,
    )
    assembler = SimpleNamespace(total_spilled_bytes=123, spill_count=1, rendered=45)
    write_stats(stats, assembler)  # not asked for: nothing happens
    path = tmp_path / "stats.json"
    monkeypatch.setenv(STATS_ENV, str(path))
    write_stats(stats, assembler)
    summary = orjson.loads(path.read_bytes())
    assert summary["events"] == 5
    assert summary["events_by_op"] == {"c": 4, "u": 1}
    assert summary["events_by_table"] == {"public.a": 4, "public.b": 1}
    assert summary["spilled_bytes"] == 123 and summary["spill_count"] == 1
    assert summary["rendered_changes"] == 45
    assert summary["socket_reads"] == 7
    assert summary["peak_rss_mb"] > 0
    # whether the compiled modules ran, as the reader's "streaming" log line says
    compiled = all(accel.status(imported_only=True).values())
    assert summary["fast_paths"] == ("compiled" if compiled else "pure Python")
