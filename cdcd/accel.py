"""Optional compiled fast paths: a few innermost-loop modules compiled with mypyc.

:data:`COMPILED_MODULES` are plain, fully typed Python modules. The package build compiles them
(``setup.py``: ``pip install .`` and ``pip install -e .`` do it where a C compiler and the
Python headers exist; mypy is a build requirement), all together as one group, in which they call
each other natively (calls through Python between separately compiled modules cost about a
third of the decoding and event building). Keep them to plain constructs: a
``while view: view = view[os.write(fd, view):]`` loop over a ``memoryview`` wrote every buffer
twice once compiled (mypy 2.4), which the spill tests caught. When a module is not compiled the
very same source runs as Python: the compiled form is only a speed-up, never a different
behaviour, and the tests run both ways.

A compiled module whose source changed after it was built is not used, nor are the other
modules of the group: cdcd imports their sources and warns (:mod:`cdcd._purepy`).
``CDCD_PURE_PYTHON=1`` makes cdcd import the ``.py`` sources even where compiled modules
exist. ``python -m cdcd.accel status`` says which form each module has in this process; in a
checkout ``build`` recompiles in place and ``clean`` goes back to pure Python.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from cdcd._purepy import (
    C_MODULES,
    COMPILED_MODULES,
    IMPORTED,
    PURE_ENV,
    RECORD_SUFFIX,
    Form,
    StaleExtensionWarning,
    examine,
    group_library,
    pure_python_requested,
)

__all__ = [
    "ACCELERATED_MODULES",
    "COMPILED_MODULES",
    "C_MODULES",
    "PURE_ENV",
    "RECORD_SUFFIX",
    "StaleExtensionWarning",
    "build",
    "clean",
    "forms",
    "group_library",
    "pure_python_requested",
    "status",
]

_PACKAGE_DIR = Path(__file__).resolve().parent

#: Every module the build compiles: the mypyc ones, then the hand-written C ones.
ACCELERATED_MODULES: tuple[str, ...] = (*COMPILED_MODULES, *C_MODULES)


def is_compiled(module: ModuleType) -> bool:
    return not str(getattr(module, "__file__", "")).endswith(".py")


def forms(*, imported_only: bool = False) -> dict[str, Form]:
    """Module name -> the form this process imported it in (importing it if needed;
    ``imported_only``: only the modules this process has imported, importing none)."""
    found: dict[str, Form] = {}
    for name in ACCELERATED_MODULES:
        if imported_only and name not in sys.modules:
            continue
        try:
            module = importlib.import_module(name)
        except ImportError:  # a C module not in use: the finder recorded why
            leaf = _PACKAGE_DIR.joinpath(*name.split(".")[1:])
            source = leaf.with_name(leaf.name + ".c")
            found[name] = IMPORTED.get(name) or Form("pure", source, "not built")
            continue
        form = IMPORTED.get(name)
        if form is None:  # imported before the finder was installed
            form = examine(name, Path(str(module.__file__)).parent)
        if form is None or (form.kind == "compiled") != is_compiled(module):
            compiled = is_compiled(module)
            form = Form("compiled" if compiled else "pure", Path(str(module.__file__)))
        found[name] = form
    return found


def status(*, imported_only: bool = False) -> dict[str, bool]:
    """Module name -> whether this process runs its compiled form (``imported_only``: of the
    modules it has imported: asking imports nothing, e.g. no Kafka client for a file sink)."""
    return {
        name: form.kind == "compiled" for name, form in forms(imported_only=imported_only).items()
    }


def describe(form: Form, c_module: bool = False) -> str:
    if form.kind == "compiled":
        return f"compiled ({form.path.name})"
    if c_module:  # a C module has no Python form: its callers' general path runs
        return f"not in use, the general Python path runs ({form.reason or 'not built'})"
    if form.kind == "stale":
        return f"stale, running the source ({form.reason})"
    return f"pure Python ({form.reason})" if form.reason else "pure Python"


def checkout_root() -> Path | None:
    """The project directory when cdcd runs from a checkout (an editable install), else None."""
    root = _PACKAGE_DIR.parent
    return root if (root / "setup.py").is_file() and (root / "pyproject.toml").is_file() else None


def build() -> None:
    """Recompile the modules in a checkout: reinstall it editable (``setup.py`` compiles them in
    place). Raises RuntimeError outside a checkout, CalledProcessError when pip fails."""
    root = checkout_root()
    if root is None:
        raise RuntimeError(
            f"{_PACKAGE_DIR} is an installed copy, not a checkout: reinstall the cdcd package "
            "(`pip install --force-reinstall --no-deps cdcd...`) to rebuild its compiled modules"
        )
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "-e", str(root)], check=True
    )


def clean() -> list[Path]:
    """Remove the compiled extensions (and their build records) in the package directory."""
    removed = []
    for name in ACCELERATED_MODULES:
        source = _PACKAGE_DIR.parent.joinpath(*name.split(".")).with_suffix(".py")
        for path in source.parent.iterdir():
            stem = path.name.partition(".")[0]
            if stem in (source.stem, f"{source.stem}__mypyc") and (
                path.suffix in (".so", ".pyd") or path.name.endswith(RECORD_SUFFIX)
            ):
                path.unlink()
                removed.append(path)
    library = group_library(_PACKAGE_DIR)
    if library is not None:
        library.unlink()
        removed.append(library)
    return removed


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    command = args[0] if args else "status"
    if command == "build":
        try:
            build()
        except (RuntimeError, subprocess.CalledProcessError, OSError) as exc:
            print(f"cdcd.accel: {exc}", file=sys.stderr)
            return 1
        return main(["status"])
    if command == "clean":
        for path in clean():
            print(f"removed {path}")
        return 0
    if command == "status" and set(args[1:]) <= {"--strict"}:
        found = forms()
        for name, form in found.items():
            print(f"{name}: {describe(form, name in C_MODULES)}")
        if "--strict" in args and any(form.kind != "compiled" for form in found.values()):
            print("cdcd.accel: not every module is compiled", file=sys.stderr)
            return 1
        return 0
    print("usage: python -m cdcd.accel [status [--strict]|build|clean]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
