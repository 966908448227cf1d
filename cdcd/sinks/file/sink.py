"""The file sink: one folder per table that Spark reads directly (docs/files.md).

Layout under ``path``::

    <schema>.<table>/<commit_lsn:016X>-<seq:08X>.jsonl      events, one per line (value + "key")
    <schema>.<table>/<commit_lsn:016X>-<seq:08X>.parquet    the same with native types (format: parquet)
    <schema>.<table>/_schema/<commit_lsn:016X>-<seq:08X>.json   columns from that event on
    _messages/<commit_lsn:016X>-<seq:08X>.jsonl             logical decoding messages
    _transactions/<commit_lsn:016X>.jsonl                   BEGIN/END markers (transactions: true)

A data file is named after its first event. In a schema or table name, ``%``, ``/`` and NUL are
percent-encoded, and so is a leading ``.``, so every folder name is a valid, visible name.

Invariants:

- **Publication is atomic.** A file is written as ``.<name>.tmp``, fsynced, renamed to
  ``<name>``, and its folder fsynced (``fsync: false`` skips the fsyncs, for tests). Readers
  never see a partial file; names starting with ``.`` or ``_`` are never data files.
- **Order.** Each folder has at most one open file; events reach a folder in ``(commit_lsn,
  seq)`` order and files never overlap, so sorting a folder's file names sorts its events.
- **Durability.** ``flush()`` publishes every open file, fsyncs the folders, then reports the
  ``end_lsn`` of the last transaction handed over completely (``commit``) before it began.
  Files are also published when they reach ``rollover_bytes``/``rollover_rows`` and when a
  file is older than ``rollover_seconds`` at a commit. With ``flush_interval: 0`` every commit
  flushes before it returns. Otherwise the sink flushes by itself, in the background, as soon
  as ``flush_interval`` has passed since the last flush began and something committed is not
  durable: a timer, not the next commit, starts it, and writing goes on meanwhile (into new
  files). One flush runs at a time; what is committed during a flush goes with the next one
  (group commit). Publishing on flush makes one file per table per flush: ``flush_interval``
  bounds the flushes per second, trading file count against latency.
- **Publication order.** Files are sealed (closed for writing) and published by jobs that run
  one at a time in a worker thread, in seal order, so a folder's files become visible in name
  order and a crash leaves, per folder, a prefix of its files published. A job of at most
  ``INLINE_PUBLISH_BYTES`` on a local disk runs on the event loop instead: its fsyncs take
  about as long as handing it to the thread and back (each hand-off waits for the GIL while
  the loop decodes), and W4's p99 fell from 27 to 23 ms (docs/files.md). Only while
  publication is quick, though (``Publisher.quick``): after a job that took longer than
  ``QUICK_PUBLISH_SECONDS`` (a slow or stalled disk), jobs go to the thread until one is quick
  again, so a disk that stalls stops the event loop (the reader, keepalives, the other sinks)
  for at most one job.
- **Exactly once across crashes.** PostgreSQL resends every transaction after the confirmed
  LSN. ``start()`` deletes leftover temporary files and reads, per folder, the position of the
  last published event (the last line of the last file); events at or before it are skipped,
  so nothing is published twice and nothing is lost. ``durable_lsn`` starts at 0 in every run.
- **Schema files.** A ``_schema`` file is written (atomically) at the first event whose
  columns (name, type, typmod, key flag) differ from the previous event's in that folder, or
  from the schema file that applies at that position after a restart.
- **Errors.** OSError becomes :class:`TransientSinkError` for a full disk or quota
  (ENOSPC, EDQUOT) and :class:`DefiniteSinkError` otherwise, naming the path. After a failure
  the sink's files are in an unknown state, so every later call raises DefiniteSinkError:
  the pipeline must restart, and recovery replays from the confirmed LSN.

Writers (the extension point for formats)
-----------------------------------------

A :class:`TableWriter` writes one file. The sink creates one per published file::

    writer = WriterClass(tmp_path, relation, config)   # relation: None for _messages
    writer.write(events)            # a run of ChangeEvents, same Relation object, in order
    writer.size() / writer.rows     # for rollover
    writer.finish()                 # complete the file: footer, flush, fsync if config.fsync, close
    writer.discard()                # close and delete (crash-free shutdown without publishing)
    WriterClass.last_position(path) # (commit_lsn, seq) of the last event of a published file

``roll_on_schema_change = True`` makes the sink publish the open file before an event whose
columns differ, so one file holds one schema (Parquet needs that). ``format: parquet`` loads
``cdcd.sinks.file.parquet.ParquetTableWriter`` (suffix ``.parquet``). Logical messages and the
transaction log are always JSON Lines.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import orjson

from cdcd.assembler.transaction import Transaction
from cdcd.decoder.events import Relation
from cdcd.errors import DefiniteSinkError, SinkError, SinkSetupError, TransientSinkError
from cdcd.events import ChangeEvent
from cdcd.events.snapshot_run import SnapshotRun
from cdcd.lsn import pg_to_unix_us
from cdcd.sinks.base import Sink, SinkContext, run_events
from cdcd.sinks.file.config import FileSinkConfig, staging_folder
from cdcd.sinks.file.formats import writer_class
from cdcd.sinks.file.layout import (
    MESSAGES_FOLDER,
    SCHEMA_FOLDER,
    TRANSACTIONS_FOLDER,
    TXN_NAME,
    JsonlTableWriter,
    Position,
    Publisher,
    Recovered,
    TableWriter,
    TransactionLogWriter,
    data_file_name,
    io_error,
    parse_data_file_name,
    table_folder_name,
    temp_path,
)
from cdcd.sinks.file.storage import ObjectStore, ObjectStorePublisher, open_filesystem

#: transactions that get BEGIN/END markers (not lone messages, not the snapshot pseudo-transaction)
_MARKED_KINDS = frozenset({"regular", "streamed", "prepared"})
#: a publication job of at most this many bytes of files, on a local disk, runs on the event
#: loop rather than in the worker thread (see the module docstring)
INLINE_PUBLISH_BYTES = 1 << 20


# --- folders ---------------------------------------------------------------------------------


def _schema_signature(info: dict[str, Any] | None) -> tuple[Any, ...] | None:
    if info is None:
        return None
    return tuple((c["name"], c["type_oid"], c["typmod"], c["key"]) for c in info["columns"])


_UNKNOWN: Any = object()


class _Folder:
    """One output folder: its open file, what to skip after a restart, its schema state."""

    def __init__(
        self,
        sink: FileSink,
        path: Path,
        writer_cls: type[TableWriter],
        recovered: Recovered,
        name_for: Callable[[Position], str],
    ) -> None:
        self.sink = sink
        self.path = path
        self.writer_cls = writer_cls
        self.skip = recovered.last
        self.recovered_schemas = recovered.schemas
        self.name_for = name_for
        self.writer: TableWriter | None = None
        self.final: Path | None = None
        self.opened_at = 0.0
        self.relation: Relation | Any | None = _UNKNOWN
        self.signature: tuple[Any, ...] | Any | None = _UNKNOWN

    def append(self, run: Sequence[ChangeEvent]) -> None:
        skip = self.skip
        if skip is not None:  # after a restart: drop what a previous run published
            if run[-1].position <= skip:
                self.sink.events_skipped += len(run)
                return
            self.skip = None
            if run[0].position <= skip:
                kept = [e for e in run if e.position > skip]
                self.sink.events_skipped += len(run) - len(kept)
                run = kept
        event = run[0]
        if event.relation is not self.relation:
            self._relation_changed(event)
        if self.writer is None:
            self._open(event.position, event.relation)
        writer = self.writer
        assert writer is not None
        writer.write(run)
        self._maybe_roll(writer)

    def append_lines(self, position: Position, lines: list[bytes]) -> None:
        """For the transaction log: lines that all share ``position``."""
        if self.skip is not None:
            if position <= self.skip:
                return
            self.skip = None
        if self.writer is None:
            self._open(position, None)
        writer = self.writer
        assert isinstance(writer, JsonlTableWriter)
        writer.write_lines(lines)
        self._maybe_roll(writer)

    def _maybe_roll(self, writer: TableWriter) -> None:
        config = self.sink.config
        if writer.size() >= config.rollover_bytes or (
            config.rollover_rows is not None and writer.rows >= config.rollover_rows
        ):
            self.seal()

    def _open(self, position: Position, relation: Relation | None) -> None:
        self.final = self.path / self.name_for(position)
        self.writer = self.writer_cls(temp_path(self.final), relation, self.sink.config)
        budget = self.sink.memory_budget
        self.writer.memory_budget = None if budget is None else budget // 2
        self.opened_at = self.sink.clock()
        self.sink.open_folders[self.path] = self

    def _relation_changed(self, event: ChangeEvent) -> None:
        self.relation = event.relation
        info = event.schema_info()
        signature = _schema_signature(info)
        if self.signature is _UNKNOWN:
            self.signature = self._recovered_signature(event.position)
        if signature == self.signature or info is None:
            return
        if self.writer is not None and self.writer_cls.roll_on_schema_change:
            self.seal()
        self.signature = signature
        pos = event.position
        document = {**info, "commit_lsn": pos[0], "seq": pos[1]}
        schema_dir = self.path / SCHEMA_FOLDER
        self.sink.publisher.make_dir(schema_dir)
        self.sink.publisher.write_file(
            schema_dir / data_file_name(pos, ".json"),
            orjson.dumps(document, option=orjson.OPT_INDENT_2),
        )

    def _recovered_signature(self, position: Position) -> tuple[Any, ...] | None:
        """The columns of the schema file a previous run wrote for ``position``, if any."""
        applicable = [path for pos, path in self.recovered_schemas if pos <= position]
        self.recovered_schemas = []
        if not applicable:
            return None
        try:
            return _schema_signature(orjson.loads(applicable[-1].read_bytes()))
        except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
            raise DefiniteSinkError(
                f"file sink: cannot read schema file {applicable[-1]}: {exc}"
            ) from exc

    def seal(self) -> None:
        """Close the open file for writing: the sink publishes sealed files in order."""
        writer, final = self.writer, self.final
        if writer is None or final is None:
            return
        self.writer = None
        self.sink.open_folders.pop(self.path, None)
        self.sink.sealed.append((writer, final))

    def discard(self) -> None:
        writer, self.writer = self.writer, None
        self.sink.open_folders.pop(self.path, None)
        if writer is not None:
            writer.discard()


# --- the sink --------------------------------------------------------------------------------


class FileSink(Sink):
    """JSON Lines or Parquet files per table, published atomically, exactly once."""

    type_name = "file"
    Config = FileSinkConfig
    #: publishes in the background (see ``_schedule_flush``): the pipeline need not call flush
    flushes_itself = True
    flushes_while_writing = True  # what comes after a flush began goes to new files

    @classmethod
    def directories(cls, config: FileSinkConfig) -> dict[str, Path]:
        if isinstance(config.path, str):  # an object store: files are staged locally
            return {"storage.staging_dir": staging_folder(config.path, config.storage)}
        return {"path": Path(config.path)}

    @classmethod
    def preflight(cls, config: FileSinkConfig, key: str) -> str | None:
        """An object store's bucket exists and lets cdcd in (one attempt: a store that cannot
        be reached now is only warned about, the sink retries it when it starts)."""
        if not isinstance(config.path, str):
            return None
        once = config.storage.model_copy(update={"retry_timeout": 0.0})
        try:
            store = ObjectStore(config.path, once, *open_filesystem(config.path, once))
            store.check_bucket()
        except TransientSinkError as exc:  # the sink retries it when it starts
            return f"{config.path}: not reachable now ({exc})"
        except SinkSetupError as exc:
            raise SinkSetupError(f"{key}.path: {exc}") from exc
        return f"{config.path}: the bucket exists"

    def __init__(
        self,
        config: FileSinkConfig,
        context: SinkContext,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self.config = config
        self.context = context
        self.flush_interval = config.flush_interval  # read by the pipeline
        self.clock = clock
        self.publisher: Publisher | ObjectStorePublisher
        #: an object store: files are staged locally and uploaded to publish them
        self.remote: ObjectStorePublisher | None = None
        if isinstance(config.path, str):
            self.publisher = self.remote = ObjectStorePublisher(config.path, config.storage)
            self.root = self.remote.staging
        else:
            path = Path(config.path)
            self.root = path if path.is_absolute() else context.config_dir / path
            self.publisher = Publisher(config.fsync)
        self.open_folders: dict[Path, _Folder] = {}
        #: files closed for writing, waiting for the next publication job (in order)
        self.sealed: list[tuple[TableWriter, Path]] = []
        self.events_skipped = 0
        self.files_published = 0
        self.events_written = 0
        self._writer_cls = writer_class(config.format)
        self.writes_json = config.format == "jsonl"
        self._recovered: dict[str, Recovered] = {}
        self._folders: dict[str, _Folder] = {}
        self._by_relation: dict[int, tuple[Relation, _Folder]] = {}
        self._txn_log: _Folder | None = None
        self._txn: Transaction | None = None
        self._txn_counts: dict[str, int] = {}
        self._committed_end = 0
        self._last_flush = clock()  # when the last flush began
        self._unpublished = 0  # files sealed and not yet published
        self._publishing = asyncio.Lock()  # one publication job at a time, in seal order
        self._flush_task: asyncio.Task[None] | None = None
        self._flush_timer: asyncio.TimerHandle | None = None
        self._started = False
        self._failed: SinkError | None = None
        self._where: Path = self.root  # named in error messages

    # --- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        with self._failing():
            await asyncio.to_thread(self._recover)
        self._started = True

    def _recover(self) -> None:
        """Delete temporary files; find each folder's last published position and schemas."""
        if self.remote is not None:
            self._recovered = self.remote.recover()
            return
        root = self.root
        self.publisher.make_dir(root)
        for folder in sorted(root.iterdir()):
            if folder.name.startswith(".") or not folder.is_dir():
                continue
            found = Recovered()
            schema_dir = folder / SCHEMA_FOLDER
            for path in (*folder.iterdir(), *(schema_dir.iterdir() if schema_dir.is_dir() else ())):
                if path.name.startswith(".") and path.name.endswith(".tmp"):
                    path.unlink()
                    self.publisher.mark_dirty(path.parent)
            if folder.name == TRANSACTIONS_FOLDER:
                logs = sorted(p.name for p in folder.iterdir() if TXN_NAME.fullmatch(p.name))
                if logs:
                    found.last = TransactionLogWriter.last_position(folder / logs[-1])
            else:
                data = sorted(
                    (parsed[0], p.name, parsed[1])
                    for p in folder.iterdir()
                    if (parsed := parse_data_file_name(p.name)) is not None
                )
                if data:
                    _, name, suffix = data[-1]
                    found.last = writer_class(suffix[1:]).last_position(folder / name)
                if schema_dir.is_dir():
                    found.schemas = sorted(
                        (parsed[0], p)
                        for p in schema_dir.iterdir()
                        if (parsed := parse_data_file_name(p.name)) is not None
                    )
            self._recovered[folder.name] = found
        self.publisher.sync()

    async def close(self) -> None:
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        task = self._flush_task
        if task is not None:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        for folder in list(self.open_folders.values()):
            with contextlib.suppress(OSError):  # the next start() deletes what is left
                folder.discard()
        sealed, self.sealed = self.sealed, []
        for writer, _ in sealed:
            with contextlib.suppress(OSError):
                writer.discard()

    # --- the sink protocol -------------------------------------------------------------------

    async def begin(self, txn: Transaction) -> None:
        self._check()
        if not self._started:
            await self.start()
        self._txn = txn
        self._txn_counts = {}
        if self.config.transactions and txn.kind in _MARKED_KINDS:
            with self._failing():
                self._marker(txn, "BEGIN")

    async def write(self, events: Sequence[ChangeEvent]) -> None:
        self._check()
        with self._failing():
            self._write(events)
        if self.sealed:  # a file rolled over: publish it now (after any flush in progress)
            await self._publish_sealed()

    async def write_transactions(
        self, run: Sequence[tuple[Transaction, Sequence[Sequence[ChangeEvent]]]]
    ) -> None:
        """A run of small transactions (docs/sinks.md): their events in one write, one commit.
        Call by call when it writes transaction markers, when a batch is a snapshot's run (its
        JSON Lines records are written as they are), or when a file may reach
        ``rollover_rows`` within the run (it ends after the transaction that reaches it, as
        without runs)."""
        if (
            self.config.transactions
            or any(isinstance(batch, SnapshotRun) for _, batches in run for batch in batches)
            or self._rows_may_roll(sum(len(batch) for _, batches in run for batch in batches))
        ):
            await super().write_transactions(run)
            return
        self._check()
        if not self._started:
            await self.start()
        events = run_events(run)
        if events:
            await self.write(events)
        await self.commit(run[-1][0])

    def _rows_may_roll(self, count: int) -> bool:
        """Whether ``count`` more events may bring a file to ``rollover_rows``."""
        limit = self.config.rollover_rows
        if limit is None:
            return False
        return count >= limit or any(
            folder.writer is not None and folder.writer.rows + count >= limit
            for folder in self.open_folders.values()
        )

    async def commit(self, txn: Transaction) -> None:
        self._check()
        if self.config.transactions and txn.kind in _MARKED_KINDS:
            with self._failing():
                self._marker(txn, "END")
        self._txn = None
        self._committed_end = max(self._committed_end, txn.end_lsn)
        if self._all_published():
            self._mark_durable(self._committed_end)
            return
        if self.flush_interval == 0:
            await self.flush()
            return
        now = self.clock()
        old = [
            f
            for f in self.open_folders.values()
            if now - f.opened_at >= self.config.rollover_seconds
        ]
        if old:
            for folder in old:
                folder.seal()
            await self._publish_sealed()
        if not self._all_published():
            self._schedule_flush()

    async def flush(self) -> None:
        """Publish every open file and wait until it is durable. Safe to run while
        transactions are being written: what comes after the flush began goes to new files."""
        self._check()
        committed = self._committed_end
        self._last_flush = self.clock()
        for folder in list(self.open_folders.values()):
            folder.seal()
        await self._publish_sealed()
        self._mark_durable(committed)

    async def settled(self) -> None:
        """Wait until no background flush is running or due (tests; see ``_schedule_flush``)."""
        while self._flush_task is not None:
            await asyncio.shield(self._flush_task)

    def buffered_bytes(self) -> int:
        """What the open and sealed (not yet published) files hold in memory; each file may
        hold half the sink's ``memory_budget``."""
        total = 0
        for folder in self.open_folders.values():
            if folder.writer is not None:
                total += folder.writer.buffered()
        for writer, _ in self.sealed:
            total += writer.buffered()
        return total

    def stats(self) -> dict[str, Any]:
        return {
            "events_written": self.events_written,
            "events_skipped": self.events_skipped,
            "files_published": self.files_published,
            "open_files": len(self.open_folders),
        }

    # --- internals ---------------------------------------------------------------------------

    def _check(self) -> None:
        if self._failed is not None:
            raise DefiniteSinkError(
                f"file sink failed earlier ({self._failed}); restart to replay from the "
                "last confirmed position"
            )

    @contextlib.contextmanager
    def _failing(self) -> Iterator[None]:
        """Translate OSError (naming the path) and remember any failure: afterwards the open
        files are in an unknown state and only a restart (replaying from the confirmed LSN)
        can continue."""
        try:
            yield
        except OSError as exc:
            self._failed = io_error(exc, "write", exc.filename or self._where)
            raise self._failed from exc
        except SinkError as exc:
            self._failed = exc
            raise

    def _folder(self, name: str, writer_cls: type[TableWriter]) -> _Folder:
        folder = self._folders.get(name)
        if folder is None:
            path = self.root / name
            self.publisher.make_dir(path)
            recovered = self._recovered.get(name, Recovered())
            suffix = writer_cls.suffix
            folder = _Folder(self, path, writer_cls, recovered, lambda p: data_file_name(p, suffix))
            self._folders[name] = folder
        return folder

    def _folder_for(self, event: ChangeEvent) -> _Folder:
        relation = event.relation
        if relation is None:
            return self._folder(MESSAGES_FOLDER, JsonlTableWriter)
        cached = self._by_relation.get(id(relation))
        if cached is not None and cached[0] is relation:
            return cached[1]
        name = table_folder_name(event.schema or "", event.table or "")
        folder = self._folder(name, self._writer_cls)
        if len(self._by_relation) > 4096:
            self._by_relation.clear()
        self._by_relation[id(relation)] = (relation, folder)
        return folder

    def _write(self, events: Sequence[ChangeEvent]) -> None:
        count = len(events)
        counts = self._txn_counts if self.config.transactions else None
        start = 0
        while start < count:
            if isinstance(events, SnapshotRun):  # one table's rows: one run
                end = count
            else:
                relation = events[start].relation
                end = start + 1
                while end < count and events[end].relation is relation:
                    end += 1
            run = events if start == 0 and end == count else events[start:end]
            folder = self._folder_for(run[0])
            self._where = folder.path
            folder.append(run)
            if counts is not None:
                first = run[0]
                collection = (
                    f"{first.schema}.{first.table}" if first.table is not None else MESSAGES_FOLDER
                )
                counts[collection] = counts.get(collection, 0) + len(run)
            start = end
        self.events_written += count

    def _marker(self, txn: Transaction, status: Literal["BEGIN", "END"]) -> None:
        """Debezium's transaction metadata, plus ``commit_lsn`` to deduplicate on."""
        if self._txn_log is None:
            recovered = self._recovered.get(TRANSACTIONS_FOLDER, Recovered())
            path = self.root / TRANSACTIONS_FOLDER
            self.publisher.make_dir(path)
            self._txn_log = _Folder(
                self, path, TransactionLogWriter, recovered, lambda p: f"{p[0]:016X}.jsonl"
            )
        counts = self._txn_counts
        marker = {
            "status": status,
            "id": f"{txn.xid}:{txn.commit_lsn}",
            "ts_ms": pg_to_unix_us(txn.commit_time) // 1000,
            "event_count": sum(counts.values()) if status == "END" else None,
            "data_collections": (
                [{"data_collection": k, "event_count": v} for k, v in counts.items()]
                if status == "END"
                else None
            ),
            "commit_lsn": txn.commit_lsn,
            "end_lsn": txn.end_lsn if txn.ends else None,  # a first part does not know it
        }
        position = (txn.commit_lsn, 0 if status == "BEGIN" else 1)
        self._txn_log.append_lines(position, [orjson.dumps(marker)])

    def _all_published(self) -> bool:
        """Every event handed over so far is in a published file."""
        return not self.open_folders and self._unpublished == 0 and not self.sealed

    async def _publish_sealed(self) -> None:
        """Publish the sealed files in a worker thread. Jobs run one at a time, in seal order,
        so a folder's files become visible in name order and a crash leaves, per folder, a
        prefix of its files published (what recovery relies on). When this returns, every file
        sealed before the call is published."""
        async with self._publishing:
            files, self.sealed = self.sealed, []
            self._unpublished += len(files)
            dirty = self.publisher.take_dirty()
            if (files or dirty) and self._inline(files):
                with self._failing():
                    self.publisher.publish_files(files, dirty)
            elif files or dirty:
                job = asyncio.to_thread(self.publisher.publish_files, files, dirty)
                try:
                    with self._failing():
                        await job
                except asyncio.CancelledError:  # the job goes on in its thread: stop here
                    self._failed = DefiniteSinkError("file sink: publication interrupted")
                    raise
            self._unpublished -= len(files)
            self.files_published += len(files)
            if self._all_published():
                self._mark_durable(self._committed_end)

    def _inline(self, files: list[tuple[TableWriter, Path]]) -> bool:
        """Whether this publication job is small enough to run on the event loop, and the
        last one was quick (a disk that stalls keeps its fsyncs off the loop)."""
        if not (self.publisher.local and self.publisher.quick):  # uploads, a stalled disk
            return False
        return sum(writer.size() for writer, _ in files) <= INLINE_PUBLISH_BYTES

    def _schedule_flush(self) -> None:
        """Flush in the background once ``flush_interval`` has passed since the last flush
        began. One flush runs at a time; what is committed meanwhile goes with the next one
        (group commit), which starts as soon as the interval allows, without waiting for
        another commit."""
        if self._flush_task is not None or self._failed is not None:
            return  # the running flush schedules the next one when it ends
        delay = self._last_flush + self.flush_interval - self.clock()
        if delay > 0:
            if self._flush_timer is None:
                self._flush_timer = asyncio.get_running_loop().call_later(delay, self._flush_due)
            return
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        self._flush_task = asyncio.get_running_loop().create_task(self._background_flush())

    def _flush_due(self) -> None:
        self._flush_timer = None
        if not self._all_published():
            self._schedule_flush()

    async def _background_flush(self) -> None:
        try:
            await self.flush()
        except SinkError:
            return  # kept in self._failed: the pipeline's next call raises it
        except Exception as exc:  # e.g. a format library's error: fail the same way
            self._failed = self._failed or DefiniteSinkError(f"file sink: flush failed: {exc!r}")
            return
        finally:
            self._flush_task = None
        if not self._all_published():
            self._schedule_flush()
