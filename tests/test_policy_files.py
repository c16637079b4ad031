"""The ACL policies as files an operator can copy (`docs/policies/`), for the by-hand install in
docs/operating.md: the same rules as terraform/acl.tf's heredocs, with the models' namespace
written as its default, `default`, so `nomad acl policy apply` takes them as they are."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.test_terraform import blocks, heredoc

ROOT = Path(__file__).resolve().parent.parent
POLICIES = ROOT / "docs" / "policies"
# (resource type, rules attribute, file suffix)
KINDS = [("nomad_acl_policy", "rules_hcl", "nomad.hcl"), ("consul_acl_policy", "rules", "consul.hcl")]


def expected() -> dict[Path, str]:
    files = {}
    for (rtype, _), body in blocks("resource").items():
        for kind, attr, suffix in KINDS:
            if rtype == kind:
                text = heredoc(body[attr]).replace("${var.models_namespace}", "default")
                files[POLICIES / f"{body['name']}.{suffix}"] = text.strip() + "\n"
    return files


@pytest.mark.parametrize("path", sorted(expected()), ids=lambda p: p.name)
def test_each_policy_file_is_the_modules_rules(path: Path) -> None:
    assert path.exists(), f"{path.relative_to(ROOT)} is missing: write the rules from terraform/acl.tf"
    assert path.read_text() == expected()[path], f"{path.name} differs from terraform/acl.tf"
    assert "${" not in path.read_text()


def test_the_by_hand_install_applies_the_files_and_no_heredoc() -> None:
    page = (ROOT / "docs" / "operating.md").read_text()
    by_hand = page.split("### By hand", 1)[1].split("\n## ", 1)[0]
    assert "heredoc" not in by_hand
    named = set(re.findall(r"docs/policies/([\w.-]+\.hcl)", by_hand))
    assert named == {p.name for p in expected()}, named
