"""Consul ACLs on the dev stack (`python -m devstack up --acl`): the dev agent denies by default,
and llmgw's parts read and write Consul on the tokens of its own policies.

The steps are the `consul acl` lines of docs/operating.md, section 5, "By hand", made through
the HTTP calls the `consul` CLI makes for them: each policy in docs/policies/llmgw-*.consul.hcl
created under its file's name, and a local token each for the watcher, the router and the
operator. Prometheus gets the read-only token the shipped scrape configuration asks for
(jobs/prometheus/prometheus.yml). The management token is what Nomad's agent registers
services with, as `nomad setup consul` gives it one.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx

from devstack.agent_tls import verify

REPO = Path(__file__).resolve().parents[1]
POLICIES_DIR = REPO / "docs" / "policies"
PROMETHEUS_CONFIG = REPO / "jobs" / "prometheus" / "prometheus.yml"


class ConsulAclError(RuntimeError):
    """Consul refused a policy or token the dev stack writes; the message has its answer."""


@dataclass(frozen=True)
class ConsulTokens:
    management: str
    watcher: str
    router: str
    operator: str
    prometheus: str


def new_management_token() -> str:
    return str(uuid.uuid4())


def consul_policies(directory: Path = POLICIES_DIR) -> dict[str, str]:
    """{policy name: rules}: `llmgw-router` for llmgw-router.consul.hcl, as the docs name them."""
    return {
        path.name.removesuffix(".consul.hcl"): path.read_text(encoding="utf-8")
        for path in sorted(directory.glob("llmgw-*.consul.hcl"))
    }


def prometheus_rules(config: Path = PROMETHEUS_CONFIG) -> str:
    """The rules the shipped scrape configuration names beside its `token:` line, read from its
    comment, so that a rule it leaves out stops Prometheus finding targets here too."""
    rules = re.findall(r'`(\w+ "[^"]*" \{ policy = "\w+" \})`', config.read_text(encoding="utf-8"))
    if not rules:
        raise ConsulAclError(f"{config}: no Consul rules named in its comments")
    return "\n".join(rules) + "\n"


def _checked(resp: httpx.Response, what: str) -> httpx.Response:
    if resp.status_code != 200:
        raise ConsulAclError(f"{what}: Consul answered {resp.status_code} {resp.text.strip()}")
    return resp


def create_policy(client: httpx.Client, name: str, rules: str) -> None:
    """`consul acl policy create -name NAME -rules @FILE`: PUT /v1/acl/policy."""
    _checked(client.put("/v1/acl/policy", json={"Name": name, "Rules": rules}), f"creating the policy {name}")


def create_token(client: httpx.Client, description: str, policy: str) -> str:
    """`consul acl token create -description D -policy-name P -local`: PUT /v1/acl/token."""
    body = {"Description": description, "Policies": [{"Name": policy}], "Local": True}
    resp = _checked(client.put("/v1/acl/token", json=body), f"creating the token {description}")
    return str(resp.json()["SecretID"])


def set_up(consul_url: str, management: str, ca: Path | None = None) -> ConsulTokens:
    """Policies and tokens for llmgw on a Consul whose ACLs `management` manages."""
    headers = {"X-Consul-Token": management}
    with httpx.Client(base_url=consul_url, headers=headers, timeout=30, verify=verify(ca)) as client:
        for name, rules in consul_policies().items():
            create_policy(client, name, rules)
        create_policy(client, "prometheus-llmgw", prometheus_rules())
        return ConsulTokens(
            management=management,
            watcher=create_token(client, "llmgw-watcher", "llmgw-watcher"),
            router=create_token(client, "llmgw-router", "llmgw-router"),
            operator=create_token(client, "llmgw-operator", "llmgw-operator"),
            prometheus=create_token(client, "prometheus", "prometheus-llmgw"),
        )
