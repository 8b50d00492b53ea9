"""Read a manifest file: bytes -> text -> YAML -> ``Manifest``, with a precise error at each step.

Every failure is a ``ManifestError`` that names the file; see ``messages.py`` for the form of
field-level messages.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from fp8ops.errors import ManifestError
from fp8ops.manifest.messages import dotted, format_problems, validate_manifest, yaml_type
from fp8ops.manifest.schema import Manifest
from fp8ops.manifest.yaml_io import (
    AliasExpansionError,
    DuplicateKeyError,
    Loc,
    ManifestLoader,
    key_lines,
)


def load_manifest(path: str | Path) -> Manifest:
    """Read and validate the manifest at ``path``."""
    path = Path(path)
    source = str(path)
    if not path.exists():
        raise ManifestError(f"{source}: no such file")
    if path.is_dir():
        raise ManifestError(f"{source}: is a directory, not a manifest file")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ManifestError(f"{source}: cannot read: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8-sig")  # -sig: tolerate a byte-order mark from Windows editors
    except UnicodeDecodeError as exc:
        raise ManifestError(
            f"{source}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at offset {exc.start})"
        ) from None
    return parse_manifest(text, source)


def parse_manifest(text: str, source: str) -> Manifest:
    """Validate manifest YAML ``text``; ``source`` names it in messages (usually the path)."""
    data, lines = parse_yaml(text, source)
    if data is None:
        required = [name for name, field in Manifest.model_fields.items() if field.is_required()]
        raise ManifestError(f"{source}: empty manifest; it needs at least {', '.join(required)}")
    if not isinstance(data, dict):
        raise ManifestError(
            f"{source}: the top level must be a mapping of sections (got a {yaml_type(data)})"
        )
    return validate_manifest(data, source, lines)


def parse_yaml(text: str, source: str) -> tuple[Any, dict[Loc, int]]:
    """YAML text -> (Python data, {key path: line number}), or ``ManifestError``."""
    loader = ManifestLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, {}
        lines = key_lines(node)
        return loader.construct_document(node), lines
    except DuplicateKeyError as exc:
        problems = [
            f"{dotted(path)}: duplicate key (first at line {first}) [line {line}]"
            for path, first, line in exc.duplicates
        ]
        raise ManifestError(format_problems(source, problems)) from None
    except AliasExpansionError as exc:
        raise ManifestError(f"{source}: {exc}") from None
    except yaml.MarkedYAMLError as exc:
        raise ManifestError(f"{source}: {_syntax_error(exc)}") from None
    except yaml.YAMLError as exc:  # ReaderError: control characters and the like
        raise ManifestError(f"{source}: YAML error: {exc}") from None
    finally:
        loader.dispose()


def _syntax_error(exc: yaml.MarkedYAMLError) -> str:
    mark = exc.problem_mark or exc.context_mark
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
    problem = exc.problem or exc.context or "invalid YAML"
    context = ""
    if exc.context and exc.problem and exc.context_mark:
        context = f" ({exc.context} at line {exc.context_mark.line + 1})"
    return f"{where}YAML syntax error: {problem}{context}"
