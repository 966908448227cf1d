"""Loading the captured pgoutput corpus (``tests/corpus``, written by
``scripts/capture_corpus.py``).

Each ``tests/corpus/pg<major>/<optionset>/<scenario>.jsonl`` file holds a header object on
its first line, then one ``{"lsn": "0/16B3748", "xid": 123, "data": "<hex>"}`` object per
row returned by ``pg_logical_slot_peek_binary_changes``: ``data`` is exactly one pgoutput
message as the walsender would put after the ``w`` (XLogData) header.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from cdcd.wire.framing import frame

CORPUS_DIR = Path(__file__).resolve().parent / "corpus"

Row = tuple[int, int, bytes]


def parse_lsn(text: str) -> int:
    hi, lo = text.split("/")
    return (int(hi, 16) << 32) | int(lo, 16)


def load_corpus(path: str | Path) -> tuple[dict[str, Any], list[Row]]:
    """``(header, [(lsn, xid, message bytes), ...])`` of one corpus file."""
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    header = json.loads(lines[0])
    rows: list[Row] = []
    for line in lines[1:]:
        obj = json.loads(line)
        rows.append((parse_lsn(obj["lsn"]), int(obj["xid"] or 0), bytes.fromhex(obj["data"])))
    return header, rows


def all_corpus_files() -> list[Path]:
    """Every corpus file, sorted by path."""
    return sorted(CORPUS_DIR.glob("pg*/*/*.jsonl"))


def corpus_files(
    major: int | None = None, optionset: str | None = None, scenario: str | None = None
) -> list[Path]:
    """Corpus files filtered by server major, option set name and/or scenario name."""
    return [
        p
        for p in all_corpus_files()
        if (major is None or p.parts[-3] == f"pg{major}")
        and (optionset is None or p.parts[-2] == optionset)
        and (scenario is None or p.stem == scenario)
    ]


_XLOGDATA = struct.Struct("!cQQQ")


def xlogdata(row: Row, send_time: int = 0) -> bytes:
    """The CopyData payload the walsender sends for one message: ``w`` + start + end + time."""
    lsn, _xid, data = row
    return _XLOGDATA.pack(b"w", lsn, lsn, send_time) + data


def framed_stream(rows: Iterable[Row]) -> bytes:
    """The rows as a walsender byte stream: one CopyData (``d``) message per pgoutput message."""
    return b"".join(frame(b"d", xlogdata(row)) for row in rows)
