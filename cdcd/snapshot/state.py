"""What an incremental snapshot records (:mod:`cdcd.snapshot.incremental`), and when.

:class:`IncrementalState` is ``<state_dir>/<slot>.incremental.json``: per table, whether it is
requested, the key of its last durable chunk, the rows emitted and the estimate. A chunk's key
is written there only once that chunk and every chunk of its table before it are durable in
every sink (:class:`Ledger`), so a restart (kill -9 included) resumes at the next chunk; at
worst the chunks in flight at the crash are emitted again, and those whose record was still
being written. The ledger's writes go to a thread (:meth:`IncrementalState.save_soon`): the
event loop never waits for their fsyncs, and writes asked for meanwhile make one write of the
newest state once it ends.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cdcd.errors import ConfigError
from cdcd.source.snapshot import incremental_state_path
from cdcd.stats import Stats


class IncrementalState:
    """``<state_dir>/<slot>.incremental.json``, written atomically (fsynced)."""

    def __init__(self, state_dir: Path, slot: str) -> None:
        self.path = incremental_state_path(state_dir, slot)
        self.tables: dict[str, dict[str, Any]] = {}
        self.last_signal = 0  # end LSN of the last signal taken (they are sent again)
        self.known: list[str] | None = None  # the published tables at the last look
        self.signals: list[str] = []  # ids of the last signals taken (cdcd.snapshot.signals)
        self.exists = self.path.exists()
        if self.exists:
            data = json.loads(self.path.read_text())
            self.tables = data["tables"]
            self.last_signal = int(data.get("last_signal", 0))
            self.known = data.get("known")
            self.signals = list(data.get("signals") or [])

        self._made = 0  # the newest content made (a generation number) ...
        self._written = 0  # ... and the newest written
        self._file_lock = threading.Lock()  # one write at a time
        self._guard = threading.Lock()  # _waiting and _writer
        self._waiting: tuple[int, str] | None = None  # the content the thread writes next
        self._writer: threading.Thread | None = None
        self._failure: OSError | None = None  # of a write in the thread, raised by the next save

    @property
    def unwritten(self) -> bool:
        """Whether content made was not written yet (a write in the thread)."""
        return self._made > self._written

    def save(self) -> None:
        """Write the state now (after a write in the thread, if one is under way)."""
        self._check()
        try:
            self._write(*self._dump())
        except OSError as exc:
            raise self._error(exc) from exc

    def save_soon(self) -> None:
        """Write the state in a thread: the caller does not wait for the fsyncs. Asked again
        while a write is under way, the thread writes the newest state once it ends."""
        self._check()
        content = self._dump()
        with self._guard:
            self._waiting = content
            if self._writer is None:
                self._writer = threading.Thread(
                    target=self._write_waiting, name="cdcd-snapshot-state", daemon=True
                )
                self._writer.start()

    def _write_waiting(self) -> None:
        while True:
            with self._guard:
                content, self._waiting = self._waiting, None
                if content is None:
                    self._writer = None
                    return
            try:
                self._write(*content)
            except OSError as exc:
                self._failure = exc

    def _check(self) -> None:
        failure, self._failure = self._failure, None
        if failure is not None:
            raise self._error(failure) from failure

    def _error(self, exc: OSError) -> ConfigError:
        return ConfigError(
            f"snapshot.state_dir {self.path.parent}: cannot record the incremental "
            f"snapshot's progress: {exc.strerror or exc} (make it writable)"
        )

    def _dump(self) -> tuple[int, str]:
        self._made += 1
        content = {
            "tables": self.tables,
            "last_signal": self.last_signal,
            "known": self.known,
            "signals": self.signals,
        }
        return self._made, json.dumps(content, indent=1)

    def _write(self, made: int, content: str) -> None:
        with self._file_lock:
            if made <= self._written:  # a newer state was written meanwhile
                return
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name("." + self.path.name + ".tmp")
            with tmp.open("w") as fh:
                fh.write(content)
                fh.flush()
                os.fsync(fh.fileno())
            tmp.replace(self.path)
            fd = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
            self._written = made
            self.exists = True

    def request(self, tables: list[str]) -> None:
        """Snapshot ``tables`` (again) from their first key."""
        for name in tables:
            self.tables[name] = {
                "status": "pending",
                "last_key": None,
                "rows": 0,
                "estimate": None,
                "estimated_from": None,
            }
        self.save()

    def resume(self, tables: dict[str, tuple[list[Any] | None, int]]) -> None:
        """Snapshot ``tables`` from after a key (``(last key or None, rows so far)``): the
        rest of an interrupted initial snapshot (:mod:`cdcd.source.resume`)."""
        for name, (last_key, rows) in tables.items():
            self.tables[name] = {
                "status": "pending",
                "last_key": last_key,
                "rows": rows,
                "estimate": None,
                "estimated_from": None,
            }
        self.save()

    def pending(self) -> list[str]:
        return [n for n, t in self.tables.items() if t["status"] in ("pending", "running")]


@dataclass(slots=True)
class Done:
    """A chunk queued at ``end_lsn`` (0: nothing queued; -1: not read yet), to record once
    durable; kept in key order, so the recorded key is one below which every chunk is
    durable."""

    table: str
    end_lsn: int
    last_key: list[str | None] | None
    rows: int
    finished: bool
    bytes: int = 0
    keyed: bool = False  # last_key and finished are known (the chunk's rows are read)


class Ledger:
    """Per table, its chunks not recorded yet, in key order."""

    def __init__(self, state: IncrementalState, stats: Stats) -> None:
        self.state = state
        self.stats = stats
        self.undurable: dict[str, list[Done]] = {}
        self.recorded = asyncio.Event()  # set when chunks are recorded (the reader waits)

    def in_flight(self) -> int:
        """Chunks queued or being read, not recorded yet, of every table."""
        return sum(len(chunks) for chunks in self.undurable.values())

    def record(self, durable: int, *, now: bool = False) -> None:
        """Write the progress of the chunks every sink holds durably (up to ``durable``), in a
        thread (:meth:`IncrementalState.save_soon`); ``now``: before returning, with whatever
        the thread had not written yet (an orderly stop)."""
        recorded = False
        for chunks in self.undurable.values():
            recorded |= self._record(chunks, durable)
        if recorded:
            self.recorded.set()
        if now and (recorded or self.state.unwritten):
            self.state.save()
        elif recorded:
            self.state.save_soon()

    def _record(self, chunks: list[Done], durable: int) -> bool:
        """Record the leading ``chunks`` (one table's) durable at ``durable``."""
        done = 0
        for item in chunks:
            if item.end_lsn < 0 or item.end_lsn > durable:  # < 0: not read yet
                break
            done += 1
        if not done:
            return False
        for item in chunks[:done]:
            entry = self.state.tables.get(item.table)
            if entry is None or entry["status"] == "pending":
                continue  # requested again meanwhile: starts over
            entry["last_key"] = item.last_key
            entry["rows"] = item.rows
            entry["bytes"] = item.bytes
            progress = self.stats.snapshots.get(item.table)
            rate = progress.meter.rate if progress is not None else None
            entry["rows_per_s"] = None if rate is None else round(rate)  # for cdcd snapshot status
            if item.finished:
                entry["status"] = "done"
        del chunks[:done]
        return True
