"""Which form of the mypyc-compilable modules cdcd imports: compiled, or the ``.py`` source.

:data:`COMPILED_MODULES` is the one list of them: ``setup.py`` (the package build) compiles
these and :mod:`cdcd.accel` reports on them. Beside each extension the build writes a record
(``<extension>.build.json``) with the SHA-256 of the source it was compiled from. The import
finder installed by ``cdcd/__init__.py`` (:func:`install_import_finder`) then decides, module by
module:

- ``CDCD_PURE_PYTHON=1``: the source, always;
- an extension whose record matches the ``.py`` file beside it: the extension, provided every
  other module of the group is compiled and current too (below);
- an extension whose source has changed since it was built (or that has no record): the source,
  with a :class:`StaleExtensionWarning` — a compiled module never runs code other than its
  source says;
- no extension: the source.

The modules are compiled together, as one group (:data:`COMPILED_GROUP`): one shared library
holds the code of all of them, in which they call each other's functions and read each other's
classes natively, not through Python, and each module's extension only loads its part. So a
compiled module would go on calling the compiled code of a module whose source has changed: when
any module of the group cannot run compiled (stale, no extension, no shared library), every
module of the group runs from its source, and the warning names the module that changed. Kept
apart from :mod:`cdcd.accel` and free of cdcd imports, so that ``cdcd/__init__.py`` and
``setup.py`` can load it with nothing but the standard library.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, Literal

#: Modules written for mypyc (dotted names), compiled together. The only list of them.
COMPILED_MODULES: tuple[str, ...] = (
    "cdcd.wire.framing",
    "cdcd.decoder.tuples",
    "cdcd.decoder.events",
    "cdcd.decoder.pgoutput",
    "cdcd.values.types",
    "cdcd.values.text",
    "cdcd.values.binary_base",
    "cdcd.values.binary_time",
    "cdcd.values.binary_containers",
    "cdcd.values.binary",
    "cdcd.assembler.transaction",
    "cdcd.assembler.sizes",
    "cdcd.assembler.spill",
    "cdcd.assembler.policy",
    "cdcd.assembler.buffer",
    "cdcd.assembler.memory",
    "cdcd.assembler.assembler",
    "cdcd.events.change_event",
    "cdcd.events.encoder",
    "cdcd.pipeline.feeding",
    "cdcd.decoder.copy_text",
    "cdcd.sinks.kafka.partition",
    "cdcd.sinks.kafka.recordbatch",
    "cdcd.sinks.kafka.batches",
    "cdcd.sinks.file.parquet_columns",
)

#: The mypyc group of COMPILED_MODULES: its shared library is ``cdcd/compiled__mypyc.<suffix>``.
COMPILED_GROUP = "cdcd.compiled"

#: Hand-written C extensions (dotted names; the source is ``<leaf>.c``), for what neither a
#: library nor mypyc does fast enough, one per job. They have no Python form: where one is not
#: compiled (or stale, or ``CDCD_PURE_PYTHON`` is set) :func:`c_module` gives None and its
#: caller takes the general Python path, which computes the same result (its tests compare the
#: two).
C_MODULES: tuple[str, ...] = (
    "cdcd._rowjson",  # a row event's JSON; the initial snapshot's batches of records
    "cdcd._kafkarec",  # a Kafka record into its record batch (cdcd.sinks.kafka.recordbatch)
    "cdcd._arrowcols",  # a run's columns as Arrow buffers (cdcd.sinks.file.parquet_columns)
    "cdcd._xlog",  # the replication stream split into XLogData (cdcd.wire.framing)
    "cdcd._tupledata",  # a change's TupleData (cdcd.decoder.tuples)
)
#: The header the C_MODULES share (beside them in ``cdcd/``): part of each one's source, so an
#: edit to it makes them stale too.
C_HEADER = "_cdcd.h"

PURE_ENV = "CDCD_PURE_PYTHON"
#: Appended to an extension's file name to name its build record.
RECORD_SUFFIX = ".build.json"


class StaleExtensionWarning(RuntimeWarning):
    """A compiled module was built from another source than the ``.py`` file beside it."""


def c_module(name: str) -> Any:
    """The hand-written C extension ``name`` (:data:`C_MODULES`), or None where it is not in use
    (not built, stale, ``CDCD_PURE_PYTHON``): the caller takes its Python path then, which
    computes the same. The one way cdcd loads them."""
    assert name in C_MODULES, name
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def pure_python_requested() -> bool:
    return os.environ.get(PURE_ENV, "") not in ("", "0", "false", "no")


def source_suffix(name: str) -> str:
    return ".c" if name in C_MODULES else ".py"


def source_path(name: str) -> str:
    """``cdcd.decoder.tuples`` -> ``cdcd/decoder/tuples.py`` (relative to the project root;
    ``.c`` for :data:`C_MODULES`)."""
    return "/".join(name.split(".")) + source_suffix(name)


def source_digest(path: Path) -> str:
    """The SHA-256 of a module's source: for a C module, its ``.c`` file and :data:`C_HEADER`."""
    digest = hashlib.sha256(path.read_bytes())
    if path.suffix == ".c":
        digest.update((path.parent / C_HEADER).read_bytes())
    return digest.hexdigest()


def build_record(name: str, source: Path) -> str:
    """The record the build writes beside the extension compiled from ``source``."""
    import json

    return json.dumps({"module": name, "source_sha256": source_digest(source)}) + "\n"


@dataclass(frozen=True)
class Form:
    """What the finder found for a module in one directory."""

    kind: Literal["compiled", "stale", "pure"]
    path: Path  # the extension for "compiled" and "stale", the source for "pure"
    reason: str = ""


def examine(name: str, directory: Path) -> Form | None:
    """The form of module ``name`` in ``directory``; None when neither source nor extension is
    there."""
    import json

    leaf = name.rpartition(".")[2]
    source = directory / f"{leaf}{source_suffix(name)}"
    extension = next(
        (
            directory / f"{leaf}{suffix}"
            for suffix in importlib.machinery.EXTENSION_SUFFIXES
            if (directory / f"{leaf}{suffix}").is_file()
        ),
        None,
    )
    if extension is None:
        return Form("pure", source, "no compiled extension") if source.is_file() else None
    if not source.is_file():  # only the extension installed: nothing to compare with
        return Form("compiled", extension)
    record = extension.with_name(extension.name + RECORD_SUFFIX)
    try:
        built_from = json.loads(record.read_text())["source_sha256"]
    except (OSError, ValueError, KeyError, TypeError):
        return Form("stale", extension, f"{extension.name} has no build record {record.name}")
    if built_from != source_digest(source):
        return Form("stale", extension, f"{source} changed since {extension.name} was built")
    return Form("compiled", extension)


def group_library(package_dir: Path) -> Path | None:
    """The shared library of :data:`COMPILED_GROUP` in the package directory ``package_dir``
    (the one holding ``cdcd/``'s files), or None when it is not there."""
    leaf = COMPILED_GROUP.rpartition(".")[2]
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = package_dir / f"{leaf}__mypyc{suffix}"
        if path.is_file():
            return path
    return None


def examine_group(package_dir: Path) -> str:
    """Why the group of :data:`COMPILED_MODULES` in ``package_dir`` cannot run compiled ("" when
    it can: its shared library is there, and every module's extension is current)."""
    forms = [
        (name, examine(name, package_dir.joinpath(*name.split(".")[1:-1])))
        for name in COMPILED_MODULES
    ]
    group = "the compiled modules are one group, so all run from source"
    for _, form in forms:  # the most telling first: an extension not built from its source
        if form is not None and form.kind == "stale":
            return f"{form.reason}; {group}"
    if group_library(package_dir) is None:
        leaf = COMPILED_GROUP.rpartition(".")[2]
        return f"the compiled modules' shared library ({leaf}__mypyc) is missing in {package_dir}"
    for name, form in forms:
        if form is None or form.kind != "compiled":
            return f"{name} has no compiled extension; {group}"
    return ""


def _package_dir(fullname: str, directory: Path) -> Path:
    """The directory of the ``cdcd`` package, from module ``fullname``'s ``directory``."""
    for _ in range(fullname.count(".") - 1):
        directory = directory.parent
    return directory.resolve()


#: examine_group's answer per package directory, found once per process.
_GROUP_STATE: dict[Path, str] = {}


def _group_problem(package_dir: Path) -> str:
    problem = _GROUP_STATE.get(package_dir)
    if problem is None:
        problem = _GROUP_STATE[package_dir] = examine_group(package_dir)
    return problem


#: The reasons a StaleExtensionWarning was given for (each one once).
_WARNED: set[str] = set()

#: The form each compiled-capable module was imported in, by the finder.
IMPORTED: dict[str, Form] = {}


class _Finder(importlib.abc.MetaPathFinder):
    """Imports each module of COMPILED_MODULES in the form described in the module docstring."""

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        c_module = fullname in C_MODULES
        if (fullname not in COMPILED_MODULES and not c_module) or path is None:
            return None
        for entry in path:
            form = examine(fullname, Path(entry))
            if form is None:
                continue
            if pure_python_requested() and form.kind != "pure":
                source = Path(entry) / f"{fullname.rpartition('.')[2]}{source_suffix(fullname)}"
                form = Form("pure", source, f"{PURE_ENV} is set")
            elif form.kind != "pure" and not c_module:
                problem = _group_problem(_package_dir(fullname, Path(entry)))
                if problem:  # a module of the group cannot run compiled: none of them does
                    form = Form("stale", form.path, problem)
            IMPORTED[fullname] = form
            if c_module and form.kind != "compiled":
                if form.kind == "stale":
                    warnings.warn(
                        f"cdcd: {form.reason}; not using {fullname} (same behaviour, slower). "
                        "Rebuild the compiled modules with `pip install` (`python -m cdcd.accel "
                        "build` in a checkout).",
                        StaleExtensionWarning,
                        stacklevel=2,
                    )
                raise ModuleNotFoundError(
                    f"{fullname} is not in use: {form.reason or 'not compiled'}", name=fullname
                )
            if form.kind == "compiled":
                loader = importlib.machinery.ExtensionFileLoader(fullname, str(form.path))
                return importlib.util.spec_from_file_location(fullname, form.path, loader=loader)
            if form.kind == "stale":
                if form.reason not in _WARNED:  # once for the group, not once per module
                    _WARNED.add(form.reason)
                    warnings.warn(
                        f"cdcd: {form.reason}; importing {fullname} from its source instead "
                        "(same behaviour, slower). Rebuild the compiled modules with `pip "
                        "install` (`python -m cdcd.accel build` in a checkout).",
                        StaleExtensionWarning,
                        stacklevel=2,
                    )
                form = Form("pure", Path(entry) / f"{fullname.rpartition('.')[2]}.py")
            return importlib.util.spec_from_file_location(fullname, form.path)
        return None


def install_import_finder() -> None:
    """Put the finder first on ``sys.meta_path`` (once); ``cdcd/__init__.py`` calls it."""
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
