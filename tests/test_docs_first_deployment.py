"""What a first deployment from the docs met (issue 32, item 7): each of these fails when a page
or the Terraform module says again what does not work."""

from __future__ import annotations

import re
from pathlib import Path

import hcl2

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([*(ROOT / "docs").rglob("*.md"), ROOT / "README.md", ROOT / "terraform" / "README.md"])


def text(path: str) -> str:
    return (ROOT / path).read_text(encoding="utf-8")


def test_getting_started_gives_ctl_the_admin_token_before_it_runs() -> None:
    """The watchers listen beyond loopback, so `ctl` without the token gets 401."""
    page = text("docs/getting-started.md")
    first_ctl = page.index("llmgw ctl ")
    assert "LLMGW_ADMIN_TOKEN=" in page[:first_ctl]


def test_no_page_rotates_a_token_with_var_put_force() -> None:
    """`nomad var put -force PATH k=v` replaces every item: the other tokens are gone."""
    for page in DOCS:
        assert "var put -force" not in page.read_text(encoding="utf-8"), page.name


def test_the_terraform_example_leaves_addresses_to_the_environment() -> None:
    """A provider `address` wins over NOMAD_ADDR and CONSUL_HTTP_ADDR, which the docs export."""
    example = hcl2.loads(text("terraform/examples/basic/main.tf"))
    for provider in example["provider"]:
        for name, body in provider.items():
            assert "address" not in body, f"provider {name} sets address"


def test_terraform_floor_is_the_one_optional_defaults_need() -> None:
    """`optional(type, default)` came in Terraform 1.3."""
    assert "optional(string, " in text("terraform/variables.tf")
    for path in ("terraform/versions.tf", "terraform/examples/basic/main.tf"):
        (block,) = hcl2.loads(text(path))["terraform"]
        assert block["required_version"].strip('"') == ">= 1.3.0", path
    assert "Terraform 1.3+" in text("terraform/README.md")


def test_no_page_says_the_router_calls_nomad() -> None:
    """The router asks the leading watcher through Consul; it holds no Nomad token."""
    row = next(line for line in text("docs/operating.md").splitlines() if line.startswith("| `llmgw router`"))
    assert "Nomad" not in row
    assert "routers scale" not in text("terraform/variables.tf")


def test_plan_job_is_named_with_the_nomad_release_that_has_it() -> None:
    """`plan-job` is a namespace capability from Nomad 2.0 on (hashicorp/nomad acl/policy.go)."""
    for page in DOCS:
        for match in re.finditer(r"`plan-job`[^|]{0,40}", page.read_text(encoding="utf-8")):
            assert "2.0" in match.group(0), f"{page.name}: {match.group(0)!r}"


def test_the_version_floors_are_the_ones_the_rules_were_checked_for() -> None:
    """Task `consul {}` identities and `nomad setup consul` need Nomad 1.7; the docs say what the
    rules were checked against."""
    for path in ("docs/getting-started.md", "docs/operating.md", "terraform/README.md"):
        page = text(path)
        assert "Nomad 1.6" not in page, path
        assert "Nomad 1.7 or later" in page, path
    assert "checked against" in text("docs/operating.md")
