"""From committed transactions to change events: the one place that assigns ``seq``.

CONTRACT.md §3. Every sink receives the same :class:`ChangeEvent` objects, so positions
``(commit_lsn, seq)`` are identical in every sink. Values are converted lazily, once per event
and per representation (JSON-ready for JSON Lines and Kafka, native for Parquet), with
per-relation precomputed converters from :mod:`cdcd.decoder.types`.

INTERFACE (fixed; implementation in progress):

``ChangeEvent`` attributes:
    op: str                 "c" "u" "d" "r" "t" "m"
    schema: str | None      None for logical messages
    table: str | None
    relation: Relation | None
    lsn: int                the change's own WAL position
    commit_lsn: int
    seq: int                0-based index within the transaction (after key-change splits)
    xid: int | None
    commit_time: int        PostgreSQL-epoch microseconds
    position -> (commit_lsn, seq)
methods:
    key() -> dict | None          replica-identity (primary key) columns, JSON-ready
    value() -> dict               the whole Debezium-compatible value of CONTRACT §3
    key_json() -> bytes | None    orjson of key()
    value_json() -> bytes         orjson of value()
    record_json() -> bytes        value plus top-level "key": one JSON Lines line (no newline)
    native_row(which) -> dict | None   "before"/"after" with native Python values (Parquet)

``Encoder(context: SinkContext, catalog: Catalog)``:
    events(txn: Transaction) -> Iterator[ChangeEvent]
"""
