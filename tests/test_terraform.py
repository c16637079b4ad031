"""The Terraform module in terraform/: formatted, parseable, pointing at jobspecs that exist with
the variables they declare, storing the tokens where the jobs' templates look, and granting each
component exactly the ACLs its calls need (tests/acl_table.py), checked both on paper and, for
Consul, against a real Consul with ACLs enforced.

Providers cannot be downloaded here, so `terraform validate` cannot run; these tests cover what
it would have caught in the module's own wiring, and more that it would not.
"""

from __future__ import annotations

import ast
import inspect
import re
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import hcl2
import httpx
import pytest
from hcl2 import SerializationOptions

from devstack.consul_agent import ConsulAgent, ConsulAgentError
from nomad_driver.spec import load_models
from tests import acl_table as acl
from tests import api_scan as scan
from tests.fixtures.consul import ACL_MASTER_TOKEN, AclConsulAgent

ROOT = Path(__file__).resolve().parent.parent
MODULE = ROOT / "terraform"
EXAMPLE = MODULE / "examples" / "basic"
HCL = SerializationOptions(strip_string_quotes=True, explicit_blocks=False, with_comments=False)

# Terraform resource name -> the component whose calls tests/acl_table.py lists.
COMPONENT_OF = {"watcher": "watcher", "router": "router", "node_agent": "node-agent", "operator": "operator"}
JOBSPEC_OF = {
    "watcher": "llmgw-watcher.nomad.hcl",
    "router": "llmgw-router.nomad.hcl",
    "node_agent": "llmgw-node-agent.nomad.hcl",
}


def load_hcl(path: Path) -> dict[str, Any]:
    with path.open(encoding="utf-8") as f:
        return hcl2.load(f, serialization_options=HCL)


def heredoc(value: str) -> str:
    """The text of a `<<-EOT ... EOT` heredoc as python-hcl2 hands it back, indentation removed."""
    m = re.fullmatch(r"<<(-?)([A-Za-z_][A-Za-z0-9_]*)\n(.*)\n[ \t]*\2", value, re.S)
    assert m, f"not a heredoc: {value[:60]!r}"
    lines = m.group(3).split("\n")
    indent = min((len(x) - len(x.lstrip()) for x in lines if x.strip()), default=0) if m.group(1) else 0
    return "\n".join(x[indent:] for x in lines) + "\n"


def module_files() -> list[Path]:
    return sorted(MODULE.rglob("*.tf"))


def blocks(kind: str, files: list[Path] | None = None) -> dict[tuple[str, str], dict[str, Any]]:
    """`resource`/`data` blocks of the module as {(type, name): body}."""
    found: dict[tuple[str, str], dict[str, Any]] = {}
    for path in files or sorted(MODULE.glob("*.tf")):
        for entry in load_hcl(path).get(kind, []):
            for rtype, named in entry.items():
                for name, body in named.items():
                    assert (rtype, name) not in found, f"{kind} {rtype}.{name} declared twice"
                    found[(rtype, name)] = body
    return found


def named_blocks(kind: str, path: Path) -> dict[str, dict[str, Any]]:
    """`variable`/`output` blocks of one file as {name: body}."""
    return {name: body for entry in load_hcl(path).get(kind, []) for name, body in entry.items()}


def locals_() -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for path in sorted(MODULE.glob("*.tf")):
        for entry in load_hcl(path).get("locals", []):
            merged.update(entry)
    return merged


def resolve(expr: str) -> str:
    """Substitute `${path.module}` and `${local.x}`/`${local.x.y}` (literal locals only)."""
    values = locals_()

    def local(m: re.Match[str]) -> str:
        value: Any = values
        for part in m.group(1).split("."):
            value = value[part]
        assert isinstance(value, str), f"local.{m.group(1)} is not a literal string"
        return resolve(value)

    expr = expr.replace("${path.module}", str(MODULE))
    return re.sub(r"\$\{local\.([A-Za-z0-9_.]+)\}", local, expr)


NOMAD_VAR = re.compile(r'nomadVar\s+"([^"]+)"\s*-?\}\}(.*?)\{\{-?\s*end', re.S)
TEMPLATE_KEY = re.compile(r"\{\{-?\s*\.(\w+)\s*-?\}\}")


def jobspec_path(job_body: dict[str, Any]) -> Path:
    m = re.fullmatch(r'\$\{file\("(.+)"\)\}', job_body["jobspec"])
    assert m, f"jobspec is not file(...): {job_body['jobspec']!r}"
    return Path(resolve(m.group(1))).resolve()


# --- Form ----------------------------------------------------------------------------------------


def test_terraform_fmt_check_passes() -> None:
    terraform = shutil.which("terraform")
    if terraform is None:
        pytest.skip("the terraform binary is not installed, so `terraform fmt -check` cannot run")
    result = subprocess.run(
        [terraform, "fmt", "-check", "-recursive", "-diff", str(MODULE)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, f"terraform fmt would change:\n{result.stdout}{result.stderr}"


def test_every_tf_file_parses() -> None:
    files = module_files()
    assert {p.name for p in files} >= {"main.tf", "variables.tf", "outputs.tf", "versions.tf", "acl.tf"}
    assert EXAMPLE / "main.tf" in files
    for path in files:
        assert isinstance(load_hcl(path), dict), path


def test_every_variable_has_a_type_and_a_description() -> None:
    for path in module_files():
        for name, body in named_blocks("variable", path).items():
            where = f"{path.relative_to(ROOT)}: variable {name!r}"
            assert body.get("type"), f"{where} has no type"
            assert str(body.get("description", "")).strip(), f"{where} has no description"


def test_secret_variables_are_sensitive_and_secret_outputs_are_marked() -> None:
    variables = named_blocks("variable", MODULE / "variables.tf")
    for name in ("api_keys", "admin_token"):
        assert variables[name].get("sensitive") is True, f"variable {name} must be sensitive"
    secret = re.compile(r"secret_id|random_password|admin_token|api_keys")
    for path in module_files():
        for name, body in named_blocks("output", path).items():
            if secret.search(str(body["value"])):
                assert body.get("sensitive") is True, f"{path.name}: output {name} shows a secret unmarked"
            assert str(body.get("description", "")).strip(), f"{path.name}: output {name} has no description"


def test_outputs_name_the_router_service_and_token_accessors() -> None:
    outputs = named_blocks("output", MODULE / "outputs.tf")
    assert outputs["router_service_name"]["value"] == "llmgw-router"
    assert outputs["router_port"]["value"] == "${var.router_port}"
    # The routers call no Nomad API (the leading watcher scales for them): no Nomad token.
    assert set(outputs["nomad_token_accessor_ids"]["value"]) == set(JOBSPEC_OF) - {"router"}
    assert outputs["operator_policy_names"]["value"] == {
        "nomad": "${nomad_acl_policy.operator.name}",
        "consul": "${consul_acl_policy.operator.name}",
    }
    for value in outputs["nomad_token_accessor_ids"]["value"].values():
        assert value.endswith(".accessor_id}")


# --- Jobs ----------------------------------------------------------------------------------------


def test_the_jobspecs_the_module_registers_exist_and_are_the_ones_in_jobs() -> None:
    jobs = {name: body for (rtype, name), body in blocks("resource").items() if rtype == "nomad_job"}
    assert set(jobs) == set(JOBSPEC_OF)
    for name, body in jobs.items():
        path = jobspec_path(body)
        assert path.is_file(), f"nomad_job.{name} points at {path}, which does not exist"
        assert path == (ROOT / "jobs" / JOBSPEC_OF[name]).resolve()


def test_each_job_gets_only_variables_its_jobspec_declares_and_every_required_one() -> None:
    """Nomad refuses a job given a variable it does not declare, or missing one without a default."""
    for (rtype, name), body in blocks("resource").items():
        if rtype != "nomad_job":
            continue
        spec = load_hcl(jobspec_path(body))
        declared = {v: b for entry in spec.get("variable", []) for v, b in entry.items()}
        given = set(body["hcl2"][0]["vars"])
        assert given <= set(declared), f"nomad_job.{name} passes undeclared {sorted(given - set(declared))}"
        required = {v for v, b in declared.items() if "default" not in b}
        assert required <= given, f"nomad_job.{name} leaves out required {sorted(required - given)}"
        # Lists travel as HCL text: a bare list would be refused by the provider's map(string).
        for var, value in body["hcl2"][0]["vars"].items():
            if str(declared[var].get("type", "")).startswith("${list("):
                assert value.startswith("${jsonencode("), f"nomad_job.{name}: {var} must be jsonencode()d"


def test_tokens_are_stored_where_each_jobs_template_reads_them() -> None:
    variables = {
        name: body for (rtype, name), body in blocks("resource").items() if rtype == "nomad_variable"
    }
    assert set(variables) == set(JOBSPEC_OF)
    jobs = blocks("resource")
    for name, body in variables.items():
        spec_text = jobspec_path(jobs[("nomad_job", name)]).read_text(encoding="utf-8")
        job_id = next(iter(load_hcl(jobspec_path(jobs[("nomad_job", name)]))["job"][0]))
        path = resolve(body["path"])
        assert path == f"nomad/jobs/{job_id}", f"nomad_variable.{name} at {path}, job is {job_id}"
        m = NOMAD_VAR.search(spec_text)
        assert m, f"{job_id}: no nomadVar template"
        assert m.group(1) == path
        read = set(TEMPLATE_KEY.findall(m.group(2)))
        assert read == set(body["items"]), (
            f"{job_id} reads {sorted(read)}, the variable holds {sorted(body['items'])}"
        )
        assert ("nomad_job", name) in jobs
        assert f"nomad_variable.{name}" in str(jobs[("nomad_job", name)]["depends_on"])


def test_the_environment_the_templates_set_is_what_the_code_reads() -> None:
    """A token stored under the right key but exported under a name nobody reads is as good as
    missing: the task would run without it and fail on its first call."""
    code = "\n".join(
        p.read_text(encoding="utf-8") for d in ("nomad_driver", "router") for p in (ROOT / d).rglob("*.py")
    )
    for name in JOBSPEC_OF.values():
        m = NOMAD_VAR.search((ROOT / "jobs" / name).read_text(encoding="utf-8"))
        assert m, f"{name}: no nomadVar template"
        for env in re.findall(r"^\s*([A-Z][A-Z0-9_]*)=\{\{", m.group(2), re.M):
            assert f'"{env}"' in code, f"{name} sets {env}, which nothing in the code reads"


def test_models_are_stored_under_llmgw_config_models_and_the_example_models_load() -> None:
    keys = blocks("resource")[("consul_keys", "models")]["key"]
    assert len(keys) == 1
    assert resolve(keys[0]["path"]) == "llmgw/config/models"
    assert keys[0]["value"] == "${file(var.models_file)}"
    example = load_hcl(EXAMPLE / "main.tf")
    module = next(b for entry in example["module"] for b in entry.values())
    assert (EXAMPLE / module["source"]).resolve() == MODULE.resolve()
    models_file = module["models_file"].replace("${path.module}", str(EXAMPLE))
    assert len(load_models(models_file).models) >= 1


# --- ACL policies --------------------------------------------------------------------------------


def policies(rtype: str, attr: str) -> dict[str, dict[str, Any]]:
    """{component: parsed rules} for every policy resource of `rtype`."""
    found = {}
    for (t, name), body in blocks("resource").items():
        if t == rtype:
            # The one interpolation the rules have: the models' namespace, at its default.
            rules = heredoc(body[attr]).replace("${var.models_namespace}", "default")
            found[COMPONENT_OF[name]] = hcl2.loads(rules, serialization_options=HCL)
    return found


@pytest.mark.parametrize("component", acl.COMPONENTS)
def test_nomad_policy_grants_exactly_what_the_component_calls(component: acl.Component) -> None:
    parsed = policies("nomad_acl_policy", "rules_hcl")
    assert set(parsed) == {c for c in acl.COMPONENTS if acl.grants(c, "nomad")}
    if not acl.grants(component, "nomad"):
        assert component not in parsed, f"the {component} calls no Nomad API but has a Nomad policy"
        return
    problems = acl.check_nomad_policy(component, parsed[component])
    assert not problems, f"nomad policy of the {component}:\n" + "\n".join(problems)


@pytest.mark.parametrize("component", acl.COMPONENTS)
def test_consul_policy_grants_exactly_what_the_component_calls(component: acl.Component) -> None:
    parsed = policies("consul_acl_policy", "rules")
    if not acl.grants(component, "consul"):
        assert component not in parsed, f"the {component} calls no Consul API but has a Consul policy"
        return
    problems = acl.check_consul_policy(component, parsed[component])
    assert not problems, f"consul policy of the {component}:\n" + "\n".join(problems)


def test_each_token_carries_its_own_components_policy_and_no_more() -> None:
    resources = blocks("resource")
    for (rtype, name), body in resources.items():
        if rtype == "nomad_acl_token":
            assert body["type"] == "client", f"nomad_acl_token.{name} must be a client token"
            assert body["policies"] == [f"${{nomad_acl_policy.{name}.name}}"]
        if rtype == "consul_acl_token":
            assert body["policies"] == [f"${{consul_acl_policy.{name}.name}}"]
            assert "roles" not in body and "service_identities" not in body
    # The jobs get the tokens the module made, not some other secret.
    for name in JOBSPEC_OF:
        items = resources[("nomad_variable", name)]["items"]
        if acl.grants(COMPONENT_OF[name], "nomad"):
            assert items["nomad_token"] == f"${{nomad_acl_token.{name}.secret_id}}"
        else:
            assert "nomad_token" not in items and ("nomad_acl_token", name) not in resources
        if "consul_token" in items:
            assert items["consul_token"] == f"${{data.consul_acl_token_secret_id.{name}.secret_id}}"


def cli_verbs() -> set[str]:
    """Every verb of the `llmgw` CLI as an operator types it (`apply`, `ctl retry`)."""
    import typer.main

    from nomad_driver.cli.app import app

    command = typer.main.get_command(app)
    verbs: set[str] = set()

    def walk(group: Any, prefix: str) -> None:
        for name, sub in group.commands.items():
            if hasattr(sub, "commands"):
                walk(sub, f"{prefix}{name} ")
            else:
                verbs.add(f"{prefix}{name}")

    walk(command, "")
    return verbs


def test_every_cli_verb_says_whose_grants_it_runs_with() -> None:
    """A verb added without a line in acl.CLI_VERBS would go out with whatever token the operator
    holds, and nobody would have written down what that token must allow."""
    verbs = cli_verbs()
    assert {"render", "apply", "ctl retry"} <= verbs
    assert verbs == set(acl.CLI_VERBS), "add each verb to acl.CLI_VERBS, and drop gone ones"
    for verb, runs_with in acl.CLI_VERBS.items():
        if runs_with in acl.COMPONENTS:
            assert acl.CALLS[cast(acl.Component, runs_with)], f"{verb}: its component lists no calls"


def with_rules(parsed: dict[str, Any], text: str) -> dict[str, Any]:
    """`parsed` with the rules in `text` added (a rule for the same name is overridden)."""
    merged = {k: list(v) if isinstance(v, list) else v for k, v in parsed.items()}
    for kind, extra in hcl2.loads(text, serialization_options=HCL).items():
        merged[kind] = [*merged.get(kind, []), *extra] if isinstance(extra, list) else extra
    return merged


def without_rule(parsed: dict[str, Any], kind: str, name: str) -> dict[str, Any]:
    return {**parsed, kind: [{n: b for n, b in blk.items() if n != name} for blk in parsed[kind]]}


def test_the_policy_check_fails_on_policies_that_are_too_wide_or_too_narrow() -> None:
    """The checker itself must be able to fail, or the two tests above prove nothing."""
    consul = policies("consul_acl_policy", "rules")["router"]
    assert not acl.check_consul_policy("router", consul)
    wider = {**consul, "operator": "read"}
    assert any("operator" in p for p in acl.check_consul_policy("router", wider))
    as_write = with_rules(
        without_rule(consul, "key_prefix", "llmgw/state/"), 'key_prefix "llmgw/state/" { policy = "write" }'
    )
    as_read = with_rules(
        without_rule(consul, "key_prefix", "llmgw/state/"), 'key_prefix "llmgw/state/" { policy = "read" }'
    )
    assert any("missing" in p and "recurse" in p for p in acl.check_consul_policy("router", as_read))
    assert any("llmgw/state/" in p and "is enough" in p for p in acl.check_consul_policy("router", as_write))
    unused = with_rules(consul, 'key_prefix "llmgw/leader" { policy = "read" }')
    assert any("no call of the router" in p for p in acl.check_consul_policy("router", unused))
    no_nodes = {k: v for k, v in consul.items() if k != "node_prefix"}
    assert any("missing" in p and "catalog/service" in p for p in acl.check_consul_policy("router", no_nodes))
    # An exact rule that shadows a prefix the calls need is a gap, as it is in Consul.
    shadow = with_rules(consul, 'key "llmgw/activity/m1" { policy = "deny" }')
    assert any("activity" in p and "missing" in p for p in acl.check_consul_policy("router", shadow))

    nomad = policies("nomad_acl_policy", "rules_hcl")
    extra_cap = hcl2.loads(
        'namespace "default" {\n capabilities = ["list-jobs", "read-job", "submit-job", "read-logs", "alloc-exec"]\n}\n',
        serialization_options=HCL,
    )
    assert any(
        "alloc-exec" in p for p in acl.check_nomad_policy("watcher", {**nomad["watcher"], **extra_cap})
    )
    shorthand = hcl2.loads('namespace "default" {\n policy = "write"\n}\n', serialization_options=HCL)
    assert any("use capabilities" in p for p in acl.check_nomad_policy("watcher", shorthand))
    assert any(
        "node policy write" in p
        for p in acl.check_nomad_policy("watcher", {**nomad["watcher"], "node": [{"policy": "write"}]})
    )
    assert any(
        "missing" in p and "client/metadata" in p
        for p in acl.check_nomad_policy("node-agent", {"node": [{"policy": "read"}]})
    )
    assert any(
        "operator" in p
        for p in acl.check_nomad_policy("watcher", {**nomad["watcher"], "operator": [{"policy": "read"}]})
    )


# --- Consul enforcing the policies ---------------------------------------------------------------


@pytest.fixture(scope="module")
def acl_consul_agent(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ConsulAgent, str]]:
    """A Consul 1.8 dev agent with ACLs on, deny by default and the stricter KV list policy, so a
    recursive read needs `list` as on clusters that turn it on: (url, management token)."""
    master = ACL_MASTER_TOKEN
    try:
        agent = AclConsulAgent(log_dir=tmp_path_factory.mktemp("consul-acl"), die_with_parent=True).start()
    except ConsulAgentError as exc:
        pytest.fail(f"cannot start Consul with ACLs: {exc}")
    try:
        yield agent, master
    finally:
        agent.stop()


@pytest.fixture
def acl_consul(acl_consul_agent: tuple[ConsulAgent, str]) -> tuple[str, str]:
    """The ACL agent's (url, management token), with nothing left by an earlier test: no
    sessions (so no held lock), nothing under llmgw/, no nodes but the agent's own."""
    agent, master = acl_consul_agent
    url = agent.url
    for session in consul_request(url, master, "GET", "/v1/session/list").json() or []:
        consul_request(url, master, "PUT", f"/v1/session/destroy/{session['ID']}")
    consul_request(url, master, "DELETE", "/v1/kv/llmgw/?recurse")
    for node in consul_request(url, master, "GET", "/v1/catalog/nodes").json() or []:
        if node["Node"] != agent.node_name:
            consul_request(url, master, "PUT", "/v1/catalog/deregister", json={"Node": node["Node"]})
    return url, master


def consul_token_for(url: str, master: str, component: str) -> str:
    rules = heredoc(blocks("resource")[("consul_acl_policy", component.replace("-", "_"))]["rules"])
    with httpx.Client(base_url=url, headers={"X-Consul-Token": master}, timeout=10) as c:
        policy = c.put(
            "/v1/acl/policy", json={"Name": f"test-{component}-{uuid.uuid4().hex[:8]}", "Rules": rules}
        )
        assert policy.status_code == 200, f"Consul refused the {component} policy: {policy.text}"
        token = c.put("/v1/acl/token", json={"Policies": [{"ID": policy.json()["ID"]}], "Local": True})
        assert token.status_code == 200, token.text
        return str(token.json()["SecretID"])


def consul_request(url: str, token: str, method: str, path: str, **kw: Any) -> Any:
    with httpx.Client(base_url=url, headers={"X-Consul-Token": token}, timeout=10) as c:
        return c.request(method, path, **kw)


# One key under each prefix a component reads recursively.
SEEDED_KEYS = ("llmgw/state/m0", "llmgw/config/model/m0")


def new_session(url: str, token: str) -> str:
    created = consul_request(url, token, "PUT", "/v1/session/create", json={"TTL": "30s", "LockDelay": "0s"})
    assert created.status_code == 200, created.text
    return str(created.json()["ID"])


def perform(url: str, token: str, master: str, call: acl.Call) -> Any:
    """Make `call` as the table describes it, with sample values for its placeholders."""
    path = call.path
    if "<session>" in path:
        path = path.replace("<session>", new_session(url, token))
    path = re.sub(r"<\w+>", lambda m: "0" if m.group(0) == "<index>" else "m1", path)
    body: Any = None
    if path == "/v1/session/create":
        body = {"TTL": "30s", "LockDelay": "0s"}
    elif path == "/v1/txn":
        # The fenced write: the lock must be held by this session, then cas on the state key.
        session = new_session(url, token)
        consul_request(url, token, "PUT", f"/v1/kv/llmgw/leader?acquire={session}", content=b"me")
        body = [
            {"KV": {"Verb": "check-session", "Key": "llmgw/leader", "Session": session}},
            {"KV": {"Verb": "cas", "Key": "llmgw/state/m1", "Value": "e30=", "Index": 0}},
        ]
    elif path == "/v1/catalog/register":
        body = {
            "Node": "llmgw-models",
            "Address": "127.0.0.1",
            "NodeMeta": {"external-node": "true"},
            "Service": {"ID": "llmgw-model-m1", "Service": "llmgw-model", "Tags": ["model=m1"]},
            "Check": {
                "CheckID": "llmgw-model-m1",
                "Name": "m1",
                "Status": "passing",
                "ServiceID": "llmgw-model-m1",
            },
        }
    elif path == "/v1/catalog/deregister":
        # Something to deregister, made with the management token.
        made = consul_request(
            url,
            master,
            "PUT",
            "/v1/catalog/register",
            json={
                "Node": "llmgw-models",
                "Address": "127.0.0.1",
                "Service": {"ID": "llmgw-model-m2", "Service": "llmgw-model"},
            },
        )
        assert made.status_code == 200, made.text
        body = {"Node": "llmgw-models", "ServiceID": "llmgw-model-m2"}
    content = b"{}" if call.method == "PUT" and body is None else None
    return consul_request(url, token, call.method, path, json=body, content=content)


def refusal(resp: Any, call: acl.Call) -> str | None:
    """Why `resp` shows Consul refused `call`, or None. Recursive reads are filtered rather than
    refused, so they must return the keys seeded under the prefix read."""
    if resp.status_code == 403 or resp.status_code >= 500:
        return f"HTTP {resp.status_code} {resp.text.strip()[:120]}"
    if call.method == "GET" and "recurse" in call.path:
        keys = [e["Key"] for e in resp.json()] if resp.status_code == 200 else []
        prefix = call.path.removeprefix("/v1/kv/").split("?")[0]
        for seeded in SEEDED_KEYS:
            if seeded.startswith(prefix) and seeded not in keys:
                return f"HTTP {resp.status_code}, {seeded} filtered out of the answer"
    return None


@pytest.mark.parametrize("component", ["watcher", "router"])
def test_consul_with_acls_enforced_allows_every_call_in_the_table(
    acl_consul: tuple[str, str], component: str
) -> None:
    url, master = acl_consul
    token = consul_token_for(url, master, component)
    for key in SEEDED_KEYS:
        seeded = consul_request(url, master, "PUT", f"/v1/kv/{key}", content=b"{}")
        assert seeded.status_code == 200, seeded.text
    denied = []
    for call in acl.CALLS[cast(acl.Component, component)]:
        if call.system != "consul":
            continue
        why = refusal(perform(url, token, master, call), call)
        if why:
            denied.append(f"{call} ({call.why}): {why}")
    assert not denied, f"Consul refused the {component}'s own calls:\n" + "\n".join(denied)
    # Health reads are filtered, not refused: the engine replica must be visible to the token.
    consul_request(
        url,
        master,
        "PUT",
        "/v1/catalog/register",
        json={
            "Node": "gpu-1",
            "Address": "10.0.0.1",
            "Service": {"ID": "llmgw-engine-a", "Service": "llmgw-engine", "Port": 9000},
        },
    )
    seen = consul_request(url, token, "GET", "/v1/health/service/llmgw-engine").json()
    assert [e["Service"]["ID"] for e in seen] == ["llmgw-engine-a"], (
        f"the {component}'s token sees no replica: health answers are filtered by node:read"
    )


OPERATOR_MODELS = """profiles:
  p: {engine: llama.cpp, engine_version: b1, gpus: 1}
models:
  a: {source: "file:///m/a.gguf", profile: p, replicas: {min: 0, max: 1}}
"""


async def test_apply_stores_definitions_under_the_operator_policy_and_nothing_else(
    acl_consul: tuple[str, str],
) -> None:
    """`llmgw apply`'s own Consul code, run with a token carrying only the operator policy."""
    from nomad_driver.cli.apply import store_definitions
    from nomad_driver.consul import Consul
    from nomad_driver.state import ModelState, state_key

    url, master = acl_consul
    token = consul_token_for(url, master, "operator")
    consul = Consul(url, token=token)
    try:
        assert await store_definitions(consul, OPERATOR_MODELS)
        assert not await store_definitions(consul, OPERATOR_MODELS)  # read back, unchanged
        assert await store_definitions(consul, OPERATOR_MODELS.replace("max: 1", "max: 2"))
        # The upgrade: apply deletes the single key of the layout before, under the same policy.
        await consul.kv_put("llmgw/config/models", OPERATOR_MODELS)
        assert await store_definitions(consul, OPERATOR_MODELS)
    finally:
        await consul.close()
    refused = consul_request(url, token, "PUT", f"/v1/kv/{state_key('m')}", content=ModelState().to_kv())
    assert refused.status_code == 403


def test_consul_with_acls_enforced_refuses_what_the_router_must_not_do(acl_consul: tuple[str, str]) -> None:
    url, master = acl_consul
    token = consul_token_for(url, master, "router")
    refused: dict[str, tuple[str, str, dict[str, Any]]] = {
        "write model state": ("PUT", "/v1/kv/llmgw/state/m1", {"content": b"{}"}),
        "take the leader lock": ("PUT", "/v1/kv/llmgw/leader", {"content": b"x"}),
        "change the definitions": ("PUT", "/v1/kv/llmgw/config/models", {"content": b"x"}),
        "create a session": ("PUT", "/v1/session/create", {"json": {"TTL": "30s"}}),
        "register model health": (
            "PUT",
            "/v1/catalog/register",
            {
                "json": {
                    "Node": "llmgw-models",
                    "Address": "127.0.0.1",
                    "Service": {"ID": "llmgw-model-x", "Service": "llmgw-model"},
                }
            },
        ),
        "read ACL tokens": ("GET", "/v1/acl/tokens", {}),
    }
    allowed = [
        what
        for what, (m, p, kw) in refused.items()
        if consul_request(url, token, m, p, **kw).status_code != 403
    ]
    assert not allowed, f"the router's token may: {allowed}"


def test_consul_with_acls_enforced_keeps_the_watcher_inside_llmgw(acl_consul: tuple[str, str]) -> None:
    url, master = acl_consul
    token = consul_token_for(url, master, "watcher")
    refused: dict[str, tuple[str, str, dict[str, Any]]] = {
        "write outside llmgw/": ("PUT", "/v1/kv/other/key", {"content": b"x"}),
        "register another service": (
            "PUT",
            "/v1/catalog/register",
            {
                "json": {
                    "Node": "llmgw-models",
                    "Address": "127.0.0.1",
                    "Service": {"ID": "web", "Service": "web"},
                }
            },
        ),
        "register on another node": (
            "PUT",
            "/v1/catalog/register",
            {
                "json": {
                    "Node": "gpu-9",
                    "Address": "10.0.0.9",
                    "Service": {"ID": "llmgw-model-y", "Service": "llmgw-model"},
                }
            },
        ),
        "read ACL tokens": ("GET", "/v1/acl/tokens", {}),
        "operator raft": ("GET", "/v1/operator/raft/configuration", {}),
    }
    allowed = [
        what
        for what, (m, p, kw) in refused.items()
        if consul_request(url, token, m, p, **kw).status_code != 403
    ]
    assert not allowed, f"the watcher's token may: {allowed}"


# --- The table against the code ------------------------------------------------------------------


def _pattern(path: str) -> re.Pattern[str]:
    """A found call's path as a pattern: each `<x>` one path segment, or for a KV key any run of
    them (keys hold slashes: llmgw/state/<model>)."""
    parts = re.split(r"(<x>)", path.split("?")[0])
    return re.compile(
        "".join(
            (".+" if "".join(parts[:i]).startswith("/v1/kv/") else "[^/]+") if p == "<x>" else re.escape(p)
            for i, p in enumerate(parts)
        )
    )


def _sample(call: acl.Call) -> str:
    return re.sub(r"<[^>]+>", "p", call.path.split("?")[0])


def table_matches(component: acl.Component, method: str | None, pattern: str) -> bool:
    wanted = _pattern(pattern)
    return any(
        (method is None or method == call.method) and wanted.fullmatch(_sample(call))
        for call in acl.CALLS[component]
    )


def table_call_made(call: acl.Call, made: list[scan.ApiCall]) -> bool:
    """Some call found in the code is this line of the table (its variable parts any value)."""
    return any(
        (found.method is None or found.method == call.method)
        and _pattern(found.path).fullmatch(_sample(call))
        for found in made
    )


@pytest.fixture(scope="module")
def code() -> scan.CodeIndex:
    return scan.CodeIndex()


def verb_calls(code: scan.CodeIndex) -> dict[str, list[scan.ApiCall]]:
    """`llmgw VERB` -> every Consul and Nomad call reachable from the function that runs it."""
    from nomad_driver.cli import reference

    out = {}
    for path, cmd in reference.commands():
        if cmd.callback is None or hasattr(cmd, "commands"):
            continue
        callback = inspect.unwrap(cmd.callback)
        module, start = code.find(callback.__module__, callback.__qualname__)
        out[path.removeprefix("llmgw ")] = code.trace(module, start)
    return out


def test_each_verbs_calls_are_granted_to_whose_grants_it_runs_with(code: scan.CodeIndex) -> None:
    """What `llmgw apply` (or any verb) calls, traced from its own function through every
    helper and client method it reaches, must be in the table for the grants it runs with
    (acl.CLI_VERBS); a verb that runs with none must call neither Nomad nor Consul. Checking
    apply's helpers as the watcher's, because they live in the watcher's files, is how a call
    only the operator makes would go out with a token nobody granted it."""
    calls = verb_calls(code)
    assert set(calls) == set(acl.CLI_VERBS), "every verb traced, and only those"
    wrong = []
    for verb, made in sorted(calls.items()):
        runs_with = acl.CLI_VERBS[verb]
        for call in made:
            if runs_with not in acl.COMPONENTS:
                wrong.append(f"llmgw {verb} ({runs_with}) calls {call}")
            elif not table_matches(cast(acl.Component, runs_with), call.method, call.path):
                wrong.append(f"llmgw {verb} calls {call}, which the {runs_with}'s table does not grant")
    assert not wrong, "calls tests/acl_table.py does not grant:\n" + "\n".join(wrong)


def test_every_call_the_table_lists_is_made_by_a_verb_running_with_those_grants(code: scan.CodeIndex) -> None:
    """The other way round: a table line no verb makes grants what nothing needs."""
    calls = verb_calls(code)
    unused = [
        f"{component}: {call} ({call.why})"
        for component in acl.COMPONENTS
        for call in acl.CALLS[component]
        if not table_call_made(
            call, [c for v, made in calls.items() if acl.CLI_VERBS[v] == component for c in made]
        )
    ]
    assert not unused, "table lines no verb's code makes:\n" + "\n".join(unused)


def test_the_trace_follows_apply_through_its_helpers_and_can_fail(code: scan.CodeIndex) -> None:
    calls = verb_calls(code)
    apply = {(c.method, c.path) for c in calls["apply"]}
    # Through cli/apply.py's helpers and the Nomad and Consul clients' methods.
    assert {("GET", "/v1/job/<x>"), ("POST", "/v1/job/<x>"), ("PUT", "/v1/txn")} <= apply
    # `plan` touches nothing: no register, no write.
    plan = {(c.method, c.path) for c in calls["plan"]}
    assert ("GET", "/v1/job/<x>") in plan and ("POST", "/v1/job/<x>/plan") in plan
    assert not {m for m, _ in plan} & {"PUT", "DELETE"} and ("POST", "/v1/job/<x>") not in plan
    # The check above fails for calls outside a component's table.
    assert not all(table_matches("router", c.method, c.path) for c in calls["apply"])
    assert not calls["render"] and not calls["ctl retry"]


def test_every_call_in_the_code_is_in_the_acl_table(code: scan.CodeIndex) -> None:
    """Every call spelled out anywhere in the product, attributed by where it lives, so code no
    verb is traced to (a handler registered by name, say) is still checked. The CLI's own
    modules are checked through the verbs that run them, above, and must all be reached."""
    traced = {c.where.split(" via ")[0] for made in verb_calls(code).values() for c in made}
    found: list[str] = []
    unlisted: list[str] = []
    for path in sorted([*(ROOT / "nomad_driver").rglob("*.py"), *(ROOT / "router").rglob("*.py")]):
        rel = path.relative_to(ROOT)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for call in scan.api_calls_in(tree, path):
            found.append(call.where)
            if rel.parts[:2] == ("nomad_driver", "cli"):
                if call.where not in traced:
                    unlisted.append(f"{call}: in the CLI, but no verb reaches it")
                continue
            component: acl.Component = (
                "router"
                if rel.parts[0] == "router"
                else "node-agent"
                if rel.parts[:2] == ("nomad_driver", "node_agent")
                else "watcher"
            )
            if not table_matches(component, call.method, call.path):
                unlisted.append(f"{call} (the {component})")
    assert len(found) >= 10, f"the scan found almost no calls ({found}); it no longer understands the clients"
    assert not unlisted, "calls missing from tests/acl_table.py:\n" + "\n".join(unlisted)


# --- llmgw's own clients under the module's tokens -----------------------------------------------


async def test_the_watchers_consul_work_succeeds_under_the_watcher_policy(
    acl_consul: tuple[str, str],
) -> None:
    """The watcher's real Consul client and health entries, not hand-made requests: the lock, a
    fenced state write and the model health entries, all with the watcher's token."""
    from nomad_driver.consul import Consul
    from nomad_driver.state import KV_PREFIX, LEADER_KEY, ModelState, state_key
    from nomad_driver.watcher.health import Entry, HealthEntries

    url, master = acl_consul
    consul = Consul(url, token=consul_token_for(url, master, "watcher"))
    try:
        await consul.kv_get(KV_PREFIX, recurse=True)
        session = await consul.session_create("llmgw-leader", ttl_s=15, lock_delay_s=0)
        assert await consul.session_renew(session)
        assert await consul.kv_put(LEADER_KEY, b"watcher-1", acquire=session)
        written = await consul.fenced_put(
            state_key("kev-0.5b"),
            ModelState(parked=True).to_kv(),
            cas=0,
            session=session,
            lock_key=LEADER_KEY,
        )
        assert written.ok, written.errors
        await consul.kv_get(state_key("kev-0.5b"))
        health = HealthEntries(consul)
        await health.sync({"kev-0.5b": Entry("critical", "parked: unknown model architecture: 'kev'")})
        health.forget()  # a new leader reads the entries back, then removes the stale one
        await health.sync({})
        left = [c.get("ServiceID") for c in await consul.health_node("llmgw-models")]
        assert "llmgw-model-kev-0.5b" not in left
        await consul.health_service("llmgw-engine")
        assert await consul.kv_put(LEADER_KEY, b"", release=session)
        await consul.session_destroy(session)
    finally:
        await consul.close()


async def test_the_routers_discovery_reads_and_writes_under_the_router_policy(
    acl_consul: tuple[str, str],
) -> None:
    """The router's real discovery: all four watches read (no 403, no silently empty answer: a
    failing check is seen failing) and its one write, the activity timestamp, goes through."""
    import asyncio

    from router.config import ConsulSettings
    from router.discovery import Discovery

    url, master = acl_consul
    registered = consul_request(
        url,
        master,
        "PUT",
        "/v1/catalog/register",
        json={
            "Node": "gpu-2",
            "Address": "10.0.0.2",
            "Service": {
                "ID": "engine-qwen",
                "Service": "llmgw-engine",
                "Port": 9100,
                "Meta": {"model": "qwen"},
            },
        },
    )
    assert registered.status_code == 200, registered.text
    failing = consul_request(
        url,
        master,
        "PUT",
        "/v1/catalog/register",
        json={
            "Node": "gpu-3",
            "Address": "10.0.0.3",
            "Service": {
                "ID": "engine-qwen-3",
                "Service": "llmgw-engine",
                "Port": 9100,
                "Meta": {"model": "qwen"},
            },
            "Check": {
                "CheckID": "qwen-3-ready",
                "Name": "ready",
                "ServiceID": "engine-qwen-3",
                "Status": "critical",
            },
        },
    )
    assert failing.status_code == 200, failing.text
    state = consul_request(url, master, "PUT", "/v1/kv/llmgw/state/qwen", content=b'{"unplaceable": true}')
    assert state.status_code == 200, state.text
    discovery = Discovery(ConsulSettings(addr=url, token=consul_token_for(url, master, "router"), wait_s=2.0))
    await discovery.start()
    try:
        deadline = time.monotonic() + 20
        while not discovery.has_snapshot and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        failing = {w.name: w.error for w in discovery.watches.values() if not w.ok}
        assert not failing, f"router watches refused: {failing}"
        assert "qwen" in discovery.snapshot.ready, "the router's token sees no engine replica"
        ready = [r.id for r in discovery.snapshot.ready["qwen"]]
        assert ready == ["engine-qwen"], f"the router's token does not see the failing check: {ready}"
        assert discovery.snapshot.states["qwen"].unplaceable
        await discovery.put_kv("llmgw/activity/qwen", "1764471600")
    finally:
        await discovery.stop()
