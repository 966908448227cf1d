"""The HTTP endpoint: ``/healthz`` (alive), ``/readyz`` (connected and streaming) and
``/metrics`` (Prometheus text format), and a status page at ``/`` (cdcd.status_page).

Metrics are read from the pipeline's statistics object (:class:`cdcd.stats.Stats`) when
scraped (a custom collector), so the hot path only increments plain integers; the endpoint
never touches the pipeline itself. The server is a deliberately tiny HTTP/1.1 responder on asyncio
streams: four GET routes, no keep-alive, no dependencies beyond prometheus-client.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import structlog
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from cdcd.progress_rate import SIZE

if TYPE_CHECKING:
    from cdcd.stats import Stats

log = structlog.get_logger("cdcd.health")

WAL_STATUSES = ("reserved", "extended", "unreserved", "lost")


def _snapshot_metrics(s: Stats) -> Iterator[Any]:
    """Per table of an incremental snapshot: rows emitted, estimated, dropped; running; bytes,
    rate and ETA."""
    families: dict[str, Any] = {
        "rows": CounterMetricFamily(
            "cdcd_snapshot_rows", "rows emitted by incremental snapshots", labels=["table"]
        ),
        "estimate": GaugeMetricFamily(
            "cdcd_snapshot_rows_estimated",
            "rows of the table when its snapshot started (pg_class.reltuples; absent when "
            "nothing is known)",
            labels=["table"],
        ),
        "from_size": GaugeMetricFamily(
            "cdcd_snapshot_estimate_from_size",
            "1 when the estimate comes from the table's size (never analysed: its size over a "
            "sample's row width), not from statistics",
            labels=["table"],
        ),
        "dropped": CounterMetricFamily(
            "cdcd_snapshot_rows_dropped",
            "rows read by a chunk but changed in its watermark window (the stream has them)",
            labels=["table"],
        ),
        "running": GaugeMetricFamily(
            "cdcd_snapshot_running", "1 while the table's snapshot runs", labels=["table"]
        ),
        "bytes": CounterMetricFamily(
            "cdcd_snapshot_bytes",
            "bytes of the rows read by incremental snapshots (the text form of their values)",
            labels=["table"],
        ),
        "rate": GaugeMetricFamily(
            "cdcd_snapshot_rows_per_second",
            "rows emitted per second over the last 30 s of the table's snapshot",
            labels=["table"],
        ),
        "eta": GaugeMetricFamily(
            "cdcd_snapshot_eta_seconds",
            "seconds until the estimate at that rate (absent while unknown)",
            labels=["table"],
        ),
    }
    for table, t in sorted(s.snapshots.items()):
        families["rows"].add_metric([table], t.rows)
        if t.estimated_from is not None:
            families["estimate"].add_metric([table], t.estimate)
            families["from_size"].add_metric([table], 1 if t.estimated_from == SIZE else 0)
        families["dropped"].add_metric([table], t.dropped)
        families["running"].add_metric([table], 1 if t.status == "running" else 0)
        families["bytes"].add_metric([table], t.bytes)
        running = t.status == "running"
        families["rate"].add_metric([table], (t.meter.rate or 0.0) if running else 0.0)
        eta = t.eta() if running else 0.0
        if eta is not None:
            families["eta"].add_metric([table], eta)
    yield from families.values()


class StatsCollector(Collector):
    """Reads :class:`~cdcd.stats.Stats` at scrape time."""

    def __init__(self, stats: Stats) -> None:
        self.stats = stats

    def collect(self) -> Iterator[Any]:
        s = self.stats
        yield CounterMetricFamily(
            "cdcd_received_bytes", "pgoutput payload bytes received", value=s.received_bytes
        )
        yield CounterMetricFamily(
            "cdcd_received_messages", "pgoutput messages received", value=s.received_messages
        )
        yield CounterMetricFamily(
            "cdcd_transactions",
            "committed transactions delivered to the sinks",
            value=s.transactions,
        )
        events = CounterMetricFamily(
            "cdcd_events", "change events delivered, by table and op", labels=["table", "op"]
        )
        for (table, op), count in sorted(s.events_by.items()):
            events.add_metric([table, op], count)
        yield events
        yield from _snapshot_metrics(s)
        yield CounterMetricFamily(
            "cdcd_reconnects", "reconnections to the source after a failure", value=s.reconnects
        )
        yield CounterMetricFamily(
            "cdcd_slot_recreated",
            "replication slots replaced after being lost (source.on_slot_lost: recreate)",
            value=s.slot_recreations,
        )
        yield GaugeMetricFamily(
            "cdcd_acknowledged_lsn",
            "LSN confirmed to the server (flush position)",
            value=s.confirmed_lsn,
        )
        yield GaugeMetricFamily(
            "cdcd_server_wal_lsn",
            "the server's current WAL position (polled)",
            value=s.server_wal_end,
        )
        yield GaugeMetricFamily(
            "cdcd_replication_lag_bytes",
            "server WAL position minus the acknowledged LSN",
            value=max(0, s.server_wal_end - s.confirmed_lsn) if s.server_wal_end else 0,
        )
        yield GaugeMetricFamily(
            "cdcd_replication_lag_seconds",
            "now minus the commit time of the last delivered transaction; 0 when caught up",
            value=s.lag_seconds(),
        )
        yield GaugeMetricFamily(
            "cdcd_buffered_bytes",
            "bytes of transactions being assembled in memory",
            value=s.buffered_bytes,
        )
        yield GaugeMetricFamily(
            "cdcd_spilled_bytes",
            "bytes of transactions spilled to disk",
            value=s.spilled_bytes,
        )
        yield GaugeMetricFamily(
            "cdcd_queued_bytes",
            "bytes of committed transactions waiting for or being written to the sinks",
            value=s.queued_bytes,
        )
        yield GaugeMetricFamily(
            "cdcd_open_streamed_transactions",
            "streamed transactions not yet committed or aborted",
            value=s.open_streams,
        )
        yield CounterMetricFamily(
            "cdcd_streamed_changes_rendered",
            "changes of streamed transactions whose row JSON was made as they arrived",
            value=s.rendered_changes,
        )
        yield GaugeMetricFamily(
            "cdcd_held_prepared_transactions",
            "prepared transactions awaiting COMMIT/ROLLBACK PREPARED",
            value=s.held_prepared,
        )
        yield GaugeMetricFamily(
            "cdcd_up", "1 while connected and streaming", value=int(s.streaming)
        )
        yield GaugeMetricFamily(
            "cdcd_source_waiting",
            "1 while no usable source server answers (down, or only a standby not promoted yet)",
            value=int(s.waiting_for is not None and not s.streaming),
        )
        status = GaugeMetricFamily(
            "cdcd_slot_wal_status",
            "the slot's wal_status (1 for the current one)",
            labels=["status"],
        )
        for name in WAL_STATUSES:
            status.add_metric([name], 1 if s.slot_wal_status == name else 0)
        yield status
        if s.slot_safe_wal_size is not None:
            yield GaugeMetricFamily(
                "cdcd_slot_safe_wal_size_bytes",
                "WAL that can still be written before the slot is invalidated",
                value=s.slot_safe_wal_size,
            )
        yield GaugeMetricFamily(
            "cdcd_slot_retained_wal_bytes",
            "WAL the slot holds back (current minus restart_lsn)",
            value=s.slot_retained_bytes,
        )
        yield GaugeMetricFamily(
            "cdcd_tables_breaking_writes",
            "published tables whose UPDATE/DELETE fail on the server: no usable replica identity "
            "(docs/keyless-tables.md)",
            value=len(s.breaking_tables),
        )
        breaking = GaugeMetricFamily(
            "cdcd_table_breaking_writes",
            "1 for each published table whose UPDATE/DELETE fail on the server",
            labels=["table"],
        )
        for table in s.breaking_tables:
            breaking.add_metric([table], 1)
        yield breaking
        yield from self._sinks()

    def _sinks(self) -> Iterator[Any]:
        sinks = self.stats.sinks
        durable = GaugeMetricFamily(
            "cdcd_sink_durable_lsn", "end LSN the sink holds durably", labels=["sink", "index"]
        )
        retries = CounterMetricFamily(
            "cdcd_sink_retries",
            "sink calls retried after a transient error",
            labels=["sink", "index"],
        )
        write = HistogramMetricFamily(
            "cdcd_sink_write_seconds",
            "time to hand one transaction to a sink (begin, writes, commit)",
            labels=["sink"],
        )
        flush = HistogramMetricFamily(
            "cdcd_sink_flush_seconds", "time to make a sink's data durable (flush)", labels=["sink"]
        )
        for i, sink in enumerate(sinks):
            labels = [sink.type_name, str(i)]
            durable.add_metric(labels, sink.durable_lsn)
            retries.add_metric(labels, sink.retries)
            write.add_metric(
                [sink.type_name], sink.write_seconds.cumulative(), sink.write_seconds.sum
            )
            flush.add_metric(
                [sink.type_name], sink.flush_seconds.cumulative(), sink.flush_seconds.sum
            )
        yield from (durable, retries, write, flush)


class Health:
    """Owns the metrics registry and serves the HTTP endpoint."""

    def __init__(self, stats: Stats) -> None:
        self.stats = stats
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(StatsCollector(stats))
        self._server: asyncio.Server | None = None
        self.port: int | None = None

    async def start(self, host: str, port: int) -> None:
        self._server = await asyncio.start_server(self._handle, host, port)
        sock = self._server.sockets[0]
        self.port = sock.getsockname()[1]
        log.info("http endpoint listening", host=host, port=self.port)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)
            self._server = None

    def render(self, path: str) -> tuple[int, bytes, str]:
        if path == "/healthz":
            return 200, b"ok\n", "text/plain"
        if path == "/readyz":
            if self.stats.streaming:
                return 200, b"ready\n", "text/plain"
            why = self.stats.waiting_for
            body = b"not streaming\n" if why is None else f"not streaming: {why}\n".encode()
            return 503, body, "text/plain"
        if path == "/metrics":
            return 200, generate_latest(self.registry), "text/plain; version=0.0.4; charset=utf-8"
        if path == "/":
            from cdcd import status_page

            return 200, status_page.render(status_page.collect(self.stats)), "text/html"
        return 404, b"not found\n", "text/plain"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            line = request.split(b"\r\n", 1)[0].decode("latin-1").split()
            method, path = (line[0], line[1].split("?", 1)[0]) if len(line) >= 2 else ("", "")
            if method not in ("GET", "HEAD"):
                status, body, ctype = 405, b"method not allowed\n", "text/plain"
            else:
                status, body, ctype = self.render(path)
            reason = {
                200: "OK",
                404: "Not Found",
                405: "Method Not Allowed",
                503: "Service Unavailable",
            }[status]
            head = (
                f"HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            ).encode()
            writer.write(head + (b"" if method == "HEAD" else body))
            await writer.drain()
        except (
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
            TimeoutError,
            ConnectionError,
        ):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
