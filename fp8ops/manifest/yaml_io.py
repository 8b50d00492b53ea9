"""The YAML dialect manifests are read and written in: safe YAML, minus two traps.

* Duplicate keys are an error. PyYAML silently keeps the last one, so a second ``margin:``
  further down a section would quietly win.
* ``1e-5`` is a float, as in YAML 1.2. PyYAML (YAML 1.1) wants a dot (``1.0e-5``) and would
  otherwise hand the schema the string "1e-5". The dumper knows the rule too, so it quotes
  a string that looks like such a float.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import yaml

Loc = tuple[str | int, ...]

_MERGE_KEY = "<<"


class DuplicateKeyError(yaml.YAMLError):
    """A mapping repeats a key. ``duplicates`` holds ``(key path, first line, repeat line)``."""

    def __init__(self, duplicates: list[tuple[Loc, int, int]]):
        super().__init__(
            "; ".join(f"{'.'.join(map(str, p))} at line {line}" for p, _, line in duplicates)
        )
        self.duplicates = duplicates


class ManifestLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys (with their lines) and reads ``1e-5`` as a float."""

    def construct_document(self, node: yaml.Node) -> Any:
        duplicates = duplicate_keys(node)
        if duplicates:
            raise DuplicateKeyError(duplicates)
        return super().construct_document(node)


class ManifestDumper(yaml.SafeDumper):
    """SafeDumper that quotes strings ``ManifestLoader`` would read as floats."""


# YAML 1.2 floats without a dot: 1e-5, 3E+2. PyYAML's own float rule still handles the rest.
_EXPONENT_FLOAT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$")
for _cls in (ManifestLoader, ManifestDumper):
    _cls.add_implicit_resolver("tag:yaml.org,2002:float", _EXPONENT_FLOAT, list("-+0123456789."))


def walk(
    node: yaml.Node, path: Loc = (), active: frozenset[int] = frozenset()
) -> Iterator[tuple[Loc, yaml.Node, yaml.Node]]:
    """Yield ``(path, key node, value node)`` for every mapping entry, and ``(path, item,
    item)`` for every list item, depth first, on the composed (not yet constructed) tree."""
    if id(node) in active:  # an alias that contains itself
        return
    active = active | {id(node)}
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            # Merged mappings ("<<: *anchor") were walked where the anchor was defined, and
            # their keys may legitimately be overridden here.
            if isinstance(key, yaml.ScalarNode) and key.value != _MERGE_KEY:
                yield (*path, key.value), key, value
                yield from walk(value, (*path, key.value), active)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            yield (*path, index), item, item
            yield from walk(item, (*path, index), active)


def key_lines(node: yaml.Node) -> dict[Loc, int]:
    """1-based line of every key and list item, by path."""
    return {path: key.start_mark.line + 1 for path, key, _ in walk(node)}


def duplicate_keys(node: yaml.Node) -> list[tuple[Loc, int, int]]:
    """``(key path, first line, repeat line)`` for every repeated key."""
    first_line: dict[Loc, int] = {}
    duplicates = []
    for path, key, value in walk(node):
        if key is value:  # a list item
            continue
        line = key.start_mark.line + 1
        if path in first_line:
            duplicates.append((path, first_line[path], line))
        first_line.setdefault(path, line)
    return duplicates


def load_yaml_value(text: str) -> Any:
    """One YAML value in this dialect (for ``--set path=value``)."""
    return yaml.load(text, Loader=ManifestLoader)
