"""Every manifest keeps its hash: the shipped ones, the suite's fixtures, and a set that sets
every section's fields away from their defaults.

A run's checkpoints, its stored revisions and their parent links all name a manifest by the
sha256 of its canonical JSON (``fp8ops.manifest.canonical``), so a hash that moves with a
refactor of the schema is an upgrade that refuses every run's resume. The hashes below were
computed before the schema was split into one module per section; they are sha256 over JSON,
so the same on every machine.

The canonical JSON sorts its keys, so the order in which a section declares its fields does
not reach the hash; its names, defaults and which fields were added later (left out while they
hold their defaults) do, and the cases cover them: ``minimal`` holds every default, and
between them the cases set every field of every section away from it
(``test_the_cases_set_every_field``).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from support.example_manifests import MINIMAL, TINY
from support.shared_base import base_manifest

from fp8ops.manifest import (
    Manifest,
    content_dict,
    derive,
    load_manifest,
    manifest_hash,
    parse_manifest,
)

SHA = "a" * 64  # a fingerprint, approval or parent: any sha256 digest will do

# Each section of the tiny manifest away from its defaults, as tests derive it.
PRECISION_CURRENT = {
    "precision.scaling": "current",
    "precision.amax_history_len": 1024,
    "precision.power_2_scale": True,
    "precision.amax_epsilon": 1e-6,
    "precision.backend": "scaled_mm",
}
PRECISION_BLOCK = {
    "precision.scaling": "block",
    "precision.amax_history_len": 1024,
    "precision.w_block_scaling_dim": 1,
    "precision.grad_block_scaling_dim": 2,
    "precision.exclude_modules": ["*.linear_proj"],
    "precision.small_gemm": {"enabled": True, "min_dim": 64, "min_flops_per_token": 0},
    "precision.overrides": [
        {
            "module": "decoder.layers.3.mlp.linear_fc2",
            "reason": "saturates",
            "approval": SHA,
            "policy": "b" * 64,
        }
    ],
    "precision.module_recipes": [
        {"modules": ["decoder.layers.0.*"], "scaling": "current", "reason": "first layer"},
        {"modules": ["decoder.layers.1.*"], "scaling": "mxfp8", "reason": "try", "approval": SHA},
    ],
}
PRECISION_BLOCK_2D_INPUTS = {
    "precision.scaling": "block",
    "precision.amax_history_len": 1024,
    "precision.x_block_scaling_dim": 2,
    "precision.w_block_scaling_dim": 1,
}
PRECISION_DELAYED = {
    "precision.base_dtype": "fp32",
    "precision.fp8_format": "e4m3",
    "precision.amax_compute_algo": "trimmed_max:2",
    "precision.margin": 1,
    "precision.reduce_amax": False,
    "precision.include_modules": ["*.linear_fc1", "*.linear_fc2"],
    "precision.module_recipes": [
        {"modules": ["decoder.layers.3.*"], "scaling": "block", "reason": "last layer"}
    ],
}
LLAMA_SHAPED = {
    "model.normalization": "RMSNorm",
    "model.activation": "swiglu",
    "model.position_embedding": "rope",
    "model.num_query_groups": 2,
    "model.layernorm_epsilon": 1e-6,
    "model.add_bias_linear": False,
    "model.add_qkv_bias": True,
    "model.kv_channels": 64,
    "model.qk_layernorm": True,
    "model.tied_embeddings": True,
    "model.rotary_base": 500000.0,
    "model.rope_scaling": {
        "type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 2.0,
        "high_freq_factor": 8.0,
        "original_max_position_embeddings": 4096,
    },
    "model.init_checkpoint": None,
    "model.fingerprint": SHA,
    "tokenizer.kind": "huggingface",
    "tokenizer.path": "tokenizer/tokenizer.json",
    "tokenizer.fingerprint": SHA,
    "tokenizer.eod_token": "<|end_of_text|>",
    "data.kind": "chat",
    "data.path": "data/chat.jsonl",
    "data.fingerprint": SHA,
    "data.split_version": 2,
    "data.pad_to": "longest",
    "data.overlong": "truncate",
}
TASKS_AS_CHAT = {
    "model.position_embedding": "rope",
    "model.rope_scaling": {"type": "linear", "factor": 2.0},
    "tokenizer.kind": "huggingface",
    "tokenizer.path": "tokenizer",
    "data.as_chat": True,
    "data.num_examples": 1000,
    "data.eval_fraction": 0.2,
}
PARALLEL = {
    "topology.tensor_parallel": 2,
    "topology.pipeline_parallel": 2,
    "topology.data_parallel": 2,
    "topology.sequence_parallel": True,
    "topology.amax_reduction": "tp_cp",
    "optimizer.name": "sgd",
    "optimizer.clip_grad": None,
    "optimizer.distributed": True,
    "optimizer.lr": 0.5,
    "optimizer.min_lr": 0.0,
    "optimizer.weight_decay": 0.0,
    "optimizer.beta1": 0.8,
    "optimizer.beta2": 0.9,
    "optimizer.eps": 1e-6,
    "schedule.train_steps": 40,
    "schedule.warmup_steps": 0,
    "schedule.micro_batch_size": 2,
    "schedule.global_batch_size": 32,
    "schedule.lr_decay": "linear",
    "schedule.log_interval": 5,
    "schedule.eval_interval": 10,
    "schedule.eval_iters": None,
    "schedule.checkpoint_interval": 20,
    "schedule.keep_checkpoints": 5,
    "seeds.model": 7,
    "seeds.data": 8,
}
WATCHING = {
    "alerts.saturation": {"observe": 1e-5, "degrade": None, "stop": 0.5},
    "alerts.underflow": {"observe": 0.02, "degrade": 0.1, "stop": 0.2},
    "alerts.scale_change": {"observe": 2.0, "degrade": 8.0, "stop": None},
    "alerts.fp8_rel_error": {"observe": 0.05, "degrade": 0.2, "stop": 0.3},
    "alerts.blocks_at_floor": {"observe": 1e-3, "degrade": 1e-2, "stop": 0.1},
    "alerts.nonfinite_stop": False,
    "alerts.patience_steps": 2,
    "alerts.window_steps": 8,
    "alerts.underflow_rise_factor": 3.0,
    "alerts.underflow_rise_floor": 1e-2,
    "alerts.error_growth_samples": 5,
    "alerts.error_growth_floor": 0.05,
    "alerts.grad_spike_factor": 6.0,
    "alerts.amax_jump_factor": 8.0,
    "alerts.divergence_factor": 3.0,
    "alerts.divergence_warmup_steps": 4,
    "alerts.auto_degrade": {
        "rules": ["saturation", "blocks_at_floor"],
        "max_modules": 2,
        "until_step": 100,
    },
    "gates.loss_gap": 0.02,
    "gates.bucket_accuracy_gap": 0.05,
    "gates.allow_nonfinite": True,
    "gates.allow_skipped_steps": True,
    "gates.bucket_significance": None,
    "gates.min_bucket_items": 10,
    "gates.require_resume_continuity": False,
    "gates.resume_loss_jump": 0.2,
    "capability.enabled": False,
    "capability.items": None,
    "capability.interval": 50,
    "capability.max_new_tokens": 8,
    "dualtrack.fallback_first_last": False,
    "dualtrack.fallback_alerted": False,
    "dualtrack.fallback_modules": ["decoder.layers.2.*"],
    "telemetry.every_steps": 2,
    "telemetry.error_sample_every": 5,
    "telemetry.error_sample_tokens": 64,
    "telemetry.flush_steps": 128,
    "review.allow_self_approval": True,
    "review.allowed_signers": "allowed_signers",
    "review.allowed_signers_sha256": SHA,
    "review.require_signatures": True,
}
# The metric sinks and alert notifications (fields added in 0.1.0).
REPORTING = {
    "logging.tensorboard": {"dir": "tb"},
    "logging.wandb": {"project": "fp8", "entity": "team", "mode": "offline", "dir": "w"},
    "logging.mlflow": {"tracking_uri": "file:///srv/mlruns", "experiment": "fp8"},
    "logging.every_steps": 10,
    "logging.worst_modules": 3,
    "notifications.webhooks": [
        {"url_env": "FP8OPS_SLACK_WEBHOOK", "format": "slack", "level": "stop"},
        {"url_env": "FP8OPS_WEBHOOK"},
    ],
    "notifications.timeout_seconds": 2.0,
    "notifications.retries": 1,
    "notifications.exit_wait_seconds": 30.0,
}
PER_GEMM = {
    "precision.scaling": "current",
    "precision.amax_history_len": 1024,
    "precision.overrides": [
        {
            "module": "decoder.layers.3.mlp.linear_fc2",
            "reason": "grads",
            "gemms": ["wgrad", "dgrad"],
        }
    ],
    "precision.module_recipes": [
        {
            "modules": ["decoder.layers.0.*"],
            "scaling": "current",
            "reason": "wgrad in bf16",
            "gemms": ["fprop", "dgrad"],
        }
    ],
}

PRECISION_SCHEDULE = {
    "precision.schedule": [
        {"start": 10, "end": 20, "modules": ["*.linear_fc2"], "reason": "warm-up"},
        {
            "start_fraction": 0.5,
            "end_fraction": 0.8,
            "modules": ["decoder.layers.0.*"],
            "gemms": ["wgrad"],
            "to": "bf16",
            "reason": "middle",
        },
        {"start_fraction": 0.9, "modules": ["*"], "gemms": ["fprop"], "reason": "the last 10%"},
    ]
}


def _from_tiny(changes: dict[str, Any]) -> Manifest:
    return derive(load_manifest(TINY), changes, "test: every field")


def _second_revision() -> Manifest:
    first = _from_tiny({"precision.enabled": False})
    return derive(first, {"name": "tiny-gpt-cpu-control", "data.kind": "corpus"}, "test: again")


# ``small-base`` is the end-to-end tests' base model (tests/support/shared_base.py): its hash
# moves, rightly, if those tests' changes do.
CASES = {
    "minimal": lambda: parse_manifest(MINIMAL, "minimal"),
    "small-base": base_manifest,
    "precision-current": lambda: _from_tiny(PRECISION_CURRENT),
    "precision-block": lambda: _from_tiny(PRECISION_BLOCK),
    "precision-block-2d-inputs": lambda: _from_tiny(PRECISION_BLOCK_2D_INPUTS),
    "precision-delayed": lambda: _from_tiny(PRECISION_DELAYED),
    "llama-shaped": lambda: _from_tiny(LLAMA_SHAPED),
    "tasks-as-chat": lambda: _from_tiny(TASKS_AS_CHAT),
    "parallel": lambda: _from_tiny(PARALLEL),
    "watching": lambda: _from_tiny(WATCHING),
    "reporting": lambda: _from_tiny(REPORTING),
    "second-revision": _second_revision,
    # Added after the cases above were pinned (alerts.update_blowup_factor): a case of its own.
    "update-blowup-off": lambda: _from_tiny({"alerts.update_blowup_factor": None}),
    # Added with per-GEMM precision (precision.overrides[].gemms, module_recipes[].gemms).
    "per-gemm": lambda: _from_tiny(PER_GEMM),
    "auto-degrade-gemm": lambda: _from_tiny(
        {"alerts.auto_degrade": {"rules": ["saturation"], "max_modules": 1, "granularity": "gemm"}}
    ),
    # Added with the precision schedule (precision.schedule).
    "precision-schedule": lambda: _from_tiny(PRECISION_SCHEDULE),
}

# As tests/test_manifest.py pins them; here beside the rest.
SHIPPED = {
    "llama3-8b-h100-r1.yaml": "5f2ea22db9f025dced89bd8a475ad7ef6d858843f35c6a251f5bdd5b3b0d460c",
    "llama3-8b-h100.yaml": "e43d286bfcaf197c8a13a910c8ba6cd68badab08aadc1dda6828d607caf0cbb5",
    "smollm2-135m-chat.yaml": "05d3e92a4377d5c9400bf27c9d7c9aaadc8b5340f9bfebe46d5c1a09be5a2e1a",
    "tiny-gpt-cpu-base.yaml": "147bb0a27e1e7e7e18bd66a0ba07a88ce341c6af5348f6d2eba23e73a8813ee9",
    "tiny-gpt-cpu.yaml": "e3401e12090da85ef349b9b7b1848eb4c57b28efa02a86271f0caa44f8c68dcf",
}

BUILT = {
    "auto-degrade-gemm": "9fc5e3798d0b6ddb12297b095abb054083d514c095bf51246852a4e71d3f4659",
    "llama-shaped": "e8049efe2d4f7dd5b3217718578a0331018f1ceb7b842d4a11833b4393405396",
    "minimal": "0cb8ad7cf990b5d68fdae7435048d1475aa8bd921cf1583845d8d0c199cecc9f",
    "parallel": "e355d025a6ff01c7562b838186cc41fbfeb7f45325cd49fef12521299662dbf0",
    "per-gemm": "e93de4bd4bfae6701eb369e7d577d30960ab3822bac88f51f7495cba568c3177",
    "precision-schedule": "15be88eb74ebf8140336ee029fa3e14e8c4ed63333e9629327e834a9054ce1f4",
    "precision-block": "725fd2a20587795a3005af48cf1bbedcc35c57e3707c90968525de3686168757",
    "precision-block-2d-inputs": "56522112086d3c47f3aa7d5e811633f17bd397577b90da1ec8d801ae269f1048",
    "precision-current": "c6bb1f79ce23141edaf0c0f9059c26332af72bd37727e2c7ca120d97fc069098",
    "precision-delayed": "a466e051f67b654fc108882a463a9f0c7564f8cd2bf3565616c904f38a2e38d7",
    "reporting": "69ff3cd5a40905b64590e62d69c140329d41a8c9edc30de2d20129e09eaba4eb",
    "second-revision": "d15654a94a21dd27dcc57ea4f305cb4fc95f79f0d028423e4a637391aabd697c",
    "small-base": "f0908a9ac640e090d66d1fdb4b5445401bb6a9faa4e0ec285a98b2a8ba4f0d96",
    "tasks-as-chat": "b4b8e3178a582f8122f6e81a3ae15a3e8294e838780a2fd29af772dc6d1f1286",
    "update-blowup-off": "86877c4b72fff4a6f1e798f62fd7088d222914f6da0926da85786d0400e9b70a",
    "watching": "d0adb329f45fca4d1f1905fa678a7086514df3349039e11e1601ef6393ff580d",
}


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_manifest_keeps_its_hash(name):
    assert manifest_hash(load_manifest(TINY.parent / name)) == SHIPPED[name]


def test_every_shipped_manifest_is_pinned():
    assert sorted(p.name for p in TINY.parent.glob("*.yaml")) == sorted(SHIPPED)


@pytest.mark.parametrize("name", sorted(CASES))
def test_built_manifest_keeps_its_hash(name):
    assert manifest_hash(CASES[name]()) == BUILT[name]


def test_the_cases_set_every_field():
    """Every field of every section, nested ones included, takes two values among the shipped
    manifests and the cases (absent, as in a nested section left null, counts as one), so a
    renamed field or a changed default moves some pinned hash. A field added later needs a case
    of its own: setting it in an existing case would move that case's hash."""
    manifests = [load_manifest(TINY.parent / name) for name in SHIPPED]
    trees = [_leaves(content_dict(m)) for m in manifests + [build() for build in CASES.values()]]
    paths = set().union(*trees)
    values = {p: {json.dumps(t[p]) if p in t else "absent" for t in trees} for p in paths}
    one_value = sorted(p for p in paths if len(values[p]) < 2)
    # The fields whose type allows one value.
    assert one_value == ["model.arch", "schema_version", "topology.context_parallel"]


def _leaves(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    leaves = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            leaves.update(_leaves(value, f"{prefix}{key}."))
        else:
            leaves[f"{prefix}{key}"] = value
    return leaves
