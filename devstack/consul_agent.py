"""A real Consul dev agent on free loopback ports, for the dev stack and the tests.

A dev agent keeps everything in memory: stopping it loses every key, session and service, which
is exactly what a Consul restart looks like to the watcher and the router, so `restart()` keeps
the ports and throws the state away.
"""

from __future__ import annotations

import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType

import httpx

from devstack import lifetime, processes
from devstack.agent_tls import AgentTLS, verify
from devstack.ports import free_ports

DEFAULT_CACHED_BIN = Path.home() / ".cache" / "llmgw" / "consul" / "usr" / "bin" / "consul"


class ConsulAgentError(RuntimeError):
    """The Consul dev agent could not be found, started or made to elect itself."""


def find_consul_binary() -> str:
    """`LLMGW_CONSUL_BIN`, else the binary `make setup` unpacks into the cache, else PATH."""
    return processes.find_binary(
        "LLMGW_CONSUL_BIN", DEFAULT_CACHED_BIN, "consul", ConsulAgentError, "Consul", "Consul 1.8.7"
    )


class ConsulAgent:
    """One `consul agent -dev` process.

    `die_with_parent` ties the agent's life to this process (for tests); the dev stack leaves
    it off so that `devstack up` can return and `devstack down` stop the agent later by PID.
    """

    def __init__(
        self,
        *,
        host: str = "127.0.0.1",
        binary: str | None = None,
        log_dir: str | Path | None = None,
        node_name: str = "llmgw-dev",
        die_with_parent: bool = False,
        start_timeout: float = 30.0,
        extra_args: tuple[str, ...] = (),
        acl_master_token: str | None = None,
        tls: AgentTLS | None = None,
    ) -> None:
        self.host = host
        # ACLs on, deny by default, with this secret as the management (master) token.
        self.acl_master_token = acl_master_token
        # The HTTP API over HTTPS only, with this certificate (the port stays `http_port`).
        self.tls = tls
        # More agent flags, e.g. `-hcl` TLS settings for a test that needs HTTPS.
        self.extra_args = extra_args
        self.binary = binary or find_consul_binary()
        self.node_name = node_name
        self.die_with_parent = die_with_parent
        self.start_timeout = start_timeout
        self._log_dir = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="llmgw-consul-"))
        self._log_dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self._log_dir / "consul.log"
        self._proc: subprocess.Popen[bytes] | None = None
        self.http_port = 0
        self.serf_lan_port = 0
        self.serf_wan_port = 0
        self.server_port = 0

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.http_port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def command(self) -> list[str]:
        return [
            self.binary,
            "agent",
            "-dev",
            "-node",
            self.node_name,
            "-bind",
            self.host,
            "-client",
            self.host,
            "-http-port",
            "-1" if self.tls else str(self.http_port),
            "-dns-port",
            "-1",
            "-grpc-port",
            "-1",
            "-serf-lan-port",
            str(self.serf_lan_port),
            "-serf-wan-port",
            str(self.serf_wan_port),
            "-server-port",
            str(self.server_port),
            *self.acl_args(),
            *self.tls_args(),
            *self.extra_args,
        ]

    def tls_args(self) -> list[str]:
        if self.tls is None:
            return []
        return [
            "-hcl",
            f"ports {{ https = {self.http_port} }}",
            "-hcl",
            f'cert_file = "{self.tls.cert}"',
            "-hcl",
            f'key_file = "{self.tls.key}"',
            "-hcl",
            f'ca_file = "{self.tls.ca}"',
        ]

    def acl_args(self) -> list[str]:
        """Consul 1.8's ACLs as a cluster with `default_policy = "deny"` has them, and the
        stricter KV list policy (a recursive read needs `list`), as the operating guide asks."""
        if not self.acl_master_token:
            return []
        token = self.acl_master_token
        hcl = (
            'acl {\n enabled = true\n default_policy = "deny"\n enable_key_list_policy = true\n'
            f' tokens {{\n  master = "{token}"\n  agent = "{token}"\n }}\n}}\n'
        )
        return ["-hcl", hcl]

    def start(self, attempts: int = 3) -> ConsulAgent:
        """Start on fresh free ports, trying new ones if another process took one first."""
        if self.running:
            raise ConsulAgentError(f"consul agent already running (pid {self.pid}) at {self.url}")
        last: ConsulAgentError | None = None
        for _ in range(attempts):
            self.http_port, self.serf_lan_port, self.serf_wan_port, self.server_port = free_ports(
                4, self.host
            )
            try:
                self._launch()
                return self
            except ConsulAgentError as exc:
                last = exc
                self._kill()
        assert last is not None
        raise last

    def restart(self) -> ConsulAgent:
        """Stop and start again on the same ports; a dev agent comes back empty."""
        self.stop()
        self._launch()
        return self

    def _launch(self) -> None:
        with self.log_path.open("ab") as log:
            log.write(f"--- llmgw: starting {' '.join(self.command())}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                self.command(),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=lifetime.die_with_parent if self.die_with_parent else None,
            )
        self._wait_for_leader()

    def _wait_for_leader(self) -> None:
        deadline = time.monotonic() + self.start_timeout
        with httpx.Client(timeout=2.0, verify=verify(self.tls.ca if self.tls else None)) as client:
            while time.monotonic() < deadline:
                if self._proc is None or self._proc.poll() is not None:
                    code = self._proc.returncode if self._proc else None
                    raise ConsulAgentError(
                        f"consul agent exited with status {code} before electing a leader; "
                        f"log {self.log_path}:\n{self.log_tail()}"
                    )
                try:
                    if self._ready(client):
                        return
                except (httpx.HTTPError, ValueError):
                    pass
                time.sleep(0.1)
        raise ConsulAgentError(
            f"consul agent at {self.url} named no leader within {self.start_timeout:.0f}s; "
            f"log {self.log_path}:\n{self.log_tail()}"
        )

    def _ready(self, client: httpx.Client) -> bool:
        # The leader's answer is a JSON string, "" until this server has elected itself.
        leader = client.get(f"{self.url}/v1/status/leader")
        if leader.status_code != 200 or not leader.json():
            return False
        # Sessions are refused until the agent's own node is in the catalog with a passing
        # serfHealth check, which lands a moment after the election.
        headers = {"X-Consul-Token": self.acl_master_token} if self.acl_master_token else {}
        checks = client.get(f"{self.url}/v1/health/node/{self.node_name}", headers=headers)
        if checks.status_code != 200:
            return False
        return any(c.get("CheckID") == "serfHealth" and c.get("Status") == "passing" for c in checks.json())

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL if it has not gone within `timeout`; returns its exit status."""
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self._kill()
        self._proc = None
        return proc.returncode

    def _kill(self) -> None:
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        self._proc = None

    def __enter__(self) -> ConsulAgent:
        if not self.running:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
