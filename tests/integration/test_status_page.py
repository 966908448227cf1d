"""The status page at ``/`` of a running ``cdcd run``, as a person sees it: headless Chromium
(Debian's ``chromium``) takes a screenshot and Tesseract reads the key figures back from the
picture — state, table, per-operation counts, the sink's durable position — after an initial
snapshot and a streamed workload against a real PostgreSQL.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from cdcd.lsn import format_lsn, parse_lsn
from tests.e2e import start_cdcd, write_config
from tests.integration.test_crash_safety import wait_for
from tests.pgharness import PgDatabase
from tests.s3harness import free_port

pytestmark = [pytest.mark.pg, pytest.mark.version_independent]


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(response.status), response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    except OSError:
        return 0, ""


def screenshot_text(url: str, tmp_path: Path) -> str:
    """What Tesseract reads in Chromium's screenshot of ``url`` (PNG kept in tmp_path)."""
    png = tmp_path / "status.png"
    subprocess.run(
        [
            "chromium",
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            f"--user-data-dir={tmp_path / 'chromium'}",
            "--force-device-scale-factor=2",
            "--window-size=1000,800",
            f"--screenshot={png}",
            url,
        ],
        capture_output=True,
        timeout=120,
        check=True,
    )
    assert png.stat().st_size > 10_000, "an empty screenshot"
    # --psm 6, one uniform block: each row read left to right (the automatic layout analysis
    # may read the overview's labels and its values as two columns)
    return subprocess.run(
        ["tesseract", str(png), "-", "--psm", "6"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout


def test_status_page_in_chromium(pg_db: PgDatabase, tmp_path: Path) -> None:
    missing = [t for t in ("chromium", "tesseract") if shutil.which(t) is None]
    if missing and os.geteuid() != 0:
        pytest.skip(f"{missing} not installed and not root (scripts/setup installs them as root)")
    assert not missing, f"scripts/setup should have installed {missing}"
    pg_db.execute(
        "CREATE TABLE orders (id int PRIMARY KEY, item text);"
        "INSERT INTO orders SELECT g, 'old' FROM generate_series(1, 37) g;"
        "CREATE PUBLICATION cdcd_e2e_pub FOR ALL TABLES"
    )
    port = free_port()
    cfg = write_config(tmp_path, pg_db.dsn, snapshot="initial")
    data = yaml.safe_load(cfg.read_text())
    data["source"]["slot"] = "pageslot"
    data["http"] = {"listen": f"127.0.0.1:{port}"}
    data["snapshot"]["state_dir"] = "state"
    cfg.write_text(yaml.safe_dump(data))
    proc = start_cdcd("run", "--config", str(cfg), log_path=tmp_path / "cdcd.log")
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: get(f"{base}/readyz")[0] == 200, "/readyz")
        pg_db.execute(
            "INSERT INTO orders SELECT g, 'new' FROM generate_series(100, 349) g;"
            "UPDATE orders SET item = 'changed' WHERE id <= 12;"
            "DELETE FROM orders WHERE id > 346"
        )
        written = parse_lsn(pg_db.fetchval("SELECT pg_current_wal_insert_lsn()::text"))
        wait_for(lambda: "302</td></tr>" in get(base + "/")[1], "all events on the page")

        def confirmed() -> int:
            return parse_lsn(
                pg_db.fetchval(
                    "SELECT confirmed_flush_lsn::text FROM pg_replication_slots "
                    "WHERE slot_name = 'pageslot'"
                )
            )

        wait_for(lambda: confirmed() >= written, "the position to be confirmed")
        status, page = get(base + "/")
        assert status == 200
        durable = re.search(r"<td>0</td><td>file</td><td>([0-9A-F]+/[0-9A-F]+)</td>", page)
        assert durable is not None and parse_lsn(durable.group(1)) >= written, page
        text = screenshot_text(base + "/", tmp_path)
    finally:
        proc.terminate()
        proc.wait(30)
    assert re.search(r"state\s+streaming", text), text
    assert re.search(r"slot\s+pageslot", text), text
    assert re.search(r"snapshot rows read\s+37", text), text
    # table, snapshot, insert, update, delete, truncate, total
    assert re.search(r"public\.orders\s+37\s+250\s+12\s+3\s+0\s+302", text), text
    assert re.search(r"302\s*/\s*\d", text), text  # events / transactions
    assert format_lsn(parse_lsn(durable.group(1))) in text.replace("O", "0"), text
