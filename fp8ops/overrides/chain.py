"""The ledger's file format: canonical JSON lines chained by sha256.

Every record carries ``seq`` (its 0-based position), ``prev`` (the previous record's ``hash``;
:data:`GENESIS` for the first) and ``hash`` (sha256 of its canonical JSON without ``hash``). An
edited line no longer matches its hash; a deleted or moved one breaks the ``seq``/``prev`` links
of the line after it. :func:`parse_chain` checks both, line by line, and names the first bad
line; what the records mean is ``ledger.py``'s business.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fp8ops.errors import Fp8opsError
from fp8ops.files import loads_json

GENESIS = "0" * 64  # the ``prev`` of the first record


class LedgerError(Fp8opsError):
    """``overrides.jsonl`` is damaged or was tampered with; the message names file and line."""


def canonical_json(record: Mapping[str, Any]) -> str:
    """What a line holds and what the hash covers: keys sorted, no spaces, no NaN."""
    return json.dumps(
        record, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    )


def record_hash(record: Mapping[str, Any]) -> str:
    """sha256 of the canonical JSON of ``record`` without its ``hash`` key."""
    body = {key: value for key, value in record.items() if key != "hash"}
    return hashlib.sha256(canonical_json(body).encode("utf-8")).hexdigest()


def parse_chain(path: Path, data: bytes) -> list[dict[str, Any]]:
    """The records of a ledger file's bytes, the chain checked line by line."""
    lines = data.split(b"\n")
    if lines[-1]:  # the file does not end in a newline: the last write was cut short
        n = len(lines)
        keep = f"remove {path}"
        if n > 1:
            keep = (
                f"keep its first {n - 1} line(s): head -n {n - 1} {path} > {path}.fixed && "
                f"mv {path}.fixed {path}"
            )
        raise LedgerError(
            f"{path}, line {n}: incomplete last line (no newline at its end): a write was "
            "interrupted (a crash or a full disk) and that record was never completed. Remove "
            f"the partial line ({keep}), check the ledger with `fp8ops overrides list`, and "
            "redo the last action if it is missing. Nothing reads or appends to the ledger "
            "until then."
        )
    records: list[dict[str, Any]] = []
    prev = GENESIS
    for n, raw in enumerate(lines[:-1], 1):
        try:
            record = loads_json(raw.decode("utf-8"))
        except ValueError:  # not UTF-8, not JSON, nested too deeply
            record = None
        if not isinstance(record, dict) or not isinstance(record.get("hash"), str):
            raise LedgerError(
                f"{path}, line {n}: not a ledger record (not a JSON object with a hash); the "
                "ledger was edited or damaged: restore it from a copy"
            )
        try:
            intact = record_hash(record) == record["hash"]
        except ValueError:  # NaN or infinity, which the writer never produces
            intact = False
        if not intact:
            raise LedgerError(
                f"{path}, line {n}: the record's hash does not match its content: line {n} was "
                "edited after it was written. An edited ledger cannot be trusted or appended "
                "to: restore it from a copy."
            )
        if record.get("seq") != n - 1:
            raise LedgerError(
                f"{path}, line {n}: the hash chain is broken (seq {record.get('seq')!r} where "
                f"{n - 1} belongs): a record before line {n} was deleted or the lines were "
                "reordered. Restore the ledger from a copy."
            )
        if record.get("prev") != prev:
            # In its place, but chained to another record: the one before it was replaced.
            before = f"line {n - 1} was rewritten" if n > 1 else "the first record was deleted"
            raise LedgerError(
                f"{path}, line {n}: the hash chain is broken (its prev is not the hash of the "
                f"record before it): {before}. Restore the ledger from a copy."
            )
        records.append(record)
        prev = record["hash"]
    return records
