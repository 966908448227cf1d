"""A Docker engine for tests: Debian's ``dockerd`` (package ``docker.io``, installed by
``scripts/setup``) started by hand, and the project's image built with it.

* :func:`start_engine` starts ``dockerd --iptables=false --bridge=none
  --storage-driver=overlay2`` with its own data root, exec root and socket under
  ``$CDCD_DOCKER_DIR`` (default ``/var/cache/cdcd-docker``), so nothing of a system Docker is
  touched. The data root is kept between runs (the base image and the build cache with it);
  an engine already answering on that socket (an earlier run's, a developer's) is reused and
  left running.
* :func:`build_image` builds the Dockerfile with ``--network host`` (containers have no
  bridge network here): on ``python:3.11-slim`` when it can be pulled, otherwise on the
  stand-in base that ``scripts/docker-base`` makes (debootstrap, cached as a tarball under
  the same folder), chosen by the Dockerfile's ``PYTHON_IMAGE`` build argument.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from tests.e2e import REPO

ROOT = Path(os.environ.get("CDCD_DOCKER_DIR", "/var/cache/cdcd-docker"))
OFFICIAL_BASE = "python:3.11-slim"
STAND_IN_BASE = "cdcd-base:bookworm"


def missing_tools() -> list[str]:
    return [tool for tool in ("dockerd", "docker", "debootstrap") if shutil.which(tool) is None]


@dataclass
class Engine:
    socket: Path
    process: subprocess.Popen[bytes] | None = None  # None: an engine that was already running
    log: Path = field(default_factory=lambda: ROOT / "dockerd.log")

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "DOCKER_HOST": f"unix://{self.socket}"}

    def docker(
        self, *args: str, timeout: float = 120, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            ["docker", *args], capture_output=True, text=True, timeout=timeout, env=self.env
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"docker {' '.join(args)} exited {proc.returncode}\n{proc.stdout[-4000:]}"
                f"\n{proc.stderr[-4000:]}"
            )
        return proc

    def answers(self) -> bool:
        if not self.socket.exists():
            return False
        with contextlib.suppress(subprocess.TimeoutExpired):
            return (
                self.docker("info", "--format", "{{.ID}}", check=False, timeout=20).returncode == 0
            )
        return False

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)


def start_engine() -> Engine:
    ROOT.mkdir(parents=True, exist_ok=True)
    engine = Engine(ROOT / "docker.sock")
    if engine.answers():
        return engine
    engine.socket.unlink(missing_ok=True)
    log = engine.log.open("ab")
    engine.process = subprocess.Popen(
        [
            "dockerd",
            "--iptables=false",
            "--ip6tables=false",
            "--bridge=none",
            "--storage-driver=overlay2",
            f"--data-root={ROOT / 'data'}",
            f"--exec-root={ROOT / 'exec'}",
            f"--pidfile={ROOT / 'docker.pid'}",
            f"--host=unix://{engine.socket}",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 90
    while not engine.answers():
        if engine.process.poll() is not None or time.monotonic() > deadline:
            engine.stop()
            tail = engine.log.read_text(errors="replace")[-4000:]
            raise RuntimeError(f"dockerd did not start:\n{tail}")
        time.sleep(0.5)
    return engine


@dataclass
class Image:
    tag: str
    base: str
    size: int
    build_seconds: float


def pick_base(engine: Engine) -> str:
    """``python:3.11-slim`` if it is there or can be pulled, else the stand-in base."""
    if engine.docker("image", "inspect", OFFICIAL_BASE, check=False).returncode == 0:
        return OFFICIAL_BASE
    with contextlib.suppress(subprocess.TimeoutExpired):
        if engine.docker("pull", "-q", OFFICIAL_BASE, check=False, timeout=180).returncode == 0:
            return OFFICIAL_BASE
    proc = subprocess.run(
        [str(REPO / "scripts" / "docker-base"), STAND_IN_BASE, str(ROOT / "cache")],
        capture_output=True,
        text=True,
        timeout=1200,
        env=engine.env,
    )
    assert proc.returncode == 0, f"scripts/docker-base failed:\n{proc.stdout}\n{proc.stderr}"
    return STAND_IN_BASE


def build_image(engine: Engine, tag: str, extra: Sequence[str] = ()) -> Image:
    """Build ``tag``. The build stage is tagged too (``<tag>-build``), so that pruning dangling
    images keeps both stages' layers: the next build reuses them up to the first change."""
    base = pick_base(engine)
    started = time.monotonic()
    common = ["build", "--network", "host", "--build-arg", f"PYTHON_IMAGE={base}", *extra]
    engine.docker(*common, "--target", "build", "-t", f"{tag}-build", str(REPO), timeout=1800)
    engine.docker(*common, "-t", tag, str(REPO), timeout=1800)
    engine.docker("image", "prune", "-f", check=False)  # what the tags no longer reach
    seconds = time.monotonic() - started
    size = int(engine.docker("image", "inspect", tag, "--format", "{{.Size}}").stdout.strip())
    return Image(tag, base, size, seconds)
