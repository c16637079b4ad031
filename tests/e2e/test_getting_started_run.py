"""docs/getting-started.md, followed literally on the dev stack with Nomad's and Consul's ACLs on.

Every fenced block of the page is read out of the markdown and run in the page's order, with the
page's variables: the models file is the page's YAML, `llmgw`, `curl`, `echo`, `grep` and `cut`
run as the page writes them, and each command's comment (`# exit 6`, `# two allocations
running`, `"Apply these changes?"`) is what the test expects of it. So the test fails when the
page and the product part ways: a renamed flag, a changed message, a token that cannot do what
the page asks of it.

What cannot run here is mapped, never skipped, and each mapping says why (`MAPPINGS`, the
placeholders in `PLACEHOLDERS` and the exported values in `exported_value`):
- no `nomad` binary can be installed on these machines, so each `nomad` command is the HTTP call
  the CLI makes for it (hashicorp/nomad `command/*.go`), against the stand-in, with the token the
  command line gives it, and its output is the lines of the CLI's output that the page reads;
- no Docker daemon: the dev stack runs the same llmgw from the virtualenv (`jobs/local/`);
- nothing can be downloaded: the models file's `hf://` source becomes the stack's tiny GGUF;
- Nomad's and Consul's APIs are HTTPS with certificates of only the names `nomad tls cert
  create` and `consul tls cert create` give (`localhost`, 127.0.0.1 among them), so the page's
  `https://nomad.example.com:4646` becomes `https://localhost:PORT`, CONSUL_HTTP_ADDR the
  stack's `https://127.0.0.1:PORT`, and the reader's shell holds NOMAD_CACERT and CONSUL_CACERT
  from the start, as operating.md section 9, which the page sends the reader to in step 3,
  sets them;
- no Consul DNS: `llmgw-router.service.consul:8080` is the router the stack registered.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import ssl
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hcl2
import httpx
import pytest

from tests.e2e.conftest import REPO, DevStack, start_devstack, wait_until
from tests.e2e.page_commands import Block, Command, page_blocks, run_in_terminal, shell_commands

PAGE = REPO / "docs" / "getting-started.md"
LLMGW = str(Path(sys.prefix) / "bin" / "llmgw")

pytestmark = pytest.mark.slow


# ----- the session: what the reader's shell holds -----------------------------------------------


@dataclass
class Session:
    stack: DevStack
    workdir: Path
    env: dict[str, str] = field(default_factory=dict)
    ran: list[str] = field(default_factory=list)

    @property
    def management(self) -> str:
        return str(self.stack.info["nomad_management_token"])

    def shell_env(self) -> dict[str, str]:
        # The reader installed llmgw, so it is on their PATH.
        path = f"{Path(LLMGW).parent}:{os.environ.get('PATH', '')}"
        return {**os.environ, "PATH": path, "COLUMNS": "200", "NO_COLOR": "1", **self.env}

    def nomad(self, method: str, path: str, token: str | None = None, **kw: Any) -> httpx.Response:
        """A call the `nomad` CLI makes, to the address and with the token the shell gives it:
        NOMAD_ADDR and NOMAD_TOKEN once exported, the installer's before (steps 1 to 3 are the
        install, done with the management token)."""
        addr = self.env.get("NOMAD_ADDR", self.stack.nomad)
        token = token if token is not None else self.env.get("NOMAD_TOKEN", self.management)
        headers = {"X-Nomad-Token": token}
        ca = ssl.create_default_context(cafile=self.env["NOMAD_CACERT"])
        return httpx.request(method, f"{addr}{path}", headers=headers, timeout=30, verify=ca, **kw)


def gpu_node(session: Session) -> dict[str, Any]:
    nodes = session.nomad("GET", "/v1/nodes").json()
    return next(n for n in nodes if n["NodePool"] == "gpu" and n["Status"] == "ready")


def watcher_address(session: Session) -> str:
    """The page says where to look, not with which token: llmgw-operator reads no services, so
    the one Consul's management token (the reader's UI login, say)."""
    entries = httpx.get(
        f"{session.stack.consul}/v1/health/service/llmgw-watcher",
        params={"passing": "1"},
        headers={"X-Consul-Token": session.stack.info["consul_management_token"]},
        timeout=10,
        verify=ssl.create_default_context(cafile=session.env["CONSUL_CACERT"]),
    ).json()
    service = entries[0]["Service"]
    return f"{service['Address'] or '127.0.0.1'}:{service['Port']}"


# The page's placeholders: each is something a reader looks up; here, where the stack has it.
PLACEHOLDERS: dict[str, Callable[[Session], str]] = {
    "<gpu-node>": lambda s: str(gpu_node(s)["ID"]),
    "<a watcher's address>": watcher_address,
    # What `nomad acl bootstrap` handed the installer; the stack keeps it in its state file.
    "<management token>": lambda s: s.management,
}


def exported_value(session: Session, name: str, page_value: str) -> str:
    """What the reader puts where the page shows an example value or `...`."""
    stack = session.stack
    if name == "NOMAD_ADDR":
        assert page_value.startswith("https://") and stack.nomad.startswith("https://"), page_value
        return stack.nomad
    if name == "NOMAD_TOKEN":
        # The reader's own token, holding the llmgw-operator policy the step names.
        return stack.env["NOMAD_TOKEN"]
    if name == "CONSUL_HTTP_ADDR":
        assert stack.consul.startswith("https://"), stack.consul
        return stack.consul
    if name == "CONSUL_HTTP_TOKEN":
        # The reader's own, holding the llmgw-operator Consul policy.
        return stack.env["CONSUL_HTTP_TOKEN"]
    if page_value in ("", "..."):
        raise AssertionError(f"the page exports {name} with no value the test knows how to fill")
    return page_value


# ----- `nomad` commands: the CLI's HTTP calls ---------------------------------------------------


def nomad_node_pool_apply(session: Session, args: list[str]) -> str:
    """`nomad node pool apply FILE` PUTs /v1/node/pool/NAME (command/node_pool_apply.go). The
    stand-in has no node pool endpoints: its pools are the fleet file's, so the pool the file
    declares must be the one the stack's GPU nodes are in."""
    (path,) = args
    pools = hcl2.loads((session.workdir / path).read_text())["node_pool"]
    (name,) = [next(iter(p)).strip('"') for p in pools]
    assert gpu_node(session)["NodePool"] == name
    return f'Successfully applied node pool "{name}"!'


def nomad_node_status_verbose(session: Session, args: list[str]) -> str:
    """`nomad node status -verbose NODE` (command/node_status.go): the lines the page greps,
    `Node Pool = ...`, each device instance as `<vendor>/<type>/<name>[<id>]` and the meta as
    `key = value`, read from GET /v1/node/NODE."""
    assert args[0] == "-verbose", args
    node = session.nomad("GET", f"/v1/node/{args[1]}").json()
    lines = [f"ID        = {node['ID']}", f"Name      = {node['Name']}", f"Node Pool = {node['NodePool']}"]
    for device in (node.get("NodeResources") or {}).get("Devices") or []:
        for instance in device.get("Instances") or []:
            lines.append(f"{device['Vendor']}/{device['Type']}/{device['Name']}[{instance['ID']}]")
    lines.append("Meta")
    lines += [f"{key} = {value}" for key, value in sorted((node.get("Meta") or {}).items())]
    return "\n".join(lines) + "\n"


def nomad_job_status(session: Session, args: list[str]) -> str:
    """`nomad job status JOB`: GET /v1/job/JOB and /v1/job/JOB/allocations; the allocation rows."""
    (job_id,) = args
    job = session.nomad("GET", f"/v1/job/{job_id}")
    assert job.status_code == 200, f"nomad job status {job_id}: {job.status_code} {job.text}"
    allocs = session.nomad("GET", f"/v1/job/{job_id}/allocations").json()
    rows = [f"{a['ID'][:8]}  {a['TaskGroup']}  {a['DesiredStatus']}  {a['ClientStatus']}" for a in allocs]
    return "\n".join(["Allocations", *rows]) + "\n"


def nomad_var_get(session: Session, args: list[str], token: str | None) -> str:
    """`nomad var get -item=KEY PATH` (command/var_get.go): GET /v1/var/PATH, the item's value."""
    item = next(a.split("=", 1)[1] for a in args if a.startswith("-item="))
    path = args[-1]
    # Why the page names the token: the reader's own (llmgw-operator) may not read the Variable.
    refused = session.nomad("GET", f"/v1/var/{path}", token=session.env["NOMAD_TOKEN"])
    assert refused.status_code == 403, f"the operator's token read {path}: {refused.status_code}"
    resp = session.nomad("GET", f"/v1/var/{path}", token=token)
    assert resp.status_code == 200, f"nomad var get {path}: {resp.status_code} {resp.text}"
    return str(resp.json()["Items"][item])


def run_nomad(session: Session, argv: list[str], token: str | None) -> str:
    verb = argv[1:4]
    if verb[:3] == ["node", "pool", "apply"]:
        return nomad_node_pool_apply(session, argv[4:])
    if verb[:2] == ["node", "status"]:
        return nomad_node_status_verbose(session, argv[3:])
    if verb[:2] == ["job", "status"]:
        return nomad_job_status(session, argv[3:])
    if verb[:2] == ["var", "get"]:
        return nomad_var_get(session, argv[3:], token)
    raise AssertionError(f"the page runs `{shlex.join(argv)}`, which this test does not map to Nomad's API")


# ----- running a line ---------------------------------------------------------------------------


def substitute(session: Session, line: str) -> str:
    for placeholder in re.findall(r"<[^<>|]+>", line):
        if placeholder not in PLACEHOLDERS:
            raise AssertionError(f"the page has a placeholder the test cannot fill: {placeholder}")
        line = line.replace(placeholder, PLACEHOLDERS[placeholder](session))
    # No Consul DNS here: the router's service name is the router the stack registered.
    line = line.replace("http://llmgw-router.service.consul:8080", session.stack.router)
    # The page's scratch directory is the test's own.
    return line.replace("/tmp/jobs", str(session.workdir / "jobs"))


def run_pipeline(session: Session, line: str) -> subprocess.CompletedProcess[str]:
    """One command line: `nomad ...` stages through the API, the rest by a real shell."""
    results = []
    for part in line.split(" && "):
        stages = part.split(" | ")
        first = shlex.split(stages[0])
        token = None
        while first and re.fullmatch(r"[A-Z_]+=.*", first[0]):
            name, _, value = first.pop(0).partition("=")
            assert name == "NOMAD_TOKEN", f"a per-command {name}= the test does not map"
            token = value
        if first[0] == "nomad":
            out = run_nomad(session, first, token)
            if len(stages) == 1:
                results.append(subprocess.CompletedProcess(first, 0, out, ""))
                continue
            rest = " | ".join(stages[1:])
            results.append(
                subprocess.run(
                    ["bash", "-c", rest], input=out, capture_output=True, text=True, env=session.shell_env()
                )
            )
            continue
        results.append(
            subprocess.run(
                ["bash", "-o", "pipefail", "-c", part],
                cwd=session.workdir,
                capture_output=True,
                text=True,
                env=session.shell_env(),
                timeout=180,
            )
        )
        if results[-1].returncode != 0:
            break
    last = results[-1]
    return subprocess.CompletedProcess(line, last.returncode, "".join(r.stdout for r in results), last.stderr)


def run_export(session: Session, line: str) -> None:
    # `$(...)` first: its command runs as any other line would.
    def inner(match: re.Match[str]) -> str:
        result = run_pipeline(session, match.group(1))
        assert result.returncode == 0, f"$({match.group(1)}): {result.stderr}"
        return shlex.quote(result.stdout.strip())

    expanded = re.sub(r"\$\((.+?)\)(?=\s|$)", inner, line)
    for assignment in shlex.split(expanded)[1:]:
        name, _, value = assignment.partition("=")
        session.env[name] = exported_value(session, name, value)


# ----- what each command's comment promises -----------------------------------------------------

NUMBERS = {"one": 1, "two": 2, "three": 3}


def check_llmgw(session: Session, command: Command) -> None:
    argv = shlex.split(command.line)
    verb = argv[1]
    if verb == "apply":
        # The page shows the question, so the reader has a terminal and answers it.
        code, output = run_in_terminal(argv, "y", cwd=session.workdir, env=session.shell_env())
        assert code == 0, output
        for quoted in re.findall(r'"([^"]+)"', command.comment):
            assert quoted in output, f"{command.line}: no {quoted!r} in:\n{output}"
        promised = command.comment.split("then: ", 1)[1]
        assert promised in output, f"{command.line}: no {promised!r} in:\n{output}"
        return
    if verb == "ctl":
        # The model starts after apply; the page's promise is the state it comes to.
        model, _, state = command.comment.partition(" ... ")

        def shows_it() -> str | None:
            result = run_pipeline(session, command.line)
            line = next((ln for ln in result.stdout.splitlines() if model in ln), "")
            return result.stdout if result.returncode == 0 and state in line else None

        wait_until(f"{command.line} showing {model} {state}", shows_it, timeout=180, interval=2)
        return
    result = run_pipeline(session, command.line)
    output = result.stdout + result.stderr
    exit_code = re.search(r"\bexit (\d+)", command.comment)
    if verb == "render" and "--check" in argv:
        # The comment is about a file with mistakes; the page's own file is valid.
        assert result.returncode == 0, output
        assert "valid, 1 models (qwen2.5-0.5b)" in output
        broken = session.workdir / "broken.yaml"
        broken.write_text((session.workdir / argv[-1]).read_text().replace("gpus: 1", "gpus: one"))
        bad = run_pipeline(session, command.line.replace(argv[-1], broken.name))
        assert exit_code and bad.returncode == int(exit_code.group(1)), bad.stdout + bad.stderr
        assert "profiles.llamacpp-1x24g.gpus" in bad.stderr, bad.stderr
        return
    if verb == "render":
        assert result.returncode == 0, output
        written = sorted(p.name for p in (session.workdir / "jobs").iterdir())
        assert (
            len(written) == 1 and written[0].endswith(".nomad.hcl") and f"wrote {session.workdir}" in output
        )
        return
    if verb == "plan":
        assert exit_code, command.comment
        assert result.returncode == int(exit_code.group(1)), output
        shown = command.comment.split(", fits:")[0]
        assert shown in output and "fits: 1 replica" in output, output
        return
    raise AssertionError(f"`{command.line}`: the test has no expectation for llmgw {verb}")


def check_nomad(session: Session, command: Command) -> None:
    result = run_pipeline(session, command.line)
    assert result.returncode == 0, f"{command.line}: {result.stderr}"
    output = result.stdout
    if "job status" in command.line:
        if command.comment == "one per GPU node":
            nodes = session.nomad("GET", "/v1/nodes").json()
            count = sum(1 for n in nodes if n["NodePool"] == "gpu" and n["Status"] == "ready")
        else:
            count = NUMBERS[command.comment.split()[0]]

        def running() -> list[str] | None:
            rows = run_pipeline(session, command.line).stdout.splitlines()
            found = [row for row in rows if row.endswith(" running")]
            return found if len(found) == count else None

        wait_until(f"{command.line}: {command.comment}", running)
        return
    if "grep llmgw_engine_" in command.line:
        assert re.search(r"^llmgw_engine_llama_cpp = .*b6500", output, re.M), output
        return
    if "grep -E 'Node Pool|nvidia'" in command.line:
        assert "Node Pool = gpu" in output and "nvidia/gpu/" in output, output
        return
    if "node pool apply" in command.line:
        assert 'applied node pool "gpu"' in output
        return
    raise AssertionError(f"`{command.line}`: the test has no expectation for it")


def check_curl(session: Session, command: Command) -> None:
    result = run_pipeline(session, command.line)
    assert result.returncode == 0, result.stderr
    body = json.loads(result.stdout)
    assert body["object"] == "chat.completion" and body["model"] == "qwen2.5-0.5b", body
    assert body["choices"][0]["message"]["role"] == "assistant", body


def run_command(session: Session, command: Command) -> None:
    session.ran.append(command.line)
    line = substitute(session, command.line)
    command = Command(command.step, line, command.comment)
    program = shlex.split(line.split("&&")[0])[0]
    if program == "export":
        run_export(session, line)
    elif program == "docker":
        # No Docker daemon here: the dev stack runs the same llmgw from the virtualenv through
        # jobs/local/'s raw_exec jobs. What is checked: the build context the page names.
        assert line.startswith("docker build -t registry.example.com/llmgw:") and " . " in line
        assert (REPO / "Dockerfile").exists()
    elif program == "llmgw":
        check_llmgw(session, command)
    elif program == "curl":
        check_curl(session, command)
    elif program in ("nomad", "echo"):
        check_nomad(session, command)
    else:
        raise AssertionError(f"the page runs {program}, which the test does not know: `{line}`")


def write_models_file(session: Session, block: Block) -> None:
    """The page's models file, as written; only its source is the stack's tiny GGUF, since
    nothing can be downloaded here."""
    text = block.text
    (source,) = re.findall(r"source: (hf://\S+)", text)
    tiny = Path(session.stack.info["state_dir"]) / "models" / "tiny-llama.gguf"
    assert tiny.exists(), tiny
    (session.workdir / "models.yaml").write_text(text.replace(source, f"file://{tiny}"))


# ----- the run ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def acl_stack(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The cluster as the page finds it at step 1 and leaves it after step 3: Nomad and Consul
    with ACLs on and their APIs over HTTPS, llmgw's policies and tokens, its three jobs
    running, no models."""
    stack = start_devstack(tmp_path_factory.mktemp("devstack-acl"), "--acl", "--tls", "--no-models")
    try:
        yield stack
    finally:
        stack.down()


def test_the_page_parses_into_the_commands_this_run_knows() -> None:
    """The run below goes through every block; this names them, so that a new block on the page
    shows here as a change to read, not as a silently passing run."""
    blocks = page_blocks(PAGE.read_text(encoding="utf-8"))
    assert [b.lang for b in blocks] == ["shell", "shell", "shell", "yaml", "shell", "shell", "shell"]
    commands = [
        c.line.split()[0] + " " + c.line.split()[1]
        for b in blocks
        if b.lang == "shell"
        for c in shell_commands(b)
    ]
    assert commands == [
        "echo 'node_pool",
        "nomad node",
        "docker build",
        "nomad job",
        "nomad job",
        "nomad node",
        "llmgw render",
        "llmgw render",
        "export NOMAD_ADDR=https://nomad.example.com:4646",
        "llmgw plan",
        "llmgw apply",
        "export LLMGW_ADMIN_ADDR=http://<a",
        "export LLMGW_ADMIN_TOKEN=$(NOMAD_TOKEN=<management",
        "export API_KEY=$(NOMAD_TOKEN=<management",
        "llmgw ctl",
        "curl -s",
    ]


def test_getting_started_from_the_docs_on_a_cluster_with_nomad_and_consul_acls(
    acl_stack: DevStack, tmp_path: Path
) -> None:
    session = Session(acl_stack, tmp_path)
    session.env["NOMAD_CACERT"] = acl_stack.env["NOMAD_CACERT"]
    session.env["CONSUL_CACERT"] = acl_stack.env["CONSUL_CACERT"]
    blocks = page_blocks(PAGE.read_text(encoding="utf-8"))
    for block in blocks:
        if block.lang == "yaml":
            write_models_file(session, block)
            continue
        assert block.lang == "shell", f"{block.step}: a ```{block.lang} block the test does not run"
        for command in shell_commands(block):
            try:
                run_command(session, command)
            except AssertionError as exc:
                raise AssertionError(
                    f"docs/getting-started.md, {block.step}: `{command.line}`:\n{exc}"
                ) from exc
    assert any(line.startswith("llmgw apply") for line in session.ran)


def test_prometheus_finds_llmgw_on_a_consul_with_acls_using_the_rules_its_config_names(
    acl_stack: DevStack,
) -> None:
    """jobs/prometheus/prometheus.yml names the Consul rules its token needs; the stack gives
    Prometheus a token of exactly those. Without `agent` read, Prometheus's Consul discovery
    cannot learn its datacenter (403 on /v1/agent/self) and finds nothing."""

    def targets() -> set[str] | None:
        body = httpx.get(f"{acl_stack.env['PROMETHEUS_ADDR']}/api/v1/targets", timeout=10).json()
        found = {t["labels"]["job"] for t in body["data"]["activeTargets"] if t["health"] == "up"}
        return found if {"llmgw-watcher", "llmgw-router", "llmgw-node-agent"} <= found else None

    wait_until("Prometheus scraping the watchers, the router and the node agents", targets, timeout=60)
