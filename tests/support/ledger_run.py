"""The run directory the override-ledger tests work on (test_ledger.py, test_overrides_cli.py):
the tiny GPT's admission table, with one module excluded by glob and one kept in BF16 by a
hand-written manifest override, and the files training leaves beside it."""

from __future__ import annotations

import json
import math

from fp8ops.admission import decide_admission
from fp8ops.alerts import Alert, write_alerts
from fp8ops.checkpoint.meta import (
    CheckpointMeta,
    Fp8StateRecord,
    LedgerAnchor,
    TopologyRecord,
    write_meta,
)
from fp8ops.manifest import ManifestStore, derive, load_manifest, manifest_hash, write_manifest
from fp8ops.overrides.chain import GENESIS, canonical_json, record_hash
from fp8ops.run.records import write_layers_json
from support.example_manifests import TINY

FC1 = "decoder.layers.0.mlp.linear_fc1"
QKV = "decoder.layers.1.self_attention.linear_qkv"
EXCLUDED = "decoder.layers.3.mlp.linear_fc2"  # precision.exclude_modules
HAND = "decoder.layers.3.mlp.linear_fc1"  # a hand-written precision.overrides entry
DATA = "d" * 64


def admit_tiny_gpt():
    """(manifest, recipe, admission table) of the tiny GPT, built on Megatron's parallel state
    (the ``megatron_tp1`` fixture)."""
    from fp8ops.megatron import build_gpt
    from fp8ops.precision import DelayedScalingRecipe

    manifest = derive(
        load_manifest(TINY),
        {
            "precision.exclude_modules": [EXCLUDED],
            "precision.overrides": [{"module": HAND, "reason": "kept in BF16 by hand"}],
        },
        "ledger tests",
    )
    recipe = DelayedScalingRecipe.from_precision(manifest.precision)
    table = decide_admission(build_gpt(manifest, recipe), manifest.precision, tensor_parallel=1)
    return manifest, recipe, table


def make_run_dir(path, admitted, *, allow_self_approval=False, review=None):
    """A run directory as training leaves it: manifest, layers.json, run.json, status, alerts.
    ``review``: fields of the manifest's review section (allowed signers, say)."""
    manifest, recipe, table = admitted
    if allow_self_approval:
        manifest = derive(manifest, {"review.allow_self_approval": True}, "one-person team")
    if review:
        manifest = derive(manifest, {f"review.{k}": v for k, v in review.items()}, "signers")
    path.mkdir(parents=True, exist_ok=True)
    write_manifest(manifest, path / "manifest.yaml")
    ManifestStore(path / "manifests").put(manifest)
    write_layers_json(path, table, recipe, tensor_parallel=1, manifest_hash=manifest_hash(manifest))
    (path / "run.json").write_text(json.dumps({"data": {"fingerprint": DATA}}))
    (path / "status.json").write_text(
        json.dumps({"state": "running", "step": 120, "manifest": manifest_hash(manifest)})
    )
    saturation = {"rule": "saturation", "metric": "input.saturation", "threshold": 0.02}
    write_alerts(
        path,
        [
            Alert(
                100,
                "observe",
                module=FC1,
                value=0.01,
                message="",
                **{**saturation, "threshold": 0.005},
            ),
            Alert(110, "degrade", module=FC1, value=0.03, message="", **saturation),
            Alert(110, "degrade", "underflow", FC1, "grad_output.underflow", math.nan, 0.1, ""),
            Alert(115, "degrade", module=QKV, value=0.5, message="", **saturation),
        ],
    )
    return path


def checkpoint_record(run, anchor=None, step=120):
    """A checkpoint as a resume and the ledger's reads see it: its directory with only
    ``fp8ops_checkpoint.json``, saved under the revision ``status.json`` names, with the
    ledger's ``anchor`` ({records, head}; None: the ledger was empty)."""
    directory = run / "checkpoints" / f"step_{step:08d}"
    directory.mkdir(parents=True)
    manifest = json.loads((run / "status.json").read_text())["manifest"]
    write_meta(
        directory,
        CheckpointMeta(
            step=step,
            saved_at="2026-12-02T00:00:00+0000",
            reason="periodic",
            manifest=manifest,
            revisions=[manifest],
            environment={},
            topology=TopologyRecord(
                tensor_parallel=1,
                pipeline_parallel=1,
                data_parallel=1,
                world_size=1,
                amax_reduction="tp_dp",
                reduce_amax=True,
            ),
            admission=None,
            weights_fingerprint="0" * 64,
            fp8=Fp8StateRecord(layout="none", groups=1, history_len=0, modules=[], digests={}),
            # where `step` global batches end, as fp8ops.checkpoint.consistency checks
            sampler={"epoch": 0, "cursor": step * _global_batch(run, manifest)},
            optimizer_steps=step,
            optimizer_main=False,
            telemetry_committed=None,
            per_rank_state=True,
            files={},
            ledger=None if anchor is None else LedgerAnchor(**anchor),
        ),
    )
    return directory


def _global_batch(run, digest: str) -> int:
    from fp8ops.manifest import ManifestStore

    return ManifestStore(run / "manifests").get(digest).schedule.global_batch_size


def append_by_hand(run, body):
    """``body`` appended to the run's ledger as someone with a text editor would: ``seq``,
    ``prev`` and ``hash`` computed with ``fp8ops.overrides.chain``, so the chain holds."""
    path = run / "overrides.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    prev = json.loads(lines[-1])["hash"] if lines else GENESIS
    record = {**body, "seq": len(lines), "prev": prev, "time": "2026-12-02T00:00:00+00:00"}
    record["hash"] = record_hash(record)
    with path.open("a") as f:
        f.write(canonical_json(record) + "\n")
    return record


def forged_proposal(run, module=FC1, who="fp8ops-alerts", rule="saturation"):
    """A ``proposed`` record appended by hand, as the alert engine's (or ``who``'s)."""
    trigger = {"metric": "input.saturation", "value": 0.5, "threshold": 0.1, "level": "degrade"}
    return append_by_hand(
        run,
        {
            "kind": "proposed",
            "module": module,
            "dtype": "bf16",
            "reason": "forged",
            "who": who,
            "triggers": [{**trigger, "rule": rule, "step": 100}],
            "step": 100,
            "data_version": None,
        },
    )


def lock_to(run, manifest):
    """Make ``manifest`` the run's locked revision, as a writer of the run directory can: stored
    in ``manifests/``, written to ``manifest.yaml``, named by ``status.json``. Its sha256."""
    ManifestStore(run / "manifests").put(manifest)
    (run / "manifest.yaml").unlink()
    write_manifest(manifest, run / "manifest.yaml")
    status = json.loads((run / "status.json").read_text())
    digest = manifest_hash(manifest)
    (run / "status.json").write_text(json.dumps({**status, "manifest": digest}))
    return digest
