"""cdcd.source.publication's pure parts: which tables break, and what each
``source.keyless_tables`` choice publishes (the SQL side runs in
tests/integration/test_keyless_tables.py); the config key and the publication names."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from cdcd.config import Config, load_config
from cdcd.errors import ConfigError
from cdcd.source.publication import BreakingTablesError, Leaf, Listed, Publication, plan


def _table(name: str, *identities: tuple[str, bool, bool]) -> Listed:
    """A listed table; one leaf per ``(identity, primary key, usable)`` (partitions: several)."""
    leaves = tuple(
        Leaf("public", name if len(identities) == 1 else f"{name}_{i}", ident, pk, usable)
        for i, (ident, pk, usable) in enumerate(identities)
    )
    return Listed("public", name, leaves)


KEYED = _table("t", ("default", True, True))
KEYLESS = _table("nk", ("default", False, False))
NOTHING = _table("n", ("nothing", True, False))
FULL = _table("f", ("full", False, True))
PARTED = _table("p", ("default", True, True), ("default", False, False))


def _publication(*tables: Listed, exists: bool = False, ud: bool = True) -> Publication:
    return Publication("pub", exists, not exists, ud, True, tables)


def test_breaking_leaves() -> None:
    pub = _publication(KEYED, KEYLESS, NOTHING, FULL, PARTED)
    assert [leaf.qualified for leaf in pub.breaking] == ["public.nk", "public.n", "public.p_1"]
    # a publication of inserts and truncates breaks nothing
    assert _publication(KEYLESS, ud=False).breaking == []


def test_refuse_names_every_breaking_table_and_its_fixes() -> None:
    with pytest.raises(BreakingTablesError) as caught:
        plan(_publication(KEYED, KEYLESS, PARTED), "refuse", listed=False)
    assert caught.value.tables == ["public.nk", "public.p_1"]
    assert caught.value.exit_code == 3
    message = str(caught.value)
    assert "public.nk (replica identity default without a primary key)" in message
    assert 'ALTER TABLE "public"."p_1" REPLICA IDENTITY FULL' in message
    assert "source.keyless_tables" in message
    assert plan(_publication(KEYED, FULL), "refuse", listed=False).main is None  # ALL TABLES


def test_each_choice() -> None:
    pub = _publication(KEYED, KEYLESS, FULL, PARTED)
    insert_only = plan(pub, "insert_only", listed=False)
    assert [t.name for t in insert_only.main or []] == ["t", "f"]
    assert [t.name for t in insert_only.insert_only or []] == ["nk", "p"]  # the whole table
    exclude = plan(pub, "exclude", listed=False)
    assert [t.name for t in exclude.main or []] == ["t", "f"] and exclude.insert_only is None
    assert [t.name for t in exclude.excluded] == ["nk", "p"]
    full = plan(pub, "replica_identity_full", listed=False)
    assert full.main is None and [leaf.name for leaf in full.full] == ["nk", "p_1"]
    # insert_only and exclude list the tables even when nothing breaks (new tables routed)
    assert [t.name for t in plan(_publication(KEYED), "exclude", listed=False).main or []] == ["t"]


def _config(tmp_path: Path, source: str) -> Config:
    path = tmp_path / "cdcd.yaml"
    text = "source:\n  dsn: postgresql://cdc@db/shop\n" + textwrap.indent(source, "  ")
    path.write_text(text + "sinks:\n  - type: file\n    path: out\n")
    return load_config(path, env={})


def test_config_key(tmp_path: Path) -> None:
    src = _config(tmp_path, "publication: p\n").source
    assert src.keyless_tables == "refuse" and src.publication_names() == ["p"]
    src = _config(tmp_path, "publication: p\nkeyless_tables: INSERT_ONLY\n").source
    assert src.publication_names() == ["p", "p_insert_only"]
    long = "x" * 63
    src = _config(tmp_path, f"publication: {long}\nkeyless_tables: insert_only\n").source
    assert len(src.insert_only_publication()) == 63
    with pytest.raises(ConfigError, match=r"source\.keyless_tables"):
        _config(tmp_path, "create_publication: false\nkeyless_tables: exclude\n")
    with pytest.raises(ConfigError, match="keyless_tables"):
        _config(tmp_path, "keyless_tables: skip\n")
