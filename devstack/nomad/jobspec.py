"""HCL2 jobspecs to Nomad's API JSON, for the stand-in's `/v1/jobs/parse` (what `nomad job run`
does on the client side before it registers).

Nomad's own parser (jobspec2) evaluates the full HCL2 language. This one covers what llmgw's
jobspecs and rendered jobs use, and what `nomad init` writes: `variable` blocks with defaults,
`var.x` references, string templates over variables, `coalesce()`, and the job, group, task,
network (port, dns), service (check, check_restart, header), restart, reschedule, update,
migrate, scaling, identity, ui, constraint and affinity (with jobspec2's shorthand such as
`distinct_hosts = true` or `regexp = "..."`), resources (device, numa), artifact, template
(wait, change_script), ephemeral_disk, env, meta and resources blocks, every attribute of each
under its API name (jobspec_keys.py). Runtime interpolations (`${attr.*}`, `${meta.*}`,
`${NOMAD_*}`) are left for the client, as Nomad does. Anything outside that subset, a block or an
attribute, is an error naming it, never silently dropped.
"""

from __future__ import annotations

import re
from typing import Any

import hcl2

from devstack.nomad.hclexpr import Evaluator as _Evaluator
from devstack.nomad.hclexpr import JobspecError
from devstack.nomad.jobspec_keys import ATTRS, BLOCK_KEYS, BODY_KEYS, DURATIONS

Json = dict[str, Any]


_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")
_UNITS_NS = {
    "ns": 1,
    "us": 1_000,
    "µs": 1_000,
    "ms": 1_000_000,
    "s": 10**9,
    "m": 60 * 10**9,
    "h": 3600 * 10**9,
}


def duration_ns(value: Any, where: str) -> int:
    if isinstance(value, int):
        return value
    text = str(value)
    parts = _DURATION.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise JobspecError(f"{where}: {text!r} is not a duration such as 30s or 5m")
    return int(sum(float(n) * _UNITS_NS[u] for n, u in parts))


def _blocks(body: Json, name: str) -> list[tuple[str | None, Json]]:
    """python-hcl2 gives `name "label" {}` as [{'"label"': {...}}] and `name {}` as [{...}]."""
    found: list[tuple[str | None, Json]] = []
    for item in body.get(name, []) or []:
        if not isinstance(item, dict):
            continue
        keys = [k for k in item if not k.startswith("__")]
        if len(keys) == 1 and isinstance(item[keys[0]], dict) and item[keys[0]].get("__is_block__"):
            found.append((_Evaluator.label(keys[0]), item[keys[0]]))
        else:
            found.append((None, item))
    return found


def _check_keys(kind: str, body: Json, where: str) -> None:
    unknown = {k for k in body if not k.startswith("__")} - (BODY_KEYS.get(kind) or BLOCK_KEYS[kind])
    if unknown:
        raise JobspecError(
            f"{where}: {kind} has {', '.join(sorted(unknown))}, which the stand-in's parser does not support"
        )


class _Converter:
    def __init__(self, ev: _Evaluator) -> None:
        self.ev = ev

    def v(self, body: Json, key: str, where: str, default: Any = None) -> Any:
        return self.ev.value(body[key], f"{where}.{key}") if key in body else default

    def constraints(self, body: Json, where: str, kind: str = "constraint") -> list[Json]:
        out = []
        for _, block in _blocks(body, kind):
            cw = f"{where}.{kind}"
            _check_keys(kind, block, cw)
            item = {
                "LTarget": self._text(block, "attribute", cw),
                "RTarget": self._text(block, "value", cw),
                "Operand": self._text(block, "operator", cw),
            }
            # jobspec2's shorthand: `regexp = "..."` is operator regexp with that value, and so on.
            for sugar in (
                "version",
                "semver",
                "regexp",
                "set_contains_any",
                "set_contains_all",
                "set_contains",
            ):
                if self._text(block, sugar, cw):
                    item["Operand"], item["RTarget"] = sugar, self._text(block, sugar, cw)
            if "distinct_hosts" in block:
                item["Operand"], item["RTarget"] = "distinct_hosts", self._text(block, "distinct_hosts", cw)
            if self._text(block, "distinct_property", cw):
                item["Operand"], item["LTarget"] = (
                    "distinct_property",
                    self._text(block, "distinct_property", cw),
                )
            item["Operand"] = item["Operand"] or "="
            if kind == "affinity":
                item["Weight"] = self.v(block, "weight", cw, 50)
            out.append(item)
        return out

    def _text(self, block: Json, key: str, where: str) -> str:
        """An attribute HCL converts to a string, as Nomad's parser does (`true`, not `True`)."""
        value = self.v(block, key, where, "")
        return ("true" if value else "false") if isinstance(value, bool) else str(value)

    def attrs(self, kind: str, block: Json, where: str) -> Json:
        """The block's attributes under their API names (jobspec_keys.ATTRS), durations in
        nanoseconds; only those the HCL sets, as Nomad's parser leaves the rest unset."""
        _check_keys(kind, block, where)
        durations = DURATIONS.get(kind, set())
        return {
            field: self._d(block, key, where) if key in durations else self.v(block, key, where)
            for key, field in ATTRS[kind].items()
            if key in block
        }

    def _d(self, block: Json, key: str, where: str) -> int | None:
        return duration_ns(self.v(block, key, where), f"{where}.{key}") if key in block else None

    def restart(self, block: Json, where: str) -> Json:
        _check_keys("restart", block, where)
        return {
            "Attempts": self.v(block, "attempts", where),
            "Interval": self._d(block, "interval", where),
            "Delay": self._d(block, "delay", where),
            "Mode": self.v(block, "mode", where),
            "RenderTemplates": self.v(block, "render_templates", where),
        }

    def reschedule(self, block: Json, where: str) -> Json:
        _check_keys("reschedule", block, where)
        return {
            "Attempts": self.v(block, "attempts", where),
            "Interval": self._d(block, "interval", where),
            "Delay": self._d(block, "delay", where),
            "DelayFunction": self.v(block, "delay_function", where),
            "MaxDelay": self._d(block, "max_delay", where),
            "Unlimited": self.v(block, "unlimited", where),
        }

    def update(self, block: Json, where: str) -> Json:
        _check_keys("update", block, where)
        return {
            "Stagger": self._d(block, "stagger", where),
            "MaxParallel": self.v(block, "max_parallel", where),
            "HealthCheck": self.v(block, "health_check", where),
            "MinHealthyTime": self._d(block, "min_healthy_time", where),
            "HealthyDeadline": self._d(block, "healthy_deadline", where),
            "ProgressDeadline": self._d(block, "progress_deadline", where),
            "Canary": self.v(block, "canary", where),
            "AutoRevert": self.v(block, "auto_revert", where),
            "AutoPromote": self.v(block, "auto_promote", where),
        }

    def migrate(self, block: Json, where: str) -> Json:
        _check_keys("migrate", block, where)
        return {
            "MaxParallel": self.v(block, "max_parallel", where),
            "HealthCheck": self.v(block, "health_check", where),
            "MinHealthyTime": self._d(block, "min_healthy_time", where),
            "HealthyDeadline": self._d(block, "healthy_deadline", where),
        }

    def scaling(self, block: Json, where: str) -> Json:
        """A group's `scaling` block (`api.ScalingPolicy`); its `policy` is the autoscaler's,
        passed through as a map."""
        _check_keys("scaling", block, where)
        policy: Json | None = None
        for _, p in _blocks(block, "policy"):
            policy = {**(policy or {}), **self.ev.value(p, f"{where}.policy")}
        return {
            "Min": self.v(block, "min", where),
            "Max": self.v(block, "max", where),
            "Policy": policy,
            "Enabled": self.v(block, "enabled", where),
            "Type": self.v(block, "type", where, ""),
        }

    def identity(self, block: Json, where: str) -> Json:
        _check_keys("identity", block, where)
        return {
            "Name": self.v(block, "name", where, ""),
            "Audience": self.v(block, "aud", where),
            "ChangeMode": self.v(block, "change_mode", where, ""),
            "ChangeSignal": self.v(block, "change_signal", where, ""),
            "Env": self.v(block, "env", where, False),
            "File": self.v(block, "file", where, False),
            "Filepath": self.v(block, "filepath", where, ""),
            "ServiceName": self.v(block, "service_name", where, ""),
            "TTL": self._d(block, "ttl", where) or 0,
            "ExtraClaims": self.v(block, "extra_claims", where),
        }

    def ui(self, block: Json, where: str) -> Json:
        _check_keys("ui", block, where)
        links = []
        for _, link in _blocks(block, "link"):
            _check_keys("link", link, f"{where}.link")
            links.append({"Label": self.v(link, "label", where, ""), "URL": self.v(link, "url", where, "")})
        return {"Description": self.v(block, "description", where, ""), "Links": links or None}

    def _one(self, body: Json, key: str, where: str, convert: Any) -> Json | None:
        blocks = _blocks(body, key)
        if len(blocks) > 1:
            raise JobspecError(f"{where}: only one {key} block is allowed")
        return convert(blocks[0][1], f"{where}.{key}") if blocks else None

    def service(self, block: Json, where: str) -> Json:
        service: Json = {
            "Name": None,
            "PortLabel": "",
            "Tags": [],
            "Provider": "consul",
            **self.attrs("service", block, where),
            "Meta": self._map(block, "meta", where),
        }
        for key, field in (("canary_meta", "CanaryMeta"), ("tagged_addresses", "TaggedAddresses")):
            if _blocks(block, key) or isinstance(block.get(key), dict):
                service[field] = self._map(block, key, where)
        restart = self._one(block, "check_restart", where, self.check_restart)
        if restart is not None:
            service["CheckRestart"] = restart
        service["Checks"] = [self.check(c, f"{where}.check") for _, c in _blocks(block, "check")]
        return service

    def check(self, block: Json, where: str) -> Json:
        check: Json = {
            "Name": "",
            "Type": None,
            "Path": "",
            "PortLabel": "",
            "Method": "",
            "Interval": duration_ns("10s", where),
            "Timeout": duration_ns("2s", where),
            **self.attrs("check", block, where),
        }
        header = self._one(block, "header", where, self.header)
        if header is not None:
            check["Header"] = header
        restart = self._one(block, "check_restart", where, self.check_restart)
        if restart is not None:
            check["CheckRestart"] = restart
        return check

    def check_restart(self, block: Json, where: str) -> Json:
        return self.attrs("check_restart", block, where)

    def header(self, block: Json, where: str) -> Json:
        """`header { Authorization = ["Basic ..."] }`: each header has a list of values."""
        headers = self.ev.value(block, where)
        for name, values in headers.items():
            if not isinstance(values, list) or not all(isinstance(v, str) for v in values):
                raise JobspecError(f"{where}.{name}: a header's value is a list of strings")
        return headers

    def _map(self, body: Json, key: str, where: str) -> Json | None:
        """`key { a = "b" }` or `key = { a = "b" }`: jobspec2 takes either for a string map."""
        blocks = [b for _, b in _blocks(body, key)]
        if isinstance(body.get(key), dict):
            blocks = [body[key]]
        if not blocks:
            return None
        merged: Json = {}
        for block in blocks:
            merged.update(self.ev.value(block, f"{where}.{key}"))
        return {k: str(v) if not isinstance(v, str) else v for k, v in merged.items()}

    def task(self, name: str, body: Json, where: str) -> Json:
        _check_keys("task", body, where)
        config: Json = {}
        for _, block in _blocks(body, "config"):
            config.update(self.ev.value(block, f"{where}.config"))
        templates = [self.template(b, f"{where}.template") for _, b in _blocks(body, "template")]
        artifacts = [self.artifact(b, f"{where}.artifact") for _, b in _blocks(body, "artifact")]
        resources = self._one(body, "resources", where, self.resources)
        return {
            "Name": name,
            "Driver": self.v(body, "driver", where),
            "User": self.v(body, "user", where, ""),
            "Config": config,
            "Env": self._map(body, "env", where),
            "Templates": templates or None,
            "Artifacts": artifacts or None,
            "Resources": resources,
            "Meta": self._map(body, "meta", where),
            "Constraints": self.constraints(body, where) or None,
            "Services": [self.service(b, f"{where}.service") for _, b in _blocks(body, "service")] or None,
            "KillTimeout": self._d(body, "kill_timeout", where),
            "Affinities": self.constraints(body, where, "affinity") or None,
            "RestartPolicy": self._one(body, "restart", where, self.restart),
            "ShutdownDelay": self._d(body, "shutdown_delay", where),
            "Consul": self._one(body, "consul", where, lambda b, w: self.attrs("consul", b, w)),
            **self.identities(body, where),
        }

    def resources(self, block: Json, where: str) -> Json:
        resources: Json = {"CPU": None, "MemoryMB": None, **self.attrs("resources", block, where)}
        devices = []
        for label, device in _blocks(block, "device"):
            dw = f"{where}.device.{label}"
            devices.append(
                {
                    "Name": label,
                    "Count": 1,
                    **self.attrs("device", device, dw),
                    "Constraints": self.constraints(device, dw) or None,
                    "Affinities": self.constraints(device, dw, "affinity") or None,
                }
            )
        if devices:
            resources["Devices"] = devices
        numa = self._one(block, "numa", where, lambda b, w: self.attrs("numa", b, w))
        if numa is not None:
            resources["NUMA"] = numa
        return resources

    def template(self, block: Json, where: str) -> Json:
        template: Json = {
            "DestPath": None,
            "EmbeddedTmpl": "",
            "Envvars": False,
            "ChangeMode": "restart",
            **self.attrs("template", block, where),
        }
        for key, field in (("change_script", "ChangeScript"), ("wait", "Wait")):
            nested = self._one(block, key, where, lambda b, w, k=key: self.attrs(k, b, w))
            if nested is not None:
                template[field] = nested
        return template

    def artifact(self, block: Json, where: str) -> Json:
        artifact: Json = {
            "GetterSource": None,
            "RelativeDest": "local/",
            "GetterMode": "any",
            **self.attrs("artifact", block, where),
            "GetterOptions": self._map(block, "options", where),
        }
        headers = self._map(block, "headers", where)
        if headers is not None:
            artifact["GetterHeaders"] = headers
        return artifact

    def network(self, block: Json, where: str) -> Json:
        dynamic: list[Json] = []
        reserved: list[Json] = []
        for label, port in _blocks(block, "port"):
            entry = {"Label": label, "Value": 0, "To": 0, **self.attrs("port", port, f"{where}.port.{label}")}
            # A static port is reserved; the rest Nomad picks (`port "http" {}`).
            (reserved if entry["Value"] else dynamic).append(entry)
        network: Json = {
            "Mode": "host",
            **self.attrs("network", block, where),
            "DynamicPorts": dynamic or None,
            "ReservedPorts": reserved or None,
        }
        dns = self._one(block, "dns", where, lambda b, w: self.attrs("dns", b, w))
        if dns is not None:
            network["DNS"] = dns
        return network

    def identities(self, body: Json, where: str) -> Json:
        """jobspec2 moves the default identity (no name, or "default") to `Identity` and keeps
        the named ones in `Identities`."""
        found = [self.identity(b, f"{where}.identity") for _, b in _blocks(body, "identity")]
        default = next((i for i in found if i["Name"] in ("", "default")), None)
        rest = [i for i in found if i is not default]
        return {"Identity": default, "Identities": rest or None}

    def group(self, name: str, body: Json, where: str) -> Json:
        _check_keys("group", body, where)
        networks = [self.network(b, f"{where}.network") for _, b in _blocks(body, "network")]
        group: Json = {
            "Name": name,
            "Count": self.v(body, "count", where, 1),
            "Constraints": self.constraints(body, where) or None,
            "Affinities": self.constraints(body, where, "affinity") or None,
            "Networks": networks or None,
            "Services": [self.service(b, f"{where}.service") for _, b in _blocks(body, "service")] or None,
            "Meta": self._map(body, "meta", where),
            "ShutdownDelay": self._d(body, "shutdown_delay", where),
            "Tasks": [
                self.task(label or "", b, f"{where}.task.{label}") for label, b in _blocks(body, "task")
            ],
        }
        for key, field, convert in (
            ("restart", "RestartPolicy", self.restart),
            ("reschedule", "ReschedulePolicy", self.reschedule),
            ("update", "Update", self.update),
            ("migrate", "Migrate", self.migrate),
            ("scaling", "Scaling", self.scaling),
        ):
            converted = self._one(body, key, where, convert)
            if converted is not None:
                group[field] = converted
        disk = self._one(body, "ephemeral_disk", where, lambda b, w: self.attrs("ephemeral_disk", b, w))
        if disk is not None:
            group["EphemeralDisk"] = {"SizeMB": 300, **disk}
        return group

    def job(self, name: str, body: Json) -> Json:
        where = f"job.{name}"
        _check_keys("job", body, where)
        job: Json = {
            "ID": name,
            "Name": name,
            "Type": self.v(body, "type", where, "service"),
            "Datacenters": self.v(body, "datacenters", where),
            "NodePool": self.v(body, "node_pool", where),
            "Namespace": self.v(body, "namespace", where),
            "Region": self.v(body, "region", where),
            "Priority": self.v(body, "priority", where),
            "Meta": self._map(body, "meta", where),
            "Constraints": self.constraints(body, where) or None,
            "Affinities": self.constraints(body, where, "affinity") or None,
            "TaskGroups": [
                self.group(label or "", b, f"{where}.group.{label}") for label, b in _blocks(body, "group")
            ],
            # At job level these are the defaults the groups inherit when canonicalised; parsed
            # alone they stay here, as Nomad's parser leaves them.
            "Update": self._one(body, "update", where, self.update),
            "Reschedule": self._one(body, "reschedule", where, self.reschedule),
            "Migrate": self._one(body, "migrate", where, self.migrate),
            "UI": self._one(body, "ui", where, self.ui),
        }
        return {k: v for k, v in job.items() if v is not None}


def parse_variables_file(text: str) -> dict[str, Any]:
    """The `Variables` field of /v1/jobs/parse: an HCL vars file (`name = value` lines)."""
    if not text.strip():
        return {}
    try:
        raw = hcl2.loads(text)
    except Exception as exc:
        raise JobspecError(f"variables: {exc}") from exc
    ev = _Evaluator({})
    return {k: ev.value(v, f"variables.{k}") for k, v in raw.items()}


def undefined_variable(name: str) -> str:
    """jobspec2's diagnostic for a value given to an undeclared variable, as hcl prints it."""
    return (
        f'<nil>: Undefined variable; A "{name}" variable was set but was not found in known '
        f'variables. To declare variable "{name}", place this block in your job files'
    )


def declared_variables(text: str) -> set[str]:
    try:
        return {name for name, _ in _blocks(hcl2.loads(text), "variable") if name}
    except Exception as exc:
        raise JobspecError(f"Failed to parse job: {exc}") from exc


def parse_jobspec(text: str, variables: dict[str, Any] | None = None, *, strict: bool = True) -> Json:
    """`strict` as `nomad job run`'s `-hcl2-strict` (its default); `/v1/jobs/parse` is not."""
    if not text.strip():
        raise JobspecError("Job spec is empty")
    try:
        body = hcl2.loads(text)
    except Exception as exc:
        raise JobspecError(f"Failed to parse job: {exc}") from exc
    given = dict(variables or {})
    values: dict[str, Any] = {}
    declared = set()
    for name, block in _blocks(body, "variable"):
        assert name is not None
        declared.add(name)
        if name in given:
            values[name] = given[name]
        elif "default" in block:
            values[name] = _Evaluator({}).value(block["default"], f"variable.{name}.default")
        else:
            raise JobspecError(f"Failed to parse job: variable {name!r} has no default and was not given")
    undeclared = sorted(set(given) - declared)
    if undeclared and strict:
        raise JobspecError(f"Failed to parse job: {undefined_variable(undeclared[0])}")
    jobs = _blocks(body, "job")
    if len(jobs) != 1:
        raise JobspecError(f"Failed to parse job: expected one job block, found {len(jobs)}")
    name, job_body = jobs[0]
    return _Converter(_Evaluator(values)).job(name or "", job_body)
