"""What each llmgw component calls on Consul and Nomad, and the ACL grant each call needs.

The table is the source of truth for the policies in `terraform/acl.tf`. tests/test_terraform.py
checks those policies against it both ways (a call no rule allows, a rule no call needs or a
level higher than any call needs), runs the Consul calls against a real Consul enforcing them,
and traces each `llmgw` verb's code for calls that have no line here, and lines no call makes. The grants follow the "ACL
Required" columns of Consul's and Nomad's API docs; where an endpoint accepts either of two Nomad
capabilities, the narrower one is listed first.

Pure data and logic: the caller parses the rules (HCL) and passes the resulting dicts, so the
installed package needs no HCL parser.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

# "operator" is the person running `llmgw plan` and `llmgw apply` with their own tokens; the module ships a
# policy for it to attach to those tokens, and creates no token for it.
Component = Literal["watcher", "router", "node-agent", "operator"]
COMPONENTS: tuple[Component, ...] = ("watcher", "router", "node-agent", "operator")

# Consul: `list` grants read and list, `write` grants all three; `read` does not grant list, and
# a recursive read needs list wherever the agent sets acl.enable_key_list_policy (with `read` it
# is refused outright; checked against Consul 1.8.7). `list` works in both modes.
CONSUL_LEVELS = {"deny": 0, "read": 1, "list": 2, "write": 3}
CONSUL_KINDS = ("key", "session", "service", "node", "agent")
# Everything else (acl, operator, keyring, event, query, mesh, peering) llmgw never needs.
CONSUL_RULE_NAMES = frozenset(CONSUL_KINDS) | {f"{k}_prefix" for k in CONSUL_KINDS}

NOMAD_LEVELS = {"deny": 0, "read": 1, "write": 2}
NOMAD_RULE_BLOCKS = frozenset({"namespace", "node", "agent"})


@dataclass(frozen=True)
class ConsulGrant:
    """`kind` on `name` at `access`; with `prefix`, on every name that starts with `name` (the
    call's variable part, such as a model name, follows it)."""

    kind: str
    name: str
    access: str
    prefix: bool = False

    def __str__(self) -> str:
        rule = f"{self.kind}_prefix" if self.prefix else self.kind
        return f'{rule} "{self.name}" {self.access}'


@dataclass(frozen=True)
class NomadGrant:
    """A namespace capability (`scope` "namespace"), or the `node`/`agent` policy level."""

    scope: Literal["namespace", "node", "agent"]
    capability: str
    # Other namespace capabilities the endpoint accepts instead (Nomad's docs say "X or Y").
    alternatives: tuple[str, ...] = ()
    namespace: str = "default"

    def __str__(self) -> str:
        if self.scope == "namespace":
            alts = "".join(f" or {a}" for a in self.alternatives)
            return f'namespace "{self.namespace}" {self.capability}{alts}'
        return f"{self.scope} {self.capability}"


Grant = ConsulGrant | NomadGrant


@dataclass(frozen=True)
class Call:
    system: Literal["consul", "nomad"]
    method: str
    path: str
    grants: tuple[Grant, ...]
    why: str

    def __str__(self) -> str:
        return f"{self.system} {self.method} {self.path}"


def _consul(method: str, path: str, why: str, *grants: ConsulGrant) -> Call:
    return Call("consul", method, path, grants, why)


def _nomad(method: str, path: str, why: str, *grants: NomadGrant) -> Call:
    return Call("nomad", method, path, grants, why)


def _ns(capability: str, *alternatives: str) -> NomadGrant:
    return NomadGrant("namespace", capability, alternatives)


def _key(name: str, access: str, *, prefix: bool = False) -> ConsulGrant:
    return ConsulGrant("key", name, access, prefix)


# Health and catalog answers are filtered by node:read on each entry's node as well as
# service:read, and replicas run on any node, so every health read also needs every node.
_ALL_NODES_READ = ConsulGrant("node", "", "read", prefix=True)
_ENGINE_READ = ConsulGrant("service", "llmgw-engine", "read")

CALLS: dict[Component, tuple[Call, ...]] = {
    "watcher": (
        # Consul: the state it watches and writes (nomad_driver/watcher/watch.py, loop.py). `llmgw apply`
        # (cli/apply.py) runs with the operator's token, not the watcher's.
        _consul(
            "GET",
            "/v1/kv/llmgw/?recurse",
            "watch all of llmgw/ in one blocking query",
            _key("llmgw/", "list", prefix=True),
        ),
        _consul(
            "GET",
            "/v1/kv/llmgw/state/<model>",
            "read a model's state back before a write",
            _key("llmgw/state/", "read", prefix=True),
        ),
        _consul(
            "PUT",
            "/v1/txn",
            "fenced state write: check-session on the lock, then cas on the state key",
            _key("llmgw/leader", "read"),
            _key("llmgw/state/", "write", prefix=True),
        ),
        # The leader puts back the definitions it runs on when llmgw/config/ lost them
        # (claimed create-only, so an operator's apply always wins; nomad_driver/config_store.py).
        _consul(
            "GET",
            "/v1/kv/llmgw/config/?recurse",
            "what is stored before the definitions are put back",
            _key("llmgw/config/", "list", prefix=True),
        ),
        _consul(
            "PUT",
            "/v1/txn",
            "restore the definitions' keys: claim, keys, commit",
            _key("llmgw/config/", "write", prefix=True),
        ),
        # The leader deletes the in-flight keys of routers gone for an hour (watcher/loop.py).
        _consul(
            "DELETE", "/v1/kv/llmgw/<key>", "remove a key llmgw owns", _key("llmgw/", "write", prefix=True)
        ),
        # Leadership (nomad_driver/watcher/leader.py): the session is tied to the local agent's node,
        # whose name the policy cannot know in advance.
        _consul(
            "PUT",
            "/v1/session/create",
            "session for the leader lock",
            ConsulGrant("session", "", "write", prefix=True),
        ),
        _consul(
            "PUT",
            "/v1/session/renew/<session>",
            "keep the lock",
            ConsulGrant("session", "", "write", prefix=True),
        ),
        _consul(
            "PUT",
            "/v1/session/destroy/<session>",
            "step down",
            ConsulGrant("session", "", "write", prefix=True),
        ),
        _consul("GET", "/v1/kv/llmgw/leader?index=<index>", "watch the lock", _key("llmgw/leader", "read")),
        _consul(
            "PUT", "/v1/kv/llmgw/leader?acquire=<session>", "take the lock", _key("llmgw/leader", "write")
        ),
        _consul(
            "PUT", "/v1/kv/llmgw/leader?release=<session>", "give the lock up", _key("llmgw/leader", "write")
        ),
        # Model health entries (nomad_driver/watcher/health.py): one external node, one service per model.
        _consul(
            "PUT",
            "/v1/catalog/register",
            "register llmgw-model-<model> on the external node llmgw-models",
            ConsulGrant("node", "llmgw-models", "write"),
            ConsulGrant("service", "llmgw-model", "write"),
        ),
        _consul(
            "PUT",
            "/v1/catalog/deregister",
            "remove a model's health entry",
            ConsulGrant("node", "llmgw-models", "write"),
            ConsulGrant("service", "llmgw-model", "write"),
        ),
        _consul(
            "GET",
            "/v1/health/node/llmgw-models",
            "read the health entries back after a restart",
            ConsulGrant("node", "llmgw-models", "read"),
            ConsulGrant("service", "llmgw-model", "read"),
        ),
        _consul(
            "GET", "/v1/health/service/llmgw-engine", "count ready replicas", _ENGINE_READ, _ALL_NODES_READ
        ),
        # Nomad (nomad_driver/nomad.py, watcher/watch.py).
        _nomad("GET", "/v1/jobs?prefix=llmgw-", "watch the model jobs", _ns("list-jobs")),
        _nomad("GET", "/v1/job/<job>", "read a model job", _ns("read-job")),
        _nomad("POST", "/v1/job/<job>", "register or update a model job", _ns("submit-job")),
        # Job.Deregister wants submit-job (or deregister-job; nomad/job_endpoint.go).
        _nomad("DELETE", "/v1/job/<job>", "stop a rollout's drained previous job", _ns("submit-job")),
        _nomad(
            "POST",
            "/v1/job/<job>/scale",
            "park, unpark, scale idle models down",
            _ns("scale-job", "submit-job"),
        ),
        # Job.Evaluate wants submit-job (nomad/job_endpoint.go), which the watcher has for register.
        _nomad(
            "POST",
            "/v1/job/<job>/evaluate",
            "reschedule a failed allocation Nomad gave up on",
            _ns("submit-job"),
        ),
        _nomad("GET", "/v1/allocations", "watch replicas and start failures", _ns("read-job")),
        # The Job, Allocation and Evaluation topics need read-job in the namespace (Nomad's events
        # API docs).
        _nomad("GET", "/v1/event/stream", "follow job, allocation and evaluation changes", _ns("read-job")),
        _nomad(
            "GET", "/v1/evaluations", "placement results, listed at start and each resync", _ns("read-job")
        ),
        _nomad(
            "GET",
            "/v1/job/<job>/evaluations",
            "one job's evaluations, for a model whose decision reads them",
            _ns("read-job"),
        ),
        _nomad(
            "GET",
            "/v1/evaluation/<eval>",
            "an activation's evaluation, read at once for the router",
            _ns("read-job"),
        ),
        _nomad(
            "GET",
            "/v1/client/fs/logs/<alloc>",
            "the engine's stderr, for the last error",
            _ns("read-logs", "read-fs"),
        ),
        _nomad(
            "GET",
            "/v1/nodes?resources=true",
            "every node with its GPUs, for placement and the fleet summary",
            NomadGrant("node", "read"),
        ),
        _nomad(
            "GET",
            "/v1/node/<node>",
            "a changed node in full: its meta, where the node agent publishes",
            NomadGrant("node", "read"),
        ),
    ),
    "router": (
        # Consul (router/discovery.py, activity.py).
        _consul(
            "GET", "/v1/catalog/service/llmgw-engine", "the engine instances", _ENGINE_READ, _ALL_NODES_READ
        ),
        _consul(
            "GET",
            '/v1/health/state/any?filter=Status != "passing"',
            "which instances are not ready",
            _ENGINE_READ,
            _ALL_NODES_READ,
        ),
        _consul(
            "GET",
            '/v1/health/service/llmgw-engine?filter=Service.ID == "<instance>"',
            "confirm an instance before it is back in rotation",
            _ENGINE_READ,
            _ALL_NODES_READ,
        ),
        _consul(
            "GET",
            "/v1/kv/llmgw/state/?recurse",
            "parked and unplaceable models",
            _key("llmgw/state/", "list", prefix=True),
        ),
        _consul(
            "GET",
            "/v1/kv/llmgw/config/?recurse",
            "the model definitions: one key per model, or the single key before",
            _key("llmgw/config/", "list", prefix=True),
        ),
        _consul(
            "PUT",
            "/v1/kv/llmgw/activity/<model>",
            "last request time",
            _key("llmgw/activity/", "write", prefix=True),
        ),
        _consul(
            "PUT",
            "/v1/kv/llmgw/inflight/<router>",
            "this router's requests in flight per model",
            _key("llmgw/inflight/", "write", prefix=True),
        ),
        # No Nomad: the router asks (its in-flight key) and the leading watcher scales.
    ),
    "node-agent": (
        # Nomad (nomad_driver/node_agent/agent.py), on the local client agent.
        _nomad("GET", "/v1/client/metadata", "what is published now", NomadGrant("node", "read")),
        _nomad(
            "POST", "/v1/client/metadata", "publish GPUs, engines and weights", NomadGrant("node", "write")
        ),
    ),
    "operator": (
        # `llmgw apply` (nomad_driver/cli/apply.py): the definitions with check-and-set, then each job
        # read (to keep its count and skip an unchanged one) before it is registered.
        _consul(
            "GET",
            "/v1/kv/llmgw/config/?recurse",
            "the stored definitions' keys and the commit key's index",
            _key("llmgw/config/", "list", prefix=True),
        ),
        _consul(
            "PUT",
            "/v1/txn",
            "store the definitions: claim, keys 63 at a time, commit (deleting the single key)",
            _key("llmgw/config/", "write", prefix=True),
        ),
        _nomad("GET", "/v1/job/<job>", "is the running job current; its replica count", _ns("read-job")),
        _nomad("POST", "/v1/job/<job>", "register a new or changed model job", _ns("submit-job")),
        # `llmgw plan` (nomad_driver/cli/plan.py), which `apply` runs first: the running model jobs
        # (removed models), Nomad's plan of each changed one, the nodes' GPUs where it fits.
        _nomad(
            "GET", "/v1/jobs?prefix=llmgw-&meta=true", "model jobs no longer in the file", _ns("list-jobs")
        ),
        _nomad(
            "POST", "/v1/job/<job>/plan", "would it fit, and what would change", _ns("submit-job", "plan-job")
        ),
        _nomad(
            "GET",
            "/v1/nodes?resources=true",
            "the GPUs a model that fits can land on",
            NomadGrant("node", "read"),
        ),
        # A multi-node model's fabric, chosen as the watcher chooses it (nodes' meta, the GPUs
        # allocations hold), and the node pool a profile without one lands in.
        _nomad(
            "GET", "/v1/node/<node>", "a node in full: its meta names its fabric", NomadGrant("node", "read")
        ),
        _nomad(
            "GET", "/v1/allocations?resources=true", "the GPUs that are taken, per fabric", _ns("read-job")
        ),
        # Nomad authorises a namespace read with any capability in it; read-job is the one held.
        _nomad("GET", "/v1/namespace/<namespace>", "the namespace's default node pool", _ns("read-job")),
    ),
}

# Every verb of the `llmgw` CLI and whose grants it runs with: a component's (the table above),
# or none of Nomad's and Consul's at all. `ctl` talks only to a watcher's admin API, which wants
# LLMGW_ADMIN_TOKEN for `retry` where the watchers have one, and for every read where they listen
# beyond loopback.
ADMIN_API = "the admin API only, no Nomad or Consul token; `LLMGW_ADMIN_TOKEN` where the watchers listen beyond loopback"
CLI_VERBS: dict[str, Component | str] = {
    "render": "nothing: reads the models file, writes files",
    "plan": "operator",
    "apply": "operator",
    "watcher": "watcher",
    "router": "router",
    "node-agent": "node-agent",
    "ctl status": ADMIN_API,
    "ctl models": ADMIN_API,
    "ctl summary": ADMIN_API,
    "ctl nodes": ADMIN_API,
    "ctl replicas": ADMIN_API,
    "ctl retry": "the admin API only, no Nomad or Consul token; `LLMGW_ADMIN_TOKEN` where the watchers have one",
    # Registers the model's prefetch job, as `apply` registers model jobs.
    "ctl prefetch": "operator",
    "fetch": "no token: the model job's fetch task, whose template reads the model's Variable with the job's workload identity (a policy attached to the job, models.md)",
}


def grants(component: Component, system: Literal["consul", "nomad"]) -> list[Grant]:
    return [g for call in CALLS[component] if call.system == system for g in call.grants]


# --- Consul rules --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ConsulRule:
    kind: str
    name: str
    prefix: bool
    access: str

    def __str__(self) -> str:
        rule = f"{self.kind}_prefix" if self.prefix else self.kind
        return f'{rule} "{self.name}" {{ policy = "{self.access}" }}'


def consul_rules(parsed: Mapping[str, Any]) -> tuple[list[ConsulRule], list[str]]:
    """Rules from a parsed Consul policy (python-hcl2 output with quotes stripped, blocks without
    markers), and the problems found reading it: rule kinds llmgw has no use for, bad levels."""
    rules: list[ConsulRule] = []
    problems: list[str] = []
    for rule_name, blocks in parsed.items():
        if rule_name.startswith("__"):
            continue
        if rule_name not in CONSUL_RULE_NAMES:
            problems.append(f"rule {rule_name!r} is not one llmgw needs (no acl, operator, keyring, ...)")
            continue
        kind = rule_name.removesuffix("_prefix")
        for block in blocks if isinstance(blocks, list) else [blocks]:
            if not isinstance(block, Mapping):
                problems.append(f"rule {rule_name!r} is not a block: {block!r}")
                continue
            for name, body in block.items():
                access = body.get("policy") if isinstance(body, Mapping) else None
                if access not in CONSUL_LEVELS:
                    problems.append(
                        f'{rule_name} "{name}": policy {access!r} is not one of {list(CONSUL_LEVELS)}'
                    )
                    continue
                if access == "list" and kind != "key":
                    problems.append(f'{rule_name} "{name}": list applies to keys only')
                    continue
                rules.append(ConsulRule(kind, str(name), rule_name.endswith("_prefix"), str(access)))
    return rules, problems


def consul_access(rules: Iterable[ConsulRule], kind: str, name: str) -> str:
    """The level Consul gives `name`: an exact rule wins, else the longest matching prefix,
    else deny (the default policy llmgw expects)."""
    best: ConsulRule | None = None
    for rule in rules:
        if rule.kind != kind:
            continue
        if not rule.prefix and rule.name == name:
            return rule.access
        if rule.prefix and name.startswith(rule.name) and (best is None or len(rule.name) > len(best.name)):
            best = rule
    return best.access if best else "deny"


def consul_allows(rules: list[ConsulRule], grant: ConsulGrant) -> bool:
    need = CONSUL_LEVELS[grant.access]
    if not grant.prefix:
        return CONSUL_LEVELS[consul_access(rules, grant.kind, grant.name)] >= need
    # Every name under the prefix must be allowed, including those a more specific rule governs.
    probes = {grant.name, grant.name + "\uffff"}
    for rule in rules:
        if rule.kind == grant.kind and rule.name.startswith(grant.name):
            probes.update({rule.name, rule.name + "\uffff"} if rule.prefix else {rule.name})
    return all(CONSUL_LEVELS[consul_access(rules, grant.kind, p)] >= need for p in probes)


def _consul_missing(rules: list[ConsulRule], component: Component) -> list[str]:
    return [
        f"{call} ({call.why}) needs {g}"
        for call in CALLS[component]
        if call.system == "consul"
        for g in call.grants
        if isinstance(g, ConsulGrant) and not consul_allows(rules, g)
    ]


def _weaker(rule: ConsulRule) -> ConsulRule | None:
    """The same rule one level down, or None where the next step is removing it."""
    lower = {"write": "list" if rule.kind == "key" else "read", "list": "read"}.get(rule.access)
    return replace(rule, access=lower) if lower else None


def check_consul_policy(component: Component, parsed: Mapping[str, Any]) -> list[str]:
    """Problems with a component's Consul policy: calls it does not allow, and rules beyond what
    the calls need (a name no call uses, or a rule that can go or be lowered with every call
    still allowed). Empty when the policy is exactly right."""
    rules, problems = consul_rules(parsed)
    problems += [f"missing: {m}" for m in _consul_missing(rules, component)]
    needed = {(g.kind, g.name, g.prefix) for g in grants(component, "consul") if isinstance(g, ConsulGrant)}
    for i, rule in enumerate(rules):
        if (rule.kind, rule.name, rule.prefix) not in needed:
            problems.append(f"beyond need: {rule}: no call of the {component} uses this name")
            continue
        others = rules[:i] + rules[i + 1 :]
        if not _consul_missing(others, component):
            problems.append(f"beyond need: {rule}: every call is still allowed without it")
            continue
        weaker = _weaker(rule)
        if weaker and not _consul_missing([*others, weaker], component):
            problems.append(f"beyond need: {rule}: {weaker.access} is enough for every call")
    return problems


# --- Nomad rules ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class NomadPolicy:
    capabilities: dict[str, frozenset[str]]  # namespace -> capabilities
    node: str = "deny"
    agent: str = "deny"


def nomad_policy(parsed: Mapping[str, Any]) -> tuple[NomadPolicy, list[str]]:
    """A parsed Nomad policy (python-hcl2 output with quotes stripped, blocks without markers),
    and the problems found reading it. Namespace rules must list capabilities: the `policy`
    shorthand grants more than its name suggests (`write` includes alloc-exec)."""
    problems: list[str] = []
    caps: dict[str, frozenset[str]] = {}
    levels = {"node": "deny", "agent": "deny"}
    for block_name, blocks in parsed.items():
        if block_name.startswith("__"):
            continue
        if block_name not in NOMAD_RULE_BLOCKS:
            problems.append(f"block {block_name!r} is not one llmgw needs (no operator, quota, plugin, ...)")
            continue
        for block in blocks if isinstance(blocks, list) else [blocks]:
            if not isinstance(block, Mapping):
                problems.append(f"block {block_name!r} is not a block: {block!r}")
                continue
            if block_name == "namespace":
                for ns, body in block.items():
                    body = body if isinstance(body, Mapping) else {}
                    if "policy" in body:
                        problems.append(
                            f'namespace "{ns}": use capabilities, not policy = {body["policy"]!r}'
                        )
                    extra = sorted(set(body) - {"capabilities", "policy"})
                    if extra:
                        problems.append(f'namespace "{ns}": unexpected {extra}')
                    caps[str(ns)] = caps.get(str(ns), frozenset()) | frozenset(
                        str(c) for c in body.get("capabilities") or []
                    )
            else:
                level = block.get("policy")
                if level not in NOMAD_LEVELS:
                    problems.append(f"{block_name}: policy {level!r} is not one of {list(NOMAD_LEVELS)}")
                    continue
                levels[block_name] = str(level)
    return NomadPolicy(caps, levels["node"], levels["agent"]), problems


def nomad_allows(policy: NomadPolicy, grant: NomadGrant) -> bool:
    if grant.scope == "namespace":
        held = policy.capabilities.get(grant.namespace, frozenset())
        return "deny" not in held and bool(held & {grant.capability, *grant.alternatives})
    level = policy.node if grant.scope == "node" else policy.agent
    return NOMAD_LEVELS[level] >= NOMAD_LEVELS[grant.capability]


def _nomad_missing(policy: NomadPolicy, component: Component) -> list[str]:
    return [
        f"{call} ({call.why}) needs {g}"
        for call in CALLS[component]
        if call.system == "nomad"
        for g in call.grants
        if isinstance(g, NomadGrant) and not nomad_allows(policy, g)
    ]


def check_nomad_policy(component: Component, parsed: Mapping[str, Any]) -> list[str]:
    """Problems with a component's Nomad policy, as check_consul_policy does for Consul: each
    capability and each node/agent level must be needed by some call, at no higher a level."""
    policy, problems = nomad_policy(parsed)
    problems += [f"missing: {m}" for m in _nomad_missing(policy, component)]
    for ns, held in policy.capabilities.items():
        for cap in sorted(held):
            less = replace(policy, capabilities={**policy.capabilities, ns: held - {cap}})
            if not _nomad_missing(less, component):
                problems.append(
                    f'beyond need: namespace "{ns}" capability {cap}: every call is still allowed without it'
                )
    for scope in ("node", "agent"):
        level = getattr(policy, scope)
        if level == "deny":
            continue
        lower = "read" if level == "write" else "deny"
        weaker = replace(policy, node=lower) if scope == "node" else replace(policy, agent=lower)
        if not _nomad_missing(weaker, component):
            problems.append(f"beyond need: {scope} policy {level}: {lower} is enough for every call")
    return problems
