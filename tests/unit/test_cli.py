"""cdcd.cli: usage, exit codes, dispatch to cdcd.commands / cdcd.quickstart, error reporting."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
from pydantic import BaseModel, ConfigDict

import cdcd
from cdcd import __version__
from cdcd.cli import main
from cdcd.config import Config
from cdcd.errors import ConfigError, DefiniteSourceError, TransientSinkError
from cdcd.runtime import run_async
from cdcd.sinks import registry
from cdcd.sinks.base import Sink

REPO = Path(__file__).resolve().parents[2]

CONFIG = """\
source:
  dsn: postgresql://cdc:T0pSecret@127.0.0.1:1/shop
sinks:
  - type: "null"
log:
  format: json
  level: {level}
"""


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv("CDCD_CONFIG", raising=False)
    # the null sink is written in parallel with this module: stand in for it
    monkeypatch.setitem(registry.BUILTIN_SINKS, "null", f"{__name__}:NullSink")
    yield
    # main() configured logging onto pytest's captured stderr: take that handler down again
    root = logging.getLogger()
    for handler in [h for h in root.handlers if h.get_name() == "cdcd"]:
        root.removeHandler(handler)
    structlog.reset_defaults()


class NullSink(Sink):
    class Config(BaseModel):
        model_config = ConfigDict(extra="forbid")

    async def begin(self, txn: Any) -> None: ...
    async def write(self, events: Any) -> None: ...
    async def commit(self, txn: Any) -> None: ...
    async def flush(self) -> None: ...


def config_file(tmp_path: Path, level: str = "info") -> str:
    path = tmp_path / "cdcd.yaml"
    path.write_text(CONFIG.format(level=level))
    return str(path)


class FakeApp:
    """Records what the CLI dispatches; ``behaviour`` decides what each call does."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []
        self.behaviour: Any = 0

    def _act(self, *call: Any) -> int:
        self.calls.append(call)
        if isinstance(self.behaviour, BaseException):
            raise self.behaviour
        return int(self.behaviour)

    def run(self, config: Config, endpos: int | None) -> int:
        return self._act("run", config, endpos)

    def check(self, config: Config) -> int:
        return self._act("check", config)

    def slot(self, config: Config, action: str) -> int:
        return self._act("slot", config, action)

    def quickstart(self, args: argparse.Namespace) -> int:
        return self._act("quickstart", args)


@pytest.fixture
def app(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeApp]:
    fake = FakeApp()
    app_module = types.ModuleType("cdcd.commands")
    app_module.run = fake.run  # type: ignore[attr-defined]
    app_module.check = fake.check  # type: ignore[attr-defined]
    app_module.slot = fake.slot  # type: ignore[attr-defined]
    quickstart_module = types.ModuleType("cdcd.quickstart")
    quickstart_module.main = fake.quickstart  # type: ignore[attr-defined]
    for name, module in (("commands", app_module), ("quickstart", quickstart_module)):
        monkeypatch.setitem(sys.modules, f"cdcd.{name}", module)
        monkeypatch.setattr(cdcd, name, module, raising=False)
    yield fake


# -- usage -------------------------------------------------------------------------------------


def test_help(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for word in (
        "run",
        "check",
        "slot",
        "quickstart",
        "examples:",
        "CDCD_SOURCE__DSN",
        "exit codes",
    ):
        assert word in out


@pytest.mark.parametrize("command", ["run", "check", "slot", "quickstart"])
def test_subcommand_help(capsys: pytest.CaptureFixture[str], command: str) -> None:
    assert main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: cdcd {command}")
    assert "example" in out


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"cdcd {__version__}"


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["frobnicate"],
        ["run"],
        ["slot", "--config", "x.yaml"],
        ["slot", "rename", "--config", "x.yaml"],
        ["run", "--config", "x.yaml", "--endpos", "not-an-lsn"],
        ["quickstart", "--duration", "-1"],
        ["--no-such-option"],
    ],
)
def test_bad_usage_exits_2(capsys: pytest.CaptureFixture[str], argv: list[str]) -> None:
    assert main(argv) == 2
    assert "usage: cdcd" in capsys.readouterr().err


def test_config_from_environment(
    app: FakeApp, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CDCD_CONFIG", config_file(tmp_path))
    assert main(["check"]) == 0
    assert app.calls[0][0] == "check"


# -- invalid config ----------------------------------------------------------------------------


def test_invalid_config_exits_2_naming_the_key(
    app: FakeApp, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(CONFIG.format(level="info") + "buffer: {memory_limit: 12XB}\n")
    assert main(["run", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "buffer.memory_limit: bad size '12XB'" in err
    assert "T0pSecret" not in err
    assert app.calls == []


def test_missing_config_file_exits_2(app: FakeApp, tmp_path: Path, capsys: Any) -> None:
    assert main(["check", "--config", str(tmp_path / "nope.yaml")]) == 2
    assert "cannot read config file" in capsys.readouterr().err


def python(*args: str) -> subprocess.CompletedProcess[str]:
    """``python args`` in the repository, without the CDCD_ variables of the environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CDCD_")}
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, cwd=REPO, env=env, timeout=60
    )


def test_python_dash_m_reports_bad_config(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("source: {dsn: 'host=x', slto: 1}\nsinks: [{type: memory}]\n")
    done = python("-m", "cdcd", "check", "--config", str(path))
    assert done.returncode == 2, done.stderr
    assert "source.slto: unknown key" in done.stderr


def test_python_dash_m_version_and_unknown_command() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "cdcd", "--version"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert (done.returncode, done.stdout.strip()) == (0, f"cdcd {__version__}")
    done = subprocess.run(
        [sys.executable, "-m", "cdcd", "bogus"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    assert done.returncode == 2
    assert "invalid choice: 'bogus'" in done.stderr


# -- dispatch ----------------------------------------------------------------------------------


def test_run_dispatches_with_config_and_endpos(app: FakeApp, tmp_path: Path) -> None:
    path = config_file(tmp_path)
    assert main(["run", "--config", path]) == 0
    assert main(["run", "--config", path, "--endpos", "1/A0"]) == 0
    (_, config, endpos_none), (_, _, endpos) = app.calls
    assert isinstance(config, Config)
    assert config.config_dir == tmp_path
    assert endpos_none is None
    assert endpos == (1 << 32) | 0xA0


@pytest.mark.parametrize("action", ["create", "drop", "status"])
def test_slot_dispatches_the_action(app: FakeApp, tmp_path: Path, action: str) -> None:
    assert main(["slot", action, "--config", config_file(tmp_path)]) == 0
    assert app.calls[0][0::2] == ("slot", action)


def test_check_returns_what_the_app_returns(app: FakeApp, tmp_path: Path) -> None:
    app.behaviour = 3
    assert main(["check", "-c", config_file(tmp_path)]) == 3


def test_quickstart_dispatch_and_defaults(app: FakeApp) -> None:
    assert main(["quickstart"]) == 0
    assert main(["quickstart", "--duration", "5", "--dir", "/tmp/qs", "--rate", "50"]) == 0
    (_, defaults), (_, given) = app.calls
    assert (defaults.duration, defaults.dir, defaults.rate) == (30.0, "cdcd-quickstart", 10.0)
    assert (given.duration, given.dir, given.rate) == (5.0, "/tmp/qs", 50.0)


# -- errors from the app -----------------------------------------------------------------------


def test_definite_source_error_exits_3_with_one_line(
    app: FakeApp, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    app.behaviour = DefiniteSourceError(
        "wal_level is 'replica'; set wal_level = logical (password was T0pSecret)"
    )
    assert main(["run", "--config", config_file(tmp_path)]) == 3
    err = capsys.readouterr().err
    [line] = err.strip().splitlines()
    assert "wal_level is 'replica'" in line
    assert '"level":"error"' in line
    assert "DefiniteSourceError" in line
    assert "Traceback" not in err
    assert "T0pSecret" not in err


def test_error_traceback_only_at_debug(
    app: FakeApp, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    app.behaviour = TransientSinkError("broker unavailable")
    assert main(["run", "--config", config_file(tmp_path, level="debug")]) == 1
    assert "Traceback" in capsys.readouterr().err


def test_config_error_from_the_app_exits_2(app: FakeApp, tmp_path: Path) -> None:
    app.behaviour = ConfigError("source.proto_version: 4 is not supported by this server")
    assert main(["check", "--config", config_file(tmp_path)]) == 2


def test_unexpected_exception_exits_1_with_traceback(
    app: FakeApp, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    app.behaviour = RuntimeError("boom")
    assert main(["check", "--config", config_file(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "unexpected error" in err
    assert "RuntimeError: boom" in err


def test_keyboard_interrupt_exits_130(app: FakeApp, tmp_path: Path) -> None:
    app.behaviour = KeyboardInterrupt()
    assert main(["run", "--config", config_file(tmp_path)]) == 130
    assert main(["quickstart"]) == 130


# -- event loop --------------------------------------------------------------------------------


def test_run_async_uses_uvloop() -> None:
    async def which_loop() -> str:
        await asyncio.sleep(0)
        return type(asyncio.get_running_loop()).__module__

    assert run_async(which_loop()).startswith("uvloop")


_REQUEST_ONLY = """\
import sys

from cdcd import cli, snapshot_command


async def request_async(config, tables, out=sys.stdout):
    out.write(f"requested {tables} on {config.source.slot}\\n")
    return 0


snapshot_command.request_async = request_async
code = cli.main(["snapshot", "--config", sys.argv[1], "--table", "public.t", "--no-follow"])
heavy = ("structlog", "rich", "cdcd.source.prepare", "cdcd.replication.client", "cdcd.pipeline",
         "cdcd.wire.session")
print(code, [m for m in heavy if m in sys.modules])
"""


@pytest.mark.parametrize("sink", ['type: "null"', "{type: file, path: out, format: jsonl}"])
def test_snapshot_request_imports_neither_logging_nor_the_daemon(tmp_path: Path, sink: str) -> None:
    """`cdcd snapshot --table` is a short client: a request that goes through logs nothing, so
    its start-up leaves out structlog (with rich) and the daemon's modules."""
    path = tmp_path / "cdcd.yaml"
    path.write_text(CONFIG.format(level="info").replace('- type: "null"', f"- {sink}"))
    done = python("-c", _REQUEST_ONLY, str(path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["requested ['public.t'] on cdcd", "0 []"]
    assert done.stderr == ""
