"""cdcd.directories: every directory cdcd writes is checked by ``cdcd check`` and before ``run``.

The read-only cases run cdcd as a subprocess that cannot override file permissions: as root,
under ``setpriv`` without CAP_DAC_OVERRIDE (root otherwise writes anywhere).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cdcd.config import load_config
from cdcd.directories import ensure_writable, write_problem, written_dirs
from cdcd.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]

CONFIG = """\
source:
  dsn: postgresql://cdc:pw@127.0.0.1:1/shop
snapshot:
  mode: {mode}
sinks:
  - type: file
    path: out
  - type: "null"
"""


def config_in(folder: Path, mode: str = "initial") -> Path:
    folder.mkdir(exist_ok=True)
    path = folder / "cdcd.yaml"
    path.write_text(CONFIG.format(mode=mode))
    return path


def test_written_dirs_are_the_sink_paths_spill_and_state_dirs(tmp_path: Path) -> None:
    config = load_config(config_in(tmp_path))
    assert [(d.key, d.path) for d in written_dirs(config)] == [
        ("sinks[0].path", tmp_path / "out"),
        ("buffer.spill_dir", tmp_path / "cdcd-spill"),
        ("snapshot.state_dir", tmp_path / "cdcd-state"),
    ]
    # snapshot.mode: never too: a `cdcd snapshot --table` request is recorded there
    never = load_config(config_in(tmp_path, mode="never"))
    assert ("snapshot.state_dir", tmp_path / "cdcd-state") in [
        (d.key, d.path) for d in written_dirs(never)
    ]


def test_write_problem_probes_without_leaving_anything(tmp_path: Path) -> None:
    assert write_problem(tmp_path) is None
    assert list(tmp_path.iterdir()) == []  # the probe file is gone
    assert write_problem(tmp_path / "a" / "b") is None  # creatable
    assert not (tmp_path / "a").exists()  # and not created by the check
    (tmp_path / "file").write_text("x")
    assert write_problem(tmp_path / "file") == f"{tmp_path / 'file'} is not a directory"
    problem = write_problem(tmp_path / "file" / "sub")
    assert (
        problem
        == f"{tmp_path / 'file' / 'sub'} cannot be created: {tmp_path / 'file'} is not a directory"
    )


def test_ensure_writable_names_every_key(tmp_path: Path) -> None:
    config = load_config(config_in(tmp_path))
    ensure_writable(config)
    (tmp_path / "out").write_text("a file where the sink wants a folder")
    (tmp_path / "cdcd-spill").write_text("same")
    with pytest.raises(ConfigError) as info:
        ensure_writable(config)
    assert info.value.exit_code == 2
    message = str(info.value)
    assert f"sinks[0].path: {tmp_path / 'out'} is not a directory" in message
    assert f"buffer.spill_dir: {tmp_path / 'cdcd-spill'} is not a directory" in message
    assert "snapshot.state_dir" not in message


def unprivileged() -> list[str]:
    """A command prefix under which file permissions apply to this process too."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("root without setpriv: permissions cannot be made to apply")
    caps = "-dac_override,-dac_read_search"
    return ["setpriv", f"--bounding-set={caps}", f"--inh-caps={caps}", "--"]


@pytest.fixture
def read_only_config(tmp_path: Path) -> Iterator[Path]:
    """A config in a read-only folder: the default spill and state dirs and the file sink's
    relative ``out`` would all be created there."""
    path = config_in(tmp_path / "etc")
    path.parent.chmod(0o555)
    yield path
    path.parent.chmod(0o755)


def cdcd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*unprivileged(), sys.executable, "-m", "cdcd", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if not k.startswith("CDCD_")},
    )


def test_check_fails_naming_each_directory_it_cannot_write(read_only_config: Path) -> None:
    done = cdcd("check", "--config", str(read_only_config))
    assert done.returncode == 2, done.stdout + done.stderr
    rows = {line.split()[0]: line for line in done.stdout.splitlines() if line.strip()}
    folder = read_only_config.parent
    for key, name in (
        ("sinks[0].path", "out"),
        ("buffer.spill_dir", "cdcd-spill"),
        ("snapshot.state_dir", "cdcd-state"),
    ):
        assert "FAIL" in rows[key], rows
        assert f"{folder / name} cannot be created: no write permission on {folder}" in rows[key]
    assert "FAIL" in rows["connection"]  # the rest of the report is still there


def test_run_stops_before_connecting_naming_the_key(read_only_config: Path) -> None:
    done = cdcd("run", "--config", str(read_only_config))
    assert done.returncode == 2, done.stdout + done.stderr
    events = [json.loads(line) for line in done.stderr.splitlines() if line.startswith("{")]
    (error,) = [e for e in events if e["level"] == "error"]  # one line, no traceback
    assert error["error"] == "ConfigError"
    assert "buffer.spill_dir:" in error["event"] and "no write permission on" in error["event"]
    # stopped before any connection attempt (the DSN's port 1 would be retried forever)
    assert [e["event"] for e in events if e is not error] == []


def test_check_with_snapshot_mode_never_still_checks_the_state_dir(tmp_path: Path) -> None:
    """`cdcd snapshot --table` requests are recorded in snapshot.state_dir whatever the mode."""
    path = config_in(tmp_path, mode="never")
    state = tmp_path / "cdcd-state"
    state.mkdir()
    state.chmod(0o555)
    try:
        done = cdcd("check", "--config", str(path))
    finally:
        state.chmod(0o755)
    assert done.returncode == 2, done.stdout + done.stderr
    rows = {line.split()[0]: line for line in done.stdout.splitlines() if line.strip()}
    assert "FAIL" in rows["snapshot.state_dir"], rows
    assert f"{state} is not writable" in rows["snapshot.state_dir"]
    assert "FAIL" not in rows["buffer.spill_dir"]
