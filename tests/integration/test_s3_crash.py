"""The file sink's SIGKILL loop (test_crash_safety.py) with the sink on S3: moto's server on
127.0.0.1 (or ``CDCD_TEST_S3_URL``). cdcd is killed at random moments, uploads included, under
a random workload (streamed, prepared, aborted transactions, messages); at the end the prefix,
copied to a local folder, holds every committed change exactly once, each object complete and
named after its first event, and the slot never confirmed what S3 did not hold. 8 kills
(``CDCD_TEST_ALL_VERSIONS=1``: 16).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from tests.e2e import thorough
from tests.integration.test_crash_safety import (
    SEED,
    Daemon,
    Workload,
    assert_exactly_once,
    assert_nothing_confirmed_is_missing,
    daemons,  # noqa: F401  (fixture)
    finish_to_endpos,
    make_config,
    prepare_database,
)
from tests.pgharness import PgDatabase
from tests.s3harness import S3Store, launch_s3

pytestmark = [pytest.mark.pg, pytest.mark.slow]

KILLS = 16 if thorough() else 8  # a multiple of 4: every fourth checks the bucket mid-loop


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Store]:
    store = launch_s3()
    try:
        yield store
    finally:
        store.close()


def test_sigkill_loop_on_s3_loses_and_doubles_nothing(
    pg_db: PgDatabase,
    tmp_path: Path,
    s3: S3Store,
    daemons: Callable[[Path, Path], Daemon],  # noqa: F811
) -> None:
    prepare_database(pg_db)
    cfg = make_config(tmp_path, pg_db.dsn)
    prefix = s3.new_prefix()
    data = yaml.safe_load(cfg.read_text())
    data["sinks"][0] |= {
        "path": f"s3://{prefix}",
        "storage": s3.storage(staging_dir=str(tmp_path / "staging")),
    }
    cfg.write_text(yaml.safe_dump(data))
    rng = random.Random(SEED + 10)
    workload = Workload(pg_db.cluster, pg_db.name, SEED + 10)
    daemon = daemons(cfg, tmp_path / "cdcd.log")
    workload.start()
    try:
        for kill in range(KILLS):
            daemon.start()
            if kill % 2:
                daemon.wait_streaming()
            time.sleep(rng.uniform(0.3, 1.5))
            daemon.assert_running()
            daemon.kill()
            if kill % 4 == 3:  # confirmed means uploaded, at any moment
                assert_nothing_confirmed_is_missing(
                    pg_db, s3.download(prefix, tmp_path / f"mirror-{kill}"), workload
                )
    finally:
        workload.finish()
    assert len(s3.keys(prefix)) > KILLS, "the killed runs published along the way"
    finish_to_endpos(pg_db, cfg)
    assert workload.transactions > 40
    assert daemon.log().count('"event":"streaming"') >= KILLS // 2
    out = s3.download(prefix, tmp_path / "out")
    assert_exactly_once(pg_db, out, workload)
