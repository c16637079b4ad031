"""The stand-in's consul-template subset: `service` lookups rendered as consul-template renders
them, and refused clearly where it does not go."""

from __future__ import annotations

import pytest

from devstack.nomad.consul_template import ServiceTemplateError, lookups, render_services, split_query
from nomad_driver.render import render_replica_job
from tests.test_multinode_render import SET


def leader_template() -> str:
    job = render_replica_job(SET.models["gemma-split"], 1)
    return str(job["TaskGroups"][0]["Tasks"][0]["Templates"][0]["EmbeddedTmpl"])


def test_the_leaders_template_lists_its_shards_comma_separated() -> None:
    text = leader_template()
    (query,) = lookups(text)
    assert split_query(query) == ("llmgw-shard", "job=llmgw-gemma-split:1")
    shards = [("10.0.0.1", 4001), ("10.0.0.2", 4002)]
    assert render_services(text, {query: shards}, {}) == "RPC_SERVERS=10.0.0.1:4001,10.0.0.2:4002\n"
    assert render_services(text, {query: shards[:1]}, {}) == "RPC_SERVERS=10.0.0.1:4001\n"
    assert render_services(text, {}, {}) == "RPC_SERVERS=\n"


def test_a_tag_with_dots_keeps_everything_before_the_last_dot() -> None:
    assert split_query("job=llmgw-a.b.c.llmgw-shard") == ("llmgw-shard", "job=llmgw-a.b.c")
    assert split_query("web") == ("web", "")


def test_range_with_dot_fields_and_env_render() -> None:
    text = 'H={{ range service "x.head" }}{{ .Address }}:{{ .Port }}{{ end }} {{ env "A" }}'
    assert render_services(text, {"x.head": [("h", 1)]}, {"A": "a"}) == "H=h:1 a"


@pytest.mark.parametrize(
    "text",
    [
        '{{ range service "a" }}{{ .Name }}{{ end }}',
        '{{ range service "a" }}{{ .Address }}',
        '{{ key "x" }}',
        "{{ if $i }}x{{ end }}",
    ],
)
def test_what_the_stand_in_cannot_render_is_refused(text: str) -> None:
    with pytest.raises(ServiceTemplateError):
        render_services(text, {"a": [("h", 1)]}, {})
