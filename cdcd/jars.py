"""Where the Java jars that ``scripts/setup`` fetched with Maven live.

Each set is pinned by ``scripts/maven/<name>/pom.xml`` and copied, with its dependencies, into
``$CDCD_JARS/<name>/`` (default ``~/.cache/cdcd/jars/<name>/``). Nothing is downloaded at run
or test time: a missing set is an error that says to run ``scripts/setup``.
"""

from __future__ import annotations

import os
from pathlib import Path

ENV = "CDCD_JARS"


def jars_root() -> Path:
    return Path(os.environ.get(ENV) or Path.home() / ".cache" / "cdcd" / "jars")


def jar_dir(name: str) -> Path:
    """The folder holding the jars of set ``name``; FileNotFoundError naming the fix if absent."""
    folder = jars_root() / name
    if not folder.is_dir() or not any(folder.glob("*.jar")):
        raise FileNotFoundError(
            f"no jars for {name!r} in {folder}: run scripts/setup --test "
            f"(it fetches scripts/maven/{name}/pom.xml with Maven)"
        )
    return folder


def jars(name: str) -> list[Path]:
    """Every jar of set ``name``, sorted by file name."""
    return sorted(jar_dir(name).glob("*.jar"))
