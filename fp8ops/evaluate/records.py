"""What a capability evaluation leaves in the run directory, and how to read it back.

::

    RUN_DIR/
      capability.jsonl                 one line per evaluation: step, items, correct, accuracy,
                                       the same per bucket ("task=add", ...), seconds, and the
                                       predictions file with its sha256
      capability/step_XXXXXXXX.jsonl   one line per item, in evaluation order: index (row of the
                                       eval split), key, prompt, answer, generated, correct,
                                       buckets

The predictions file is written whole and atomically before its summary line is appended, so a
line never names a file that is not there. A resume from an earlier checkpoint evaluates a step
again: the file is replaced and a new line appended, and the latest line for a step wins
(:func:`read_capability`).

No torch here: the comparison and reporting tools read these files anywhere.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fp8ops.errors import Fp8opsError
from fp8ops.files import append_lines, atomic_write_text, json_line, latest_per_step, read_jsonl
from fp8ops.run.layout import CAPABILITY as LOG
from fp8ops.run.layout import CAPABILITY_ANSWERS as PREDICTIONS_DIR


def predictions_name(step: int) -> str:
    """The step's predictions file, relative to the run directory."""
    return f"{PREDICTIONS_DIR}/step_{step:08d}.jsonl"


def score(predictions: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Items, correct and accuracy over ``predictions``, overall and per ``name=value`` bucket
    (sorted). ``predictions`` must not be empty."""
    counts: dict[str, list[int]] = {}
    for prediction in predictions:
        for name, value in prediction["buckets"].items():
            entry = counts.setdefault(f"{name}={value}", [0, 0])
            entry[0] += 1
            entry[1] += prediction["correct"]
    correct = sum(p["correct"] for p in predictions)
    return {
        "items": len(predictions),
        "correct": correct,
        "accuracy": correct / len(predictions),
        "buckets": {
            bucket: {"items": n, "correct": right, "accuracy": right / n}
            for bucket, (n, right) in sorted(counts.items())
        },
    }


def write_capability(
    run_dir: Path, step: int, predictions: Sequence[dict[str, Any]], seconds: float
) -> dict[str, Any]:
    """Write the step's predictions file, then append its summary line; returns the line."""
    name = predictions_name(step)
    text = "".join(json.dumps(prediction) + "\n" for prediction in predictions)
    atomic_write_text(Path(run_dir) / name, text)
    record = {
        "step": step,
        **score(predictions),
        "seconds": round(seconds, 3),
        "predictions": name,
        "predictions_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
    }
    # One write of one line, as RunDir.append does: a crash loses at most this line.
    append_lines(Path(run_dir) / LOG, json_line(record))
    return record


def read_capability(run_dir: Path) -> list[dict[str, Any]]:
    """The run's capability records in step order, the latest line winning for a step that was
    evaluated again after a resume from an earlier checkpoint; [] when there are none."""
    path = Path(run_dir) / LOG
    return latest_per_step(read_jsonl(path)) if path.exists() else []


def read_predictions(run_dir: Path, record: dict[str, Any]) -> list[dict[str, Any]]:
    """The per-item predictions behind ``record`` (a line of :func:`read_capability`), checked
    against the sha256 the line recorded."""
    path = Path(run_dir) / record["predictions"]
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise Fp8opsError(
            f"{path}: missing, but {LOG} names it for step {record['step']}; the run directory "
            "is incomplete (copied without its capability/ folder?)"
        ) from None
    found = hashlib.sha256(data).hexdigest()
    if found != record["predictions_sha256"]:
        raise Fp8opsError(
            f"{path}: sha256 {found[:12]}... does not match the {record['predictions_sha256'][:12]}"
            f"... that {LOG} recorded for step {record['step']}: the file was changed or damaged "
            "after the evaluation wrote it. Do not use it; the summary line in "
            f"{LOG} is what the run measured, and resuming from a checkpoint before step "
            f"{record['step']} would evaluate it again."
        )
    return [json.loads(line) for line in data.decode("utf-8").splitlines()]
