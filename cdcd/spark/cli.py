"""``python -m cdcd.spark <job> ...``: the jobs as a command line (also for ``spark-submit``).

Jobs::

    state   --input PATH --table schema.table [--format jsonl|parquet] [--key COL ...]
            --output DIR [--mode overwrite|errorifexists]
            rebuild the table's current state from a file sink folder, write it as Parquet
    stream  --input PATH --table schema.table [--format ...] [--key COL ...]
            --output DIR --checkpoint DIR [--continuous]
            keep a versioned Parquet state up to date (see cdcd.spark.streaming); by default
            processes the files present and exits (trigger availableNow)

``--key`` may repeat or hold a comma-separated list; without it the events' ``key`` struct
names the key columns (none: the table is matched by whole rows). ``--master`` starts a local
session (default when not run by ``spark-submit``: ``local[*]``); under ``spark-submit``
(``spark-submit $(python -c 'import cdcd.spark.cli as m; print(m.__file__)') state ...``)
the submitted session is used.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from cdcd.spark.sources import FORMATS

if TYPE_CHECKING:
    from pyspark.sql import SparkSession


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m cdcd.spark", description=__doc__.split("\n")[0]
    )
    jobs = parser.add_subparsers(dest="job", required=True)
    for name, text in (
        ("state", "rebuild a table's current state as Parquet"),
        ("stream", "stream a table folder into a versioned Parquet state"),
    ):
        job = jobs.add_parser(name, help=text)
        job.add_argument("--input", required=True, help="the file sink's path")
        job.add_argument("--table", required=True, help="schema.table")
        job.add_argument("--format", choices=FORMATS, default="jsonl")
        job.add_argument("--key", action="append", default=[], help="key column(s)")
        job.add_argument("--output", required=True, help="output folder")
        job.add_argument("--master", default=None, help="Spark master (default: spark-submit's)")
        if name == "state":
            job.add_argument("--mode", choices=("overwrite", "errorifexists"), default="overwrite")
        else:
            job.add_argument("--checkpoint", required=True, help="streaming checkpoint folder")
            job.add_argument("--continuous", action="store_true", help="run until stopped")
    return parser


def _keys(values: list[str]) -> list[str] | None:
    keys = [k.strip() for v in values for k in v.split(",") if k.strip()]
    return keys or None


def main(argv: Sequence[str] | None = None, spark: SparkSession | None = None) -> int:
    """Run a job; ``spark`` is a session to use (and leave running) instead of a new one."""
    args = _parser().parse_args(argv)
    if spark is not None:
        run(spark, args)
        return 0
    from pyspark.sql import SparkSession

    from cdcd.spark.session import local_session

    if args.master is None and os.environ.get("PYSPARK_GATEWAY_PORT"):
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
    if args.job == "state":
        from cdcd.spark.sources import events_from_files
        from cdcd.spark.state import latest_state

        events = events_from_files(spark, args.input, args.table, args.format)
        latest_state(events, _keys(args.key)).write.mode(args.mode).parquet(args.output)
        return
    from cdcd.spark.streaming import stream_files_to_parquet

    query = stream_files_to_parquet(
        spark,
        args.input,
        args.table,
        args.output,
        args.checkpoint,
        key_columns=_keys(args.key),
        format=args.format,
        available_now=not args.continuous,
    )
    query.awaitTermination()


if __name__ == "__main__":
    sys.exit(main())
