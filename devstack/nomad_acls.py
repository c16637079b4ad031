"""Nomad ACLs on the dev stack (`python -m devstack up --acl`): llmgw runs on the tokens of its own
policies, as on a cluster, so a policy short of a grant stops the demo instead of a deployment.

The steps are those of docs/operating.md, section 5, "By hand", made through the HTTP calls the
`nomad` CLI makes for them (no `nomad` binary can be installed here): each policy in
docs/policies/llmgw-*.nomad.hcl applied under its file's name, a client token per component, and
the watcher's and the node agent's tokens written to their jobs' Variables, where
`nomad var get` finds them. The operator's token holds `llmgw-operator`, as the page says to
give the people who run `llmgw apply`.
"""

from __future__ import annotations

import secrets
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx

from devstack.agent_tls import verify
from devstack.consul_acls import ConsulTokens

REPO = Path(__file__).resolve().parents[1]
POLICIES_DIR = REPO / "docs" / "policies"
WATCHER_VARIABLE = "nomad/jobs/llmgw-watcher"
ROUTER_VARIABLE = "nomad/jobs/llmgw-router"
NODE_AGENT_VARIABLE = "nomad/jobs/llmgw-node-agent"


class AclSetupError(RuntimeError):
    """Nomad refused a policy, token or Variable the dev stack writes; the message has its answer."""


@dataclass(frozen=True)
class StackTokens:
    """The secrets of a dev stack with ACLs on. `management` is what `nomad acl bootstrap`
    would have handed out; the stack itself uses it only for what an installer does."""

    management: str
    watcher: str
    node_agent: str
    operator: str
    admin: str
    # The key the router asks its clients for, as `api_keys` in the router's Variable.
    api_key: str
    consul: ConsulTokens


def new_management_token() -> str:
    # Nomad's secrets are UUIDs; the stand-in takes any string, a real agent's bootstrap a UUID.
    return str(uuid.uuid4())


def nomad_policies(directory: Path = POLICIES_DIR) -> dict[str, str]:
    """{policy name: rules}: `llmgw-watcher` for llmgw-watcher.nomad.hcl, as the docs name them."""
    return {
        path.name.removesuffix(".nomad.hcl"): path.read_text(encoding="utf-8")
        for path in sorted(directory.glob("llmgw-*.nomad.hcl"))
    }


def _checked(resp: httpx.Response, what: str) -> httpx.Response:
    if resp.status_code != 200:
        raise AclSetupError(f"{what}: Nomad answered {resp.status_code} {resp.text.strip()}")
    return resp


def apply_policy(client: httpx.Client, name: str, rules: str, description: str = "") -> None:
    """`nomad acl policy apply -description D NAME FILE`: PUT /v1/acl/policy/NAME."""
    body = {"Name": name, "Description": description, "Rules": rules}
    _checked(client.put(f"/v1/acl/policy/{name}", json=body), f"applying the policy {name}")


def create_token(client: httpx.Client, name: str, policies: list[str]) -> str:
    """`nomad acl token create -name NAME -type client -policy P`: PUT /v1/acl/token."""
    body = {"Name": name, "Type": "client", "Policies": policies}
    resp = _checked(client.put("/v1/acl/token", json=body), f"creating the token {name}")
    return str(resp.json()["SecretID"])


def put_variable(client: httpx.Client, path: str, items: dict[str, str]) -> None:
    """`nomad var put PATH k=v ...`: PUT /v1/var/PATH with every item (the whole Variable)."""
    body = {"Path": path, "Items": items}
    _checked(client.put(f"/v1/var/{path}", json=body), f"writing the Variable {path}")


def set_up(nomad_url: str, management: str, consul: ConsulTokens, ca: Path | None = None) -> StackTokens:
    """Policies, tokens and Variables for llmgw on a Nomad whose ACLs `management` manages; the
    Variables carry the Consul tokens too, as on a cluster."""
    headers = {"X-Nomad-Token": management}
    with httpx.Client(base_url=nomad_url, headers=headers, timeout=30, verify=verify(ca)) as client:
        for name, rules in nomad_policies().items():
            apply_policy(client, name, rules, description=f"{name} (docs/policies/{name}.nomad.hcl)")
        tokens = StackTokens(
            management=management,
            watcher=create_token(client, "llmgw-watcher", ["llmgw-watcher"]),
            node_agent=create_token(client, "llmgw-node-agent", ["llmgw-node-agent"]),
            operator=create_token(client, "llmgw-operator", ["llmgw-operator"]),
            admin=secrets.token_hex(20),  # `openssl rand -hex 20` in the docs
            api_key=f"sk-devstack-{secrets.token_hex(8)}",
            consul=consul,
        )
        watcher = {"nomad_token": tokens.watcher, "consul_token": consul.watcher, "admin_token": tokens.admin}
        put_variable(client, WATCHER_VARIABLE, watcher)
        put_variable(client, ROUTER_VARIABLE, {"consul_token": consul.router, "api_keys": tokens.api_key})
        put_variable(client, NODE_AGENT_VARIABLE, {"nomad_token": tokens.node_agent})
    return tokens
