"""Reading numbers out of JSON that Nomad or the admin API sent, where a field may be missing,
null or of another type: it reads as 0, so one odd record cannot fail a whole pass or table."""

from __future__ import annotations

from typing import Any


def as_int(value: Any) -> int:
    try:
        return int(value or 0)
    except (TypeError, ValueError):
        return 0
