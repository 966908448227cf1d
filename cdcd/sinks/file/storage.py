"""Object storage for the file sink: ``sinks[].path: s3://bucket/prefix`` (docs/files.md).

The file sink writes each file under a hidden name in a local *staging* folder, exactly as on
disk; publishing it uploads the completed file to its final key and deletes the staged copy:

- **A file is visible complete or not at all.** Object storage has no rename: an upload of the
  final name is either one PUT (small files) or a multipart upload that becomes visible only
  when it is completed, after its last part. A process killed during an upload leaves no
  object (at most an incomplete multipart upload, invisible to readers; a bucket lifecycle
  rule ``AbortIncompleteMultipartUpload`` cleans those up).
- **Order and recovery.** Uploads run one at a time in seal order (the file sink's publication
  jobs), so after a crash each folder holds a prefix of its files. ``recover()`` lists the
  prefix, reads the last event position of each folder's last object (ranged reads of its
  tail; a Parquet footer) and fetches the ``_schema`` files into the staging folder, which
  it empties first: events at or before those positions are skipped, nothing is published
  twice.
- **Errors.** Throttling (SlowDown, 429), 5xx, timeouts and connection failures are retried
  with exponential backoff (``storage.retry_timeout`` in all, on top of the S3 client's own
  few quick retries) and then raise :class:`TransientSinkError`; access denied, a missing
  bucket, bad credentials raise :class:`DefiniteSinkError`. Every message names the bucket
  and key. Nothing is confirmed to PostgreSQL before its upload completed.

Credentials and endpoint come from ``sinks[].storage`` or else the standard environment
variables (``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``,
``AWS_REGION``/``AWS_DEFAULT_REGION``, ``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL``), then
the AWS SDK's default chain (profile, instance or pod role). Other URL schemes are refused
when the config is read (:data:`~cdcd.sinks.file.config.SCHEMES`): their publication would
need its own proof of atomicity.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast
from urllib.parse import urlsplit

from pydantic import SecretStr

from cdcd.errors import DefiniteSinkError, SinkSetupError, TransientSinkError
from cdcd.sinks.file.config import StorageConfig, staging_folder

if TYPE_CHECKING:
    from pyarrow.fs import FileSystem

    from cdcd.sinks.file.layout import Position, Recovered, TableWriter

T = TypeVar("T")

#: AWS SDK error names and HTTP statuses worth retrying
_TRANSIENT = re.compile(
    r"AWS Error (NETWORK_CONNECTION|SLOW_DOWN|THROTTLING|SERVICE_UNAVAILABLE|INTERNAL_FAILURE"
    r"|REQUEST_TIMEOUT|REQUEST_TIME_TOO_SKEWED|REQUEST_LIMIT_EXCEEDED)"
    r"|HTTP status (429|5\d\d)|curlCode: (6|7|28|52|55|56)\b|[Tt]imed? ?out|Connection reset"
)
_EXPLAINED = {
    "ACCESS_DENIED": "access denied (check the credentials and the bucket policy)",
    "NO_SUCH_BUCKET": "the bucket does not exist",
    "INVALID_ACCESS_KEY_ID": "the access key id is not known",
    "SIGNATURE_DOES_NOT_MATCH": "the secret access key is wrong",
    "NO_SUCH_KEY": "no such key",
}
#: the errors above an operator fixes in the store's setup (exit 3, cdcd.errors.SinkSetupError)
_SETUP = frozenset(_EXPLAINED) - {"NO_SUCH_KEY"}


def _secret(value: SecretStr | None, env: Mapping[str, str], *names: str) -> str | None:
    if value is not None:
        return value.get_secret_value()
    return next((env[n] for n in names if env.get(n)), None)


def open_filesystem(
    url: str, config: StorageConfig, env: Mapping[str, str] | None = None
) -> tuple[FileSystem, str]:
    """The pyarrow filesystem of ``url`` and the path of its prefix in it (``bucket/prefix``)."""
    import pyarrow.fs as pafs

    env = os.environ if env is None else env
    parts = urlsplit(url)
    endpoint = config.endpoint_url or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL")
    options: dict[str, Any] = {
        "access_key": _secret(config.access_key_id, env, "AWS_ACCESS_KEY_ID"),
        "secret_key": _secret(config.secret_access_key, env, "AWS_SECRET_ACCESS_KEY"),
        "session_token": _secret(config.session_token, env, "AWS_SESSION_TOKEN"),
        "region": config.region or env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION"),
        "connect_timeout": config.connect_timeout,
        "request_timeout": config.request_timeout,
        "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=3),
        # small files in one PutObject; larger ones in a multipart upload completed at close
        "allow_delayed_open": True,
    }
    if endpoint:
        where = urlsplit(endpoint)
        options["endpoint_override"] = where.netloc or endpoint
        options["scheme"] = where.scheme or "https"
    if options["access_key"] is None or options["secret_key"] is None:
        options.pop("access_key")
        options.pop("secret_key")
        options.pop("session_token")
    return pafs.S3FileSystem(**{k: v for k, v in options.items() if v is not None}), (
        f"{parts.netloc}{parts.path}".rstrip("/")
    )


class ObjectStore:
    """One prefix of an object store, with retries and errors that name the object."""

    def __init__(self, url: str, config: StorageConfig, filesystem: FileSystem, root: str) -> None:
        self.url = url
        self.config = config
        self.fs = filesystem
        self.root = root  # "bucket/prefix"
        self.scheme = urlsplit(url).scheme
        self.sleep: Callable[[float], None] = time.sleep

    def where(self, key: str) -> str:
        bucket, _, name = key.partition("/")
        return f"{self.scheme}://{bucket}/{name} (bucket {bucket!r}, key {name!r})"

    def call(self, action: str, key: str, fn: Callable[[], T]) -> T:
        """``fn()``, retried with backoff while it fails transiently; errors become SinkErrors."""
        deadline = time.monotonic() + self.config.retry_timeout
        delay = 0.2
        while True:
            try:
                return fn()
            except FileNotFoundError as exc:
                raise DefiniteSinkError(
                    f"file sink: cannot {action} {self.where(key)}: not found ({exc})"
                ) from exc
            except OSError as exc:
                message = str(exc)
                if _TRANSIENT.search(message) is None:
                    code = re.search(r"AWS Error (\w+)", message)
                    reason = _EXPLAINED.get(code.group(1), "") if code else ""
                    error = (
                        SinkSetupError if code and code.group(1) in _SETUP else DefiniteSinkError
                    )
                    raise error(
                        f"file sink: cannot {action} {self.where(key)}: "
                        f"{reason + ': ' if reason else ''}{message}"
                    ) from exc
                if time.monotonic() + delay > deadline:
                    raise TransientSinkError(
                        f"file sink: cannot {action} {self.where(key)} (retried for "
                        f"{self.config.retry_timeout:g} s): {message}"
                    ) from exc
                self.sleep(delay)
                delay = min(delay * 2, self.config.retry_max_backoff)

    def check_bucket(self) -> None:
        """Fail clearly when the bucket (the prefix's first level) is missing or not ours."""
        from pyarrow.fs import FileType

        bucket = self.root.split("/", 1)[0]
        info = self.call(
            "look up the bucket of", bucket + "/", lambda: self.fs.get_file_info(bucket)
        )
        if info.type == FileType.NotFound:
            raise SinkSetupError(
                f"file sink: bucket {bucket!r} of {self.url} does not exist (create it first)"
            )

    def list(self) -> list[tuple[str, int]]:
        """``(path relative to the prefix, size)`` of every object under the prefix."""
        from pyarrow.fs import FileSelector, FileType

        selector = FileSelector(self.root, recursive=True, allow_not_found=True)
        infos = self.call("list", self.root + "/", lambda: self.fs.get_file_info(selector))
        cut = len(self.root) + 1
        return sorted((i.path[cut:], i.size or 0) for i in infos if i.type == FileType.File)

    def upload(self, local: Path, name: str) -> None:
        """Copy a complete local file to ``<prefix>/<name>``: visible only once complete.

        The file is read whole before the upload starts (at most ``rollover_bytes``): pyarrow's
        output stream cannot be aborted, and closing it, even on an error, would complete a
        multipart upload, so nothing may fail between opening and closing it but the upload
        itself. A part that fails fails the close, and the upload is never completed."""
        key = f"{self.root}/{name}"
        data = local.read_bytes()

        def put() -> None:
            with self.fs.open_output_stream(key) as dst:
                dst.write(data)

        self.call("upload", key, put)

    def read_range(self, name: str, offset: int, length: int) -> bytes:
        key = f"{self.root}/{name}"

        def read() -> bytes:
            with self.fs.open_input_file(key) as f:
                return bytes(f.read_at(length, offset))

        return self.call("read", key, read)

    def download(self, name: str, local: Path) -> None:
        key = f"{self.root}/{name}"

        def get() -> None:
            with self.fs.open_input_stream(key) as src, local.open("wb") as dst:
                shutil.copyfileobj(src, dst, 8 << 20)

        self.call("download", key, get)


def tail(store: ObjectStore, name: str, size: int) -> bytes:
    """The end of an object holding at least its last complete line (ranged reads)."""
    length = 64 * 1024
    while True:
        length = min(length, size)
        data = store.read_range(name, size - length, length)
        if length == size or b"\n" in data.rstrip(b"\n"):
            return data
        length *= 4


class ObjectStorePublisher:
    """The file sink's publisher for an object store (see the module docstring)."""

    fsync = False
    local = False  # publication jobs upload: always in the worker thread
    quick = False  # its jobs are not timed (Publisher.quick)

    def __init__(self, url: str, config: StorageConfig, store: ObjectStore | None = None) -> None:
        if store is None:
            filesystem, root = open_filesystem(url, config)
            store = ObjectStore(url, config, filesystem, root)
        self.store = store
        self.staging = staging_folder(url, config)
        self._queued: set[Path] = set()  # small files written, uploaded by the next job

    def name(self, local: Path) -> str:
        return local.relative_to(self.staging).as_posix()

    # --- the Publisher interface of cdcd.sinks.file.sink --------------------------------------

    def make_dir(self, path: Path) -> None:
        path.mkdir(parents=True, exist_ok=True)

    def mark_dirty(self, folder: Path) -> None:
        pass

    def write_file(self, final: Path, data: bytes) -> None:
        """Stage a small file (a ``_schema`` file); the next publication job uploads it before
        the data files it comes with."""
        from cdcd.sinks.file.layout import temp_path

        temp_path(final).write_bytes(data)
        self._queued.add(final)

    def take_dirty(self) -> set[Path]:
        queued, self._queued = self._queued, set()
        return queued

    def sync(self) -> None:
        pass

    def publish_files(self, files: Sequence[tuple[TableWriter, Path]], queued: set[Path]) -> None:
        """One publication job (a worker thread): the staged small files, then each data file
        completed and uploaded in order; staged copies are deleted once uploaded."""
        from cdcd.sinks.file.layout import temp_path

        for final in sorted(queued):
            staged = temp_path(final)
            self.store.upload(staged, self.name(final))
            staged.unlink()
        for writer, final in files:
            writer.finish()
            self.store.upload(writer.path, self.name(final))
            writer.path.unlink()

    def recover(self) -> dict[str, Recovered]:
        """Empty the staging folder; per folder under the prefix, the last published position
        (from its last object) and the ``_schema`` files (fetched into the staging folder)."""
        from cdcd.sinks.file import layout as sink

        if self.staging.exists():
            shutil.rmtree(self.staging)
        self.staging.mkdir(parents=True)
        if self.store.scheme == "s3":
            self.store.check_bucket()
        folders: dict[str, list[tuple[str, int]]] = {}
        for name, size in self.store.list():
            folder, _, rest = name.partition("/")
            if rest and not folder.startswith(".") and not rest.split("/")[-1].startswith("."):
                folders.setdefault(folder, []).append((rest, size))
        recovered: dict[str, Recovered] = {}
        for folder, objects in folders.items():
            found = sink.Recovered()
            sizes = dict(objects)
            if folder == sink.TRANSACTIONS_FOLDER:
                logs = sorted(n for n in sizes if sink.TXN_NAME.fullmatch(n))
                if logs:
                    found.last = self._last(folder, logs[-1], sizes[logs[-1]], ".jsonl", True)
            else:
                data = sorted(
                    (parsed[0], n, parsed[1])
                    for n in sizes
                    if (parsed := sink.parse_data_file_name(n)) is not None
                )
                if data:
                    _, last, suffix = data[-1]
                    found.last = self._last(folder, last, sizes[last], suffix, False)
                prefix = sink.SCHEMA_FOLDER + "/"
                for n in sorted(sizes):
                    parsed = sink.parse_data_file_name(n[len(prefix) :])
                    if n.startswith(prefix) and parsed is not None:
                        local = self.staging / folder / n
                        local.parent.mkdir(parents=True, exist_ok=True)
                        self.store.download(f"{folder}/{n}", local)
                        found.schemas.append((parsed[0], local))
            recovered[folder] = found
        return recovered

    def _last(self, folder: str, name: str, size: int, suffix: str, txn: bool) -> Position:
        """The last event position of an object: its tail staged locally and read by the
        format's own ``last_position`` (a Parquet file is read through ranged requests)."""
        from cdcd.sinks.file import layout as sink
        from cdcd.sinks.file.formats import writer_class

        if suffix == ".jsonl":
            local = self.staging / folder / f".{name}.tail"
            local.parent.mkdir(parents=True, exist_ok=True)
            local.write_bytes(tail(self.store, f"{folder}/{name}", size))
            try:
                cls = sink.TransactionLogWriter if txn else sink.JsonlTableWriter
                return cls.last_position(local)
            finally:
                local.unlink()
        key = f"{self.store.root}/{folder}/{name}"
        source = self.store.call("open", key, lambda: self.store.fs.open_input_file(key))
        with source:
            # pq.ParquetFile reads a file object as well as a path
            return writer_class(suffix[1:]).last_position(cast(Path, source))
