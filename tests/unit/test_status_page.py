"""The status page's HTML (cdcd.status_page.render), from a plain dict."""

from __future__ import annotations

from typing import Any

from cdcd.stats import Stats
from cdcd.status_page import collect, render


def figures(**changes: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "name": "shop",
        "slot": "cdcd_main",
        "state": "streaming",
        "confirmed_lsn": "0/1A2B3C4",
        "server_wal_lsn": "0/1A2C000",
        "lag_bytes": 3 * 1024 * 1024,
        "lag_seconds": 1.25,
        "transactions": 1234,
        "events": 56789,
        "events_per_second": 4321.4,
        "transactions_per_second": 12.0,
        "reconnects": 2,
        "slot_wal_status": "reserved",
        "retained_wal_bytes": 5 * 1024 * 1024 * 1024,
        "snapshot_rows": 1000,
        "tables": {"public.orders": {"r": 1000, "c": 50000, "u": 5000, "d": 789, "t": 0}},
        "sinks": [{"type": "file", "durable_lsn": "0/1A2B3C4", "stats": {"files_published": 7}}],
        "generated_at": "2026-01-01 00:00:00 UTC",
    }
    return data | changes


def test_the_page_shows_every_figure() -> None:
    page = render(figures()).decode()
    assert page.startswith("<!DOCTYPE html>")
    assert '<meta http-equiv="refresh" content="5">' in page
    for text in (
        '<td id="slot">cdcd_main</td>',
        '<td id="state-row">streaming</td>',
        '<td id="confirmed">0/1A2B3C4</td>',
        '<td id="server">0/1A2C000</td>',
        '<td id="lag-bytes">3.0 MiB</td>',
        '<td id="lag-seconds">1.2 s</td>',
        '<td id="throughput">4,321 events/s, 12 transactions/s</td>',
        '<td id="totals">56,789 / 1,234</td>',
        '<td id="snapshot">1,000</td>',
        '<td id="slot-wal">reserved, retains 5.0 GiB</td>',
        '<span class="state streaming" id="state">streaming</span>',
        "<tr><td>public.orders</td>"
        '<td class="n">1,000</td><td class="n">50,000</td><td class="n">5,000</td>'
        '<td class="n">789</td><td class="n">0</td><td class="n">56,789</td></tr>',
        "<tr><td>0</td><td>file</td><td>0/1A2B3C4</td>",
        "files_published 7",
    ):
        assert text in page, text


def test_unknown_values_and_no_events() -> None:
    page = render(
        figures(server_wal_lsn=None, lag_bytes=None, slot_wal_status=None, tables={}, sinks=[])
    ).decode()
    assert '<td id="server">unknown</td>' in page
    assert '<td id="lag-bytes">unknown</td>' in page
    assert "no events yet" in page


def test_names_are_escaped() -> None:
    page = render(
        figures(name="<b>x</b>", tables={"public.<script>": {"c": 1}}, state="connecting")
    ).decode()
    assert "<script>" not in page and "public.&lt;script&gt;" in page
    assert "cdcd &lt;b&gt;x&lt;/b&gt;" in page


def test_slot_recreations() -> None:
    assert '<td id="slot-recreated">never</td>' in render(figures()).decode()
    stats = Stats(slot_recreations=1, slot_recreated_reason="idle_timeout", slot_recreated_at=0)
    assert collect(stats)["slot_recreated"] == {
        "count": 1,
        "reason": "idle_timeout",
        "at": "1970-01-01 00:00:00 UTC",
    }
    recreated = {"count": 2, "reason": "wal_removed", "at": "2026-01-01 00:00:00 UTC"}
    page = render(figures(slot_recreated=recreated)).decode()
    assert (
        '<td id="slot-recreated">2 time(s), last 2026-01-01 00:00:00 UTC (wal_removed)</td>' in page
    )
