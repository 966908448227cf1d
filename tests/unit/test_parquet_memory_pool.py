"""Arrow's C++ default memory pool where pyarrow loads through cdcd's file sink
(cdcd/sinks/file/__init__.py): the system allocator, so what the Parquet writer's encoders and
compressors free goes back to the system instead of staying in mimalloc's huge pages.

Each case is a fresh interpreter: the pool is chosen once, as pyarrow loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

#: loads pyarrow the way the daemon does (through the Parquet writer's module), writes a Parquet
#: file, and prints how much each pool ever held (null: a pyarrow built without mimalloc)
WRITE = """
import io, json
import cdcd.sinks.file.parquet
import pyarrow as pa, pyarrow.parquet as pq
table = pa.table({"a": [str(i) * 20 for i in range(50_000)]})
with pq.ParquetWriter(io.BytesIO(), table.schema, compression="zstd") as writer:
    writer.write_table(table)
try:
    mimalloc = pa.mimalloc_memory_pool().max_memory()
except NotImplementedError:
    mimalloc = None
print(json.dumps({"mimalloc": mimalloc, "system": pa.system_memory_pool().max_memory()}))
"""


def pools_after_write(**env: str) -> dict[str, int | None]:
    environ = {k: v for k, v in os.environ.items() if k != "ARROW_DEFAULT_MEMORY_POOL"}
    out = subprocess.run(
        [sys.executable, "-c", WRITE],
        env={**environ, **env},
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    result: dict[str, int | None] = json.loads(out.splitlines()[-1])
    if result["mimalloc"] is None:
        pytest.skip("this pyarrow has no mimalloc pool")
    return result


def test_parquet_writer_allocates_from_the_system_pool() -> None:
    pools = pools_after_write()
    assert pools["mimalloc"] == 0
    assert pools["system"]


def test_a_users_arrow_default_memory_pool_wins() -> None:
    assert pools_after_write(ARROW_DEFAULT_MEMORY_POOL="mimalloc")["mimalloc"]
