"""Reading a models file: YAML read strictly (a key given twice is a problem, not the last one
winning), and pydantic's complaints put in the file's own words (`models.m.replicas.max:
expected an integer, got 'two'`), for `spec.parse_models` to collect."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from nomad_driver.safeload import LoadError, compose_yaml, construct_yaml


class SpecError(Exception):
    """One or more problems in a models file, each `path: message`."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


def check_duplicates(node: yaml.Node, path: str, problems: list[str]) -> None:
    """PyYAML keeps the last of two equal keys without a word; a model defined twice would then
    silently lose its first definition, so duplicates are found on the node tree first."""
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = str(key_node.value) if isinstance(key_node, yaml.ScalarNode) else "?"
            line = key_node.start_mark.line + 1
            child = f"{path}.{key}" if path else key
            if key in seen:
                problems.append(f"{child}: duplicate key '{key}' at line {line} (first at line {seen[key]})")
            else:
                seen[key] = line
            check_duplicates(value_node, child, problems)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            check_duplicates(item, f"{path}.{i}" if path else str(i), problems)


def load_yaml(text: str, problems: list[str]) -> Any:
    """The document, with duplicate keys added to `problems` (the rest is still validated, so
    the operator sees every problem in one run)."""
    try:
        # Bounded (see safeload): depth, size, aliases and numbers are checked before the
        # tree is walked, so a YAML bomb is refused in milliseconds instead of hanging.
        node = compose_yaml(text)
        if node is None:
            return None
        check_duplicates(node, "", problems)
        return construct_yaml(node)
    except LoadError as exc:
        raise SpecError([f"(file): not valid YAML: {exc.detail}"]) from None
    except yaml.YAMLError as exc:
        raise SpecError([f"(file): not valid YAML: {yaml_error(exc)}"]) from None


def yaml_error(exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    if mark is not None:
        return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"
    return str(problem)


def describe(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def pydantic_problems(prefix: str, exc: ValidationError, model: type[BaseModel]) -> Iterator[str]:
    for err in exc.errors():
        loc = [str(p) for p in err["loc"]]
        path = ".".join([prefix, *loc])
        kind = err["type"]
        value = err.get("input")
        if kind == "extra_forbidden":
            allowed = allowed_keys(model, loc[:-1])
            yield f"{path}: unknown key '{loc[-1]}' (expected one of: {', '.join(allowed)})"
        elif kind == "missing":
            yield f"{path}: required field is missing"
        elif kind == "literal_error":
            expected = err.get("ctx", {}).get("expected", "")
            yield f"{path}: expected one of {expected}, got {describe(value)}"
        elif kind in ("int_type", "int_parsing", "int_from_float"):
            yield f"{path}: expected an integer, got {describe(value)}"
        elif kind in ("string_type",):
            yield f"{path}: expected a string, got {describe(value)}"
        elif kind in ("list_type",):
            yield f"{path}: expected a list, got {describe(value)}"
        elif kind in ("model_type", "model_attributes_type", "dict_type"):
            yield f"{path}: expected a mapping, got {describe(value)}"
        elif kind in ("greater_than_equal", "less_than_equal", "greater_than", "less_than"):
            if isinstance(value, int) and abs(value) > 10**18:
                value = f"a {len(str(abs(value)))}-digit number"
            yield f"{path}: {err['msg'].lower()}, got {describe(value)}"
        else:
            yield f"{path}: {err['msg']}"


def allowed_keys(model: type[BaseModel], loc: list[str]) -> list[str]:
    current: type[BaseModel] = model
    for part in loc:
        field = current.model_fields.get(part)
        annotation = field.annotation if field else None
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            current = annotation
        else:
            break
    return list(current.model_fields)
