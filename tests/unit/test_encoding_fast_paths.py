"""Fast paths of the encoder give the same answers as the general path."""

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


# -- the JSON fast path (ChangeEvent._body) against the whole value, on generated transactions --

import orjson  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

VALUE = st.one_of(
    st.none(),
    st.just(U),
    st.integers(-(2**31), 2**31 - 1),
    st.text(st.characters(blacklist_categories=["Cs"], blacklist_characters="\x00"), max_size=8),
)
ROW = st.tuples(st.integers(1, 5), VALUE, VALUE)


@st.composite
def transactions(draw: st.DrawFn) -> list[ChangeEvent]:
    """A transaction of inserts, updates (plain, with K or O images, key changes, unchanged
    TOAST), deletes, messages and truncates, on a table with a key and one with FULL."""
    keyed, full = relation(), relation(name="full", identity="f", oid=16401)
    builder = TxnBuilder(draw(st.integers(1, 2**31)), draw(st.integers(8, 2**40)))
    for _ in range(draw(st.integers(1, 12))):
        rel = draw(st.sampled_from([keyed, full]))
        new = draw(ROW)
        kind = draw(st.sampled_from(["insert", "update", "update_k", "update_o", "delete", "msg"]))
        if kind == "insert":
            builder.insert(rel, tup(*(v if v is not U else "x" for v in new)))
        elif kind == "update":
            builder.update(rel, tup(*new))
        elif kind == "update_k":
            builder.update(rel, tup(*new), old=tup(draw(st.integers(1, 5)), None, None), kind="K")
        elif kind == "update_o":
            old = draw(ROW)
            builder.update(
                rel, tup(*new), old=tup(*(v if v is not U else "o" for v in old)), kind="O"
            )
        elif kind == "delete":
            builder.delete(rel, tup(new[0], None, None))
        else:
            builder.message(draw(st.sampled_from(["p", "q"])), draw(st.binary(max_size=6)))
    if draw(st.booleans()):
        builder.truncate([keyed, full], draw(st.integers(0, 3)))
    return list(encoder({("public", "full"): ("id",)}).events(builder.build()))


@settings(max_examples=200, deadline=None)
@given(events=transactions())
def test_json_fast_path_equals_the_whole_value(events: list[ChangeEvent]) -> None:
    """record_json/value_json (built from cached pieces) say what value()/key() say."""
    for event in events:
        assert event.value_json() == orjson.dumps(event.value())  # the same bytes, even
        assert event.record_json() == orjson.dumps({**event.value(), "key": event.key()})
        assert event.key_json() == (None if event.key() is None else orjson.dumps(event.key()))


@settings(max_examples=100, deadline=None)
@given(
    rows=st.lists(st.tuples(st.integers(-5, 2**40), VALUE, VALUE), max_size=5),
    lsn=st.integers(1, 2**64 - 2),
    first=st.integers(0, 2**40),
    last=st.booleans(),
)
def test_json_fast_path_of_snapshot_rows(
    rows: list[tuple[object, ...]], lsn: int, first: int, last: bool
) -> None:
    """Snapshot rows (no transaction block, a null xid) take the same fast path."""
    keyed = relation()
    images = [tup(*(v if v is not U else "x" for v in row)) for row in rows]
    made = encoder().snapshot_events(
        keyed, images, commit_lsn=lsn, commit_time=first, first_seq=first, last=last
    )
    for event in made:
        assert event.value_json() == orjson.dumps(event.value())
        assert event.record_json() == orjson.dumps({**event.value(), "key": event.key()})
