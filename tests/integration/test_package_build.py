"""The package build compiles the mypyc modules (setup.py), from a copy of the sources alone.

``pip wheel`` builds from a clean copy (pyproject.toml, setup.py, README.md, cdcd/ — what the
Dockerfile copies) in pip's isolated build environment, so mypy comes from the build
requirements; the wheel goes into a fresh virtualenv and ``python -m cdcd.accel status --strict``
there says every module runs compiled. Then the installed source of one module is edited: cdcd
imports that source instead, and the other modules of the compiled group too, with a warning.
Without a C compiler the same build says why and installs pure Python.
"""

from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

from cdcd import accel
from tests.e2e import REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def source_copy(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(REPO / name, src / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.so", f"*{accel.RECORD_SUFFIX}")
    shutil.copytree(REPO / "cdcd", src / "cdcd", ignore=ignore)
    return src


def build_wheel(src: Path, out: Path, **env: str) -> tuple[Path, str]:
    """``pip wheel`` from a fresh virtualenv, as on a new machine or in the Dockerfile: none of
    cdcd's dependencies (pydantic, pyarrow, ...) is installed where mypyc type-checks the
    modules it compiles (a compiled module reaching one through its imports failed the build
    there, and fell back to pure Python, while builds in this test's environment compiled)."""
    builder = out.parent / "build-venv"
    venv.create(builder, with_pip=True)
    python = builder / "bin" / "python"
    done = subprocess.run(
        [python, "-m", "pip", "wheel", "-v", "--no-deps", "-w", str(out), str(src)],
        env=os.environ | env,
        capture_output=True,
        text=True,
        timeout=1100,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    (wheel,) = out.glob("cdcd-*.whl")
    return wheel, done.stdout + done.stderr


def test_pip_install_yields_compiled_modules(tmp_path: Path) -> None:
    # -O0: what is proved is that the modules compile and run compiled, not how fast (the
    # default -O3 compile of the group is most of the build's time)
    wheel, _ = build_wheel(source_copy(tmp_path), tmp_path / "dist", MYPYC_OPT_LEVEL="0")
    assert f"-cp{sys.version_info[0]}{sys.version_info[1]}-" in wheel.name  # a binary wheel
    names = zipfile.ZipFile(wheel).namelist()
    for name in accel.ACCELERATED_MODULES:
        path = "/".join(name.split("."))
        assert f"{path}{'.c' if name in accel.C_MODULES else '.py'}" in names
        assert any(n.startswith(f"{path}.") and n.endswith(accel.RECORD_SUFFIX) for n in names)

    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    subprocess.run(
        [python, "-m", "pip", "install", "-q", "--no-deps", str(wheel)], check=True, timeout=300
    )
    # cdcd's dependencies from this test's environment, after the fresh venv's own packages
    deps = ";".join(f"sys.path.append({p!r})" for p in site.getsitepackages())
    probe = f"import sys; {deps}; from cdcd.accel import main; sys.exit(main(sys.argv[1:]))"

    def status(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [python, "-W", "default", "-c", probe, "status", *args],
            cwd=tmp_path,  # not the repository: its cdcd/ must not be the one imported
            env={
                k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "CDCD_PURE_PYTHON")
            },
            capture_output=True,
            text=True,
            timeout=120,
        )

    done = status("--strict")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = dict(line.split(": ", 1) for line in done.stdout.splitlines())
    assert list(lines) == list(accel.ACCELERATED_MODULES)
    assert all(line.startswith("compiled (") for line in lines.values()), lines

    (installed,) = (env_dir / "lib").glob("python3*/site-packages/cdcd/assembler/spill.py")
    installed.write_text(installed.read_text() + "\n# edited after the build\n")
    done = status()
    lines = dict(line.split(": ", 1) for line in done.stdout.splitlines())
    assert lines["cdcd.assembler.spill"].startswith("stale, running the source"), lines
    # one group (cdcd._purepy.COMPILED_GROUP): the other modules run their sources too
    assert lines["cdcd.decoder.tuples"].startswith("stale, running the source"), lines
    assert "spill.py changed since" in lines["cdcd.decoder.tuples"]
    assert "StaleExtensionWarning" in done.stderr and "spill.py changed since" in done.stderr


def test_without_a_compiler_the_build_installs_pure_python(tmp_path: Path) -> None:
    wheel, log = build_wheel(
        source_copy(tmp_path), tmp_path / "dist", CC=str(tmp_path / "no-such-cc")
    )
    assert "cdcd build: no C compiler" in log, log[-3000:]
    assert "as pure Python" in log
    names = zipfile.ZipFile(wheel).namelist()
    assert "cdcd/decoder/tuples.py" in names
    assert not [n for n in names if n.endswith((".so", accel.RECORD_SUFFIX))], names
