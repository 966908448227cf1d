"""The file sink on S3 (``path: s3://bucket/prefix``, cdcd/sinks/file/storage.py), end to end: the
real ``cdcd`` against a real PostgreSQL and moto's S3 server on 127.0.0.1 (or the store named
by ``CDCD_TEST_S3_URL``; the tests that inject HTTP errors need moto).

* JSON Lines and Parquet on S3 hold exactly what the same sink writes to a local folder (same
  object names, same bytes for JSON Lines, same events for Parquet), ``_schema`` files too;
* a second run recovers from the listing and publishes nothing twice;
* 503 SlowDown and 500 answers are retried with backoff, and while uploads fail nothing is
  confirmed to PostgreSQL; once S3 answers again everything arrives, once;
* a missing bucket and access denied stop cdcd with a message naming bucket and key; a missing
  bucket before any slot or publication is created (exit 3), and ``cdcd check`` tests the
  bucket and the staging folder.

The crash loop (SIGKILL during uploads) is in test_s3_crash.py.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from pyarrow.dataset import dataset

from cdcd.errors import DefiniteSinkError
from cdcd.lsn import parse_lsn
from cdcd.sinks.file.storage import ObjectStorePublisher, StorageConfig
from tests.e2e import (
    all_events,
    assert_no_duplicates,
    comparable_event,
    parquet_events,
    read_events,
    run_cdcd,
    start_cdcd,
    write_config,
)
from tests.pgharness import PgDatabase
from tests.s3harness import FailingProxy, S3Store, launch_s3

pytestmark = [pytest.mark.pg, pytest.mark.version_independent, pytest.mark.xdist_group("s3")]


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Store]:
    store = launch_s3()
    try:
        yield store
    finally:
        store.close()


def s3_sink(
    prefix: str, store: S3Store, endpoint: str | None = None, **options: Any
) -> dict[str, Any]:
    storage = store.storage(endpoint, **options.pop("storage", {}))
    return {
        "type": "file",
        "path": f"s3://{prefix}",
        "flush_interval": 0.2,
        "storage": storage,
        **options,
    }


def setup_source(db: PgDatabase, tmp_path: Path, sinks: list[dict[str, Any]]) -> Path:
    db.execute(
        "CREATE TABLE orders (id int PRIMARY KEY, item text, qty int);"
        "CREATE PUBLICATION cdcd_e2e_pub FOR ALL TABLES"
    )
    for i, sink in enumerate(sinks):  # staged files in the test's folder, not /tmp
        if "storage" in sink:
            sink["storage"].setdefault("staging_dir", str(tmp_path / f"staging{i}"))
    cfg = write_config(tmp_path, db.dsn, sinks=sinks)
    data = yaml.safe_load(cfg.read_text())
    data["shutdown"] = {"grace_period": 20}
    cfg.write_text(yaml.safe_dump(data))
    run_cdcd("slot", "create", "--config", str(cfg))
    return cfg


def workload(db: PgDatabase, start: int, n: int) -> None:
    for i in range(start, start + n):
        db.execute(
            f"INSERT INTO orders VALUES ({i}, 'item {i}', {i % 7});"
            f"UPDATE orders SET qty = qty + 1 WHERE id = {i}"
        )
    db.execute(f"DELETE FROM orders WHERE id = {start}")


def run_to_now(db: PgDatabase, cfg: Path) -> None:
    endpos = db.fetchval("SELECT pg_current_wal_insert_lsn()::text")
    run_cdcd("run", "--config", str(cfg), "--endpos", endpos, timeout=180)


def start_streaming(cfg: Path, log: Path) -> Any:
    """``cdcd run`` in the background, once it streams."""
    proc = start_cdcd("run", "--config", str(cfg), log_path=log)
    deadline = time.monotonic() + 60
    while '"event":"streaming"' not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(log.read_text()[-4000:])
        time.sleep(0.2)
    return proc


def confirmed(db: PgDatabase) -> int:
    return parse_lsn(
        db.fetchval(
            "SELECT confirmed_flush_lsn::text FROM pg_replication_slots "
            "WHERE slot_name = 'cdcd_e2e'"
        )
    )


def test_jsonl_and_parquet_on_s3_match_the_local_sink(
    pg_db: PgDatabase, tmp_path: Path, s3: S3Store
) -> None:
    jsonl, parquet = s3.new_prefix("jsonl"), s3.new_prefix("parquet")
    cfg = setup_source(
        pg_db,
        tmp_path,
        [
            # files end at 40 rows and at the end of a run only: the same files everywhere
            {"type": "file", "path": "local", "rollover_rows": 40, "flush_interval": "1h"},
            s3_sink(jsonl, s3, rollover_rows=40, flush_interval="1h"),
            s3_sink(parquet, s3, format="parquet", rollover_rows=40, flush_interval="1h"),
        ],
    )
    workload(pg_db, 1, 60)
    run_to_now(pg_db, cfg)
    pg_db.execute("ALTER TABLE orders ADD COLUMN note text")  # a second _schema file
    workload(pg_db, 100, 30)
    run_to_now(pg_db, cfg)  # the second run recovers from the listing

    local = tmp_path / "local"
    names = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
    keys = s3.keys(jsonl)
    assert sorted(keys) == names, "the same objects as local files"
    assert sum(n.endswith(".jsonl") for n in names) >= 5 and any("/_schema/" in n for n in names)
    mirror = s3.download(jsonl, tmp_path / "mirror")
    for name in names:
        assert (mirror / name).read_bytes() == (local / name).read_bytes(), name
    events = read_events(mirror, "public.orders")
    assert len(events) == 60 * 2 + 1 + 30 * 2 + 1
    assert_no_duplicates(all_events(mirror))

    pq_mirror = s3.download(parquet, tmp_path / "pq-mirror")
    assert [comparable_event(e) for e in events] == parquet_events(pq_mirror, "public.orders")
    assert (
        sorted((pq_mirror / "public.orders" / "_schema").iterdir())[1].name
        == sorted((local / "public.orders" / "_schema").iterdir())[1].name
    )
    # read in place with pyarrow, as docs/spark.md shows
    table = dataset(f"{parquet}/public.orders", filesystem=s3.filesystem(), format="parquet")
    rows = (
        table.to_table()
        .flatten()
        .sort_by([("source.commit_lsn", "ascending"), ("source.seq", "ascending")])
    )
    assert rows.column("op").to_pylist() == [e["op"] for e in events]
    # nothing staged is left behind (the default staging folder, under the temp folder)
    assert not any(n.startswith(".") or "/." in n for n in keys)


def test_throttling_and_server_errors_are_retried(
    pg_db: PgDatabase, tmp_path: Path, s3: S3Store
) -> None:
    if s3.external or s3.endpoint is None:
        pytest.skip("injecting HTTP errors needs the S3 server started by the tests")
    prefix = s3.new_prefix()
    with FailingProxy(s3.endpoint) as proxy:
        cfg = setup_source(
            pg_db,
            tmp_path,
            [
                s3_sink(
                    prefix,
                    s3,
                    proxy.endpoint,
                    rollover_rows=25,
                    storage={"retry_max_backoff": "1s"},
                )
            ],
        )
        workload(pg_db, 1, 50)
        proxy.fail(6, 503, "SlowDown")
        run_to_now(pg_db, cfg)
        assert proxy.failed == 6
        workload(pg_db, 100, 20)
        proxy.fail(4, 500, "InternalError")
        run_to_now(pg_db, cfg)
        assert proxy.failed == 10
    events = read_events(s3.download(prefix, tmp_path / "mirror"), "public.orders")
    assert len(events) == 50 * 2 + 1 + 20 * 2 + 1
    assert_no_duplicates(events)


def test_nothing_is_confirmed_while_uploads_fail(
    pg_db: PgDatabase, tmp_path: Path, s3: S3Store
) -> None:
    if s3.external or s3.endpoint is None:
        pytest.skip("injecting HTTP errors needs the S3 server started by the tests")
    prefix = s3.new_prefix()
    with FailingProxy(s3.endpoint) as proxy:
        cfg = setup_source(
            pg_db,
            tmp_path,
            [s3_sink(prefix, s3, proxy.endpoint, storage={"retry_max_backoff": "1s"})],
        )
        data = yaml.safe_load(cfg.read_text())
        data["source"]["status_interval"] = "1s"
        cfg.write_text(yaml.safe_dump(data))
        log = tmp_path / "cdcd.log"
        proc = start_streaming(cfg, log)
        try:
            before = confirmed(pg_db)
            proxy.fail(-1, 503, "SlowDown")
            workload(pg_db, 1, 10)
            written = parse_lsn(pg_db.fetchval("SELECT pg_current_wal_insert_lsn()::text"))
            time.sleep(6)
            assert proc.poll() is None, log.read_text()[-4000:]
            assert proxy.failed >= 3, "uploads were tried again"
            assert confirmed(pg_db) < written, "confirmed while nothing was uploaded"
            assert confirmed(pg_db) >= before
            assert not s3.keys(prefix), "nothing is visible while uploads fail"
            proxy.fail(0)
            deadline = time.monotonic() + 60
            while confirmed(pg_db) < written:
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
                time.sleep(0.3)
            proc.terminate()
            assert proc.wait(30) == 0, log.read_text()[-4000:]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    events = read_events(s3.download(prefix, tmp_path / "mirror"), "public.orders")
    assert len(events) == 10 * 2 + 1
    assert_no_duplicates(events)


def test_a_failed_part_leaves_no_object(s3: S3Store, tmp_path: Path) -> None:
    """A multipart upload whose second part is refused is never completed: no object."""
    if s3.external or s3.endpoint is None:
        pytest.skip("injecting HTTP errors needs the S3 server started by the tests")
    prefix = s3.new_prefix()
    local = tmp_path / "big.jsonl"
    local.write_bytes(os.urandom(25 << 20))  # three parts
    with FailingProxy(s3.endpoint) as proxy:
        storage = StorageConfig.model_validate(
            s3.storage(proxy.endpoint, staging_dir=str(tmp_path / "staging"))
        )
        store = ObjectStorePublisher(f"s3://{prefix}", storage).store
        proxy.fail(1, 400, "InvalidArgument", methods=("PUT",), after=1)
        with pytest.raises(DefiniteSinkError, match=r"cannot upload s3://.*key 'out/t/big.jsonl'"):
            store.upload(local, "t/big.jsonl")
        assert proxy.failed == 1
        assert not s3.keys(prefix)
        store.upload(local, "t/big.jsonl")  # and a whole upload is visible whole
    assert s3.keys(prefix) == {"t/big.jsonl": 25 << 20}


def test_missing_bucket_stops_cdcd_before_the_slot_is_created(
    pg_db: PgDatabase, tmp_path: Path, s3: S3Store
) -> None:
    bucket = f"cdcd-missing-{os.getpid()}"
    sink = s3_sink(f"{bucket}/out", s3, storage={"staging_dir": str(tmp_path / "staging")})
    cfg = write_config(tmp_path, pg_db.dsn, sinks=[sink])  # creates slot and publication
    for command in ("check", "run"):
        proc = run_cdcd(command, "--config", str(cfg), check=False, timeout=120)
        output = proc.stdout + proc.stderr
        assert proc.returncode == 3, output[-3000:]
        assert (
            f"sinks[0].path: file sink: bucket '{bucket}' of s3://{bucket}/out does not exist"
            in (" ".join(output.split()))
        ), output[-3000:]
    slots = "SELECT count(*) FROM pg_replication_slots WHERE database = current_database()"
    assert pg_db.fetchval(slots) == 0
    assert pg_db.fetchval("SELECT count(*) FROM pg_publication") == 0


def test_check_looks_at_the_staging_folder(tmp_path: Path, s3: S3Store) -> None:
    """For object storage the local folder cdcd writes is the staging folder: ``cdcd check``
    and ``cdcd run`` test that one (not the URL taken as a local path) and the bucket."""
    nowhere = "postgresql://cdc@127.0.0.1:1/shop"  # the checks come before any connection
    prefix = s3.new_prefix()
    not_a_folder = tmp_path / "a-file"
    not_a_folder.write_text("")
    sink = s3_sink(prefix, s3, storage={"staging_dir": str(not_a_folder / "staging")})
    cfg = write_config(tmp_path, nowhere, sinks=[sink])
    run = run_cdcd("run", "--config", str(cfg), check=False, timeout=60)
    assert run.returncode == 2, run.stderr
    assert "sinks[0].storage.staging_dir" in run.stderr and "not a directory" in run.stderr
    check = run_cdcd("check", "--config", str(cfg), check=False, timeout=60)
    rows = rows_of(check.stdout)
    assert check.returncode == 2, check.stdout
    assert ["sinks[0].storage.staging_dir", "FAIL"] in [r[:2] for r in rows], check.stdout
    assert ["sinks[0]", "ok", f"s3://{prefix}:", "the", "bucket", "exists"] in rows, check.stdout
    assert "s3:/" not in "".join(r[0] for r in rows), check.stdout

    sink["storage"]["staging_dir"] = str(tmp_path / "staging")
    cfg = write_config(tmp_path, nowhere, sinks=[sink])
    check = run_cdcd("check", "--config", str(cfg), check=False, timeout=60)
    assert ["sinks[0].storage.staging_dir", "ok"] in [r[:2] for r in rows_of(check.stdout)]


def rows_of(report: str) -> list[list[str]]:
    return [line.split() for line in report.splitlines()]


def test_access_denied_is_named(pg_db: PgDatabase, tmp_path: Path) -> None:
    """moto checks credentials with INITIAL_NO_AUTH_ACTION_COUNT=0: the test's made-up access
    key is refused at the first request (403 AccessDenied on HeadBucket)."""
    if os.environ.get("CDCD_TEST_S3_URL"):
        pytest.skip("needs the S3 server started by the tests")
    os.environ["INITIAL_NO_AUTH_ACTION_COUNT"] = "0"
    try:
        store = launch_s3()
    finally:
        del os.environ["INITIAL_NO_AUTH_ACTION_COUNT"]
    bucket = f"cdcd-denied-{os.getpid()}"
    try:
        cfg = setup_source(pg_db, tmp_path, [s3_sink(f"{bucket}/out", store)])
        workload(pg_db, 1, 2)
        endpos = pg_db.fetchval("SELECT pg_current_wal_insert_lsn()::text")
        proc = run_cdcd("run", "--config", str(cfg), "--endpos", endpos, check=False)
    finally:
        store.close()
    assert proc.returncode != 0
    output = proc.stdout + proc.stderr
    assert f"s3://{bucket}/" in output and f"bucket {bucket!r}" in output, output[-3000:]
    assert "access denied (check the credentials and the bucket policy)" in output, output[-3000:]


def test_sigterm_while_uploads_fail_ends_within_the_grace_period(
    pg_db: PgDatabase, tmp_path: Path, s3: S3Store
) -> None:
    """The drain cannot finish (every upload is refused and retried): after
    ``shutdown.grace_period`` cdcd confirms what is durable, nothing more, and exits 0; the
    next run sends the rest."""
    if s3.external or s3.endpoint is None:
        pytest.skip("injecting HTTP errors needs the S3 server started by the tests")
    prefix = s3.new_prefix()
    grace = 3
    with FailingProxy(s3.endpoint) as proxy:
        sink = s3_sink(prefix, s3, proxy.endpoint, storage={"retry_max_backoff": "1s"})
        cfg = setup_source(pg_db, tmp_path, [sink])
        data = yaml.safe_load(cfg.read_text())
        data["shutdown"] = {"grace_period": grace}
        cfg.write_text(yaml.safe_dump(data))
        log = tmp_path / "cdcd.log"
        proc = start_streaming(cfg, log)
        try:
            proxy.fail(-1, 503, "SlowDown")
            workload(pg_db, 1, 10)
            written = parse_lsn(pg_db.fetchval("SELECT pg_current_wal_insert_lsn()::text"))
            deadline = time.monotonic() + 60
            while proxy.failed < 2:  # the sink is retrying an upload
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
            proc.terminate()
            # well before the watchdog (grace + 10 s), which would exit 1
            assert proc.wait(grace + 8) == 0, log.read_text()[-4000:]
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        assert "shutdown grace period expired" in log.read_text()
        assert confirmed(pg_db) < written, "confirmed what was not uploaded"
    data["sinks"][0]["storage"]["endpoint_url"] = s3.endpoint
    cfg.write_text(yaml.safe_dump(data))
    run_to_now(pg_db, cfg)
    events = read_events(s3.download(prefix, tmp_path / "mirror"), "public.orders")
    assert len(events) == 10 * 2 + 1
    assert_no_duplicates(events)
