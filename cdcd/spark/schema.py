"""Explicit Spark schemas from the file sink's ``_schema/`` files: no inference pass.

A table folder's ``_schema/<commit_lsn:016X>-<seq:08X>.json`` files (docs/files.md) each hold
the table's columns (name, type name, type OID, typmod, key flag) from the first event at
which they apply. :func:`table_schemas` reads them (with Spark, so any Hadoop path works; one
small job), :func:`event_schema_from_files` turns them into the event schema used for batch and
streaming reads of JSON Lines (and of Kafka values).

PostgreSQL type → Spark type (JSON Lines values, docs/events.md):

==============================================  =====================================
int2, int4                                      IntegerType
int8, oid, xid, xid8, cid                       LongType
float4 / float8                                 FloatType / DoubleType (NaN, ±Infinity too)
numeric(p, s), 0 <= s <= p <= 38                DecimalType(p, s)
numeric (unconstrained or wider)                StringType (its exact text)
money                                           DecimalType(19, 2)
bool                                            BooleanType
bytea                                           BinaryType (the JSON value is base64)
date                                            DateType
timestamp                                       TimestampNTZType
timestamptz                                     TimestampType
``_<element>`` (arrays)                         ArrayType(element's type)
everything else (text, varchar, uuid, json,     StringType (the same text as in JSON)
jsonb, time, timetz, interval, enums, ranges,
domains, inet, unknown types)
==============================================  =====================================

A value that has no form in the Spark type (numeric ``NaN`` in a ``numeric(p, s)`` column,
date or timestamp ``infinity``, an array with lower bounds other than 1, which JSON carries as
text) fails the read (``mode=FAILFAST``) naming the file; read such columns as strings with
``overrides={"column": "text"}`` (a PostgreSQL type name, or a Spark DataType).

Schema changes across ``_schema/`` versions. The read schema is the newest version's columns,
in its order, with its types; columns that only older versions have (dropped since) follow, so
that older events still parse; a column's type is its newest. Older events of a retyped
column are converted by Spark's JSON parser (a number into a wider number or a string; a
value that does not fit fails the read). The key is the newest version's. A target table
(:mod:`cdcd.spark.tables`) keeps every column it has seen: a dropped column stays, null in rows
written after the drop; :func:`columns_of` gives the newest version's columns.
"""

from __future__ import annotations

from dataclasses import dataclass

from pyspark.sql import SparkSession
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    BooleanType,
    DataType,
    DateType,
    DecimalType,
    DoubleType,
    FloatType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampNTZType,
    TimestampType,
)


def table_folder(path: str, table: str) -> str:
    """``<path>/<schema>.<table>``; ``table`` is ``schema.table``."""
    if "." not in table:
        raise ValueError(f"table must be 'schema.table', got {table!r}")
    return f"{path.rstrip('/')}/{table}"


SCHEMA_FOLDER = "_schema"
NUMERIC_MAX_PRECISION = 38

_SIMPLE: dict[str, DataType] = {
    "int2": IntegerType(),
    "int4": IntegerType(),
    "int8": LongType(),
    "oid": LongType(),
    "xid": LongType(),
    "xid8": LongType(),
    "cid": LongType(),
    "float4": FloatType(),
    "float8": DoubleType(),
    "money": DecimalType(19, 2),
    "bool": BooleanType(),
    "bytea": BinaryType(),
    "date": DateType(),
    "timestamp": TimestampNTZType(),
    "timestamptz": TimestampType(),
}

#: The fields of a ``_schema/`` document that are read.
_DOCUMENT = StructType(
    [
        StructField("commit_lsn", LongType()),
        StructField("seq", LongType()),
        StructField("key", ArrayType(StringType())),
        StructField(
            "columns",
            ArrayType(
                StructType(
                    [
                        StructField("name", StringType()),
                        StructField("type", StringType()),
                        StructField("type_oid", LongType()),
                        StructField("typmod", IntegerType()),
                        StructField("key", BooleanType()),
                    ]
                )
            ),
        ),
    ]
)


@dataclass(frozen=True)
class TableSchema:
    """One ``_schema/`` version: position it applies from, key, (column, type name, typmod)."""

    position: tuple[int, int]
    key: tuple[str, ...]
    columns: tuple[tuple[str, str, int], ...]


def spark_type(type_name: str, typmod: int = -1) -> DataType:
    """The Spark type of a PostgreSQL column (the module's table)."""
    if type_name.startswith("_"):
        return ArrayType(spark_type(type_name[1:], typmod))
    if type_name == "numeric":
        if typmod >= 4:
            precision, scale = ((typmod - 4) >> 16) & 0xFFFF, (typmod - 4) & 0xFFFF
            if 0 <= scale <= precision <= NUMERIC_MAX_PRECISION:
                return DecimalType(precision, scale)
        return StringType()
    return _SIMPLE.get(type_name, StringType())


def table_schemas(spark: SparkSession, path: str, table: str) -> list[TableSchema]:
    """The ``_schema/`` versions of ``table`` under the file sink path ``path``, oldest first.
    Raises ValueError naming the folder when there is none."""
    folder = f"{table_folder(path, table)}/{SCHEMA_FOLDER}"
    try:
        rows = (
            spark.read.schema(_DOCUMENT)
            .option("multiLine", "true")
            .option("mode", "FAILFAST")
            .option("pathGlobFilter", "*.json")
            .json(folder)
            .collect()
        )
    except Exception as exc:
        if "PATH_NOT_FOUND" in str(exc) or "does not exist" in str(exc):
            raise ValueError(f"{folder}: no _schema files (is this a cdcd table folder?)") from exc
        raise
    if not rows:
        raise ValueError(f"{folder}: no _schema files (is this a cdcd table folder?)")
    versions = [
        TableSchema(
            (int(r["commit_lsn"]), int(r["seq"])),
            tuple(r["key"] or ()),
            tuple((c["name"], c["type"], int(c["typmod"])) for c in r["columns"]),
        )
        for r in rows
    ]
    return sorted(versions, key=lambda v: v.position)


def row_schema(
    versions: list[TableSchema], overrides: dict[str, DataType | str] | None = None
) -> tuple[StructType, tuple[str, ...]]:
    """The table's row struct across ``versions`` (the module's rule) and the newest key."""
    if not versions:
        raise ValueError("no _schema versions")
    fields: dict[str, DataType] = {}
    for version in reversed(versions):  # newest first: its order and types win
        for name, type_name, typmod in version.columns:
            if name not in fields:
                fields[name] = spark_type(type_name, typmod)
    for name, ddl in (overrides or {}).items():
        if name not in fields:
            raise ValueError(f"override for {name!r}: not a column ({', '.join(fields)})")
        fields[name] = ddl if isinstance(ddl, DataType) else spark_type(ddl)
    struct = StructType([StructField(n, t) for n, t in fields.items()])
    return struct, versions[-1].key


def event_schema_for(row: StructType, key: tuple[str, ...]) -> StructType:
    """The change event schema (docs/events.md, plus the top-level ``key``) of rows ``row``."""
    key_type: DataType = (
        StructType([row[k] for k in key]) if key else StringType()  # null for keyless tables
    )
    source = StructType(
        [
            StructField("version", StringType()),
            StructField("connector", StringType()),
            StructField("name", StringType()),
            StructField("db", StringType()),
            StructField("schema", StringType()),
            StructField("table", StringType()),
            StructField("ts_ms", LongType()),
            StructField("ts_us", LongType()),
            StructField("snapshot", StringType()),
            StructField("txId", LongType()),
            StructField("lsn", LongType()),
            StructField("sequence", StringType()),
            StructField("xmin", LongType()),
            StructField("commit_lsn", LongType()),
            StructField("seq", LongType()),
            StructField("origin", StringType()),
            StructField("unchanged_toast", ArrayType(StringType())),
            StructField(
                "truncate",
                StructType(
                    [
                        StructField("cascade", BooleanType()),
                        StructField("restart_identity", BooleanType()),
                    ]
                ),
            ),
            StructField("old_key", key_type),
            StructField("new_key", key_type),
        ]
    )
    transaction = StructType(
        [
            StructField("id", StringType()),
            StructField("total_order", LongType()),
            StructField("data_collection_order", LongType()),
        ]
    )
    return StructType(
        [
            StructField("before", row),
            StructField("after", row),
            StructField("source", source),
            StructField("op", StringType()),
            StructField("ts_ms", LongType()),
            StructField("transaction", transaction),
            StructField("key", key_type),
        ]
    )


def event_schema_from_files(
    spark: SparkSession, path: str, table: str, overrides: dict[str, DataType | str] | None = None
) -> StructType:
    """The JSON Lines event schema of ``table`` from its ``_schema/`` files."""
    row, key = row_schema(table_schemas(spark, path, table), overrides)
    return event_schema_for(row, key)


def columns_of(spark: SparkSession, path: str, table: str) -> tuple[list[str], list[str]]:
    """The newest ``_schema/`` version's columns and key columns."""
    newest = table_schemas(spark, path, table)[-1]
    return [c[0] for c in newest.columns], list(newest.key)
