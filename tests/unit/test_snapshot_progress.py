"""Rate and ETA of snapshot progress (cdcd.progress_rate) and ``cdcd snapshot --follow``'s plain
output off a terminal (cdcd.snapshot_follow), over a state file written as the daemon does."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from cdcd import status_page
from cdcd.config.loading import parse_config
from cdcd.errors import EXIT_FAILURE, EXIT_OK
from cdcd.health import Health
from cdcd.progress_rate import RateMeter, duration
from cdcd.snapshot.state import IncrementalState
from cdcd.snapshot_command import status
from cdcd.snapshot_follow import follow, line
from cdcd.stats import Stats, TableSnapshot


def test_rate_over_the_window_and_eta() -> None:
    meter = RateMeter(window=10)
    assert meter.rate is None and meter.eta(0, 1000) is None
    meter.add(0, 0)
    assert meter.rate is None
    meter.add(1, 100)
    assert meter.rate == 100
    assert meter.eta(100, 1000) == pytest.approx(9.0)
    # a slower pace: after the window the rate is the recent one, not the average
    for t in range(2, 31):
        meter.add(t, 100 + 10 * (t - 1))
    assert meter.rate == pytest.approx(10)
    assert meter.eta(390, 1000) == pytest.approx(61)
    # estimate reached or exceeded (reltuples is an estimate): how much is left is unknown
    assert meter.eta(1200, 1000) is None
    # no estimate (never analyzed: reltuples -1 is stored as 0): unknown
    assert meter.eta(390, 0) is None


def test_a_count_going_back_starts_over_and_a_pause_shows() -> None:
    meter = RateMeter(window=5)
    meter.add(0, 5000)
    meter.add(1, 6000)
    meter.add(2, 0)  # requested again: the table starts over
    assert meter.rate is None
    meter.add(3, 500)
    assert meter.rate == 500
    for t in range(4, 12):
        meter.add(t, 500)  # stalled (a sink retrying)
    assert meter.rate == 0 and meter.eta(500, 1000) is None


def test_duration() -> None:
    assert [duration(s) for s in (None, 4.4, 59.6, 185, 7620)] == [
        "?",
        "4s",
        "1m00s",
        "3m05s",
        "2h07m",
    ]


def test_line() -> None:
    meter = RateMeter()
    meter.add(0, 0)
    meter.add(2, 40_000)
    text = line("public.t", "running", 40_000, 250_000, meter)
    assert text == "public.t  running  40,000 / 250,000 rows  16.0%  20,000 rows/s  ETA 10s"
    assert line("public.t", "done", 250_100, 250_000, meter).endswith("100%  20,000 rows/s  ETA 0s")


def _config(tmp_path: Path) -> object:
    return parse_config(
        {
            "source": {"dsn": "postgresql://x@127.0.0.1/db", "slot": "s"},
            "sinks": [{"type": "null"}],
            "snapshot": {"state_dir": str(tmp_path)},
        },
        tmp_path,
    )


def test_follow_off_a_terminal_prints_lines_until_done(tmp_path: Path) -> None:
    config = _config(tmp_path)
    daemon = IncrementalState(tmp_path, "s")
    daemon.last_signal = 50  # an earlier request: not ours yet
    daemon.save()
    now = [0.0]
    steps = iter(range(100))

    def sleep(seconds: float) -> None:
        """The daemon's side: takes the signal, then records 10,000 rows a second."""
        now[0] += seconds
        step = next(steps)
        if step == 2:
            daemon.last_signal = 120
            daemon.request(["public.t", "public.u"])
        elif step > 2:
            t = daemon.tables["public.t"]
            t.update(status="running", estimate=100_000, estimated_from="statistics")
            t["rows"] = min(100_000, t["rows"] + 5000)
            if t["rows"] == 100_000:
                t["status"] = "done"
            daemon.tables["public.u"]["status"] = "skipped" if step > 5 else "running"
            daemon.save()

    out = io.StringIO()
    code = follow(
        config,  # type: ignore[arg-type]
        ["public.t", "public.u"],
        after_signal=100,
        out=out,
        tty=False,
        every=2.0,
        clock=lambda: now[0],
        sleep=sleep,
    )
    lines = out.getvalue().splitlines()
    assert lines[0] == "waiting for the daemon to take the request (is it running?)"
    assert lines[1].startswith("public.t  pending  0 / ? rows  -")
    t_lines = [x for x in lines if x.startswith("public.t  running")]
    # a line every 2 s (4 polls) while running, at 10,000 rows/s: ETA from rows left
    assert [x.split("  ", 2)[2] for x in t_lines] == [
        "5,000 / 100,000 rows  5.0%  10,000 rows/s  ETA 10s",
        "25,000 / 100,000 rows  25.0%  10,000 rows/s  ETA 8s",
        "45,000 / 100,000 rows  45.0%  10,000 rows/s  ETA 6s",
        "65,000 / 100,000 rows  65.0%  10,000 rows/s  ETA 4s",
        "85,000 / 100,000 rows  85.0%  10,000 rows/s  ETA 2s",
    ]
    assert [x for x in lines if x.startswith("public.t  done")] == [
        "public.t  done  100,000 / 100,000 rows  100%  10,000 rows/s  ETA 0s"
    ]
    assert [x for x in lines if x.startswith("public.u  skipped")] == [
        "public.u  skipped  0 / ? rows  -  0 rows/s  ETA ?"
    ]
    assert lines[-1].startswith("not snapshotted: public.u (skipped or removed")
    assert code == EXIT_FAILURE


def test_follow_with_nothing_running(tmp_path: Path) -> None:
    daemon = IncrementalState(tmp_path, "s")
    daemon.tables = {"public.t": {"status": "done", "rows": 5, "estimate": 5, "last_key": None}}
    daemon.save()
    out = io.StringIO()
    assert follow(_config(tmp_path), None, out=out, tty=False) == EXIT_OK  # type: ignore[arg-type]
    assert out.getvalue() == "no incremental snapshot running\n"


def test_status_shows_bytes_rate_and_eta(tmp_path: Path) -> None:
    daemon = IncrementalState(tmp_path, "s")
    daemon.tables = {
        "public.t": {
            "status": "running",
            "rows": 40_000,
            "estimate": 100_000,
            "last_key": ["40000"],
            "bytes": 3 * 1024**2,
            "rows_per_s": 12_000,
        },
        "public.u": {"status": "done", "rows": 7, "estimate": 5, "last_key": None},
    }
    daemon.save()
    out = io.StringIO()
    assert status(_config(tmp_path), out) == EXIT_OK  # type: ignore[arg-type]
    assert out.getvalue().splitlines() == [
        "table     status          rows    estimate   done    bytes    rows/s  ETA",
        "public.t  running        40000      100000  40.0%   3.00MB    12,000  5s",
        "public.u  done               7           5   100%    0.00B         -  -",
    ]


def test_without_statistics_no_percentage_is_made_up(tmp_path: Path) -> None:
    """A table never analysed: its estimate from the size is marked ``~``; with none at all,
    rows and rate only, in ``cdcd snapshot status``, ``--follow``, the metrics and the page."""
    daemon = IncrementalState(tmp_path, "s")
    daemon.tables = {
        "public.sized": {
            "status": "running",
            "rows": 106_000,
            "estimate": 400_000,
            "estimated_from": "size",
            "last_key": ["1"],
            "rows_per_s": 10_000,
        },
        "public.blind": {
            "status": "running",
            "rows": 106_000,
            "estimate": 0,
            "estimated_from": None,
            "last_key": ["1"],
            "rows_per_s": 10_000,
        },
    }
    daemon.save()
    out = io.StringIO()
    assert status(_config(tmp_path), out) == EXIT_OK  # type: ignore[arg-type]
    lines = out.getvalue().splitlines()
    assert lines[1].split() == [
        "public.sized",
        "running",
        "106000",
        "~400000",
        "~26.5%",
        "0.00B",
        "10,000",
        "29s",
    ]
    assert lines[2].split() == [
        "public.blind",
        "running",
        "106000",
        "?",
        "-",
        "0.00B",
        "10,000",
        "?",
    ]
    assert lines[3].startswith("~: estimated from the table's size")
    meter = RateMeter()
    meter.add(0.0, 0)
    meter.add(1.0, 106_000)
    assert line("public.blind", "running", 106_000, 0, meter, None) == (
        "public.blind  running  106,000 / ? rows  -  106,000 rows/s  ETA ?"
    )
    assert line("public.sized", "running", 106_000, 400_000, meter, "size") == (
        "public.sized  running  106,000 / ~400,000 rows  ~26.5%  106,000 rows/s  ETA 3s"
    )
    stats = Stats(name="shop", slot="s")
    stats.snapshots["public.blind"] = TableSnapshot("running", rows=5, estimated_from=None)
    stats.snapshots["public.sized"] = TableSnapshot(
        "running", rows=5, estimate=10, estimated_from="size"
    )
    text = Health(stats).render("/metrics")[1].decode()
    assert 'cdcd_snapshot_rows_estimated{table="public.blind"}' not in text
    assert 'cdcd_snapshot_estimate_from_size{table="public.sized"} 1.0' in text
    page = status_page.render(status_page.collect(stats)).decode()
    assert '<td class="n">?</td><td class="n">-</td>' in page
    assert '<td class="n">~10</td><td class="n">~50.0%</td>' in page
