"""What every manifest section shares: the strict and frozen base model, the marker of a field
added after the schema's first release, the field types several sections use, and the way
cross-field rules report their problems.

Three settings hold for every section (``Section``):

* ``extra="forbid"``: a misspelt key is an error, never a silently ignored option (TE's own
  pydantic recipe drops unknown keywords, which is how ``--no-fp8-wgrad`` became a no-op);
* ``strict=True``: YAML ``"16"`` is not the integer 16 and ``yes`` is not a string. Floats
  still accept YAML integers (``lr: 1`` is 1.0);
* ``frozen=True``: a manifest never changes; a change is a new revision (``revisions.py``).

Lists are stored as tuples so that frozen means frozen all the way down; YAML lists are
accepted and dump back as lists.

Cross-field rules raise every violation at once, each at the location of the field to fix
(``raise_problems``), so ``load.py`` can report them all with their dotted paths.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, ValidationError
from pydantic_core import PydanticCustomError, PydanticUndefined

# The marker of a field added after the schema's first release (``added_field``).
ADDED_IN = "fp8ops_added_in"
# The error type of a rule whose bad value may be a secret (a webhook URL where the name of its
# variable belongs): ``messages.py`` does not repeat the value.
SECRET = "secret_value"


def added_field(default: Any = PydanticUndefined, *, added_in: str, **kwargs: Any) -> Any:
    """A field added to the schema after its first release, in fp8ops version ``added_in``.

    Every field added from now on must be declared with this, not ``Field``: the hash leaves
    it out while it holds its default (``canonical.py``), so every manifest written before it
    existed keeps its hash, its stored revisions and its checkpoints' lock. ``default`` must
    therefore mean what runs did before. ``tests/test_manifest.py`` and
    ``tests/test_manifest_hashes.py`` pin the hashes of the shipped manifests and of manifests
    that set every field, and fail on a field added with ``Field``.
    """
    extra = dict(kwargs.pop("json_schema_extra", None) or {})
    extra[ADDED_IN] = added_in
    return Field(default, json_schema_extra=extra, **kwargs)


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


def raise_problems(title: str, problems: list[tuple[tuple[str | int, ...], Any, str]]) -> None:
    """Raise all cross-field problems at once, each located at the field to fix.

    ``problems`` holds ``(loc relative to the model, bad value, message)``; pydantic prefixes
    the model's own location, so a rule in ``Manifest`` names e.g. ``model.num_layers``.
    """
    if problems:
        raise ValidationError.from_exception_data(
            title,
            [
                {
                    "type": PydanticCustomError("manifest_rule", "{detail}", {"detail": message}),
                    "loc": loc,
                    "input": value,
                }
                for loc, value, message in problems
            ],
        )


# --------------------------------------------------------------------------------------
# Shared field types
# --------------------------------------------------------------------------------------


def list_to_tuple(value: Any) -> Any:
    # Only lists: strict mode must still reject a string or a mapping where a list belongs.
    return tuple(value) if isinstance(value, list) else value


def _check_sha256(value: str) -> str:
    if not re.fullmatch(r"[0-9a-f]{64}", value):
        raise ValueError("must be a sha256 digest: 64 lowercase hex digits")
    return value


# Module FQNs are dotted Python identifiers and layer indices, e.g.
# "decoder.layers.3.self_attention.linear_qkv"; globs add fnmatch's *, ? and [...] / [!...].
_GLOB_CHARS = re.compile(r"[A-Za-z0-9_.*?\[\]!-]")


def _check_glob(pattern: str) -> str:
    if not pattern:
        raise ValueError("must be a non-empty module glob such as '*.linear_qkv'")
    bad = [ch for ch in pattern if not _GLOB_CHARS.fullmatch(ch)]
    if bad:
        raise ValueError(
            f"contains {bad[0]!r}; module globs use letters, digits, '_', '.' "
            "and the wildcards '*', '?', '[...]'"
        )
    # fnmatch treats an unclosed '[' as a literal, which would silently match nothing.
    if re.search(r"\[[^\]]*(\[|$)", pattern) or re.search(r"(^|\])[^\[]*\]", pattern):
        raise ValueError("has an unbalanced '[' or ']'")
    if pattern.startswith(".") or pattern.endswith(".") or ".." in pattern:
        raise ValueError("has an empty name segment (leading, trailing or doubled '.')")
    return pattern


def _some_globs(value: tuple[str, ...]) -> tuple[str, ...]:
    # An after-validator, not Field(min_length=1): pydantic counts only the items that
    # validated, so a list with one bad glob would also be reported as empty.
    if not value:
        raise ValueError("must list at least one module glob, e.g. '*.linear_fc1'")
    return value


Sha256 = Annotated[str, AfterValidator(_check_sha256)]
NonEmptyStr = Annotated[str, Field(min_length=1)]
ModuleGlob = Annotated[str, AfterValidator(_check_glob)]
Globs = Annotated[tuple[ModuleGlob, ...], BeforeValidator(list_to_tuple)]
SomeGlobs = Annotated[Globs, AfterValidator(_some_globs)]  # at least one
Fraction = Annotated[float, Field(ge=0, le=1)]
