"""What each jobspec block may hold, and the API field each attribute becomes: Nomad's
`hcl:"..."` tags on the structs in its `api/` package (`api/jobs.go`, `api/tasks.go`,
`api/services.go`, `api/resources.go`, `api/constraint.go`, `api/affinity.go`). A key that is
not here is refused by name (`jobspec._check_keys`), never left out of the answer.
"""

from __future__ import annotations

# The blocks and attributes of the job, group and task themselves.
BODY_KEYS = {
    "job": {
        "type", "datacenters", "node_pool", "namespace", "region", "priority", "meta", "group",
        "constraint", "affinity", "update", "reschedule", "migrate", "ui",
    },
    "group": {
        "count", "constraint", "affinity", "network", "service", "restart", "reschedule", "update",
        "task", "meta", "ephemeral_disk", "scaling", "migrate", "shutdown_delay",
    },
    "task": {
        "driver", "config", "env", "template", "resources", "artifact", "meta", "constraint",
        "affinity", "service", "kill_timeout", "user", "restart", "identity", "shutdown_delay",
        "consul",
    },
}  # fmt: skip

# Small blocks whose converters spell their fields out (jobspec._Converter).
BLOCK_KEYS = {
    "restart": {"attempts", "interval", "delay", "mode", "render_templates"},
    "reschedule": {"attempts", "interval", "delay", "delay_function", "max_delay", "unlimited"},
    "update": {
        "stagger", "max_parallel", "health_check", "min_healthy_time", "healthy_deadline",
        "progress_deadline", "canary", "auto_revert", "auto_promote",
    },
    "migrate": {"max_parallel", "health_check", "min_healthy_time", "healthy_deadline"},
    "scaling": {"min", "max", "enabled", "type", "policy"},
    "identity": {
        "name", "aud", "change_mode", "change_signal", "env", "file", "filepath", "service_name",
        "ttl", "extra_claims",
    },
    "ui": {"description", "link"},
    "link": {"label", "url"},
    # The sugar Nomad's jobspec2 turns into an operator (`decodeConstraint`, `decodeAffinity`).
    "constraint": {
        "attribute", "value", "operator", "version", "semver", "regexp", "set_contains",
        "distinct_hosts", "distinct_property",
    },
    "affinity": {
        "attribute", "value", "operator", "weight", "version", "semver", "regexp", "set_contains",
        "set_contains_any", "set_contains_all",
    },
}  # fmt: skip

# Blocks whose attributes map one to one onto API fields: HCL name -> API name. Durations are
# converted to nanoseconds; the nested blocks each kind may hold are listed apart.
ATTRS: dict[str, dict[str, str]] = {
    # api/consul.go `Consul`: a task's or group's Consul block.
    "consul": {"namespace": "Namespace", "cluster": "Cluster", "partition": "Partition"},
    "service": {
        "name": "Name", "tags": "Tags", "canary_tags": "CanaryTags",
        "enable_tag_override": "EnableTagOverride", "port": "PortLabel",
        "address_mode": "AddressMode", "address": "Address", "task": "TaskName",
        "on_update": "OnUpdate", "provider": "Provider", "cluster": "Cluster", "kind": "Kind",
    },
    "check": {
        "name": "Name", "type": "Type", "command": "Command", "args": "Args", "path": "Path",
        "protocol": "Protocol", "port": "PortLabel", "expose": "Expose",
        "address_mode": "AddressMode", "advertise": "Advertise", "interval": "Interval",
        "timeout": "Timeout", "initial_status": "InitialStatus", "notes": "Notes",
        "tls_server_name": "TLSServerName", "tls_skip_verify": "TLSSkipVerify", "method": "Method",
        "grpc_service": "GRPCService", "grpc_use_tls": "GRPCUseTLS", "task": "TaskName",
        "success_before_passing": "SuccessBeforePassing",
        "failures_before_critical": "FailuresBeforeCritical",
        "failures_before_warning": "FailuresBeforeWarning", "body": "Body", "on_update": "OnUpdate",
    },
    "check_restart": {"limit": "Limit", "grace": "Grace", "ignore_warnings": "IgnoreWarnings"},
    "network": {
        "mode": "Mode", "device": "Device", "cidr": "CIDR", "ip": "IP", "hostname": "Hostname",
        "mbits": "MBits",
    },
    "port": {"static": "Value", "to": "To", "host_network": "HostNetwork", "ignore_collision": "IgnoreCollision"},
    "dns": {"servers": "Servers", "searches": "Searches", "options": "Options"},
    "resources": {
        "cpu": "CPU", "cores": "Cores", "memory": "MemoryMB", "memory_max": "MemoryMaxMB",
        "disk": "DiskMB", "secrets": "SecretsMB", "iops": "IOPS",
    },
    "device": {"count": "Count"},
    "numa": {"affinity": "Affinity", "devices": "Devices"},
    "template": {
        "source": "SourcePath", "destination": "DestPath", "data": "EmbeddedTmpl",
        "change_mode": "ChangeMode", "change_signal": "ChangeSignal", "once": "Once",
        "splay": "Splay", "perms": "Perms", "uid": "Uid", "gid": "Gid",
        "left_delimiter": "LeftDelim", "right_delimiter": "RightDelim", "env": "Envvars",
        "vault_grace": "VaultGrace", "error_on_missing_key": "ErrMissingKey",
    },
    "change_script": {
        "command": "Command", "args": "Args", "timeout": "Timeout", "fail_on_error": "FailOnError",
        "run_on_first_render": "RunOnFirstRender",
    },
    "wait": {"min": "Min", "max": "Max"},
    "artifact": {
        "source": "GetterSource", "mode": "GetterMode", "insecure": "GetterInsecure",
        "destination": "RelativeDest", "chown": "Chown",
    },
    "ephemeral_disk": {"sticky": "Sticky", "migrate": "Migrate", "size": "SizeMB"},
}  # fmt: skip

DURATIONS = {
    "check": {"interval", "timeout"},
    "check_restart": {"grace"},
    "template": {"splay", "vault_grace"},
    "change_script": {"timeout"},
    "wait": {"min", "max"},
}

# The blocks each of those may hold (anything else, such as a service's `connect` or a task
# resources' own `network`, is refused).
NESTED = {
    "service": {"check", "check_restart", "meta", "canary_meta", "tagged_addresses"},
    "check": {"header", "check_restart"},
    "network": {"port", "dns"},
    "resources": {"device", "numa"},
    "device": {"constraint", "affinity"},
    "template": {"change_script", "wait"},
    "artifact": {"options", "headers"},
}

for _kind, _attrs in ATTRS.items():
    BLOCK_KEYS[_kind] = set(_attrs) | NESTED.get(_kind, set())
