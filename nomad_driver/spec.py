"""Model definitions: the YAML file an operator writes, validated into `ModelSet`.

Every problem is reported with the path of the field it is about and what was expected, and all
of them at once: an operator fixing a file of forty models should not have to run the validator
forty times. `parse_models` either returns a complete, consistent set or raises `SpecError`.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError

from nomad_driver import engines
from nomad_driver.durations import parse_duration
from nomad_driver.redaction import SECRETS_HINT, redact, source_credentials
from nomad_driver.spec_yaml import SpecError, describe, load_yaml, pydantic_problems

DEFAULT_IDLE_TIMEOUT_S = 15 * 60.0
DEFAULT_ACTIVATION_TIMEOUT_S = 5 * 60.0

# A model name becomes the Nomad job ID `llmgw-<name>`, the Consul tag `model=<name>`, a Consul KV
# key segment and a URL path segment of the admin API. This alphabet is safe in all four, so the
# name is never rewritten and the name a client asks for is the name everywhere else.
# Matched whole (fullmatch): `$` would also match before a trailing newline, and a name with
# one renders broken HCL.
MODEL_NAME_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,62}[A-Za-z0-9])?")
MODEL_NAME_RULE = (
    "1-64 characters from letters, digits, '.', '_' and '-', starting and ending with a letter or digit"
)
# Nomad's own rule for node pool names (`structs.validNodePoolName`).
NODE_POOL_RE = re.compile(r"[a-zA-Z0-9-_]{1,128}")
# llmgw's own Nomad jobs (jobs/*.nomad.hcl) are `llmgw-<name>` too; a model with one of these
# names would replace the router, the watcher or the node agents. Nomad compares job IDs without
# regard to case, so neither may differ only in case.
RESERVED_MODEL_NAMES = ("router", "watcher", "node-agent")
# Versions end up in a path on the node, a Docker image tag and a comma-separated node meta list.
ENGINE_VERSION_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
SOURCE_SCHEMES = ("hf", "https", "s3", "file")

# Bounds on numbers, so that what validates also registers: Nomad reads these as Go int64
# (anything larger fails to decode), and far below that they stop meaning anything. A year is
# longer than any idle or activation timeout an operator means (durations.py).
MAX_REPLICAS = 10_000
MAX_TARGET_IN_FLIGHT = 100_000
DEFAULT_SCALE_DOWN_DELAY_S = 5 * 60.0
MAX_MEMORY_MIB = 64 * 1024 * 1024  # 64 TiB of host memory
MAX_GPU_MEMORY_MIB = 16 * 1024 * 1024  # 16 TiB per GPU
MAX_CPU_MHZ = 10_000_000
MAX_CONTEXT = 100_000_000


class Profile(BaseModel):
    """How a model runs: the engine, and what it needs from a node."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    # One of the registered engines (nomad_driver/engines/), checked by `_registered_engine`.
    engine: str
    engine_version: str
    gpus: int = Field(default=1, ge=0, le=64)
    # Per GPU, in MiB, as Nomad's nvidia device plugin reports `memory`; 0 asks for any size.
    gpu_memory_mib: int = Field(default=0, ge=0, le=MAX_GPU_MEMORY_MIB)
    gpu_models: list[str] = Field(default_factory=list)
    cpu_mhz: int = Field(default=1000, ge=1, le=MAX_CPU_MHZ)
    # Nomad refuses a task with less than 10 MB of memory.
    memory_mib: int = Field(default=4096, ge=10, le=MAX_MEMORY_MIB)
    context: int = Field(default=4096, ge=1, le=MAX_CONTEXT)
    args: list[str] = Field(default_factory=list)
    # The chat template, for an engine that would guess it from the weights and can guess
    # wrong (`takes_chat_format`).
    chat_format: str | None = None
    # Where its jobs may run: a Nomad node pool (the GPU nodes' own pool, `gpu` in the operating
    # guide) and datacenters. Unset, Nomad's defaults apply: the namespace's default pool (else
    # `default`) and every datacenter. Part of the definition: a model moved to another pool
    # must be registered again, because Nomad places a job only where its job says.
    node_pool: str | None = None
    datacenters: list[str] | None = None
    # Shards per replica, one per whole node: a model too big for one node runs as `nodes`
    # processes on `nodes` distinct nodes of one fabric. `gpus` is then per node.
    nodes: int = Field(default=1, ge=1, le=64)
    # How a new definition replaces a serving one (watcher/rollout.py): `surge` starts it beside
    # the serving replicas and stops them once it is ready, waiting for room for both; `rolling`
    # does the same where there is room and, where there is not, stops one old replica at a time
    # as each new one turns ready; `replace` registers it over them, all at once.
    update: Literal["surge", "rolling", "replace"] = "surge"

    @field_validator("engine", mode="before")
    @classmethod
    def _registered_engine(cls, value: Any) -> Any:
        # Worded as the one-of-these-names problem any other choice in the file gets.
        if isinstance(value, str) and value in engines.ENGINES:
            return value
        known = [repr(name) for name in engines.names()]
        expected = known[0] if len(known) == 1 else f"{', '.join(known[:-1])} or {known[-1]}"
        raise PydanticCustomError("literal_error", "Input should be {expected}", {"expected": expected})

    @field_validator("args", mode="before")
    @classmethod
    def _numbers_as_strings(cls, value: Any) -> Any:
        # `- 8` in YAML is an int; an engine argument is text either way.
        if isinstance(value, list):
            return [str(v) if isinstance(v, int | float) and not isinstance(v, bool) else v for v in value]
        return value


class _Replicas(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    min: int = Field(default=1, le=MAX_REPLICAS)
    max: int | None = Field(default=None, le=MAX_REPLICAS)
    # Requests in flight one replica should carry before another is asked for; unset, the
    # engine's own slots (its `target_in_flight`).
    target_in_flight: int | None = Field(default=None, le=MAX_TARGET_IN_FLIGHT)
    # How long a lower load must hold before replicas are stopped; checked by parse_duration.
    scale_down_delay: Any = None


class _ModelDoc(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    source: str
    profile: str
    replicas: _Replicas = Field(default_factory=_Replicas)
    # Checked by parse_duration, which says what a duration looks like.
    idle_timeout: Any = None
    activation_timeout: Any = None


@dataclass(frozen=True)
class Model:
    name: str
    source: str
    profile_name: str
    profile: Profile
    replicas_min: int
    replicas_max: int
    idle_timeout_s: float
    activation_timeout_s: float
    def_hash: str
    job_id: str
    # Load scaling (`watcher/scaling.py`): requests in flight per replica, and how long a lower
    # load must last before the count follows it down.
    target_in_flight: int = 4
    scale_down_delay_s: float = 300.0


@dataclass(frozen=True)
class ModelSet:
    profiles: dict[str, Profile]
    models: dict[str, Model]


def job_id_for(model_name: str) -> str:
    return f"llmgw-{model_name}"


PLACEMENT_KEYS = ("node_pool", "datacenters")


def definition_hash(source: str, profile: Profile) -> str:
    """A change of this hash is "the definition changed": it unparks a parked model. Replicas
    and timeouts are left out on purpose, because scaling a broken model must not unpark it."""
    dumped = profile.model_dump(mode="json")
    # Placement counts only when set, so that definitions written before it existed keep their
    # hash: an upgrade of llmgw must not re-register (and unpark) every model.
    for key in PLACEMENT_KEYS:
        if dumped.get(key) is None:
            dumped.pop(key, None)
    # Likewise one node, the default, is left out so that single-node models keep their hash.
    if dumped.get("nodes") == 1:
        dumped.pop("nodes", None)
    # How a definition is rolled out is not part of it: changing it restarts nothing.
    dumped.pop("update", None)
    doc = {"source": source, "profile": dumped}
    blob = json.dumps(doc, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


# --- sources (what a credential in one looks like: redaction.py) ------------------------------


def source_problem(source: str, engine: str) -> str | None:
    """Why `source` cannot be fetched for `engine`, or None when it can."""
    secret = source_credentials(source)
    if secret:
        return f"source {redact(source)!r} carries a credential ({secret}); {SECRETS_HINT}"
    parts = urlsplit(source)
    scheme = parts.scheme
    if scheme not in SOURCE_SCHEMES:
        return (
            f"unsupported source {source!r}: expected hf://ORG/REPO/FILE, https://..., "
            "s3://BUCKET/KEY or file:///ABSOLUTE/PATH"
        )
    if any(c.isspace() for c in source):
        return f"source {source!r} contains whitespace"
    if scheme == "hf":
        segments = [s for s in (parts.netloc + parts.path).split("/") if s]
        if len(segments) < 2:
            return f"hf source {source!r} must name ORG/REPO and, for a GGUF engine, a file in it"
        if len(segments) == 2 and not engines.get(engine).loads_repositories:
            return (
                f"hf source {source!r} names a repository; {engine} loads one file: "
                "use hf://ORG/REPO/FILE.gguf"
            )
    elif scheme == "https":
        if not parts.netloc or not parts.path.strip("/"):
            return f"https source {source!r} must name a host and a path"
    elif scheme == "s3":
        if not parts.netloc or not parts.path.strip("/"):
            return f"s3 source {source!r} must name a bucket and a key: s3://BUCKET/KEY"
    elif scheme == "file" and (parts.netloc or not parts.path.startswith("/")):
        return f"file source {source!r} must be an absolute path: file:///ABSOLUTE/PATH"
    elif scheme == "file" and source.endswith("/") and not engines.get(engine).reads_node_files:
        return (
            f"source {source!r} is a directory on the node; {engine} runs in docker, which sees "
            "only what is mounted, and llmgw's fetch copies one file: serve it from "
            "s3://BUCKET/PREFIX/ or hf://ORG/REPO"
        )
    if not engines.get(engine).loads_repositories and source.endswith("/"):
        return f"source {source!r} is a directory; {engine} loads one GGUF file"
    return None


# --- the file ---------------------------------------------------------------------------------

_TOP_KEYS = ("profiles", "models")


def parse_models(text: str, origin: str = "<string>") -> ModelSet:
    """Validate a models file. `origin` names the file in the one problem that has no path."""
    problems: list[str] = []
    try:
        doc = load_yaml(text, problems)
    except SpecError as exc:
        raise SpecError([p.replace("(file)", origin, 1) for p in exc.problems]) from None
    if doc is None:
        raise SpecError([f"{origin}: the file is empty; expected 'profiles' and 'models'"])
    if not isinstance(doc, dict):
        raise SpecError([f"{origin}: expected a mapping with 'profiles' and 'models'"])

    for key in doc:
        if key not in _TOP_KEYS:
            problems.append(f"{key}: unknown key '{key}' (expected one of: {', '.join(_TOP_KEYS)})")

    profiles = _parse_profiles(doc.get("profiles"), problems)
    raw_profiles = doc.get("profiles")
    declared = [str(k) for k in raw_profiles] if isinstance(raw_profiles, dict) else []
    models = _parse_models(doc.get("models"), profiles, declared, problems)
    if problems:
        raise SpecError(problems)
    return ModelSet(profiles=profiles, models=models)


def read_models_text(path: str | Path) -> str:
    """The text of a models file, or SpecError saying why it cannot be read (missing, a
    directory, not UTF-8), for every verb that takes one."""
    path = Path(path)
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SpecError([f"{path}: cannot read: {exc.strerror or exc}"]) from None
    except UnicodeDecodeError as exc:
        raise _not_utf8(str(path), exc) from None


def decode_models_text(raw: bytes, origin: str) -> str:
    """A models file kept as bytes (`llmgw/config/models`) as text, or SpecError naming
    `origin`. Strict, for every reader alike: with bad bytes replaced, a watcher would act on
    definitions the routers refuse."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise _not_utf8(origin, exc) from None


def _not_utf8(origin: str, exc: UnicodeDecodeError) -> SpecError:
    return SpecError([f"{origin}: not UTF-8 text (invalid byte at offset {exc.start})"])


def problem_line(path: str | Path, problem: str) -> str:
    """`PATH: problem`, for a CLI; problems about the whole file already start with the path."""
    return problem if problem.startswith(f"{path}:") else f"{path}: {problem}"


def load_models(path: str | Path) -> ModelSet:
    return parse_models(read_models_text(path), origin=str(path))


def _parse_profiles(raw: Any, problems: list[str]) -> dict[str, Profile]:
    if raw is None:
        problems.append("profiles: required; define at least one profile")
        return {}
    if not isinstance(raw, dict):
        problems.append(f"profiles: expected a mapping of profile name to profile, got {describe(raw)}")
        return {}
    profiles: dict[str, Profile] = {}
    for name, body in raw.items():
        path = f"profiles.{name}"
        if not isinstance(body, dict):
            problems.append(f"{path}: expected a mapping, got {describe(body)}")
            continue
        try:
            profile = Profile.model_validate(body)
        except ValidationError as exc:
            problems.extend(pydantic_problems(path, exc, Profile))
            continue
        before = len(problems)
        if not ENGINE_VERSION_RE.fullmatch(profile.engine_version):
            problems.append(
                f"{path}.engine_version: {profile.engine_version!r} is not a version: "
                "letters, digits, '.', '_' and '-' only"
            )
        engine = engines.get(profile.engine)
        problems.extend(engine.profile_problems(path, profile))
        for i, gpu_model in enumerate(profile.gpu_models):
            # The constraint is set_contains_any over a comma-separated list.
            if not gpu_model.strip() or "," in gpu_model:
                problems.append(f"{path}.gpu_models.{i}: expected a GPU model name without commas")
        if profile.gpus == 0 and (profile.gpu_models or profile.gpu_memory_mib):
            problems.append(f"{path}: gpu_memory_mib and gpu_models need gpus >= 1")
        if profile.chat_format is not None and not engine.takes_chat_format:
            takers = " or ".join(engines.taking_chat_format())
            problems.append(f"{path}.chat_format: only {takers} takes a chat_format")
        if profile.node_pool is not None and not NODE_POOL_RE.fullmatch(profile.node_pool):
            problems.append(
                f"{path}.node_pool: {profile.node_pool!r} is not a Nomad node pool name: "
                "1-128 letters, digits, '-' and '_'"
            )
        if profile.datacenters is not None:
            if not profile.datacenters:
                problems.append(f"{path}.datacenters: list at least one datacenter, or leave it out for all")
            for i, dc in enumerate(profile.datacenters):
                if not dc.strip() or any(c.isspace() for c in dc):
                    problems.append(f"{path}.datacenters.{i}: expected a datacenter name without spaces")
        problems.extend(_nodes_problems(path, profile))
        if len(problems) == before:
            profiles[str(name)] = profile
    return profiles


def _nodes_problems(path: str, profile: Profile) -> list[str]:
    """What stops a multi-node profile from working, before any job is rendered."""
    if profile.nodes == 1:
        return []
    if not engines.get(profile.engine).shards_over:
        return [
            f"{path}.nodes: {profile.engine} cannot split a model across nodes; "
            f"use engine {' or '.join(engines.sharding())} for nodes: {profile.nodes}, or nodes: 1"
        ]
    return []


def _parse_models(
    raw: Any, profiles: dict[str, Profile], declared: list[str], problems: list[str]
) -> dict[str, Model]:
    """`declared` are all profile names in the file: a model whose profile exists but is invalid
    is not also told that its profile is unknown."""
    if raw is None:
        problems.append("models: required; define at least one model")
        return {}
    if not isinstance(raw, dict):
        problems.append(f"models: expected a mapping of model name to model, got {describe(raw)}")
        return {}
    models: dict[str, Model] = {}
    for key, body in raw.items():
        name = str(key)
        path = f"models.{name}"
        before = len(problems)
        if not isinstance(key, str) or not MODEL_NAME_RE.fullmatch(name):
            problems.append(f"{path}: invalid model name {name!r}: {MODEL_NAME_RULE}")
        elif name.lower() in RESERVED_MODEL_NAMES:
            problems.append(
                f"{path}: model name {name!r} is taken: its Nomad job would be {job_id_for(name)}, "
                f"llmgw's own {name.lower()} job; choose another name"
            )
        if not isinstance(body, dict):
            problems.append(f"{path}: expected a mapping, got {describe(body)}")
            continue
        try:
            doc = _ModelDoc.model_validate(body)
        except ValidationError as exc:
            problems.extend(pydantic_problems(path, exc, _ModelDoc))
            continue

        profile = profiles.get(doc.profile)
        if profile is None and doc.profile not in declared:
            problems.append(f"{path}.profile: unknown profile {doc.profile!r}" + _known(declared))
        elif profile is not None:
            why = source_problem(doc.source, profile.engine)
            if why:
                problems.append(f"{path}.source: {why}")

        rmin = doc.replicas.min
        rmax = doc.replicas.max if doc.replicas.max is not None else max(rmin, 1)
        if rmin < 0:
            problems.append(f"{path}.replicas.min: must be >= 0, got {rmin}")
        if rmax < 1:
            problems.append(f"{path}.replicas.max: must be >= 1, got {rmax}")
        elif rmin > rmax:
            problems.append(f"{path}.replicas: min {rmin} is greater than max {rmax}")
        elif profile is not None and profile.nodes > 1 and rmax > 1:
            problems.append(
                f"{path}.replicas.max: a multi-node model (profile {doc.profile!r}, nodes: "
                f"{profile.nodes}) runs at most 1 replica, got {rmax}"
            )

        target = doc.replicas.target_in_flight
        if target is not None and target < 1:
            problems.append(
                f"{path}.replicas.target_in_flight: must be >= 1 (requests in flight per replica), got {target}"
            )
        delay = _duration(
            doc.replicas.scale_down_delay,
            DEFAULT_SCALE_DOWN_DELAY_S,
            f"{path}.replicas.scale_down_delay",
            problems,
        )
        idle = _duration(doc.idle_timeout, DEFAULT_IDLE_TIMEOUT_S, f"{path}.idle_timeout", problems)
        activation = _duration(
            doc.activation_timeout, DEFAULT_ACTIVATION_TIMEOUT_S, f"{path}.activation_timeout", problems
        )
        if len(problems) != before or profile is None:
            continue
        models[name] = Model(
            name=name,
            source=doc.source,
            profile_name=doc.profile,
            profile=profile,
            replicas_min=rmin,
            replicas_max=rmax,
            idle_timeout_s=idle,
            activation_timeout_s=activation,
            def_hash=definition_hash(doc.source, profile),
            job_id=job_id_for(name),
            target_in_flight=target
            if target is not None
            else engines.get(profile.engine).target_in_flight(profile),
            scale_down_delay_s=delay,
        )
    return models


def _known(declared: list[str]) -> str:
    return f" (defined: {', '.join(declared)})" if declared else ""


def _duration(raw: object, default: float, path: str, problems: list[str]) -> float:
    if raw is None:
        return default
    try:
        return parse_duration(raw)
    except ValueError:
        shown = (
            raw if not isinstance(raw, int) or abs(raw) < 10**18 else f"a {len(str(abs(raw)))}-digit number"
        )
        problems.append(
            f"{path}: expected a positive duration up to a year, like 90, '30s', '15m' or '1h', got {shown!r}"
        )
        return default
