"""The benchmark refuses to mix versions: an edit to the cdcd it runs, made while it runs, stops
it (bench/run.py ``check_checkout``), and each result names the commit it measured."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from bench import run


def _checkout(tmp_path: Path) -> Path:
    (tmp_path / "cdcd" / "sub").mkdir(parents=True)
    (tmp_path / "cdcd" / "__init__.py").write_text("")
    (tmp_path / "cdcd" / "sub" / "__init__.py").write_text("")
    (tmp_path / "cdcd" / "sub" / "mod.py").write_text("X = 1\n")
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t")
    env["GIT_COMMITTER_EMAIL"] = "t@t"
    for cmd in (["init", "-q"], ["add", "."], ["commit", "-q", "-m", "x"]):
        subprocess.run(["git", "-C", str(tmp_path), *cmd], check=True, env=env)
    return tmp_path


def test_an_edit_during_the_run_stops_it(tmp_path: Path) -> None:
    checkout = _checkout(tmp_path)
    state = run.prepare_checkout(checkout)
    assert state["commit"] and not state["dirty"]
    assert list((checkout / "cdcd" / "sub" / "__pycache__").glob("mod.*.pyc"))  # compiled
    run.check_checkout(checkout)  # unchanged: goes on
    (checkout / "cdcd" / "sub" / "mod.py").write_text("X = 22\n")
    with pytest.raises(RuntimeError, match="changed while the benchmark ran"):
        run.check_checkout(checkout)


def test_uncommitted_changes_are_reported(tmp_path: Path) -> None:
    checkout = _checkout(tmp_path)
    (checkout / "cdcd" / "new.py").write_text("Y = 2\n")
    state = run.prepare_checkout(checkout)
    assert state["dirty"]
    run.check_checkout(checkout)  # the state at the start is what counts


def test_a_contender_that_ran_another_package_fails(tmp_path: Path) -> None:
    checkout = _checkout(tmp_path)
    run.check_package({"cdcd_package": str(checkout / "cdcd")}, checkout, "base_cdcd_null")
    run.check_package({}, checkout, "base_cdcd_null")  # an older baseline cannot say
    with pytest.raises(RuntimeError, match="base_cdcd_null ran the cdcd package in /elsewhere"):
        run.check_package({"cdcd_package": "/elsewhere/cdcd"}, checkout, "base_cdcd_null")


def test_a_contender_s_page_faults_are_counted() -> None:
    """``minor_faults_per_krow`` comes from wait4: a child that touches 64 MiB of fresh memory
    shows about a fault per 4 KiB page more than one that touches none."""
    import sys

    touch = (
        "import mmap; m = mmap.mmap(-1, {n}); [m.__setitem__(i, 1) for i in range(0, {n}, 4096)]"
    )
    idle = run.run_measured([sys.executable, "-c", touch.format(n=4096)])
    busy = run.run_measured([sys.executable, "-c", touch.format(n=64 << 20)])
    assert idle.returncode == busy.returncode == 0
    assert busy.minor_faults - idle.minor_faults >= 0.9 * (64 << 20) // 4096
