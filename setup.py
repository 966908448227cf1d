"""Build hook: compiles cdcd's per-row modules with mypyc where a C compiler exists.

All metadata lives in pyproject.toml; this file only adds the compiled extensions, the way mypy
and black ship mypyc builds (``mypyc.build.mypycify``, mypy in the build requirements). The
module list is ``COMPILED_MODULES`` in ``cdcd/_purepy.py``, read here without importing cdcd;
``C_MODULES`` there are hand-written C extensions built the same way (same build records).
The modules are compiled together, as one group (``COMPILED_GROUP``: one shared library in which
they call each other natively, and a small extension per module). Beside each extension goes a
build record (``<extension>.build.json``) holding the SHA-256 of the source it was compiled
from; at import, cdcd uses the group only when every record matches the ``.py`` file next to it,
and otherwise imports every module of the group from its source (see docs/development.md).

Without a C compiler, the Python headers or mypy, or when mypyc fails, the build says so and
installs the same modules as pure Python (same behaviour, slower). ``CDCD_PURE_PYTHON=1`` at
build time skips the compilation.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import sys
import sysconfig
import traceback
from pathlib import Path
from typing import Any

from setuptools import Distribution, Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def _purepy() -> Any:
    """cdcd/_purepy.py loaded from its file (standard library only; cdcd is not importable here)."""
    spec = importlib.util.spec_from_file_location("_cdcd_purepy", ROOT / "cdcd" / "_purepy.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


PUREPY = _purepy()


def _say(message: str) -> None:
    print(f"cdcd build: {message}", file=sys.stderr, flush=True)


def _why_not_compiled() -> str | None:
    """What is missing to compile, or None when a compiler, the headers and mypyc are there."""
    if PUREPY.pure_python_requested():
        return f"{PUREPY.PURE_ENV} is set"
    if importlib.util.find_spec("mypyc") is None:
        return "mypy (mypyc) is not installed in the build environment"
    compiler = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc")[0]
    if shutil.which(compiler) is None:
        return f"no C compiler ({compiler!r} not found: install gcc, or set CC)"
    include = sysconfig.get_paths()["include"]
    if not os.path.isfile(os.path.join(include, "Python.h")):
        return f"no Python headers (no Python.h in {include}: install python3-dev)"
    return None


class BuildMypyc(build_ext):
    """build_ext that generates the mypyc extensions when the build needs them (not when
    setup.py is read, so the metadata steps stay fast) and falls back to pure Python when they
    cannot be built."""

    def finalize_options(self) -> None:
        self.not_compiled = _why_not_compiled()
        # the sources as mypyc reads them: one edited during the build must not be recorded
        self.records = {
            name: PUREPY.build_record(name, ROOT / PUREPY.source_path(name))
            for name in (*PUREPY.COMPILED_MODULES, *PUREPY.C_MODULES)
        }
        if self.not_compiled is None:
            try:
                self.distribution.ext_modules = self._mypycify()
            except (Exception, SystemExit):  # mypy found an error: the source still works
                traceback.print_exc()
                self.not_compiled = "mypyc failed (see above)"
        super().finalize_options()

    def run(self) -> None:
        if self.not_compiled is None:
            try:
                super().run()  # builds in build_lib, then copies into the tree if inplace
                self._write_build_records()
                return
            except Exception:  # the C compiler failed: the source still works
                traceback.print_exc()
                self.not_compiled = "compiling the C code failed (see above)"
                self._remove_outputs()
        self.extensions = []
        _say(
            f"{self.not_compiled}; installing {', '.join(PUREPY.COMPILED_MODULES)} as pure "
            f"Python and leaving out {', '.join(PUREPY.C_MODULES)} (same behaviour, slower; "
            "`python -m cdcd.accel status` shows the form in use)"
        )

    def _mypycify(self) -> list[Extension]:
        from mypyc.build import mypycify

        if Path.cwd().resolve() != ROOT:  # mypy reads its options from ROOT/pyproject.toml
            os.chdir(ROOT)
        # one group: a shared library (cdcd/compiled__mypyc) holding every module's code, in
        # which the modules call each other's functions and read each other's classes natively,
        # and a small extension per module that loads it
        paths = [
            "--no-warn-unused-configs",
            *(PUREPY.source_path(name) for name in PUREPY.COMPILED_MODULES),
        ]
        # MYPYC_OPT_LEVEL (as in mypy's own setup.py): the C compiler's -O, 3 unless set; the
        # package build test sets 0, which compiles the same modules in a fraction of the time
        extensions: list[Extension] = mypycify(
            paths,
            opt_level=os.environ.get("MYPYC_OPT_LEVEL", "3"),
            group_name=PUREPY.COMPILED_GROUP,
        )
        header = f"cdcd/{PUREPY.C_HEADER}"
        for name in PUREPY.C_MODULES:  # hand-written C: compiled as it is
            extensions.append(
                Extension(name, [PUREPY.source_path(name)], include_dirs=["cdcd"], depends=[header])
            )
        return extensions

    def _built(self, name: str, inplace: bool) -> Path:
        self.inplace, saved = inplace, self.inplace
        try:
            return Path(self.get_ext_fullpath(name))
        finally:
            self.inplace = saved

    def _write_build_records(self) -> None:
        for name, record in self.records.items():
            places = (False, True) if self.inplace else (False,)  # inplace: editable install
            for inplace in places:
                path = self._built(name, inplace)
                path.with_name(path.name + PUREPY.RECORD_SUFFIX).write_text(record)

    def _remove_outputs(self) -> None:
        for ext in self.extensions:
            for inplace in (False, True) if self.inplace else (False,):
                path = self._built(ext.name, inplace)
                path.unlink(missing_ok=True)
                path.with_name(path.name + PUREPY.RECORD_SUFFIX).unlink(missing_ok=True)

    def get_outputs(self) -> list[str]:
        if not self.extensions:
            return []
        records = []
        for name in (*PUREPY.COMPILED_MODULES, *PUREPY.C_MODULES):
            path = self._built(name, bool(self.inplace))
            records.append(str(path.with_name(path.name + PUREPY.RECORD_SUFFIX)))
        return [*super().get_outputs(), *records]


class BinaryDistribution(Distribution):
    """Extensions are built by BuildMypyc.run, so the wheel is platform-specific."""

    def has_ext_modules(self) -> bool:
        return True


setup(cmdclass={"build_ext": BuildMypyc}, distclass=BinaryDistribution)
