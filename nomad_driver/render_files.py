"""The jobs `llmgw render` writes: each model's job as an HCL jobspec for `nomad job run`, or
as JSON with the `{"Job": ...}` wrapper; a multi-node model as one file per replica.
"""

from __future__ import annotations

import json

from nomad_driver.hcl import job_to_hcl
from nomad_driver.render import render_job, render_replica_job
from nomad_driver.spec import Model


def render_hcl(model: Model, *, namespace: str | None = None) -> str:
    """The same job as `render_job`, as an HCL jobspec for `nomad job run`."""
    job = render_job(model, namespace=namespace)
    header = (
        f"# Rendered by llmgw from model '{model.name}' (definition {model.def_hash}).\n"
        "# Edit the models file and render again rather than this file.\n"
    )
    return header + job_to_hcl(job)


def job_filename(model: Model, fmt: str) -> str:
    return f"{model.job_id}.nomad.{fmt}"


def render_files(models: list[Model], fmt: str, *, namespace: str | None = None) -> dict[str, str]:
    """File name -> content for each model. JSON files carry the `{"Job": ...}` wrapper, so the
    same file works with `nomad job run -json` and as the body of `PUT /v1/jobs`."""
    files: dict[str, str] = {}
    for model in models:
        if model.profile.nodes > 1:
            files.update(_replica_files(model, fmt, namespace))
            continue
        if fmt == "json":
            text = json.dumps({"Job": render_job(model, namespace=namespace)}, indent=2) + "\n"
        elif fmt == "hcl":
            text = render_hcl(model, namespace=namespace)
        else:
            raise ValueError(f"unknown format {fmt!r}: expected hcl or json")
        files[job_filename(model, fmt)] = text
    return files


def _replica_files(model: Model, fmt: str, namespace: str | None) -> dict[str, str]:
    files: dict[str, str] = {}
    for replica in range(model.replicas_max):
        job = render_replica_job(model, replica, namespace=namespace)
        name = f"{job['ID'].replace(':', '-r')}.nomad.{fmt}"
        if fmt == "json":
            files[name] = json.dumps({"Job": job}, indent=2) + "\n"
        elif fmt == "hcl":
            header = (
                f"# Rendered by llmgw from model '{model.name}' (definition {model.def_hash}), "
                f"replica {replica} of {model.replicas_max}, {model.profile.nodes} nodes each.\n"
                "# Edit the models file and render again rather than this file.\n"
            )
            files[name] = header + job_to_hcl(job)
        else:
            raise ValueError(f"unknown format {fmt!r}: expected hcl or json")
    return files
