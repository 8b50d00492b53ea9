"""``fp8ops manifest ...``: exit codes, messages and output, through the real entry point.

Malformed manifests run through ``main`` in-process (fast: the precision package's torch
import is paid once); a sample of them, and the hash-stability check, also run as real
``python -m fp8ops`` processes, launched together so the suite stays quick.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from support.example_manifests import MINIMAL, ROOT, TINY

from fp8ops.manifest import load_manifest, manifest_hash

MISSING, DIRECTORY = object(), object()

# (id, file content, substrings the error must contain). Every row must also exit 2, name
# the file, print nothing on stdout and no traceback. MINIMAL has 14 lines; text appended
# to it starts at line 15.
MALFORMED = [
    ("missing-file", MISSING, ["no such file"]),
    ("directory", DIRECTORY, ["is a directory, not a manifest file"]),
    ("not-utf8", b"name: caf\xe9\n", ["not UTF-8 text (byte 0xe9 at offset 9)"]),
    (
        "empty",
        "",
        ["empty manifest; it needs at least schema_version, name, model, data, schedule"],
    ),
    ("comments-only", "# nothing yet\n", ["empty manifest"]),
    (
        "yaml-syntax",
        MINIMAL + "precision: {margin: 1\n",
        ["line 16, column 1: YAML syntax error: expected ',' or '}'"],
    ),
    (
        "tab-indent",
        MINIMAL.replace("  kind: tasks", "\tkind: tasks"),
        ["line 11, column 1: YAML syntax error", "'\\t'"],
    ),
    ("top-level-list", "- a\n- b\n", ["the top level must be a mapping of sections (got a list)"]),
    (
        "duplicate-key",
        MINIMAL + "precision:\n  margin: 1\n  margin: 2\n",
        ["precision.margin: duplicate key (first at line 16) [line 17]"],
    ),
    (
        "unknown-key",
        MINIMAL + "precision: {margn: 1}\n",
        [
            "precision.margn: unknown key (did you mean margin?); "
            "allowed here: amax_compute_algo, amax_epsilon, amax_history_len, backend, base_dtype,",
            "[line 15]",
        ],
    ),
    (
        "unknown-section",
        MINIMAL + "optimiser: {lr: 1}\n",
        [
            "optimiser: unknown key (did you mean optimizer?); allowed here: alerts, capability, data,"
        ],
    ),
    (
        "missing-section",
        MINIMAL.replace("data:\n  kind: tasks\n", ""),
        ["data: required field missing"],
    ),
    (
        "missing-field",
        MINIMAL.replace("  seq_length: 64\n", ""),
        ["model.seq_length: required field missing"],
    ),
    (
        "quoted-int",
        MINIMAL + "precision: {amax_history_len: '16'}\n",
        [
            "precision.amax_history_len: must be an integer "
            "(got string '16'; write it without quotes) [line 15]"
        ],
    ),
    (
        "bool-for-int",
        MINIMAL.replace("num_layers: 2", "num_layers: yes"),
        ["model.num_layers: must be an integer (got boolean true) [line 4]"],
    ),
    (
        "string-for-section",
        MINIMAL + "precision: fast\n",
        ["precision: must be a mapping (got string 'fast') [line 15]"],
    ),
    (
        "mapping-for-number",
        MINIMAL + "optimizer: {clip_grad: {max: 1}}\n",
        ["optimizer.clip_grad: must be a number or null (got a mapping)"],
    ),
    (
        "out-of-range",
        MINIMAL + "precision: {amax_history_len: 0}\n",
        ["precision.amax_history_len: must be >= 1 (got 0) [line 15]"],
    ),
    (
        "fraction-out-of-range",
        MINIMAL.replace("kind: tasks", "kind: tasks\n  eval_fraction: 0.7"),
        ["data.eval_fraction: must be <= 0.5 (got 0.7) [line 12]"],
    ),
    (
        "nan",
        MINIMAL + "gates: {loss_gap: .nan}\n",
        ["gates.loss_gap: must be a finite number (got .nan)"],
    ),
    (
        "e5m2",
        MINIMAL + "precision: {fp8_format: e5m2}\n",
        [
            "precision.fp8_format: pure E5M2 training is not supported",
            '"Pure E5M2 training is not supported"',
            "use 'hybrid', which gives E5M2 to gradients",
            "(got 'e5m2')",
        ],
    ),
    (
        "unknown-format",
        MINIMAL + "precision: {fp8_format: E4M3}\n",
        ["precision.fp8_format: must be 'hybrid' or 'e4m3' (got 'E4M3')"],
    ),
    (
        "unknown-algorithm",
        MINIMAL + "precision: {amax_compute_algo: p99}\n",
        [
            "precision.amax_compute_algo: unknown amax_compute_algo 'p99'",
            "'max', 'most_recent', 'quantile:Q'",
            "'trimmed_max:K'",
        ],
    ),
    (
        "trimmed-max-beyond-history",
        MINIMAL + "precision: {amax_history_len: 16, amax_compute_algo: 'trimmed_max:16'}\n",
        [
            "precision.amax_compute_algo: trimmed_max:K needs K < amax_history_len (16) "
            "(got 'trimmed_max:16')"
        ],
    ),
    (
        "empty-include-list",
        MINIMAL + "precision: {include_modules: []}\n",
        ["precision.include_modules: must list at least one module glob", "(got [])"],
    ),
    (
        "bad-glob",
        MINIMAL + "precision:\n  include_modules: ['*.linear_qkv', '*.linear qkv']\n",
        ["precision.include_modules[1]: contains ' '", "(got '*.linear qkv') [line 16]"],
    ),
    (
        "nested-list-for-glob",
        MINIMAL + "precision: {include_modules: [['*.linear_qkv']]}\n",
        ["precision.include_modules[0]: must be a string (got a list) [line 15]"],
    ),
    (
        "non-string-key",
        MINIMAL + "precision: {3: 1}\n",
        ["precision: keys must be strings (got integer key 3)"],
    ),
    (
        "unbalanced-glob",
        MINIMAL + "precision: {exclude_modules: ['*.layers.[0']}\n",
        ["precision.exclude_modules[0]: has an unbalanced '[' or ']' (got '*.layers.[0')"],
    ),
    (
        "duplicate-glob",
        MINIMAL
        + "precision: {include_modules: ['*.linear_qkv', '*.linear_fc1', '*.linear_qkv']}\n",
        ["precision.include_modules[2]: duplicate of item [0] (got '*.linear_qkv')"],
    ),
    (
        "bad-name",
        MINIMAL.replace("name: minimal", "name: Tiny GPT"),
        ["name: must start with a lowercase letter or digit", "(got 'Tiny GPT') [line 2]"],
    ),
    (
        "schema-version",
        MINIMAL.replace("schema_version: 1", "schema_version: 2"),
        ["schema_version: must be 1 (got 2) [line 1]"],
    ),
    (
        "revision-without-parent",
        MINIMAL + "revision: {number: 1}\n",
        [
            "revision.parent: revision 1 needs its parent's sha256 (got null)",
            "revision.reason: a derived revision needs a non-empty reason (got null)",
        ],
    ),
    (
        "alert-levels-out-of-order",
        MINIMAL + "alerts: {saturation: {observe: 0.5, degrade: 0.1, stop: 0.9}}\n",
        ["alerts.saturation.degrade: must be >= observe (0.5) (got 0.1)"],
    ),
    (
        "scale-change-ratio",
        MINIMAL + "alerts: {scale_change: {observe: 1}}\n",
        ["alerts.scale_change.observe: must be > 1 (got 1)"],
    ),
    (
        "heads-vs-tensor-parallel",
        MINIMAL + "topology: {tensor_parallel: 3}\n",
        [
            "model.num_attention_heads: must be divisible by topology.tensor_parallel (3) (got 4)",
            "model.ffn_hidden_size: must be divisible by topology.tensor_parallel (3) (got 256)",
        ],
    ),
    (
        "query-groups-vs-tensor-parallel",
        MINIMAL.replace("num_attention_heads: 4", "num_attention_heads: 4\n  num_query_groups: 2")
        + "topology: {tensor_parallel: 4}\n",
        ["model.num_query_groups: must be divisible by topology.tensor_parallel (4) (got 2)"],
    ),
    (
        "byte-vocab-too-small",
        MINIMAL.replace("vocab_size: 256", "vocab_size: 100"),
        ["model.vocab_size: must be >= 256 for byte tokens (got 100)"],
    ),
    (
        "layers-vs-pipeline-parallel",
        MINIMAL + "topology: {pipeline_parallel: 4}\n",
        ["model.num_layers: must be divisible by topology.pipeline_parallel (4) (got 2)"],
    ),
    (
        "batch-vs-data-parallel",
        MINIMAL + "topology: {data_parallel: 3}\n",
        [
            "schedule.global_batch_size: must be divisible by "
            "schedule.micro_batch_size * topology.data_parallel (3) (got 8)"
        ],
    ),
    (
        "hidden-vs-heads",
        MINIMAL.replace("hidden_size: 64", "hidden_size: 66"),
        ["model.hidden_size: must be divisible by num_attention_heads (4) (got 66)"],
    ),
    (
        "warmup-beyond-steps",
        MINIMAL.replace("train_steps: 10", "train_steps: 10\n  warmup_steps: 20"),
        ["schedule.warmup_steps: must be <= train_steps (10) (got 20)"],
    ),
    (
        "min-lr-above-lr",
        MINIMAL + "optimizer: {lr: 1e-4, min_lr: 1e-3}\n",
        ["optimizer.min_lr: must be <= lr (0.0001) (got 0.001)"],
    ),
    (
        "jsonl-without-path",
        MINIMAL.replace("kind: tasks", "kind: jsonl"),
        ["data.path: required for kind 'jsonl' (got null)"],
    ),
    (
        "several-problems",
        MINIMAL + "precision: {margin: -1, fp8_format: e5m2}\noptimizer: {beta2: 1}\n",
        [
            ": 3 problems\n",
            "\n  precision.fp8_format: pure E5M2",
            "\n  precision.margin: must be >= 0 (got -1) [line 15]",
            "\n  optimizer.beta2: must be < 1 (got 1) [line 16]",
        ],
    ),
]


def write_case(directory: Path, content: object) -> Path:
    path = directory / "manifest.yaml"
    if content is DIRECTORY:
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif isinstance(content, str):
        path.write_text(content)
    return path


def check_user_error(code: int, out: str, err: str, source: object, expected: list[str]) -> None:
    """Exit 2, nothing on stdout, no traceback, the message starts with ``<source>: ``."""
    assert code == 2, err
    assert "Traceback" not in out + err
    assert out == ""
    assert err.startswith(f"{source}: "), err
    for fragment in expected:
        assert fragment in err, f"{fragment!r} not in:\n{err}"
    assert "errors.pydantic.dev" not in err


@pytest.mark.parametrize(
    ("content", "expected"), [row[1:] for row in MALFORMED], ids=[row[0] for row in MALFORMED]
)
def test_malformed_manifest_is_a_clean_user_error(cli, tmp_path, content, expected):
    path = write_case(tmp_path, content)
    result = cli("manifest", "validate", path)
    check_user_error(result.code, result.out, result.err, path, expected)


# --------------------------------------------------------------------------------------
# Real processes
# --------------------------------------------------------------------------------------

IN_SUBPROCESS = ["duplicate-key", "e5m2", "several-problems"]

REFORMATTED = """\
# MINIMAL again, another way round
schedule: {global_batch_size: 8, train_steps: 10}
data: {kind: tasks}
model: {vocab_size: 256, seq_length: 64, num_attention_heads: 4,
        ffn_hidden_size: 256, hidden_size: 64, num_layers: 2}
name: 'minimal'
precision: {amax_history_len: 1024, margin: 0}   # defaults, written out
schema_version: 1
"""


@pytest.fixture(scope="module")
def processes(tmp_path_factory):
    """Run every ``python -m fp8ops`` check of this module at once; results by name."""
    commands = {}
    for name, content, _ in (row for row in MALFORMED if row[0] in IN_SUBPROCESS):
        path = write_case(tmp_path_factory.mktemp(name), content)
        commands[name] = (path, ["manifest", "validate", str(path)])
    for name, text in (("hash-block", MINIMAL), ("hash-flow", REFORMATTED)):
        path = tmp_path_factory.mktemp(name) / "manifest.yaml"
        path.write_text(text)
        commands[name] = (path, ["manifest", "hash", str(path)])
    running = {
        name: subprocess.Popen(
            [sys.executable, "-m", "fp8ops", *args],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name, (_, args) in commands.items()
    }
    results = {}
    for name, proc in running.items():
        out, err = proc.communicate(timeout=120)
        results[name] = (commands[name][0], proc.returncode, out, err)
    return results


@pytest.mark.parametrize("name", IN_SUBPROCESS)
def test_malformed_manifest_exit_code_of_a_real_process(processes, name):
    path, code, out, err = processes[name]
    expected = next(row[2] for row in MALFORMED if row[0] == name)
    check_user_error(code, out, err, path, expected)


def test_hash_is_stable_across_formatting_in_real_processes(processes):
    _, block_code, block_hash, _ = processes["hash-block"]
    flow_path, flow_code, flow_hash, _ = processes["hash-flow"]
    assert (block_code, flow_code) == (0, 0)
    assert block_hash == flow_hash == manifest_hash(load_manifest(flow_path)) + "\n"


# --------------------------------------------------------------------------------------
# Commands
# --------------------------------------------------------------------------------------


def test_validate_prints_a_summary(cli):
    result = cli("manifest", "validate", TINY)
    assert result.code == 0, result.err
    assert f"{TINY}: valid" in result.out
    assert manifest_hash(load_manifest(TINY)) in result.out
    assert "tiny-gpt-cpu" in result.out
    assert "0 (root)" in result.out
    assert "hybrid FP8, delayed scaling, history 16 (max), margin 0, base bf16" in result.out
    assert "off (every included module runs FP8)" in result.out


def test_validate_reads_the_inputs_only_when_asked(cli, tmp_path):
    result = cli("manifest", "validate", TINY, "--inputs")
    assert result.code == 0, result.err
    assert f"{TINY}: valid, and its inputs read" in result.out
    assert "data            built-in tasks, 6,000 examples; eval_fraction 0.1" in result.out
    words = " ".join(result.out.split())  # the table folds long rows
    assert "5,416 train and 584 eval sequences, fingerprint c80632b74fe5" in words
    # A manifest for another machine validates as a manifest; its inputs are refused by name.
    elsewhere = tmp_path / "elsewhere.yaml"
    elsewhere.write_text(
        TINY.read_text().replace(
            "tokenizer:\n  kind: byte",
            f"tokenizer:\n  kind: huggingface\n  path: {tmp_path / 'no'}",
        )
    )
    assert cli("manifest", "validate", elsewhere).code == 0
    refused = cli("manifest", "validate", elsewhere, "--inputs")
    assert refused.code == 2 and refused.err.startswith(
        f"{elsewhere}: tokenizer.path: {tmp_path / 'no'}: no such file"
    ), refused.err
    short = tmp_path / "short.yaml"
    short.write_text(TINY.read_text().replace("seq_length: 128", "seq_length: 8"))
    refused = cli("manifest", "validate", short, "--inputs")
    assert refused.code == 2 and f"{short}: model.seq_length: 8 is too short" in refused.err


def test_hash_prints_only_the_hash(cli):
    result = cli("manifest", "hash", TINY)
    assert (result.code, result.out) == (0, manifest_hash(load_manifest(TINY)) + "\n")


def test_diff_exit_codes_follow_diff(cli, tmp_path):
    same = tmp_path / "same.yaml"
    same.write_text(TINY.read_text().replace("# The CPU default", "# reworded comment"))
    identical = cli("manifest", "diff", TINY, same)
    assert identical.code == 0
    assert "identical" in identical.out

    changed = tmp_path / "changed.yaml"
    text = TINY.read_text()
    changed.write_text(
        text.replace("margin: 0", "margin: 2").replace("train_steps: 300", "train_steps: 600")
    )
    different = cli("manifest", "diff", TINY, changed)
    assert different.code == 1
    assert "2 field(s) differ" in different.out
    for line in ("precision.margin", "schedule.train_steps"):
        assert line in different.out
    assert "precision.amax_history_len" not in different.out

    broken = tmp_path / "broken.yaml"
    broken.write_text("schema_version: 1\n")
    assert cli("manifest", "diff", TINY, broken).code == 2


def test_derive_then_chain(cli, tmp_path):
    store = tmp_path / "store"
    first = cli(
        "manifest",
        "derive",
        TINY,
        "--set",
        "precision.margin=1",
        "--set",
        "optimizer.lr=2e-3",
        "--reason",
        "more headroom",
        "--out",
        tmp_path / "r1.yaml",
        "--store",
        store,
    )
    assert first.code == 0, first.err
    r1 = load_manifest(tmp_path / "r1.yaml")
    assert (r1.precision.margin, r1.optimizer.lr, r1.revision.number) == (1, 2e-3, 1)
    assert first.out == manifest_hash(r1) + "\n"

    second = cli(
        "manifest",
        "derive",
        tmp_path / "r1.yaml",
        "--set",
        "precision.amax_history_len=32",
        "--reason",
        "longer window",
        "--store",
        store,
    )
    assert second.code == 0, second.err

    listing = cli("manifest", "chain", store)
    assert listing.code == 0, listing.err
    assert "3 revision(s), verified" in listing.out
    hashes = [manifest_hash(load_manifest(TINY)), manifest_hash(r1), second.out.strip()]
    positions = [listing.out.index(h[:12]) for h in hashes]
    assert positions == sorted(positions)  # root first
    assert "more headroom" in listing.out and "longer window" in listing.out

    # A manifest file inside the store names its own chain.
    head_file = store / f"{hashes[1]}.yaml"
    assert "2 revision(s), verified" in cli("manifest", "chain", head_file).out


def test_derive_refuses_to_overwrite_a_different_file(cli, tmp_path):
    out = tmp_path / "r1.yaml"
    args = ["manifest", "derive", TINY, "--reason", "r", "--out", out]
    assert cli(*args, "--set", "precision.margin=1").code == 0
    assert cli(*args, "--set", "precision.margin=1").code == 0  # same content again: fine
    refused = cli(*args, "--set", "precision.margin=2")
    check_user_error(refused.code, refused.out, refused.err, out, ["refusing to overwrite"])
    assert load_manifest(out).precision.margin == 1


def test_derive_reports_a_bad_value_by_path(cli, tmp_path):
    result = cli(
        "manifest",
        "derive",
        TINY,
        "--set",
        "precision.amax_history_len=0",
        "--reason",
        "r",
        "--out",
        tmp_path / "x.yaml",
    )
    expected = ["precision.amax_history_len: must be >= 1 (got 0)"]
    check_user_error(result.code, result.out, result.err, f"{TINY} with --set", expected)
    assert not (tmp_path / "x.yaml").exists()


def test_derive_needs_somewhere_to_write(cli):
    result = cli("manifest", "derive", TINY, "--set", "precision.margin=1", "--reason", "r")
    assert result.code == 2
    assert "Traceback" not in result.out + result.err


def test_chain_exits_2_naming_a_tampered_file(cli, tmp_path):
    store = tmp_path / "store"
    assert (
        cli(
            "manifest",
            "derive",
            TINY,
            "--set",
            "precision.margin=1",
            "--reason",
            "r",
            "--store",
            store,
        ).code
        == 0
    )
    child = next(p for p in store.iterdir() if "margin: 1" in p.read_text())
    child.write_text(child.read_text().replace("margin: 1", "margin: 3"))
    result = cli("manifest", "chain", store)
    check_user_error(
        result.code, result.out, result.err, child, ["the file was changed after it was stored"]
    )


def test_chain_asks_for_a_head_when_there_are_several(cli, tmp_path):
    store = tmp_path / "store"
    for margin in (1, 2):
        args = ["--set", f"precision.margin={margin}", "--reason", "r", "--store", store]
        assert cli("manifest", "derive", TINY, *args).code == 0
    result = cli("manifest", "chain", store)
    check_user_error(
        result.code, result.out, result.err, store, ["name the head revision; heads found:"]
    )
