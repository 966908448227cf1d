"""The status page at ``/`` of the HTTP endpoint: the figures of ``/metrics`` for people
without Grafana, as plain HTML that refreshes itself every few seconds (no script).

:func:`collect` reads the pipeline's statistics (:class:`cdcd.stats.Stats`) into a plain dict (slot, state, positions, lag,
throughput, per-table counts, the sinks' durable positions, snapshot rows read);
:func:`render` turns such a dict into the page. The two are separate so the page can be
rendered and tested from a dict alone. Throughput is the change in the counters since the
previous request of the page (or since the first, when requests come faster than a second).
"""

from __future__ import annotations

import html
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from cdcd.lsn import format_lsn
from cdcd.progress_rate import estimate_source, show_estimate, show_percent

if TYPE_CHECKING:
    from cdcd.stats import Stats

REFRESH_SECONDS = 5
OPS = ("r", "c", "u", "d", "t")
OP_NAMES = {"r": "snapshot", "c": "insert", "u": "update", "d": "delete", "t": "truncate"}

#: per Stats object (by id): (monotonic time, events, transactions) of the previous sample
_samples: dict[int, tuple[float, int, int]] = {}


def collect(s: Stats) -> dict[str, Any]:
    """The figures the page shows, from a running pipeline's statistics."""
    now = time.monotonic()
    previous = _samples.get(id(s))
    events_rate = txn_rate = 0.0
    if previous is not None and now - previous[0] > 0:
        spent = now - previous[0]
        events_rate = (s.events - previous[1]) / spent
        txn_rate = (s.transactions - previous[2]) / spent
    if previous is None or now - previous[0] >= 1.0:
        _samples[id(s)] = (now, s.events, s.transactions)
    tables: dict[str, dict[str, int]] = {}
    for (table, op), count in s.events_by.items():
        tables.setdefault(table, dict.fromkeys(OPS, 0))[op] = count
    snapshot_rows = sum(counts["r"] for counts in tables.values())
    if s.streaming:
        state = "streaming"
    elif s.connected and snapshot_rows:
        state = "snapshot"
    else:
        state = "connecting" if not s.connected else "starting"
    sinks = []
    for sink in s.sinks:
        details = {"handed": format_lsn(sink.handed_lsn), "retries": sink.retries}
        sinks.append(
            {"type": sink.type_name, "durable_lsn": format_lsn(sink.durable_lsn), "stats": details}
        )
    return {
        "name": s.name,
        "slot": s.slot,
        "state": state,
        "confirmed_lsn": format_lsn(s.confirmed_lsn),
        "server_wal_lsn": format_lsn(s.server_wal_end) if s.server_wal_end else None,
        "lag_bytes": max(0, s.server_wal_end - s.confirmed_lsn) if s.server_wal_end else None,
        "lag_seconds": s.lag_seconds(),
        "transactions": s.transactions,
        "events": s.events,
        "events_per_second": events_rate,
        "transactions_per_second": txn_rate,
        "reconnects": s.reconnects,
        "slot_recreated": {
            "count": s.slot_recreations,
            "reason": s.slot_recreated_reason,
            "at": datetime.fromtimestamp(s.slot_recreated_at, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
            if s.slot_recreated_at is not None
            else None,
        },
        "slot_wal_status": s.slot_wal_status,
        "breaking_tables": list(s.breaking_tables),
        "retained_wal_bytes": s.slot_retained_bytes,
        "snapshot_rows": snapshot_rows,
        "tables": {t: tables[t] for t in sorted(tables)},
        "snapshots": {
            t: {
                "status": p.status,
                "rows": p.rows,
                "estimate": p.estimate,
                "estimated_from": p.estimated_from,
                "dropped": p.dropped,
            }
            for t, p in sorted(s.snapshots.items())
        },
        "sinks": sinks,
        "generated_at": datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
    }


def _size(n: int | None) -> str:
    if n is None:
        return "unknown"
    for unit, factor in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= factor:
            return f"{n / factor:.1f} {unit}"
    return f"{n} B"


def _row(label: str, value: object, key: str) -> str:
    return f'<tr><th>{html.escape(label)}</th><td id="{key}">{html.escape(str(value))}</td></tr>'


_STYLE = """
body { font: 15px/1.4 "DejaVu Sans", sans-serif; margin: 24px; color: #1d2430; }
h1 { font-size: 22px; margin: 0 0 4px; } h2 { font-size: 17px; margin: 22px 0 6px; }
.state { display: inline-block; padding: 2px 10px; border-radius: 10px; color: #fff; }
.streaming { background: #1d7a3a; } .snapshot { background: #2a5db0; }
.connecting, .starting { background: #a66a00; }
table { border-collapse: collapse; } th, td { padding: 4px 12px; text-align: left; }
td.n, th.n { text-align: right; font-variant-numeric: tabular-nums; }
table.grid th, table.grid td { border-bottom: 1px solid #d5d9e0; }
.muted { color: #667; font-size: 13px; }
.alarm { background: #b3261e; color: #fff; padding: 8px 12px; border-radius: 6px; }
"""


def _recreated(info: dict[str, Any] | None) -> str:
    """``source.on_slot_lost: recreate``: how often, and the last time and reason."""
    if not info or not info["count"]:
        return "never"
    return f"{info['count']} time(s), last {info['at']} ({info['reason']})"


def _percent(p: dict[str, Any]) -> str:
    return show_percent(p["status"], p["rows"], p["estimate"], estimate_source(p))


def render(data: dict[str, Any]) -> bytes:
    """The page for a dict shaped like :func:`collect`'s."""
    e = html.escape
    state = str(data["state"])
    lag_seconds = data["lag_seconds"]
    overview = "".join(
        [
            _row("state", state, "state-row"),
            _row("slot", data["slot"], "slot"),
            _row("confirmed position", data["confirmed_lsn"], "confirmed"),
            _row("server WAL position", data["server_wal_lsn"] or "unknown", "server"),
            _row("lag", _size(data["lag_bytes"]), "lag-bytes"),
            _row("lag (time)", f"{lag_seconds:.1f} s", "lag-seconds"),
            _row(
                "throughput",
                f"{data['events_per_second']:,.0f} events/s, "
                f"{data['transactions_per_second']:,.0f} transactions/s",
                "throughput",
            ),
            _row(
                "events / transactions", f"{data['events']:,} / {data['transactions']:,}", "totals"
            ),
            _row("snapshot rows read", f"{data['snapshot_rows']:,}", "snapshot"),
            _row("reconnects", data["reconnects"], "reconnects"),
            _row("slot recreated", _recreated(data.get("slot_recreated")), "slot-recreated"),
            _row(
                "tables whose writes fail",
                ", ".join(data.get("breaking_tables") or ()) or "none",
                "breaking-tables",
            ),
            _row(
                "slot WAL",
                f"{data['slot_wal_status'] or 'unknown'}, retains {_size(data['retained_wal_bytes'])}",
                "slot-wal",
            ),
        ]
    )
    head = "".join(f'<th class="n">{e(OP_NAMES[op])}</th>' for op in OPS)
    rows = (
        "".join(
            f"<tr><td>{e(table)}</td>"
            + "".join(f'<td class="n">{counts.get(op, 0):,}</td>' for op in OPS)
            + f'<td class="n">{sum(counts.values()):,}</td></tr>'
            for table, counts in data["tables"].items()
        )
        or f'<tr><td colspan="{len(OPS) + 2}" class="muted">no events yet</td></tr>'
    )
    sinks = "".join(
        f"<tr><td>{i}</td><td>{e(sink['type'])}</td><td>{e(sink['durable_lsn'])}</td>"
        f'<td class="muted">{e(", ".join(f"{k} {v}" for k, v in sink["stats"].items()))}</td></tr>'
        for i, sink in enumerate(data["sinks"])
    )
    snapshots = "".join(
        f"<tr><td>{e(table)}</td><td>{e(p['status'])}</td>"
        f'<td class="n">{p["rows"]:,}</td>'
        f'<td class="n">{show_estimate(p["estimate"], estimate_source(p))}</td>'
        f'<td class="n">{_percent(p)}</td><td class="n">{p["dropped"]:,}</td></tr>'
        for table, p in data.get("snapshots", {}).items()
    )
    if snapshots:
        snapshots = (
            '<h2>Incremental snapshots</h2><table class="grid" id="snapshots"><tr><th>table</th>'
            '<th>status</th><th class="n">rows</th><th class="n">estimate</th>'
            f'<th class="n">done</th><th class="n">dropped</th></tr>{snapshots}</table>'
        )
    breaking = data.get("breaking_tables") or []
    alarm = (
        f'<p class="alarm" id="breaking-alarm">UPDATE and DELETE fail on '
        f"{e(', '.join(breaking))}: published without a usable replica identity "
        "(see docs/keyless-tables.md)</p>"
        if breaking
        else ""
    )
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="refresh" content="{REFRESH_SECONDS}">
<title>cdcd {e(data["name"])}: {e(state)}</title><style>{_STYLE}</style></head>
<body>
<h1>cdcd {e(data["name"])} <span class="state {e(state)}" id="state">{e(state)}</span></h1>
<div class="muted">{e(data["generated_at"])}, refreshes every {REFRESH_SECONDS} s ·
<a href="/metrics">/metrics</a> · <a href="/readyz">/readyz</a></div>
{alarm}<h2>Replication</h2><table>{overview}</table>
<h2>Tables</h2>
<table class="grid" id="tables"><tr><th>table</th>{head}<th class="n">total</th></tr>{rows}</table>
{snapshots}
<h2>Sinks</h2>
<table class="grid" id="sinks"><tr><th>#</th><th>type</th><th>durable position</th><th>stats</th></tr>{sinks}</table>
</body></html>
"""
    return page.encode()
