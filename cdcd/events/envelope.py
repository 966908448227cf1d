"""The JSON envelope of a change event, written once (docs/events.md: the public contract).

The functions below build an event's value as a dict: its fields, their names and their order,
and which are the same for a whole transaction (or snapshot batch) and which differ per row.
:meth:`ChangeEvent.value` builds every value with them, and is the tested reference.

The fast paths write a row event's JSON Lines record without building that dict: they splice
the rows' JSON, the per-transaction source head and the per-row numbers between constant byte
strings. Those byte strings are not written by hand anywhere: :data:`ROW` derives them here, at
import, by serialising the very dicts these functions build with a marker in each hole, and
cutting the result at the markers. The Python template (``ChangeEvent._make_body``) joins them,
and the compiled paths (``cdcd._rowjson.event_body``, ``snapshot_lines``,
``copy_snapshot_lines``) are handed them as an argument and only splice what they are given.
``tests/unit/test_envelope.py`` checks every path byte for byte against ``orjson.dumps`` of
:meth:`ChangeEvent.value` over generated events.

A row event's JSON Lines record, holes in capitals::

    {"before":BEFORE,"after":AFTER,"source":HEAD"lsn":LSN,"sequence":"[PREV,\\"LSN\\"]",
     "xmin":null,"commit_lsn":COMMIT_LSN,"seq":SEQ EXTRA},"op":"OP","ts_ms":TS_MS,
     "transaction":TXN,"key":KEY}

HEAD is the source block's opening brace and fields up to ``txId`` with a trailing comma (the
same for a transaction's events on one table), EXTRA the optional source fields after ``seq``
(``origin``, ``unchanged_toast``, ``new_key`` / ``old_key``), each with its leading comma;
PREV is ``null`` for a transaction's first event, else the previous LSN quoted; TXN is
``null`` (snapshot rows, non-transactional messages) or the transaction block.
"""

from __future__ import annotations

from typing import Any, Final, NamedTuple

import orjson

from cdcd import __version__

__all__ = [
    "HEAD_TAIL",
    "ROW",
    "RowPieces",
    "fields_json",
    "message_value",
    "row_body",
    "row_value",
    "sequence",
    "source_block",
    "source_extra",
    "source_fixed",
    "source_head",
    "source_origin",
    "transaction_block",
]

Row = dict[str, Any]


def row_value(
    before: Any, after: Any, source: Row, op: str, ts_ms: int, transaction: Row | None
) -> Row:
    """The value of a row event (ops ``c``, ``u``, ``d``, ``r``, ``t``)."""
    return {
        "before": before,
        "after": after,
        "source": source,
        "op": op,
        "ts_ms": ts_ms,
        "transaction": transaction,
    }


def message_value(ts_ms: int, source: Row, message: Row, transaction: Row | None) -> Row:
    """The value of a logical message's event (op ``m``)."""
    return {
        "op": "m",
        "ts_ms": ts_ms,
        "source": source,
        "message": message,
        "transaction": transaction,
    }


def source_head(
    fixed: Row, ts_ms: int, ts_us: int, snapshot: str, tx_id: int | None, origin: str | None
) -> Row:
    """The source fields a transaction's events on one table share: ``fixed`` (``version``,
    ``connector``, ``name``, ``db``, ``schema``, ``table``), the commit time, the snapshot
    marker, the xid; the per-event fields follow (:func:`source_block`), then ``origin``."""
    head = {**fixed, "ts_ms": ts_ms, "ts_us": ts_us, "snapshot": snapshot, "txId": tx_id}
    head.update(source_block({}, None, None, None, None))
    if origin is not None:
        head.update(source_origin(origin))
    return head


def source_origin(origin: str) -> Row:
    """The source field naming the replication origin of the transaction (after ``seq``)."""
    return {"origin": origin}


def source_extra(unchanged: list[str], link: tuple[str, Any] | None) -> Row:
    """A row event's own source fields after ``seq`` (and ``origin``): ``unchanged_toast``
    when the new row has columns whose value PostgreSQL did not send, ``new_key`` /
    ``old_key`` on the two events of a key change (``link``)."""
    extra: Row = {}
    if unchanged:
        extra["unchanged_toast"] = unchanged
    if link is not None:
        extra[link[0]] = link[1]
    return extra


def fields_json(fields: Row) -> bytes:
    """``fields`` as they follow other fields of an object: each with its leading comma."""
    return b"," + orjson.dumps(fields)[1:-1] if fields else b""


def source_block(head: Row, lsn: Any, sequence: Any, commit_lsn: Any, seq: Any) -> Row:
    """``head`` (:func:`source_head`) with one event's position filled in."""
    block = dict(head)
    block["lsn"] = lsn
    block["sequence"] = sequence
    block["xmin"] = None
    block["commit_lsn"] = commit_lsn
    block["seq"] = seq
    return block


def sequence(prev_lsn: int | None, lsn: int) -> str:
    """``source.sequence``: Debezium's ``["<previous lsn>","<lsn>"]`` as a JSON string."""
    return f'[null,"{lsn}"]' if prev_lsn is None else f'["{prev_lsn}","{lsn}"]'


def transaction_block(txid: str, total_order: int, data_collection_order: int) -> Row:
    """The value's ``transaction`` block (``total_order`` is ``seq + 1``)."""
    return {"id": txid, "total_order": total_order, "data_collection_order": data_collection_order}


class RowPieces(NamedTuple):
    """The constant byte strings of a row event's JSON Lines record, in the order they are
    written, each named by the hole that follows it (see the module docstring)."""

    before: bytes  # {"before":
    after: bytes  # ,"after":
    head: bytes  # ,"source":
    lsn: bytes  # "lsn":
    prev_none: bytes  # ,"sequence":"[null,\"      (a first event: then LSN)
    prev: bytes  # ,"sequence":"[\"                (then PREV)
    prev_lsn: bytes  # \",\"                       (between PREV and LSN)
    commit_lsn: bytes  # \"]","xmin":null,"commit_lsn":
    seq: bytes  # ,"seq":      (then SEQ, then EXTRA)
    op: bytes  # },"op":"
    ts_ms: bytes  # ","ts_ms":
    txn_none: bytes  # ,"transaction":null         (then the key, or the value's end)
    txid: bytes  # ,"transaction":{"id":"
    total_order: bytes  # ","total_order":
    dco: bytes  # ,"data_collection_order":
    txn_end: bytes  # }
    key: bytes  # ,"key":
    end: bytes  # }


# Markers: raw JSON holes as fragments, numbers as numbers no event has, strings with a
# control character (escaped by orjson as \u0001..., which no constant piece contains).
_BEFORE, _AFTER, _KEY = (orjson.Fragment(b"\x02%d\x02" % i) for i in range(3))
_LSN, _PREV, _COMMIT, _SEQ, _TS, _TOTAL, _DCO = (
    9_000_000_000_000_000_000 + 10 * i for i in range(7)
)
_OP, _TXID = "\x01op\x01", "\x01txid\x01"
_HEAD_KEY, _EXTRA_KEY = "\x01head\x01", "\x01extra\x01"


def _record(prev: int | None, transactional: bool) -> bytes:
    """A marked record, from the functions above."""
    source = source_block({_HEAD_KEY: None}, _LSN, sequence(prev, _LSN), _COMMIT, _SEQ)
    source[_EXTRA_KEY] = None
    txn = transaction_block(_TXID, _TOTAL, _DCO) if transactional else None
    value = row_value(_BEFORE, _AFTER, source, _OP, _TS, txn)
    record: bytes = orjson.dumps({**value, "key": _KEY})  # typed: mypyc may lack orjson's stubs
    return record


def _cut(record: bytes, *markers: bytes) -> list[bytes]:
    """``record`` cut at each of ``markers`` in turn (each found after the one before)."""
    pieces = []
    for marker in markers:
        before, found, record = record.partition(marker)
        if not found:
            raise AssertionError(f"the envelope's spec lost its marker {marker!r}")
        pieces.append(before)
    pieces.append(record)
    if any(b"\x02" in p or b"\\u0001" in p or b"9000000000000000" in p for p in pieces):
        raise AssertionError("the envelope's spec has a hole more: update envelope.py")
    return pieces


def _quoted(value: Any) -> bytes:
    quoted: bytes = orjson.dumps(value)
    return quoted


def _inner(value: str) -> bytes:
    return _quoted(value)[1:-1]


def _inner_int(value: int) -> bytes:
    return b"%d" % value


def _derive() -> RowPieces:
    extra = b"," + _quoted(_EXTRA_KEY) + b":null"
    head = _quoted(_HEAD_KEY) + b":null,"
    lsn = _inner_int(_LSN)
    full = _cut(
        _record(_PREV, True),
        b"\x020\x02", b"\x021\x02", head, lsn, _inner_int(_PREV), lsn, _inner_int(_COMMIT),
        _inner_int(_SEQ), extra, _inner(_OP), _inner_int(_TS), _inner(_TXID),
        _inner_int(_TOTAL), _inner_int(_DCO), b"\x022\x02",
    )  # fmt: skip
    first = _cut(
        _record(None, False),
        b"\x020\x02", b"\x021\x02", head, lsn, lsn, _inner_int(_COMMIT), _inner_int(_SEQ),
        extra, _inner(_OP), _inner_int(_TS), b"\x022\x02",
    )  # fmt: skip
    (before, after, source, at_lsn, prev, prev_lsn, commit, seq, after_seq, op, ts) = full[:11]
    txid, total, dco, txn_end, end = full[11:]
    key = b',"key":'
    # the HEAD hole is the source block's opening brace and its first fields; EXTRA follows SEQ
    shared = (first[:4], first[5:7], first[8:10], first[11])
    if (
        not source.endswith(b"{")
        or after_seq != b""
        or first[7] != b""
        or not txn_end.endswith(b"}" + key)
        or not first[10].endswith(key)
        or shared != (full[:4], [commit, seq], [op, ts], end)
    ):
        raise AssertionError("the envelope's spec changed shape: update envelope.py")
    return RowPieces(
        before=before,
        after=after,
        head=source[:-1],
        lsn=at_lsn,
        prev_none=first[4],
        prev=prev,
        prev_lsn=prev_lsn,
        commit_lsn=commit,
        seq=seq,
        op=op,
        ts_ms=ts,
        txn_none=first[10][: -len(key)],
        txid=txid,
        total_order=total,
        dco=dco,
        txn_end=txn_end[: -len(key)],
        key=key,
        end=end,
    )


#: The constant pieces of a row event's record, derived from the functions above.
ROW: Final = _derive()


def source_fixed(name: str, db: str, schema: str | None, table: str | None) -> Row:
    """The first source fields: the same for every event of a table."""
    return {
        "version": __version__,
        "connector": "postgresql",
        "name": name,
        "db": db,
        "schema": schema,
        "table": table,
    }


def _derive_head() -> bytes:
    marked = orjson.dumps(source_head({}, _TS, _SEQ, _OP, _COMMIT, None))
    start, ts_us, snapshot, tx_id, rest = _cut(
        marked, _inner_int(_TS), _inner_int(_SEQ), _quoted(_OP), _inner_int(_COMMIT)
    )
    if not start.startswith(b"{") or not rest.startswith(b","):
        raise AssertionError("the envelope's spec changed shape: update envelope.py")
    return b"," + start[1:] + b"%d" + ts_us + b"%d" + snapshot + b"%s" + tx_id + b"%s,"


#: The source fields after ``table`` up to the per-event ones, as a format of
#: (ts_ms, ts_us, the snapshot marker's JSON, txId's JSON): what follows the fixed fields
#: (:func:`source_fixed`, serialised without the closing brace) in HEAD.
HEAD_TAIL: Final = _derive_head()


def row_body(
    before: bytes,
    after: bytes,
    head: bytes,
    lsn: int,
    prev_lsn: int | None,
    commit_lsn: int,
    seq: int,
    extra: bytes,
    op: str,
    ts_ms: int,
    txid: str | None,
    dco: int,
    key: bytes | None,
) -> bytes:
    """A row event's JSON without its closing brace (with ``key``: its whole JSON Lines record),
    from its parts: the pieces of :data:`ROW` spliced in order. ``cdcd._rowjson.event_body``
    takes the same arguments and :data:`ROW`, and gives the same bytes."""
    p = ROW
    parts = [
        p.before,
        before,
        p.after,
        after,
        p.head,
        head,
        p.lsn,
        b"%d" % lsn,
        p.prev_none if prev_lsn is None else b"%s%d%s" % (p.prev, prev_lsn, p.prev_lsn),
        b"%d" % lsn,
        p.commit_lsn,
        b"%d" % commit_lsn,
        p.seq,
        b"%d" % seq,
        extra,
        p.op,
        op.encode(),
        p.ts_ms,
        b"%d" % ts_ms,
    ]
    if txid is None:
        parts.append(p.txn_none)
    else:
        block = (p.txid, txid.encode(), p.total_order, b"%d" % (seq + 1), p.dco, b"%d" % dco)
        parts += (*block, p.txn_end)
    if key is not None:
        parts += (p.key, key, p.end)
    return b"".join(parts)
