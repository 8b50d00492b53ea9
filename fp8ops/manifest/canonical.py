"""The canonical form of a manifest, its hash, its YAML rendering and field-by-field diffs.

The canonical form is the validated model dumped to JSON types with every default filled
in, keys sorted, no whitespace. Two files that mean the same run (keys in another order,
other comments, flow or block style, defaults written out or left implicit, ``1e-5`` or
``0.00001``) have the same canonical form and so the same hash; any change of meaning
changes it.

One exception keeps hashes stable across fp8ops versions: a field added to the schema after
its first release (``base.added_field``) is left out while it holds its default. Without
it, every new field would change the hash of every existing manifest, and with it every
stored revision's name, every revision's parent link and every checkpoint's manifest lock:
an upgrade would refuse every run's resume as drift. A default chosen for a new field
therefore has to mean what runs did before the field existed.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Literal

import yaml
from pydantic import BaseModel

from fp8ops.manifest.base import ADDED_IN
from fp8ops.manifest.schema import Manifest
from fp8ops.manifest.yaml_io import ManifestDumper


def content_dict(m: Manifest) -> dict[str, Any]:
    """Every field, defaults included, as JSON types (tuples become lists): the content to
    edit, compare or derive from."""
    return _positive_zero(m.model_dump(mode="json"))


def canonical_dict(m: Manifest) -> dict[str, Any]:
    """What the hash covers: :func:`content_dict` without the fields added to the schema
    later that still hold their defaults (module docstring)."""
    return _without_added_defaults(m, content_dict(m))


def section_dict(section: BaseModel) -> dict[str, Any]:
    """One section as the hash sees it: JSON types, without the later-added fields that hold
    their defaults (so a record of it written before those fields existed still compares
    equal)."""
    return _without_added_defaults(section, _positive_zero(section.model_dump(mode="json")))


def _without_added_defaults(model: BaseModel, dumped: dict[str, Any]) -> dict[str, Any]:
    kept = {}
    for name, field in type(model).model_fields.items():
        value = getattr(model, name)
        extra = field.json_schema_extra
        added_later = isinstance(extra, dict) and ADDED_IN in extra
        if added_later and value == field.get_default(call_default_factory=True):
            continue
        kept[name] = _recurse(value, dumped[name])
    return kept


def _recurse(value: Any, dumped: Any) -> Any:
    if isinstance(value, BaseModel):
        return _without_added_defaults(value, dumped)
    if isinstance(value, tuple | list):
        return [_recurse(v, d) for v, d in zip(value, dumped, strict=True)]
    return dumped


def canonical_json(m: Manifest) -> str:
    return json.dumps(
        canonical_dict(m), sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    )


def manifest_hash(m: Manifest) -> str:
    """sha256 hex digest of the canonical JSON: the manifest's identity."""
    return hashlib.sha256(canonical_json(m).encode("ascii")).hexdigest()


def to_yaml(m: Manifest) -> str:
    """The canonical content as block-style YAML, keys sorted, headed by its hash."""
    body = yaml.dump(
        canonical_dict(m),
        Dumper=ManifestDumper,
        sort_keys=True,
        default_flow_style=False,
        allow_unicode=True,
        width=100,
    )
    return (
        f"# fp8ops manifest {m.name} revision {m.revision.number}\n"
        f"# sha256 {manifest_hash(m)} (canonical form)\n"
        f"{body}"
    )


def _positive_zero(value: Any) -> Any:
    # -0.0 passes ">= 0" and means 0, but json.dumps writes "-0.0": the hash must not see it.
    if isinstance(value, dict):
        return {k: _positive_zero(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_positive_zero(v) for v in value]
    if isinstance(value, float) and value == 0.0:
        return 0.0
    return value


# --------------------------------------------------------------------------------------
# Diff
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FieldChange:
    """One differing leaf of the canonical form. ``old``/``new`` are None when absent."""

    path: str
    kind: Literal["added", "removed", "changed"]
    old: Any
    new: Any


def diff_manifests(a: Manifest, b: Manifest) -> list[FieldChange]:
    """Field-by-field changes from ``a`` to ``b``, sorted by dotted path.

    Lists (module globs) are compared as whole values: ``[] -> ['*.linear_fc2']`` reads
    better than a change per index.
    """
    old, new = _leaves(content_dict(a)), _leaves(content_dict(b))
    changes = []
    for path in sorted(old.keys() | new.keys()):
        if path not in new:
            changes.append(FieldChange(path, "removed", old[path], None))
        elif path not in old:
            changes.append(FieldChange(path, "added", None, new[path]))
        elif old[path] != new[path] or type(old[path]) is not type(new[path]):
            changes.append(FieldChange(path, "changed", old[path], new[path]))
    return changes


def _leaves(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    leaves = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            leaves.update(_leaves(value, f"{path}."))
        else:
            leaves[path] = value
    return leaves
