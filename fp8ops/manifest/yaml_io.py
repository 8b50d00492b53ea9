"""The YAML dialect manifests are read and written in: safe YAML, minus three traps.

* Duplicate keys are an error. PyYAML silently keeps the last one, so a second ``margin:``
  further down a section would quietly win.
* ``1e-5`` is a float, as in YAML 1.2. PyYAML (YAML 1.1) wants a dot (``1.0e-5``) and would
  otherwise hand the schema the string "1e-5". The dumper knows the rule too, so it quotes
  a string that looks like such a float.
* Aliases may not expand a document past ``MAX_NODES`` nodes, nor lists and mappings nest
  past ``MAX_DEPTH`` levels. Anchors and merge keys are
  allowed (``<<: *defaults``), but nine anchors of nine aliases each make 9^9 nodes of a small
  file, which every reader of a manifest would walk or validate without end.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import yaml

Loc = tuple[str | int, ...]

_MERGE_KEY = "<<"
# Nodes a document may hold with its aliases expanded. The 8B production manifest has about
# 300; a module list of every projection of a 126-layer model about 600.
MAX_NODES = 100_000
MAX_DEPTH = 100  # nesting levels (a manifest has three or four)


class DuplicateKeyError(yaml.YAMLError):
    """A mapping repeats a key. ``duplicates`` holds ``(key path, first line, repeat line)``."""

    def __init__(self, duplicates: list[tuple[Loc, int, int]]):
        super().__init__(
            "; ".join(f"{'.'.join(map(str, p))} at line {line}" for p, _, line in duplicates)
        )
        self.duplicates = duplicates


class AliasExpansionError(yaml.YAMLError):
    """Aliases expand the document past ``MAX_NODES``; ``path`` and ``line`` name the entry
    (the key or list item) whose value does."""

    def __init__(self, path: Loc, line: int, nodes: int):
        super().__init__(
            f"YAML aliases (*name) expand {'.'.join(map(str, path)) or 'the document'} (line "
            f"{line}) to {nodes:.3g} nodes, more than the {MAX_NODES} a manifest may hold; "
            "write the values out instead of aliasing aliases"
        )
        self.path, self.line, self.nodes = path, line, nodes


class ManifestLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys (with their lines), aliases that expand past
    ``MAX_NODES``, and reads ``1e-5`` as a float."""

    def get_single_node(self) -> yaml.Node | None:
        try:
            node = super().get_single_node()  # PyYAML composes by recursion
        except RecursionError:
            raise yaml.YAMLError(
                f"the document nests lists or mappings more than Python can read (a manifest "
                f"nests a few levels; at most {MAX_DEPTH} are read)"
            ) from None
        if node is not None:
            check_expansion(node)
        return node

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


def check_expansion(node: yaml.Node) -> None:
    """Refuse a document whose aliases expand it past ``MAX_NODES`` (``AliasExpansionError``,
    naming the top-level entry that expands the most), or that nests past ``MAX_DEPTH``. Counts each distinct node once, so a
    bomb is measured without being expanded."""
    sizes: dict[int, int] = {}

    def size(n: yaml.Node, active: frozenset[int] = frozenset()) -> int:
        if id(n) in sizes or id(n) in active:  # counted, or an alias inside itself (walk skips)
            return sizes.get(id(n), 0)
        if len(active) >= MAX_DEPTH:
            raise yaml.YAMLError(
                f"line {n.start_mark.line + 1}: lists or mappings nested more than {MAX_DEPTH} "
                "levels deep; a manifest nests a few"
            )
        inner = active | {id(n)}
        sizes[id(n)] = 1 + sum(size(child, inner) for _, child in _children(n))
        return sizes[id(n)]

    total = size(node)
    if total <= MAX_NODES:
        return
    entries = _children(node)
    if not entries:
        raise AliasExpansionError((), node.start_mark.line + 1, total)
    key, _ = max(entries, key=lambda entry: sizes.get(id(entry[1]), 0))
    label = key.value if isinstance(key, yaml.ScalarNode) else "?"
    raise AliasExpansionError((label,), key.start_mark.line + 1, total)


def _children(node: yaml.Node) -> list[tuple[yaml.Node, yaml.Node]]:
    """(key node, value node) of a mapping's entries (merge keys included), (item, item) of a
    list's; none of a scalar."""
    if isinstance(node, yaml.MappingNode):
        return list(node.value)
    if isinstance(node, yaml.SequenceNode):
        return [(item, item) for item in node.value]
    return []


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
