"""The Dockerfile's structure (no docker engine runs where the tests run, so the image itself is
not built here; CI exercises the same install commands through scripts/setup).

Checked: multi-stage on python:3.11-slim, the runtime stage runs as a numeric non-root user,
has a HEALTHCHECK on /healthz, EXPOSEs 8080, listens on 0.0.0.0:8080, finds its config through
CDCD_CONFIG at the documented path, runs ``cdcd`` as PID 1 in exec form; its pip commands are
scripts/setup's (the project installed non-editable instead of ``-e``); .dockerignore keeps
the build context to what ``pip install .`` needs, and that is enough to build the project.
"""

from __future__ import annotations

import json
import re
import shlex
import tomllib
from dataclasses import dataclass, field

import pytest

from tests.e2e import REPO

DOCKERFILE = REPO / "Dockerfile"
SETUP = REPO / "scripts" / "setup"
#: where the build stage lists pyproject.toml's dependencies, to install them first
DEPENDENCIES = "/tmp/dependencies.txt"


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[tuple[str, str]] = field(default_factory=list)

    def all(self, keyword: str) -> list[str]:
        return [args for kw, args in self.instructions if kw == keyword]

    def last(self, keyword: str) -> str | None:
        found = self.all(keyword)
        return found[-1] if found else None


def parse_dockerfile(text: str) -> tuple[dict[str, str], list[Stage]]:
    """Global ARG defaults and the stages, with line continuations joined and comments dropped."""
    logical: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):  # a comment inside a continued instruction
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    assert not pending, "the Dockerfile ends inside a line continuation"
    args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in logical:
        keyword, _, rest = line.partition(" ")
        keyword = keyword.upper()
        rest = rest.strip()
        if keyword == "FROM":
            words = rest.split()
            base = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m[1], m[0]), words[0])
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else None
            stages.append(Stage(base, name))
        elif keyword == "ARG" and not stages:
            key, _, default = rest.partition("=")
            args[key] = default
        else:
            assert stages, f"{keyword} before the first FROM"
            stages[-1].instructions.append((keyword, rest))
    return args, stages


def env_of(stage: Stage) -> dict[str, str]:
    env: dict[str, str] = {}
    for args in stage.all("ENV"):
        for item in shlex.split(args):
            key, sep, value = item.partition("=")
            assert sep, f"ENV {args!r}: use the KEY=value form"
            env[key] = value
    return env


def pip_commands(shell: str) -> list[str]:
    """The ``python -m pip install ...`` commands in a shell text, normalised spacing."""
    return [
        " ".join(m.group(0).split()) for m in re.finditer(r"python -m pip install[^&;\n]*", shell)
    ]


@pytest.fixture(scope="module")
def stages() -> list[Stage]:
    return parse_dockerfile(DOCKERFILE.read_text())[1]


@pytest.fixture(scope="module")
def runtime(stages: list[Stage]) -> Stage:
    return stages[-1]


def test_multi_stage_on_python_311_slim(stages: list[Stage]) -> None:
    assert len(stages) >= 2
    assert all(stage.base == "python:3.11-slim" for stage in stages), [s.base for s in stages]
    build = stages[0]
    assert build.name, "the build stage needs a name for COPY --from"
    copies = stages[-1].all("COPY")
    assert any(f"--from={build.name}" in c for c in copies), copies
    # only the virtualenv crosses over: no source tree, no pip cache, no build tools
    assert not [c for c in copies if "--from" not in c], copies


def test_runs_as_a_numeric_non_root_user(runtime: Stage) -> None:
    user = runtime.last("USER")
    assert user is not None
    args = {}
    for line in runtime.all("ARG"):
        key, _, default = line.partition("=")
        args[key] = default
    resolved = re.sub(r"\$\{(\w+)\}", lambda m: args[m[1]], user)
    uid, _, gid = resolved.partition(":")
    # numeric, so Kubernetes' runAsNonRoot can verify it without reading /etc/passwd
    assert uid.isdigit() and int(uid) != 0, user
    assert not gid or (gid.isdigit() and int(gid) != 0), user
    assert runtime.instructions.index(("USER", user)) > max(
        i for i, (kw, _) in enumerate(runtime.instructions) if kw in ("RUN", "COPY")
    ), "USER must come after the steps that need root"


def test_healthcheck_asks_healthz_on_8080(runtime: Stage) -> None:
    check = runtime.last("HEALTHCHECK")
    assert check is not None and "CMD" in check
    assert "http://127.0.0.1:8080/healthz" in check
    # exec form: runs without a shell; the slim image has no curl, so python does it
    command = json.loads(check.split("CMD", 1)[1].strip())
    assert command[0] == "python"
    compile(command[-1], "<healthcheck>", "exec")
    assert "8080" in (runtime.last("EXPOSE") or "").split()


def test_listens_on_all_interfaces_and_finds_its_config(runtime: Stage) -> None:
    env = env_of(runtime)
    assert env["CDCD_HTTP__LISTEN"] == "0.0.0.0:8080"
    assert env["CDCD_CONFIG"] == "/etc/cdcd/cdcd.yaml"
    assert "/opt/cdcd/venv/bin" in env["PATH"].split(":")
    assert runtime.last("WORKDIR") == "/var/lib/cdcd"
    # exec form, cdcd as PID 1: SIGTERM reaches it and drains
    assert json.loads(runtime.last("ENTRYPOINT") or "null") == ["cdcd"]
    assert json.loads(runtime.last("CMD") or "null") == ["run"]
    assert (runtime.last("STOPSIGNAL") or "SIGTERM") == "SIGTERM"


def test_install_commands_are_the_setup_scripts(stages: list[Stage]) -> None:
    setup = SETUP.read_text()
    setup_pips = pip_commands(setup)
    # if scripts/setup changes how it installs, the Dockerfile must follow
    assert "python -m pip install -q --upgrade pip" in setup_pips
    # both install the versions the tests ran with (constraints.txt)
    assert re.search(r"^\s*python -m pip install -q -c constraints\.txt -e \.\s*$", setup, re.M), (
        setup
    )
    runs = stages[0].all("RUN")
    docker_pips = [cmd for run in runs for cmd in pip_commands(run)]
    assert docker_pips == [
        "python -m pip install -q --upgrade pip",
        f"python -m pip install -q -c constraints.txt -r {DEPENDENCIES}",
        "python -m pip install -q -c constraints.txt .",
    ], docker_pips
    # the dependencies first, in a layer the sources do not invalidate: pyproject.toml's list
    (listing,) = [run for run in runs if f">{DEPENDENCIES}" in run]
    assert "tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']" in listing
    copied = [c.split()[:-1] for c in stages[0].all("COPY")]
    assert copied[0] == ["pyproject.toml", "constraints.txt"], copied
    docker_pips.remove(f"python -m pip install -q -c constraints.txt -r {DEPENDENCIES}")
    # pip's build compiles the mypyc modules (setup.py); both then check the form in use
    assert "python -m cdcd.accel status --strict" in setup
    assert any("python -m cdcd.accel status --strict" in run for run in stages[0].all("RUN"))
    # the same commands, with only the editable flag dropped (an image has no work tree)
    assert {cmd.replace(" -e ", " ") for cmd in setup_pips} >= set(docker_pips)
    # and like scripts/setup, it installs into a virtualenv made with `python -m venv`
    assert "-m venv" in setup
    assert any("python -m venv /opt/cdcd/venv" in run for run in stages[0].all("RUN"))


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """A .dockerignore pattern (Go filepath.Match plus ``**``) as a regex over a path."""
    out = []
    i = 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out))


def _ignored(path: str, patterns: list[str]) -> bool:
    """Docker's rule: a pattern matching a folder covers what is inside; the last matching
    pattern wins; ``!`` re-includes."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    ignored = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        regex = _pattern_regex(pattern.removeprefix("!").strip("/"))
        if any(regex.fullmatch(c) for c in candidates):
            ignored = not negate
    return ignored


def test_build_context_holds_what_pip_install_needs(stages: list[Stage]) -> None:
    patterns = [
        line.strip()
        for line in (REPO / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    sources = [w for c in stages[0].all("COPY") if "--from" not in c for w in c.split()[:-1]]
    for source in sources:
        assert (REPO / source).exists(), source
        assert not _ignored(source, patterns), f"{source} is excluded by .dockerignore"
    # what setuptools reads: the readme and every package under cdcd/
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["readme"] in sources
    assert "setup.py" in sources  # the build hook that compiles the mypyc modules
    assert "constraints.txt" in sources  # the pinned versions pip installs
    assert "cdcd" in sources
    assert not _ignored("cdcd/sinks/file/sink.py", patterns)
    for heavy in (".venv/bin/python", ".git/HEAD", "tests/corpus/README.md", "bench/run.py"):
        assert _ignored(heavy, patterns), f"{heavy} would be sent to the docker daemon"
    assert _ignored("cdcd/__pycache__/app.cpython-311.pyc", patterns)
