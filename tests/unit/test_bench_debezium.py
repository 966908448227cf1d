"""bench/debezium_bench.py's pure parts: which cdcd row is compared with which Debezium row, and
the connector properties of a slot workload against a snapshot."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from bench.debezium_bench import add_debezium_ratios, debezium_properties


def row(contender: str, rows_per_s: int, cpu_us_per_row: float) -> dict[str, Any]:
    return {"contender": contender, "rows_per_s": rows_per_s, "cpu_us_per_row": cpu_us_per_row}


def test_each_cdcd_row_is_compared_with_debezium_s_of_the_same_sink() -> None:
    rows = [
        row("pg_recvlogical", 90_000, 0.5),
        row("cdcd_null", 40_000, 3.0),
        row("cdcd_kafka", 30_000, 9.0),
        row("cdcd_jsonl", 35_000, 5.0),
        row("cdcd_null_w4", 200_000, 0.6),
        row("debezium_null", 10_000, 60.0),
        row("debezium_kafka", 7_500, 72.0),
    ]
    add_debezium_ratios(rows)
    by_name = {r["contender"]: r for r in rows}
    assert by_name["cdcd_null"]["ratio_vs_debezium"] == 4.0
    assert by_name["cdcd_null"]["cpu_ratio_vs_debezium"] == 20.0
    assert by_name["cdcd_kafka"]["ratio_vs_debezium"] == 4.0
    assert by_name["cdcd_kafka"]["cpu_ratio_vs_debezium"] == 8.0
    assert by_name["cdcd_null_w4"]["ratio_vs_debezium"] == 20.0  # S1's workers: the null handler
    # no Debezium contender writes files; the others are not cdcd's
    for name in ("cdcd_jsonl", "pg_recvlogical", "debezium_null", "debezium_kafka"):
        assert "ratio_vs_debezium" not in by_name[name]


def setup_for(snapshot: bool, kafka: str | None = None) -> Any:
    workload = SimpleNamespace(name="S1" if snapshot else "W2", snapshot=snapshot)
    db = SimpleNamespace(dsn="postgresql://bench%20user:p%40ss@127.0.0.1:5999/bench_w2")
    broker = None if kafka is None else SimpleNamespace(bootstrap=kafka)
    return SimpleNamespace(db=db, workload=workload, expected_rows=1234, kafka=broker, work=Path())


def test_a_slot_workload_streams_the_slot_the_bench_made() -> None:
    props = debezium_properties(cast(Any, setup_for(False)), "debezium_null", "slot_a", "pub")
    assert props["snapshot.mode"] == "no_data"
    assert props["slot.name"] == "slot_a" and props["publication.name"] == "pub"
    assert props["publication.autocreate.mode"] == "disabled"
    assert props["plugin.name"] == "pgoutput"
    assert (props["database.user"], props["database.password"]) == ("bench user", "p@ss")
    assert (props["database.port"], props["database.dbname"]) == ("5999", "bench_w2")
    assert props["bench.rows"] == "1234" and props["bench.sink"] == "null"
    assert "table.include.list" not in props
    assert not any(key.startswith("bench.kafka.") for key in props)


def test_s1_snapshots_its_table_and_kafka_gets_an_idempotent_producer() -> None:
    setup = setup_for(True, kafka="127.0.0.1:9092")
    props = debezium_properties(cast(Any, setup), "debezium_kafka", "slot_s", "pub")
    assert props["snapshot.mode"] == "initial"
    assert props["table.include.list"] == "public.s1"
    assert props["bench.sink"] == "kafka"
    assert props["bench.kafka.bootstrap.servers"] == "127.0.0.1:9092"
    assert props["bench.kafka.acks"] == "all"
    assert props["bench.kafka.enable.idempotence"] == "true"
