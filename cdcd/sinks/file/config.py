"""The file sink's settings: ``sinks: - type: file`` and its ``storage:`` (docs/files.md).

Kept apart from the sink so that every module of the file sink can name them without importing
the sink (:mod:`~cdcd.sinks.file.sink` imports them all).
"""

from __future__ import annotations

import hashlib
import re
import tempfile
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, SecretStr, ValidationInfo

from cdcd.units import ByteSize, Duration, resolve_path

_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def is_url(path: object) -> bool:
    return isinstance(path, str) and _URL.match(path) is not None


#: URL schemes ``sinks[].path`` accepts: S3 and S3-compatible stores (MinIO, R2, ...: set
#: ``storage.endpoint_url``). Other stores would need their own atomic publication (a file
#: must become visible complete or not at all, docs/files.md), and none is tested.
SCHEMES = ("s3",)
_SUPPORTED = "a local folder or s3://bucket/prefix (S3 and S3-compatible stores)"


def _sink_path(value: Any, info: ValidationInfo) -> Path | str:
    """A local path (made absolute like ``ConfigPath``) or an object store URL, kept as text."""
    if is_url(value):
        parts = urlsplit(value)
        if parts.scheme not in SCHEMES:
            hint = "; for a local folder write its path without file://" * (parts.scheme == "file")
            raise ValueError(
                f"{value!r}: the URL scheme {parts.scheme}:// is not supported; the file sink "
                f"writes to {_SUPPORTED}{hint}"
            )
        if not parts.netloc:
            raise ValueError(f"{value!r}: no bucket (use s3://bucket/prefix)")
        if parts.query or parts.fragment:
            raise ValueError(f"{value!r}: no ?query or #fragment (options go in storage:)")
        return str(value).rstrip("/")
    return _local_path(value, info)


def _local_path(value: Any, info: ValidationInfo) -> Path:
    if is_url(value):
        raise ValueError(f"{value!r}: a local folder, not a URL")
    if not isinstance(value, str | Path):
        raise ValueError(f"expected a path or a URL, not {type(value).__name__}")
    return resolve_path(Path(value), info)


#: ``sinks[].path``: a folder, or ``s3://bucket/prefix``
SinkPath = Annotated[Path | str, PlainValidator(_sink_path)]


def staging_folder(url: str, storage: StorageConfig) -> Path:
    """Where the file sink stages files for the object store ``url``: ``storage.staging_dir``,
    else a folder of its own (by the URL) under the temporary folder."""
    if storage.staging_dir is not None:
        return storage.staging_dir
    digest = hashlib.sha256(url.encode()).hexdigest()[:12]
    return Path(tempfile.gettempdir()) / f"cdcd-staging-{digest}"


class StorageConfig(BaseModel):
    """``sinks[].storage``: object store settings, used when ``path`` is a URL."""

    model_config = ConfigDict(extra="forbid")

    access_key_id: SecretStr | None = None
    secret_access_key: SecretStr | None = None
    session_token: SecretStr | None = None
    region: str | None = None
    #: e.g. http://127.0.0.1:9000 for MinIO; default: AWS (or AWS_ENDPOINT_URL)
    endpoint_url: str | None = None
    #: local folder for files being written before upload; default: under the temp folder
    staging_dir: Annotated[Path, PlainValidator(_local_path)] | None = None
    connect_timeout: Duration = Field(default=10.0, gt=0)
    request_timeout: Duration = Field(default=60.0, gt=0)
    #: how long one operation is retried (throttling, 5xx, timeouts) before failing
    retry_timeout: Duration = Field(default=120.0, ge=0)
    retry_max_backoff: Duration = Field(default=10.0, gt=0)


class FileSinkConfig(BaseModel):
    """``sinks: - type: file`` (docs/files.md)."""

    model_config = ConfigDict(extra="forbid")

    #: a folder, or an object store URL such as s3://bucket/prefix (cdcd/sinks/file/storage.py)
    path: SinkPath
    format: Literal["jsonl", "parquet"] = "jsonl"
    rollover_bytes: ByteSize = Field(default=128 * 1024 * 1024, gt=0)
    rollover_seconds: Duration = 60.0
    rollover_rows: int | None = Field(default=None, gt=0)
    flush_interval: Duration = 1.0
    transactions: bool = False
    compression: Literal["zstd", "snappy"] = "zstd"
    fsync: bool = True
    storage: StorageConfig = Field(default_factory=StorageConfig)
