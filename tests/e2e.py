"""Helpers for end-to-end tests: run the real ``cdcd`` CLI against a real PostgreSQL and read
back what the sinks wrote, independently of cdcd's own reading code."""

from __future__ import annotations

import base64
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from decimal import Decimal
from pathlib import Path
from typing import Any

import orjson
import psycopg2
import yaml

REPO = Path(__file__).resolve().parent.parent


def thorough() -> bool:
    """``CDCD_TEST_ALL_VERSIONS=1`` (or the older ``CDCD_TEST_ALL_CRASH=1``): every test on
    every PostgreSQL version (tests/conftest.py) and the crash loops at their full length."""
    return "1" in (os.environ.get("CDCD_TEST_ALL_VERSIONS"), os.environ.get("CDCD_TEST_ALL_CRASH"))


class StatementWorkload(threading.Thread):
    """Single-statement transactions (autocommit) on one database until :attr:`stop` is set:
    the background writes of the snapshot tests. A subclass's :meth:`step` runs one statement
    on ``cur``, choosing with :attr:`rng`; :attr:`done` counts them, :attr:`error` holds what
    ended the thread early (the test reports it)."""

    #: seconds between statements
    pause = 0.0

    def __init__(self, dsn: str, seed: int) -> None:
        super().__init__(daemon=True)
        self.dsn = dsn
        self.rng = random.Random(seed)
        self.stop = threading.Event()
        self.done = 0
        self.error: BaseException | None = None

    def step(self, cur: Any) -> None:
        raise NotImplementedError

    def run(self) -> None:
        try:
            conn = psycopg2.connect(self.dsn)
            conn.autocommit = True
            cur = conn.cursor()
            while not self.stop.is_set():
                self.step(cur)
                self.done += 1
                if self.pause:
                    time.sleep(self.pause)
            conn.close()
        except BaseException as exc:
            self.error = exc


def write_config(
    directory: Path,
    dsn: str,
    *,
    sinks: list[dict[str, Any]] | None = None,
    name: str = "shop",
    snapshot: str = "never",
    **source: Any,
) -> Path:
    """A cdcd YAML config in ``directory``; file sink to ``directory/out`` unless ``sinks``."""
    directory.mkdir(parents=True, exist_ok=True)
    cfg: dict[str, Any] = {
        "name": name,
        "source": {"dsn": dsn, "slot": "cdcd_e2e", "publication": "cdcd_e2e_pub", **source},
        "snapshot": {"mode": snapshot},
        "sinks": sinks or [{"type": "file", "path": "out", "format": "jsonl"}],
        "buffer": {"spill_dir": "spill"},
        "http": {"listen": None},
        "log": {"format": "json", "level": "info"},
    }
    path = directory / "cdcd.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def cdcd_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "cdcd", *args]


def run_cdcd(
    *args: str, timeout: float = 120, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run the CLI to completion; on failure the assertion shows its output."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        cdcd_cmd(*args), capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"cdcd {' '.join(args)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}"
            f"\n--- stderr\n{proc.stderr[-6000:]}"
        )
    return proc


def start_cdcd(*args: str, log_path: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    out = log_path.open("ab")
    return subprocess.Popen(
        cdcd_cmd(*args), stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO
    )


def data_files(folder: Path, suffix: str = ".jsonl") -> list[Path]:
    """Published data files of one table folder, sorted by name (= event order)."""
    if not folder.is_dir():
        return []
    return sorted(
        p
        for p in folder.iterdir()
        if p.is_file() and p.name.endswith(suffix) and not p.name.startswith(("_", "."))
    )


def read_events(out: Path, table: str) -> list[dict[str, Any]]:
    """Every event of ``schema.table`` in file-name order."""
    events: list[dict[str, Any]] = []
    for path in data_files(out / table):
        for line in path.read_bytes().splitlines():
            if line.strip():
                events.append(orjson.loads(line))
    return events


def all_events(out: Path) -> Iterator[dict[str, Any]]:
    for folder in sorted(out.iterdir()):
        if folder.is_dir() and not folder.name.startswith("."):
            if folder.name.startswith("_") and folder.name != "_messages":
                continue
            for path in data_files(folder):
                for line in path.read_bytes().splitlines():
                    if line.strip():
                        yield orjson.loads(line)


def position(event: dict[str, Any]) -> tuple[int, int]:
    return (event["source"]["commit_lsn"], event["source"]["seq"])


def assert_no_duplicates(events: Iterable[dict[str, Any]]) -> None:
    seen: dict[tuple[int, int], dict[str, Any]] = {}
    for event in events:
        pos = position(event)
        assert pos not in seen, f"event at {pos} published twice"
        seen[pos] = event


def rebuild(
    events: Iterable[dict[str, Any]], key_columns: tuple[str, ...]
) -> dict[tuple[Any, ...], dict[str, Any]]:
    """Apply events in (commit_lsn, seq) order to an empty table; rows by key."""
    state: dict[tuple[Any, ...], dict[str, Any]] = {}
    for event in sorted(events, key=position):
        op = event["op"]
        if op in ("c", "r", "u"):
            row = event["after"]
            state[tuple(row[c] for c in key_columns)] = row
            if op == "u" and event.get("before") is not None:
                old = tuple(event["before"][c] for c in key_columns)
                if old != tuple(row[c] for c in key_columns):
                    state.pop(old, None)
        elif op == "d":
            old_row = event["before"] if event["before"] is not None else event["key"]
            state.pop(tuple(old_row[c] for c in key_columns), None)
        elif op == "t":
            state.clear()
    return state


def normalize(value: Any) -> Any:
    """Comparable form of a contract JSON value (numeric strings as Decimal)."""
    if isinstance(value, str):
        try:
            return Decimal(value) if value.replace(".", "", 1).lstrip("-").isdigit() else value
        except ArithmeticError:
            return value
    if isinstance(value, float):
        return Decimal(repr(value))
    if isinstance(value, int) and not isinstance(value, bool):
        return Decimal(value)
    return value


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# --------------------------------------------------------------------------- checked reading
# (added for tests/integration/test_e2e_*.py)

UNAVAILABLE = "__debezium_unavailable_value"


def file_name(event: dict[str, Any], suffix: str = ".jsonl") -> str:
    """docs/files.md: the name of a data file whose first event is ``event``."""
    commit_lsn, seq = position(event)
    return f"{commit_lsn:016X}-{seq:08X}{suffix}"


def checked_events(out: Path, table: str) -> list[dict[str, Any]]:
    """:func:`read_events`, asserting the file layout: every file is named after its first event,
    sorting the names sorts the events (strictly: no position twice)."""
    events: list[dict[str, Any]] = []
    for path in data_files(out / table):
        lines = [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]
        assert lines, f"{path} is empty"
        assert path.name == file_name(lines[0]), f"{path.name} is not named after its first event"
        events.extend(lines)
    positions = [position(e) for e in events]
    assert positions == sorted(set(positions)), (
        f"{table}: file order is not event order, or a duplicate"
    )
    return events


def _fill_unavailable(row: dict[str, Any], previous: dict[str, Any] | None) -> dict[str, Any]:
    """An update's ``after`` with unchanged-TOAST markers replaced by the previous values."""
    if UNAVAILABLE not in row.values():
        return row
    assert previous is not None, f"unchanged TOAST value for a row never seen: {row}"
    return {c: previous[c] if v == UNAVAILABLE else v for c, v in row.items()}


def _key_ident(key: Any) -> str:
    return orjson.dumps(key, option=orjson.OPT_SORT_KEYS).decode()


def apply_events(events: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The table state after applying ``events`` in ``(commit_lsn, seq)`` order, as a consumer
    would: rows matched by ``key`` when the event has one, else by the whole ``before`` row
    (a table without key: duplicate rows are kept); unchanged-TOAST markers keep the previous
    value. The create of a key change (``source.old_key``) takes its unchanged-TOAST values
    from the row held under ``old_key`` just before (which the delete before it removed),
    the consumer rule of docs/events.md. After the reset of a recreated slot, a delete
    may name a row not backfilled yet (docs/high-availability.md). Returns the rows
    (unordered)."""
    keyed: dict[str, dict[str, Any]] = {}
    keyless: list[dict[str, Any]] = []
    removed: dict[str, dict[str, Any]] = {}  # the last row deleted under each key
    reset = False  # a recreated slot's reset seen: rows not backfilled yet may be deleted

    def take_keyless(before: dict[str, Any] | None) -> dict[str, Any]:
        assert before is not None, "update/delete of a keyless table without a before image"
        for i, row in enumerate(keyless):
            if row == before:
                return keyless.pop(i)
        raise AssertionError(f"no row equal to before {before}")

    for event in sorted(events, key=position):
        op, key = event["op"], event.get("key")
        ident = _key_ident(key) if key is not None else None
        old_key = event["source"].get("old_key")
        if op == "t":
            keyed.clear()
            keyless.clear()
            reset = reset or event["source"].get("snapshot") == "reset"
        elif op in ("c", "r"):
            if ident is None:
                keyless.append(event["after"])
            elif old_key is not None:
                old = _key_ident(old_key)
                keyed[ident] = _fill_unavailable(event["after"], keyed.get(old, removed.get(old)))
            else:
                keyed[ident] = event["after"]
        elif op == "u":
            if ident is None:
                old = take_keyless(event["before"])
                keyless.append(_fill_unavailable(event["after"], old))
            else:
                keyed[ident] = _fill_unavailable(event["after"], keyed.get(ident))
        elif op == "d":
            if ident is None:
                take_keyless(event["before"])
            else:
                row = keyed.pop(ident, None)
                assert row is not None or reset, f"delete of an unknown row {key}"
                if row is not None:
                    removed[ident] = row
    return list(keyed.values()) + keyless


def comparable(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows with :func:`normalize`d values, sorted, for comparing table states."""
    normal = [{c: normalize(v) for c, v in row.items()} for row in rows]
    return sorted(normal, key=lambda r: sorted((c, repr(v)) for c, v in r.items()))


# --------------------------------------------------------------------------- Kafka and Parquet
# (added for tests/integration/test_e2e_kafka_parquet.py and test_crash_kafka.py): read what the
# Kafka sink and the Parquet file sink wrote with independent clients (aiokafka's consumer,
# pyarrow), in the JSON form of docs/events.md so it compares with the JSON Lines events.


def native_to_json(value: Any) -> Any:
    """A native (Parquet / Python) value in its docs/events.md JSON form: decimals as exact
    strings, timestamptz as UTC ``...Z``, timestamps/times without trailing fraction zeros
    (PostgreSQL's text), dates ISO, bytes base64, lists element-wise."""
    import datetime as dt

    def trimmed(text: str) -> str:
        return text.rstrip("0").rstrip(".") if "." in text else text

    if isinstance(value, Decimal):
        return str(value)
    if isinstance(value, dt.datetime):
        if value.tzinfo is not None:
            utc = value.astimezone(dt.UTC).replace(tzinfo=None)
            return trimmed(utc.isoformat()) + "Z"
        return trimmed(value.isoformat())
    if isinstance(value, dt.time):
        return trimmed(value.isoformat())
    if isinstance(value, dt.date):
        return value.isoformat()
    if isinstance(value, bytes | memoryview):
        return b64(bytes(value))
    if isinstance(value, list):
        return [native_to_json(v) for v in value]
    return value


def parquet_event(record: dict[str, Any]) -> dict[str, Any]:
    """One Parquet row as the JSON Lines event it stands for: native values in JSON form,
    ``unrepresentable`` values put back, unchanged TOAST columns (null in Parquet, listed in
    ``source.unchanged_toast``) as the marker, null-valued optional ``source`` fields dropped,
    ``key`` null for a table without key columns."""
    lost = dict(record.get("unrepresentable") or [])
    source = {k: v for k, v in record["source"].items() if v is not None}
    for link in ("old_key", "new_key"):  # structs of the key columns, native values
        if link in source:
            source[link] = {c: native_to_json(v) for c, v in source[link].items()}
    event: dict[str, Any] = {
        "op": record["op"],
        "source": source,
        "ts_ms": record["ts_ms"],
        "transaction": record["transaction"],
        "key": native_to_json(record["key"]) if record.get("key") is not None else None,
    }
    for image in ("before", "after"):
        row = record[image]
        if row is None:
            event[image] = None
            continue
        values = {c: native_to_json(v) for c, v in row.items()}
        for column in values:
            if f"{image}.{column}" in lost:
                values[column] = orjson.loads(lost[f"{image}.{column}"])
        if image == "after":
            for column in source.get("unchanged_toast", ()):
                values[column] = UNAVAILABLE
        event[image] = values
    return event


def parquet_events(out: Path, table: str) -> list[dict[str, Any]]:
    """Every Parquet event of ``schema.table`` in file-name order (pyarrow, as Spark reads it),
    asserting each file is named after its first event; see :func:`parquet_event`."""
    import pyarrow.parquet as pq

    events: list[dict[str, Any]] = []
    for path in data_files(out / table, ".parquet"):
        rows = [parquet_event(r) for r in pq.read_table(path).to_pylist()]
        assert rows, f"{path} is empty"
        assert path.name == file_name(rows[0], ".parquet"), f"{path.name}: not its first event"
        events.extend(rows)
    return events


def comparable_event(event: dict[str, Any]) -> dict[str, Any]:
    """A JSON Lines / Kafka event without the optional ``source`` fields that are null, so it
    compares with :func:`parquet_event`."""
    source = {k: v for k, v in event["source"].items() if v is not None}
    return {**event, "source": source}


class KafkaRecord:
    """One consumed record: value and key parsed as JSON, headers as text."""

    __slots__ = ("headers", "key", "offset", "partition", "raw_value", "topic", "value")

    def __init__(self, record: Any) -> None:
        self.topic: str = record.topic
        self.partition: int = record.partition
        self.offset: int = record.offset
        self.key: Any = orjson.loads(record.key) if record.key is not None else None
        self.raw_value: bytes | None = record.value
        self.value: dict[str, Any] | None = (
            orjson.loads(record.value) if record.value is not None else None
        )
        self.headers: dict[str, str] = {k: v.decode() for k, v in record.headers}

    @property
    def position(self) -> tuple[int, int]:
        """From the headers (docs/kafka.md)."""
        return (int(self.headers["cdcd.commit_lsn"]), int(self.headers["cdcd.seq"]))

    @property
    def is_tombstone(self) -> bool:
        return self.value is None

    def event(self) -> dict[str, Any]:
        """The value with the top-level ``key`` a JSON Lines line carries."""
        assert self.value is not None, "a tombstone has no event"
        return {**self.value, "key": self.key}

    def __repr__(self) -> str:
        return f"<{self.topic}[{self.partition}]@{self.offset} {self.position}>"


async def _described_topics(bootstrap: str, topics: list[str]) -> list[dict[str, Any]]:
    """``topics`` as the broker describes them, asked again (for up to 30 s) while one of them
    comes back with an error or a partition without a leader: a topic created moments ago can
    be described before the broker's metadata has all of it, and a partition left out would be
    read as empty."""
    import asyncio

    from aiokafka.admin import AIOKafkaAdminClient

    if not topics:
        return []
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        for _ in range(60):
            described = await admin.describe_topics(topics)
            if all(
                not t["error_code"]
                and t["partitions"]
                and all(p["leader"] >= 0 and not p["error_code"] for p in t["partitions"])
                for t in described
            ):
                return list(described)
            await asyncio.sleep(0.5)
        raise AssertionError(f"topics not fully described in 30 s: {described}")
    finally:
        await admin.close()


async def consume_prefix(
    bootstrap: str,
    prefix: str,
    count: int,
    timeout: float = 60.0,
    isolation_level: str = "read_uncommitted",
) -> dict[str, list[KafkaRecord]]:
    """Every record of every topic named ``<prefix>.*`` (call it once the producer is done),
    by topic, each topic's records sorted by (partition, offset): read from the beginning until
    at least ``count`` records arrived, then on until the topics stay quiet for a second (so
    extra records show). AssertionError if fewer than ``count`` arrive within ``timeout``.
    The exactly-once mode's position topic (``<prefix>.cdcd-positions``) is left out."""
    import asyncio

    from aiokafka import AIOKafkaConsumer, TopicPartition

    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        isolation_level=isolation_level,
    )
    await consumer.start()
    records: dict[str, list[KafkaRecord]] = {}
    try:
        topics = sorted(
            t
            for t in await consumer.topics()
            if t.startswith(prefix + ".") and t != f"{prefix}.cdcd-positions"
        )
        described = await _described_topics(bootstrap, topics)
        parts = [
            TopicPartition(t["topic"], p["partition"])
            for t in described
            for p in sorted(t["partitions"], key=lambda p: p["partition"])
        ]
        records = {t: [] for t in topics}
        if parts:
            consumer.assign(parts)
            await consumer.seek_to_beginning(*parts)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        quiet = 0
        while parts and quiet < 2:
            read = sum(len(r) for r in records.values())
            if read < count and loop.time() >= deadline:
                ends = await consumer.end_offsets(parts)  # what the broker holds, by partition
                raise AssertionError(
                    f"{read} records of {prefix}.* within {timeout}s, expected {count}: "
                    f"{ {t: len(r) for t, r in records.items()} }; the partitions' end offsets: "
                    f"{ {f'{tp.topic}/{tp.partition}': end for tp, end in ends.items()} }"
                )
            assert loop.time() < deadline + timeout, f"{prefix}.* never goes quiet"
            batch = await consumer.getmany(timeout_ms=500)
            for tp, recs in batch.items():
                records[tp.topic].extend(KafkaRecord(r) for r in recs)
            quiet = quiet + 1 if not batch and read >= count else 0
    finally:
        await consumer.stop()
    assert sum(len(r) for r in records.values()) >= count, f"no topic {prefix}.*"
    for recs in records.values():
        recs.sort(key=lambda r: (r.partition, r.offset))
    return records
