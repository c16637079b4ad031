"""Unit-aware attribute values and version constraints, as Nomad compares them.

Device constraints compare typed attributes (`plugins/shared/structs/attribute.go`, `units.go`):
`${device.attr.memory} >= 80 GiB` must hold against `{"Int": 81559, "Unit": "MiB"}` because both
units share the byte base. Node constraints with `version` and `semver` follow hashicorp/go-version
and Nomad's `helper/constraints/semver`. Getting any of these subtly wrong makes the stand-in place
a model where Nomad would refuse it (or the reverse), which is exactly the class of surprise the
stand-in exists to remove.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation
from functools import lru_cache
from typing import Any

Json = dict[str, Any]

# Base units: values are comparable only within one base (bytes never compare with watts).
_BYTE, _BYTE_RATE, _HERTZ, _WATT = "byte", "byte/s", "hertz", "watt"


@dataclass(frozen=True, slots=True)
class Unit:
    name: str
    base: str
    multiplier: int
    inverse: bool = False


def _units() -> dict[str, Unit]:
    table: list[Unit] = []
    for i, name in enumerate(("KiB", "MiB", "GiB", "TiB", "PiB", "EiB"), start=1):
        table.append(Unit(name, _BYTE, 1 << (10 * i)))
        table.append(Unit(name + "/s", _BYTE_RATE, 1 << (10 * i)))
    for i, name in enumerate(("kB", "MB", "GB", "TB", "PB", "EB"), start=1):
        table.append(Unit(name, _BYTE, 1000**i))
        table.append(Unit(name + "/s", _BYTE_RATE, 1000**i))
    table.append(Unit("KB", _BYTE, 1000))
    table.append(Unit("KB/s", _BYTE_RATE, 1000))
    # Nomad's own table: MHz is 1000**1 and GHz 1000**3 (sic). Kept as is, so a comparison
    # between the two behaves here exactly as it does on a real cluster.
    table.append(Unit("MHz", _HERTZ, 1000))
    table.append(Unit("GHz", _HERTZ, 1000**3))
    table.append(Unit("mW", _WATT, 1000, inverse=True))
    table.append(Unit("W", _WATT, 1))
    table.append(Unit("kW", _WATT, 1000))
    table.append(Unit("MW", _WATT, 1000**2))
    table.append(Unit("GW", _WATT, 1000**3))
    return {u.name: u for u in table}


UNITS: dict[str, Unit] = _units()
# Suffix matching tries the longest unit first, so "MiB/s" is never read as "s".
_BY_LENGTH = sorted(UNITS, key=len, reverse=True)


@dataclass(frozen=True, slots=True)
class Attribute:
    """Nomad's `psstructs.Attribute`: exactly one of int, float, string, bool, plus an optional
    unit on numbers."""

    int_: int | None = None
    float_: float | None = None
    string: str | None = None
    bool_: bool | None = None
    unit: str = ""

    def to_json(self) -> Json:
        out: Json = {}
        if self.float_ is not None:
            out["Float"] = self.float_
        if self.int_ is not None:
            out["Int"] = self.int_
        if self.string is not None:
            out["String"] = self.string
        if self.bool_ is not None:
            out["Bool"] = self.bool_
        if self.unit:
            out["Unit"] = self.unit
        return out

    def __str__(self) -> str:
        for v in (self.float_, self.int_, self.bool_, self.string):
            if v is not None:
                text = str(v).lower() if isinstance(v, bool) else str(v)
                return text + self.unit
        return ""


def string_attr(s: str) -> Attribute:
    return Attribute(string=s)


def int_attr(i: int, unit: str = "") -> Attribute:
    return Attribute(int_=i, unit=unit)


def attribute_from_json(raw: Any, where: str = "attribute") -> Attribute:
    """Read Nomad's Attribute JSON (`{"Int": 81559, "Unit": "MiB"}`); null value keys are
    ignored, as the server emits them."""
    if not isinstance(raw, dict):
        raise ValueError(f"{where}: expected an object like {{'Int': 1, 'Unit': 'MiB'}}, got {raw!r}")
    unit = raw.get("Unit") or ""
    if unit and unit not in UNITS:
        raise ValueError(f"{where}: unknown unit {unit!r}")
    values = {k: raw.get(k) for k in ("Int", "Float", "String", "Bool") if raw.get(k) is not None}
    if len(values) != 1:
        raise ValueError(f"{where}: exactly one of Int, Float, String, Bool must be set, got {raw!r}")
    ((key, value),) = values.items()
    if key == "Int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where}: Int must be an integer, got {value!r}")
        return Attribute(int_=value, unit=unit)
    if key == "Float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where}: Float must be a number, got {value!r}")
        return Attribute(float_=float(value), unit=unit)
    if unit:
        raise ValueError(f"{where}: a unit can not be given on a string or boolean")
    if key == "String":
        return Attribute(string=str(value))
    return Attribute(bool_=bool(value))


_GO_INT = re.compile(r"[+-]?[0-9]+\Z")
_GO_FLOAT = re.compile(
    r"[+-]?(?:[0-9]+\.?[0-9]*(?:[eE][+-]?[0-9]+)?|\.[0-9]+(?:[eE][+-]?[0-9]+)?|inf|infinity|nan)\Z", re.I
)
_GO_BOOL = {"1": True, "t": True, "T": True, "TRUE": True, "true": True, "True": True,
            "0": False, "f": False, "F": False, "FALSE": False, "false": False, "False": False}  # fmt: skip


def parse_go_bool(s: str) -> bool | None:
    """strconv.ParseBool: the only spellings Go accepts, None for anything else."""
    return _GO_BOOL.get(s)


@lru_cache(maxsize=4096)
def parse_attribute(text: str) -> Attribute:
    """`psstructs.ParseAttribute`: a literal in a device constraint, e.g. "80 GiB" -> Int 80 GiB,
    "1.5" -> Float, "true" -> Bool, anything else a string."""
    if not text:
        return Attribute(string=text)
    unit = ""
    numeric = text
    if text[-1].isalpha():
        for name in _BY_LENGTH:
            if text.endswith(name):
                unit = name
                numeric = text[: -len(name)].strip()
                break
    if _GO_INT.match(numeric):
        value = int(numeric)
        if -(1 << 63) <= value < (1 << 63):
            return Attribute(int_=value, unit=unit)
    if _GO_FLOAT.match(numeric):
        return Attribute(float_=float(numeric), unit=unit)
    as_bool = parse_go_bool(text)
    if as_bool is not None:
        return Attribute(bool_=as_bool)
    return Attribute(string=text)


def _comparable(a: Attribute, b: Attribute) -> bool:
    ua, ub = UNITS.get(a.unit), UNITS.get(b.unit)
    if ua is not None and ub is not None:
        return ua.base == ub.base
    if (ua is None) != (ub is None):
        return False
    if a.string is not None:
        return b.string is not None
    if a.bool_ is not None:
        return b.bool_ is not None
    return True


def _in_base(a: Attribute) -> Decimal | None:
    if a.int_ is not None:
        value = Decimal(a.int_)
    elif a.float_ is not None:
        value = Decimal(a.float_)
    else:
        return None
    unit = UNITS.get(a.unit)
    if unit is None:
        return value
    return value / unit.multiplier if unit.inverse else value * unit.multiplier


def compare(a: Attribute, b: Attribute) -> int | None:
    """`Attribute.Compare`: -1, 0 or 1, or None when the two cannot be compared (different
    types, or units without a common base). Booleans give 0 when equal and 1 otherwise."""
    if not _comparable(a, b):
        return None
    if a.bool_ is not None:
        return 0 if a.bool_ == b.bool_ else 1
    if a.string is not None:
        assert b.string is not None
        return (a.string > b.string) - (a.string < b.string)
    if a.int_ is None and a.float_ is None:
        return None
    left, right = _in_base(a), _in_base(b)
    if left is None or right is None:
        return None
    try:
        return (left > right) - (left < right)
    except InvalidOperation:
        return None


# ----- versions: hashicorp/go-version and Nomad's semver constraints ------------------------

_VERSION_CORE = r"v?([0-9]+(\.[0-9]+)*?)"
_META = r"(\+([0-9A-Za-z\-~]+(\.[0-9A-Za-z\-~]+)*))?"
_LOOSE = (
    _VERSION_CORE
    + r"(-([0-9]+[0-9A-Za-z\-~]*(\.[0-9A-Za-z\-~]+)*)|(-?([A-Za-z\-~]+[0-9A-Za-z\-~]*(\.[0-9A-Za-z\-~]+)*)))?"
    + _META
    + "?"
)
_STRICT = (
    _VERSION_CORE
    + r"(-([0-9]+[0-9A-Za-z\-~]*(\.[0-9A-Za-z\-~]+)*)|(-([A-Za-z\-~]+[0-9A-Za-z\-~]*(\.[0-9A-Za-z\-~]+)*)))?"
    + _META
    + "?"
)
_LOOSE_RE = re.compile(f"^{_LOOSE}$")
_STRICT_RE = re.compile(f"^{_STRICT}$")
_LOOSE_CONSTRAINT = re.compile(rf"^\s*(~>|>=|<=|!=|=|>|<|)\s*({_LOOSE})\s*$")
_STRICT_CONSTRAINT = re.compile(rf"^\s*(>=|<=|!=|=|>|<|)\s*({_STRICT})\s*$")


@dataclass(frozen=True, slots=True)
class Version:
    segments: tuple[int, ...]
    pre: str
    metadata: str
    given: int  # how many segments were written; the pessimistic operator needs it

    def canonical(self) -> str:
        text = ".".join(str(s) for s in self.segments)
        if self.pre:
            text += "-" + self.pre
        if self.metadata:
            text += "+" + self.metadata
        return text


def parse_version(text: str, strict: bool = False) -> Version | None:
    """`version.NewVersion` (strict=False) or `version.NewSemver` (strict=True)."""
    m = (_STRICT_RE if strict else _LOOSE_RE).match(text)
    if m is None:
        return None
    parts = m.group(1).split(".")
    segments = [int(p) for p in parts]
    if any(s >= 1 << 63 for s in segments):
        return None
    while len(segments) < 3:
        segments.append(0)
    pre = m.group(7) or m.group(4) or ""
    return Version(tuple(segments), pre, m.group(10) or "", len(parts))


def _compare_part(a: str, b: str) -> int:
    if a == b:
        return 0
    a_num, b_num = a.isdigit(), b.isdigit()
    if a == "":
        return -1 if b_num else 1
    if b == "":
        return 1 if a_num else -1
    if a_num and not b_num:
        return -1
    if b_num and not a_num:
        return 1
    if not a_num and not b_num:
        return 1 if a > b else -1
    return 1 if int(a) > int(b) else -1


def _compare_pre(a: str, b: str) -> int:
    if a == b:
        return 0
    left, right = a.split("."), b.split(".")
    for i in range(max(len(left), len(right))):
        c = _compare_part(left[i] if i < len(left) else "", right[i] if i < len(right) else "")
        if c:
            return c
    return 0


def compare_versions(a: Version, b: Version) -> int:
    """`Version.Compare`: metadata never matters; a prerelease sorts before its release."""
    if a.canonical() == b.canonical():
        return 0
    if a.segments == b.segments:
        if not a.pre and not b.pre:
            return 0
        if not a.pre:
            return 1
        if not b.pre:
            return -1
        return _compare_pre(a.pre, b.pre)
    width = max(len(a.segments), len(b.segments))
    left = a.segments + (0,) * (width - len(a.segments))
    right = b.segments + (0,) * (width - len(b.segments))
    return (left > right) - (left < right)


def _prerelease_ok(v: Version, c: Version) -> bool:
    if c.pre and v.pre:
        return v.segments == c.segments
    return not (v.pre and not c.pre)


def _pessimistic(v: Version, c: Version) -> bool:
    if not _prerelease_ok(v, c) or (c.pre and not v.pre):
        return False
    if compare_versions(v, c) < 0:
        return False
    n = len(c.segments)
    if n > len(v.segments):
        return False
    if any(v.segments[i] != c.segments[i] for i in range(c.given - 1)):
        return False
    return c.segments[n - 1] <= v.segments[n - 1]


def _check_one(op: str, v: Version, c: Version, strict: bool) -> bool:
    cmp = compare_versions(v, c)
    if op in ("", "="):
        return cmp == 0
    if op == "!=":
        return cmp != 0
    if op == "~>":
        return _pessimistic(v, c)
    # go-version refuses to order a prerelease against a release constraint; Nomad's semver
    # operator uses plain Semver 2.0 ordering instead.
    if not strict and not _prerelease_ok(v, c):
        return False
    return {">": cmp == 1, "<": cmp == -1, ">=": cmp >= 0, "<=": cmp <= 0}[op]


@lru_cache(maxsize=1024)
def parse_version_constraint(text: str, strict: bool) -> tuple[tuple[str, Version], ...] | None:
    """A comma-separated list such as ">= 1.2, < 2.0"; None when any part is malformed, which
    makes the constraint unsatisfiable, as in Nomad."""
    pattern = _STRICT_CONSTRAINT if strict else _LOOSE_CONSTRAINT
    out: list[tuple[str, Version]] = []
    for single in text.split(","):
        m = pattern.match(single)
        if m is None:
            return None
        version = parse_version(m.group(2), strict=strict)
        if version is None:
            return None
        out.append((m.group(1), version))
    return tuple(out)


def version_matches(value: str, constraint: str, strict: bool) -> bool:
    """Nomad's `version` (strict=False) and `semver` (strict=True) operators. The left side is
    always parsed leniently (`version.NewVersion`), as Nomad does for both."""
    version = parse_version(value, strict=False)
    checks = parse_version_constraint(constraint, strict)
    if version is None or checks is None:
        return False
    return all(_check_one(op, version, c, strict) for op, c in checks)
