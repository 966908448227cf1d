"""Helpers for end-to-end tests: run the real ``cdcd`` CLI against a real PostgreSQL and read
back what the sinks wrote, independently of cdcd's own reading code."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from collections.abc import Iterable, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import orjson
import yaml

REPO = Path(__file__).resolve().parent.parent


def write_config(
    directory: Path,
    dsn: str,
    *,
    sinks: list[dict[str, Any]] | None = None,
    name: str = "shop",
    snapshot: str = "never",
    **source: Any,
) -> Path:
    """A cdcd YAML config in ``directory``; file sink to ``directory/out`` unless ``sinks``."""
    directory.mkdir(parents=True, exist_ok=True)
    cfg: dict[str, Any] = {
        "name": name,
        "source": {"dsn": dsn, "slot": "cdcd_e2e", "publication": "cdcd_e2e_pub", **source},
        "snapshot": {"mode": snapshot},
        "sinks": sinks or [{"type": "file", "path": "out", "format": "jsonl"}],
        "buffer": {"spill_dir": "spill"},
        "http": {"listen": None},
        "log": {"format": "json", "level": "info"},
    }
    path = directory / "cdcd.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def cdcd_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "cdcd", *args]


def run_cdcd(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run the CLI to completion; on failure the assertion shows its output."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        cdcd_cmd(*args), capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"cdcd {' '.join(args)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}"
            f"\n--- stderr\n{proc.stderr[-6000:]}"
        )
    return proc


def start_cdcd(*args: str, log_path: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    out = log_path.open("ab")
    return subprocess.Popen(cdcd_cmd(*args), stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO)


def data_files(folder: Path, suffix: str = ".jsonl") -> list[Path]:
    """Published data files of one table folder, sorted by name (= event order)."""
    if not folder.is_dir():
        return []
    return sorted(
        p for p in folder.iterdir()
        if p.is_file() and p.name.endswith(suffix) and not p.name.startswith(("_", "."))
    )


def read_events(out: Path, table: str) -> list[dict[str, Any]]:
    """Every event of ``schema.table`` in file-name order."""
    events: list[dict[str, Any]] = []
    for path in data_files(out / table):
        for line in path.read_bytes().splitlines():
            if line.strip():
                events.append(orjson.loads(line))
    return events


def all_events(out: Path) -> Iterator[dict[str, Any]]:
    for folder in sorted(out.iterdir()):
        if folder.is_dir() and not folder.name.startswith("."):
            if folder.name.startswith("_") and folder.name != "_messages":
                continue
            for path in data_files(folder):
                for line in path.read_bytes().splitlines():
                    if line.strip():
                        yield orjson.loads(line)


def position(event: dict[str, Any]) -> tuple[int, int]:
    return (event["source"]["commit_lsn"], event["source"]["seq"])


def assert_no_duplicates(events: Iterable[dict[str, Any]]) -> None:
    seen: dict[tuple[int, int], dict[str, Any]] = {}
    for event in events:
        pos = position(event)
        assert pos not in seen, f"event at {pos} published twice"
        seen[pos] = event


def rebuild(events: Iterable[dict[str, Any]], key_columns: tuple[str, ...]) -> dict[tuple[Any, ...], dict[str, Any]]:
    """Apply events in (commit_lsn, seq) order to an empty table; rows by key."""
    state: dict[tuple[Any, ...], dict[str, Any]] = {}
    for event in sorted(events, key=position):
        op = event["op"]
        if op in ("c", "r", "u"):
            row = event["after"]
            state[tuple(row[c] for c in key_columns)] = row
            if op == "u" and event.get("before") is not None:
                old = tuple(event["before"][c] for c in key_columns)
                if old != tuple(row[c] for c in key_columns):
                    state.pop(old, None)
        elif op == "d":
            old_row = event["before"] if event["before"] is not None else event["key"]
            state.pop(tuple(old_row[c] for c in key_columns), None)
        elif op == "t":
            state.clear()
    return state


def normalize(value: Any) -> Any:
    """Comparable form of a contract JSON value (numeric strings as Decimal)."""
    if isinstance(value, str):
        try:
            return Decimal(value) if value.replace(".", "", 1).lstrip("-").isdigit() else value
        except ArithmeticError:
            return value
    if isinstance(value, float):
        return Decimal(repr(value))
    if isinstance(value, int) and not isinstance(value, bool):
        return Decimal(value)
    return value


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()
