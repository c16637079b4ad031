"""`llmgw render`, run as an operator runs it: a real process, its output and its exit code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import hcl2

from nomad_driver.render import render_job
from nomad_driver.render_files import render_hcl
from nomad_driver.spec import load_models

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "models.yaml"


def llmgw(*args: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != "NOMAD_NAMESPACE"}
    return subprocess.run(
        [sys.executable, "-m", "nomad_driver.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env={**environ, **(env or {})},
    )


BAD = """\
profiles:
  p: {engine: llama.cpp, engine_version: b6500, gpus: 1}
models:
  kev-0.5b: {source: hf://o/r/kev.gguf, profile: gpu9}
  good: {source: hf://o/r/good.gguf, profile: p}
  over: {source: hf://o/r/o.gguf, profile: p, replicas: {min: 2, max: 1}}
"""


def test_render_writes_one_hcl_job_per_model_and_says_so(tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = llmgw("render", EXAMPLE, "-o", out)
    assert result.returncode == 0, result.stderr
    names = sorted(p.name for p in out.iterdir())
    assert names == [
        "llmgw-gemma-3-4b.nomad.hcl",
        "llmgw-llama-3.3-70b.nomad.hcl",
        "llmgw-qwen2.5-0.5b.nomad.hcl",
    ]
    for name in names:
        assert f"wrote {out / name}" in result.stdout
    models = load_models(EXAMPLE).models
    text = (out / "llmgw-llama-3.3-70b.nomad.hcl").read_text()
    assert text == render_hcl(models["llama-3.3-70b"])
    assert "job" in hcl2.loads(text)


def test_render_json_gives_the_api_job_with_four_gpus_for_the_70b(tmp_path: Path) -> None:
    result = llmgw("render", EXAMPLE, "-o", tmp_path, "--format", "json")
    assert result.returncode == 0, result.stderr
    body = json.loads((tmp_path / "llmgw-llama-3.3-70b.nomad.json").read_text())
    assert body == {"Job": render_job(load_models(EXAMPLE).models["llama-3.3-70b"])}
    (device,) = body["Job"]["TaskGroups"][0]["Tasks"][0]["Resources"]["Devices"]
    assert (device["Name"], device["Count"]) == ("nvidia/gpu", 4)
    assert {"LTarget": "${device.attr.memory}", "RTarget": "80000 MiB", "Operand": ">="} in device[
        "Constraints"
    ]


def test_render_places_jobs_where_the_models_file_says_and_in_nomad_namespace(tmp_path: Path) -> None:
    result = llmgw("render", EXAMPLE, "-o", tmp_path, "-f", "json", env={"NOMAD_NAMESPACE": "llm"})
    assert result.returncode == 0, result.stderr
    job = json.loads((tmp_path / "llmgw-llama-3.3-70b.nomad.json").read_text())["Job"]
    assert (job["Datacenters"], job["Namespace"], job["NodePool"]) == (["dc1"], "llm", "gpu")


def test_the_old_placement_flags_point_at_the_models_file(tmp_path: Path) -> None:
    # They rendered a pool that apply and the watcher never used; now the file says it for all.
    result = llmgw("render", EXAMPLE, "-o", tmp_path, "--node-pool", "gpu")
    assert result.returncode == 2
    assert "node_pool" in result.stderr and "models file" in result.stderr
    assert not list(tmp_path.iterdir())


def test_check_validates_and_writes_nothing(tmp_path: Path) -> None:
    result = llmgw("render", "--check", EXAMPLE)
    assert result.returncode == 0, result.stderr
    assert "valid, 3 models" in result.stdout
    assert not list(tmp_path.iterdir())


def test_a_bad_file_reports_every_problem_exits_2_and_writes_nothing(tmp_path: Path) -> None:
    models = tmp_path / "models.yaml"
    models.write_text(BAD)
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("untouched")
    result = llmgw("render", models, "-o", out)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines[0] == f"{models}: models.kev-0.5b.profile: unknown profile 'gpu9' (defined: p)"
    assert lines[1] == f"{models}: models.over.replicas: min 2 is greater than max 1"
    assert lines[2] == f"{models}: 2 problems; nothing written"
    assert [p.name for p in out.iterdir()] == ["keep.txt"]
    assert "Traceback" not in result.stderr

    check = llmgw("render", "--check", models)
    assert check.returncode == 2
    assert check.stderr == result.stderr


def test_duplicate_models_are_an_error_with_line_numbers(tmp_path: Path) -> None:
    models = tmp_path / "models.yaml"
    models.write_text(BAD.replace("  over:", "  good:"))
    result = llmgw("render", "--check", models)
    assert result.returncode == 2
    assert f"{models}: models.good: duplicate key 'good' at line 6 (first at line 5)" in result.stderr


def test_a_missing_file_or_output_directory_is_a_usage_error(tmp_path: Path) -> None:
    missing = llmgw("render", "--check", tmp_path / "nope.yaml")
    assert missing.returncode == 2
    assert f"{tmp_path / 'nope.yaml'}: cannot read" in missing.stderr
    no_out = llmgw("render", EXAMPLE)
    assert no_out.returncode == 2
    assert "-o DIR" in no_out.stderr
