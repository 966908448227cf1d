"""The decoder against real pgoutput bytes captured from PostgreSQL 15, 16 and 18
(``tests/corpus``, see ``tests/corpusutil.py``): every message decodes, the whole
wire path (framing, CopyData, decoder) gives the same events at any chunking, and the corpus
covers every message type of the formats doc."""

from __future__ import annotations

import random
from functools import cache
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

from cdcd.decoder.events import (
    Begin,
    BeginPrepare,
    Delete,
    Insert,
    PgOutputMessage,
    Relation,
    StreamAbort,
    Update,
)
from cdcd.decoder.pgoutput import PgOutputDecoder
from cdcd.wire.copydata import XLogData, parse_copy_data
from cdcd.wire.framing import MessageReader, frame
from tests.corpusutil import Row, all_corpus_files, framed_stream, load_corpus

#: Every tag of "Logical Replication Message Formats".
ALL_TAGS = frozenset(b"BCORYIUDTMSEcAbPKrp")

FILES = all_corpus_files()
needs_corpus = pytest.mark.skipif(not FILES, reason="tests/corpus holds no captured files yet")
file_params = pytest.mark.parametrize(
    "path", FILES, ids=[f"{p.parts[-3]}/{p.parts[-2]}/{p.stem}" for p in FILES]
)


@cache
def load(path: Path) -> tuple[dict[str, Any], list[Row]]:
    return load_corpus(path)


def proto_version(header: dict[str, Any]) -> int:
    return int(header["options"]["proto_version"])


def decode_rows(path: Path) -> tuple[PgOutputDecoder, list[PgOutputMessage]]:
    header, rows = load(path)
    decoder = PgOutputDecoder(proto_version(header))
    return decoder, [decoder.decode(data, lsn) for lsn, _xid, data in rows]


def decode_chunks(path: Path, chunks: list[bytes]) -> tuple[list[PgOutputMessage], int]:
    """Through the whole wire path: MessageReader, parse_copy_data, decoder."""
    header, _rows = load(path)
    decoder = PgOutputDecoder(proto_version(header))
    reader = MessageReader()
    events: list[PgOutputMessage] = []
    for chunk in chunks:
        reader.feed(chunk)
        while (msg := reader.next()) is not None:
            tag, payload = msg
            assert tag == b"d"
            copy = parse_copy_data(payload)
            assert isinstance(copy, XLogData)
            events.append(decoder.decode(copy.data, copy.wal_start))
    return events, reader.buffered


@needs_corpus
@file_params
def test_every_message_decodes(path: Path) -> None:
    header, rows = load(path)
    assert 1 <= proto_version(header) <= 4
    assert rows, "empty corpus file"
    decoder, events = decode_rows(path)
    assert len(events) == len(rows)
    assert not decoder.in_stream, "file ends inside a Stream Start .. Stream Stop block"


@needs_corpus
@file_params
def test_events_agree_with_their_relations_and_rows(path: Path) -> None:
    """Cross-checks only real bytes can make: each tuple has as many columns as the latest
    Relation of its OID, and Begin/Begin Prepare carry the xid the server reported."""
    _header, rows = load(path)
    _decoder, events = decode_rows(path)
    relations: dict[int, Relation] = {}
    for (lsn, xid, _data), event in zip(rows, events, strict=True):
        where = f"{path.name} at {lsn:X}"
        match event:
            case Relation():
                relations[event.oid] = event
            case Insert() | Update() | Delete():
                rel = relations.get(event.relation_oid)
                assert rel is not None, f"{where}: change before its Relation"
                tuples = [event.old] if isinstance(event, Delete) else [event.new]
                if isinstance(event, Update) and event.old is not None:
                    tuples.append(event.old)
                for tup in tuples:
                    assert tup is not None
                    assert len(tup) == len(rel.columns) == len(tup.kinds), where
            case Begin() | BeginPrepare():
                assert xid in (0, event.xid), where
            case _:
                pass


@needs_corpus
@file_params
def test_wire_path_at_any_chunking(path: Path) -> None:
    _header, rows = load(path)
    _decoder, expected = decode_rows(path)
    data = framed_stream(rows)

    whole, left = decode_chunks(path, [data])
    assert whole == expected and left == 0

    # One byte at a time (capped so huge captures stay quick: the first 64 KiB bytewise).
    head = min(len(data), 1 << 16)
    bytewise, left = decode_chunks(path, [data[i : i + 1] for i in range(head)] + [data[head:]])
    assert bytewise == expected and left == 0

    rnd = random.Random(path.name)
    points = sorted({0, len(data), *(rnd.randrange(len(data)) for _ in range(len(data) // 50))})
    chunked, left = decode_chunks(path, [data[a:b] for a, b in pairwise(points)])
    assert chunked == expected and left == 0

    # Trailing partial data: a message cut short waits in the reader, it is not decoded.
    last = rows[-1][2]
    partial = frame(b"d", b"w" + bytes(24) + last)[:-1]
    trailing, left = decode_chunks(path, [data, partial])
    assert trailing == expected and left == len(partial)


@needs_corpus
def test_corpus_covers_every_tag() -> None:
    seen: set[int] = set()
    for path in FILES:
        seen.update(data[0] for _lsn, _xid, data in load(path)[1])
    missing = sorted(chr(t) for t in ALL_TAGS - seen)
    assert not missing, f"no corpus message with tag(s) {missing}"
    assert seen <= ALL_TAGS


@needs_corpus
def test_corpus_covers_both_stream_abort_forms() -> None:
    forms: set[bool] = set()
    for path in FILES:
        _decoder, events = decode_rows(path)
        forms.update(e.abort_lsn is not None for e in events if isinstance(e, StreamAbort))
    assert forms == {False, True}, f"Stream Abort forms seen (parallel?): {forms}"


@needs_corpus
def test_corpus_covers_every_tuple_kind_and_update_form() -> None:
    kinds: set[int] = set()
    update_forms: set[str | None] = set()
    delete_forms: set[str] = set()
    for path in FILES:
        _decoder, events = decode_rows(path)
        for e in events:
            if isinstance(e, Insert):
                kinds.update(e.new.kinds)
            elif isinstance(e, Update):
                kinds.update(e.new.kinds)
                update_forms.add(e.old_kind)
            elif isinstance(e, Delete):
                kinds.update(e.old.kinds)
                delete_forms.add(e.old_kind)
    assert {chr(k) for k in kinds} == set("nutb")
    assert update_forms == {None, "K", "O"}
    assert delete_forms == {"K", "O"}
