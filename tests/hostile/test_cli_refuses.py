"""Issue 13, items 6 and 7: the CLI refuses bad files with exit 2, the path and the problem,
never a traceback; every number has a bound that Nomad accepts; names are matched whole; and an
activity time from the far future does not keep a model up for ever."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from nomad_driver.cli.app import app as cli_app
from nomad_driver.hcl import job_to_hcl
from nomad_driver.render import render_job
from nomad_driver.spec import SpecError, parse_models
from nomad_driver.state import parse_activity

pytestmark = pytest.mark.timeout(60)

PROFILE = """profiles:
  cpu:
    engine: llama-cpp-python
    engine_version: {version}
    gpus: 0
    memory_mib: {memory}
    context: {context}
models:
  {name}:
    source: file:///models/m.gguf
    profile: cpu
    replicas: {{min: 0, max: {rmax}}}
    idle_timeout: {idle}
"""


def models(
    *,
    name: str = "m",
    version: str = "b1",
    memory: object = 512,
    context: object = 256,
    rmax: object = 2,
    idle: object = "15m",
) -> str:
    return PROFILE.format(name=name, version=version, memory=memory, context=context, rmax=rmax, idle=idle)


def run(tmp_path: Path, verb: str, content: bytes) -> tuple[int, str]:
    path = tmp_path / "models.yaml"
    path.write_bytes(content)
    args = ["render", str(path), "--check"] if verb == "render" else ["apply", str(path)]
    result = CliRunner().invoke(cli_app, args)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.output


BAD_FILES = {
    # Numbers past 19 digits are refused while reading, with the line they are on.
    "400-digit duration": (models(idle="1" * 400).encode(), "is too large at line 13"),
    "400-digit duration string": (models(idle='"' + "1" * 400 + 's"').encode(), "idle_timeout"),
    "recursive anchor": (
        b"profiles: &p\n  x: *p\nmodels: {}\n",
        "an alias refers to a value that contains it",
    ),
    "not UTF-8": (models().encode() + b"\xff\xfe # \xc3\x28\n", "not UTF-8 text"),
    "nan duration": (models(idle=".nan").encode(), "not a finite number"),
    "inf duration": (models(idle=".inf").encode(), "not a finite number"),
    "replicas 10^30": (models(rmax=10**30).encode(), "is too large at line 12"),
    "replicas 10^6": (
        models(rmax=10**6).encode(),
        "replicas.max: input should be less than or equal to 10000",
    ),
    "memory 10^20": (models(memory=10**20).encode(), "is too large at line 6"),
    "memory 10^15": (models(memory=10**15).encode(), "memory_mib: input should be less than or equal to"),
    "context 10^12": (models(context=10**12).encode(), "context"),
    "a year and a day": (models(idle="8785h").encode(), "up to a year"),
}


@pytest.mark.parametrize("verb", ["render", "apply"])
@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_a_bad_file_is_exit_2_with_the_path_and_the_problem(tmp_path: Path, verb: str, case: str) -> None:
    content, problem = BAD_FILES[case]
    code, output = run(tmp_path, verb, content)
    assert code == 2, output
    assert str(tmp_path / "models.yaml") in output
    assert problem in output
    assert "Traceback" not in output


def with_placement(line: str) -> str:
    return models().replace("    gpus: 0\n", f"    gpus: 0\n    {line}\n")


@pytest.mark.parametrize(
    ("field", "text"),
    [
        ("name", models(name='"m\\n"')),
        ("engine_version", models(version='"b1\\n"')),
        ("node_pool", with_placement('node_pool: "gpu\\n"')),
        ("datacenters", with_placement('datacenters: ["dc1\\n"]')),
    ],
)
def test_names_and_versions_are_matched_whole(field: str, text: str) -> None:
    with pytest.raises(SpecError) as err:
        parse_models(text)
    assert any(field in p or "invalid model name" in p for p in err.value.problems), err.value.problems
    # The same name without the newline is fine: it is the newline that is refused.
    parse_models(text.replace("\\n", ""))


def test_a_map_key_with_a_trailing_newline_is_not_an_hcl_identifier() -> None:
    job = render_job(parse_models(models()).models["m"])
    job["Meta"]["llmgw_model\n"] = "m"
    with pytest.raises(ValueError, match="is not an HCL identifier"):
        job_to_hcl(job)


def test_bounds_allow_what_an_operator_means() -> None:
    parsed = parse_models(models(memory=2 * 1024 * 1024, rmax=1000, idle="720h", context=1_000_000))
    assert parsed.models["m"].replicas_max == 1000


def test_an_activity_time_from_the_far_future_is_not_believed() -> None:
    now = time.time()
    assert parse_activity(b"1e300", now) is None
    assert parse_activity(b"inf", now) is None
    assert parse_activity(b"nan", now) is None
    assert parse_activity(str(now + 3600).encode(), now) is None
    assert parse_activity(str(now - 5).encode(), now) == pytest.approx(now - 5)
