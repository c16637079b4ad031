"""Where a model's source credentials live in Nomad Variables, at a path Nomad accepts.

Nomad refuses a Variable path outside `^[a-zA-Z0-9-_~/]{1,128}$` (hashicorp/nomad
nomad/structs/variables.go, `validVariablePath`). A model name may hold dots
(`qwen2.5-7b`), so its job's own path, `nomad/jobs/llmgw-qwen2.5-7b`, cannot exist, and the
job's workload identity can read no Variable by default. llmgw's mapping: the dot becomes `~`,
a character no model name has (spec.MODEL_NAME_RE), so two models never share a Variable, under
a prefix of llmgw's own. The job reads it through an ACL policy attached to it
(`nomad acl policy apply -namespace NS -job JOB`), whose name follows Nomad's policy name rule
(`^[a-zA-Z0-9-]{1,128}$`, nomad/structs/structs.go `ValidPolicyName`).
"""

from __future__ import annotations

import re

VARIABLE_PATH_RE = re.compile(r"[a-zA-Z0-9_~/-]{1,128}")
POLICY_NAME_RE = re.compile(r"[a-zA-Z0-9-]{1,128}")
SOURCES_PREFIX = "llmgw/sources/"


def source_variable_path(model: str) -> str:
    """`llmgw/sources/qwen2~5-7b` for `qwen2.5-7b`."""
    return SOURCES_PREFIX + model.replace(".", "~")


def source_policy_name(model: str) -> str:
    """`llmgw-source-qwen2-5-7b` for `qwen2.5-7b`: a name for the policy that lets the model's
    job read its Variable (one policy per job; a clash only needs another name)."""
    return "llmgw-source-" + re.sub(r"[^a-zA-Z0-9-]", "-", model)
