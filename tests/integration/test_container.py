"""The project's Docker image, built by Debian's dockerd and run as a user would
(tests/dockerharness.py; ``scripts/setup`` installs ``docker.io`` and ``debootstrap``).

* the image builds (``python:3.11-slim`` or the stand-in base) and its size is reported;
* ``cdcd --help`` works; the process runs as the unprivileged user 10001 under
  ``--read-only`` (as the Helm chart sets it) and the per-row modules are the compiled ones
  (``python -m cdcd.accel status``);
* with the config mounted at ``/etc/cdcd/cdcd.yaml`` and a data folder at ``/var/lib/cdcd``
  (docs/operating.md), ``check`` passes against a test PostgreSQL and ``run`` streams
  its changes into files; ``/healthz``, ``/readyz``, ``/metrics`` and the status page ``/``
  answer while it streams; ``docker stop`` drains (files published, position confirmed) and the exit code is 0.

Containers use the host's network (``--network host``): dockerd runs here without a bridge.
"""

from __future__ import annotations

import os
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from cdcd.lsn import parse_lsn
from tests.dockerharness import Engine, Image, build_image, missing_tools, start_engine
from tests.e2e import assert_no_duplicates, read_events
from tests.integration.test_crash_safety import wait_for
from tests.pgharness import PgDatabase
from tests.s3harness import free_port

#: the first test waits for the image: debootstrap and the build take minutes on 2 busy cores
pytestmark = [
    pytest.mark.pg,
    pytest.mark.slow,
    pytest.mark.xdist_group("docker"),
    pytest.mark.timeout(1800),
]

UID = 10001


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    missing = missing_tools()
    if missing and os.geteuid() != 0:
        pytest.skip(f"{missing} not installed and not root (scripts/setup installs them as root)")
    assert not missing, f"scripts/setup should have installed {missing}"
    engine = start_engine()
    try:
        yield engine
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def image(engine: Engine) -> Image:
    """Tagged ``cdcd:test`` each run: its layers are the next run's build cache; the image it
    replaces is pruned. Compiled at -O0: the image's tests check that the modules are
    compiled and run, not how fast (the release build keeps -O3)."""
    return build_image(engine, "cdcd:test", ["--build-arg", "MYPYC_OPT_LEVEL=0"])


def test_image_builds_and_reports_its_size(
    image: Image, capsys: pytest.CaptureFixture[str]
) -> None:
    assert image.size > 0
    with capsys.disabled():
        print(
            f"\n[container] image {image.tag} on {image.base}: {image.size / 1e6:.0f} MB, "
            f"built in {image.build_seconds:.0f} s"
        )
    assert image.size < 1_000_000_000, f"image is {image.size / 1e6:.0f} MB"


def test_help(engine: Engine, image: Image) -> None:
    proc = engine.docker("run", "--rm", image.tag, "--help")
    assert proc.stdout.startswith("usage: cdcd")
    for command in ("run", "check", "slot"):
        assert command in proc.stdout


def test_non_root_read_only_and_compiled(engine: Engine, image: Image) -> None:
    probe = (
        "import os, pathlib\n"
        "print(os.getuid(), os.getgid())\n"
        "for p in ('/opt/cdcd/probe', '/etc/cdcd/probe', '/probe'):\n"
        "    try:\n"
        "        pathlib.Path(p).write_text('x'); print('wrote', p)\n"
        "    except OSError as e:\n"
        "        print('refused', p, e.errno)\n"
    )
    proc = engine.docker(
        "run", "--rm", "--read-only", "--entrypoint", "python", image.tag, "-c", probe
    )
    lines = proc.stdout.splitlines()
    assert lines[0] == f"{UID} {UID}"
    assert all(line.startswith("refused") for line in lines[1:]), lines
    status = engine.docker(
        "run",
        "--rm",
        "--read-only",
        "--entrypoint",
        "python",
        image.tag,
        "-m",
        "cdcd.accel",
        "status",
    ).stdout.splitlines()
    assert len(status) >= 5 and all(": compiled (" in line for line in status), status


def http_status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def test_check_run_probes_and_stop(
    engine: Engine, image: Image, pg_db: PgDatabase, tmp_path: Path
) -> None:
    pg_db.execute(
        "CREATE TABLE orders (id int PRIMARY KEY, item text);"
        "INSERT INTO orders SELECT g, 'before ' || g FROM generate_series(1, 50) g"
    )
    port = free_port()
    config = {
        "name": "shop",
        "source": {
            "dsn": pg_db.dsn,
            "slot": "cdcd_docker",
            "publication": "cdcd_docker_pub",
            "create_publication": True,
            "create_slot": True,
        },
        "snapshot": {"mode": "initial", "state_dir": "/var/lib/cdcd/state"},
        "sinks": [{"type": "file", "path": "/var/lib/cdcd/out", "flush_interval": "200ms"}],
        "buffer": {"spill_dir": "/var/lib/cdcd/spill"},
        "log": {"format": "json", "level": "info"},
        "shutdown": {"grace_period": "20s"},
    }
    cfg = tmp_path / "cdcd.yaml"
    cfg.write_text(yaml.safe_dump(config))
    data = tmp_path / "data"
    data.mkdir()
    os.chown(data, UID, UID)
    run_args = [
        "--network", "host", "--read-only", "--tmpfs", "/tmp",
        "-v", f"{cfg}:/etc/cdcd/cdcd.yaml:ro", "-v", f"{data}:/var/lib/cdcd",
        "-e", f"CDCD_HTTP__LISTEN=127.0.0.1:{port}",
    ]  # fmt: skip
    check = engine.docker("run", "--rm", *run_args, image.tag, "check", check=False)
    assert check.returncode == 0, check.stdout + check.stderr

    name = f"cdcd-test-{uuid.uuid4().hex[:8]}"
    engine.docker("run", "-d", "--name", name, *run_args, image.tag)
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for(lambda: http_status(f"{base}/healthz") == 200, "/healthz", 90)
        wait_for(lambda: http_status(f"{base}/readyz") == 200, "/readyz (streaming)")
        top = engine.docker("top", name, "-o", "pid,uid,args").stdout.splitlines()
        assert any(line.split()[1] == str(UID) and "cdcd" in line for line in top[1:]), top
        pg_db.execute(
            "INSERT INTO orders SELECT g, 'after ' || g FROM generate_series(51, 80) g;"
            "UPDATE orders SET item = 'changed' WHERE id <= 10; DELETE FROM orders WHERE id = 80"
        )
        written = parse_lsn(pg_db.fetchval("SELECT pg_current_wal_insert_lsn()::text"))
        out = data / "out"
        wait_for(lambda: len(read_events(out, "public.orders")) >= 50 + 30 + 10 + 1, "events", 90)
        assert "cdcd_events_total" in urllib.request.urlopen(f"{base}/metrics").read().decode()
        page = urllib.request.urlopen(f"{base}/").read().decode()  # the status page
        assert '<td id="slot">cdcd_docker</td>' in page and "public.orders" in page, page
        stop = engine.docker("stop", "-t", "40", name, timeout=90)
        assert stop.returncode == 0
        state = engine.docker("inspect", name, "--format", "{{.State.ExitCode}}").stdout.strip()
        logs = engine.docker("logs", name)
        assert state == "0", logs.stdout[-3000:] + logs.stderr[-3000:]
        assert "stopping: draining sinks" in logs.stdout + logs.stderr
    finally:
        engine.docker("rm", "-f", name, check=False)
    events = read_events(out, "public.orders")
    assert_no_duplicates(events)
    ops = [e["op"] for e in events]
    assert ops.count("r") == 50 and ops.count("c") == 30, ops
    assert ops.count("u") == 10 and ops.count("d") == 1, ops
    confirmed = pg_db.fetchval(
        "SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = 'cdcd_docker'"
    )
    assert parse_lsn(confirmed) >= written, "the drain confirmed what was published"
    assert not [p for p in out.rglob(".*") if p.is_file()], "no temporary file left"
