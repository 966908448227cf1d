"""AUTO CDC option checks (:mod:`cdcd.spark.autocdc`) and their command-line flags: pure
code, no Spark session (the flags are checked before one starts)."""

from __future__ import annotations

import pytest

pytest.importorskip("pyspark")

from cdcd.spark import cli as spark_cli
from cdcd.spark.autocdc import AutoCdc, AutoCdcError

COLUMNS = ["id", "note", "n", "tag"]


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"column_list": ["n"], "except_column_list": ["tag"]}, "give one of them, not both"),
        (
            {
                "stored_as_scd_type": 2,
                "track_history_column_list": ["n"],
                "track_history_except_column_list": ["tag"],
            },
            "track_history_column_list and track_history_except_column_list",
        ),
        ({"track_history_column_list": ["n"]}, "track_history_column_list needs stored_as_scd"),
        ({"track_history_except_column_list": "n"}, "track_history_except_column_list needs"),
        ({"stored_as_scd_type": 3}, "stored_as_scd_type must be 1 or 2, not 3"),
        ({"stored_as_scd_type": "two"}, "stored_as_scd_type must be 1 or 2"),
        ({"stored_as_scd_type": True}, "stored_as_scd_type must be 1 or 2"),
        ({"column_list": []}, "column_list: empty"),
        ({"column_list": "n, n"}, "column_list: n named twice"),
        ({"except_column_list": ["__START_AT"]}, "the target's own columns"),
    ],
)
def test_bad_combinations_name_the_option(options: dict[str, object], message: str) -> None:
    with pytest.raises(AutoCdcError, match=message):
        AutoCdc(**options)  # type: ignore[arg-type]


def test_columns_keep_keys_and_table_order() -> None:
    assert AutoCdc().columns(COLUMNS, ["id"]) == COLUMNS
    assert AutoCdc(column_list=["tag", "n"]).columns(COLUMNS, ["id"]) == ["id", "n", "tag"]
    assert AutoCdc(except_column_list="note").columns(COLUMNS, ["id"]) == ["id", "n", "tag"]
    with pytest.raises(AutoCdcError, match="except_column_list: id is a key column"):
        AutoCdc(except_column_list=["id"]).columns(COLUMNS, ["id"])
    with pytest.raises(AutoCdcError, match=r"column_list: price not among the columns \(id, "):
        AutoCdc(column_list=["price"]).columns(COLUMNS, ["id"])
    with pytest.raises(AutoCdcError, match="key columns"):
        AutoCdc().columns(COLUMNS, ["code"])


def test_tracked_columns() -> None:
    written = ["id", "n", "tag"]
    assert AutoCdc(stored_as_scd_type=2).tracked(written, ["id"]) == ["n", "tag"]
    cdc = AutoCdc(stored_as_scd_type="2", track_history_except_column_list=["tag"])
    assert cdc.scd2 and cdc.tracked(written, ["id"]) == ["n"]
    assert AutoCdc(stored_as_scd_type=2, track_history_column_list="tag").tracked(
        written, ["id"]
    ) == ["tag"]
    # a tracked column that is not written (column_list left it out)
    cdc = AutoCdc(stored_as_scd_type=2, track_history_column_list=["note"])
    with pytest.raises(AutoCdcError, match="track_history_column_list: note not among"):
        cdc.tracked(written, ["id"])


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--column-list", "n", "--except-column-list", "tag"],
            "--column-list and --except-column-list: give one",
        ),
        (
            ["--track-history-column-list", "n"],
            "--track-history-column-list needs --stored-as-scd-type=2",
        ),
    ],
)
def test_cli_flags_are_checked_before_spark_starts(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["apply", "--input", "/nonexistent", "--table", "public.t", "--output", "/x", *flags]
    with pytest.raises(SystemExit) as exit_:
        spark_cli.main(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_pinned_pyspark_has_no_auto_cdc_flow() -> None:
    """docs/spark.md: the pinned PySpark has Spark Declarative Pipelines but not
    ``create_auto_cdc_flow`` (PySpark 4.2 brings it). When the pin moves past that, the docs
    get a recipe feeding it cdcd's events, tested, instead of this check."""
    pipelines = pytest.importorskip("pyspark.pipelines")
    assert not hasattr(pipelines, "create_auto_cdc_flow"), "update docs/spark.md (AUTO CDC)"
