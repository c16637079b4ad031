"""Nomad ACLs: policies, tokens and what a token may do, as hashicorp/nomad does it.

Sources (hashicorp/nomad 2.0.6-dev, commit aa026cc): acl/policy.go (the rule language, `expandNamespacePolicy`, the capability names and the
valid policies), acl/acl.go (how several policies merge: namespace capabilities add up, `deny`
wins; node/agent/operator take the strongest; a namespace rule matches exactly before the closest
glob; `matchingVariablesCapabilitySet`: a Variable path matches a policy's exact path, then a
workload's own `nomad/jobs/<job>[/<group>[/<task>]]`, then the closest glob), nomad/auth/auth.go
(`policiesForClaims`: a workload identity gets the policies attached to its job, group or task
with `-job`/`-group`/`-task`, i.e. `JobACL`), nomad/structs/structs.go (`ACLPolicy`, `ACLPolicyListStub`, `ACLToken` and their JSON, the
policy name rule) and nomad/structs/errors.go (the error texts). The stand-in understands what
llmgw's policies use; a rule it does not (host volumes, plugins, quota) is refused at
write time, so a policy never quietly means less here than on a real cluster.
"""

from __future__ import annotations

import base64
import hashlib
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import hcl2

from devstack.nomad.encode import rfc3339

Json = dict[str, Any]

ERR_PERMISSION_DENIED = "Permission denied"  # structs.ErrPermissionDenied
VARIABLE_CAPABILITIES = {"write", "read", "list", "destroy", "deny"}  # acl/policy.go
# acl.go workloadVariablesCapabilitySet: what a workload may do with its own paths.
_WORKLOAD_VARIABLE_CAPS = {"read", "list"}
ERR_TOKEN_NOT_FOUND = "ACL token not found"  # structs.ErrTokenNotFound

POLICY_DENY, POLICY_READ, POLICY_WRITE, POLICY_SCALE = "deny", "read", "write", "scale"
_RANK = {POLICY_DENY: -1, "": 0, POLICY_READ: 1, POLICY_WRITE: 2}
VALID_POLICY_NAME = re.compile(r"[a-zA-Z0-9-]{1,128}")  # structs.validPolicyName
ANONYMOUS_POLICY = "anonymous"
# acl.AllNamespacesSentinel: `?namespace=*` is allowed where any namespace allows the operation.
ALL_NAMESPACES = "*"  # the policy Nomad applies to requests without a token

# acl/policy.go `expandNamespacePolicy`: `read`, then what `write` adds.
_READ = [
    "list-jobs",
    "parse-job",
    "read-job",
    "csi-list-volume",
    "csi-read-volume",
    "read-job-scaling",
    "list-scaling-policies",
    "read-scaling-policy",
    "host-volume-read",
]
_WRITE = [
    *_READ,
    "scale-job",
    "submit-job",
    "dispatch-job",
    "read-logs",
    "read-fs",
    "alloc-exec",
    "alloc-lifecycle",
    "csi-mount-volume",
    "csi-write-volume",
    "submit-recommendation",
    "host-volume-create",
]
_SCALE = [
    "list-scaling-policies",
    "read-scaling-policy",
    "read-job-scaling",
    "scale-job",
    "read-job",
    "submit-recommendation",
]
# acl/policy.go `isNamespaceCapabilityValid`.
NAMESPACE_CAPABILITIES = frozenset(
    [
        *_WRITE,
        "deny",
        "alloc-node-exec",
        "csi-register-plugin",
        "sentinel-override",
        "host-volume-register",
        "host-volume-write",
        "host-volume-delete",
        # The fine-grained job and deployment capabilities that `submit-job` also covers.
        "register-job",
        "revert-job",
        "deregister-job",
        "purge-job",
        "evaluate-job",
        "plan-job",
        "tag-job-version",
        "stable-job",
        "fail-deployment",
        "pause-deployment",
        "promote-deployment",
        "unblock-deployment",
        "cancel-deployment",
        "set-alloc-health-deployment",
        "gc-allocation",
        "pause-allocation",
        "force-periodic-job",
        "delete-service-registration",
    ]
)
_SIMPLE_BLOCKS = ("node", "agent", "operator")
_UNSUPPORTED = ("quota", "plugin", "host_volume", "node_pool", "sentinel")


class PolicyError(ValueError):
    pass


def multierror(*errors: str) -> str:
    """go-multierror's text, which Nomad's Validate methods return as is."""
    points = "".join(f"\t* {e}\n" for e in errors)
    return f"{len(errors)} error{'s' if len(errors) > 1 else ''} occurred:\n{points}\n"


def expand_namespace_policy(policy: str) -> list[str]:
    return {
        POLICY_DENY: ["deny"],
        POLICY_READ: list(_READ),
        POLICY_WRITE: list(_WRITE),
        POLICY_SCALE: list(_SCALE),
    }.get(policy, [])


@dataclass
class Rules:
    """One policy's rules: capabilities per namespace (a name or a glob), and the simple blocks."""

    namespaces: dict[str, set[str]] = field(default_factory=dict)
    simple: dict[str, str] = field(default_factory=dict)
    # (namespace, path), either a glob, -> Variable capabilities
    variables: dict[tuple[str, str], set[str]] = field(default_factory=dict)


def _text(value: Any) -> str:
    text = str(value)
    return text[1:-1] if len(text) >= 2 and text[0] == text[-1] == '"' else text


def parse_rules(rules: str) -> Rules:
    """acl.Parse for the subset llmgw needs; anything else is an error, never ignored."""
    try:
        body = hcl2.loads(rules)
    except Exception as exc:  # python-hcl2 raises lark's errors of several types
        raise PolicyError(f"Failed to parse ACL Policy: {exc}") from None
    parsed = Rules()
    for key, items in body.items():
        if key == "namespace":
            for item in items:
                for label, block in item.items():
                    name = _text(label)
                    for path, caps in _variable_paths(name, block.pop("variables", None)).items():
                        parsed.variables.setdefault((name, path), set()).update(caps)
                    parsed.namespaces.setdefault(name, set()).update(_namespace_caps(name, block))
        elif key in _SIMPLE_BLOCKS:
            for block in items:
                policy = _text(block.get("policy", ""))
                extra = set(block) - {"policy", "__is_block__"}
                if extra:
                    # operator `capabilities` (snapshot-save and the like) llmgw never grants
                    raise PolicyError(f"the stand-in does not implement {sorted(extra)} in {key!r}")
                if policy not in (POLICY_DENY, POLICY_READ, POLICY_WRITE):
                    raise PolicyError(f"Invalid {key} policy: {policy!r}")
                parsed.simple[key] = _stronger(parsed.simple.get(key, ""), policy)
        elif key in _UNSUPPORTED:
            raise PolicyError(f"the stand-in does not implement {key!r} rules; use a real Nomad for them")
        else:
            raise PolicyError(f"Invalid or duplicate policy keys: [{key}]")
    if not parsed.namespaces and not parsed.simple and not parsed.variables:
        raise PolicyError(f"Invalid policy: {rules}")  # Parse's `p.IsEmpty()`
    return parsed


def _variable_paths(namespace: str, blocks: Any) -> dict[str, set[str]]:
    """`variables { path "P" { capabilities = [...] } }`; acl/policy.go expandVariablesCapabilities:
    `deny` alone wins, `read` brings `list`."""
    paths: dict[str, set[str]] = {}
    for block in blocks or []:
        for item in block.get("path", []):
            for label, body in item.items():
                caps = {_text(c) for c in body.get("capabilities", []) or []}
                bad = sorted(caps - VARIABLE_CAPABILITIES)
                if bad:
                    raise PolicyError(f"Invalid variable capabilities {bad} in namespace {namespace!r}")
                if "deny" in caps:
                    caps = {"deny"}
                elif "read" in caps:
                    caps.add("list")
                paths[_text(label)] = caps
    return paths


def _namespace_caps(name: str, block: Json) -> set[str]:
    extra = set(block) - {"policy", "capabilities", "__is_block__"}
    if extra:
        raise PolicyError(f"the stand-in does not implement {sorted(extra)} in namespace {name!r}")
    policy = _text(block.get("policy", ""))
    if policy and policy not in (POLICY_DENY, POLICY_READ, POLICY_WRITE, POLICY_SCALE):
        raise PolicyError(f"Invalid namespace policy: {policy!r} in namespace {name!r}")
    caps = set(expand_namespace_policy(policy))
    for cap in block.get("capabilities", []) or []:
        cap = _text(cap)
        if cap not in NAMESPACE_CAPABILITIES:
            raise PolicyError(f"Invalid namespace capability '{cap}' in namespace {name!r}")
        caps.add(cap)
    return caps


def _stronger(a: str, b: str) -> str:
    if POLICY_DENY in (a, b):
        return POLICY_DENY
    return a if _RANK[a] >= _RANK[b] else b


@dataclass(frozen=True)
class Claim:
    """acl.ACLClaim: the workload a task's identity names."""

    namespace: str
    job: str
    group: str
    task: str

    def own_paths(self) -> tuple[str, ...]:
        job = f"nomad/jobs/{self.job}"
        return ("nomad/jobs", job, f"{job}/{self.group}", f"{job}/{self.group}/{self.task}")


class ACL:
    """acl.ACL: the merged rules of a token's policies; a management token may do anything."""

    def __init__(self, policies: list[Rules], management: bool = False) -> None:
        self.management = management
        self.namespaces: dict[str, set[str]] = {}
        self.simple: dict[str, str] = {}
        self.variables: dict[tuple[str, str], set[str]] = {}
        for rules in policies:
            for name, caps in rules.namespaces.items():
                self.namespaces.setdefault(name, set()).update(caps)
            for where, caps in rules.variables.items():
                self.variables.setdefault(where, set()).update(caps)
            for key, policy in rules.simple.items():
                self.simple[key] = _stronger(self.simple.get(key, ""), policy)

    def _caps(self, namespace: str) -> set[str]:
        if namespace in self.namespaces:
            return self.namespaces[namespace]
        # acl.findClosestMatchingGlob: the glob that leaves the fewest characters unmatched.
        best: tuple[int, str] | None = None
        for pattern in self.namespaces:
            if "*" in pattern and _glob(pattern, namespace):
                score = len(namespace) - len(pattern.replace("*", ""))
                if best is None or score < best[0]:
                    best = (score, pattern)
        return self.namespaces[best[1]] if best else set()

    def allow_ns_op(self, namespace: str, *capabilities: str) -> bool:
        """AllowNsOp, or AllowNsOpAny with several: a `deny` capability beats everything."""
        if self.management:
            return True
        if namespace == ALL_NAMESPACES and any(
            _check(caps, c) for caps in self.namespaces.values() for c in capabilities
        ):
            return True
        return any(_check(self._caps(namespace), c) for c in capabilities)

    def allow_namespace(self, namespace: str) -> bool:
        if self.management:
            return True
        if namespace == ALL_NAMESPACES:
            return any(caps and "deny" not in caps for caps in self.namespaces.values())
        caps = self._caps(namespace)
        return bool(caps) and "deny" not in caps

    def allow_variable(self, namespace: str, path: str, op: str, claim: Claim | None = None) -> bool:
        """AllowVariableOperation: the exact path, the workload's own paths, the closest glob."""
        if self.management:
            return True
        caps = self.variables.get((namespace, path))
        if caps is None and claim is not None and claim.namespace == namespace and path in claim.own_paths():
            caps = _WORKLOAD_VARIABLE_CAPS
        if caps is None:
            text = f"{namespace}\x00{path}"
            best: tuple[int, set[str]] | None = None
            for (ns, pattern), found in self.variables.items():
                glob = f"{ns}\x00{pattern}"
                if "*" in glob and _glob(glob, text):
                    score = len(text) - len(glob.replace("*", ""))
                    if best is None or score < best[0]:
                        best = (score, found)
            caps = best[1] if best else set()
        return _check(caps, op)

    def allow(self, block: str, level: str) -> bool:
        """AllowNodeRead/Write, AllowAgentRead/Write, AllowOperatorRead/Write."""
        return self.management or _RANK[self.simple.get(block, "")] >= _RANK[level]


def _check(caps: set[str], capability: str) -> bool:
    """capabilitySet.Check: a `deny` in the set beats everything."""
    return "deny" not in caps and capability in caps


def _glob(pattern: str, text: str) -> bool:
    return re.fullmatch(".*".join(re.escape(p) for p in pattern.split("*")), text) is not None


def _hash(*parts: Any) -> str:
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=32).digest()
    return base64.b64encode(digest).decode()


class AclState:
    """The ACL tables (policies by name, tokens by secret), indexed with the rest of the store."""

    def __init__(self, store: Any, bootstrap_secret: str) -> None:
        self.store = store
        self.policies: dict[str, Json] = {}
        self.rules: dict[str, Rules] = {}
        self.tokens: dict[str, Json] = {}
        self.create_token({"Name": "Bootstrap Token", "Type": "management"}, secret=bootstrap_secret)

    def _raise_index(self) -> int:
        # An ACL write is a raft write in Nomad: it takes the next index. Nothing blocks on the
        # ACL tables here, so no table wakes up.
        self.store.index += 1
        return int(self.store.index)

    def upsert_policy(self, policy: Json) -> int:
        # nomad/acl_endpoint.go UpsertPolicies: "policy %d invalid: %v" of ACLPolicy.Validate.
        name = str(policy.get("Name") or "")
        rules_text = str(policy.get("Rules") or "")
        errors = [] if VALID_POLICY_NAME.fullmatch(name) else [f"invalid name '{name}'"]
        try:
            rules = parse_rules(rules_text)
        except PolicyError as exc:
            errors.append(f"failed to parse rules: {exc}")
        if errors:
            raise PolicyError(f"policy 0 invalid: {multierror(*errors)}")
        index = self._raise_index()
        old = self.policies.get(name)
        description = str(policy.get("Description") or "")
        self.policies[name] = {
            "Name": name,
            "Description": description,
            "Rules": rules_text,
            # Nomad fills this from Rules on read (acl.Policy); the stand-in does not model it.
            "RulesJSON": None,
            "JobACL": policy.get("JobACL"),
            "Hash": _hash(name, description, rules_text),
            "CreateIndex": old["CreateIndex"] if old else index,
            "ModifyIndex": index,
        }
        self.rules[name] = rules
        return index

    def delete_policy(self, name: str) -> int:
        self.policies.pop(name, None)
        self.rules.pop(name, None)
        return self._raise_index()

    def create_token(self, token: Json, secret: str | None = None) -> Json:
        kind = token.get("Type") or "client"
        policies = list(token.get("Policies") or [])
        # structs.ACLToken.Validate's texts, wrapped as ACL.UpsertTokens wraps them.
        error = None
        if kind not in ("client", "management"):
            error = "token type must be client or management"
        elif kind == "client" and not policies and not token.get("Roles"):
            error = "client token missing policies or roles"
        elif kind == "management" and policies:
            error = "management token cannot be associated with policies or roles"
        if error:
            raise PolicyError(f"token 0 invalid: {multierror(error)}")
        index = self._raise_index()
        created: Json = {
            "AccessorID": str(uuid.uuid4()),
            "SecretID": secret or str(uuid.uuid4()),
            "Name": str(token.get("Name") or ""),
            "Type": kind,
            "Policies": policies or None,
            "Roles": None,
            "Global": bool(token.get("Global")),
            "Hash": "",
            "CreateTime": rfc3339(time.time_ns()),
            "ExpirationTime": None,
            "ExpirationTTL": 0,
            "CreateIndex": index,
            "ModifyIndex": index,
        }
        created["Hash"] = _hash(created["Name"], kind, policies, created["Global"])
        self.tokens[created["SecretID"]] = created
        return created

    def resolve(self, secret: str) -> tuple[Json | None, ACL]:
        """(token, ACL) for a secret; no secret is the anonymous token. Raises on an unknown one."""
        if not secret:
            anonymous = [self.rules[ANONYMOUS_POLICY]] if ANONYMOUS_POLICY in self.rules else []
            return None, ACL(anonymous)
        token = self.tokens.get(secret)
        if token is None:
            raise LookupError(ERR_TOKEN_NOT_FOUND)
        if token["Type"] == "management":
            return token, ACL([], management=True)
        # A policy deleted after the token was made simply grants nothing, as in Nomad.
        return token, ACL([self.rules[p] for p in token["Policies"] or [] if p in self.rules])

    def workload_acl(self, claim: Claim) -> ACL:
        """The ACL of a task's workload identity (auth.go policiesForClaims): the policies whose
        JobACL names its job (and its group, and its task, where they name one), and those
        attached to its whole namespace."""
        rules = []
        for name, policy in self.policies.items():
            job_acl = policy.get("JobACL") or {}
            if not job_acl or (job_acl.get("Namespace") or "default") != claim.namespace:
                continue
            job, group, task = (str(job_acl.get(k) or "") for k in ("JobID", "Group", "Task"))
            if job and job != claim.job:
                continue
            if (group and group != claim.group) or (task and task != claim.task):
                continue
            rules.append(self.rules[name])
        return ACL(rules)
