"""Optional compiled fast paths: a few innermost-loop modules compiled with mypyc.

:data:`COMPILED_MODULES` are plain, fully typed Python modules, compiled one at a time (what
they import from other cdcd modules is called through Python). Keep them to plain constructs:
a ``while view: view = view[os.write(fd, view):]`` loop over a ``memoryview`` wrote every
buffer twice once compiled (mypy 2.4), which the spill tests caught. ``python -m cdcd.accel build`` compiles them in place with
mypyc (it needs mypy, a C compiler and the Python headers; ``scripts/setup`` and the
Dockerfile run it); Python then imports the extension module instead of the ``.py`` file. When
a module is not compiled the very same source runs as Python: the compiled form is only a
speed-up, never a different behaviour, and the tests run both ways.

``CDCD_PURE_PYTHON=1`` makes cdcd import the ``.py`` sources even where compiled modules
exist (:func:`install_source_only_finder`, called from ``cdcd/__init__.py``).
:func:`status` says which form each module has in this process.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from cdcd._purepy import COMPILED_MODULES, install_source_only_finder, pure_python_requested

__all__ = [
    "COMPILED_MODULES",
    "build",
    "clean",
    "install_source_only_finder",
    "pure_python_requested",
    "status",
]

_PACKAGE_DIR = Path(__file__).resolve().parent


def is_compiled(module: ModuleType) -> bool:
    return not str(getattr(module, "__file__", "")).endswith(".py")


def status() -> dict[str, bool]:
    """Module name -> whether this process runs its compiled form."""
    return {name: is_compiled(importlib.import_module(name)) for name in COMPILED_MODULES}


def _module_path(name: str) -> Path:
    parts = name.split(".")
    assert parts[0] == "cdcd", name
    return _PACKAGE_DIR.joinpath(*parts[1:]).with_suffix(".py")


def build(names: Sequence[str] = COMPILED_MODULES) -> list[Path]:
    """Compile ``names`` with mypyc next to their sources; return the extension files.

    Each module is compiled alone in a scratch copy of the package (so no shared runtime
    library lands in site-packages) and its extensions are copied beside the ``.py`` file. Raises
    CalledProcessError when mypyc fails (no compiler, no headers).
    """
    import shutil
    import subprocess
    import tempfile

    built: list[Path] = []
    for name in names:
        source = _module_path(name)
        with tempfile.TemporaryDirectory(prefix="cdcd-mypyc-") as scratch:
            root = Path(scratch)
            # the whole package, for type checking; only ``name`` is compiled
            shutil.copytree(
                _PACKAGE_DIR, root / "cdcd", ignore=shutil.ignore_patterns("*.so", "__pycache__")
            )
            target = root.joinpath(*name.split(".")).with_suffix(".py")
            subprocess.run(
                [sys.executable, "-m", "mypyc", str(target.relative_to(root))],
                cwd=root,
                check=True,
                stdout=subprocess.DEVNULL,
            )
            for ext in target.parent.iterdir():
                if ext.suffix in (".so", ".pyd") and ext.name.startswith(target.stem):
                    dest = source.with_name(ext.name)
                    # a new file renamed into place: a process that has the old one loaded
                    # keeps its mapping (overwriting a loaded library in place crashes it)
                    tmp = dest.with_name(f".{dest.name}.tmp")
                    shutil.copyfile(ext, tmp)
                    os.replace(tmp, dest)
                    built.append(dest)
    return built


def clean(names: Sequence[str] = COMPILED_MODULES) -> list[Path]:
    """Remove compiled extensions of ``names`` (back to pure Python)."""
    removed = []
    for name in names:
        source = _module_path(name)
        for ext in source.parent.iterdir():
            if ext.suffix in (".so", ".pyd") and ext.name.startswith(source.stem):
                ext.unlink()
                removed.append(ext)
    return removed


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    command = args[0] if args else "status"
    if command == "build":
        import subprocess

        try:
            for path in build():
                print(f"compiled {path}")
        except (subprocess.CalledProcessError, OSError) as exc:
            print(
                f"cdcd.accel: could not compile {', '.join(COMPILED_MODULES)} with mypyc "
                f"({exc}); cdcd runs them as pure Python (slower, same behaviour)",
                file=sys.stderr,
            )
            return 1
        return 0
    if command == "clean":
        for path in clean():
            print(f"removed {path}")
        return 0
    if command == "status":
        for name, compiled in status().items():
            print(f"{name}: {'compiled' if compiled else 'pure Python'}")
        return 0
    print("usage: python -m cdcd.accel [build|clean|status]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
