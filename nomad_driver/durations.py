"""Durations as a models file and the stand-in's flags write them: `90`, "90", "30s", "15m",
"1h30m", "500ms"; positive and at most a year, since Nomad reads them as Go int64 and no idle
or activation timeout an operator means is longer."""

from __future__ import annotations

import re

MAX_DURATION_S = 365 * 24 * 3600.0

_DURATION_PART = re.compile(r"(\d{1,12}(?:\.\d{1,9})?)(ms|s|m|h)")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(value: object) -> float:
    """Seconds from `90`, "90", "30s", "15m", "1h", "1h30m", "500ms"."""
    if isinstance(value, bool):
        raise ValueError
    if isinstance(value, int):
        # float() of a 400-digit integer raises OverflowError, not ValueError.
        if abs(value) > MAX_DURATION_S:
            raise ValueError
        seconds = float(value)
    elif isinstance(value, float):
        seconds = value
    elif isinstance(value, str):
        text = value.strip()
        if re.fullmatch(r"\d{1,12}(?:\.\d{1,9})?", text):
            seconds = float(text)
        else:
            parts = list(_DURATION_PART.finditer(text))
            if not parts or "".join(p.group(0) for p in parts) != text:
                raise ValueError
            seconds = sum(float(p.group(1)) * _DURATION_UNITS[p.group(2)] for p in parts)
    else:
        raise ValueError
    # `not <=` so that NaN, which compares false with everything, is refused too.
    if not 0 < seconds <= MAX_DURATION_S:
        raise ValueError
    return seconds
