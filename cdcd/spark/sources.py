"""Reading cdcd's change events into Spark DataFrames: file sink folders and Kafka records.

Every reader returns *events*: a DataFrame with the change event's fields (docs/events.md) as
columns: ``before``, ``after`` (structs of the table's columns), ``op``, ``source`` (struct,
``source.commit_lsn`` and ``source.seq`` are the event's position), ``ts_ms``,
``transaction`` and ``key`` (struct of the key columns; absent or null for a keyless table).
:mod:`cdcd.spark.state` turns events into table state.

Files (docs/files.md). One table folder ``<path>/<schema>.<table>`` is read with Spark's own
file source. Spark skips every file *and folder* whose name starts with ``_`` or ``.`` (the
``_schema/`` folder, the sink's hidden in-progress files), which is exactly the sink's rule
for "not a data file"; ``pathGlobFilter`` also restricts the read to the format's suffix.
JSON Lines are read with an explicit schema built from the table's ``_schema/`` files
(:mod:`cdcd.spark.schema`: no inference pass over the data) unless one is given; Parquet
folders are read with ``mergeSchema`` (the footers' schemas) because the sink starts a new file
when the table's columns change.

Kafka (docs/kafka.md). The Kafka source is one of the pinned packages (:mod:`cdcd.spark.session`)::

    records = (spark.readStream.format("kafka")
               .option("kafka.bootstrap.servers", "broker:9092")
               .option("subscribe", "shop.public.orders")
               .option("includeHeaders", "true")
               .load())
    events = events_from_kafka_records(spark, records, schema=event_schema_ddl)

(:func:`cdcd.spark.streaming.stream_table` does this per micro-batch). Any DataFrame
with the Kafka source's columns works, e.g. one built by :func:`kafka_records_frame` from
records a Python consumer read. The value JSON is parsed with an explicit schema, or, for a
batch DataFrame only, with a schema inferred from all the values in one pass (a streaming
query cannot infer; :mod:`cdcd.spark.streaming` infers per micro-batch). Tombstones (null values) are dropped.
Read one table's topic per call: one schema describes one table's rows.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Iterable
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F
from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    IntegerType,
    LongType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

from cdcd.spark.schema import event_schema_from_files, table_folder

FORMATS = ("jsonl", "parquet")

#: The columns of Spark's Kafka source (with ``includeHeaders``).
KAFKA_RECORD_SCHEMA = StructType(
    [
        StructField("key", BinaryType()),
        StructField("value", BinaryType()),
        StructField("topic", StringType()),
        StructField("partition", IntegerType()),
        StructField("offset", LongType()),
        StructField("timestamp", TimestampType()),
        StructField("timestampType", IntegerType()),
        StructField(
            "headers",
            ArrayType(
                StructType([StructField("key", StringType()), StructField("value", BinaryType())])
            ),
        ),
    ]
)


def _check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    return fmt


def events_from_files(
    spark: SparkSession,
    path: str,
    table: str,
    format: str = "jsonl",
    schema: StructType | str | None = None,
) -> DataFrame:
    """The events of ``table`` (``schema.table``) from a file sink's output folder ``path``."""
    folder = table_folder(path, table)
    if _check_format(format) == "parquet":
        reader = spark.read.option("mergeSchema", "true").option("pathGlobFilter", "*.parquet")
        if schema is not None:
            reader = reader.schema(schema)
        return reader.parquet(folder)
    if schema is None:
        schema = event_schema(spark, path, table)
    reader = spark.read.option("pathGlobFilter", "*.jsonl").option("mode", "FAILFAST")
    return reader.schema(schema).json(folder)


def event_schema(spark: SparkSession, path: str, table: str, format: str = "jsonl") -> StructType:
    """The event schema of a table folder: from its ``_schema/`` files for JSON Lines, from
    the Parquet files' footers for Parquet (streaming reads need one)."""
    if _check_format(format) == "parquet":
        return events_from_files(spark, path, table, format).schema

    return event_schema_from_files(spark, path, table)


def kafka_records_frame(spark: SparkSession, records: Iterable[Any]) -> DataFrame:
    """A DataFrame with the Kafka source's columns from consumed records: objects with
    ``key, value, topic, partition, offset, timestamp`` (ms), ``timestamp_type`` and
    ``headers`` (pairs of str and bytes), as aiokafka's and kafka-python's records have."""
    rows = [
        (
            r.key,
            r.value,
            r.topic,
            r.partition,
            r.offset,
            dt.datetime.fromtimestamp(r.timestamp / 1000, tz=dt.UTC),
            getattr(r, "timestamp_type", 0),
            [(k, bytes(v) if v is not None else None) for k, v in (r.headers or ())],
        )
        for r in records
    ]
    return spark.createDataFrame(rows, KAFKA_RECORD_SCHEMA)


def events_from_kafka_records(
    spark: SparkSession, records: DataFrame, schema: StructType | str | None = None
) -> DataFrame:
    """The events carried by Kafka records of one table's topic (tombstones dropped).

    ``schema`` is the event schema (the JSON Lines files' schema, e.g. from
    :func:`event_schema`, or a DDL string); a ``key`` field in it is the schema of the record
    key. Without it, the schema is inferred from the values and keys (batch only, one pass).
    The topic, partition and offset are kept as ``kafka_topic``, ``kafka_partition``,
    ``kafka_offset``."""
    values = records.where(F.col("value").isNotNull()).select(
        F.col("value").cast("string").alias("value"),
        F.col("key").cast("string").alias("key"),
        F.col("topic").alias("kafka_topic"),
        F.col("partition").alias("kafka_partition"),
        F.col("offset").alias("kafka_offset"),
    )
    if schema is None:
        if records.isStreaming:
            raise ValueError("a streaming Kafka read needs an explicit event schema")
        event_type = _infer_event_schema(spark, values)
    else:
        parsed_type = StructType.fromDDL(schema) if isinstance(schema, str) else schema
        if not isinstance(parsed_type, StructType):
            raise ValueError(f"the event schema must be a struct, got {parsed_type}")
        event_type = parsed_type
    value_schema = StructType([f for f in event_type.fields if f.name != "key"])
    key_field = next((f for f in event_type.fields if f.name == "key"), None)
    parsed = values.select(
        F.from_json("value", value_schema).alias("event"),
        "key",
        "kafka_topic",
        "kafka_partition",
        "kafka_offset",
    )
    key = (
        F.from_json("key", key_field.dataType)
        if key_field is not None and isinstance(key_field.dataType, StructType)
        else F.lit(None).cast("string")
    )
    return parsed.select(
        "event.*", key.alias("key"), "kafka_topic", "kafka_partition", "kafka_offset"
    )


def json_schema(documents: DataFrame, column: str = "value") -> StructType:
    """The merged schema of the JSON objects in the string column ``column``, in one pass
    (``schema_of_variant_agg``: any Spark 4 session, Connect too). JSON numbers with a
    fraction become doubles (cdcd writes numeric as strings), fields that are null everywhere
    strings; the fields of a struct come in name order. No documents at all (an empty batch,
    such as a read_committed one whose records were all aborted) is the empty struct."""
    found = documents.select(F.expr(f"schema_of_variant_agg(parse_json(`{column}`))")).collect()
    ddl = found[0][0] if found and found[0][0] else "OBJECT<>"
    if ddl == "VOID":  # the aggregate over no rows, or over JSON nulls only
        ddl = "OBJECT<>"
    if not ddl.startswith("OBJECT<"):
        raise ValueError(f"the {column} column holds no JSON objects: {ddl}")
    ddl = re.sub(r"\bOBJECT<", "STRUCT<", ddl)
    ddl = re.sub(r"\bVOID\b", "STRING", ddl)
    ddl = re.sub(r"\bDECIMAL\(\d+,\s*\d+\)", "DOUBLE", ddl)
    schema = StructType.fromDDL(ddl[len("STRUCT<") : -1]) if ddl != "STRUCT<>" else StructType()
    assert isinstance(schema, StructType)
    return schema


def _infer_event_schema(spark: SparkSession, values: DataFrame) -> StructType:
    """The event schema of JSON ``value``s with their JSON ``key``s, in one pass: each record
    is read as the JSON Lines event it stands for (the value's fields plus ``key``)."""
    documents = values.select(
        F.concat(
            F.lit('{"key":'),
            F.coalesce(F.col("key"), F.lit("null")),
            F.lit(',"value":'),
            F.col("value"),
            F.lit("}"),
        ).alias("document")
    )
    inferred = json_schema(documents, "document")
    value_type = inferred["value"].dataType if "value" in inferred.fieldNames() else StructType()
    if not isinstance(value_type, StructType):
        raise ValueError(f"Kafka values are not JSON objects: {value_type.simpleString()}")
    fields = [f for f in value_type.fields if f.name != "key"]
    key = inferred["key"] if "key" in inferred.fieldNames() else StructField("key", StringType())
    return StructType([*fields, key])
