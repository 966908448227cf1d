"""``python -m cdcd.spark <job> ...``: the jobs as a command line (also for ``spark-submit``).

Jobs (``--input`` is the file sink's path, ``--table`` is ``schema.table``)::

    state    --output DIR                      the table's current rows as plain Parquet
    apply    --output DIR [--files F ...]      apply the folder (or the given files) to the
                                               incremental state under DIR (bucketed Parquet,
                                               only touched buckets rewritten; idempotent)
    apply    --merge-into TABLE [--tombstones] ... or MERGE them into a Delta/Iceberg table
    history  --output DIR                      SCD type 2 versions as Parquet
    stream   --output DIR --checkpoint DIR     keep the incremental state up to date with
             [--continuous] [--max-files N]    structured streaming (default: what is there,
                                               then exit; --continuous: until stopped)

Common options: ``--format jsonl|parquet``, ``--key COL`` (may repeat or hold a
comma-separated list; default: the events' ``key`` struct), ``--layout auto|range:W|hash:N``
(the incremental state's bucketing), ``--master`` (a local session, default when not run by
``spark-submit``: ``local[*]``) or ``--remote sc://host:port`` (Spark Connect). Under
``spark-submit`` (``spark-submit $(python -c 'import cdcd.spark.cli as m; print(m.__file__)')
apply ...``) the submitted session is used. Progress (batches, events, buckets rewritten, lag
behind the newest file) is logged to stderr.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from cdcd.spark.sources import FORMATS

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

log = logging.getLogger("cdcd.spark")

JOBS = {
    "state": "rebuild a table's current rows as plain Parquet",
    "apply": "apply events to the incremental state (or MERGE into a table)",
    "history": "write a table's SCD type 2 history as Parquet",
    "stream": "stream a table folder into the incremental state",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m cdcd.spark", description=__doc__.split("\n")[0]
    )
    jobs = parser.add_subparsers(dest="job", required=True)
    for name, text in JOBS.items():
        job = jobs.add_parser(name, help=text)
        job.add_argument("--input", required=True, help="the file sink's path")
        job.add_argument("--table", required=True, help="schema.table")
        job.add_argument("--format", choices=FORMATS, default="jsonl")
        job.add_argument("--key", action="append", default=[], help="key column(s)")
        job.add_argument("--output", required=name != "apply", help="output folder")
        job.add_argument("--layout", default="auto", help="auto | range:WIDTH | hash:BUCKETS")
        job.add_argument("--master", default=None, help="Spark master (default: spark-submit's)")
        job.add_argument("--remote", default=None, help="Spark Connect URL (sc://host:port)")
        if name == "state":
            job.add_argument("--mode", choices=("overwrite", "errorifexists"), default="overwrite")
        if name == "apply":
            job.add_argument("--files", nargs="+", help="apply these files, not the folder")
            job.add_argument("--merge-into", help="MERGE INTO this Delta/Iceberg table")
            job.add_argument("--tombstones", action="store_true", help="keep deleted rows")
        if name == "stream":
            job.add_argument("--checkpoint", required=True, help="streaming checkpoint folder")
            job.add_argument("--continuous", action="store_true", help="run until stopped")
            job.add_argument("--max-files", type=int, default=None, help="files per batch")
    return parser


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
    args = _parser().parse_args(argv)
    if args.job == "apply" and not (args.output or args.merge_into):
        _parser().error("apply needs --output DIR or --merge-into TABLE")
    if spark is not None:
        run(spark, args)
        return 0
    _log_to_stderr()
    from pyspark.sql import SparkSession

    from cdcd.spark.session import local_session

    if args.remote:
        spark = SparkSession.builder.remote(args.remote).getOrCreate()
    elif args.master is None and os.environ.get("PYSPARK_GATEWAY_PORT"):
        spark = SparkSession.builder.appName(f"cdcd-{args.job}").getOrCreate()  # spark-submit
    else:
        spark = local_session(f"cdcd-{args.job}", master=args.master or "local[*]")
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
        from cdcd.spark.streaming import stream_files_to_parquet

        query = stream_files_to_parquet(
            spark,
            args.input,
            args.table,
            args.output,
            args.checkpoint,
            key_columns=keys,
            format=args.format,
            available_now=not args.continuous,
            max_files_per_trigger=args.max_files,
            layout=args.layout,
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
    elif args.merge_into:
        from cdcd.spark.merge import merge_changes

        merge_changes(spark, events, args.merge_into, keys, tombstones=args.tombstones)
    else:
        from cdcd.spark.incremental import apply_batch

        apply_batch(spark, events, args.output, keys, args.layout)
    log.info("%s %s: done in %.1fs", args.job, args.table, time.monotonic() - started)


if __name__ == "__main__":
    sys.exit(main())
