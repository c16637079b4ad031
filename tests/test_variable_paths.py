"""Nomad Variable paths for models: Nomad accepts only `^[a-zA-Z0-9-_~/]{1,128}$`
(hashicorp/nomad nomad/structs/variables.go, `validVariablePath`), so `nomad/jobs/llmgw-qwen2.5-7b`
is refused, and every model name with a dot needs a mapping. The docs use the one llmgw defines."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from nomad_driver.spec import parse_models
from nomad_driver.variables import (
    POLICY_NAME_RE,
    VARIABLE_PATH_RE,
    source_policy_name,
    source_variable_path,
)

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([*(ROOT / "docs").rglob("*.md"), ROOT / "README.md", ROOT / "terraform" / "README.md"])
# `nomad var put|get PATH` and `nomadVar "PATH"` as the docs write them.
PATHS_IN_DOCS = re.compile(r"nomad var (?:put|get)(?: -[\w=-]+)* ([^\s`|)]+)|nomadVar \"([^\"]+)\"")


def test_the_rule_is_nomads() -> None:
    assert VARIABLE_PATH_RE.fullmatch("nomad/jobs/llmgw-watcher")
    assert not VARIABLE_PATH_RE.fullmatch("nomad/jobs/llmgw-qwen2.5-7b")
    assert not VARIABLE_PATH_RE.fullmatch("x" * 129)


@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_variable_path_in_the_docs_is_one_nomad_accepts(page: Path) -> None:
    for match in PATHS_IN_DOCS.finditer(page.read_text(encoding="utf-8")):
        path = match.group(1) or match.group(2)
        if path.startswith(("<", "-", "$")):
            continue
        path = path.replace("<job>", "x").replace("<model>", "x")
        assert VARIABLE_PATH_RE.fullmatch(path), f"{page.name}: Nomad refuses the Variable path {path!r}"


def test_every_model_name_maps_to_a_distinct_valid_path_and_policy_name() -> None:
    names = ["qwen2.5-7b", "llama-3.3-70b", "qwen2_5-7b", "qwen2-5-7b", "A.b_c-d", "m" * 64]
    for file in ("examples/models.yaml", "examples/demo-models.yaml"):
        names += list(parse_models((ROOT / file).read_text()).models)
    paths = [source_variable_path(n) for n in names]
    assert all(VARIABLE_PATH_RE.fullmatch(p) for p in paths), paths
    assert len(set(paths)) == len(set(names)), "two models share a Variable"
    assert source_variable_path("qwen2.5-7b") == "llmgw/sources/qwen2~5-7b"
    assert all(POLICY_NAME_RE.fullmatch(source_policy_name(n)) for n in names)
