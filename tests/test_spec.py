"""Model definitions: what an operator writes, and every way it can be wrong."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from nomad_driver.spec import (
    DEFAULT_ACTIVATION_TIMEOUT_S,
    DEFAULT_IDLE_TIMEOUT_S,
    RESERVED_MODEL_NAMES,
    Profile,
    SpecError,
    definition_hash,
    job_id_for,
    load_models,
    parse_duration,
    parse_models,
)

ROOT = Path(__file__).resolve().parent.parent

PROFILES = """
profiles:
  llamacpp-1x24g:
    engine: llama.cpp
    engine_version: b6500
    gpus: 1
    gpu_memory_mib: 24000
    cpu_mhz: 2000
    memory_mib: 16384
    context: 8192
  vllm-4x80g:
    engine: vllm
    engine_version: v0.10.1
    gpus: 4
    gpu_memory_mib: 80000
  cpu-dev:
    engine: llama-cpp-python
    engine_version: 0.3.36
    gpus: 0
    context: 256
"""


def doc(models: str, profiles: str = PROFILES) -> str:
    body = textwrap.indent(textwrap.dedent(models).strip("\n"), "  ")
    return textwrap.dedent(profiles) + "models:\n" + body + "\n"


def problems_of(text: str) -> list[str]:
    with pytest.raises(SpecError) as info:
        parse_models(text)
    return info.value.problems


def test_the_shipped_example_is_valid_and_ordered_as_written() -> None:
    model_set = load_models(ROOT / "examples" / "models.yaml")
    assert list(model_set.models) == ["qwen2.5-0.5b", "llama-3.3-70b", "gemma-3-4b"]
    big = model_set.models["llama-3.3-70b"]
    assert big.profile.engine == "vllm" and big.profile.gpus == 4
    on_demand = model_set.models["gemma-3-4b"]
    assert on_demand.replicas_min == 0 and on_demand.replicas_max == 1
    assert on_demand.idle_timeout_s == 600
    assert on_demand.profile.chat_format == "gemma"


def test_defaults_fill_what_a_model_leaves_out() -> None:
    model = parse_models(doc("m1: {source: hf://org/repo/m.gguf, profile: llamacpp-1x24g}")).models["m1"]
    assert model.replicas_min == 1 and model.replicas_max == 1
    assert model.idle_timeout_s == DEFAULT_IDLE_TIMEOUT_S == 900
    assert model.activation_timeout_s == DEFAULT_ACTIVATION_TIMEOUT_S == 300
    assert model.job_id == "llmgw-m1" == job_id_for("m1")
    assert model.profile_name == "llamacpp-1x24g"
    assert model.def_hash == definition_hash(model.source, model.profile)


def test_unknown_profile_names_the_model_and_the_profile() -> None:
    problems = problems_of(doc("kev-0.5b: {source: hf://org/repo/kev.gguf, profile: gpu9}"))
    assert len(problems) == 1
    assert problems[0].startswith("models.kev-0.5b.profile: unknown profile 'gpu9'")
    assert "llamacpp-1x24g" in problems[0]  # it says what would have been valid


@pytest.mark.parametrize(
    ("models", "path", "key"),
    [
        ("m: {source: hf://o/r/f.gguf, profile: cpu-dev, replica: {min: 1}}", "models.m.replica", "replica"),
        (
            "m: {source: hf://o/r/f.gguf, profile: cpu-dev, replicas: {min: 1, mx: 2}}",
            "models.m.replicas.mx",
            "mx",
        ),
    ],
)
def test_unknown_keys_in_a_model_are_refused(models: str, path: str, key: str) -> None:
    problems = problems_of(doc(models))
    assert any(p.startswith(f"{path}: unknown key '{key}'") for p in problems), problems


def test_unknown_keys_in_a_profile_and_at_the_top_are_refused() -> None:
    text = doc(
        "m: {source: hf://o/r/f.gguf, profile: cpu-dev}",
        PROFILES + "    gpu_mem: 10\n",
    )
    text += "defaults: {}\n"
    problems = problems_of(text)
    assert any(p.startswith("profiles.cpu-dev.gpu_mem: unknown key 'gpu_mem'") for p in problems), problems
    assert any(p.startswith("defaults: unknown key 'defaults'") for p in problems), problems


def test_every_problem_is_reported_at_once() -> None:
    problems = problems_of(
        doc(
            """
            a: {source: hf://o/r/f.gguf, profile: nope}
            b: {source: ftp://host/f.gguf, profile: cpu-dev}
            c: {source: hf://o/r/f.gguf, profile: cpu-dev, replicas: {min: 3, max: 1}}
            d: {source: hf://o/r/f.gguf, profile: cpu-dev, idle_timeout: soon}
            """
        )
    )
    assert [p.split(":")[0] for p in problems] == [
        "models.a.profile",
        "models.b.source",
        "models.c.replicas",
        "models.d.idle_timeout",
    ]


def test_duplicate_model_names_are_refused_with_their_lines() -> None:
    text = doc(
        """
        m1: {source: hf://o/r/a.gguf, profile: cpu-dev}
        m2: {source: hf://o/r/b.gguf, profile: cpu-dev}
        m1: {source: hf://o/r/c.gguf, profile: cpu-dev}
        """
    )
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if line.strip().startswith("m1:")) + 1
    second = max(i for i, line in enumerate(lines) if line.strip().startswith("m1:")) + 1
    problems = problems_of(text)
    assert problems == [f"models.m1: duplicate key 'm1' at line {second} (first at line {first})"]


def test_duplicate_keys_inside_a_profile_are_refused_too() -> None:
    text = PROFILES.replace("    gpus: 4\n", "    gpus: 4\n    gpus: 2\n")
    problems = problems_of(doc("m: {source: hf://o/r/f.gguf, profile: cpu-dev}", text))
    assert len(problems) == 1
    assert problems[0].startswith("profiles.vllm-4x80g.gpus: duplicate key 'gpus' at line")


@pytest.mark.parametrize(
    ("source", "profile", "why"),
    [
        ("ftp://host/f.gguf", "cpu-dev", "unsupported source"),
        ("qwen.gguf", "cpu-dev", "unsupported source"),
        ("hf://org/repo", "llamacpp-1x24g", "names a repository"),
        ("hf://org", "vllm-4x80g", "must name ORG/REPO"),
        ("file://relative/f.gguf", "cpu-dev", "absolute path"),
        ("s3://bucket", "cpu-dev", "bucket and a key"),
        ("https://host.example/dir/", "llamacpp-1x24g", "directory"),
    ],
)
def test_bad_sources_are_refused(source: str, profile: str, why: str) -> None:
    problems = problems_of(doc(f"m: {{source: '{source}', profile: {profile}}}"))
    assert len(problems) == 1
    assert problems[0].startswith("models.m.source: ") and why in problems[0], problems


@pytest.mark.parametrize(
    ("source", "profile"),
    [
        ("hf://Qwen/Qwen2.5-0.5B-Instruct-GGUF/qwen2.5-0.5b-instruct-q4_k_m.gguf", "llamacpp-1x24g"),
        ("hf://meta-llama/Llama-3.3-70B-Instruct", "vllm-4x80g"),
        ("s3://bucket/models/llama-70b/", "vllm-4x80g"),
        ("https://example.com/models/tiny.gguf", "cpu-dev"),
        ("file:///srv/models/tiny.gguf", "cpu-dev"),
    ],
)
def test_good_sources_are_accepted(source: str, profile: str) -> None:
    model = parse_models(doc(f"m: {{source: '{source}', profile: {profile}}}")).models["m"]
    assert model.source == source


@pytest.mark.parametrize(
    ("replicas", "message"),
    [
        ("{min: 3, max: 1}", "models.m.replicas: min 3 is greater than max 1"),
        ("{min: 0, max: 0}", "models.m.replicas.max: must be >= 1, got 0"),
        ("{min: -1, max: 2}", "models.m.replicas.min: must be >= 0, got -1"),
        ("2", "models.m.replicas: expected a mapping, got 2"),
        ("{min: one}", "models.m.replicas.min: expected an integer, got 'one'"),
    ],
)
def test_impossible_replica_bounds_are_refused(replicas: str, message: str) -> None:
    problems = problems_of(doc(f"m: {{source: hf://o/r/f.gguf, profile: cpu-dev, replicas: {replicas}}}"))
    assert problems == [message]


def test_max_defaults_to_min_so_an_always_on_model_needs_only_min() -> None:
    model = parse_models(doc("m: {source: hf://o/r/f.gguf, profile: cpu-dev, replicas: {min: 3}}")).models[
        "m"
    ]
    assert (model.replicas_min, model.replicas_max) == (3, 3)


@pytest.mark.parametrize(
    "name",
    ["bad name", "-lead", "trail-", "a/b", "model=x", "ünï", "x" * 65, "a:b", "'1'"],
)
def test_names_that_cannot_be_a_job_id_or_consul_tag_are_refused(name: str) -> None:
    problems = problems_of(doc(f'"{name}": {{source: hf://o/r/f.gguf, profile: cpu-dev}}'))
    assert any("invalid model name" in p for p in problems), problems


@pytest.mark.parametrize("name", ["qwen2.5-0.5b", "Llama_3.3-70B", "a", "x" * 64])
def test_names_in_the_safe_alphabet_are_accepted(name: str) -> None:
    model = parse_models(doc(f'"{name}": {{source: hf://o/r/f.gguf, profile: cpu-dev}}')).models[name]
    assert model.job_id == f"llmgw-{name}"


@pytest.mark.parametrize("name", ["router", "watcher", "node-agent", "Router", "NODE-AGENT"])
def test_names_of_llmgws_own_jobs_are_refused(name: str) -> None:
    """`llmgw-router` is the router's own Nomad job; a model by that name would replace it."""
    problems = problems_of(doc(f'"{name}": {{source: hf://o/r/f.gguf, profile: cpu-dev}}'))
    assert problems == [
        f"models.{name}: model name {name!r} is taken: its Nomad job would be llmgw-{name}, "
        f"llmgw's own {name.lower()} job; choose another name"
    ]


def test_every_job_llmgw_ships_is_a_refused_model_name() -> None:
    shipped = {
        p.name.removesuffix(".nomad.hcl").removeprefix("llmgw-") for p in (ROOT / "jobs").glob("*.nomad.hcl")
    }
    assert shipped and shipped <= set(RESERVED_MODEL_NAMES)


def test_a_model_name_that_yaml_reads_as_a_number_is_refused() -> None:
    problems = problems_of(doc("1.5: {source: hf://o/r/f.gguf, profile: cpu-dev}"))
    assert any(p.startswith("models.1.5: invalid model name") for p in problems), problems


@pytest.mark.parametrize(
    ("raw", "seconds"),
    [
        ("15m", 900),
        ("30s", 30),
        ("1h", 3600),
        ("90", 90),
        (90, 90),
        ("1h30m", 5400),
        ("500ms", 0.5),
        (2.5, 2.5),
    ],
)
def test_durations_in_the_forms_operators_write(raw: object, seconds: float) -> None:
    assert parse_duration(raw) == seconds


@pytest.mark.parametrize("raw", ["5x", "-1", "0", "", "m", "15 m", True, [1], "1d"])
def test_bad_durations_fail_with_the_path(raw: object) -> None:
    text = doc(f"m: {{source: hf://o/r/f.gguf, profile: cpu-dev, activation_timeout: {raw!r}}}")
    problems = problems_of(text)
    assert len(problems) == 1 and problems[0].startswith("models.m.activation_timeout: "), problems


def test_profile_values_are_checked_against_what_they_mean() -> None:
    profiles = """
    profiles:
      p1: {engine: tensorrt, engine_version: "1"}
      p2: {engine: vllm, engine_version: v1, gpus: 0}
      p3: {engine: llama.cpp, engine_version: "b 6500"}
      p4: {engine: llama.cpp, engine_version: b1, gpus: -1}
      p5: {engine: llama.cpp, engine_version: b1, chat_format: gemma}
      p6: {engine: llama-cpp-python, engine_version: "1", gpus: 0, gpu_memory_mib: 1000}
      p7: {engine: llama.cpp, engine_version: b1, gpu_models: ["A,B"]}
      p8: {engine: llama.cpp, engine_version: b1, memory_mib: "lots"}
    """
    problems = problems_of(doc("m: {source: hf://o/r/f.gguf, profile: p1}", profiles))
    paths = [p.split(": ")[0] for p in problems]
    assert paths == [
        "profiles.p1.engine",
        "profiles.p2.gpus",
        "profiles.p3.engine_version",
        "profiles.p4.gpus",
        "profiles.p5.chat_format",
        "profiles.p6",
        "profiles.p7.gpu_models.0",
        "profiles.p8.memory_mib",
    ]
    # A model on a broken profile is not also told its profile does not exist.
    assert not any(p.startswith("models.") for p in problems)


def test_numbers_in_engine_args_are_taken_as_text() -> None:
    profiles = "profiles:\n  p: {engine: llama.cpp, engine_version: b1, args: [--parallel, 4]}\n"
    model = parse_models(doc("m: {source: hf://o/r/f.gguf, profile: p}", profiles)).models["m"]
    assert model.profile.args == ["--parallel", "4"]


@pytest.mark.parametrize(
    ("text", "start"),
    [
        ("", "<string>: the file is empty"),
        ("- a\n- b\n", "<string>: expected a mapping"),
        ("models: [\n", "<string>: not valid YAML"),
        ("models: {}\n", "profiles: required"),
    ],
)
def test_files_that_are_not_models_files(text: str, start: str) -> None:
    problems = problems_of(text)
    assert problems[0].startswith(start), problems


def test_invalid_yaml_says_where(tmp_path: Path) -> None:
    path = tmp_path / "models.yaml"
    path.write_text("profiles:\n  p: {engine: vllm\nmodels: {}\n")
    with pytest.raises(SpecError) as info:
        load_models(path)
    assert str(info.value).startswith(f"{path}: not valid YAML")
    assert "line 3" in str(info.value)


def test_a_missing_file_is_a_spec_error_naming_it(tmp_path: Path) -> None:
    with pytest.raises(SpecError) as info:
        load_models(tmp_path / "nope.yaml")
    assert str(info.value).startswith(f"{tmp_path / 'nope.yaml'}: cannot read")


def test_spec_error_prints_one_problem_per_line() -> None:
    error = SpecError(["a.b: one", "c.d: two"])
    assert str(error) == "a.b: one\nc.d: two"


# --- the definition hash ------------------------------------------------------------------------

BASE = """
profiles:
  p:
    engine: llama.cpp
    engine_version: b6500
    gpus: 1
    gpu_memory_mib: 24000
    args: [--parallel, "4"]
models:
  m:
    source: hf://o/r/f.gguf
    profile: p
    replicas: {min: 0, max: 2}
    idle_timeout: 15m
"""


def hash_of(text: str) -> str:
    return parse_models(text).models["m"].def_hash


def test_hash_ignores_replicas_timeouts_key_order_and_the_profiles_name() -> None:
    base = hash_of(BASE)
    assert hash_of(BASE.replace("{min: 0, max: 2}", "{min: 1, max: 5}")) == base
    assert hash_of(BASE.replace("idle_timeout: 15m", "idle_timeout: 1h\n    activation_timeout: 9m")) == base
    reordered = BASE.replace(
        "    engine: llama.cpp\n    engine_version: b6500\n",
        "    engine_version: b6500\n    engine: llama.cpp\n",
    ).replace(
        "    source: hf://o/r/f.gguf\n    profile: p\n", "    profile: p\n    source: hf://o/r/f.gguf\n"
    )
    assert reordered != BASE
    assert hash_of(reordered) == base
    renamed = BASE.replace("  p:\n", "  q:\n").replace("profile: p", "profile: q")
    assert hash_of(renamed) == base
    # Writing a default out changes nothing: the hash is over the resolved profile.
    assert hash_of(BASE.replace("    gpus: 1\n", "    gpus: 1\n    context: 4096\n")) == base


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("hf://o/r/f.gguf", "hf://o/r/g.gguf"),
        ("b6500", "b6600"),
        ("gpu_memory_mib: 24000", "gpu_memory_mib: 40000"),
        ('[--parallel, "4"]', '[--parallel, "8"]'),
        ("gpus: 1", "gpus: 2"),
    ],
)
def test_hash_changes_with_the_source_or_the_profile(old: str, new: str) -> None:
    assert hash_of(BASE.replace(old, new)) != hash_of(BASE)


def test_definition_hash_is_a_pure_function_of_source_and_profile() -> None:
    profile = Profile(engine="llama.cpp", engine_version="b1")
    assert definition_hash("hf://o/r/f.gguf", profile) == definition_hash("hf://o/r/f.gguf", profile)
    assert len(definition_hash("hf://o/r/f.gguf", profile)) == 16
