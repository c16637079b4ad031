"""The PromQL reader the end-to-end query check relies on (tests/e2e/promql.py): it must find
every selector and every grouping label, in the right scope, and be fooled by nothing that
only looks like syntax. If it missed one, a renamed metric or label would pass that check."""

from __future__ import annotations

import pytest

from tests.e2e import promql
from tests.e2e.test_where_operators_look import dashboard_queries, rule_queries


def names(expr: str) -> list[str]:
    return [s.name for s in promql.read(expr).selectors]


def groupings(expr: str) -> list[tuple[str, list[str]]]:
    """Each grouping clause with the names of the selectors its labels are checked against."""
    return [(g.clause, [s.name for s in g.selectors]) for g in promql.read(expr).groupings]


def test_every_shipped_query_reads_and_names_only_llmgw_series() -> None:
    for where, expr in rule_queries() + dashboard_queries():
        reading = promql.read(expr)
        assert reading.selectors, (where, expr)
        assert all(s.name.startswith("llmgw_") for s in reading.selectors), (where, reading.selectors)


def test_the_request_panel_groups_by_model_and_code_of_the_router_counter() -> None:
    expr = 'sum by (model, code) (rate(llmgw_router_requests_total{model=~"a|b"}[1m]))'
    (selector,) = promql.read(expr).selectors
    assert selector.text == 'llmgw_router_requests_total{model=~"a|b"}'
    assert selector.labels == ("model",)
    assert groupings(expr) == [("by (model, code)", ["llmgw_router_requests_total"])]


def test_a_grouping_after_the_arguments_counts_too() -> None:
    expr = "histogram_quantile(0.95, sum(rate(x_bucket[5m])) by (le))"
    assert groupings(expr) == [("by (le)", ["x_bucket"])]


def test_each_aggregation_is_checked_against_its_own_series() -> None:
    expr = "count(max by (model) (a) > 0 and max without (instance) (b) == 0) or vector(0)"
    assert names(expr) == ["a", "b"]
    assert groupings(expr) == [("by (model)", ["a"]), ("without (instance)", ["b"])]


def test_vector_matching_labels_are_checked_against_both_operands() -> None:
    expr = "(a / on (instance) group_left (path) b offset 5m) > bool 1"
    assert groupings(expr) == [("on (instance)", ["a", "b"]), ("group_left (path)", ["a", "b"])]
    assert groupings("a and ignoring(le) b") == [("ignoring (le)", ["a", "b"])]
    assert groupings("a * on() group_left b") == []  # nothing named, nothing to check


def test_every_metric_name_is_a_selector_not_only_llmgw_ones() -> None:
    assert names("sum by (job) (up) + node:cpu:rate5m{mode!=''}") == ["up", "node:cpu:rate5m"]
    assert names('{__name__="process_cpu_seconds_total", job!=""}') == ["process_cpu_seconds_total"]
    assert names('{__name__=~"llmgw_.*"}') == [""]


def test_functions_keywords_and_numbers_are_not_selectors() -> None:
    expr = "llmgw_x - time() < 14 * 86400 and absent(y) or vector(0x1f) unless z > Inf + 1e3 - .5"
    assert names(expr) == ["llmgw_x", "y", "z"]
    assert names("sum") == ["sum"]  # a metric that happens to share an aggregation's name


def test_ranges_subqueries_offsets_and_at_are_read_past() -> None:
    expr = "max_over_time(rate(a[5m] offset -1h30m)[1h:1m] @ start()) + b @ 1609746000"
    assert names(expr) == ["a", "b"]


def test_text_inside_strings_and_comments_is_not_syntax() -> None:
    expr = 'sum by (model) (x{path="a}b by (c)", model!~"{y}"}) # by (commented) z\n+ w'
    reading = promql.read(expr)
    assert [s.name for s in reading.selectors] == ["x", "w"]
    assert reading.selectors[0].labels == ("path", "model")
    assert groupings(expr) == [("by (model)", ["x"])]


def test_a_matcher_asking_for_absence_names_no_label() -> None:
    (selector,) = promql.read('x{a="", b="1", c!=""}').selectors
    assert selector.labels == ("b", "c")


def test_labels_that_functions_create_are_counted_as_present() -> None:
    expr = 'sum by (dst) (label_replace(up, "dst", "$1", "instance", "(.*)"))'
    (grouping,) = promql.read(expr).groupings
    assert grouping.made == {"dst"}
    (outer, inner) = promql.read('max by (v) (count_values("v", sum by (job) (up)))').groupings[::-1]
    assert outer.clause == "by (v)" and outer.made == {"v"}
    assert inner.clause == "by (job)" and inner.made == frozenset()


@pytest.mark.parametrize(
    ("expr", "says"),
    [
        ("sum(x", "expression ends where"),
        ("x)", "unbalanced"),
        ("x{a=b}", "a quoted label value was expected"),
        ('x{a~"b"}', "unexpected '~'"),
        ("by (a) x", "'by' out of place"),
        ('x{a="b"', "expression ends where"),
        ("sum by (a) (x) by (b)", "a second grouping clause at 15"),
        ("sum by (a) by (b) (x)", r"expected .\(. at 11"),
        ("rate(x) 5m", "a duration outside a range or offset"),
        ("", "an empty expression"),
    ],
)
def test_what_it_cannot_read_is_an_error_naming_the_place(expr: str, says: str) -> None:
    with pytest.raises(promql.PromQLError, match=says):
        promql.read(expr)
