"""The immutable run manifest: schema, loading with precise errors, hashing, revisions."""

from fp8ops.manifest.canonical import (
    FieldChange,
    canonical_dict,
    canonical_json,
    content_dict,
    diff_manifests,
    manifest_hash,
    to_yaml,
)
from fp8ops.manifest.load import load_manifest, parse_manifest
from fp8ops.manifest.revisions import ManifestStore, derive, parse_assignments, write_manifest
from fp8ops.manifest.schema import (
    Alerts,
    DataConfig,
    Gates,
    Levels,
    Manifest,
    ModelConfig,
    OptimizerConfig,
    PrecisionPolicy,
    Revision,
    Schedule,
    Seeds,
    SmallGemmRule,
    Telemetry,
    TokenizerConfig,
    Topology,
)
from fp8ops.manifest.yaml_io import ManifestLoader

__all__ = [
    "Alerts",
    "DataConfig",
    "FieldChange",
    "Gates",
    "Levels",
    "Manifest",
    "ManifestLoader",
    "ManifestStore",
    "ModelConfig",
    "OptimizerConfig",
    "PrecisionPolicy",
    "Revision",
    "Schedule",
    "Seeds",
    "SmallGemmRule",
    "Telemetry",
    "TokenizerConfig",
    "Topology",
    "canonical_dict",
    "canonical_json",
    "content_dict",
    "derive",
    "diff_manifests",
    "load_manifest",
    "manifest_hash",
    "parse_assignments",
    "parse_manifest",
    "to_yaml",
    "write_manifest",
]
