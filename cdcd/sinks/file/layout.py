"""The file sink's layout on disk (docs/files.md): file and folder names, the table
writers (JSON Lines here; Parquet in :mod:`cdcd.sinks.file.parquet`), and publishing: a file is
written under a hidden name, fsynced, renamed, and its folder fsynced.

Shared by the sink (:mod:`cdcd.sinks.file.sink`), the Parquet writer and object storage
(:mod:`cdcd.sinks.file.storage`), none of which import each other through it.
"""

from __future__ import annotations

import abc
import contextlib
import errno
import os
import re
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Final

import orjson

from cdcd.decoder.events import Relation
from cdcd.errors import DefiniteSinkError, SinkError, TransientSinkError
from cdcd.events import ChangeEvent
from cdcd.events.snapshot_run import SnapshotRun
from cdcd.log import LazyLogger

if TYPE_CHECKING:
    from cdcd.sinks.file.config import FileSinkConfig

Position = tuple[int, int]

MESSAGES_FOLDER = "_messages"
TRANSACTIONS_FOLDER = "_transactions"
SCHEMA_FOLDER = "_schema"

DATA_NAME = re.compile(r"([0-9A-F]{16})-([0-9A-F]{8})(\.[a-z]+)")
TXN_NAME = re.compile(r"([0-9A-F]{16})\.jsonl")
_TRANSIENT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


@dataclass
class Recovered:
    """What a previous run left in a folder."""

    last: Position | None = None
    schemas: list[tuple[Position, Path]] = field(default_factory=list)


# --- names -----------------------------------------------------------------------------------


def data_file_name(position: Position, suffix: str) -> str:
    """``<commit_lsn:016X>-<seq:08X><suffix>``: sorting names sorts positions."""
    return f"{position[0]:016X}-{position[1]:08X}{suffix}"


def parse_data_file_name(name: str) -> tuple[Position, str] | None:
    """``(position, suffix)`` of a data file name; None for anything else."""
    match = DATA_NAME.fullmatch(name)
    if match is None:
        return None
    return (int(match.group(1), 16), int(match.group(2), 16)), match.group(3)


def escape_name(name: str) -> str:
    escaped = name.replace("%", "%25").replace("/", "%2F").replace("\x00", "%00")
    return "%2E" + escaped[1:] if escaped.startswith(".") else escaped


def table_folder_name(schema: str, table: str) -> str:
    """``<schema>.<table>`` with ``%``, ``/``, NUL and a leading ``.`` percent-encoded."""
    return f"{escape_name(schema)}.{escape_name(table)}"


def temp_path(final: Path) -> Path:
    """The hidden name a file is written under before it is published."""
    return final.with_name(f".{final.name}.tmp")


def io_error(exc: OSError, action: str, path: Path | str) -> SinkError:
    reason = exc.strerror or str(exc)
    message = f"file sink: cannot {action} {path}: {reason}"
    if exc.errno in _TRANSIENT_ERRNOS:
        return TransientSinkError(message)
    return DefiniteSinkError(message)


def last_line(path: Path) -> bytes | None:
    """The last non-empty line of a file (read backwards, in chunks)."""
    with path.open("rb") as f:
        pos = f.seek(0, os.SEEK_END)
        tail = b""
        while pos > 0:
            step = min(65536, pos)
            pos -= step
            f.seek(pos)
            tail = f.read(step) + tail
            stripped = tail.rstrip(b"\n")
            cut = stripped.rfind(b"\n")
            if cut >= 0:
                return stripped[cut + 1 :]
        return tail.rstrip(b"\n") or None


# --- writers ---------------------------------------------------------------------------------


class TableWriter(abc.ABC):
    """One data file being written under its temporary name (see the module docstring)."""

    #: file name suffix, with the dot
    suffix: ClassVar[str]
    #: publish the open file before an event whose columns differ from the file's
    roll_on_schema_change: ClassVar[bool] = False

    def __init__(self, path: Path, relation: Relation | None, config: FileSinkConfig) -> None:
        self.path = path
        self.relation = relation
        self.config = config
        self.rows = 0
        #: bytes this writer should keep in memory at most (set by the sink; None: unbounded)
        self.memory_budget: int | None = None

    def buffered(self) -> int:
        """Bytes of events held in memory and not yet written to the file (an estimate)."""
        return 0

    @abc.abstractmethod
    def write(self, events: Sequence[ChangeEvent]) -> None:
        """Append events (all of one Relation object, in position order)."""

    @abc.abstractmethod
    def size(self) -> int:
        """Bytes written so far (an estimate is fine), for ``rollover_bytes``."""

    @abc.abstractmethod
    def finish(self) -> None:
        """Complete the file and close it; fsync it first when ``config.fsync``."""

    @abc.abstractmethod
    def discard(self) -> None:
        """Close the file without completing it and delete it."""

    @classmethod
    @abc.abstractmethod
    def last_position(cls, path: Path) -> Position:
        """``(commit_lsn, seq)`` of the last event in a published file."""


def sync_and_release(fd: int) -> None:
    """fsync a completed data file, then tell the kernel its cached pages may go (docs/files.md: the next file's writes reuse them instead of taking fresh memory; measured on the
    10,000,000-row snapshot, docs/snapshots.md). Only advice: where the platform has no
    ``posix_fadvise`` or refuses it, nothing changes."""
    os.fsync(fd)
    fadvise = getattr(os, "posix_fadvise", None)
    if fadvise is not None:
        with contextlib.suppress(OSError):
            fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def write_pieces(fd: int, pieces: list[bytes]) -> int:
    """Write ``pieces`` one after the other to ``fd`` with ``os.writev`` (a short write goes
    on from where it stopped); the bytes written."""
    total = 0
    for start in range(0, len(pieces), _IOV_MAX):
        group: list[bytes | memoryview] = list(pieces[start : start + _IOV_MAX])
        left = sum(len(piece) for piece in group)
        total += left
        while left:
            done = os.writev(fd, group)
            if done <= 0:
                raise OSError(errno.EIO, f"writev wrote nothing with {left} bytes left")
            left -= done
            while group and done >= len(group[0]):  # what was written, whole
                done -= len(group[0])
                del group[0]
            if done:  # and the piece it stopped in
                group[0] = memoryview(group[0])[done:]
    return total


_IOV_MAX: Final = 512  # pieces per writev call (POSIX guarantees 16, Linux takes 1024)


class JsonlTableWriter(TableWriter):
    """JSON Lines: each event's ``record_json()`` and a newline, one buffered write per batch
    (a snapshot's batch: its records from one call). Snapshot batches are written here, not by
    a worker thread: measured, a thread made S1 slower (2.09 against 1.57 µs of CPU per row,
    ``bench/results/2026-11-24-s1-3m-write-thread-ab.json``)."""

    suffix = ".jsonl"

    def __init__(self, path: Path, relation: Relation | None, config: FileSinkConfig) -> None:
        super().__init__(path, relation, config)
        self._file = path.open("wb", buffering=1 << 20)
        self._size = 0

    def write(self, events: Sequence[ChangeEvent]) -> None:
        if isinstance(events, SnapshotRun):  # a snapshot's rows: their records from one call
            pieces = events.jsonl()
            if pieces is not None:  # written as they are, not copied through the buffer
                self._file.flush()
                self._size += write_pieces(self._file.fileno(), pieces)
                self.rows += len(events)
                return
        self.write_lines([event.record_json() for event in events])

    def write_lines(self, lines: list[bytes]) -> None:
        data = b"\n".join(lines)
        self._file.write(data)
        self._file.write(b"\n")
        self._size += len(data) + 1
        self.rows += len(lines)

    def size(self) -> int:
        return self._size

    def finish(self) -> None:
        self._file.flush()
        if self.config.fsync:
            sync_and_release(self._file.fileno())
        self._file.close()

    def discard(self) -> None:
        self._file.close()
        self.path.unlink(missing_ok=True)

    @classmethod
    def last_position(cls, path: Path) -> Position:
        line = last_line(path)
        try:
            source = orjson.loads(line or b"")["source"]
            return int(source["commit_lsn"]), int(source["seq"])
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise DefiniteSinkError(
                f"file sink: cannot read the last event position of {path}: {exc}"
            ) from exc


class TransactionLogWriter(JsonlTableWriter):
    """``_transactions`` files: BEGIN is at ``(commit_lsn, 0)``, END at ``(commit_lsn, 1)``."""

    @classmethod
    def last_position(cls, path: Path) -> Position:
        try:
            marker = orjson.loads(last_line(path) or b"")
            return int(marker["commit_lsn"]), 0 if marker["status"] == "BEGIN" else 1
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
            raise DefiniteSinkError(
                f"file sink: cannot read the last transaction marker of {path}: {exc}"
            ) from exc


# --- publication -----------------------------------------------------------------------------


#: a publication job that takes longer than this means a slow or stalled disk: the file sink
#: then publishes in its worker thread, not on the event loop, until a job is quick again
QUICK_PUBLISH_SECONDS = 0.01
#: at most one ``file_publish_slow`` warning this often: on a busy host publishing turns slow
#: and quick again many times a second, and each turn is not worth a line
SLOW_LOG_EVERY_SECONDS = 60.0

log = LazyLogger(__name__)


class Publisher:
    """Renames completed files into place and fsyncs the folders that changed."""

    #: writes to a local disk (an object store's publisher uploads: not local)
    local = True

    def __init__(self, fsync: bool) -> None:
        self.fsync = fsync
        self._dirty: set[Path] = set()
        self.last_seconds = 0.0  # how long the last publication job took
        self._warned_at: float | None = None  # when file_publish_slow was last logged
        self._said_slow = False  # the last turn to slow was logged: say when it ends
        self._turns = 0  # turns to slow since the last warning

    @property
    def quick(self) -> bool:
        """The last publication job took at most ``QUICK_PUBLISH_SECONDS``."""
        return self.last_seconds <= QUICK_PUBLISH_SECONDS

    def make_dir(self, path: Path) -> None:
        if not path.is_dir():
            path.mkdir(parents=True, exist_ok=True)
            self._dirty.add(path.parent)

    def mark_dirty(self, folder: Path) -> None:
        self._dirty.add(folder)

    def publish(self, tmp: Path, final: Path) -> None:
        os.replace(tmp, final)
        self._dirty.add(final.parent)

    def write_file(self, final: Path, data: bytes) -> None:
        """Write a small file completely and publish it."""
        tmp = temp_path(final)
        with tmp.open("wb") as f:
            f.write(data)
            f.flush()
            if self.fsync:
                os.fsync(f.fileno())
        self.publish(tmp, final)

    def take_dirty(self) -> set[Path]:
        """The folders changed since the last call, for a publication job to fsync."""
        dirty, self._dirty = self._dirty, set()
        return dirty

    def sync(self) -> None:
        sync_folders(self.take_dirty(), self.fsync)

    def publish_files(self, files: Sequence[tuple[TableWriter, Path]], dirty: set[Path]) -> None:
        """One publication job, timed; the log says when jobs turn slow and quick again."""
        was_quick = self.quick
        began = time.monotonic()
        publish_files(files, dirty, self.fsync)
        self.last_seconds = seconds = time.monotonic() - began
        if was_quick and not self.quick:
            self._turns += 1
            now = time.monotonic()
            self._said_slow = (
                self._warned_at is None or now - self._warned_at >= SLOW_LOG_EVERY_SECONDS
            )
            if self._said_slow:
                log.warning(
                    "file_publish_slow",
                    folder=str(files[0][1].parent) if files else None,
                    seconds=round(seconds, 3),
                    turned_slow=self._turns,  # times since the last warning, this one included
                )
                self._warned_at, self._turns = now, 0
        elif self.quick and not was_quick and self._said_slow:
            log.info("file_publish_quick", seconds=round(seconds, 4))


def sync_folders(folders: Iterable[Path], fsync: bool) -> None:
    """fsync folders, deepest first (``_schema`` before its table, tables before the root), so
    a published file's folder entry is durable before its parent's."""
    if not fsync:
        return
    for path in sorted(folders, key=lambda p: len(p.parts), reverse=True):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as exc:
            raise io_error(exc, "fsync folder", path) from exc


def publish_files(files: Sequence[tuple[TableWriter, Path]], dirty: set[Path], fsync: bool) -> None:
    """One publication job (run in a worker thread): complete each file (fsync), rename it
    into place, in the order given, then fsync every folder that changed."""
    for writer, final in files:
        try:
            writer.finish()
            os.replace(writer.path, final)
        except OSError as exc:
            raise io_error(exc, "publish", final) from exc
        dirty.add(final.parent)
    sync_folders(dirty, fsync)
