"""Validate a parsed manifest and turn pydantic's errors into messages a user can act on.

Every problem reads ``<dotted.path>: <what is allowed> (got <value>)``, list items as
``precision.include_modules[2]``, with ``[line N]`` when the YAML file has that key. One
problem gives one line, ``<file>: <problem>``; several give ``<file>: N problems`` and then
one indented problem per line.
"""

from __future__ import annotations

import datetime
import difflib
import json
import math
import types
import typing
from collections.abc import Mapping
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from fp8ops.errors import ManifestError
from fp8ops.manifest.base import SECRET
from fp8ops.manifest.schema import Manifest
from fp8ops.manifest.yaml_io import Loc, load_yaml_value

_EXPECTED = {
    "int_type": "an integer",
    "float_type": "a number",
    "string_type": "a string",
    "bool_type": "true or false",
    "model_type": "a mapping",
    "dict_type": "a mapping",
    "tuple_type": "a list",
    "list_type": "a list",
}
_COMPARISONS = {
    "greater_than": ">",
    "greater_than_equal": ">=",
    "less_than": "<",
    "less_than_equal": "<=",
}


def validate_manifest(data: Any, source: str, lines: Mapping[Loc, int] | None = None) -> Manifest:
    """``Manifest.model_validate(data)``, raising ``ManifestError`` with every problem."""
    try:
        return Manifest.model_validate(data)
    except ValidationError as exc:
        problems = [describe_error(error, lines or {}) for error in exc.errors(include_url=False)]
        raise ManifestError(format_problems(source, problems)) from None


def format_problems(source: str, problems: list[str]) -> str:
    if len(problems) == 1:
        return f"{source}: {problems[0]}"
    return "\n".join([f"{source}: {len(problems)} problems", *(f"  {p}" for p in problems)])


def dotted(loc: Loc) -> str:
    """``("precision", "include_modules", 2)`` -> ``precision.include_modules[2]``."""
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def describe_error(error: Mapping[str, Any], lines: Mapping[Loc, int]) -> str:
    """One pydantic error dict (``type``, ``loc``, ``input``, ``msg``, ``ctx``) as one line."""
    kind, loc, value = error["type"], tuple(error["loc"]), error.get("input")
    ctx = error.get("ctx") or {}
    got = f" (got {yaml_value(value)})"

    if kind == "missing":
        text, got = "required field missing", ""
    elif kind == "extra_forbidden":
        allowed = sorted(_model_at(loc[:-1]).model_fields)
        close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        text, got = f"unknown key{hint}; allowed here: {', '.join(allowed)}", ""
    elif kind == "invalid_key":  # loc ends with the offending key itself
        loc, text = loc[:-1], "keys must be strings"
        got = f" (got {yaml_type(value)} key {yaml_value(value)})"
    elif kind in _EXPECTED:
        expected = _EXPECTED[kind] + (" or null" if _nullable(loc) else "")
        text = f"must be {expected}"
        got = f" (got {yaml_type(value)} {yaml_value(value)}{_unquote_hint(kind, value)})"
        if isinstance(value, (dict, list)):
            got = f" (got a {yaml_type(value)})"
    elif kind == "literal_error":
        text = f"must be {ctx['expected']}"
    elif kind in _COMPARISONS:
        bound = next(iter(ctx.values()))
        text = f"must be {_COMPARISONS[kind]} {_number(bound)}"
    elif kind == "finite_number":
        text = "must be a finite number"
    elif kind in ("too_short", "string_too_short"):
        text = (
            "must not be empty"
            if ctx.get("min_length") == 1
            else f"needs at least {ctx['min_length']} items"
        )
    elif kind in ("value_error", "assertion_error"):
        text = str(ctx.get("error", error["msg"]))
    else:  # our own rules ("manifest_rule") and anything pydantic adds later
        text = error["msg"]
    if kind == "value_error" and isinstance(value, str) and repr(value) in text:
        got = ""  # the validator already quoted the value
    if kind == SECRET:
        got = ""  # a webhook URL or credentials: not repeated into logs

    line = lines.get(loc)
    where = f" [line {line}]" if line else ""
    return f"{dotted(loc) or '(top level)'}: {text}{got}{where}"


def yaml_type(value: Any) -> str:
    """The YAML name of a parsed value's type."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "string"
    if isinstance(value, (list, tuple)):
        return "list"
    if isinstance(value, dict):
        return "mapping"
    if isinstance(value, (datetime.date, datetime.datetime)):
        return "date"
    return type(value).__name__


def yaml_value(value: Any, limit: int | None = 60) -> str:
    """A short YAML-ish rendering: strings quoted, null/true/false spelt as in YAML."""
    if isinstance(value, str):
        text = repr(value)
    elif isinstance(value, (datetime.date, datetime.datetime)):
        text = value.isoformat()
    elif isinstance(value, float) and not math.isfinite(value):
        text = ".nan" if math.isnan(value) else (".inf" if value > 0 else "-.inf")
    else:
        try:
            text = json.dumps(value, default=str, ensure_ascii=False)
        except ValueError:  # a YAML alias that contains itself
            text = f"a recursive {yaml_type(value)}"
    return text if limit is None or len(text) <= limit else text[: limit - 3] + "..."


def _number(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _unquote_hint(kind: str, value: Any) -> str:
    """'16' for an integer is a quoting slip; say so."""
    if not isinstance(value, str):
        return ""
    try:
        parsed = load_yaml_value(value)
    except yaml.YAMLError:
        return ""
    fits = {
        "int_type": isinstance(parsed, int) and not isinstance(parsed, bool),
        "float_type": isinstance(parsed, (int, float)) and not isinstance(parsed, bool),
        "bool_type": isinstance(parsed, bool),
    }.get(kind, False)
    return "; write it without quotes" if fits else ""


# --------------------------------------------------------------------------------------
# Reading the schema at an error's location
# --------------------------------------------------------------------------------------


def _annotation_at(loc: Loc) -> Any:
    """The type annotation of the field at ``loc`` (None where the path leaves the schema)."""
    annotation: Any = Manifest
    for part in loc:
        annotation = _strip(annotation)
        if isinstance(part, int):
            args = typing.get_args(annotation)
            annotation = args[0] if args else None
        elif isinstance(annotation, type) and issubclass(annotation, BaseModel):
            field = annotation.model_fields.get(part)
            annotation = field.annotation if field else None
        else:
            return None
    return annotation


def _model_at(loc: Loc) -> type[BaseModel]:
    annotation = _strip(_annotation_at(loc))
    return (
        annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel)
        else Manifest
    )


def _nullable(loc: Loc) -> bool:
    annotation = _annotation_at(loc)
    return _is_union(annotation) and type(None) in typing.get_args(annotation)


def _strip(annotation: Any) -> Any:
    """Remove Annotated[...] and Optional[...] wrappers."""
    while True:
        if typing.get_origin(annotation) is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
        elif _is_union(annotation):
            members = [a for a in typing.get_args(annotation) if a is not type(None)]
            if len(members) != 1:
                return annotation
            annotation = members[0]
        else:
            return annotation


def _is_union(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (typing.Union, types.UnionType)
