"""The docs an operator follows say only what exists: the generated reference is the code's own
description, every `llmgw` flag the docs name is an option of the command they name it with, and
every `LLMGW_*`, `NOMAD_*` and `CONSUL_*` variable they name is read by llmgw (or listed with
what reads it), and is the variable of the flag they pair it with."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from nomad_driver.cli import reference
from tests import acl_docs

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = sorted([*(ROOT / "docs").rglob("*.md"), ROOT / "README.md", ROOT / "terraform" / "README.md"])

FLAG_RE = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*|-[a-zA-Z])\b")
# A `llmgw ...` command line inside a code span or block, up to where another command starts.
COMMAND_RE = re.compile(r"(?<![\w/.-])llmgw((?: [a-z][a-z-]*)+)([^`|;#&\n]*)")


def test_the_reference_is_fresh() -> None:
    committed = (ROOT / "docs" / "reference.md").read_text(encoding="utf-8")
    assert committed == reference.render(), (
        "regenerate: python -m nomad_driver.cli.reference > docs/reference.md"
    )


@pytest.mark.parametrize("page", ["docs/operating.md", "terraform/README.md"])
def test_the_acl_tables_are_generated_from_the_acl_table(page: str) -> None:
    """The grants the docs list are the ones tests/test_terraform.py checks the policies
    against, so a call added to tests/acl_table.py changes the docs too."""
    text = (ROOT / page).read_text(encoding="utf-8")
    start, end = (text.index(m) for m in acl_docs.DOCS_MARKERS)
    committed = text[start : end + len(acl_docs.DOCS_MARKERS[1])]
    assert committed == "\n".join(acl_docs.docs_table()), "regenerate: python -m tests.acl_docs"


def test_the_generated_acl_table_has_every_grant_the_calls_need() -> None:
    table = "\n".join(acl_docs.docs_table())
    router = next(line for line in table.splitlines() if line.startswith("| router |"))
    # The grant the hand-written table once left out.
    assert '`key_prefix "llmgw/inflight/"` write' in router
    operator = next(line for line in table.splitlines() if line.startswith("| operator |"))
    assert all(f"`{cap}`" in operator for cap in ("list-jobs", "read-job", "submit-job"))
    assert "in default" not in table


def test_every_admin_route_is_described_and_in_the_admin_api_page() -> None:
    page = (ROOT / "docs" / "admin-api.md").read_text(encoding="utf-8")
    for method, path, _ in reference.admin_routes():
        assert (method, path) in reference.ADMIN_ROUTES, f"describe {method} {path} in reference.ADMIN_ROUTES"
        route = f"{method} {path}".replace("{model}", "<model>")
        assert f"`{route}`" in page, f"{route} is not in docs/admin-api.md"


def admin_body_fields(function: str) -> set[str]:
    """The keys of the JSON objects `function` in nomad_driver/watcher/admin.py builds: the
    routes answer plain dicts, not schema models, so their shape is read from the code."""
    tree = ast.parse((ROOT / "nomad_driver" / "watcher" / "admin.py").read_text(encoding="utf-8"))
    found = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == function)
    return {
        k.value
        for d in ast.walk(found)
        if isinstance(d, ast.Dict)
        for k in d.keys
        if isinstance(k, ast.Constant) and isinstance(k.value, str)
    }


@pytest.mark.parametrize("function", ["model_status", "nodes_status"])
def test_every_field_of_the_admin_api_bodies_is_in_the_admin_api_page(function: str) -> None:
    """admin-api.md is where the bodies are documented (the reference says so): a field the
    watcher starts returning must be named there, or clients learn of it by surprise."""
    page = (ROOT / "docs" / "admin-api.md").read_text(encoding="utf-8")
    fields = admin_body_fields(function)
    assert len(fields) > 10, f"read almost no fields of {function}: {fields}"
    missing = sorted(f for f in fields if f"`{f}`" not in page and f'"{f}"' not in page)
    assert not missing, f"docs/admin-api.md does not name what {function} returns: {missing}"


def test_the_admin_api_states_are_the_ones_the_page_lists() -> None:
    tree = ast.parse((ROOT / "nomad_driver" / "watcher" / "admin.py").read_text(encoding="utf-8"))
    found = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "model_status")
    words = {
        n.value
        for a in ast.walk(found)
        if isinstance(a, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "word" for t in a.targets)
        for n in ast.walk(a.value)
        if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }
    assert {"parked", "satisfied"} <= words
    page = (ROOT / "docs" / "admin-api.md").read_text(encoding="utf-8")
    assert not [w for w in words if f"| `{w}` |" not in page], (
        "a state of model_status is not in the state table"
    )


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


PROSE_FLAG_RE = re.compile(r"`(--[a-z][a-z0-9-]*)(?:[ =/][^`]*)?`")
HEADING_RE = re.compile(r"^#+ .*$", re.M)
# Pages about one command: a flag there with no other command named belongs to it.
PAGE_COMMANDS = {"watcher.md": "llmgw watcher", "router.md": "llmgw router"}


def command_named(words: list[str], flags: dict[str, set[str]]) -> str | None:
    """The longest run of words that is a command: `ctl retry kev-0.5b` -> `llmgw ctl retry`."""
    return next(
        (
            f"llmgw {' '.join(words[:i])}"
            for i in range(len(words), 0, -1)
            if f"llmgw {' '.join(words[:i])}" in flags
        ),
        None,
    )


def command_of_prose_flag(text: str, at: int, page: str, flags: dict[str, set[str]]) -> str | None:
    """The command a flag named in prose at `at` belongs to: the last `llmgw X` named before it
    in its sentence (a table row counts as one), else in the heading above it, else the page's
    own command; None where nothing names one."""
    para = text.rfind("\n\n", 0, at) + 2
    line = text.rfind("\n", 0, at) + 1
    if text.startswith("|", line):
        para = line
    sentence = max(
        [para, *(text.rfind(end, para, at) + len(end) for end in (". ", ".\n", "; ") if end in text[para:at])]
    )
    named = [
        c for m in COMMAND_RE.finditer(text[sentence:at]) if (c := command_named(m.group(1).split(), flags))
    ]
    if not named:
        headings = HEADING_RE.findall(text, 0, at)[-1:]
        named = [
            c
            for h in headings
            for m in COMMAND_RE.finditer(h)
            if (c := command_named(m.group(1).split(), flags))
        ]
    if not named and page in PAGE_COMMANDS:
        named = [PAGE_COMMANDS[page]]
    return named[-1] if named else None


def flags_under(command: str, flags: dict[str, set[str]]) -> set[str]:
    """A command's flags; for a group (`llmgw ctl`) also those of its verbs."""
    return set().union(*(f for c, f in flags.items() if c == command or c.startswith(command + " ")))


def prose_flag_problems(text: str, page: str) -> list[str]:
    flags = cli_flags()
    known = set().union(*flags.values()) | other_tools_flags()
    wrong = []
    for m in PROSE_FLAG_RE.finditer(text):
        flag = m.group(1)
        command = command_of_prose_flag(text, m.start(), page, flags)
        if command is not None and flag not in flags_under(command, flags):
            wrong.append(f"{flag}: named with `{command}`, which has no such flag")
        elif command is None and flag not in known:
            wrong.append(f"{flag}: no command of llmgw or of its dev tools has it")
    return wrong


def test_the_prose_flag_check_ties_a_flag_to_the_command_named_with_it() -> None:
    assert prose_flag_problems("Run `llmgw plan` with `--json`.", "x.md") == []
    assert prose_flag_problems("`llmgw apply` takes `--json`.", "x.md") == [
        "--json: named with `llmgw apply`, which has no such flag"
    ]
    # The sentence's own command wins over the heading's and the page's.
    text = "## `llmgw apply`\n\nIt asks first; `--auto-approve` skips that. `llmgw ctl status` has `--check`."
    assert prose_flag_problems(text, "router.md") == []
    assert prose_flag_problems("## Serving\n\nIt takes `--auto-approve`.", "router.md") == [
        "--auto-approve: named with `llmgw router`, which has no such flag"
    ]
    assert prose_flag_problems("Any tool's `--no-such-flag`.", "x.md") == [
        "--no-such-flag: no command of llmgw or of its dev tools has it"
    ]


@pytest.mark.parametrize("doc", DOC_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_flag_named_in_prose_belongs_to_the_command_named_with_it(doc: Path) -> None:
    """A flag named on its own (`--max-start-failures`) must be an option of the command its
    sentence, heading or page names; where none is named, one of llmgw's or its dev tools'."""
    wrong = prose_flag_problems(doc.read_text(encoding="utf-8"), doc.name)
    assert not wrong, f"{doc.relative_to(ROOT)}:\n" + "\n".join(wrong)


# --- Environment variables -----------------------------------------------------------------------

ENV_NAME_RE = re.compile(r"\b(?:LLMGW|NOMAD|CONSUL)_[A-Za-z0-9_]*[A-Za-z0-9]\b")
# Variables the docs name that the product (nomad_driver/, router/) does not read itself: where
# each is read or set instead, and why the docs name it. The test checks each is still there.
ELSEWHERE: dict[str, tuple[str, str]] = {
    "NOMAD_IP_http": (
        "nomad_driver/engines/llama_cpp.py",
        "set by Nomad in a model's task; the engine's command line uses it",
    ),
    "NOMAD_PORT_http": (
        "nomad_driver/engines/llama_cpp.py",
        "set by Nomad in a model's task; the engine's command line uses it",
    ),
    "NOMAD_IP_rpc": (
        "nomad_driver/engines/llama_cpp.py",
        "set by Nomad in a multi-node replica's task, for ggml-rpc",
    ),
    "NOMAD_PORT_rpc": (
        "nomad_driver/engines/llama_cpp.py",
        "set by Nomad in a multi-node replica's task, for ggml-rpc",
    ),
    "NOMAD_TASK_DIR": ("nomad_driver/weights.py", "set by Nomad; where a model's weights are downloaded"),
    "LLMGW_CACHE": ("devstack/llama_cpp.py", "the dev stack's download and build cache"),
    "LLMGW_DEVSTACK_DIR": ("devstack/__main__.py", "the dev stack's state directory"),
    "LLMGW_DEVSTACK_TINY": ("devstack/__main__.py", "the dev stack's tiny-model mode"),
    "LLMGW_DEVSTACK_ACL": ("devstack/__main__.py", "the dev stack with Nomad's ACLs on"),
    "LLMGW_DEVSTACK_TLS": ("devstack/__main__.py", "the dev stack with Nomad's API over HTTPS"),
    "LLMGW_DEVSTACK_S3": (
        "devstack/__main__.py",
        "the dev stack with tiny-s3, fetched from a local S3 server",
    ),
    "LLMGW_LLAMA_SERVER_BIN": ("devstack/llama_cpp.py", "the dev stack and tests: which llama-server to run"),
    "LLMGW_RPC_SERVER_BIN": (
        "devstack/llama_cpp.py",
        "the dev stack and tests: which ggml rpc-server to run",
    ),
    "LLMGW_CHROMIUM_BIN": ("tests/e2e/browser.py", "the browser tests' Chromium"),
    "LLMGW_DEVSTACK_NODE_GPUS": (
        "devstack/fake_cuda.py",
        "the stand-in's simulated hardware: the GPUs a process on a simulated node can see",
    ),
    "LLMGW_PROMETHEUS_BIN": ("devstack/prometheus.py", "the dev stack's Prometheus server"),
}


def product_env() -> dict[str, set[str]]:
    """Variable -> the `llmgw VERB --flag`s it sets (empty when read outside any option), for
    every variable nomad_driver/ and router/ read."""
    found: dict[str, set[str]] = {name: set() for name in reference.env_readers()}
    for path, cmd in reference.commands():
        for param in cmd.params:
            for env in reference._envvars(param):
                found.setdefault(env, set()).update(f"{path} {o}" for o in getattr(param, "opts", []))
    return found


def test_every_variable_the_docs_name_is_read_by_llmgw_or_listed_with_its_reader() -> None:
    """Counting a variable as read because a test or a jobspec mentions it let a documented
    `LLMGW_ROUTER_TLS_CERT` pass that llmgw never served from: the product must read it, or the
    table above must say who does and why."""
    product = product_env()
    wrong = sorted(
        {
            f"{doc.relative_to(ROOT)}: {name}"
            for doc in DOC_FILES
            for name in ENV_NAME_RE.findall(doc.read_text(encoding="utf-8"))
            if name not in product and name not in ELSEWHERE
        }
    )
    assert not wrong, (
        "variables the docs name that llmgw does not read (read them, or list the reader):\n"
        + "\n".join(wrong)
    )


@pytest.mark.parametrize("name", sorted(ELSEWHERE))
def test_each_variable_listed_elsewhere_is_still_there_and_not_read_by_the_product(name: str) -> None:
    where, _ = ELSEWHERE[name]
    assert name in (ROOT / where).read_text(encoding="utf-8"), f"{where} no longer names {name}"
    assert name not in product_env(), f"llmgw reads {name} itself now: drop it from ELSEWHERE"


# `--flag` (`VAR`), `--flag`/`VAR`, `--flag`, or `VAR`, (env `VAR`), a table row `| --flag | VAR |`,
# and `VAR` (or `--flag`): the docs saying this variable is that flag's.
_SPAN = r"`([^`\n]*--[a-z][^`\n]*)`"
_VARS = r"`((?:LLMGW|NOMAD|CONSUL)_[A-Za-z0-9_]+)`((?:, `(?:LLMGW|NOMAD|CONSUL)_[A-Za-z0-9_]+`)*)"
FLAG_THEN_VAR_RE = re.compile(_SPAN + r"\s*(?:\((?:env |or )?|/\s*|,? or |\|\s*)" + _VARS)
VAR_THEN_FLAG_RE = re.compile(_VARS + r" \(or " + _SPAN)


def flag_var_pairs(text: str, page: str) -> list[tuple[str | None, str, str]]:
    """(command or None, flag, variable) for every place the docs pair a variable with a flag;
    several flags and variables in one place pair in order."""
    flags = cli_flags()
    pairs = []
    for m in FLAG_THEN_VAR_RE.finditer(text):
        names = [m.group(2), *re.findall(r"`([A-Z][A-Za-z0-9_]+)`", m.group(3))]
        spans, at = [m.group(1)], m.start(1)
        pairs += _paired(text, at, page, flags, spans, names)
    for m in VAR_THEN_FLAG_RE.finditer(text):
        names = [m.group(1), *re.findall(r"`([A-Z][A-Za-z0-9_]+)`", m.group(2))]
        pairs += _paired(text, m.start(3), page, flags, [m.group(3)], names)
    return pairs


def _paired(
    text: str, at: int, page: str, flags: dict[str, set[str]], spans: list[str], names: list[str]
) -> list[tuple[str | None, str, str]]:
    span = spans[0]
    named = [c for m in COMMAND_RE.finditer(span) if (c := command_named(m.group(1).split(), flags))]
    command = named[-1] if named else command_of_prose_flag(text, at, page, flags)
    span_flags = [f for f in FLAG_RE.findall(span) if f.startswith("--")]
    return [(command, f, n) for f, n in zip(span_flags, names, strict=False)]


def pairing_problems(text: str, page: str) -> list[str]:
    env = product_env()
    wrong = []
    for command, flag, name in flag_var_pairs(text, page):
        sets = env.get(name, set())
        if command is not None and f"{command} {flag}" not in sets:
            wrong.append(f"{name} with {command} {flag}: it sets {sorted(sets) or 'no option'}")
        elif command is None and not any(s.endswith(f" {flag}") for s in sets):
            wrong.append(f"{name} with {flag}: it sets {sorted(sets) or 'no option'}")
    return wrong


def test_the_pairing_check_reads_the_forms_the_docs_use() -> None:
    assert (
        pairing_problems(
            "the router's certificate (`llmgw router --tls-cert`, or `LLMGW_ROUTER_TLS_CERT`)", "x.md"
        )
        == []
    )
    # The defect this check exists for: a variable documented as a serving setting that only
    # the expiry metric read.
    assert pairing_problems("| `--tls-cert` | `LLMGW_TLS_CERTS` |", "router.md") == [
        "LLMGW_TLS_CERTS with llmgw router --tls-cert: it sets no option"
    ]
    text = "`llmgw watcher --tls-cert C --tls-key K` (env `LLMGW_ADMIN_TLS_CERT`, `LLMGW_ADMIN_TLS_KEY`)"
    assert flag_var_pairs(text, "x.md") == [
        ("llmgw watcher", "--tls-cert", "LLMGW_ADMIN_TLS_CERT"),
        ("llmgw watcher", "--tls-key", "LLMGW_ADMIN_TLS_KEY"),
    ]
    assert pairing_problems(text.replace("ADMIN_TLS_KEY", "ROUTER_TLS_KEY"), "x.md") == [
        "LLMGW_ROUTER_TLS_KEY with llmgw watcher --tls-key: it sets ['llmgw router --tls-key']"
    ]
    assert flag_var_pairs("set `LLMGW_ADMIN_TOKEN` (or `--token`) to", "troubleshooting.md")[0][1:] == (
        "--token",
        "LLMGW_ADMIN_TOKEN",
    )


@pytest.mark.parametrize("doc", DOC_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_a_variable_the_docs_pair_with_a_flag_is_that_flags_variable(doc: Path) -> None:
    wrong = pairing_problems(doc.read_text(encoding="utf-8"), doc.name)
    assert not wrong, f"{doc.relative_to(ROOT)}:\n" + "\n".join(wrong)


def router_error_codes() -> set[str]:
    """Every error `code` the router's own code can answer with: the literal code of each
    `RouterError(...)` and `refuse(...)` (the connection guards), and of each `bad_request(...)`
    (its `code=`, or the default its definition gives)."""
    codes: set[str] = set()
    for path in sorted((ROOT / "router").glob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name == "bad_request":
                names = [a.arg for a in node.args.args]
                defaults = dict(
                    zip(names[len(names) - len(node.args.defaults) :], node.args.defaults, strict=True)
                )
                default = defaults["code"]
                assert isinstance(default, ast.Constant)
                codes.add(default.value)
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name in ("RouterError", "refuse") and len(node.args) >= 2:
                code = node.args[1]
                if isinstance(code, ast.Constant):
                    codes.add(code.value)
                else:
                    # Only bad_request passes its code through; anything else must be literal
                    # to be checked here.
                    assert path.name == "errors.py", f"{path.name}:{node.lineno}: a non-literal error code"
            elif name == "bad_request":
                for keyword in node.keywords:
                    if keyword.arg == "code":
                        assert isinstance(keyword.value, ast.Constant), f"{path.name}:{node.lineno}"
                        codes.add(keyword.value.value)
    return codes


def router_error_table() -> set[str]:
    """The codes in the first column of docs/router.md's one table of error answers."""
    page = (ROOT / "docs" / "router.md").read_text(encoding="utf-8")
    head = "| status, `code` | when | retry? |"
    assert page.count(head) == 1, "docs/router.md has one table of error codes"
    rows = page.split(head, 1)[1].split("\n\n", 1)[0].splitlines()[2:]
    codes: set[str] = set()
    for row in rows:
        first = row.split("|")[1]
        codes |= set(re.findall(r"`([a-z_]+)`", first))
    return codes


def test_every_error_code_the_router_answers_with_is_in_the_docs_table_and_no_other() -> None:
    emitted = router_error_codes()
    table = router_error_table()
    assert {"model_parked", "headers_too_large", "invalid_request", "not_found"} <= emitted
    assert sorted(emitted - table) == [], "answered by the router but not in docs/router.md's error table"
    assert sorted(table - emitted) == [], "in docs/router.md's error table but never answered"


def test_the_fetch_gauges_are_documented() -> None:
    """They exist only while a fetch runs, so no scrape of an idle stand-in shows them missing."""
    from nomad_driver.watcher.fetch_progress import fetch_metrics

    text = (ROOT / "docs" / "metrics.md").read_text(encoding="utf-8")
    running = {"m": [{"node": "n", "done": 1, "total": 2, "rate": 3}]}
    for family in fetch_metrics(running):
        assert f"| `{family.name}` | gauge | `model`, `node` |" in text, family.name
