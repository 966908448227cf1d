"""Change events from Transactions built directly from pgoutput events (docs/events.md)."""

from __future__ import annotations

import base64

import orjson

from cdcd import __version__
from cdcd.assembler.transaction import ChangeRecord, Transaction
from cdcd.decoder.events import TRUNCATE_CASCADE, TRUNCATE_RESTART_IDENTITY, Truncate
from cdcd.lsn import pg_to_unix_us
from tests.unit.sink_fixtures import (
    INT4,
    TEXT,
    TxnBuilder,
    U,
    encoder,
    relation,
    standalone_message,
    tup,
)

ORDERS = relation()
ITEMS = relation("items", (("order_id", INT4), ("sku", TEXT)), key=("order_id", "sku"), oid=16401)


def test_insert_event_has_the_contract_shape() -> None:
    txn = TxnBuilder(771, 1000).insert(ORDERS, tup(1, "ann", None)).build()
    (event,) = encoder().events(txn)
    assert (event.op, event.schema, event.table, event.relation) == (
        "c",
        "public",
        "orders",
        ORDERS,
    )
    assert event.position == (txn.commit_lsn, 0)
    assert (event.lsn, event.xid, event.commit_time) == (1008, 771, txn.commit_time)
    unix_us = pg_to_unix_us(txn.commit_time)
    assert event.value() == {
        "before": None,
        "after": {"id": 1, "name": "ann", "note": None},
        "source": {
            "version": __version__,
            "connector": "postgresql",
            "name": "shop",
            "db": "shopdb",
            "schema": "public",
            "table": "orders",
            "ts_ms": unix_us // 1000,
            "ts_us": unix_us,
            "snapshot": "false",
            "txId": 771,
            "lsn": 1008,
            "sequence": '[null,"1008"]',
            "xmin": None,
            "commit_lsn": txn.commit_lsn,
            "seq": 0,
        },
        "op": "c",
        "ts_ms": 1_700_000_000_000,
        "transaction": {
            "id": f"771:{txn.commit_lsn}",
            "total_order": 1,
            "data_collection_order": 1,
        },
    }
    assert event.key() == {"id": 1}
    assert orjson.loads(event.value_json()) == event.value()
    assert orjson.loads(event.key_json() or b"null") == {"id": 1}
    assert orjson.loads(event.record_json()) == {**event.value(), "key": {"id": 1}}
    assert event.value() is event.value()  # built once, cached


def test_update_before_is_null_without_old_and_full_row_with_o() -> None:
    full = relation(identity="f")
    txn = (
        TxnBuilder(5, 2000)
        .update(ORDERS, tup(1, "bob", "x"))
        .update(full, tup(1, "cid", "y"), old=tup(1, "bob", "x"), kind="O")
        .build()
    )
    plain, with_old = encoder({("public", "orders"): ("id",)}).events(txn)
    assert plain.op == with_old.op == "u"
    assert plain.value()["before"] is None
    assert plain.value()["after"] == {"id": 1, "name": "bob", "note": "x"}
    assert with_old.value()["before"] == {"id": 1, "name": "bob", "note": "x"}
    assert with_old.value()["after"] == {"id": 1, "name": "cid", "note": "y"}
    assert with_old.key() == {"id": 1}
    assert [plain.seq, with_old.seq] == [0, 1]


def test_update_changing_the_key_is_a_delete_then_a_create() -> None:
    txn = (
        TxnBuilder(9, 3000)
        .insert(ORDERS, tup(1, "ann", "n"))
        .update(ORDERS, tup(2, "ann", "n"), old=tup(1, None, None), kind="K")
        .insert(ORDERS, tup(3, "cy", None))
        .build()
    )
    events = list(encoder().events(txn))
    assert [(e.op, e.seq) for e in events] == [("c", 0), ("d", 1), ("c", 2), ("c", 3)]
    delete, create = events[1], events[2]
    # K image: key columns, the other columns present as null (Debezium's shape)
    assert delete.value()["before"] == {"id": 1, "name": None, "note": None}
    assert delete.value()["after"] is None
    assert delete.key() == {"id": 1}
    assert create.value()["before"] is None
    assert create.value()["after"] == {"id": 2, "name": "ann", "note": "n"}
    assert create.key() == {"id": 2}
    assert delete.lsn == create.lsn == 3016
    orders = [e.value()["transaction"] for e in events]
    assert [t["total_order"] for t in orders] == [1, 2, 3, 4]
    assert [t["data_collection_order"] for t in orders] == [1, 2, 3, 4]
    assert create.source()["sequence"] == '["3016","3016"]'
    assert events[3].source()["sequence"] == '["3016","3024"]'


def test_full_identity_update_that_changes_the_primary_key_splits_too() -> None:
    full = relation(identity="f")
    txn = TxnBuilder(9, 3000).update(full, tup(2, "a", "b"), old=tup(1, "a", "b"), kind="O").build()
    events = list(encoder({("public", "orders"): ("id",)}).events(txn))
    assert [e.op for e in events] == ["d", "c"]
    assert events[0].value()["before"] == {"id": 1, "name": "a", "note": "b"}
    assert [e.key() for e in events] == [{"id": 1}, {"id": 2}]


def test_k_image_of_unchanged_key_does_not_split() -> None:
    txn = TxnBuilder(9, 3000).update(ORDERS, tup(1, "b", "c"), old=tup(1, None, None), kind="K")
    (event,) = encoder().events(txn.build())
    assert event.op == "u"
    assert event.value()["before"] == {"id": 1, "name": None, "note": None}


def test_delete_takes_the_key_from_the_old_row() -> None:
    full = relation(identity="f")
    txn = (
        TxnBuilder(11, 4000)
        .delete(ORDERS, tup(7, None, None), kind="K")
        .delete(full, tup(8, "zed", "z"), kind="O")
        .build()
    )
    k_delete, o_delete = encoder({("public", "orders"): ("id",)}).events(txn)
    assert k_delete.value()["before"] == {"id": 7, "name": None, "note": None}
    assert k_delete.value()["after"] is None
    assert k_delete.key() == {"id": 7}
    assert o_delete.value()["before"] == {"id": 8, "name": "zed", "note": "z"}
    assert o_delete.key() == {"id": 8}


def test_key_is_null_without_primary_key_or_with_replica_identity_full() -> None:
    full = relation(identity="f")
    nothing = relation("log", (("msg", TEXT),), key=(), identity="n", oid=16500)
    txn = TxnBuilder(1, 100).insert(full, tup(1, "a", "b")).insert(nothing, tup("hi")).build()
    events = list(encoder().events(txn))
    assert [e.key() for e in events] == [None, None]
    assert events[0].key_json() is None
    assert orjson.loads(events[0].record_json())["key"] is None


def test_unchanged_toast_without_old_row_is_the_debezium_placeholder() -> None:
    txn = TxnBuilder(12, 5000).update(ORDERS, tup(1, "ann", U)).build()
    (event,) = encoder().events(txn)
    assert event.value()["after"] == {
        "id": 1,
        "name": "ann",
        "note": "__debezium_unavailable_value",
    }
    assert event.source()["unchanged_toast"] == ["note"]
    assert event.unchanged_toast() == ["note"]
    assert event.native_row("after") == {"id": 1, "name": "ann", "note": None}


def test_unchanged_toast_is_filled_from_the_full_old_row() -> None:
    full = relation(identity="f")
    txn = TxnBuilder(12, 5000).update(full, tup(1, "bo", U), old=tup(1, "ann", "long"), kind="O")
    (event,) = encoder({("public", "orders"): ("id",)}).events(txn.build())
    assert event.value()["after"] == {"id": 1, "name": "bo", "note": "long"}
    assert event.value()["before"] == {"id": 1, "name": "ann", "note": "long"}
    assert "unchanged_toast" not in event.source()
    assert event.native_row("after") == {"id": 1, "name": "bo", "note": "long"}


def test_unchanged_toast_in_the_created_row_of_a_key_change_is_filled_from_o() -> None:
    full = relation(identity="f")
    txn = TxnBuilder(12, 5000).update(full, tup(2, "bo", U), old=tup(1, "ann", "long"), kind="O")
    _, create = encoder({("public", "orders"): ("id",)}).events(txn.build())
    assert create.value()["after"] == {"id": 2, "name": "bo", "note": "long"}


def test_key_change_pair_is_linked_by_new_key_and_old_key() -> None:
    """The delete names the create's key (``source.new_key``), the create the delete's
    (``source.old_key``), in the value, its JSON and the native form; no other event has them."""
    txn = (
        TxnBuilder(12, 5000)
        .insert(ORDERS, tup(1, "ann", "long"))
        .update(ORDERS, tup(2, "ann", U), old=tup(1, None, None), kind="K")
        .update(ORDERS, tup(2, "bo", U))
        .build()
    )
    insert, delete, create, update = encoder().events(txn)
    assert (delete.op, create.op, (delete.seq, create.seq)) == ("d", "c", (1, 2))
    assert delete.source()["new_key"] == create.key() == {"id": 2}
    assert create.source()["old_key"] == delete.key() == {"id": 1}
    assert "old_key" not in delete.source() and "new_key" not in create.source()
    for other in (insert, update):
        assert other.key_link() is None
        assert not {"old_key", "new_key"} & set(other.source())
    assert delete.key_link(native=True) == ("new_key", {"id": 2})
    assert create.key_link(native=True) == ("old_key", {"id": 1})
    assert create.source()["unchanged_toast"] == ["note"]  # what old_key lets a consumer fill
    for event in (insert, delete, create, update):
        assert orjson.loads(event.value_json()) == event.value()
        assert orjson.loads(event.record_json()) == {**event.value(), "key": event.key()}


def test_truncate_is_one_consecutive_event_per_table_with_flags() -> None:
    txn = (
        TxnBuilder(13, 6000)
        .insert(ORDERS, tup(1, "a", None))
        .truncate([ORDERS, ITEMS], TRUNCATE_CASCADE | TRUNCATE_RESTART_IDENTITY)
        .truncate([ITEMS])
        .build()
    )
    events = list(encoder().events(txn))
    assert [(e.op, e.table, e.seq) for e in events] == [
        ("c", "orders", 0),
        ("t", "orders", 1),
        ("t", "items", 2),
        ("t", "items", 3),
    ]
    assert events[1].lsn == events[2].lsn
    assert events[1].source()["truncate"] == {"cascade": True, "restart_identity": True}
    assert events[3].source()["truncate"] == {"cascade": False, "restart_identity": False}
    for event in events[1:]:
        assert event.key() is None
        assert event.value()["before"] is None and event.value()["after"] is None
    orders = [e.value()["transaction"]["data_collection_order"] for e in events]
    assert orders == [1, 2, 1, 2]


def test_transactional_message_is_an_op_m_event_in_its_transaction() -> None:
    txn = (
        TxnBuilder(14, 7000)
        .insert(ORDERS, tup(1, "a", None))
        .message("audit", b"\x00hello")
        .build()
    )
    _, msg = encoder().events(txn)
    assert (msg.op, msg.schema, msg.table, msg.relation, msg.seq) == ("m", None, None, None, 1)
    value = msg.value()
    assert value["message"] == {
        "prefix": "audit",
        "content": base64.b64encode(b"\x00hello").decode(),
    }
    assert value["source"]["transactional"] is True
    assert value["source"]["txId"] == 14
    assert value["transaction"] == {
        "id": f"14:{txn.commit_lsn}",
        "total_order": 2,
        "data_collection_order": 1,
    }
    assert msg.key() == {"prefix": "audit"}
    assert "before" not in value


def test_non_transactional_message_has_its_own_position_and_no_transaction() -> None:
    (msg,) = encoder().events(standalone_message(0x5000, "hb", b"x"))
    assert msg.position == (0x4FFF, 0)  # the message's LSN - 1 (docs/events.md)
    assert msg.lsn == 0x5000
    value = msg.value()
    assert value["transaction"] is None
    assert value["source"]["transactional"] is False
    assert value["source"]["txId"] is None
    assert value["source"]["lsn"] == 0x5000  # as sent
    assert value["source"]["commit_lsn"] == 0x4FFF
    assert value["source"]["seq"] == 0


def test_data_collection_order_counts_per_table() -> None:
    txn = (
        TxnBuilder(15, 8000)
        .insert(ORDERS, tup(1, "a", None))
        .insert(ITEMS, tup(1, "s1"))
        .insert(ITEMS, tup(1, "s2"))
        .insert(ORDERS, tup(2, "b", None))
        .build()
    )
    events = list(encoder().events(txn))
    blocks = [e.value()["transaction"] for e in events]
    assert [b["total_order"] for b in blocks] == [1, 2, 3, 4]
    assert [b["data_collection_order"] for b in blocks] == [1, 1, 2, 2]
    assert events[1].key() == {"order_id": 1, "sku": "s1"}


def test_sequence_pairs_the_previous_event_lsn_with_the_own_lsn() -> None:
    txn = TxnBuilder(16, 9000).insert(ORDERS, tup(1, "a", None)).insert(ORDERS, tup(2, "b", None))
    first, second = encoder().events(txn.build())
    assert first.source()["sequence"] == '[null,"9008"]'
    assert second.source()["sequence"] == '["9008","9016"]'
    assert orjson.loads(second.source()["sequence"]) == ["9008", "9016"]


def test_origin_is_reported_in_source() -> None:
    txn = TxnBuilder(17, 100, origin="pg_16385").insert(ORDERS, tup(1, "a", None)).build()
    (event,) = encoder().events(txn)
    assert event.source()["origin"] == "pg_16385"


def test_same_transaction_encodes_to_identical_bytes_twice() -> None:
    txn = TxnBuilder(18, 100).insert(ORDERS, tup(1, "a", None)).message("p", b"c").build()
    enc = encoder()
    first = [e.record_json() for e in enc.events(txn)]
    second = [e.record_json() for e in enc.events(txn)]
    assert first == second


def test_batches_split_a_transaction_and_keep_seq() -> None:
    builder = TxnBuilder(19, 100)
    for i in range(25):
        builder.insert(ORDERS, tup(i, "x", None))
    batches = list(encoder().batches(builder.build(), max_events=10))
    assert [len(b) for b in batches] == [10, 10, 5]
    assert [e.seq for b in batches for e in b] == list(range(25))


def test_snapshot_events_are_op_r_with_snapshot_markers() -> None:
    rows = [tup(1, "a", None), tup(2, "b", None)]
    events = list(
        encoder().snapshot_events(
            ORDERS, rows, commit_lsn=0x100, commit_time=0, first_seq=5, last=True
        )
    )
    assert [(e.op, e.position) for e in events] == [("r", (0x100, 5)), ("r", (0x100, 6))]
    assert [e.source()["snapshot"] for e in events] == ["true", "last"]
    assert events[0].value()["transaction"] is None
    assert events[1].value()["after"] == {"id": 2, "name": "b", "note": None}
    assert events[1].key() == {"id": 2}


def test_schema_info_describes_columns_and_key() -> None:
    info = encoder().schema_info(ORDERS)
    assert info["key"] == ["id"]
    assert info["columns"][0] == {
        "name": "id",
        "type": "int4",
        "type_oid": INT4,
        "typmod": -1,
        "key": True,
    }
    assert [c["key"] for c in info["columns"]] == [True, False, False]


def test_fast_json_is_byte_identical_to_serialising_the_value_dict() -> None:
    full = relation(identity="f")
    txn = (
        TxnBuilder(20, 100, origin='o"rigin')
        .insert(ORDERS, tup(1, "a\n\u00e9", None))
        .update(ORDERS, tup(1, "b", U))
        .update(full, tup(2, "bo", U), old=tup(1, "ann", "long"), kind="O")
        .update(full, tup(2, "bo", U), old=tup(2, "ann", U), kind="O")
        .delete(ORDERS, tup(1, None, None))
        .truncate([ORDERS, ITEMS], TRUNCATE_CASCADE)
        .message("p", b"\xff")
        .build()
    )
    enc = encoder({("public", "orders"): ("id",)})
    events = [
        *enc.events(txn),
        *enc.events(standalone_message(7, "q", b"")),
        *enc.snapshot_events(ORDERS, [tup(5, "r", None)], commit_lsn=3, commit_time=0, last=True),
    ]
    for fresh, cached in zip(events, [*enc.events(txn), *events[len(events) - 2 :]], strict=False):
        assert fresh.value_json() == orjson.dumps(cached.value())
        record = {**cached.value(), "key": cached.key()}
        assert fresh.record_json() == orjson.dumps(record)


def test_reset_of_a_recreated_slot_is_truncates_marked_reset() -> None:
    point = 0x5000
    records = [
        ChangeRecord(point - 1, Truncate(None, 0, (rel.oid,)), (rel,)) for rel in (ORDERS, ITEMS)
    ]
    txn = Transaction(
        kind="reset",
        xid=0,
        commit_lsn=point - 1,
        end_lsn=point,
        commit_time=0,
        size=2,
        _records=records,
    )
    events = list(encoder().events(txn))
    assert [(e.op, e.table, e.position) for e in events] == [
        ("t", "orders", (point - 1, 0)),
        ("t", "items", (point - 1, 1)),
    ]
    for event in events:
        value = event.value()
        assert value["source"]["snapshot"] == "reset"
        assert value["source"]["truncate"] == {"cascade": False, "restart_identity": False}
        assert event.key() is None and value["before"] is None and value["after"] is None
    plain = TxnBuilder(13, 6000).truncate([ORDERS]).build()
    assert next(encoder().events(plain)).source()["snapshot"] == "false"


def test_encoder_counts_the_events_it_makes_per_table_and_op() -> None:
    """take_counts (what the writer's per-table counters come from) agrees with the events."""
    from collections import Counter

    txn = (
        TxnBuilder(780, 5000)
        .insert(ORDERS, tup(1, "a", None))
        .insert(ITEMS, tup(1, "x"))
        .insert(ORDERS, tup(2, "b", None))
        .update(ORDERS, tup(3, "b", None), old=tup(2, None, None), kind="K")  # key change: d + c
        .update(ORDERS, tup(3, "c", None))
        .delete(ITEMS, tup(1, "x"))
        .message("p", b"m")
        .truncate([ORDERS, ITEMS])
        .build()
    )
    enc = encoder()
    assert enc.take_counts() == []
    events = list(enc.events(txn))
    made = Counter(
        ("_messages" if e.table is None else f"{e.schema}.{e.table}", e.op) for e in events
    )
    assert {(t, op): n for t, op, n in enc.take_counts()} == made
    assert made[("public.orders", "c")] == 3 and made[("public.orders", "d")] == 1
    assert enc.take_counts() == []  # taken
    rows = [tup(i, "r", None) for i in range(7)]
    list(enc.snapshot_events(ORDERS, rows, commit_lsn=10, commit_time=0))
    assert enc.take_counts() == [("public.orders", "r", 7)]
