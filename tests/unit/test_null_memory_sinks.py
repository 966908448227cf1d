"""The null and memory sinks: durable at commit; the memory sink keeps every value."""

from __future__ import annotations

import pytest

from cdcd.sinks.memory import MemorySink
from cdcd.sinks.null import NullSink
from cdcd.sinks.registry import load_sink_class
from tests.unit.sink_fixtures import CONTEXT, TxnBuilder, encoder, relation, standalone_message, tup

ORDERS = relation()


def two_transactions() -> list:
    first = TxnBuilder(1, 1000).insert(ORDERS, tup(1, "a", None)).insert(ORDERS, tup(2, "b", None))
    second = TxnBuilder(2, 2000).delete(ORDERS, tup(1, None, None))
    return [first.build(), second.build(), standalone_message(3000, "p", b"x")]


async def run(sink, txns) -> None:  # type: ignore[no-untyped-def]
    enc = encoder()
    await sink.start()
    for txn in txns:
        await sink.begin(txn)
        for batch in enc.batches(txn):
            await sink.write(batch)
        await sink.commit(txn)
        assert sink.durable_lsn() == txn.end_lsn  # durable at commit, no flush needed
    await sink.flush()
    await sink.close()


async def test_memory_sink_keeps_values_keys_and_positions() -> None:
    sink = MemorySink(MemorySink.Config(), CONTEXT)
    txns = two_transactions()
    await run(sink, txns)
    assert [v["op"] for v in sink.values] == ["c", "c", "d", "m"]
    assert sink.keys == [{"id": 1}, {"id": 2}, {"id": 1}, {"prefix": "p"}]
    assert sink.positions() == [
        (txns[0].commit_lsn, 0),
        (txns[0].commit_lsn, 1),
        (txns[1].commit_lsn, 0),
        (2999, 0),  # a non-transactional message: its LSN - 1
    ]
    assert [t[3] for t in sink.transactions] == [2, 1, 1]


@pytest.mark.parametrize("encode", [False, True])
async def test_null_sink_discards_and_counts(encode: bool) -> None:
    sink = NullSink(NullSink.Config(encode=encode), CONTEXT)
    await run(sink, two_transactions())
    assert sink.stats() == {"events": 4, "transactions": 3}


async def test_null_sink_takes_changes_unless_it_encodes() -> None:
    plain = NullSink(NullSink.Config(), CONTEXT)
    assert plain.wants_events is False
    records = [r for txn in two_transactions() for r in txn.changes()]
    await plain.write_changes(records)
    assert plain.stats()["events"] == len(records) > 0
    assert NullSink(NullSink.Config(encode=True), CONTEXT).wants_events is True
    with pytest.raises(NotImplementedError, match="takes events"):
        await MemorySink(MemorySink.Config(), CONTEXT).write_changes(records)


def test_registered_by_type_and_configs_forbid_unknown_keys() -> None:
    assert load_sink_class("null") is NullSink
    assert load_sink_class("memory") is MemorySink
    with pytest.raises(ValueError):
        NullSink.Config.model_validate({"bogus": 1})
    with pytest.raises(ValueError):
        MemorySink.Config.model_validate({"bogus": 1})
