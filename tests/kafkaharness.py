"""Apache Kafka for tests and bench/: KRaft brokers on 127.0.0.1, started from the jars that
``scripts/setup`` fetched (``scripts/maven/kafka/pom.xml``, found by :mod:`cdcd.jars`).

``KafkaBroker.launch()`` starts one node (combined broker and controller) or a cluster of
``brokers`` nodes, each a JVM (``java -cp '<jars>/*' kafka.Kafka server.properties``) with a
small heap and settings that make a single machine quick (internal topics of one partition,
no initial rebalance delay). It returns once the cluster answers a metadata request.

Listeners of a node:

- ``PLAINTEXT`` for clients, behind a small TCP proxy (its own thread) whose port the node
  advertises: ``bootstrap`` lists the proxies;
- ``INTERNAL`` between the nodes and ``CONTROLLER`` for KRaft, direct, so a closed proxy keeps
  only clients out;
- on request, ``SASL_PLAINTEXT`` (``sasl_bootstrap``; SCRAM users given to ``launch`` are
  written at format time), ``SSL`` and ``SASL_SSL`` (``ssl_bootstrap``, ``sasl_ssl_bootstrap``;
  a certificate from a trustme CA whose PEM is ``ca_file``), and an authorizer
  (``StandardAuthorizer``; the proxied and TLS listeners' anonymous user is a super user,
  SCRAM users get only the ACLs a test grants with :meth:`KafkaBroker.grant`).

Outages:

- ``stop()`` takes the cluster away from clients: the proxies cut every connection and refuse
  new ones; the JVMs keep running. ``start()`` lets clients in again.
- ``restart()`` kills every JVM (SIGKILL) and starts them again on the same log directories,
  as a crashed broker restarts: acknowledged records (``acks=all``) and producer state stay.
- ``kill(i)`` / ``revive(i)``: one node of a cluster killed and started again.

When ``CDCD_TEST_KAFKA_BOOTSTRAP`` is set, that broker is used instead and nothing is started;
``stop``/``start``/``restart`` are then unavailable (``can_restart`` False).

The module needs only the standard library, aiokafka and cdcd.jars, so bench/ starts its broker
with it too (``python -m tests.kafkaharness`` runs one in the foreground and prints its address).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient

from cdcd.jars import jar_dir

ENV_BOOTSTRAP = "CDCD_TEST_KAFKA_BOOTSTRAP"
#: JVM options of a test broker: a small heap, the serial collector, and the C1 compiler only
#: (about a third faster to start on two cores; the tests' loads do not need C2)
TEST_JVM_OPTIONS = ("-Xms64m", "-Xmx384m", "-XX:+UseSerialGC", "-XX:TieredStopAtLevel=1")
#: JVM options for bench/: the default compilers and a larger heap
BENCH_JVM_OPTIONS = ("-Xms512m", "-Xmx1g", "-XX:+UseG1GC")
START_TIMEOUT = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def wait_for_metadata(
    bootstrap: str, timeout: float = 30.0, brokers: int = 1, **client: Any
) -> None:
    """Return once the cluster at ``bootstrap`` answers a metadata request listing ``brokers``
    brokers; TimeoutError after ``timeout``."""
    quiet = logging.getLogger("aiokafka")
    level = quiet.level
    quiet.setLevel(logging.CRITICAL)  # "Unable connect" on every try until the broker is up
    try:
        await _wait_for_metadata(bootstrap, timeout, brokers, client)
    finally:
        quiet.setLevel(level)


async def _wait_for_metadata(
    bootstrap: str, timeout: float, brokers: int, client: dict[str, Any]
) -> None:
    deadline = time.monotonic() + timeout
    last: Exception | str | None = None
    while time.monotonic() < deadline:
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=3000, **client)
        try:
            await admin.start()
            cluster = await admin.describe_cluster()
            if len(cluster["brokers"]) >= brokers:
                return
            last = f"{len(cluster['brokers'])} of {brokers} brokers"
        except Exception as exc:  # any failure means "not ready yet"
            last = exc
        finally:
            with contextlib.suppress(Exception):
                await admin.close()
        await asyncio.sleep(0.2)
    raise TimeoutError(f"Kafka at {bootstrap} not ready after {timeout}s: {last!r}")


class _Proxy:
    """Forwards 127.0.0.1:``port`` to 127.0.0.1:``target``; ``close()`` cuts and refuses
    connections until ``open()``. Runs its own event loop in a thread, so it keeps working
    while the test's loop is blocked (e.g. waiting for a subprocess)."""

    def __init__(self, port: int, target: int) -> None:
        self.port, self.target = port, target
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def _call(self, coro: Any) -> Any:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    async def open(self) -> None:
        await self._call(self._open())

    async def close(self) -> None:
        await self._call(self._close())

    def shutdown(self) -> None:
        asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    async def _open(self) -> None:
        if self._server is None:
            self._server = await asyncio.start_server(
                self._handle, "127.0.0.1", self.port, reuse_address=True
            )

    async def _close(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        self._writers.clear()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            writer.transport.abort()
            return
        self._writers.update((writer, up_writer))

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(Exception):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.transport.abort()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self._writers.difference_update((writer, up_writer))


@dataclass
class _Node:
    """One KRaft node (broker and controller) and its ports."""

    node_id: int
    folder: Path
    client_port: int  # PLAINTEXT, behind the proxy
    proxy_port: int
    internal_port: int
    controller_port: int
    sasl_port: int = 0
    ssl_port: int = 0
    sasl_ssl_port: int = 0
    proxy: _Proxy | None = None
    proc: subprocess.Popen[bytes] | None = None

    @property
    def log(self) -> Path:
        return self.folder / "kafka.log"


def _cluster_id() -> str:
    """A random id as Kafka's ``Uuid.randomUuid`` makes them: never starting with ``-``
    (``kafka-storage format --cluster-id -x…`` would read it as an option and fail)."""
    while True:
        found = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not found.startswith("-"):
            return found


@dataclass
class KafkaBroker:
    """Apache Kafka the tests talk to (one node or a cluster). ``bootstrap`` is
    ``host:port[,host:port...]`` of the PLAINTEXT listeners (through the proxies)."""

    bootstrap: str
    external: bool = False
    nodes: list[_Node] = field(default_factory=list, repr=False)
    folder: Path | None = field(default=None, repr=False)
    jvm_options: tuple[str, ...] = TEST_JVM_OPTIONS
    ca_file: Path | None = None  # the CA of the TLS listeners (PEM)
    started_in: float = 0.0  # seconds from the first JVM start to a cluster that answers

    @property
    def supports_idempotence(self) -> bool:
        return True

    @property
    def can_restart(self) -> bool:
        return not self.external

    @property
    def direct_bootstrap(self) -> str:
        """The nodes' internal listeners: reachable also while :meth:`stop` keeps clients out
        (for a test's own look at the topics)."""
        if self.external:
            return self.bootstrap
        return ",".join(f"127.0.0.1:{n.internal_port}" for n in self.nodes)

    @property
    def sasl_bootstrap(self) -> str:
        return ",".join(f"127.0.0.1:{n.sasl_port}" for n in self.nodes)

    @property
    def ssl_bootstrap(self) -> str:
        return ",".join(f"127.0.0.1:{n.ssl_port}" for n in self.nodes)

    @property
    def sasl_ssl_bootstrap(self) -> str:
        return ",".join(f"127.0.0.1:{n.sasl_ssl_port}" for n in self.nodes)

    @classmethod
    async def launch(
        cls,
        *,
        brokers: int = 1,
        scram_users: dict[str, str] | None = None,
        tls: bool = False,
        authorizer: bool = False,
        jvm_options: tuple[str, ...] = TEST_JVM_OPTIONS,
        settings: dict[str, str] | None = None,
        external_ok: bool = True,
        proxy: bool = True,
    ) -> KafkaBroker:
        """Use ``$CDCD_TEST_KAFKA_BOOTSTRAP`` if set (and ``external_ok``), else start
        ``brokers`` nodes. ``scram_users``: name -> password (SCRAM-SHA-256 and -512) on a
        ``SASL_PLAINTEXT`` listener (and ``SASL_SSL`` with ``tls``); ``settings``: more
        server properties; ``proxy`` False: clients connect to the nodes directly (bench/;
        no ``stop``/``start``)."""
        external = os.environ.get(ENV_BOOTSTRAP)
        if external and external_ok:
            await wait_for_metadata(external)
            return cls(bootstrap=external, external=True)
        folder = Path(tempfile.mkdtemp(prefix="kafka-"))
        nodes = [
            _Node(
                node_id=i + 1,
                folder=folder / f"node{i + 1}",
                client_port=(port := free_port()),
                proxy_port=free_port() if proxy else port,
                internal_port=free_port(),
                controller_port=free_port(),
                sasl_port=free_port() if scram_users is not None else 0,
                ssl_port=free_port() if tls else 0,
                sasl_ssl_port=free_port() if tls and scram_users is not None else 0,
            )
            for i in range(brokers)
        ]
        broker = cls(
            bootstrap=",".join(f"127.0.0.1:{n.proxy_port}" for n in nodes),
            nodes=nodes,
            folder=folder,
            jvm_options=jvm_options,
        )
        try:
            keystore = broker._tls_files() if tls else None
            voters = ",".join(f"{n.node_id}@127.0.0.1:{n.controller_port}" for n in nodes)
            cluster_id = _cluster_id()
            for node in nodes:
                node.folder.mkdir(parents=True)
                props = broker._properties(node, voters, scram_users, keystore, authorizer)
                props.update(settings or {})
                (node.folder / "server.properties").write_text(
                    "".join(f"{k}={v}\n" for k, v in props.items())
                )
                broker._format(node, cluster_id, scram_users)
            started = time.monotonic()
            for node in nodes:
                if proxy:
                    node.proxy = _Proxy(node.proxy_port, node.client_port)
                broker._spawn(node)
            await broker.start()
            broker.started_in = time.monotonic() - started
        except BaseException:
            await broker.close()
            raise
        return broker

    # --- files -----------------------------------------------------------------------------

    def _tls_files(self) -> Path:
        """A CA (``ca_file``) and a PEM keystore for 127.0.0.1 (PKCS#8 key and chain)."""
        import trustme
        from cryptography.hazmat.primitives.serialization import (
            Encoding,
            NoEncryption,
            PrivateFormat,
            load_pem_private_key,
        )

        assert self.folder is not None
        ca = trustme.CA()
        leaf = ca.issue_cert("127.0.0.1", "localhost")
        key = load_pem_private_key(leaf.private_key_pem.bytes(), None)
        pkcs8 = key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())
        keystore = self.folder / "keystore.pem"
        keystore.write_bytes(pkcs8 + b"".join(b.bytes() for b in leaf.cert_chain_pems))
        self.ca_file = self.folder / "ca.pem"
        ca.cert_pem.write_to_path(str(self.ca_file))
        return keystore

    def _properties(
        self,
        node: _Node,
        voters: str,
        scram_users: dict[str, str] | None,
        keystore: Path | None,
        authorizer: bool,
    ) -> dict[str, str]:
        replicas = len(self.nodes)
        listeners = {
            "PLAINTEXT": (node.client_port, node.proxy_port),
            "INTERNAL": (node.internal_port, node.internal_port),
        }
        if node.sasl_port:
            listeners["SASL_PLAINTEXT"] = (node.sasl_port, node.sasl_port)
        if node.ssl_port:
            listeners["SSL"] = (node.ssl_port, node.ssl_port)
        if node.sasl_ssl_port:
            listeners["SASL_SSL"] = (node.sasl_ssl_port, node.sasl_ssl_port)
        protocols = {name: name for name in listeners} | {
            "INTERNAL": "PLAINTEXT",
            "CONTROLLER": "PLAINTEXT",
        }
        props = {
            "process.roles": "broker,controller",
            "node.id": str(node.node_id),
            "controller.quorum.voters": voters,
            "listeners": ",".join(
                [f"{n}://127.0.0.1:{port}" for n, (port, _) in listeners.items()]
                + [f"CONTROLLER://127.0.0.1:{node.controller_port}"]
            ),
            "advertised.listeners": ",".join(
                f"{n}://127.0.0.1:{port}" for n, (_, port) in listeners.items()
            ),
            "listener.security.protocol.map": ",".join(f"{k}:{v}" for k, v in protocols.items()),
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "INTERNAL",
            "log.dirs": str(node.folder / "data"),
            "auto.create.topics.enable": "false",
            "num.partitions": "1",
            "default.replication.factor": str(replicas),
            "min.insync.replicas": str(min(2, replicas)),
            "offsets.topic.replication.factor": str(replicas),
            "offsets.topic.num.partitions": "1",
            "transaction.state.log.replication.factor": str(replicas),
            "transaction.state.log.min.isr": str(min(2, replicas)),
            "transaction.state.log.num.partitions": "1",
            "share.coordinator.state.topic.replication.factor": str(replicas),
            "share.coordinator.state.topic.min.isr": str(min(2, replicas)),
            "group.initial.rebalance.delay.ms": "0",
            # a killed node is fenced, and its partitions led elsewhere, within seconds
            "broker.session.timeout.ms": "4000",
            "broker.heartbeat.interval.ms": "500",
            "controller.quorum.election.timeout.ms": "1000",
            "controller.quorum.fetch.timeout.ms": "2000",
            "replica.lag.time.max.ms": "5000",
            # compacted topics (cdcd's position topic) need the cleaner; keep its buffer small
            "log.cleaner.dedupe.buffer.size": str(8 * 1024 * 1024),
            "log.cleaner.threads": "1",
            "num.network.threads": "2",
            "num.io.threads": "2",
            "background.threads": "2",
            "num.replica.fetchers": "1",
            "num.recovery.threads.per.data.dir": "1",
            "log.segment.bytes": str(64 * 1024 * 1024),
            "delete.topic.enable": "true",
        }
        if scram_users is not None:
            props["sasl.enabled.mechanisms"] = "SCRAM-SHA-256,SCRAM-SHA-512"
            module = "org.apache.kafka.common.security.scram.ScramLoginModule required;"
            for listener in ("sasl_plaintext", "sasl_ssl"):
                for mechanism in ("scram-sha-256", "scram-sha-512"):
                    props[f"listener.name.{listener}.{mechanism}.sasl.jaas.config"] = module
        if keystore is not None:
            props["ssl.keystore.type"] = "PEM"
            props["ssl.keystore.location"] = str(keystore)
        if authorizer:
            props["authorizer.class.name"] = (
                "org.apache.kafka.metadata.authorizer.StandardAuthorizer"
            )
            props["super.users"] = "User:ANONYMOUS"
        return props

    def _java(self) -> list[str]:
        java = shutil.which("java")
        home = os.environ.get("JAVA_HOME")
        if home:
            java = str(Path(home) / "bin" / "java")
        if java is None:
            raise RuntimeError(
                "no java on PATH (Apache Kafka 4 needs Java 17+): scripts/setup --test"
            )
        return [java, *self.jvm_options, "-cp", f"{jar_dir('kafka')}/*"]

    def _format(self, node: _Node, cluster_id: str, scram_users: dict[str, str] | None) -> None:
        """``kafka-storage format``: the node's log directory with the cluster id (and SCRAM
        users). Without users, only ``meta.properties`` is written, as the tool would (a JVM
        start less); the node then takes the newest metadata version."""
        if not scram_users:
            data = node.folder / "data"
            data.mkdir()
            (data / "meta.properties").write_text(
                f"version=1\ncluster.id={cluster_id}\nnode.id={node.node_id}\n"
                f"directory.id={_cluster_id()}\n"
            )
            return
        command = [
            *self._java(),
            "kafka.tools.StorageTool",
            "format",
            "--cluster-id",
            cluster_id,
            "--config",
            str(node.folder / "server.properties"),
        ]
        for name, password in (scram_users or {}).items():
            for mechanism in ("SCRAM-SHA-256", "SCRAM-SHA-512"):
                command += ["--add-scram", f"{mechanism}=[name={name},password={password}]"]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode:
            raise RuntimeError(f"kafka-storage format failed: {done.stdout}{done.stderr}")

    # --- processes --------------------------------------------------------------------------

    def _spawn(self, node: _Node) -> None:
        with node.log.open("ab") as out:
            node.proc = subprocess.Popen(
                [*self._java(), "kafka.Kafka", str(node.folder / "server.properties")],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

    async def _kill(self, node: _Node, sig: int = signal.SIGKILL) -> None:
        proc, node.proc = node.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(sig)
            try:
                await asyncio.to_thread(proc.wait, 30)
            except subprocess.TimeoutExpired:
                proc.kill()
                await asyncio.to_thread(proc.wait)

    def _require_local(self) -> list[_Node]:
        if self.external:
            raise RuntimeError("cannot stop, start or restart an external broker")
        return self.nodes

    async def start(self) -> None:
        """Let clients reach the cluster (again); return once it answers."""
        for node in self._require_local():
            if node.proxy is not None:
                await node.proxy.open()
        await self.wait_ready()

    async def wait_ready(self, brokers: int | None = None) -> None:
        live = [n for n in self.nodes if n.proc is not None]
        for node in live:
            if node.proc is not None and node.proc.poll() is not None:
                raise RuntimeError(f"Kafka node {node.node_id} exited: {self.log_text()}")
        await wait_for_metadata(
            self.bootstrap, START_TIMEOUT, brokers=len(live) if brokers is None else brokers
        )

    async def stop(self) -> None:
        """Take the cluster away from clients: cut connections, refuse new ones."""
        for node in self._require_local():
            if node.proxy is None:
                raise RuntimeError("launched with proxy=False: clients cannot be kept out")
            await node.proxy.close()

    async def restart(self) -> None:
        """Kill every node (SIGKILL) and start it again on its log directories; clients are
        let in again (also after :meth:`stop`)."""
        nodes = self._require_local()
        for node in nodes:
            await self._kill(node)
        for node in nodes:
            self._spawn(node)
        await self.start()

    async def heal(self) -> None:
        """Every node running and reachable again (after a test's outage, failed or not)."""
        for node in self._require_local():
            if node.proc is None or node.proc.poll() is not None:
                self._spawn(node)
        await self.start()

    async def kill(self, index: int) -> None:
        """Kill node ``index`` (0-based) with SIGKILL; the others carry on."""
        await self._kill(self._require_local()[index])

    async def revive(self, index: int) -> None:
        """Start node ``index`` again on its log directory; return once it is back."""
        self._spawn(self._require_local()[index])
        await self.wait_ready()

    async def grant(
        self, user: str, operation: str, *, topic: str | None = None, prefix: bool = False
    ) -> None:
        """An ALLOW ACL for ``User:<user>``: ``operation`` (READ, WRITE, CREATE, DESCRIBE,
        IDEMPOTENT_WRITE ...) on ``topic`` (a prefix with ``prefix``) or on the cluster."""
        from aiokafka.protocol.admin import CreateAclsRequest

        operations = {"READ": 3, "WRITE": 4, "CREATE": 5, "DESCRIBE": 8, "IDEMPOTENT_WRITE": 12}
        resource = (2, topic) if topic is not None else (4, "kafka-cluster")
        pattern = 4 if prefix else 3  # PREFIXED / LITERAL
        request = CreateAclsRequest(
            *resource, pattern, f"User:{user}", "*", operations[operation], 3
        )
        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap)
        await admin.start()
        try:
            response = await admin._send_request(request)
        finally:
            await admin.close()
        for code, message in response.creation_responses:
            if code:
                raise RuntimeError(f"CreateAcls failed: {code} {message}")

    def log_text(self) -> str:
        return "\n".join(
            f"--- node {n.node_id}\n" + n.log.read_text(errors="replace")[-20000:]
            for n in self.nodes
            if n.log.exists()
        )

    async def close(self) -> None:
        for node in self.nodes:
            if node.proxy is not None:
                node.proxy.shutdown()
                node.proxy = None
            await self._kill(node)
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)
            self.folder = None


async def _main() -> None:
    """Run one node in the foreground until interrupted (for bench/ and by hand)."""
    broker = await KafkaBroker.launch(jvm_options=BENCH_JVM_OPTIONS, external_ok=False, proxy=False)
    print(f"Apache Kafka at {broker.bootstrap} (started in {broker.started_in:.1f}s)", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await broker.close()


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_main())
    sys.exit(0)
