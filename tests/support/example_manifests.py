"""Shared by the manifest tests: the example manifests and a minimal valid one."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "manifests" / "tiny-gpt-cpu.yaml"
LLAMA = ROOT / "manifests" / "llama3-8b-h100.yaml"

# The smallest valid manifest: the five required sections, everything else defaulted.
MINIMAL = """\
schema_version: 1
name: minimal
model:
  num_layers: 2
  hidden_size: 64
  ffn_hidden_size: 256
  num_attention_heads: 4
  seq_length: 64
  vocab_size: 256
data:
  kind: tasks
schedule:
  train_steps: 10
  global_batch_size: 8
"""
