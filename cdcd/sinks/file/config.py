"""The file sink's settings: ``sinks: - type: file`` and its ``storage:`` (docs/files.md).

Kept apart from the sink so that every module of the file sink can name them without importing
the sink (:mod:`~cdcd.sinks.file.sink` imports them all).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, PlainValidator, SecretStr, ValidationInfo

from cdcd.units import ByteSize, Duration, resolve_path

_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def is_url(path: object) -> bool:
    return isinstance(path, str) and _URL.match(path) is not None


def _sink_path(value: Any, info: ValidationInfo) -> Path | str:
    """A local path (made absolute like ``ConfigPath``) or an object store URL, kept as text."""
    if is_url(value):
        parts = urlsplit(value)
        if parts.scheme == "s3" and not parts.netloc:
            raise ValueError(f"{value!r}: no bucket (use s3://bucket/prefix)")
        if parts.query or parts.fragment:
            raise ValueError(f"{value!r}: no ?query or #fragment (options go in storage:)")
        return str(value).rstrip("/")
    if not isinstance(value, str | Path):
        raise ValueError(f"expected a path or a URL, not {type(value).__name__}")
    return resolve_path(Path(value), info)


#: ``sinks[].path``: a folder, or ``s3://bucket/prefix`` (any pyarrow filesystem URL)
SinkPath = Annotated[Path | str, PlainValidator(_sink_path)]


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
    staging_dir: Annotated[Path | str, PlainValidator(_sink_path)] | None = None
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
