"""Where the definitions live in Consul KV, and how every reader turns those keys into models.

One key per model, so a fleet of any size fits Consul's 512 KiB cap on a value
(`kv_max_value_size`), and a change to one model rewrites one key:

- `llmgw/config/model/<name>`: the model's definition, the mapping it has in the models file
  (written as JSON; YAML is read too, for a hand edit);
- `llmgw/config/profiles`: what the models share, the file without `models` (`profiles:`);
- `llmgw/config/applied`: written first and last by `llmgw apply` (`config_store.py`): while
  its `pending` is set an apply is writing, and readers keep the set they had, so none acts on
  half of one file and half of another.

`llmgw/config/models`, the whole file in one key, is the layout before this one (and what
Terraform writes). While it exists it is the definitions, whatever the per-model keys say; apply
deletes it in the transaction that commits the per-model keys, which is the whole upgrade.

Every reader (watcher, router, `llmgw plan`) reads all of `llmgw/config/` with one blocking query
and gives the entries to a `StoredDefinitions`, which reparses only the keys that changed and
keeps a model's last good definition when its key turns bad: one bad key harms its model only.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import yaml

from nomad_driver.consul import KVEntry, encode_json
from nomad_driver.safeload import LoadError, json_loads
from nomad_driver.spec import (
    Model,
    Profile,
    SpecError,
    _parse_models,
    _parse_profiles,
    decode_models_text,
    parse_models,
)
from nomad_driver.spec_yaml import load_yaml

log = logging.getLogger("llmgw.definitions")

CONFIG_PREFIX = "llmgw/config/"
LEGACY_MODELS_KEY = "llmgw/config/models"
MODEL_KEY_PREFIX = "llmgw/config/model/"
PROFILES_KEY = "llmgw/config/profiles"
APPLIED_KEY = "llmgw/config/applied"


def model_key(name: str) -> str:
    return f"{MODEL_KEY_PREFIX}{name}"


def definition_keys(text: str, origin: str = "<string>", *, checked: bool = False) -> dict[str, bytes]:
    """A valid models file as the keys `llmgw apply` writes (SpecError when it is not valid).
    `checked`: `parse_models` already passed it, so it is bounded and valid and is read again
    with libyaml, not the bounded pure-Python reader (5 s for ten thousand models)."""
    if not checked:
        parse_models(text, origin)  # the whole file is checked once, as one
    doc = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    shared = {k: v for k, v in doc.items() if k != "models"}
    keys = {PROFILES_KEY: _encode(shared)}
    for name, body in doc["models"].items():
        keys[model_key(str(name))] = _encode(body)
    return keys


def _encode(value: Any) -> bytes:
    # JSON reads back far faster than YAML (ten thousand keys at a watcher's start); `str` for
    # what YAML has and JSON lacks (a date), which validation refused already anyway.
    return json.dumps(value, separators=(",", ":"), default=str).encode()


@dataclass(frozen=True)
class Applied:
    """`llmgw/config/applied`: the generation last committed, and an apply under way."""

    generation: int = 0
    models: int = 0
    pending: Mapping[str, Any] | None = None

    def to_bytes(self) -> bytes:
        return encode_json({"generation": self.generation, "models": self.models, "pending": self.pending})


def parse_applied(raw: bytes) -> Applied:
    """Any value reads: a mangled one as generation 0 with nothing pending."""
    try:
        doc = json_loads(raw, APPLIED_KEY)
    except (LoadError, ValueError):
        return Applied()
    if not isinstance(doc, dict):
        return Applied()
    generation = doc.get("generation")
    models = doc.get("models")
    pending = doc.get("pending")
    return Applied(
        generation if isinstance(generation, int) else 0,
        models if isinstance(models, int) else 0,
        pending if isinstance(pending, dict) else None,
    )


def _load(raw: bytes, origin: str) -> Any:
    """A key's value: JSON as apply writes it, else YAML (a hand edit)."""
    text = decode_models_text(raw, origin)
    try:
        return json_loads(text, origin)
    except (LoadError, ValueError):
        pass
    problems: list[str] = []
    value = load_yaml(text, problems)
    if problems:
        raise SpecError(problems)
    return value


def parse_profiles_value(raw: bytes) -> tuple[dict[str, Profile], list[str]]:
    """The shared part; raises SpecError naming the key when it cannot be used at all."""
    try:
        doc = _load(raw, PROFILES_KEY)
    except SpecError as exc:
        raise SpecError([_at(PROFILES_KEY, p) for p in exc.problems]) from None
    if not isinstance(doc, dict):
        raise SpecError([f"{PROFILES_KEY}: expected a mapping with 'profiles'"])
    problems = [
        f"{PROFILES_KEY}: {k}: unknown key '{k}' (expected: profiles)" for k in doc if k != "profiles"
    ]
    raw_profiles = doc.get("profiles")
    profiles = _parse_profiles(raw_profiles, problems)
    declared = [str(k) for k in raw_profiles] if isinstance(raw_profiles, dict) else []
    if problems or not profiles:
        raise SpecError([_at(PROFILES_KEY, p) for p in problems] or [f"{PROFILES_KEY}: no profiles"])
    return profiles, declared


def parse_model_value(name: str, raw: bytes, profiles: dict[str, Profile], declared: list[str]) -> Model:
    """One model's key; raises SpecError whose problems start with the key's name."""
    key = model_key(name)
    try:
        body = _load(raw, key)
    except SpecError as exc:
        raise SpecError([_at(key, p) for p in exc.problems]) from None
    problems: list[str] = []
    models = _parse_models({name: body}, profiles, declared, problems)
    if problems or name not in models:
        raise SpecError([_at(key, p) for p in problems] or [f"{key}: not a model definition"])
    return models[name]


def _at(key: str, problem: str) -> str:
    return problem if problem.startswith(f"{key}:") else f"{key}: {problem}"


@dataclass
class StoredDefinitions:
    """The definitions as one reader last read them from `llmgw/config/`.

    `read` takes the entries of a read of that prefix (or of all of `llmgw/`), and says whether
    the models changed. A bad model key keeps that model's last good definition; a bad profiles
    key or legacy file keeps them all; an apply under way keeps them all until it commits.
    """

    models: dict[str, Model] = field(default_factory=dict)
    # What was wrong in the last reading, each naming its key; empty when all was good.
    problems: list[str] = field(default_factory=list)
    layout: str = ""  # "model keys", "legacy key", or "" before anything was read
    generation: int = 0
    pending: bool = False  # an apply is writing (or was interrupted): the set is held
    missing: bool = False  # nothing stored, while this reader still holds definitions
    # The values the models were read from, by key: what a watcher writes back if Consul
    # comes back empty.
    raw: dict[str, bytes] = field(default_factory=dict)
    _seen: dict[str, int] = field(default_factory=dict)  # key -> ModifyIndex last read
    _parsed: dict[str, Model | SpecError] = field(default_factory=dict)

    @property
    def problem(self) -> str:
        return "; ".join(self.problems)

    def read(self, entries: Mapping[str, KVEntry]) -> bool:
        legacy = entries.get(LEGACY_MODELS_KEY)
        if legacy is not None:
            return self._read_legacy(legacy)
        mine = {k: e for k, e in entries.items() if k.startswith(MODEL_KEY_PREFIX)}
        profiles = entries.get(PROFILES_KEY)
        applied_entry = entries.get(APPLIED_KEY)
        if profiles is None and not mine and applied_entry is None:
            return self._read_nothing()
        applied = parse_applied(applied_entry.value) if applied_entry else Applied()
        self.missing = False
        if applied.pending is not None and self.models:
            # Half of a new file and half of the old one is a set nobody applied.
            if not self.pending:
                log.info("event=definitions_held reason=apply_pending pending=%r", dict(applied.pending))
            self.pending = True
            return False
        self.pending = applied.pending is not None
        self.generation = applied.generation
        seen = {k: e.modify_index for k, e in mine.items()}
        seen[PROFILES_KEY] = profiles.modify_index if profiles else 0
        if seen == self._seen and self.layout == "model keys":
            return False
        return self._read_model_keys(profiles, mine, seen)

    def _read_nothing(self) -> bool:
        if self.models:
            if not self.missing:
                log.warning("event=definitions_missing prefix=%s keeping=%d", CONFIG_PREFIX, len(self.models))
            self.missing = True
            return False
        # Nothing stored and nothing held: as before anything was read (a router then falls back
        # to its models file).
        self.missing, self.layout, self.problems = False, "", []
        return False

    def _read_legacy(self, entry: KVEntry) -> bool:
        self.missing = self.pending = False
        if self.layout == "legacy key" and self._seen == {LEGACY_MODELS_KEY: entry.modify_index}:
            return False
        self._seen = {LEGACY_MODELS_KEY: entry.modify_index}
        self._parsed = {}
        origin = f"consul:{LEGACY_MODELS_KEY}"
        try:
            parsed = parse_models(decode_models_text(entry.value, origin), origin)
        except SpecError as exc:
            # Keep serving the last good definitions: a typo must not stop every model.
            self.problems = [_at(origin, p) for p in exc.problems]
            log.error("event=definitions_invalid key=%s problems=%r", LEGACY_MODELS_KEY, exc.problems)
            return False
        self.layout, self.problems = "legacy key", []
        self.raw = {LEGACY_MODELS_KEY: entry.value}
        return self._set(dict(parsed.models))

    def _read_model_keys(
        self, profiles_entry: KVEntry | None, mine: Mapping[str, KVEntry], seen: dict[str, int]
    ) -> bool:
        problems: list[str] = []
        if profiles_entry is None:
            problems.append(f"{PROFILES_KEY}: missing; the model keys cannot be read without it")
            profiles: dict[str, Profile] = {}
            declared: list[str] = []
        else:
            try:
                profiles, declared = parse_profiles_value(profiles_entry.value)
            except SpecError as exc:
                problems.extend(exc.problems)
        if problems:
            # Every model depends on the profiles: keep the whole last good set.
            self.problems = problems
            self._seen = seen
            log.error("event=definitions_invalid key=%s problems=%r", PROFILES_KEY, problems)
            return False
        profiles_changed = self._seen.get(PROFILES_KEY) != seen[PROFILES_KEY] or self.layout != "model keys"
        parsed: dict[str, Model | SpecError] = {}
        models: dict[str, Model] = {}
        for key, entry in mine.items():
            name = key[len(MODEL_KEY_PREFIX) :]
            before = self._parsed.get(key)
            if not profiles_changed and before is not None and self._seen.get(key) == entry.modify_index:
                result = before
            else:
                try:
                    result = parse_model_value(name, entry.value, profiles, declared)
                except SpecError as exc:
                    result = exc
            parsed[key] = result
            if isinstance(result, Model):
                models[name] = result
                continue
            problems.extend(result.problems)
            # One bad key harms its own model only, which keeps its last good definition.
            last = self.models.get(name)
            if last is not None:
                models[name] = last
        if problems and problems != self.problems:
            log.error("event=definitions_invalid prefix=%s problems=%r", MODEL_KEY_PREFIX, problems)
        self.problems = problems
        raw = {PROFILES_KEY: profiles_entry.value} if profiles_entry is not None else {}
        for key, entry in mine.items():
            if isinstance(parsed[key], Model):
                raw[key] = entry.value
            elif key in self.raw:
                raw[key] = self.raw[key]  # the last good value of a model kept at it
        self._parsed, self._seen, self.layout, self.raw = parsed, seen, "model keys", raw
        return self._set(models)

    def _set(self, models: dict[str, Model]) -> bool:
        changed = models != self.models
        self.models = models
        if changed:
            log.info("event=definitions_loaded models=%d layout=%r", len(models), self.layout)
        return changed


def config_entries(entries: Mapping[str, KVEntry] | list[KVEntry]) -> dict[str, KVEntry]:
    """The entries under `llmgw/config/`, by key, from a read of it or of all of `llmgw/`."""
    items = entries.values() if isinstance(entries, Mapping) else entries
    return {e.key: e for e in items if e.key.startswith(CONFIG_PREFIX)}
