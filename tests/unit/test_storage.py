"""Pure parts of the file sink's object storage (cdcd/sinks/file/storage.py): how ``path`` and
``storage`` are validated, and how S3 errors (pyarrow's messages) are classified and retried.
The uploads themselves are tested against a real S3 server in tests/integration/test_s3_*.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from cdcd.config import parse_config
from cdcd.errors import DefiniteSinkError, TransientSinkError
from cdcd.sinks.file.sink import FileSinkConfig
from cdcd.sinks.file.storage import ObjectStore, StorageConfig, open_filesystem


def sink(**options: Any) -> FileSinkConfig:
    return FileSinkConfig.model_validate(options, context={"config_dir": Path("/etc/cdcd")})


def test_urls_stay_urls_and_paths_become_absolute() -> None:
    assert sink(path="s3://lake/cdc/shop/").path == "s3://lake/cdc/shop"
    assert sink(path="gs://lake/x").path == "gs://lake/x"
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
    ],
)
def test_bad_paths_are_named(path: object, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        sink(path=path)


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
