"""Prints constraints.txt: the installed version of every package ``cdcd[test]`` needs.

pyproject.toml keeps ranges (what cdcd needs as a library); constraints.txt pins the set this
environment was tested with, which scripts/setup and the Dockerfile install (``pip install -c
constraints.txt``). Walks the requirements of cdcd and its ``test`` extra through the installed
packages' metadata (extras and environment markers included), so packages installed beside
them by hand are left out, and so is cdcd itself. Refresh after changing the environment:

    .venv/bin/python scripts/constraints.py > constraints.txt
"""

from __future__ import annotations

import sys
from importlib import metadata

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name


def closure(root: str, extras: set[str]) -> dict[str, str]:
    """Canonical name -> installed version of everything ``root[extras]`` needs."""
    found: dict[str, str] = {}
    todo: list[tuple[str, set[str]]] = [(root, extras)]
    seen: set[tuple[str, str]] = set()
    while todo:
        name, wanted = todo.pop()
        dist = metadata.distribution(name)
        for extra in {"", *wanted}:
            key = (canonicalize_name(name), extra)
            if key in seen:
                continue
            seen.add(key)
            for line in dist.requires or []:
                req = Requirement(line)
                env = {"extra": extra}
                if req.marker is not None and not req.marker.evaluate(env):
                    continue
                if req.marker is None and extra:  # unconditional ones came with extra ""
                    continue
                dep = canonicalize_name(req.name)
                try:
                    found[dep] = metadata.version(dep)
                except metadata.PackageNotFoundError:
                    sys.exit(f"{req} (needed by {name}) is not installed: install it first")
                todo.append((dep, set(req.extras)))
    found.pop(canonicalize_name(root), None)
    return found


def main() -> None:
    pins = closure("cdcd", {"test"})
    print("# The versions cdcd[test] was tested with; refresh: see scripts/constraints.py")
    for name in sorted(pins):
        print(f"{name}=={pins[name]}")


if __name__ == "__main__":
    main()
