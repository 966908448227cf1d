"""``python -m cdcd.spark <job> ...``: the jobs as a command line (also for ``spark-submit``).

Jobs (``--table`` is ``schema.table``; the source is a file sink's path ``--input`` or, for
``stream``, a Kafka broker ``--kafka-bootstrap``)::

    stream   --output TARGET --checkpoint DIR  keep a Delta Lake (default) or Iceberg table up
             [--continuous]                    to date with Structured Streaming, one MERGE
             [--max-files N]                   per micro-batch (default: what is there, then
                                               exit; --continuous: until stopped)
    apply    --output TARGET [--files F ...]   MERGE the folder (or the given files) into it
    state    --output DIR                      the table's current rows as plain Parquet
    history  --output DIR                      SCD type 2 versions as plain Parquet

``TARGET`` is a Delta table's folder (``/lake/orders``, ``s3a://lake/orders``) or a catalog
table name (``lake.db.orders``; ``--target-format iceberg`` for Iceberg, whose catalog is
configured on the session: ``--iceberg-warehouse DIR`` makes a local session's ``iceberg``
catalog). Kafka: ``--kafka-bootstrap HOST:PORT`` (topic ``<name>.<schema>.<table>``, or
``--topic``), ``--read-committed`` for cdcd's exactly-once mode, ``--schema-from PATH`` to take
the column types from a file sink's ``_schema/`` files (else the target's, then the values').
``stream`` and ``apply`` take AUTO CDC's options (:mod:`cdcd.spark.autocdc`):
``--column-list`` / ``--except-column-list A,B``, ``--stored-as-scd-type 1|2`` and, for type 2,
``--track-history-column-list`` / ``--track-history-except-column-list A,B``; bad
combinations exit 2 naming the flags before Spark starts.

Common options: ``--format jsonl|parquet`` (files), ``--key COL`` (may repeat or hold a
comma-separated list; default: the events' ``key`` struct), ``--master`` (a local session,
default when not run by ``spark-submit``: ``local[*]``) or ``--remote sc://host:port`` (Spark
Connect). Under ``spark-submit`` (``spark-submit --packages ... $(python -c 'import
cdcd.spark.cli as m; print(m.__file__)') stream ...``) the submitted session is used.
Progress (batches, events, seconds) is logged to stderr.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from cdcd.spark.autocdc import AutoCdc, AutoCdcError
from cdcd.spark.sources import FORMATS

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger("cdcd.spark")

JOBS = {
    "stream": "keep a Delta Lake or Iceberg table up to date with Structured Streaming",
    "apply": "MERGE a table folder's events into a Delta Lake or Iceberg table",
    "state": "rebuild a table's current rows as plain Parquet",
    "history": "write a table's SCD type 2 history as plain Parquet",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m cdcd.spark", description=__doc__.split("\n")[0]
    )
    jobs = parser.add_subparsers(dest="job", required=True)
    for name, text in JOBS.items():
        job = jobs.add_parser(name, help=text)
        job.add_argument("--input", required=name != "stream", help="the file sink's path")
        job.add_argument("--table", required=True, help="schema.table")
        job.add_argument("--format", choices=FORMATS, default="jsonl")
        job.add_argument("--key", action="append", default=[], help="key column(s)")
        job.add_argument("--output", required=True, help="target table or folder")
        job.add_argument("--master", default=None, help="Spark master (default: spark-submit's)")
        job.add_argument("--remote", default=None, help="Spark Connect URL (sc://host:port)")
        if name in ("stream", "apply"):
            job.add_argument("--target-format", choices=("delta", "iceberg"), default="delta")
            job.add_argument("--iceberg-warehouse", help="local session: the iceberg catalog")
            _auto_cdc_arguments(job)
        if name == "state":
            job.add_argument("--mode", choices=("overwrite", "errorifexists"), default="overwrite")
        if name == "apply":
            job.add_argument("--files", nargs="+", help="apply these files, not the folder")
        if name == "stream":
            job.add_argument("--checkpoint", required=True, help="streaming checkpoint folder")
            job.add_argument("--continuous", action="store_true", help="run until stopped")
            job.add_argument("--max-files", type=int, default=None, help="files per batch")
            job.add_argument("--kafka-bootstrap", help="read Kafka (HOST:PORT,...)")
            job.add_argument("--topic", help="Kafka topic (default: <name>.<schema>.<table>)")
            job.add_argument("--name", default=None, help="cdcd's name (the topic prefix)")
            job.add_argument("--read-committed", action="store_true", help="exactly-once mode")
            job.add_argument("--schema-from", help="a file sink path whose _schema/ to use")
    return parser


def _auto_cdc_arguments(job: argparse.ArgumentParser) -> None:
    """AUTO CDC's options (docs/spark.md), named as ``create_auto_cdc_flow`` names them."""
    group = job.add_argument_group("AUTO CDC (create_auto_cdc_flow's options)")
    group.add_argument("--column-list", help="columns written (comma-separated; keys always)")
    group.add_argument("--except-column-list", help="columns not written (comma-separated)")
    group.add_argument(
        "--stored-as-scd-type",
        "--scd-type",
        dest="stored_as_scd_type",
        choices=("1", "2"),
        default="1",
        help="1: current rows; 2: history with __START_AT/__END_AT",
    )
    group.add_argument("--track-history-column-list", help="type 2: changes that open versions")
    group.add_argument(
        "--track-history-except-column-list", help="type 2: changes updating in place"
    )


_OPTION = re.compile(
    r"\b(track_history_except_column_list|track_history_column_list|except_column_list"
    r"|column_list|stored_as_scd_type)\b"
)


def _auto_cdc(args: argparse.Namespace) -> AutoCdc:
    return AutoCdc(
        args.column_list,
        args.except_column_list,
        args.stored_as_scd_type,
        args.track_history_column_list,
        args.track_history_except_column_list,
    )


def _keys(values: list[str]) -> list[str] | None:
    keys = [k.strip() for v in values for k in v.split(",") if k.strip()]
    return keys or None


def _log_to_stderr() -> None:
    """Progress to stderr at INFO (PySpark may have configured the root logger already)."""
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(message)s"))
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False


def main(argv: Sequence[str] | None = None, spark: SparkSession | None = None) -> int:
    """Run a job; ``spark`` is a session to use (and leave running) instead of a new one
    (then logging is the caller's to configure; otherwise progress goes to stderr)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if args.job == "stream" and not (args.input or args.kafka_bootstrap):
        parser.error("stream needs --input PATH (files) or --kafka-bootstrap HOST:PORT")
    if args.job == "stream" and args.kafka_bootstrap and not (args.topic or args.name):
        parser.error("a Kafka stream needs --topic, or --name (cdcd's name, the topic prefix)")
    if args.job in ("stream", "apply"):
        try:
            _auto_cdc(args)
        except AutoCdcError as exc:
            parser.error(_OPTION.sub(lambda m: "--" + m[0].replace("_", "-"), str(exc)))
    if spark is not None:
        run(spark, args)
        return 0
    _log_to_stderr()
    from pyspark.sql import SparkSession

    from cdcd.spark.session import session

    if args.remote:
        spark = SparkSession.builder.remote(args.remote).getOrCreate()
    elif args.master is None and os.environ.get("PYSPARK_GATEWAY_PORT"):
        spark = SparkSession.builder.appName(f"cdcd-{args.job}").getOrCreate()  # spark-submit
    else:
        spark = session(
            f"cdcd-{args.job}",
            master=args.master or "local[*]",
            iceberg_warehouse=getattr(args, "iceberg_warehouse", None),
        )
    try:
        run(spark, args)
    finally:
        spark.stop()
    return 0


def run(spark: SparkSession, args: argparse.Namespace) -> None:
    """Run the job ``args.job`` on ``spark``."""
    from cdcd.spark.sources import event_schema, events_from_files

    started = time.monotonic()
    keys = _keys(args.key)
    if args.job == "stream":
        from cdcd.spark.streaming import stream_table

        query = stream_table(
            spark,
            args.table,
            args.output,
            args.checkpoint,
            path=args.input,
            format=args.format,
            kafka_bootstrap=args.kafka_bootstrap,
            topic=args.topic or (f"{args.name}.{args.table}" if args.name else None),
            read_committed=args.read_committed,
            schema_from=args.schema_from,
            key_columns=keys,
            target_format=args.target_format,
            available_now=not args.continuous,
            max_files_per_trigger=args.max_files,
            **_auto_cdc(args).options(),
        )
        query.awaitTermination()
        log.info("stream %s: stopped after %.1fs", args.table, time.monotonic() - started)
        return
    if args.job == "apply" and args.files:
        schema = event_schema(spark, args.input, args.table, args.format)
        reader = spark.read.schema(schema)
        events = (
            reader.parquet(*args.files) if args.format == "parquet" else reader.json(args.files)
        )
    else:
        events = events_from_files(spark, args.input, args.table, args.format)
    if args.job == "state":
        from cdcd.spark.state import latest_state

        latest_state(events, keys).write.mode(args.mode).parquet(args.output)
    elif args.job == "history":
        from cdcd.spark.history import history

        history(events, keys).write.mode("overwrite").parquet(args.output)
    else:
        from cdcd.spark.tables import apply_to_table, table_ref

        target = table_ref(args.output, args.target_format)
        options = _auto_cdc(args).options()
        apply_to_table(spark, events, target, keys, args.target_format, args.table, **options)
    log.info("%s %s: done in %.1fs", args.job, args.table, time.monotonic() - started)


if __name__ == "__main__":
    sys.exit(main())
