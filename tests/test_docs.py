"""The docs an operator follows say only what exists: the generated reference is the code's own
description, and every `llmgw` flag and `LLMGW_*` variable named anywhere in the docs is real."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from nomad_driver.cli import reference

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = sorted([*(ROOT / "docs").rglob("*.md"), ROOT / "README.md", ROOT / "terraform" / "README.md"])
# Where a name the docs use may be defined: the product, the dev stack and benchmarks, and the
# files that drive them.
CODE_DIRS = ("nomad_driver", "router", "devstack", "bench", "tests", "jobs")

FLAG_RE = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*|-[a-zA-Z])\b")
LLMGW_VAR_RE = re.compile(r"\bLLMGW_[A-Z0-9_]+\b")
# A `llmgw ...` command line inside a code span or block, up to where another command starts.
COMMAND_RE = re.compile(r"(?<![\w/.-])llmgw((?: [a-z][a-z-]*)+)([^`|;#&\n]*)")


def test_the_reference_is_fresh() -> None:
    committed = (ROOT / "docs" / "reference.md").read_text(encoding="utf-8")
    assert committed == reference.render(), (
        "regenerate: python -m nomad_driver.cli.reference > docs/reference.md"
    )


def test_every_admin_route_is_described_and_in_the_admin_api_page() -> None:
    page = (ROOT / "docs" / "admin-api.md").read_text(encoding="utf-8")
    for method, path, _ in reference.admin_routes():
        assert (method, path) in reference.ADMIN_ROUTES, f"describe {method} {path} in reference.ADMIN_ROUTES"
        if path.startswith("/v1/admin/"):
            assert path.replace("{model}", "<model>") in page, f"{method} {path} is not in docs/admin-api.md"


def test_every_environment_variable_the_code_reads_is_in_the_reference() -> None:
    page = (ROOT / "docs" / "reference.md").read_text(encoding="utf-8")
    for name in reference.env_readers():
        assert f"`{name}`" in page


def cli_flags() -> dict[str, set[str]]:
    """`llmgw VERB` -> the flags it takes, its groups' flags included, and `--help`."""
    commands = dict(reference.commands())
    flags: dict[str, set[str]] = {}
    for path, cmd in commands.items():
        own = {o for p in cmd.params for o in [*getattr(p, "opts", []), *getattr(p, "secondary_opts", [])]}
        flags[path] = {o for o in own if o.startswith("-")} | {"--help"}
    for path in list(flags):
        parts = path.split()
        for i in range(2, len(parts)):
            flags[path] |= flags.get(" ".join(parts[:i]), set())
    return flags


def other_tools_flags() -> set[str]:
    """Flags of the dev stack and benchmarks (argparse), which the developer pages name, and the
    engines' flags llmgw itself passes (`--alias`, `--served-model-name`, `--version`)."""
    found: set[str] = set()
    for folder in ("devstack", "bench"):
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text(encoding="utf-8")
            found |= set(re.findall(r"add_argument\(\s*\"(--[a-z0-9-]+)\"", text))
            # Flags added in a loop over (flag, default, help) tuples (the stand-in's GC settings).
            found |= set(re.findall(r"\(\s*\"(--[a-z0-9-]+)\",", text))
    for path in (ROOT / "nomad_driver").rglob("*.py"):
        found |= set(re.findall(r"\"(--[a-z][a-z0-9_-]*)\"", path.read_text(encoding="utf-8")))
    return found


def code_spans(text: str) -> list[str]:
    blocks = re.findall(r"```[a-z]*\n(.*?)```", text, re.S)
    rest = re.sub(r"```[a-z]*\n.*?```", "", text, flags=re.S)
    return [*(line for b in blocks for line in b.splitlines()), *re.findall(r"`([^`\n]+)`", rest)]


def test_the_command_line_check_reads_what_the_docs_write() -> None:
    """The check below is only as good as its reading of the docs: it must find these."""
    spans = code_spans((ROOT / "docs" / "operating.md").read_text(encoding="utf-8"))
    found = {
        (m.group(1).strip(), f)
        for s in spans
        for m in COMMAND_RE.finditer(s)
        for f in FLAG_RE.findall(m.group(0))
    }
    assert {("ctl status", "--check"), ("render", "--check"), ("render models", "-o")} <= found


@pytest.mark.parametrize("doc", DOC_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_llmgw_command_line_in_the_docs_uses_flags_that_exist(doc: Path) -> None:
    flags = cli_flags()
    wrong: list[str] = []
    for span in code_spans(doc.read_text(encoding="utf-8")):
        for match in COMMAND_RE.finditer(span):
            words = match.group(1).split()
            # The longest run of words that is a command: `llmgw ctl retry kev-0.5b` -> `llmgw ctl retry`.
            path = next(
                (
                    f"llmgw {' '.join(words[:i])}"
                    for i in range(len(words), 0, -1)
                    if f"llmgw {' '.join(words[:i])}" in flags
                ),
                None,
            )
            if path is None:
                if words[0] in {"ctl", "render", "plan", "apply", "watcher", "router", "node-agent"}:
                    wrong.append(f"{span.strip()!r}: no command llmgw {' '.join(words[:2])}")
                continue
            for flag in FLAG_RE.findall(match.group(0)):
                if flag not in flags[path]:
                    wrong.append(f"{span.strip()!r}: {path} has no {flag}")
    assert not wrong, f"{doc.name}:\n" + "\n".join(wrong)


@pytest.mark.parametrize("doc", DOC_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_flag_named_on_its_own_belongs_to_llmgw_or_its_dev_tools(doc: Path) -> None:
    """A flag named in prose (`--max-start-failures`) must be one of llmgw's or of the dev
    stack's and benchmarks'; other tools' flags appear only inside their own command lines."""
    known = set().union(*cli_flags().values()) | other_tools_flags()
    wrong = [
        span
        for span in re.findall(r"`(--[a-z][a-z0-9-]*)(?:[ =/][^`]*)?`", doc.read_text(encoding="utf-8"))
        if span not in known
    ]
    assert not wrong, f"{doc.name} names flags nothing has: {sorted(set(wrong))}"


def test_every_llmgw_variable_the_docs_name_is_read_somewhere() -> None:
    code = "\n".join(
        path.read_text(encoding="utf-8", errors="replace")
        for folder in CODE_DIRS
        for path in (ROOT / folder).rglob("*")
        if path.is_file() and path.suffix in {".py", ".hcl", ".sh"}
    ) + (ROOT / "Makefile").read_text(encoding="utf-8")
    defined = set(LLMGW_VAR_RE.findall(code))
    wrong = {
        f"{doc.name}: {name}"
        for doc in DOC_FILES
        for name in LLMGW_VAR_RE.findall(doc.read_text(encoding="utf-8"))
        if name not in defined
    }
    assert not wrong, "variables the docs name and nothing reads:\n" + "\n".join(sorted(wrong))
