"""The directories cdcd writes, and whether it can: checked by ``cdcd check`` and before ``run``.

They are: the directories each sink says it writes into (``Sink.directories``: the file sink's
output folder),
``buffer.spill_dir`` (large transactions spill there) and ``snapshot.state_dir``, in every
``snapshot.mode``: ``never`` too, since a ``cdcd snapshot --table`` request (a signal in the
stream, docs/snapshots.md) is recorded there when the daemon takes it. A directory that exists must accept a new file (a real
probe file is created and removed, so read-only mounts, ACLs and ownership all count); one that
does not exist yet must be creatable, i.e. its nearest existing ancestor is a writable
directory. Failing that, ``run`` would stop later with an I/O error in the middle of streaming;
:func:`ensure_writable` stops it before it starts, with exit code 2 and the config key named.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from cdcd.config import Config
from cdcd.errors import ConfigError


@dataclass(frozen=True)
class WrittenDir:
    key: str  # the config key that names it, e.g. ``sinks[0].path``, ``buffer.spill_dir``
    path: Path


def written_dirs(config: Config) -> list[WrittenDir]:
    """Every directory ``cdcd run`` with this config writes files into."""
    found = []
    for index, spec in enumerate(config.sinks):
        for name, path in spec.sink_class.directories(spec.config).items():
            found.append(WrittenDir(f"sinks[{index}].{name}", path))
    found.append(WrittenDir("buffer.spill_dir", config.buffer.spill_dir))
    # every mode: on-demand snapshots (and snapshot.new_tables) record their progress there
    found.append(WrittenDir("snapshot.state_dir", config.snapshot.state_dir))
    return found


def write_problem(path: Path) -> str | None:
    """Why cdcd cannot write files into directory ``path`` (creating it if needed), or None."""
    path = path.absolute()
    existing = path
    while not existing.exists() and existing.parent != existing:
        existing = existing.parent
    if existing != path:  # cdcd creates the missing part
        if not existing.is_dir():
            return f"{path} cannot be created: {existing} is not a directory"
        if not os.access(existing, os.W_OK | os.X_OK):
            return f"{path} cannot be created: no write permission on {existing}"
        return None
    if not path.is_dir():
        return f"{path} is not a directory"
    try:
        fd, probe = tempfile.mkstemp(prefix=".cdcd-write-check-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        return f"{path} is not writable: {exc.strerror or exc}"
    return None


def unwritable(config: Config) -> list[tuple[WrittenDir, str]]:
    """The directories of :func:`written_dirs` cdcd cannot write, each with the reason."""
    return [(d, problem) for d in written_dirs(config) if (problem := write_problem(d.path))]


def ensure_writable(config: Config) -> None:
    """Raise :class:`ConfigError` (exit 2) naming each key whose directory cdcd cannot write;
    ``cdcd run`` calls it before connecting."""
    problems = unwritable(config)
    if problems:
        lines = [f"{d.key}: {reason}" for d, reason in problems]
        raise ConfigError("cannot write where the config says: " + "; ".join(lines))
