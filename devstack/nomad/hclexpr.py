"""HCL2 expressions in jobspecs, as far as the stand-in's parser evaluates them.

python-hcl2 hands an expression over as its source text (`${var.a == "" ? [] : ["x"]}`); this
evaluates the subset llmgw's jobspecs use: `var.x`, string templates over variables, numbers,
booleans, list literals, `coalesce()`, `concat()`, and the conditional `A == B ? X : Y` (or `!=`), which is
how a job mounts or sets something only when a variable is given. Anything else is an error
that names the expression, never a guess.
"""

from __future__ import annotations

import re
from typing import Any


class JobspecError(ValueError):
    pass


_VAR_REF = re.compile(r"\$\{var\.([A-Za-z0-9_-]+)\}")


def _top_level(text: str, targets: str) -> list[tuple[int, str]]:
    """Positions of `targets` characters outside strings and brackets."""
    found: list[tuple[int, str]] = []
    depth, quoted, escaped = 0, False, False
    for i, ch in enumerate(text):
        if quoted:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                quoted = False
            continue
        if ch == '"':
            quoted = True
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif depth == 0 and ch in targets:
            found.append((i, ch))
    return found


class Evaluator:
    def __init__(self, variables: dict[str, Any]) -> None:
        self.variables = variables

    def var(self, name: str, where: str) -> Any:
        if name not in self.variables:
            raise JobspecError(f"{where}: unknown variable var.{name}")
        return self.variables[name]

    def _split_args(self, text: str) -> list[str]:
        cuts = [i for i, _ in _top_level(text, ",")]
        parts, last = [], 0
        for cut in cuts:
            parts.append(text[last:cut].strip())
            last = cut + 1
        if text[last:].strip():
            parts.append(text[last:].strip())
        return parts

    def _conditional(self, expr: str, where: str) -> tuple[bool, Any] | None:
        marks = _top_level(expr, "?:")
        question = next((i for i, ch in marks if ch == "?"), None)
        if question is None:
            return None
        colon = next((i for i, ch in marks if ch == ":" and i > question), None)
        if colon is None:
            raise JobspecError(f"{where}: conditional {expr!r} has no ':'")
        condition = expr[:question].strip()
        match = re.fullmatch(r"(.+?)\s*(==|!=)\s*(.+)", condition, re.S)
        if match is None:
            raise JobspecError(
                f"{where}: condition {condition!r} is outside what the stand-in's parser supports"
            )
        left = self.expression(match.group(1), where)
        right = self.expression(match.group(3), where)
        holds = (left == right) == (match.group(2) == "==")
        # Only the branch taken is evaluated, as in HCL: the other may name what is not set.
        chosen = expr[question + 1 : colon] if holds else expr[colon + 1 :]
        return True, self.expression(chosen, where)

    def expression(self, expr: str, where: str) -> Any:
        expr = expr.strip()
        conditional = self._conditional(expr, where)
        if conditional is not None:
            return conditional[1]
        if expr.startswith("var."):
            return self.var(expr[4:], where)
        if expr.startswith('"') and expr.endswith('"'):
            return self.template(expr[1:-1], where)
        if expr.startswith("[") and expr.endswith("]"):
            return [self.expression(item, where) for item in self._split_args(expr[1:-1])]
        match = re.fullmatch(r"concat\((.*)\)", expr, re.S)
        if match:
            joined: list[Any] = []
            for arg in self._split_args(match.group(1)):
                value = self.expression(arg, where)
                if not isinstance(value, list):
                    raise JobspecError(f"{where}: concat() takes lists, got {value!r}")
                joined.extend(value)
            return joined
        match = re.fullmatch(r"coalesce\((.*)\)", expr, re.S)
        if match:
            for arg in self._split_args(match.group(1)):
                value = self.expression(arg, where)
                if value not in (None, ""):
                    return value
            raise JobspecError(f"{where}: coalesce() got only empty values")
        if re.fullmatch(r"-?\d+", expr):
            return int(expr)
        if expr in ("true", "false"):
            return expr == "true"
        raise JobspecError(f"{where}: expression {expr!r} is outside what the stand-in's parser supports")

    def template(self, text: str, where: str) -> str:
        text = _VAR_REF.sub(lambda m: str(self.var(m.group(1), where)), text)
        return text.replace("$${", "${").replace('\\"', '"')

    def value(self, raw: Any, where: str) -> Any:
        if isinstance(raw, list):
            return [self.value(item, where) for item in raw]
        if isinstance(raw, dict):
            return {
                self.label(k): self.value(v, f"{where}.{self.label(k)}")
                for k, v in raw.items()
                if not k.startswith("__")
            }
        if not isinstance(raw, str):
            return raw
        if raw.startswith('"') and raw.endswith('"') and len(raw) >= 2:
            raw = raw[1:-1]
            if not raw.startswith("<<"):
                return self.template(raw, where)
        if raw.startswith("${") and raw.endswith("}"):
            return self.expression(raw[2:-1], where)
        if raw.startswith("<<"):
            # A heredoc: python-hcl2 keeps the marker lines; `<<-` strips the common indent.
            lines = raw.splitlines()[1:-1]
            indent = min((len(line) - len(line.lstrip()) for line in lines if line.strip()), default=0)
            return self.template("\n".join(line[indent:] for line in lines) + "\n", where)
        return raw

    @staticmethod
    def label(key: str) -> str:
        return key[1:-1] if key.startswith('"') and key.endswith('"') else key
