"""Your own data (data kind ``jsonl``): one JSON object per line, one kind per file.

* pre-training: every line is ``{"text": "..."}``, a document;
* SFT: every line is ``{"prompt": "...", "answer": "...", "buckets": {"name": "value", ...}}``;
  ``buckets`` is optional, but when present every line must use the same bucket names.

Blank lines are skipped. Anything else that is wrong is a ``ManifestError`` naming the file, the
1-based line number and what to fix: the file is part of the run, as the manifest is, and is
checked as strictly (an unknown key is an error, not ignored).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from fp8ops.data.tasks import Example
from fp8ops.errors import ManifestError, relative

_TEXT_KEYS = {"text"}
_SFT_KEYS = {"prompt", "answer", "buckets"}


@dataclass(frozen=True)
class JsonlData:
    """A JSONL file's content: ``texts`` (pre-training) or ``examples`` (SFT), never both."""

    path: Path
    kind: Literal["text", "sft"]
    texts: tuple[str, ...]
    examples: tuple[Example, ...]
    sha256: str  # of the file's bytes, for the record (the data fingerprint is what counts)
    text_lines: tuple[int, ...]  # each text's line, for errors found when it is encoded


def read_jsonl(path: str | Path) -> JsonlData:
    """Read and check the JSONL file at ``path`` (``data.path``)."""
    path = Path(path)
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "no such file"
        raise ManifestError(f"data.path: {path}: {what}{relative(path)}; it must name a JSONL file")
    raw = path.read_bytes()
    texts: list[str] = []
    text_lines: list[int] = []
    examples: list[Example] = []
    first: dict[str, int] = {}  # kind -> its first line
    bucket_names: tuple[str, ...] | None = None
    # A byte-order mark from Windows editors is tolerated, as in manifests.
    for number, line in enumerate(raw.removeprefix(b"\xef\xbb\xbf").split(b"\n"), 1):
        where = f"{path}: line {number}"
        obj = parse_line(line, where)
        if obj is None:
            continue  # blank
        kind = _kind_of(obj, where)
        first.setdefault(kind, number)
        if len(first) > 1:
            other = "text" if kind == "sft" else "sft"
            raise ManifestError(
                f"{where}: a {_KIND_NAMES[kind]}, but line {first[other]} is a "
                f"{_KIND_NAMES[other]}; one file holds one kind (split it into two files)"
            )
        if kind == "text":
            texts.append(text_field(obj, "text", where))
            text_lines.append(number)
            continue
        buckets = bucket_labels(obj.get("buckets", {}), where)
        names = tuple(sorted(buckets))
        if bucket_names is None:
            bucket_names = names
        elif names != bucket_names:
            raise ManifestError(
                f"{where}: buckets are named {list(names)} but line {first['sft']} names "
                f"{list(bucket_names)}; every example needs the same bucket names"
            )
        prompt, answer = text_field(obj, "prompt", where), text_field(obj, "answer", where)
        examples.append(Example(prompt, answer, buckets, origin=where))

    if not first:
        raise ManifestError(
            f"{path}: no JSON objects (the file is empty or blank); data kind 'jsonl' needs "
            'one {"text": ...} or {"prompt": ..., "answer": ...} object per line'
        )
    return JsonlData(
        path=path,
        kind="text" if texts else "sft",
        texts=tuple(texts),
        text_lines=tuple(text_lines),
        examples=tuple(examples),
        sha256=hashlib.sha256(raw).hexdigest(),
    )


_KIND_NAMES = {"text": 'text document {"text": ...}', "sft": 'SFT example {"prompt", "answer"}'}


def parse_line(line: bytes, where: str) -> dict[str, Any] | None:
    """The line's JSON object, or None for a blank line."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ManifestError(
            f"{where}: not UTF-8 (byte 0x{line[exc.start]:02x} at column {exc.start + 1}); "
            "save the file as UTF-8"
        ) from None
    if not text.strip():
        return None
    try:
        obj = json.loads(text, object_pairs_hook=_no_duplicate_keys)
    except json.JSONDecodeError as exc:
        raise ManifestError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    except _DuplicateKey as exc:
        raise ManifestError(
            f"{where}: key {exc.args[0]!r} appears twice in one object; keep one"
        ) from None
    except (ValueError, RecursionError) as exc:  # an integer of thousands of digits; deep nesting
        what = "nested too deeply" if isinstance(exc, RecursionError) else "a number too long"
        raise ManifestError(f"{where}: not readable JSON ({what})") from None
    if not isinstance(obj, dict):
        raise ManifestError(f"{where}: expected a JSON object, got {_json_type(obj)}")
    return obj


class _DuplicateKey(Exception):
    pass


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object whose keys are all different: JSON would keep the last of two silently."""
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise _DuplicateKey(key)
        obj[key] = value
    return obj


def _kind_of(obj: dict[str, Any], where: str) -> Literal["text", "sft"]:
    keys = set(obj)
    if "text" in keys:
        kind, allowed = "text", _TEXT_KEYS
    elif "prompt" in keys or "answer" in keys:
        kind, allowed = "sft", _SFT_KEYS
    else:
        raise ManifestError(
            f'{where}: has keys {sorted(keys)}; expected {{"text": ...}} or '
            '{"prompt": ..., "answer": ..., "buckets": {...}}'
        )
    unknown = sorted(keys - allowed)
    if unknown:
        raise ManifestError(
            f"{where}: unknown key {unknown[0]!r} for a {_KIND_NAMES[kind]}; "
            f"allowed: {sorted(allowed)}"
        )
    missing = sorted({"prompt", "answer"} - keys) if kind == "sft" else []
    if missing:
        raise ManifestError(
            f"{where}: missing key {missing[0]!r}; an SFT example needs 'prompt' and 'answer'"
        )
    return kind


def text_field(obj: dict[str, Any], key: str, where: str) -> str:
    value = obj[key]
    if not isinstance(value, str):
        raise ManifestError(f"{where}: {key!r} must be a string, got {_json_type(value)}")
    if not value:
        # Empty text teaches nothing; an empty prompt leaves no position to predict the answer.
        raise ManifestError(f"{where}: {key!r} is empty")
    if "\x00" in value:
        raise ManifestError(
            f"{where}: {key!r} contains NUL (\\u0000), which fp8ops reads as end of document"
        )
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone \ud800-\udfff escape: no character at all
        raise ManifestError(
            f"{where}: {key!r} contains an unpaired surrogate "
            f"(\\u{ord(value[exc.start]):04x}), which is no character; fix the escape (a pair "
            "\\ud83d\\ude00 is one character)"
        ) from None
    return value


def bucket_labels(value: Any, where: str) -> dict[str, str]:
    if not isinstance(value, dict):
        raise ManifestError(
            f"{where}: 'buckets' must be an object of name -> value strings, "
            f"got {_json_type(value)}"
        )
    for name, label in value.items():
        if not isinstance(label, str):
            raise ManifestError(
                f"{where}: bucket {name!r} must be a string, got {_json_type(label)}"
            )
    return dict(value)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return {dict: "an object", list: "an array", str: "a string"}[type(value)]
