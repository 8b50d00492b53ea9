"""torchrun worker: ``fp8ops resume RUN_DIR --checkpoint STEP`` on every rank, each rank's
outcome recorded (tests/test_pipeline_training.py): a refusal some ranks meet must end every
rank with it, not leave the others in the pipeline schedule.

Writes OUT_DIR/rank{r}.json: what this rank's resume raised (its type and message, whether it
is said once) or "trained".
Usage: torchrun --standalone --nproc_per_node 2 resume_outcome.py OUT_DIR RUN_DIR STEP
"""

import json
import os
import sys
from pathlib import Path

import fp8ops.megatron  # noqa: F401  (before Megatron-Core: TE's meta-package otherwise)
from fp8ops.train import resume_training


def main(out_dir: Path, run_dir: Path, step: str) -> None:
    try:
        resume_training(run_dir, checkpoint=step, progress=False)
        found = {"outcome": "trained"}
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        found = {
            "outcome": type(exc).__name__,
            "message": str(exc),
            "collective": getattr(exc, "collective", False),
        }
    (out_dir / f"rank{os.environ['RANK']}.json").write_text(json.dumps(found))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3])
