"""Incremental snapshot progress as Prometheus metrics (cdcd.health over cdcd.stats)."""

from __future__ import annotations

from cdcd import status_page
from cdcd.health import Health
from cdcd.stats import Stats, TableSnapshot


def test_progress_per_table_is_exported() -> None:
    stats = Stats(name="shop", slot="s")
    stats.snapshots["public.t"] = TableSnapshot("running", rows=1500, estimate=3000, dropped=4)
    stats.snapshots["public.u"] = TableSnapshot("done", rows=10, estimate=10)
    status, body, _ = Health(stats).render("/metrics")
    text = body.decode()
    assert status == 200
    assert 'cdcd_snapshot_rows_total{table="public.t"} 1500.0' in text
    assert 'cdcd_snapshot_rows_estimated{table="public.t"} 3000.0' in text
    assert 'cdcd_snapshot_rows_dropped_total{table="public.t"} 4.0' in text
    assert 'cdcd_snapshot_running{table="public.t"} 1.0' in text
    assert 'cdcd_snapshot_running{table="public.u"} 0.0' in text


def test_bytes_rate_and_eta_per_table() -> None:
    stats = Stats(name="shop", slot="s")
    t = stats.snapshots["public.t"] = TableSnapshot("running", rows=1500, estimate=3500)
    t.bytes = 123_456
    t.meter.add(10.0, 500)
    t.meter.add(12.0, 1500)  # 500 rows/s: 2,000 rows left in 4 s
    stats.snapshots["public.u"] = TableSnapshot("running", rows=10, estimate=100)  # no rate yet
    text = Health(stats).render("/metrics")[1].decode()
    assert 'cdcd_snapshot_bytes_total{table="public.t"} 123456.0' in text
    assert 'cdcd_snapshot_rows_per_second{table="public.t"} 500.0' in text
    assert 'cdcd_snapshot_eta_seconds{table="public.t"} 4.0' in text
    assert 'cdcd_snapshot_rows_per_second{table="public.u"} 0.0' in text
    assert 'cdcd_snapshot_eta_seconds{table="public.u"}' not in text  # unknown: absent


def test_progress_on_the_status_page() -> None:
    stats = Stats(name="shop", slot="s")
    stats.snapshots["public.t"] = TableSnapshot("running", rows=1500, estimate=3000, dropped=4)
    page = status_page.render(status_page.collect(stats)).decode()
    assert 'id="snapshots"' in page
    assert "<td>public.t</td><td>running</td>" in page and "50.0%" in page
