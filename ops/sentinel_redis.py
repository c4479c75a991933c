"""A real Sentinel-managed Redis, for the tests, ``make soak --sentinel`` and the benchmark:
a primary, two replicas and three sentinels on free loopback ports in a temp dir
(``redis-server`` and ``redis-server --sentinel``), with a short
``down-after-milliseconds`` so a killed primary is replaced within seconds."""

from __future__ import annotations

import contextlib
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis

SERVICE = "mlxq"
#: How long the sentinels wait before they call a silent primary down.
DOWN_AFTER_MS = 1000
#: A sentinel starts no failover of the service within twice this of its last one: a new
#: primary stalled a second on a busy machine is not failed over again at once (its
#: replica may still be syncing from it). Kills must be spaced by ``FAILOVER_GAP_S``.
FAILOVER_TIMEOUT_MS = 5000
FAILOVER_GAP_S = 2 * FAILOVER_TIMEOUT_MS / 1000


class NoSentinel(RuntimeError):
    """This redis-server cannot run as a sentinel (a build without it)."""


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free loopback ports: every socket stays bound until all are picked
    (one at a time, the kernel may hand back a port it just gave: two sentinels on one
    port, the second unable to bind, and the first never seeing two others)."""
    with contextlib.ExitStack() as held:
        socks = [held.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]


def _wait(check: object, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():  # type: ignore[operator]
                return
        except redis.RedisError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"{what} not within {timeout:.0f} s")


class SentinelRedis:
    """Three data nodes (one primary) watched by three sentinels; ``url`` names them all.

    ``kill_master()`` kills the primary with SIGKILL, ``wait_failover()`` waits until the
    sentinels have promoted a replica, ``restart(port)`` brings a killed node back as a
    replica of the new primary.
    """

    def __init__(self, workdir: Path, down_after_ms: int = DOWN_AFTER_MS) -> None:
        self.down_after_ms = down_after_ms
        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError(
                "redis-server not found: install Redis (apt-get install redis-server)"
            )
        self.exe, self.workdir = exe, workdir
        self.procs: dict[int, subprocess.Popen[bytes]] = {}
        self.killed_at = -FAILOVER_GAP_S
        ports = _free_ports(6)
        self.data_ports, self.sentinel_ports = ports[:3], ports[3:]
        primary = self.data_ports[0]
        self._node(primary, None)
        for port in self.data_ports[1:]:
            self._node(port, primary)
        for port in self.sentinel_ports:
            self._sentinel(port, primary)
        self.wait_primary_replicas(2)
        _wait(self._sentinels_agree, "the sentinels to see each other and both replicas")

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{SERVICE}/0"

    def client(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_timeout=5)

    def _node(self, port: int, replica_of: int | None) -> None:
        d = self.workdir / f"node{port}"
        d.mkdir(parents=True, exist_ok=True)
        args = [self.exe, "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "no", "--dir", str(d), "--repl-diskless-sync", "yes"]
        args += ["--repl-diskless-sync-delay", "0"]
        if replica_of is not None:
            args += ["--replicaof", "127.0.0.1", str(replica_of)]
        self.procs[port] = subprocess.Popen(
            args, stdout=(d / "log").open("ab"), stderr=subprocess.STDOUT
        )
        _wait(self.client(port).ping, f"redis-server on {port} to start", 30)

    def _sentinel(self, port: int, primary: int) -> None:
        d = self.workdir / f"sentinel{port}"
        d.mkdir(parents=True, exist_ok=True)
        conf = d / "sentinel.conf"
        conf.write_text(
            f"port {port}\nbind 127.0.0.1\ndir {d}\n"
            f"sentinel monitor {SERVICE} 127.0.0.1 {primary} 2\n"
            f"sentinel down-after-milliseconds {SERVICE} {self.down_after_ms}\n"
            f"sentinel failover-timeout {SERVICE} {FAILOVER_TIMEOUT_MS}\n"
            f"sentinel parallel-syncs {SERVICE} 2\n"
        )
        self.procs[port] = subprocess.Popen(
            [self.exe, str(conf), "--sentinel"],
            stdout=(d / "log").open("ab"),
            stderr=subprocess.STDOUT,
        )
        proc = self.procs[port]
        try:
            _wait(self.client(port).ping, f"sentinel on {port} to start", 30)
        except RuntimeError:
            if proc.poll() is None:
                raise
            log = (d / "log").read_text(errors="replace").strip().splitlines()[-3:]
            self.stop()
            raise NoSentinel(f"{self.exe} --sentinel exited: {' / '.join(log)}") from None

    def _sentinels_agree(self) -> bool:
        """Every sentinel sees the others and two replicas in good health."""
        for port in self.sentinel_ports:
            c = self.client(port)
            state = c.sentinel_master(SERVICE)
            if state["num-other-sentinels"] < 2 or state["flags"] != "master":
                return False
            replicas = c.sentinel_slaves(SERVICE)
            healthy = [
                r for r in replicas if r["flags"] == "slave" and r["master-link-status"] == "ok"
            ]
            if len(healthy) < 2:
                return False
        return True

    def wait_healthy(self) -> None:
        """Wait until every sentinel sees a master with two healthy replicas (so the next
        kill can be failed over)."""
        _wait(self._sentinels_agree, "the sentinels to see two healthy replicas", 120)

    def master_port(self) -> int:
        """The primary's port as the sentinels report it (the first that answers)."""
        for port in self.sentinel_ports:
            try:
                _, p = self.client(port).sentinel_get_master_addr_by_name(SERVICE)
                return int(p)
            except (redis.RedisError, TypeError):
                continue
        raise RuntimeError("no sentinel answers")

    def wait_primary_replicas(self, n: int, timeout: float = 60.0) -> int:
        """Wait until the primary has ``n`` replicas in sync, whichever node the sentinels
        name at each look (on a busy machine a primary that stalls past
        ``down_after_ms`` is failed over once more, and a wait on the node it was would
        wait on a replica); its port."""

        def ready() -> bool:
            try:
                c = self.client(self.master_port())
                info = c.info("replication")
                if info["role"] != "master" or int(info["connected_slaves"]) < n:
                    return False
                return int(c.wait(n, 1000)) >= n
            except RuntimeError:  # no sentinel answers (yet)
                return False

        try:
            _wait(ready, "the primary's replicas", timeout)
        except RuntimeError:
            raise RuntimeError(
                f"the primary has no {n} replicas in sync in {timeout:.0f} s "
                f"({self.failovers()} failovers so far): {self._roles()}"
            ) from None
        return self.master_port()

    def _roles(self) -> dict[int, str]:
        roles = {}
        for p in self.procs:
            try:
                info = self.client(p).info("replication")
                keys = ("role", "master_port", "master_link_status", "connected_slaves")
                roles[p] = " ".join(str(info.get(k, "")) for k in keys)
            except redis.RedisError as e:
                roles[p] = repr(e)
        return roles

    def freeze_replicas(self) -> list[int]:
        """SIGSTOP every replica, then make the primary close its links to them (what it
        wrote before stays in their sockets and is applied when they resume; nothing
        after): from now on the primary's writes reach none, and stopped, they cannot
        reconnect. Their ports (for :meth:`thaw`)."""
        primary = self.master_port()
        frozen = [p for p in self.procs if p in self.data_ports and p != primary]
        for p in frozen:
            self.procs[p].send_signal(signal.SIGSTOP)
        self.client(primary).client_kill_filter(_type="replica")
        return frozen

    def thaw(self, ports: list[int]) -> None:
        for p in ports:
            self.procs[p].send_signal(signal.SIGCONT)

    def wait_failover_gap(self) -> None:
        """Wait until the sentinels may fail the service over again (FAILOVER_GAP_S after
        the last kill)."""
        time.sleep(max(0.0, self.killed_at + FAILOVER_GAP_S - time.monotonic()))

    def kill_master(self) -> int:
        """SIGKILL the primary; its port is returned (for :meth:`restart`)."""
        self.killed_at = time.monotonic()
        port = self.master_port()
        proc = self.procs.pop(port)
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        return port

    def failover(self) -> int:
        """A coordinated failover (``SENTINEL FAILOVER``): the old primary lives on, demoted
        to a replica (its clients get ``READONLY``); the new primary's port."""
        old = self.master_port()
        self.client(self.sentinel_ports[0]).execute_command("SENTINEL", "FAILOVER", SERVICE)
        new = self.wait_failover(old)
        _wait(lambda: self.client(old).info("replication")["role"] == "slave", "demotion")
        return new

    def wait_failover(self, old: int, timeout: float = 60.0) -> int:
        """Wait until every sentinel names a new primary that answers as one; its port."""

        def done() -> bool:
            ports = {
                int(self.client(p).sentinel_get_master_addr_by_name(SERVICE)[1])
                for p in self.sentinel_ports
            }
            if len(ports) != 1 or old in ports:
                return False
            role = self.client(ports.pop()).info("replication")["role"]
            return bool(role == "master")

        _wait(done, "failover", timeout)
        return self.master_port()

    def failovers(self) -> int:
        """Failovers so far: the ``+switch-master`` lines of the sentinel that logged the
        most (each logs every failover it learns of)."""
        counts = []
        for port in self.sentinel_ports:
            log = self.workdir / f"sentinel{port}" / "log"
            counts.append(log.read_text(errors="replace").count("+switch-master"))
        return max(counts, default=0)

    def restart(self, port: int) -> None:
        """Bring the node that listened on ``port`` back, as a replica of the primary."""
        self._node(port, self.master_port())

    def add_replica(self) -> int:
        """One more replica of the primary, in sync; its port."""
        (port,) = _free_ports(1)
        self.data_ports.append(port)
        self._node(port, self.master_port())
        self.wait_primary_replicas(len(self.data_ports) - 1)
        return port

    def stop(self) -> None:
        for proc in self.procs.values():
            proc.kill()
        for proc in self.procs.values():
            proc.wait(10)
        self.procs.clear()
