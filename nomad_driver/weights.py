"""Where an engine's weights come from: an artifact Nomad fetches into the task directory, with
go-getter's address for each kind of source, or a name the engine resolves itself."""

from __future__ import annotations

import posixpath
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit

# Where the artifact puts the weights, relative to the allocation's task directory; inside the
# task that directory is ${NOMAD_TASK_DIR} (`local/`), for raw_exec and docker alike.
WEIGHTS_DEST = "local/model"
WEIGHTS_DIR = "${NOMAD_TASK_DIR}/model"


@dataclass(frozen=True)
class Weights:
    """How the engine gets its weights: an artifact Nomad downloads into the task directory, or,
    for a whole Hugging Face repository (which only an engine that `loads_repositories` is
    given), a name the engine resolves itself."""

    model_arg: str
    artifact: dict[str, Any] | None


def weights_for(source: str) -> Weights:
    parts = urlsplit(source)
    if parts.scheme == "file":
        # A client has no file getter (hashicorp/nomad client/allocrunner/taskrunner/getter/
        # params.go): fetch/render.py reads such a file in place or fetches it.
        raise ValueError(f"source {source!r}: a file on the node is never an artifact")
    is_dir = source.endswith("/")
    name = posixpath.basename(parts.path.rstrip("/")) or "model"
    if parts.scheme == "hf":
        segments = [s for s in (parts.netloc + parts.path).split("/") if s]
        if len(segments) == 2:
            # The engine downloads a whole repository itself; go-getter cannot list a Hub one.
            return Weights(model_arg="/".join(segments), artifact=None)
        org, repo, *path = segments
        revision = "main"
        if "@" in repo:
            repo, revision = repo.split("@", 1)
        getter = f"https://huggingface.co/{org}/{repo}/resolve/{revision}/{'/'.join(path)}"
    elif parts.scheme == "s3":
        query = dict(parse_qsl(parts.query))
        region = query.pop("region", "")
        # go-getter takes the region from a three-part path-style host (s3-REGION.amazonaws.com).
        host = f"s3-{region}.amazonaws.com" if region else "s3.amazonaws.com"
        getter = f"s3::https://{host}/{parts.netloc}{parts.path}"
        if query:
            getter += "?" + urlencode(query)
    else:
        getter = source
    artifact = {
        "GetterSource": getter,
        "GetterMode": "dir" if is_dir else "file",
        "RelativeDest": f"{WEIGHTS_DEST}/{name}",
    }
    return Weights(model_arg=f"{WEIGHTS_DIR}/{name}", artifact=artifact)
