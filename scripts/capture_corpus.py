#!/usr/bin/env python3
"""Capture raw pgoutput messages from real servers into ``tests/corpus``.

For every installed PostgreSQL 15, 16 and 18 (via ``tests/pgharness.py``) and every scenario
below, a fresh database gets the scenario's schema, a ``FOR ALL TABLES`` publication and two
pgoutput slots (one created with ``two_phase``); then the scenario's SQL runs and each option
set peeks the slot with ``pg_logical_slot_peek_binary_changes`` (peeking does not consume,
so all option sets see the same WAL). The decoding session sets the GUCs cdcd's replication
connection sets (they change the text output of dates, intervals, floats and bytea).

Streaming is forced with ``logical_decoding_work_mem=64kB`` (the minimum) plus "ballast":
rows of an unpublished table in the same transaction that fill the reorder buffer without
producing output, so a streamed transaction needs only a few published rows and the corpus
stays small. ``debug_logical_replication_streaming=immediate`` (16+) is deliberately not
used: it streams every transaction, even one-row ones, so the 16+ corpus would lose
non-streamed transactions (B/C, Begin Prepare/Prepare) under protocols 2-4.

Output: ``tests/corpus/pg<major>/<optionset>/<scenario>.jsonl`` (header line, then one
``{"lsn", "xid", "data"}`` line per message). ``--check`` only prints the tag counts of the
existing corpus.

Usage: ``python scripts/capture_corpus.py [--majors 15,18] [--check]``
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from cdcd.source import SESSION_GUCS as CDCD_SESSION_GUCS  # noqa: E402
from tests.corpusutil import CORPUS_DIR, all_corpus_files, load_corpus  # noqa: E402
from tests.pgharness import PgCluster, create_database, find_installations  # noqa: E402

PUB = "cdcd_pub"
PLAIN_SLOT = "cdcd_plain"
TWOPC_SLOT = "cdcd_2pc"

#: Session settings of cdcd's connections (they affect text output), plus the minimum
#: decoding memory so that transactions stream early.
SESSION_GUCS = {**CDCD_SESSION_GUCS, "logical_decoding_work_mem": "64kB"}


@dataclass(frozen=True)
class OptionSet:
    name: str
    options: dict[str, str]
    two_phase_slot: bool = False
    min_major: int = 15

    def for_major(self, major: int) -> dict[str, str]:
        opts = {
            "proto_version": self.options["proto_version"],
            "publication_names": PUB,
            "messages": "true",
        }
        opts.update({k: v for k, v in self.options.items() if k != "proto_version"})
        return opts

    def gucs(self, major: int) -> dict[str, str]:
        return dict(SESSION_GUCS)


OPTION_SETS = [
    OptionSet("v1-text", {"proto_version": "1"}),
    OptionSet("v1-binary", {"proto_version": "1", "binary": "true"}),
    OptionSet("v2-stream-text", {"proto_version": "2", "streaming": "on"}),
    OptionSet("v2-stream-binary", {"proto_version": "2", "streaming": "on", "binary": "true"}),
    OptionSet(
        "v3-stream-twophase",
        {"proto_version": "3", "streaming": "on", "two_phase": "on"},
        two_phase_slot=True,
    ),
    OptionSet(
        "v4-parallel-twophase-binary",
        {"proto_version": "4", "streaming": "parallel", "two_phase": "on", "binary": "true"},
        two_phase_slot=True,
        min_major=16,
    ),
]


# --------------------------------------------------------------------------- scenarios


@dataclass
class Scenario:
    """Schema (``setup``, before the slots exist) and steps ``(connection, sql)``."""

    name: str
    setup: list[str]
    steps: list[tuple[int, str]] = field(default_factory=list)
    publication: str = f"CREATE PUBLICATION {PUB} FOR ALL TABLES"

    def sql(self) -> list[str]:
        return [sql if conn == 0 else f"/* c{conn} */ {sql}" for conn, sql in self.steps]


def _ins(table: str, first: int, count: int) -> str:
    return f"INSERT INTO {table} SELECT g FROM generate_series({first}, {first + count - 1}) g"


#: An unpublished table whose rows cost ~1.1 kB of decoding memory each but produce no
#: output: 70 of them exceed logical_decoding_work_mem=64kB, so the transaction streams.
BALLAST_TABLE = "CREATE TABLE ballast (v text)"
BALLAST = "INSERT INTO ballast SELECT repeat(md5(g::text), 32) FROM generate_series(1, 70) g"


def _chunk(table: str, first: int, count: int) -> str:
    """``count`` published rows, then enough ballast to make the transaction stream."""
    return f"{_ins(table, first, count)}; {BALLAST}"


def _pub(*tables: str) -> str:
    return f"CREATE PUBLICATION {PUB} FOR TABLE {', '.join(tables)}"


def replica_identity(n: int) -> Scenario:
    return Scenario(
        "replica_identity",
        [
            "CREATE TABLE ri_default (id int PRIMARY KEY, name text, qty int)",
            "CREATE TABLE ri_full (id int, name text, qty int)",
            "ALTER TABLE ri_full REPLICA IDENTITY FULL",
            "CREATE TABLE ri_index (a int NOT NULL, b text NOT NULL, note text)",
            "CREATE UNIQUE INDEX ri_index_ab ON ri_index (a, b)",
            "ALTER TABLE ri_index REPLICA IDENTITY USING INDEX ri_index_ab",
            "CREATE TABLE ri_nothing (id int, name text)",
            "ALTER TABLE ri_nothing REPLICA IDENTITY NOTHING",
        ],
        [
            (0, "INSERT INTO ri_default VALUES (1, 'one', 10), (2, 'two', NULL)"),
            (0, "UPDATE ri_default SET qty = 11 WHERE id = 1"),
            (0, "UPDATE ri_default SET id = 3 WHERE id = 2"),
            (0, "DELETE FROM ri_default WHERE id = 1"),
            (0, "INSERT INTO ri_full VALUES (1, 'one', 10), (2, NULL, 20)"),
            (0, "UPDATE ri_full SET qty = qty + 1"),
            (0, "DELETE FROM ri_full WHERE id = 2"),
            (0, "INSERT INTO ri_index VALUES (1, 'x', 'first'), (2, 'y', NULL)"),
            (0, "UPDATE ri_index SET note = 'changed' WHERE a = 1"),
            (0, "UPDATE ri_index SET b = 'z' WHERE a = 2"),
            (0, "DELETE FROM ri_index WHERE a = 1"),
            # UPDATE/DELETE of a NOTHING table in a publication that publishes them is an
            # error on the server, so only inserts.
            (0, "INSERT INTO ri_nothing VALUES (1, 'only inserts')"),
            (
                0,
                "BEGIN; INSERT INTO ri_default VALUES (10, 'multi', 1); "
                "UPDATE ri_full SET name = 'multi'; INSERT INTO ri_nothing VALUES (2, 'x'); "
                "COMMIT",
            ),
        ],
    )


def toast(n: int) -> Scenario:
    big = "(SELECT string_agg(md5(i::text), '') FROM generate_series(1, 80) i)"  # 2560 chars
    return Scenario(
        "toast",
        [
            "CREATE TABLE toasty (id int PRIMARY KEY, big text, n int)",
            "ALTER TABLE toasty ALTER COLUMN big SET STORAGE EXTERNAL",
            "CREATE TABLE toasty_full (id int, big text, n int)",
            "ALTER TABLE toasty_full ALTER COLUMN big SET STORAGE EXTERNAL",
            "ALTER TABLE toasty_full REPLICA IDENTITY FULL",
        ],
        [
            (0, f"INSERT INTO toasty VALUES (1, {big}, 1)"),
            (0, "UPDATE toasty SET n = 2 WHERE id = 1"),
            (0, "UPDATE toasty SET big = 'small now', n = 3 WHERE id = 1"),
            (0, "DELETE FROM toasty WHERE id = 1"),
            (0, f"INSERT INTO toasty_full VALUES (1, {big}, 1)"),
            (0, "UPDATE toasty_full SET n = 2"),
            (0, "DELETE FROM toasty_full"),
        ],
    )


def truncate(n: int) -> Scenario:
    return Scenario(
        "truncate",
        [
            "CREATE TABLE parent (id serial PRIMARY KEY)",
            "CREATE TABLE child (id serial PRIMARY KEY, pid int REFERENCES parent)",
            "CREATE TABLE other (id serial PRIMARY KEY)",
            "CREATE TABLE lone (id int)",
        ],
        [
            (0, "INSERT INTO parent DEFAULT VALUES"),
            (0, "INSERT INTO child (pid) SELECT id FROM parent"),
            (0, "INSERT INTO other DEFAULT VALUES"),
            (0, "TRUNCATE parent, other RESTART IDENTITY CASCADE"),
            (0, "INSERT INTO lone VALUES (1)"),
            (0, "TRUNCATE lone"),
            (
                0,
                "BEGIN; INSERT INTO lone VALUES (2); TRUNCATE lone; INSERT INTO lone VALUES (3); COMMIT",
            ),
        ],
    )


def stream_commit(n: int) -> Scenario:
    return Scenario(
        "stream_commit",
        ["CREATE TABLE big (id int)", BALLAST_TABLE],
        [
            (
                0,
                f"BEGIN; {_chunk('big', 1, n)}; {_chunk('big', 101, n)}; {_ins('big', 201, n)}; COMMIT",
            )
        ],
        publication=_pub("big"),
    )


def stream_abort(n: int) -> Scenario:
    return Scenario(
        "stream_abort",
        ["CREATE TABLE big (id int)", "CREATE TABLE after (id int)", BALLAST_TABLE],
        [
            (0, f"BEGIN; {_chunk('big', 1, n)}; {_ins('big', 101, n)}; ROLLBACK"),
            (0, "BEGIN; INSERT INTO big VALUES (0); ROLLBACK"),
            (0, "INSERT INTO after VALUES (1)"),
        ],
        publication=_pub("big", "after"),
    )


def stream_savepoints(n: int) -> Scenario:
    return Scenario(
        "stream_savepoints",
        ["CREATE TABLE big (id int)", BALLAST_TABLE],
        [
            (
                0,
                f"BEGIN; {_chunk('big', 1, n)}; SAVEPOINT a; {_chunk('big', 101, n)}; "
                f"SAVEPOINT b; {_chunk('big', 201, n)}; ROLLBACK TO SAVEPOINT b; "
                f"{_ins('big', 301, n)}; RELEASE SAVEPOINT a; COMMIT",
            ),
            (
                0,
                "BEGIN; INSERT INTO big VALUES (-1); SAVEPOINT s; INSERT INTO big VALUES (-2); "
                "ROLLBACK TO SAVEPOINT s; INSERT INTO big VALUES (-3); COMMIT",
            ),
        ],
        publication=_pub("big"),
    )


def stream_interleaved(n: int) -> Scenario:
    steps: list[tuple[int, str]] = [(1, "BEGIN"), (2, "BEGIN")]
    for r in range(2):
        steps.append((1, _chunk("big", 1000 + 100 * r, n)))
        steps.append((2, _chunk("big", 2000 + 100 * r, n)))
    steps += [(1, _ins("big", 1900, n)), (2, _ins("big", 2900, n))]
    steps += [(1, "COMMIT"), (2, "COMMIT")]
    return Scenario(
        "stream_interleaved", ["CREATE TABLE big (id int)", BALLAST_TABLE], steps, _pub("big")
    )


def stream_ddl(n: int) -> Scenario:
    return Scenario(
        "stream_ddl",
        ["CREATE TABLE big (id int, note text)", BALLAST_TABLE],
        [
            (
                0,
                f"BEGIN; {_chunk('big', 1, n)}; "
                "ALTER TABLE big ADD COLUMN extra int DEFAULT 7; "
                f"INSERT INTO big (id, note, extra) SELECT g, 'n', g "
                f"FROM generate_series(101, {100 + n}) g; {BALLAST}; "
                "ALTER TABLE big DROP COLUMN note; "
                f"{_ins('big', 201, n)}; COMMIT",
            )
        ],
        publication=_pub("big"),
    )


def prepared(n: int) -> Scenario:
    return Scenario(
        "prepared",
        ["CREATE TABLE big (id int)", BALLAST_TABLE],
        [
            (0, "BEGIN; INSERT INTO big VALUES (1); PREPARE TRANSACTION 'small_commit'"),
            (0, "COMMIT PREPARED 'small_commit'"),
            (0, "BEGIN; INSERT INTO big VALUES (2); PREPARE TRANSACTION 'small_rollback'"),
            (0, "ROLLBACK PREPARED 'small_rollback'"),
            (
                0,
                f"BEGIN; {_chunk('big', 10, n)}; {_ins('big', 20, n)}; "
                "PREPARE TRANSACTION 'large_commit'",
            ),
            (0, "COMMIT PREPARED 'large_commit'"),
            (
                0,
                f"BEGIN; {_chunk('big', 30, n)}; {_ins('big', 40, n)}; "
                "PREPARE TRANSACTION 'large_rollback'",
            ),
            (0, "ROLLBACK PREPARED 'large_rollback'"),
        ],
        publication=_pub("big"),
    )


def messages(n: int) -> Scenario:
    return Scenario(
        "messages",
        ["CREATE TABLE big (id int)", BALLAST_TABLE],
        [
            (0, "SELECT pg_logical_emit_message(false, 'cdcd', 'non-transactional text')"),
            (0, "SELECT pg_logical_emit_message(false, 'cdcd.bin', '\\x00ff10'::bytea)"),
            (
                0,
                "BEGIN; SELECT pg_logical_emit_message(true, 'cdcd', 'transactional text'); "
                "INSERT INTO big VALUES (1); "
                "SELECT pg_logical_emit_message(true, 'cdcd.bin', '\\x0001feff'::bytea); COMMIT",
            ),
            (0, "BEGIN; SELECT pg_logical_emit_message(true, 'cdcd', 'only a message'); COMMIT"),
            (0, "BEGIN; SELECT pg_logical_emit_message(true, 'cdcd', 'rolled back'); ROLLBACK"),
            (
                0,
                "BEGIN; SELECT pg_logical_emit_message(true, 'cdcd', 'streamed start'); "
                f"{_chunk('big', 1, n)}; "
                "SELECT pg_logical_emit_message(true, 'cdcd', 'streamed end'); COMMIT",
            ),
        ],
        publication=_pub("big"),
    )


def origin(n: int) -> Scenario:
    return Scenario(
        "origin",
        ["CREATE TABLE t (id int PRIMARY KEY)"],
        [
            (0, "SELECT pg_replication_origin_create('cdcd_corpus_origin')"),
            (0, "SELECT pg_replication_origin_session_setup('cdcd_corpus_origin')"),
            (
                0,
                "BEGIN; SELECT pg_replication_origin_xact_setup('0/1234ABCD', "
                "'2024-01-02 03:04:05+00'); INSERT INTO t VALUES (1); COMMIT",
            ),
            (0, "SELECT pg_replication_origin_session_reset()"),
            (0, "INSERT INTO t VALUES (2)"),
        ],
    )


def types(n: int) -> Scenario:
    return Scenario(
        "types",
        [
            "CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy')",
            "CREATE DOMAIN posint AS int CHECK (VALUE > 0)",
            "CREATE TYPE pair AS (a int, b text)",
            "CREATE TABLE typed (id int PRIMARY KEY, m mood, p posint, c pair, ms mood[])",
        ],
        [
            (0, "INSERT INTO typed VALUES (1, 'happy', 5, ROW(1, 'x'), '{sad,ok}')"),
            (0, "INSERT INTO typed VALUES (2, NULL, NULL, NULL, NULL)"),
            (0, "UPDATE typed SET m = 'ok', c = ROW(2, NULL) WHERE id = 1"),
        ],
    )


def datatypes(n: int) -> Scenario:
    return Scenario(
        "datatypes",
        [
            "CREATE TABLE dt (id int PRIMARY KEY, i2 int2, i8 int8, num numeric, f4 float4, "
            "f8 float8, b bool, t text, vc varchar(10), ch char(3), by bytea, d date, tm time, "
            "ttz timetz, ts timestamp, tstz timestamptz, iv interval, u uuid, j json, jb jsonb, "
            "ia int[], ta text[], ip inet, cid cidr, mac macaddr, bits bit varying, "
            "r int4range, o oid, money money)",
        ],
        [
            (
                0,
                "INSERT INTO dt VALUES (1, -32768, 9223372036854775807, 12345.678900, 1.5, "
                "0.1, true, 'héllo ''q'' \\ \"', 'abc', 'ab', '\\x00ff'::bytea, '2024-02-29', "
                "'13:14:15.123456', '13:14:15+05:30', '2024-01-02 03:04:05.678', "
                "'2024-01-02 03:04:05.678+02', '1 year 2 mons 3 days 04:05:06.5', "
                "'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11', '{\"a\": [1, 2]}', '{\"b\": null}', "
                "'{1,NULL,3}', '{\"x y\",NULL,\"\"}', '192.168.0.1/24', '10.0.0.0/8', "
                "'08:00:2b:01:02:03', B'10101', '[1,10)', 42, 12.34)",
            ),
            (
                0,
                "INSERT INTO dt (id, num, f4, f8, d, ts, tstz) VALUES "
                "(2, 'NaN', 'Infinity', '-Infinity', 'infinity', '-infinity', 'infinity'), "
                "(3, '-0.000001', 'NaN', 1e300, '0001-01-01 BC', '4713-01-01 BC', "
                "'1970-01-01 00:00:00+00')",
            ),
            (0, "INSERT INTO dt (id) VALUES (4)"),
        ],
    )


def partitioned(n: int) -> Scenario:
    return Scenario(
        "partitioned",
        [
            "CREATE TABLE meas (id int, day date, v int, PRIMARY KEY (id, day)) "
            "PARTITION BY RANGE (day)",
            "CREATE TABLE meas_2024 PARTITION OF meas "
            "FOR VALUES FROM ('2024-01-01') TO ('2025-01-01')",
            "CREATE TABLE meas_2025 PARTITION OF meas "
            "FOR VALUES FROM ('2025-01-01') TO ('2026-01-01')",
        ],
        [
            (0, "INSERT INTO meas VALUES (1, '2024-05-01', 1), (2, '2025-05-01', 2)"),
            (0, "UPDATE meas SET v = 10 WHERE id = 1"),
            (0, "UPDATE meas SET day = '2025-06-01' WHERE id = 1"),
            (0, "DELETE FROM meas WHERE id = 2"),
            (0, "TRUNCATE meas"),
        ],
        publication=f"CREATE PUBLICATION {PUB} FOR ALL TABLES "
        "WITH (publish_via_partition_root = true)",
    )


SCENARIOS: list[Callable[[int], Scenario]] = [
    replica_identity,
    toast,
    truncate,
    stream_commit,
    stream_abort,
    stream_savepoints,
    stream_interleaved,
    stream_ddl,
    prepared,
    messages,
    origin,
    types,
    datatypes,
    partitioned,
]


#: Published rows per "chunk" of a streamed transaction (the ballast makes it stream).
CHUNK_ROWS = 3


# --------------------------------------------------------------------------- capture


def _peek(
    cluster: PgCluster, db: str, slot: str, opts: dict[str, str], gucs: dict[str, str]
) -> list[tuple[str, int, bytes]]:
    args = ", ".join(f"'{k}', '{v}'" for k, v in opts.items())
    with cluster.connect(db) as conn, conn.cursor() as cur:
        for k, v in gucs.items():
            cur.execute(f"SET {k} = %s", (v,))
        cur.execute(
            "SELECT lsn::text, xid::text::bigint, data FROM "
            f"pg_logical_slot_peek_binary_changes('{slot}', NULL, NULL, {args})"
        )
        return [(lsn, int(xid), bytes(data)) for lsn, xid, data in cur.fetchall()]


def run_scenario(cluster: PgCluster, scenario: Scenario, out_dir: Path) -> None:
    db = create_database(cluster, f"corpus_{scenario.name}")
    try:
        for sql in scenario.setup:
            db.execute(sql)
        db.execute(scenario.publication)
        db.execute(f"SELECT pg_create_logical_replication_slot('{PLAIN_SLOT}', 'pgoutput')")
        db.execute(
            f"SELECT pg_create_logical_replication_slot('{TWOPC_SLOT}', 'pgoutput', false, true)"
        )
        with contextlib.ExitStack() as stack:
            conns: dict[int, Any] = {}
            for conn_no, sql in scenario.steps:
                if conn_no not in conns:
                    conns[conn_no] = stack.enter_context(cluster.connect(db.name))
                with conns[conn_no].cursor() as cur:
                    cur.execute(sql)
        for optset in OPTION_SETS:
            if cluster.major < optset.min_major:
                continue
            opts = optset.for_major(cluster.major)
            gucs = optset.gucs(cluster.major)
            slot = TWOPC_SLOT if optset.two_phase_slot else PLAIN_SLOT
            rows = _peek(cluster, db.name, slot, opts, gucs)
            header = {
                "server_version": cluster.version,
                "major": cluster.major,
                "scenario": scenario.name,
                "optionset": optset.name,
                "options": opts,
                "session_gucs": gucs,
                "slot_two_phase": optset.two_phase_slot,
                "setup": [*scenario.setup, scenario.publication],
                "sql": scenario.sql(),
            }
            path = out_dir / f"pg{cluster.major}" / optset.name / f"{scenario.name}.jsonl"
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "w") as f:
                f.write(json.dumps(header) + "\n")
                for lsn, xid, data in rows:
                    f.write(json.dumps({"lsn": lsn, "xid": xid, "data": data.hex()}) + "\n")
    finally:
        db.drop()
    if scenario.name == "origin":
        cluster.execute("SELECT pg_replication_origin_drop('cdcd_corpus_origin')")


# --------------------------------------------------------------------------- check


REQUIRED_TAGS = [
    "B",
    "C",
    "O",
    "R",
    "Y",
    "I",
    "U",
    "D",
    "T",
    "M",
    "S",
    "E",
    "c",
    "A",
    "b",
    "P",
    "K",
    "r",
    "p",
    "A25",
]


def tag_of(data: bytes) -> str:
    tag = data[:1].decode("latin-1")
    if tag == "A" and len(data) == 25:
        return "A25"  # Stream Abort with abort_lsn and abort_time (streaming=parallel)
    return tag


def check(files: list[Path]) -> list[str]:
    """Print tag counts per (major, option set); return required tags never seen."""
    seen: Counter[str] = Counter()
    groups: dict[str, Counter[str]] = {}
    for path in files:
        _header, rows = load_corpus(path)
        group = groups.setdefault(f"{path.parts[-3]}/{path.parts[-2]}", Counter())
        for _lsn, _xid, data in rows:
            group[tag_of(data)] += 1
    for name, counts in sorted(groups.items()):
        seen.update(counts)
        print(f"{name:40} " + " ".join(f"{t}={c}" for t, c in sorted(counts.items())))
    total = sum(p.stat().st_size for p in files)
    print(f"{len(files)} files, {total / 1e6:.2f} MB")
    missing = [t for t in REQUIRED_TAGS if not seen[t]]
    print("missing tags:", " ".join(missing) or "none")
    return missing


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--majors", default="15,16,18", help="server majors to capture")
    parser.add_argument("--check", action="store_true", help="only print tag counts")
    parser.add_argument("--out", type=Path, default=CORPUS_DIR)
    args = parser.parse_args()
    if not args.check:
        majors = {int(m) for m in args.majors.split(",")}
        installs = [i for i in find_installations() if i.major in majors]
        if not installs:
            print("no matching PostgreSQL installation", file=sys.stderr)
            return 1
        for install in installs:
            shutil.rmtree(args.out / f"pg{install.major}", ignore_errors=True)
            with PgCluster(install) as cluster:
                n = CHUNK_ROWS
                for make in SCENARIOS:
                    scenario = make(n)
                    print(f"pg{cluster.major} {scenario.name}", flush=True)
                    run_scenario(cluster, scenario, args.out)
    files = all_corpus_files() if args.out == CORPUS_DIR else sorted(args.out.glob("pg*/*/*.jsonl"))
    return 1 if check(files) else 0


if __name__ == "__main__":
    sys.exit(main())
