"""The mypyc-compiled modules (cdcd.accel) behave exactly like their pure-Python source.

scripts/setup compiles them; scripts/test runs the decoder and assembler tests once on the
compiled form and once more with CDCD_PURE_PYTHON=1. Here both forms run side by side on the
same inputs.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cdcd.decoder.tuples as tuples
from cdcd import accel

REPO = Path(__file__).resolve().parents[2]


def load_source(name: str) -> ModuleType:
    """The module's .py source, imported under another name (never the compiled form)."""
    path = REPO.joinpath(*name.split(".")).with_suffix(".py")
    spec = importlib.util.spec_from_file_location(f"_pure_{name.replace('.', '_')}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PURE_TUPLES = load_source("cdcd.decoder.tuples")


def test_the_source_form_is_not_compiled() -> None:
    assert not accel.is_compiled(PURE_TUPLES)


def test_setup_compiled_them_when_a_compiler_exists() -> None:
    """scripts/setup builds them; the test suite then runs on the compiled form."""
    if accel.pure_python_requested():
        assert accel.status() == dict.fromkeys(accel.COMPILED_MODULES, False)
        return
    if shutil.which("cc") is None or importlib.util.find_spec("mypyc") is None:
        pytest.skip("no C compiler or mypyc: cdcd runs the pure-Python form")
    assert accel.status() == dict.fromkeys(accel.COMPILED_MODULES, True)


def test_pure_python_env_imports_the_sources() -> None:
    env = os.environ | {"CDCD_PURE_PYTHON": "1"}
    out = subprocess.run(
        [sys.executable, "-c", "import cdcd.accel as a; print(sorted(a.status().values()))"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    ).stdout
    assert out.strip() == str([False] * len(accel.COMPILED_MODULES))


def column(kind: bytes, value: bytes) -> bytes:
    if kind in (b"t", b"b"):
        return kind + struct.pack("!I", len(value)) + value
    return kind


columns = st.lists(
    st.tuples(st.sampled_from([b"t", b"b", b"n", b"u"]), st.binary(max_size=40)), max_size=40
)


def outcome(module: ModuleType, buf: bytes, pos: int) -> object:
    try:
        return module.parse_tuple(buf, pos)
    except tuples.BadKind as exc:  # compiled and source classes differ: compare the fields
        return ("BadKind", exc.column, exc.ncols, exc.kind)
    except PURE_TUPLES.BadKind as exc:
        return ("BadKind", exc.column, exc.ncols, exc.kind)
    except IndexError:
        return "IndexError"


@settings(max_examples=300, deadline=None)
@given(cols=columns, prefix=st.binary(max_size=5), cut=st.integers(0, 30), junk=st.binary())
def test_parse_tuple_compiled_equals_source(
    cols: list[tuple[bytes, bytes]], prefix: bytes, cut: int, junk: bytes
) -> None:
    body = struct.pack("!H", len(cols)) + b"".join(column(k, v) for k, v in cols)
    for buf in (prefix + body, prefix + body + junk, (prefix + body)[: len(prefix) + cut]):
        assert outcome(tuples, buf, len(prefix)) == outcome(PURE_TUPLES, buf, len(prefix))
    kinds, values, end = PURE_TUPLES.parse_tuple(prefix + body, len(prefix))
    assert end == len(prefix + body)
    assert kinds == b"".join(k for k, _ in cols)
    assert values == tuple(v if k in (b"t", b"b") else None for k, v in cols)
    # build_tuple is the inverse, in both forms
    assert tuples.build_tuple(kinds, values) == body == PURE_TUPLES.build_tuple(kinds, values)


def test_build_tuple_refuses_a_text_column_without_value() -> None:
    for module in (tuples, PURE_TUPLES):
        with pytest.raises(ValueError, match="column 2"):
            module.build_tuple(b"nt", (None, None))
        with pytest.raises(ValueError, match="2 kinds for 1 values"):
            module.build_tuple(b"nt", (None,))


def test_unknown_kind_is_reported_with_its_column() -> None:
    buf = struct.pack("!H", 3) + column(b"t", b"1") + b"n" + b"x"
    for module in (tuples, PURE_TUPLES):
        with pytest.raises(module.BadKind) as info:
            module.parse_tuple(buf, 0)
        assert (info.value.column, info.value.ncols, info.value.kind) == (2, 3, ord("x"))
