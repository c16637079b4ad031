"""The ACL tables of docs/operating.md and terraform/README.md, generated from the calls in
tests/acl_table.py, so the docs grant what the policies grant (tests/test_terraform.py checks
those against the same calls) and cannot drift from them:

    python -m tests.acl_docs            # rewrites the table in both pages

tests/test_docs.py fails when a committed table differs from a fresh one.
"""

from __future__ import annotations

from tests.acl_table import (
    CLI_VERBS,
    COMPONENTS,
    CONSUL_LEVELS,
    NOMAD_LEVELS,
    Component,
    ConsulGrant,
    NomadGrant,
    grants,
)

# What each component does with its grants, for the docs' table; the grants themselves come from
# CALLS, so the table cannot say more or less than the policies the tests check.
ROLES: dict[Component, str] = {
    "watcher": "registers, scales and parks model jobs; reads the engine's stderr for the last error; "
    "holds the leader lock; writes state; shows each model in the Consul UI",
    "router": "finds replicas; scales an on-demand model up; writes when a model was last used and "
    "its requests in flight",
    "node-agent": "publishes the node's GPUs, engines and weights; `/v1/client/metadata` takes nothing narrower",
    "operator": "`llmgw plan` and `llmgw apply`, run with your own tokens (the Terraform module makes "
    "these `llmgw-operator` policies, and no token)",
}
DOCS_MARKERS = (
    "<!-- acl-table: generated from tests/acl_table.py by `python -m tests.acl_docs`; do not edit -->",
    "<!-- end acl-table -->",
)


def nomad_needs(component: Component) -> tuple[list[str], dict[str, str]]:
    """The fewest namespace capabilities that allow every call (the narrower of two where a
    call takes either, unless another call already needs the other), and the node/agent levels."""
    wanted = [g for g in grants(component, "nomad") if isinstance(g, NomadGrant)]
    caps = [g.capability for g in wanted if g.scope == "namespace" and not g.alternatives]
    for g in wanted:
        if g.scope == "namespace" and not {g.capability, *g.alternatives} & set(caps):
            caps.append(g.capability)
    levels: dict[str, str] = {}
    for g in wanted:
        if g.scope != "namespace" and NOMAD_LEVELS[g.capability] > NOMAD_LEVELS[levels.get(g.scope, "deny")]:
            levels[g.scope] = g.capability
    return list(dict.fromkeys(caps)), levels


def consul_needs(component: Component) -> list[ConsulGrant]:
    """The fewest Consul rules that allow every call: each name at the highest level a call
    needs, less those a wider prefix rule already grants at that level."""
    best: dict[tuple[str, str, bool], ConsulGrant] = {}
    for g in grants(component, "consul"):
        assert isinstance(g, ConsulGrant)
        key = (g.kind, g.name, g.prefix)
        if key not in best or CONSUL_LEVELS[g.access] > CONSUL_LEVELS[best[key].access]:
            best[key] = g
    return [
        g
        for g in best.values()
        if not any(
            o is not g
            and o.kind == g.kind
            and o.prefix
            and g.name.startswith(o.name)
            and (len(o.name) < len(g.name) or not g.prefix)
            and CONSUL_LEVELS[o.access] >= CONSUL_LEVELS[g.access]
            for o in best.values()
        )
    ]


def _code_list(items: list[str]) -> str:
    quoted = [f"`{i}`" for i in items]
    return quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + " and " + quoted[-1]


def docs_table() -> list[str]:
    """The ACL table of docs/operating.md and terraform/README.md, from CALLS."""
    lines = [
        DOCS_MARKERS[0],
        "| component | Nomad | Consul | why |",
        "| --- | --- | --- | --- |",
    ]
    for component in COMPONENTS:
        caps, levels = nomad_needs(component)
        nomad = [f"{_code_list(caps)} in the models' namespace"] if caps else []
        nomad += [f"`{scope}` {level}" for scope, level in levels.items()]
        consul = [
            f'`{g.kind}{"_prefix" if g.prefix else ""} "{g.name}"` {g.access}'
            for g in consul_needs(component)
        ]
        name = component.replace("-", " ")
        lines.append(
            f"| {name} | {'; '.join(nomad) or 'none'} | {', '.join(consul) or 'none'} | {ROLES[component]} |"
        )
    lines += ["", "| `llmgw` verb | runs with |", "| --- | --- |"]
    for verb, runs_with in CLI_VERBS.items():
        whose = (
            f"the {runs_with.replace('-', ' ')}'s grants (above)" if runs_with in COMPONENTS else runs_with
        )
        lines.append(f"| `{verb}` | {whose} |")
    return [*lines, DOCS_MARKERS[1]]


def with_docs_table(text: str) -> str:
    """`text` with its generated block replaced by a fresh one."""
    start, end = (text.index(m) for m in DOCS_MARKERS)
    return text[:start] + "\n".join(docs_table()) + text[end + len(DOCS_MARKERS[1]) :]


if __name__ == "__main__":
    # Rewrites the table in the pages that carry it, so it is regenerated, never edited.
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    for page in sys.argv[1:] or ["docs/operating.md", "terraform/README.md"]:
        path = root / page
        path.write_text(with_docs_table(path.read_text(encoding="utf-8")), encoding="utf-8")
