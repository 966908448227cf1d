"""The mypyc-compiled modules (cdcd.accel) behave exactly like their pure-Python source, and a
compiled module whose source changed is never used.

The package build (setup.py, run by scripts/setup's ``pip install -e``) compiles them;
the suite runs the decoder and assembler tests once on the compiled form and once more with
CDCD_PURE_PYTHON=1 (tests/integration/test_pure_python_pass.py). Here both forms run side by side on the same inputs, and copies of the
package show the stale-extension fallback. tests/integration/test_package_build.py builds a
wheel from scratch.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import shutil
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cdcd.decoder.tuples as tuples
from cdcd import accel
from cdcd._purepy import C_HEADER, build_record, c_module, examine

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
    """scripts/setup's editable install builds them; the test suite then runs on them."""
    if accel.pure_python_requested():
        assert accel.status() == dict.fromkeys(accel.ACCELERATED_MODULES, False)
        return
    if shutil.which("cc") is None or importlib.util.find_spec("mypyc") is None:
        pytest.skip("no C compiler or mypyc: cdcd runs the pure-Python form")
    assert accel.status() == dict.fromkeys(accel.ACCELERATED_MODULES, True)


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
    assert out.strip() == str([False] * len(accel.ACCELERATED_MODULES))


def package_copy(tmp_path: Path) -> Path:
    """A copy of the cdcd package (with its compiled files, if any) under ``tmp_path``."""
    shutil.copytree(REPO / "cdcd", tmp_path / "cdcd", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def run_in(root: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``python args...`` importing cdcd from ``root``, warnings shown."""
    return subprocess.run(
        [sys.executable, "-W", "default", *args],
        cwd=root,
        env={k: v for k, v in os.environ.items() if k != accel.PURE_ENV}
        | {"PYTHONPATH": str(root)}
        | env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def status_lines(stdout: str) -> dict[str, str]:
    return dict(line.split(": ", 1) for line in stdout.splitlines())


def test_status_names_each_module_and_its_form() -> None:
    done = run_in(REPO, "-m", "cdcd.accel", "status")
    assert done.returncode == 0, done.stderr
    lines = status_lines(done.stdout)
    assert list(lines) == list(accel.ACCELERATED_MODULES)
    # what the finder makes of the files (this process may run with CDCD_PURE_PYTHON=1)
    kinds = {}
    for name in accel.ACCELERATED_MODULES:
        form = examine(name, REPO.joinpath(*name.split(".")).parent)
        assert form is not None, name
        kinds[name] = form.kind
    for name, kind in kinds.items():
        expected = {"compiled": "compiled (", "stale": "stale, ", "pure": "pure Python"}[kind]
        if name in accel.C_MODULES and kind != "compiled":
            expected = "not in use, the general Python path runs"
        assert lines[name].startswith(expected), lines[name]
    strict = run_in(REPO, "-m", "cdcd.accel", "status", "--strict")
    assert strict.returncode == (0 if set(kinds.values()) == {"compiled"} else 1), strict.stderr
    pure = run_in(REPO, "-m", "cdcd.accel", "status", "--strict", CDCD_PURE_PYTHON="1")
    assert pure.returncode == 1 and "not every module is compiled" in pure.stderr
    assert set(status_lines(pure.stdout).values()) == {
        "pure Python (CDCD_PURE_PYTHON is set)",
        "not in use, the general Python path runs (CDCD_PURE_PYTHON is set)",
    }


@pytest.mark.parametrize("record", ["missing", "other source"])
def test_a_c_module_not_built_from_its_source_is_not_used(tmp_path: Path, record: str) -> None:
    """A stale hand-written C module is not imported at all: its callers' Python path runs."""
    root = package_copy(tmp_path)
    line = stale_status(root, "cdcd._rowjson", record)
    assert line.startswith("not in use, the general Python path runs ("), line
    probe = (
        "import orjson; from cdcd.values import types as t; "
        "from cdcd.decoder.events import Column, Relation, TupleData; "
        "rel = Relation(None, 1, 'public', 't', 'd', (Column(1, 'id', 23, -1),)); "
        "d = t.RowDecoder(rel, t.TypeRegistry(), 'json'); "
        "print(t._c_row_json, d.row_json(TupleData(b't', (b'7',))), "
        "orjson.dumps(d.decode(TupleData(b't', (b'7',)))))"
    )
    done = run_in(root, "-c", probe)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["None", "None", "b'{\"id\":7}'"]
    if record == "other source":
        assert "StaleExtensionWarning" in done.stderr


def stale_status(root: Path, name: str, record: str) -> str:
    """Module ``name``'s line of ``accel status --strict`` in ``root`` once its extension is a
    fake whose build record is ``missing`` or names ``other source``; the run warns."""
    *package, leaf = name.split(".")
    ext = fake_extension(root.joinpath(*package), leaf)
    record_path = ext.with_name(ext.name + accel.RECORD_SUFFIX)
    record_path.unlink(missing_ok=True)
    if record == "other source":
        record_path.write_text(f'{{"module": "{name}", "source_sha256": "00"}}')
    done = run_in(root, "-m", "cdcd.accel", "status", "--strict")
    assert done.returncode == 1
    assert "StaleExtensionWarning" in done.stderr
    return status_lines(done.stdout)[name]


def fake_extension(directory: Path, leaf: str) -> Path:
    """An extension file that cannot be loaded: proves the finder never tried."""
    for old in directory.glob(f"{leaf}.*.so"):
        old.unlink()
    path = directory / f"{leaf}{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    path.write_bytes(b"not a shared library")
    return path


@pytest.mark.parametrize("record", ["missing", "other source"])
def test_an_extension_not_built_from_this_source_is_ignored(tmp_path: Path, record: str) -> None:
    root = package_copy(tmp_path)
    line = stale_status(root, "cdcd.decoder.tuples", record)
    assert line.startswith("stale, running the source"), line
    reason = "has no build record" if record == "missing" else "tuples.py changed since"
    assert reason in line
    if all(accel.status().values()):  # a compiled group: its other modules run their sources
        status = status_lines(run_in(root, "-m", "cdcd.accel", "status").stdout)
        others = [status[n] for n in accel.COMPILED_MODULES if n != "cdcd.decoder.tuples"]
        assert all(
            line.startswith("stale, running the source") and reason in line for line in others
        )


def test_a_c_module_is_stale_when_the_shared_header_changed(tmp_path: Path) -> None:
    """A C module's build record covers its ``.c`` file and the header the C modules share."""
    for name in ("_xlog.c", C_HEADER):
        shutil.copy2(REPO / "cdcd" / name, tmp_path / name)
    extension = tmp_path / f"_xlog{importlib.machinery.EXTENSION_SUFFIXES[0]}"
    extension.write_bytes(b"")  # examine() only looks at the files
    record = extension.with_name(extension.name + accel.RECORD_SUFFIX)
    record.write_text(build_record("cdcd._xlog", tmp_path / "_xlog.c"))
    form = examine("cdcd._xlog", tmp_path)
    assert form is not None and form.kind == "compiled"
    with (tmp_path / C_HEADER).open("a") as header:
        header.write("/* edited */\n")
    form = examine("cdcd._xlog", tmp_path)
    assert form is not None and form.kind == "stale", form
    assert "_xlog.c changed since" in form.reason


def test_an_edited_source_runs_instead_of_its_compiled_module(tmp_path: Path) -> None:
    """The developer's case: a compiled module's source edited after the build. The modules are
    compiled as one group, calling each other natively, so the others run from source too:
    otherwise the compiled decoder would go on calling the old compiled parse_tuple."""
    if not accel.status()["cdcd.decoder.tuples"]:
        pytest.skip("cdcd.decoder.tuples is not compiled here")
    root = package_copy(tmp_path)
    source = root / "cdcd" / "decoder" / "tuples.py"
    source.write_text(
        source.read_text().replace(
            "    fast = _C_PARSE_TUPLE\n",
            "    return b'edited', *parse_tuple_python(buf, pos)[1:]\n    fast = _C_PARSE_TUPLE\n",
        )
    )
    probe = (
        "import cdcd.decoder.tuples as t, cdcd.decoder.pgoutput as p, cdcd.decoder.events as e; "
    )
    probe += "msg = b'I' + bytes([0, 0, 0, 1]) + b'N' + bytes([0, 1]) + b'n'; "
    probe += "print(p.PgOutputDecoder(1).decode(msg, 0).new.kinds, t.__file__, e.__file__)"
    done = run_in(root, "-c", probe)
    assert done.returncode == 0, done.stderr
    kinds, tuples_file, events_file = done.stdout.split()
    assert kinds == "b'edited'"  # the decoder calls the edited source
    assert tuples_file == str(source)
    assert events_file.endswith(".py")  # the whole group runs from source
    assert done.stderr.count("StaleExtensionWarning") == 1, done.stderr
    assert f"{source} changed since tuples." in done.stderr
    status = status_lines(run_in(root, "-m", "cdcd.accel", "status").stdout)
    assert status["cdcd.decoder.tuples"].startswith("stale, running the source")
    assert status["cdcd.decoder.events"].startswith("stale, running the source")
    assert "one group, so all run from source" in status["cdcd.decoder.events"]
    assert status["cdcd._rowjson"].startswith("compiled (")  # hand-written C: on its own


def test_the_group_without_its_shared_library_runs_from_source(tmp_path: Path) -> None:
    if not accel.status()["cdcd.decoder.tuples"]:
        pytest.skip("cdcd.decoder.tuples is not compiled here")
    root = package_copy(tmp_path)
    library = accel.group_library(root / "cdcd")
    assert library is not None
    library.unlink()
    done = run_in(root, "-m", "cdcd.accel", "status", "--strict")
    assert done.returncode == 1
    lines = status_lines(done.stdout)
    for name in accel.COMPILED_MODULES:
        assert lines[name].startswith("stale, running the source"), lines[name]
        assert "shared library (compiled__mypyc) is missing" in lines[name]


def column(kind: bytes, value: bytes) -> bytes:
    if kind in (b"t", b"b"):
        return kind + struct.pack("!I", len(value)) + value
    return kind


columns = st.lists(
    st.tuples(st.sampled_from([b"t", b"b", b"n", b"u"]), st.binary(max_size=40)), max_size=40
)


def outcome(parse: Callable[[bytes, int], object], buf: bytes, pos: int) -> object:
    try:
        return parse(buf, pos)
    except tuples.BadKind as exc:  # compiled and source classes differ: compare the fields
        return ("BadKind", exc.column, exc.ncols, exc.kind)
    except PURE_TUPLES.BadKind as exc:
        return ("BadKind", exc.column, exc.ncols, exc.kind)
    except IndexError:
        return "IndexError"


_TUPLEDATA = c_module("cdcd._tupledata")
C_PARSE_TUPLE = None if _TUPLEDATA is None else _TUPLEDATA.parse_tuple


@settings(max_examples=300, deadline=None)
@given(
    cols=columns,
    prefix=st.binary(max_size=5),
    cut=st.integers(0, 30),
    junk=st.binary(),
    bad=st.sampled_from([b"", b"x", b"\x00", b"t\xff\xff\xff\xff"]),
)
def test_parse_tuple_compiled_and_c_equal_source(
    cols: list[tuple[bytes, bytes]], prefix: bytes, cut: int, junk: bytes, bad: bytes
) -> None:
    """The source's Python loop is the reference: the compiled module (which takes the C
    function where it is in use) gives the same result or error on any input, and the C
    function the same result, or None exactly where the loop raises or runs past the end."""
    body = struct.pack("!H", len(cols) + (1 if bad else 0)) + b"".join(
        column(k, v) for k, v in cols
    )
    inputs = [prefix + body, prefix + body + junk, (prefix + body)[: len(prefix) + cut]]
    if bad:  # an unknown kind, or a length running past the end, after the good columns
        inputs.append(prefix + body + bad + junk)
    for buf in inputs:
        pos = len(prefix)
        expected = outcome(PURE_TUPLES.parse_tuple_python, buf, pos)
        assert outcome(tuples.parse_tuple, buf, pos) == expected
        assert outcome(tuples.parse_tuple_python, buf, pos) == expected
        if C_PARSE_TUPLE is not None:
            parsed = isinstance(expected, tuple) and isinstance(expected[0], bytes)
            fine = parsed and expected[2] <= len(buf)  # type: ignore[index]
            assert C_PARSE_TUPLE(buf, pos) == (expected if fine else None)
    if bad:
        return
    kinds, values, end = PURE_TUPLES.parse_tuple_python(prefix + body, len(prefix))
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
    if C_PARSE_TUPLE is not None:
        assert C_PARSE_TUPLE(buf, 0) is None  # declined: the Python loop says what is wrong
    for module in (tuples, PURE_TUPLES):
        with pytest.raises(module.BadKind) as info:
            module.parse_tuple(buf, 0)
        assert (info.value.column, info.value.ncols, info.value.kind) == (2, 3, ord("x"))


def test_clean_removes_the_compiled_files_and_their_records(tmp_path: Path) -> None:
    root = package_copy(tmp_path)
    fake_extension(root / "cdcd" / "decoder", "tuples")
    done = run_in(root, "-m", "cdcd.accel", "clean")
    assert done.returncode == 0, done.stderr
    assert str(root / "cdcd" / "decoder" / "tuples") in done.stdout
    left = [p for p in (root / "cdcd").rglob("*") if p.suffix == ".so" or p.name.endswith(".json")]
    assert left == []
    status = status_lines(run_in(root, "-m", "cdcd.accel", "status").stdout)
    assert set(status.values()) == {
        "pure Python (no compiled extension)",
        "not in use, the general Python path runs (no compiled extension)",
    }


def test_status_of_the_imported_modules_imports_nothing() -> None:
    """The daemon's "streaming" log line asks about the modules in use only: asking must not
    import the others (the Kafka ones would import aiokafka into a file-sink process)."""
    code = (
        "import sys; from cdcd import accel; import cdcd.decoder.tuples; "
        "found = accel.status(imported_only=True); "
        "print(sorted(found), 'cdcd.sinks.kafka.batches' in sys.modules, 'aiokafka' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO
    ).stdout.split("]")
    assert "'cdcd.decoder.tuples'" in out[0]
    assert "cdcd.sinks.kafka.batches" not in out[0]
    assert out[1].split() == ["False", "False"]
