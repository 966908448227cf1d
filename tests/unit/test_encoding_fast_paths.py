"""Fast paths of the encoder give the same answers as the general path (bench/run.py issue)."""

from __future__ import annotations

from cdcd.events import ChangeEvent
from tests.unit.sink_fixtures import TxnBuilder, U, encoder, relation, tup

ORDERS = relation()


def _event(row: tuple[object, ...], old: tuple[object, ...] | None = None) -> ChangeEvent:
    """The one event of an update of ``row``; with ``old``, under REPLICA IDENTITY FULL (O)."""
    if old is None:
        txn = TxnBuilder(12, 5000).update(ORDERS, tup(*row)).build()
        (event,) = encoder().events(txn)
    else:
        full = relation(identity="f")
        txn = TxnBuilder(12, 5000).update(full, tup(*row), old=tup(*old), kind="O").build()
        (event,) = encoder({("public", "orders"): ("id",)}).events(txn)
    return event


def test_unchanged_toast_is_the_same_whichever_representation_came_first() -> None:
    for row, old in (
        ((1, "ann", U), None),
        ((1, "bo", U), (1, "ann", "long")),
        ((1, "x", "y"), None),
    ):
        native_first = _event(row, old)
        native_first.native_row("after")
        json_first = _event(row, old)
        json_first.value()
        nothing_first = _event(row, old)
        expected = ["note"] if row[2] is U and old is None else []
        assert nothing_first.unchanged_toast() == expected
        assert native_first.unchanged_toast() == expected
        assert json_first.unchanged_toast() == expected
        assert json_first.source().get("unchanged_toast", []) == expected


def test_unchanged_toast_converts_nothing_without_unchanged_columns() -> None:
    event = _event((1, "x", "y"))
    assert event.unchanged_toast() == []
    assert event._json_rows is None and event._native_rows is None
