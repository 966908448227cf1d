"""Pure parts of the file sink's object storage (cdcd/sinks/file/storage.py): how ``path`` and
``storage`` are validated, and how S3 errors (pyarrow's messages) are classified and retried.
The uploads themselves are tested against a real S3 server in tests/integration/test_s3_*.py."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from cdcd.config import parse_config
from cdcd.errors import ConfigError, DefiniteSinkError, TransientSinkError
from cdcd.sinks.file.sink import FileSink, FileSinkConfig
from cdcd.sinks.file.storage import ObjectStore, StorageConfig, open_filesystem


def sink(**options: Any) -> FileSinkConfig:
    return FileSinkConfig.model_validate(options, context={"config_dir": Path("/etc/cdcd")})


def test_urls_stay_urls_and_paths_become_absolute() -> None:
    assert sink(path="s3://lake/cdc/shop/").path == "s3://lake/cdc/shop"
    assert sink(path="out").path == Path("/etc/cdcd/out")
    config = parse_config(
        {
            "source": {"dsn": "postgresql://cdc@db/shop"},
            "sinks": [{"type": "file", "path": "s3://lake/cdc"}, {"type": "file", "path": "out"}],
        },
        Path("/etc/cdcd"),
    )
    assert [s.config.path for s in config.sinks] == ["s3://lake/cdc", Path("/etc/cdcd/out")]  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("s3:///prefix", "no bucket"),
        ("s3://lake/p?versionId=1", r"no \?query"),
        (42, "expected a path or a URL"),
        # what pyarrow could open but cdcd cannot publish atomically, or a typo
        ("gs://lake/x", r"gs:// is not supported; the file sink writes to a local folder or s3://"),
        ("s4://lake/x", r"s4:// is not supported"),
        ("hdfs://namenode/x", r"hdfs:// is not supported"),
        ("file:///data/out", r"file:// is not supported.*without file://"),
    ],
)
def test_bad_paths_are_named(path: object, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        sink(path=path)


def test_an_unsupported_scheme_names_the_key() -> None:
    with pytest.raises(ConfigError, match=r"sinks\[1\]\.path: 'gs://lake/x': the URL scheme"):
        parse_config(
            {
                "source": {"dsn": "postgresql://cdc@db/shop"},
                "sinks": [{"type": "file", "path": "out"}, {"type": "file", "path": "gs://lake/x"}],
            },
            Path("/etc/cdcd"),
        )
    with pytest.raises(ValidationError, match="a local folder, not a URL"):
        sink(path="s3://lake/x", storage={"staging_dir": "s3://lake/staging"})


def test_the_folder_checked_for_object_storage_is_the_staging_folder() -> None:
    """``cdcd check`` and ``cdcd run`` check the folders a sink writes (cdcd.directories):
    for object storage that is the local staging folder, not the URL taken as a path."""
    staged = sink(path="s3://lake/x", storage={"staging_dir": "stage"})
    assert FileSink.directories(staged) == {"storage.staging_dir": Path("/etc/cdcd/stage")}
    (default,) = FileSink.directories(sink(path="s3://lake/x")).values()
    assert default.parent == Path(tempfile.gettempdir())
    assert default.name.startswith("cdcd-staging-")
    assert FileSink.directories(sink(path="out")) == {"path": Path("/etc/cdcd/out")}


def test_storage_keys_are_checked() -> None:
    with pytest.raises(ValidationError, match=r"extra_forbidden|Extra inputs"):
        sink(path="s3://lake/x", storage={"acces_key_id": "x"})
    config = sink(path="s3://lake/x", storage={"retry_timeout": "30s", "secret_access_key": "s"})
    assert config.storage.retry_timeout == 30.0
    assert "s'" not in repr(config.storage)  # secrets are not shown


def test_environment_fills_what_storage_leaves_out() -> None:
    env = {
        "AWS_ACCESS_KEY_ID": "env-key",
        "AWS_SECRET_ACCESS_KEY": "env-secret",
        "AWS_REGION": "eu-west-3",
        "AWS_ENDPOINT_URL": "http://127.0.0.1:9",
    }
    fs, root = open_filesystem("s3://lake/cdc/shop", StorageConfig(), env)
    assert root == "lake/cdc/shop"
    assert fs.region == "eu-west-3"
    fs, _ = open_filesystem("s3://lake", StorageConfig(region="us-west-2"), env)
    assert fs.region == "us-west-2"


def store(retry_timeout: float = 1.0) -> tuple[ObjectStore, list[float]]:
    sleeps: list[float] = []
    s = ObjectStore(
        "s3://lake/cdc",
        StorageConfig(retry_timeout=retry_timeout, retry_max_backoff=0.5),
        filesystem=None,  # type: ignore[arg-type]  (call() does not use it)
        root="lake/cdc",
    )
    s.sleep = sleeps.append
    return s, sleeps


def failing(messages: list[str]) -> Any:
    def fn() -> str:
        if messages:
            raise OSError(messages.pop(0))
        return "done"

    return fn


SLOW_DOWN = (
    "When uploading object with key 'cdc/a' in bucket 'lake': AWS Error SLOW_DOWN during "
    "PutObject operation: Please reduce your request rate."
)
UNAVAILABLE = "AWS Error UNKNOWN (HTTP status 503) during PutObject operation: Service Unavailable"
RESET = "AWS Error NETWORK_CONNECTION during PutObject operation: curlCode: 56, Failure"


def test_throttling_5xx_and_network_errors_are_retried_with_backoff() -> None:
    s, sleeps = store(retry_timeout=60)
    assert s.call("upload", "lake/cdc/a", failing([SLOW_DOWN, UNAVAILABLE, RESET] * 2)) == "done"
    assert sleeps == [0.2, 0.4, 0.5, 0.5, 0.5, 0.5]


def test_retries_end_in_a_transient_error_naming_the_object() -> None:
    s, sleeps = store(retry_timeout=0)
    with pytest.raises(TransientSinkError, match=r"s3://lake/cdc/a \(bucket 'lake', key 'cdc/a'\)"):
        s.call("upload", "lake/cdc/a", failing([SLOW_DOWN] * 100))
    assert sleeps == []


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        ("AWS Error ACCESS_DENIED during PutObject operation: Access Denied", "access denied"),
        ("AWS Error NO_SUCH_BUCKET during PutObject operation: nope", "the bucket does not exist"),
        ("AWS Error INVALID_ACCESS_KEY_ID during PutObject", "the access key id is not known"),
    ],
)
def test_definite_errors_are_not_retried(message: str, reason: str) -> None:
    s, sleeps = store()
    with pytest.raises(DefiniteSinkError, match=f"cannot upload s3://lake/cdc/a .*: {reason}"):
        s.call("upload", "lake/cdc/a", failing([message]))
    assert sleeps == []
