"""AUTO CDC options (Databricks' ``create_auto_cdc_flow``, formerly ``apply_changes``) for the
table jobs of :mod:`cdcd.spark.tables`: which columns land in the target and how history is
kept. Pure code: no Spark.

``keys`` and ``sequence_by`` need no option: the keys are the events' key (or ``key_columns``)
and the sequence is always the position ``(source.commit_lsn, source.seq)``.

* ``column_list`` / ``except_column_list`` (at most one): the source columns written to the
  target. The key columns are always written: a ``column_list`` without them gets them, an
  ``except_column_list`` naming one is an error.
* ``stored_as_scd_type``: 1 keeps the current row per key (deletes and truncates remove it);
  2 keeps every version with ``__START_AT`` / ``__END_AT`` (:mod:`cdcd.spark.scd2`).
* ``track_history_column_list`` / ``track_history_except_column_list`` (at most one, type 2
  only): a change to none of the tracked columns updates the current version in place
  instead of opening a new one. Default: every written column is tracked.

Bad combinations raise :class:`AutoCdcError` naming the option when the options are made
(:class:`AutoCdc`); lists naming columns the table lacks, when they meet the table's columns
(:meth:`AutoCdc.columns`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

SCD_TYPES = (1, 2)
START_AT = "__START_AT"
END_AT = "__END_AT"


class AutoCdcError(ValueError):
    """AUTO CDC options that cannot go together or do not fit the table."""


def _names(option: str, value: Sequence[str] | str | None) -> tuple[str, ...] | None:
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else list(value)
    names = tuple(str(n).strip() for n in items if str(n).strip())
    if not names:
        raise AutoCdcError(f"{option}: empty (leave it out to take every column)")
    duplicated = sorted({n for n in names if names.count(n) > 1})
    if duplicated:
        raise AutoCdcError(f"{option}: {', '.join(duplicated)} named twice")
    reserved = [n for n in names if n in (START_AT, END_AT) or n.startswith("_cdc_")]
    if reserved:
        raise AutoCdcError(f"{option}: {', '.join(reserved)} are the target's own columns")
    return names


@dataclass(frozen=True)
class AutoCdc:
    """One table's AUTO CDC options (the module's rules); lists may also be comma-separated
    strings. Raises :class:`AutoCdcError` on bad combinations."""

    column_list: tuple[str, ...] | None = None
    except_column_list: tuple[str, ...] | None = None
    stored_as_scd_type: int = 1
    track_history_column_list: tuple[str, ...] | None = None
    track_history_except_column_list: tuple[str, ...] | None = None

    def __init__(
        self,
        column_list: Sequence[str] | str | None = None,
        except_column_list: Sequence[str] | str | None = None,
        stored_as_scd_type: int | str = 1,
        track_history_column_list: Sequence[str] | str | None = None,
        track_history_except_column_list: Sequence[str] | str | None = None,
    ) -> None:
        try:
            scd = int(stored_as_scd_type)
        except (TypeError, ValueError):
            scd = 0
        if scd not in SCD_TYPES or isinstance(stored_as_scd_type, bool):
            raise AutoCdcError(f"stored_as_scd_type must be 1 or 2, not {stored_as_scd_type!r}")
        values: dict[str, Any] = {
            "column_list": _names("column_list", column_list),
            "except_column_list": _names("except_column_list", except_column_list),
            "stored_as_scd_type": scd,
            "track_history_column_list": _names(
                "track_history_column_list", track_history_column_list
            ),
            "track_history_except_column_list": _names(
                "track_history_except_column_list", track_history_except_column_list
            ),
        }
        for name, value in values.items():
            object.__setattr__(self, name, value)
        if self.column_list is not None and self.except_column_list is not None:
            raise AutoCdcError("column_list and except_column_list: give one of them, not both")
        tracks = self.track_history_column_list, self.track_history_except_column_list
        if tracks[0] is not None and tracks[1] is not None:
            raise AutoCdcError(
                "track_history_column_list and track_history_except_column_list: "
                "give one of them, not both"
            )
        if scd == 1 and (tracks[0] is not None or tracks[1] is not None):
            option = (
                "track_history_column_list"
                if tracks[0] is not None
                else "track_history_except_column_list"
            )
            raise AutoCdcError(f"{option} needs stored_as_scd_type=2 (type 1 keeps no history)")

    @property
    def scd2(self) -> bool:
        return self.stored_as_scd_type == 2

    def columns(self, available: Sequence[str], keys: Sequence[str]) -> list[str]:
        """The columns written to the target, in the table's order: ``available`` (the
        table's columns) narrowed by ``column_list`` / ``except_column_list``, keys kept."""
        missing_keys = [k for k in keys if k not in available]
        if missing_keys:
            raise AutoCdcError(f"key columns {missing_keys} are not columns of the table")
        if self.column_list is not None:
            self._known("column_list", self.column_list, available)
            chosen = set(self.column_list) | set(keys)
        elif self.except_column_list is not None:
            self._known("except_column_list", self.except_column_list, available)
            excluded = [k for k in keys if k in self.except_column_list]
            if excluded:
                raise AutoCdcError(
                    f"except_column_list: {', '.join(excluded)} is a key column "
                    "(key columns are always written)"
                )
            chosen = set(available) - set(self.except_column_list)
        else:
            chosen = set(available)
        return [c for c in available if c in chosen]

    def tracked(self, columns: Sequence[str], keys: Sequence[str]) -> list[str]:
        """The written non-key ``columns`` whose changes open a new type 2 version."""
        others = [c for c in columns if c not in keys]
        if self.track_history_column_list is not None:
            self._known("track_history_column_list", self.track_history_column_list, columns)
            return [c for c in others if c in self.track_history_column_list]
        if self.track_history_except_column_list is not None:
            listed = self.track_history_except_column_list
            self._known("track_history_except_column_list", listed, columns)
            return [c for c in others if c not in listed]
        return others

    @staticmethod
    def _known(option: str, names: Sequence[str], available: Sequence[str]) -> None:
        unknown = [n for n in names if n not in available]
        if unknown:
            raise AutoCdcError(
                f"{option}: {', '.join(unknown)} not among the columns ({', '.join(available)})"
            )

    def options(self) -> dict[str, Any]:
        """The options as keyword arguments (of :func:`cdcd.spark.tables.apply_to_table`)."""
        return {
            "column_list": self.column_list,
            "except_column_list": self.except_column_list,
            "stored_as_scd_type": self.stored_as_scd_type,
            "track_history_column_list": self.track_history_column_list,
            "track_history_except_column_list": self.track_history_except_column_list,
        }


__all__ = ["END_AT", "SCD_TYPES", "START_AT", "AutoCdc", "AutoCdcError"]
