"""`llmgw ctl prefetch MODEL [--nodes A,B]`: the model's weights into the caches of chosen nodes
before the first request, so that an on-demand start costs the engine's load time only.

A `sysbatch` job, `llmgw-prefetch-<model>`: one allocation per feasible node, running the same
fetch task as the model's own job (fetch/render.py), with the same host volume, credentials
template and engine constraint, so it lands exactly where the model could run: every such node
of the profile's pool and datacenters, or only those named. A node that holds the weights
already finishes at once. Registering it again (a new definition, other nodes) runs it again.
"""

from __future__ import annotations

import copy
from typing import Any

from nomad_driver.fetch.render import add_fetch, fetched
from nomad_driver.render import GROUP_NAME, render_job
from nomad_driver.spec import Model

PREFETCH_PREFIX = "llmgw-prefetch-"


class NotFetched(ValueError):
    """The model's source is not one llmgw fetches (a file the engine reads where it lies, a
    whole hf repository)."""


def prefetch_job_id(model: Model) -> str:
    return PREFETCH_PREFIX + model.name


def render_prefetch_job(
    model: Model, nodes: list[str] | None = None, *, namespace: str | None = None
) -> dict[str, Any]:
    if not fetched(model):
        raise NotFetched(
            f"model '{model.name}': source {model.source!r} is not fetched by llmgw (one https, "
            "s3 or hf file is; a file:// path is read where it lies on the node); nothing to prefetch"
        )
    model_job = render_job(model, namespace=namespace)
    model_group = model_job["TaskGroups"][0]
    group: dict[str, Any] = {"Name": GROUP_NAME, "Count": 1, "Tasks": [{"Name": "engine"}]}
    add_fetch(group, model, group["Tasks"][0])
    fetch = group["Tasks"][1]
    # The whole job is the fetch: no lifecycle, and it is not retried beyond Nomad's own policy.
    del fetch["Lifecycle"]
    constraints = copy.deepcopy(model_group.get("Constraints") or [])
    if nodes:
        constraints.append(
            {"LTarget": "${node.unique.name}", "RTarget": ",".join(nodes), "Operand": "set_contains_any"}
        )
    job: dict[str, Any] = {
        "ID": prefetch_job_id(model),
        "Name": prefetch_job_id(model),
        "Type": "sysbatch",
    }
    if namespace:
        job["Namespace"] = namespace
    job["Datacenters"] = model_job["Datacenters"]
    if "NodePool" in model_job:
        job["NodePool"] = model_job["NodePool"]
    job["Meta"] = {"llmgw_prefetch": model.name, "llmgw_def_hash": model.def_hash}
    job["TaskGroups"] = [
        {
            "Name": "fetch",
            "Count": 1,
            "Constraints": constraints,
            "Volumes": group["Volumes"],
            "RestartPolicy": {
                "Attempts": 1,
                "Interval": 30 * 60 * 10**9,
                "Delay": 15 * 10**9,
                "Mode": "fail",
            },
            "Tasks": [fetch],
        }
    ]
    return job
