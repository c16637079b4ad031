"""`python -m devstack up`: the whole dev stack in one foreground process, and `down`.

Start order is dependency order (Consul, Nomad, the watchers and the router, then the models);
stop order is the reverse, watchers first, so that no watcher sees the engines go away and
counts it as start failures or re-registers jobs that are being stopped.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import httpx

from devstack import agent_tls, consul_acls, demo_models, fleet, nomad_acls, nomad_agent, processes, services
from devstack import prometheus as prom
from devstack import s3_weights as s3
from devstack.addresses import Addresses
from devstack.consul_agent import ConsulAgent
from devstack.ports import free_port
from devstack.tour import show_tour

REPO = Path(__file__).resolve().parents[1]
DEFAULT_STATE_DIR = REPO / ".devstack"

Say = Callable[[str], None]


def say(text: str) -> None:
    print(f"devstack: {text}", flush=True)


class StackError(RuntimeError):
    """The stack could not be brought up; the message names the part and its log."""


class Stop(Exception):
    """SIGTERM or SIGINT arrived: stop everything that was started."""


@dataclass
class UpOptions:
    state_dir: Path = DEFAULT_STATE_DIR
    tiny: bool = False
    nodes: Path = fleet.DEMO_FLEET
    template: Path = demo_models.TEMPLATE
    services: str = "nomad"  # nomad: llmgw's own jobs from jobs/local; process: child processes
    nomad: str = "auto"  # auto: a real `nomad` when on PATH; standin; real
    # Nomad's restart and reschedule delays (15 s, then 1 min, 2 min, ...) run this many times
    # faster in the stand-in, so that kev-0.5b's five failed starts take about a minute.
    clock_speed: float = 4.0
    watchers: int = 2
    max_start_failures: int = 5
    wait_timeout: float = 600.0
    tour: bool = True
    # The alert rules' `for:` durations are cut to this in the dev stack's copy, so that the
    # demo's alerts fire within a minute (the shipped rules wait up to ten).
    alert_for: str = prom.DEFAULT_ALERT_FOR
    # Nomad's ACLs on (the stand-in's --acl-bootstrap-token), llmgw on its own policies' tokens.
    acl: bool = False
    # False: stop where an operator stands before writing a models file (getting-started step 4).
    apply_models: bool = True
    # Nomad's API over HTTPS, with a certificate of only the names `nomad tls cert create` gives.
    tls: bool = False
    s3: bool = False  # and tiny-s3, fetched from a local S3 that enforces credentials (s3_weights.py)


class Stack:
    def __init__(self, options: UpOptions, say: Say = say) -> None:
        self.options = options
        self.say = say
        self.dir = options.state_dir.resolve()
        self.logs = self.dir / "logs"
        self.engines_dir = self.dir / "engines"
        self.models_dir = self.dir / "models"
        self.models_file = self.dir / "models.yaml"
        self.nodes_file = self.dir / "nodes.yaml"
        self.state = processes.StackState(up_pid=os.getpid())
        self.addr = Addresses()
        self.consul: ConsulAgent | None = None
        self.nomad_proc: subprocess.Popen[bytes] | None = None
        self.prometheus: prom.Prometheus | None = None
        self.nomad_is_standin = True
        self.services = services.Services()
        self.gemma_is_real = False
        self.tokens: nomad_acls.StackTokens | None = None
        self.consul_tokens: consul_acls.ConsulTokens | None = None
        self.nomad_ca: Path | None = None
        self.consul_ca: Path | None = None
        self.s3: s3.S3Weights | None = None

    @property
    def management_token(self) -> str | None:
        """What the stack's own Nomad calls (registering, stopping) carry: an installer's token."""
        return self.tokens.management if self.tokens else None

    # ----- up -------------------------------------------------------------------------------

    def claim_state_dir(self) -> None:
        """Refuse to start over a running stack; clear what a dead one left."""
        self.dir.mkdir(parents=True, exist_ok=True)
        old = processes.StackState.load(self.dir)
        if old is not None and old.up_pid != os.getpid() and processes.alive(old.up_pid):
            raise StackError(
                f"a dev stack is already running from {self.dir} (devstack up, pid {old.up_pid}); "
                "stop it with 'python -m devstack down' or use another --state-dir"
            )
        if old is not None:
            processes.stop_children(old, self.say)
        # Allocation directories hold copies of the weights; a new stack starts without them.
        shutil.rmtree(self.dir / "nomad", ignore_errors=True)
        self.logs.mkdir(parents=True, exist_ok=True)
        self.save()

    def save(self) -> None:
        self.state.env = self.addr.env()
        self.state.info = {
            "state_dir": str(self.dir),
            "watchers": self.addr.watchers,
            "models_file": str(self.models_file),
            "nodes_file": str(self.nodes_file),
            "engines_dir": str(self.engines_dir),
            "logs": str(self.logs),
            "gemma_is_real": self.gemma_is_real,
            "services": self.options.services,
            "nomad": "stand-in" if self.nomad_is_standin else "nomad agent -dev",
            "nomad_acl": self.options.acl,
            # The installer's token: Variables and ACLs need it (the operator's token reads neither).
            "nomad_management_token": self.management_token or "",
            "consul_management_token": self.consul_tokens.management if self.consul_tokens else "",
        }
        self.state.save(self.dir)

    def _track(self, name: str, pid: int, log: Path) -> None:
        self.state.children.append(processes.Child(name, pid, str(log)))
        self.save()

    def up(self) -> None:
        o = self.options
        self.claim_state_dir()
        _, self.gemma_is_real = demo_models.prepare_weights(self.models_dir, tiny=o.tiny, say=self.say)
        demo_models.write_effective_models(self.models_file, self.models_dir, o.template)
        fleet.install_engines(self.engines_dir)
        # The demo models name node_pool gpu, as a cluster set up by the operating guide would.
        fleet.effective_nodes(o.nodes, self.engines_dir, self.nodes_file, gpu_pool=fleet.GPU_POOL)
        if o.s3:
            self.s3 = s3.set_up(self)
        self.say(f"models file: {self.models_file} (from {o.template})")

        self.say("starting a Consul dev agent ...")
        master = consul_acls.new_management_token() if o.acl else None
        consul_tls = None
        if o.tls:
            consul_tls = agent_tls.write_agent_certificates(
                self.dir / "tls" / "consul", role_name=agent_tls.CONSUL_SERVER_NAME
            )
            self.consul_ca = consul_tls.ca
            self.addr.consul_cacert = str(consul_tls.ca)
        self.consul = ConsulAgent(
            log_dir=self.logs, die_with_parent=True, acl_master_token=master, tls=consul_tls
        ).start()
        assert self.consul.pid is not None
        self._track("consul", self.consul.pid, self.consul.log_path)
        self.addr.consul = self.consul.url
        self.say(f"Consul {self.consul.url} (UI {self.consul.url}/ui/)")
        if master:
            self.consul_tokens = consul_acls.set_up(self.consul.url, master, self.consul_ca)
            self.addr.consul_token = self.consul_tokens.operator
            self.save()
            self.say(
                "Consul ACLs on (deny by default): policies from docs/policies/*.consul.hcl, a token each "
                "for the watcher, the router, the operator (CONSUL_HTTP_TOKEN) and Prometheus; the "
                "management token is in state.json (info.consul_management_token)"
            )

        self._start_prometheus()
        self._start_nomad()
        self._start_services()
        if o.apply_models:
            self._apply()
        else:
            self.say(f"no models applied (--no-models); apply them with: llmgw apply {self.models_file}")
        self.write_env_file()
        self.save()

    def _start_prometheus(self) -> None:
        assert self.consul is not None
        o = self.options
        # A certificate for the expiry metric to watch, so that the certificate panels and
        # alerts have a series here too; the watchers and routers read LLMGW_TLS_CERTS from the
        # environment Nomad passes on to raw_exec tasks (child processes inherit it as well).
        cert = prom.write_watched_certificate(self.dir / "tls" / "watched-cert.pem")
        watched = [p for p in os.environ.get("LLMGW_TLS_CERTS", "").split(",") if p]
        os.environ["LLMGW_TLS_CERTS"] = ",".join(dict.fromkeys([*watched, str(cert)]))
        self.say(f"starting Prometheus (alert rules with for: cut to {o.alert_for}) ...")
        self.prometheus = prom.start(
            state_dir=self.dir / "prometheus",
            consul_url=self.consul.url,
            consul_token=self.consul_tokens.prometheus if self.consul_tokens else None,
            consul_ca=self.consul_ca,
            log=self.logs / "prometheus.log",
            alert_for=o.alert_for,
        )
        self._track("prometheus", self.prometheus.process.pid, self.prometheus.log)
        self.addr.prometheus = self.prometheus.url
        self.save()
        self.say(
            f"Prometheus {self.prometheus.url} (alerts {self.prometheus.url}/classic/alerts), "
            "scraping llmgw-watcher and llmgw-router found in Consul"
        )

    def _start_nomad(self) -> None:
        o = self.options
        binary = nomad_agent.find_nomad() if o.nomad in ("auto", "real") else None
        if o.nomad == "real" and binary is None:
            raise StackError("--nomad real: no 'nomad' binary on PATH")
        if (o.acl or o.tls) and binary:
            # A real agent would need `acl { enabled = true }` and `nomad acl bootstrap`; not
            # written yet, and a stack that silently ran without ACLs would prove nothing.
            raise StackError("--acl and --tls run with the Nomad stand-in only for now: pass --nomad standin")
        management = nomad_acls.new_management_token() if o.acl else None
        tls = agent_tls.write_agent_certificates(self.dir / "tls" / "nomad") if o.tls else None
        self.nomad_ca = tls.ca if tls else None
        self.addr.nomad_cacert = str(tls.ca) if tls else ""
        log = self.logs / "nomad.log"
        assert self.consul is not None
        if binary:
            self.say(f"starting a real Nomad dev agent ({binary}) ...")
            self.nomad_is_standin = False
            proc, url = nomad_agent.start_real(
                binary=binary,
                consul_url=self.consul.url,
                engines_dir=self.engines_dir,
                state_dir=self.dir,
                log=log,
            )
        else:
            self.say(
                f"starting the Nomad stand-in on the simulated fleet {o.nodes.name} "
                f"(no 'nomad' on PATH; restart delays x{o.clock_speed:g}) ..."
            )
            proc, url = nomad_agent.start_standin(
                nodes=self.nodes_file,
                consul_url=self.consul.url,
                data_dir=self.dir / "nomad",
                log=log,
                clock_speed=o.clock_speed,
                acl_bootstrap_token=management,
                consul_token=self.consul_tokens.management if self.consul_tokens else None,
                tls=tls,
                consul_ca=self.consul_ca,
            )
        self.nomad_proc = proc
        self._track("nomad", proc.pid, log)
        self.addr.nomad = url
        self.say(f"Nomad {url}")
        if management:
            assert self.consul_tokens is not None
            self.tokens = nomad_acls.set_up(url, management, self.consul_tokens, self.nomad_ca)
            self.addr.nomad_token = self.tokens.operator
            self.addr.admin_token = self.tokens.admin
            self.addr.api_key = self.tokens.api_key
            self.save()
            self.say(
                f"Nomad ACLs on: policies from {nomad_acls.POLICIES_DIR.relative_to(REPO)}, a token each for "
                f"the watcher, the node agent and the operator (NOMAD_TOKEN, llmgw-operator); the management "
                f"token is in {self.dir / processes.STATE_FILE} (info.nomad_management_token)"
            )

    def _start_services(self) -> None:
        o = self.options
        assert self.consul is not None
        common: dict[str, Any] = {
            "nomad_url": self.addr.nomad,
            "consul_url": self.consul.url,
            "venv": services.venv_root(),
            "watchers": o.watchers,
            "max_start_failures": o.max_start_failures,
            "router_port": free_port(),
            "say": self.say,
            "tokens": self.tokens,
            "nomad_ca": self.nomad_ca,
            "consul_ca": self.consul_ca,
        }
        if o.services == "process":
            self.services = services.start_as_processes(logs_dir=self.logs, **common)
            for child in self.services.children:
                self._track(child.name, child.pid, Path(child.log))
        else:
            where = (
                f"{self.dir / 'nomad'}/alloc/<alloc-id>/alloc/logs"
                if self.nomad_is_standin
                else "nomad alloc logs"
            )
            # A real `nomad agent -dev` is one node, in the GPU pool: llmgw's own jobs go to `all`.
            pool = "default" if self.nomad_is_standin else "all"
            self.services = services.start_as_jobs(logs_hint=where, node_pool=pool, **common)
        self.addr.router = self.services.router_url
        self.addr.watchers = self.services.watcher_urls
        self.addr.admin = self._leader_admin_url()
        self.save()
        self.say(
            f"router {self.addr.router}; watchers {', '.join(self.addr.watchers)} (leader {self.addr.admin})"
        )

    def _leader_admin_url(self, timeout: float = 60.0) -> str:
        """The leading watcher's admin API: any watcher answers reads, only the leader `retry`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for url in self.addr.watchers:
                try:
                    body = httpx.get(f"{url}/v1/admin/models", timeout=5).json()
                except (httpx.HTTPError, ValueError):
                    continue
                if body.get("is_leader"):
                    return url
                leader = body.get("leader") or {}
                if leader.get("address"):
                    return f"http://{leader['address']}"
            time.sleep(0.5)
        self.say("no watcher leads yet; LLMGW_ADMIN_ADDR names the first one")
        return self.addr.watchers[0] if self.addr.watchers else ""

    def _apply(self) -> None:
        if self.s3 is not None:
            s3.put_keys(self.addr.nomad, self.s3, self.management_token, self.nomad_ca)
        # Asked nothing (no one is at a terminal here), and phi-4 fits nowhere on purpose.
        flags = ["--auto-approve", "--allow-unplaceable"]
        self.say(f"llmgw apply {' '.join(flags)} {self.models_file}")
        result = subprocess.run(
            [str(services.venv_root() / "bin" / "llmgw"), "apply", *flags, str(self.models_file)],
            env={**os.environ, **self.addr.env()},
            capture_output=True,
            text=True,
            timeout=120,
        )
        for line in (result.stdout + result.stderr).strip().splitlines():
            self.say(f"  {line}")
        if result.returncode != 0:
            raise StackError(f"llmgw apply {self.models_file} failed with exit code {result.returncode}")

    def expected(self) -> dict[str, str]:
        """What each demo model should come to here: a real `nomad agent -dev` is one node with
        no fabric, so the two-node replica can only be unplaceable there."""
        if not self.options.apply_models:
            return {}
        if self.nomad_is_standin:
            return {**demo_models.EXPECTED, **({s3.MODEL: "serving"} if self.s3 else {})}
        return {**demo_models.EXPECTED, "gemma-3-270m-split": "unplaceable"}

    def wait_for_demo(self, expected: dict[str, str] = demo_models.EXPECTED) -> dict[str, dict[str, Any]]:
        """Print each model's changes until every one is where the demo wants it."""
        if not expected:
            return {}
        self.say(
            "waiting for the models: Gemma to serve (also split over two nodes), kev-0.5b to be parked, "
            "phi-4 to be unplaceable"
        )
        deadline = time.monotonic() + self.options.wait_timeout
        shown: dict[str, str] = {}
        models: dict[str, dict[str, Any]] = {}
        while True:
            models = self.admin_models()
            for name, model in sorted(models.items()):
                line = demo_models.describe(model)
                if shown.get(name) != line:
                    shown[name] = line
                    self.say(f"  {name}: {line}")
            missing = [n for n, want in expected.items() if not demo_models.reached(models.get(n), want)]
            if not missing:
                return models
            if time.monotonic() > deadline:
                self.say(
                    f"still waiting after {self.options.wait_timeout:.0f}s for {', '.join(missing)}; "
                    f"showing the tour as things stand (logs in {self.logs})"
                )
                return models
            time.sleep(1.0)

    def admin_models(self) -> dict[str, dict[str, Any]]:
        try:
            body = httpx.get(f"{self.addr.admin}/v1/admin/models", timeout=10).json()
        except (httpx.HTTPError, ValueError):
            return {}
        return {str(m.get("model")): m for m in body.get("models", []) if isinstance(m, dict)}

    def write_env_file(self) -> None:
        """`.devstack/env`, for `source .devstack/env` in another shell (the venv's bin/ too)."""
        lines = [f"export {k}={shlex.quote(v)}" for k, v in self.addr.env().items()]
        lines.append(f'export PATH={shlex.quote(str(services.venv_root() / "bin"))}:"$PATH"')
        (self.dir / "env").write_text("\n".join(lines) + "\n")

    # ----- down -----------------------------------------------------------------------------

    def down(self) -> None:
        nomad_url = self.addr.nomad
        token = self.management_token
        if nomad_url and self.nomad_proc is not None and self.nomad_proc.poll() is None:
            self.say("stopping the watchers ...")
            if self.options.services == "nomad":
                # Watchers first: with them gone nothing re-registers a job being stopped.
                services.stop_job(nomad_url, services.WATCHER_JOB, token, self.nomad_ca)
                services.wait_allocs_gone(nomad_url, services.WATCHER_JOB, 40, token, self.nomad_ca)
            else:
                for child in self.services.children:
                    if child.name.startswith("watcher"):
                        processes.stop_group(child.pid)
            self.say("stopping the router and the models' jobs ...")
            for job_id in services.job_ids(nomad_url, token, self.nomad_ca):
                services.stop_job(nomad_url, job_id, token, self.nomad_ca)
            # Engines get their kill_timeout to exit; a real Nomad agent would leave them
            # running if it stopped first.
            services.wait_allocs_gone(nomad_url, None, 45, token, self.nomad_ca)
        if self.state.children:
            self.say(f"stopping {', '.join(c.name for c in reversed(self.state.children))} ...")
        processes.stop_children(self.state, self.say)
        self.consul = None
        self.nomad_proc = None
        self.prometheus = None
        (self.dir / processes.STATE_FILE).unlink(missing_ok=True)


def run_up(options: UpOptions, say: Say = say) -> int:
    """Bring the stack up, show the tour, stay until Ctrl-C or `devstack down`, stop it all."""

    def stop(signum: int, frame: FrameType | None) -> None:
        raise Stop(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    stack = Stack(options, say)
    code = 0
    try:
        stack.up()
        models = stack.wait_for_demo(stack.expected())
        if options.tour and options.apply_models:
            show_tour(stack, models)
        stack.state.ready = True
        stack.save()
        say("the stack is up; Ctrl-C here, or 'python -m devstack down' from another shell, stops it")
        while True:
            time.sleep(1.0)
            prometheus = stack.prometheus.process if stack.prometheus else None
            for name, proc in (("nomad", stack.nomad_proc), ("prometheus", prometheus)):
                if proc is not None and proc.poll() is not None:
                    raise StackError(f"{name} exited with status {proc.returncode}; see {stack.logs}")
            if stack.consul is not None and not stack.consul.running:
                raise StackError(f"consul exited; see {stack.consul.log_path}")
    except Stop as exc:
        say(f"{exc}: stopping everything this stack started ...")
    except (
        StackError,
        services.ServiceError,
        nomad_agent.NomadStartError,
        prom.PrometheusError,
        nomad_acls.AclSetupError,
        consul_acls.ConsulAclError,
        RuntimeError,
        OSError,
        ValueError,
    ) as exc:
        say(f"error: {exc}")
        code = 1
    finally:
        # A second Ctrl-C must not cut the clean-up short and leave engines behind.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stack.down()
        say("stopped")
    return code


def run_down(state_dir: Path, say: Say = say, timeout: float = 120.0) -> int:
    state = processes.StackState.load(state_dir)
    if state is None:
        say(f"no dev stack state in {state_dir}; nothing to stop")
        return 0
    if processes.alive(state.up_pid):
        say(f"asking devstack up (pid {state.up_pid}) to stop what it started ...")
        os.kill(state.up_pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while processes.alive(state.up_pid) and time.monotonic() < deadline:
            time.sleep(0.2)
    # Whatever is left (devstack up was killed, or did not finish in time) is stopped by group.
    processes.stop_children(state, say)
    (state_dir / processes.STATE_FILE).unlink(missing_ok=True)
    say("stopped")
    return 0
