"""``CDCD_PURE_PYTHON=1``: import the mypyc-compilable modules from source (see cdcd.accel).

Kept apart from :mod:`cdcd.accel` (which builds them) so that ``cdcd/__init__.py`` can install
the finder with nothing but the standard library's import machinery.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

#: Modules written for mypyc (dotted names), compiled one by one.
COMPILED_MODULES: tuple[str, ...] = (
    "cdcd.decoder.tuples",
    "cdcd.decoder.events",
    "cdcd.decoder.pgoutput",
    "cdcd.values.types",
    "cdcd.values.text",
    "cdcd.values.binary_base",
    "cdcd.values.binary_time",
    "cdcd.values.binary",
    "cdcd.assembler.transaction",
    "cdcd.assembler.spill",
    "cdcd.assembler.assembler",
    "cdcd.sinks.encoding",
)

PURE_ENV = "CDCD_PURE_PYTHON"


def pure_python_requested() -> bool:
    return os.environ.get(PURE_ENV, "") not in ("", "0", "false", "no")


class _SourceOnly(importlib.abc.MetaPathFinder):
    """Finds the ``.py`` source of the modules in COMPILED_MODULES, ignoring extensions."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in COMPILED_MODULES or path is None:
            return None
        leaf = fullname.rpartition(".")[2]
        for entry in path:
            source = Path(entry) / f"{leaf}.py"
            if source.is_file():
                return importlib.util.spec_from_file_location(fullname, source)
        return None


def install_source_only_finder() -> None:
    """With CDCD_PURE_PYTHON set, import the compiled modules from their Python source."""
    if pure_python_requested() and not any(isinstance(f, _SourceOnly) for f in sys.meta_path):
        sys.meta_path.insert(0, _SourceOnly())
