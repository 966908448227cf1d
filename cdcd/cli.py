"""The ``cdcd`` command line: parse arguments, load the config, set up logging, dispatch.

The work itself lives in :mod:`cdcd.commands` (``run``, ``check``, ``slot``) and
:mod:`cdcd.quickstart`; they are imported only when their command runs. Nothing imports this
module.

Exit codes (README "Running against your database"): 0 done; 2 bad usage or invalid config; 3 a definite source problem
(:class:`~cdcd.errors.DefiniteSourceError`) or a sink that refuses cdcd
(:class:`~cdcd.errors.SinkSetupError`); 130 interrupted before a handler took over;
1 anything else. A :class:`~cdcd.errors.CdcdError` that escapes is logged as one line (with its
traceback only at ``log.level: debug``) and its ``exit_code`` returned.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from cdcd import __version__
from cdcd.errors import EXIT_FAILURE, EXIT_OK, EXIT_USAGE, CdcdError, ConfigError
from cdcd.lsn import format_lsn, parse_lsn

T = TypeVar("T")

EXIT_INTERRUPTED = 130

_DESCRIPTION = """\
cdcd streams committed transactions from PostgreSQL logical replication (pgoutput)
into JSON Lines / Parquet files and Kafka, ready for Spark."""

_EPILOG = """\
examples:
  cdcd quickstart                          demo on an embedded PostgreSQL, no setup needed
  cdcd check --config cdcd.yaml            validate the config and the server's readiness
  cdcd run --config cdcd.yaml              run the daemon (SIGTERM/SIGINT drain and exit 0)
  cdcd run --config cdcd.yaml --endpos 0/1A2B3C4D
  cdcd slot status --config cdcd.yaml

Any config value can be overridden by an environment variable CDCD_<PATH>, levels joined
by "__": CDCD_SOURCE__DSN, CDCD_LOG__LEVEL=debug, CDCD_SINKS__0__PATH=/data/cdc.
CDCD_CONFIG names the config file when --config is not given.

exit codes: 0 done, 1 failure, 2 bad usage or invalid config, 3 source problem
(wal_level, slot lost, publication missing, permission denied) or a sink that refuses cdcd
(credentials, permissions, fenced by another cdcd)."""


#: ``--endpos`` without an LSN: where the server's WAL ends when cdcd starts
ENDPOS_NOW = "now"


def _endpos(text: str) -> int | str:
    if text.strip().lower() == ENDPOS_NOW:
        return ENDPOS_NOW
    try:
        return parse_lsn(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{exc} (or 'now')") from None


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be greater than zero: {text!r}")
    return value


def _add_config_option(parser: argparse.ArgumentParser) -> None:
    default = os.environ.get("CDCD_CONFIG") or None
    parser.add_argument(
        "--config",
        "-c",
        metavar="FILE",
        default=default,
        required=default is None,
        help="the YAML config file (default: $CDCD_CONFIG)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser for every ``cdcd`` command."""
    formatter = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="cdcd", description=_DESCRIPTION, epilog=_EPILOG, formatter_class=formatter
    )
    parser.add_argument("--version", action="version", version=f"cdcd {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")

    run = commands.add_parser(
        "run",
        help="run the daemon",
        formatter_class=formatter,
        description="Stream changes into the configured sinks until SIGTERM/SIGINT "
        "(which drain: stop reading, make the sinks durable, confirm, exit 0).",
        epilog="examples:\n  cdcd run --config cdcd.yaml\n"
        "  cdcd run --config cdcd.yaml --endpos 0/1A2B3C4D   # stop once caught up to it\n"
        "  cdcd run --config cdcd.yaml --endpos              # catch up to now, then stop",
    )
    _add_config_option(run)
    run.add_argument(
        "--endpos",
        metavar="LSN",
        nargs="?",
        const=ENDPOS_NOW,
        type=_endpos,
        help="exit 0 once every transaction committed at or before LSN (e.g. 0/1A2B3C4D) "
        "is durable in every sink and confirmed to the server; without LSN (or 'now'): the "
        "server's WAL insert position when cdcd starts (pg_current_wal_insert_lsn())",
    )
    run.set_defaults(handler=_cmd_run)

    check = commands.add_parser(
        "check",
        help="validate the config and the server setup",
        formatter_class=formatter,
        description="Validate the config, connect, and report wal_level, server version, the "
        "negotiated protocol, slot and publication state, privileges and the replica identity "
        "of published tables. Exits non-zero on problems.",
        epilog="example:\n  cdcd check --config cdcd.yaml",
    )
    _add_config_option(check)
    check.set_defaults(handler=_cmd_check)

    slot = commands.add_parser(
        "slot",
        help="create, drop or show the replication slot",
        formatter_class=formatter,
        description="Manage the logical replication slot named in the config (source.slot). "
        "'create' on an existing slot says so and exits 0.",
        epilog="examples:\n  cdcd slot create --config cdcd.yaml\n"
        "  cdcd slot status --config cdcd.yaml\n  cdcd slot drop --config cdcd.yaml",
    )
    slot.add_argument("action", choices=("create", "drop", "status"), help="what to do")
    _add_config_option(slot)
    slot.set_defaults(handler=_cmd_slot)

    snapshot = commands.add_parser(
        "snapshot",
        help="ask the daemon for an incremental snapshot of tables, or show progress",
        formatter_class=formatter,
        description="Without an action: ask the running daemon (through a signal in the "
        "replication stream, docs/snapshots.md) to snapshot the named tables "
        "again, in chunks, while it streams. 'status': the progress recorded in "
        "snapshot.state_dir.",
        epilog="examples:\n  cdcd snapshot --config cdcd.yaml --table public.orders\n"
        "  cdcd snapshot --config cdcd.yaml --table public.orders --no-follow\n"
        "  cdcd snapshot status --config cdcd.yaml [--follow]",
    )
    snapshot.add_argument("action", nargs="?", choices=("status",), help="show progress")
    snapshot.add_argument(
        "--table",
        action="append",
        default=[],
        metavar="SCHEMA.TABLE",
        help="a published table with a primary key (repeatable)",
    )
    snapshot.add_argument(
        "--follow",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="after the request (or with 'status'), show progress until the snapshots end: "
        "rows done / estimated, rate, ETA; a progress bar on a terminal, plain lines otherwise "
        "(default: on when the output is a terminal, for a request)",
    )
    _add_config_option(snapshot)
    snapshot.set_defaults(handler=_cmd_snapshot)

    quickstart = commands.add_parser(
        "quickstart",
        help="a local demo on an embedded PostgreSQL",
        formatter_class=formatter,
        description="Start an embedded PostgreSQL, create a sample table and workload, stream "
        "it into the file sink and show the result. Needs no configuration.",
        epilog="examples:\n  cdcd quickstart\n  cdcd quickstart --duration 60 --rate 50 --dir /tmp/demo",
    )
    quickstart.add_argument(
        "--duration",
        metavar="SECONDS",
        type=_positive_float,
        default=30.0,
        help="how long the workload runs (default: 30)",
    )
    quickstart.add_argument(
        "--dir",
        metavar="DIR",
        default="cdcd-quickstart",
        help="working folder for the database and the output (default: ./cdcd-quickstart)",
    )
    quickstart.add_argument(
        "--rate",
        metavar="N",
        type=_positive_float,
        default=10.0,
        help="workload transactions per second (default: 10)",
    )
    quickstart.set_defaults(handler=_cmd_quickstart)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``cdcd`` console script; returns the exit code."""
    # numpy, which pyarrow imports for the Parquet sink, starts an OpenBLAS thread per core,
    # and those threads spin on the CPU for a while after numpy (and pandas, when installed)
    # load: 60-100 ms of the cores PostgreSQL's walsender needs, in every process. cdcd does no
    # linear algebra; a user's own setting wins.
    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error (already printed)
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    handler: Callable[[argparse.Namespace], int] = args.handler
    try:
        return handler(args)
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


# -- commands ----------------------------------------------------------------------------------


def _cmd_run(args: argparse.Namespace) -> int:
    def run(config: Any) -> int:
        from cdcd import commands

        endpos: int | None = args.endpos
        if args.endpos == ENDPOS_NOW:
            endpos = commands.current_endpos(config)
        if endpos is not None:
            _logger().info("running until end position", endpos=format_lsn(endpos))
        return commands.run(config, endpos)

    return _with_config(args, run)


def _cmd_check(args: argparse.Namespace) -> int:
    def check(config: Any) -> int:
        from cdcd import commands

        return int(commands.check(config))

    return _with_config(args, check)


def _cmd_slot(args: argparse.Namespace) -> int:
    def slot(config: Any) -> int:
        from cdcd import commands

        return int(commands.slot(config, args.action))

    return _with_config(args, slot)


def _cmd_snapshot(args: argparse.Namespace) -> int:
    def snapshot(config: Any) -> int:
        from cdcd import snapshot_command

        if args.action == "status":
            return snapshot_command.status(config, follow=bool(args.follow))
        follow = sys.stdout.isatty() if args.follow is None else args.follow
        return snapshot_command.request(config, args.table, follow=follow)

    # a request that goes through logs nothing: its logging is set up only if something logs
    return _with_config(args, snapshot, logging_when_needed=True)


def _cmd_quickstart(args: argparse.Namespace) -> int:
    from cdcd.log import configure_logging

    configure_logging("auto", "info")

    def start_quickstart() -> int:
        from cdcd import quickstart

        return int(quickstart.main(args))

    return _guarded(start_quickstart, debug=False)


def _with_config(
    args: argparse.Namespace, command: Callable[[Any], int], *, logging_when_needed: bool = False
) -> int:
    """Load the config (exit 2 on problems), configure logging (``logging_when_needed``: at the
    first record, :func:`cdcd.log.configure_logging`), run ``command(config)``."""
    from cdcd.config import load_config
    from cdcd.log import configure_logging

    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"cdcd: {exc}", file=sys.stderr)
        return exc.exit_code
    configure_logging(config.log.format, config.log.level, when_needed=logging_when_needed)
    return _guarded(lambda: command(config), debug=config.log.level == "debug")


def _guarded(command: Callable[[], int], *, debug: bool) -> int:
    """Run ``command``; a CdcdError becomes one log line and its exit code."""
    try:
        code = command()
    except CdcdError as exc:
        _logger().error(str(exc), error=type(exc).__name__, exc_info=debug)
        return exc.exit_code
    except KeyboardInterrupt:
        _logger().warning("interrupted")
        return EXIT_INTERRUPTED
    except Exception:
        _logger().exception("unexpected error (a bug in cdcd; please report it)")
        return EXIT_FAILURE
    return EXIT_OK if code is None else int(code)


def _logger() -> Any:
    from cdcd.log import get_logger

    return get_logger("cdcd.cli")
