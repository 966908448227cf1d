"""``cdcd snapshot --table`` following the snapshot it asked for (docs/snapshots.md,
"Watching"), against a real server and the real daemon: on a terminal (a pty) progress bars
until done; off a terminal with ``--follow``, plain lines with rows, rate and ETA."""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import termios
import time
from pathlib import Path

import pytest

from tests.e2e import REPO, cdcd_cmd, run_cdcd, start_cdcd
from tests.integration.test_incremental_snapshot import (
    LOG,
    _config,
    _state,
    _stop,
    _streaming,
    throttled,
)
from tests.pgharness import PgDatabase

pytestmark = [pytest.mark.pg, pytest.mark.version_independent, pytest.mark.timeout(180)]

ROWS = 30000
#: cdcd.progress_rate.duration: 45s, 3m05s, 2h07m (slowed down, the ETA can be minutes)
ETA = r"(\d+s|\d+m\d\ds|\d+h\d\dm)"


def _on_a_terminal(*args: str, timeout: float = 90) -> tuple[int, str]:
    """Run the CLI with a pty as its terminal; its exit code and everything it drew."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 120, 0, 0))
    env = dict(os.environ, PYTHONUNBUFFERED="1", COLUMNS="120", TERM="xterm")
    proc = subprocess.Popen(
        cdcd_cmd(*args), stdin=slave, stdout=slave, stderr=slave, cwd=REPO, env=env
    )
    os.close(slave)
    chunks = []
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    data = os.read(master, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not data:
                    break
                chunks.append(data)
            elif proc.poll() is not None:
                break
        code = proc.wait(10)
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    return code, b"".join(chunks).decode(errors="replace")


def test_progress_bar_on_a_terminal_and_lines_off_it(pg_db: PgDatabase, tmp_path: Path) -> None:
    pg_db.execute(
        "CREATE TABLE t (id int PRIMARY KEY, v text NOT NULL, n int NOT NULL);"
        f"INSERT INTO t SELECT g, repeat('v', 50) || g, 0 FROM generate_series(1, {ROWS}) g;"
        "ANALYZE t"
    )
    cfg = _config(tmp_path, pg_db.dsn, "never", chunk_rows=100, chunks_in_flight=1)
    LOG[:] = [tmp_path / "cdcd.log"]
    proc = start_cdcd("run", "--config", str(cfg), log_path=LOG[0])
    try:
        _streaming(proc, tmp_path)
        # slowed down for its first seconds: it took under a second at full speed
        with throttled(proc, 4):
            code, drawn = _on_a_terminal("snapshot", "--config", str(cfg), "--table", "public.t")
        assert code == 0, drawn
        assert "requested a snapshot of public.t" in drawn
        # tqdm's bar redrawn in place (carriage returns), ending full
        bars = re.findall(
            r"public\.t +(\d+)%\|[^|]*\| ([\d.]+k?)/([\d.]+k?) rows, ([^\r\n]*)", drawn
        )
        assert len(bars) >= 3, repr(drawn[-3000:])
        assert bars[-1][0] == "100" and bars[-1][1] == bars[-1][2] == "30.0k", bars[-1]
        assert "done" in bars[-1][3], bars[-1]
        running = [b for b in bars if "running" in b[3]]
        assert any(re.search(rf"[\d,]+ rows/s, ETA {ETA}", b[3]) for b in running), running
        assert "\r" in drawn
        assert _state(tmp_path)["public.t"]["status"] == "done"

        # off a terminal: --follow prints plain lines, one when a table's status changes and
        # one every 5 s while it runs. Four times the rows, slowed down for 8 s, so that it
        # runs past the follower's second line
        pg_db.execute(
            f"INSERT INTO t SELECT g, repeat('v', 50) || g, 0 "
            f"FROM generate_series({ROWS} + 1, {4 * ROWS}) g; ANALYZE t"
        )
        with throttled(proc, 8):
            plain = run_cdcd("snapshot", "--config", str(cfg), "--table", "public.t", "--follow")
        lines = plain.stdout.splitlines()
        assert lines[0].startswith("requested a snapshot of public.t (signal at ")
        assert "\r" not in plain.stdout and "|" not in plain.stdout
        assert re.fullmatch(
            r"public\.t  done  120,000 / 120,000 rows  100%  [\d,]+ rows/s  ETA 0s", lines[-1]
        ), lines
        waiting = "waiting for the daemon to take the request (is it running?)"
        assert all(x.startswith("public.t  ") or x == waiting for x in lines[1:]), lines
        assert any(re.search(rf"public\.t  running .* rows/s  ETA {ETA}$", x) for x in lines), lines
        status = run_cdcd("snapshot", "status", "--config", str(cfg), "--follow").stdout
        assert status == "no incremental snapshot running\n"
    finally:
        _stop(proc)
