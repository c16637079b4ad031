"""The bounded JSON reader refuses exactly what nests too deep, at the limit and on random
values, however the nesting mixes objects and arrays."""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nomad_driver.safeload import MAX_DEPTH, LoadError, json_loads


def nesting(value: Any) -> int:
    """Depth as the reader counts it, by plain recursion (fine for the small values here)."""
    if isinstance(value, dict):
        return 1 + max((nesting(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((nesting(v) for v in value), default=0)
    return 0


values = st.recursive(
    st.none() | st.integers(-(10**6), 10**6) | st.text(alphabet='[]{}"\\ab', max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=40,
)


@settings(max_examples=300, deadline=None)
@given(values, st.integers(1, 8))
def test_a_value_is_refused_exactly_when_it_nests_past_the_limit(value: Any, limit: int) -> None:
    text = json.dumps(value)
    if nesting(value) > limit:
        with pytest.raises(LoadError, match=f"nested deeper than {limit} levels"):
            json_loads(text, "t", max_depth=limit)
    else:
        assert json_loads(text, "t", max_depth=limit) == value


@pytest.mark.parametrize("opener", ["[", '{"k":'])
def test_the_limit_itself_is_read_and_one_more_level_is_not(opener: str) -> None:
    closer = "]" if opener == "[" else "}"
    assert json_loads(opener * MAX_DEPTH + "1" + closer * MAX_DEPTH, "t") is not None
    with pytest.raises(LoadError, match="nested deeper than 64 levels"):
        json_loads(opener * (MAX_DEPTH + 1) + "1" + closer * (MAX_DEPTH + 1), "t")
