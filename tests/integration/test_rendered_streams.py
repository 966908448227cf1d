"""Streamed transactions' rows rendered as they arrive (docs/assembler.md, "Rendering streamed
changes") give byte for byte the events that rendering them at the commit gives.

Every captured stream of the corpus (``tests/corpus``: PostgreSQL 15, 16 and 18, every option
set) is fed as the daemon feeds it (changes of a transaction in spill format taken undecoded),
once with each streamed change's row JSON rendered on arrival (``Encoder.render``, as the
reader does) and once without; both with every transaction in spill
format from its first change, and once more spilled to files. Every event of every released
transaction must be the same: its JSON Lines record, Kafka key and value, the value and key
as dicts, its native rows (what Parquet writes) and its position.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cdcd.assembler.assembler import Assembler
from cdcd.assembler.transaction import Transaction
from cdcd.decoder.pgoutput import PgOutputDecoder
from cdcd.events.catalog import StaticCatalog
from cdcd.events.encoder import Encoder
from tests.corpusutil import all_corpus_files, load_corpus
from tests.unit.sink_fixtures import CONTEXT

STREAMED = [p for p in all_corpus_files() if "stream" in p.parts[-2] or "parallel" in p.parts[-2]]


def _released(
    path: Path, encoder: Encoder, *, render: bool, spill_dir: Path | None
) -> tuple[list[Transaction], Assembler]:
    header, rows = load_corpus(path)
    decoder = PgOutputDecoder(int(header["options"]["proto_version"]))
    asm = Assembler(compact_bytes=0, memory_limit=0 if spill_dir else 1 << 30, spill_dir=spill_dir)
    out = []
    for lsn, _xid, data in rows:
        rendered = None
        if render and decoder.in_stream:
            rel = asm.undecoded_relation(data, lsn, streamed=True)
            rendered = None if rel is None else encoder.render(data, rel)
        if asm.feed_undecoded(data, lsn, streamed=decoder.in_stream, rendered=rendered):
            continue
        txn = asm.feed(decoder.decode(data, lsn), lsn, data)
        if txn is not None:
            out.append(txn)
    assert asm.idle
    return out, asm


def _event_facts(encoder: Encoder, txns: list[Transaction]) -> list[str]:
    """What sinks see of each event (as repr: a NaN float equals itself there)."""
    facts = []
    for txn in txns:
        for event in encoder.events(txn):
            facts.append(
                repr(
                    (
                        event.position,
                        event.record_json(),
                        event.key_json(),
                        event.value_json(),
                        event.value(),
                        event.key(),
                        event.native_row("before"),
                        event.native_row("after"),
                        event.unchanged_toast(),
                    )
                )
            )
        txn.release()
    return facts


@pytest.mark.parametrize("spilled", [False, True], ids=["in-memory", "spill-files"])
def test_rendering_on_arrival_changes_no_event(tmp_path: Path, spilled: bool) -> None:
    assert len(STREAMED) >= 40, "the corpus has its streamed option sets"
    rendered: dict[str, int] = {}
    for path in STREAMED:
        plain = Encoder(CONTEXT, StaticCatalog(), clock=lambda: 1.0)
        early = Encoder(CONTEXT, StaticCatalog(), clock=lambda: 1.0)
        dirs = (tmp_path / f"{path.stem}-plain", tmp_path / f"{path.stem}-early")
        expected, _ = _released(path, plain, render=False, spill_dir=dirs[0] if spilled else None)
        got, asm = _released(path, early, render=True, spill_dir=dirs[1] if spilled else None)
        option_set = "/".join(path.parts[-3:-1])
        rendered[option_set] = rendered.get(option_set, 0) + asm.rendered
        where = "/".join(path.parts[-3:])
        assert _event_facts(early, got) == _event_facts(plain, expected), where
    # streamed changes of every option set were rendered on arrival
    assert len(rendered) >= 10
    assert all(n >= 40 for n in rendered.values()), rendered
