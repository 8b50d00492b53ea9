"""``fp8ops preflight`` on the small model, judged by its JSON results.

* a clean, committed manifest with pinned fingerprints and explicit gates and alerts passes
  every item, the rehearsals trained for real (the TP change under torchrun, two ranks);
* each record item fails on a real input, naming it: an untracked or modified manifest, no
  gates section, an unpinned or wrong data fingerprint;
* a base whose weights are not the pinned ones fails the fingerprint item and, through the
  trainer's own refusal, every rehearsal;
* a run directory is judged from its records (run.json, its revision chain, its telemetry),
  and a run recorded under another torch fails the versions item with the field;
* bad input exits 2 with a message naming the path and what to do, and writes no results.

The manifests live in a git repository each test makes, so version control can pass and fail.
"""

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

if importlib.util.find_spec("megatron") is None:
    pytest.skip("needs the megatron extra: pip install -e '.[megatron]'", allow_module_level=True)

from support.small_model import MANIFESTS, SCHEDULE, SMALL_MODEL

from fp8ops.checkpoint import CheckpointDir
from fp8ops.checkpoint.weights import read_weights_meta
from fp8ops.data import build_data
from fp8ops.data.tokenizer import ByteTokenizer
from fp8ops.manifest import canonical_dict, derive, load_manifest, manifest_hash, write_manifest
from fp8ops.train import run_training

pytestmark = [
    pytest.mark.filterwarnings("ignore:MLP requires ffn_hidden_size:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:Warning. tp_group is None:DeprecationWarning"),
]

STEPS = 4  # --steps: the rehearsals stop at 2 and resume to 4
NO_REHEARSALS = ["--skip", "4", "--skip", "5", "--skip", "8", "--skip", "9"]
RECORD_ITEMS_ONLY = [*NO_REHEARSALS, "--skip", "6"]  # a manifest's item 6 reads a rehearsal


@pytest.fixture(scope="module")
def base(small_base) -> Path:
    """The shared small base's weights (read only): what the manifests fine-tune."""
    return small_base / "final"


@pytest.fixture(scope="module")
def pinned(base):
    """The CPU default on the small model, every fingerprint pinned to what is there."""
    small = derive(
        load_manifest(MANIFESTS / "tiny-gpt-cpu.yaml"),
        {
            **SMALL_MODEL,
            **SCHEDULE,
            "model.init_checkpoint": str(base),
            "data.num_examples": 400,
            "optimizer.lr": 2e-3,
            "schedule.train_steps": 4,
            "schedule.eval_interval": 4,
            "schedule.checkpoint_interval": 4,
            "telemetry.every_steps": 2,
            "telemetry.error_sample_every": 2,
        },
        "test: small",
    )
    return derive(
        small,
        {
            "model.fingerprint": read_weights_meta(base, field="base")["fingerprint"],
            "tokenizer.fingerprint": ByteTokenizer().fingerprint(),
            "data.fingerprint": build_data(small).fingerprint,
        },
        "test: pinned",
    )


@pytest.fixture
def repo(tmp_path) -> Path:
    path = tmp_path / "repo"
    path.mkdir()
    _git(path, "init", "-q")
    return path


def _git(repo: Path, *args: str) -> None:
    subprocess.run(
        ["git", "-C", str(repo), "-c", "user.name=test", "-c", "user.email=t@example", *args],
        check=True,
        capture_output=True,
    )


def _committed(repo: Path, manifest, name: str = "finetune.yaml") -> Path:
    file = write_manifest(manifest, repo / name)
    _git(repo, "add", name)
    _git(repo, "commit", "-q", "-m", f"add {name}")
    return file


def _preflight(cli, target: Path, tmp_path: Path, *args: object) -> tuple[int, dict, str]:
    results = tmp_path / "results.json"
    done = cli("preflight", target, "--json", results, *args)
    assert done.code in (0, 1), done.err
    return done.code, json.loads(results.read_text()), done.out


def _item(results: dict, key: str) -> dict:
    return next(item for item in results["items"] if item["key"] == key)


def _texts(item: dict, result: str | None = None) -> str:
    return "\n".join(e["text"] for e in item["evidence"] if result in (None, e["result"]))


# -- everything passes --------------------------------------------------------------------------


@pytest.mark.slow
def test_a_clean_committed_manifest_passes_every_item(cli, pinned, repo, tmp_path):
    file = _committed(repo, pinned)
    code, results, out = _preflight(cli, file, tmp_path, "--steps", STEPS)
    assert {i["key"]: i["result"] for i in results["items"]} == {
        "versions": "pass",
        "version-control": "pass",
        "fingerprints": "pass",
        "fp8-state": "pass",
        "bf16-control": "pass",
        "telemetry": "pass",
        "gates": "pass",
        "fallback": "pass",
        "topology": "pass",
    }, out
    assert code == 0 and results["exit_code"] == 0 and "ready to launch" in out
    assert results["summary"] == {"pass": 9, "fail": 0, "n/a": 0, "skipped": 0}
    assert results["mode"] == "manifest" and results["manifest"] == manifest_hash(pinned)

    assert "tracked by git and unmodified" in _texts(_item(results, "version-control"))
    facts = _item(results, "fingerprints")["facts"]
    assert facts["data.fingerprint"]["pinned"] == facts["data.fingerprint"]["actual"]
    # The rehearsal: bit-identical through a stop at 2 and a resume, the control twice alike.
    survived = _item(results, "fp8-state")
    losses = survived["facts"]["losses"]
    assert losses["straight"] == losses["resumed"] and len(losses["straight"]) == STEPS
    assert "FP8 state digests of all 8 modules bit-identical at step 4" in _texts(survived)
    control = _item(results, "bf16-control")["facts"]["losses"]
    assert control["first"] == control["second"] != losses["straight"]
    assert "8 modules x 4 steps" in _texts(_item(results, "telemetry"))
    fallback = _item(results, "fallback")
    module = fallback["facts"]["module"]
    assert f"fallbacks.json: {module} bf16 from step 3" in _texts(fallback)
    assert "FP8 state frozen" in _texts(fallback)
    topology = _item(results, "topology")
    assert "resumed at TP 2 from the TP 1 checkpoint of step 2 (2 processes)" in _texts(topology)
    assert "group0" in _texts(topology)
    gaps = topology["facts"]["relative_loss_gaps"]
    assert list(gaps) == ["3", "4"] and 0 <= max(gaps.values()) <= 2e-2
    # And at two pipeline stages, one layer each (torchrun's one thread per process against
    # this process's threads: close, not bitwise).
    assert "resumed at PP 2 from the PP 1 checkpoint of step 2 (2 processes)" in _texts(topology)
    gaps = topology["facts"]["pipeline_relative_loss_gaps"]
    assert list(gaps) == ["3", "4"] and 0 <= max(gaps.values()) <= 2e-2
    assert results["work_dir"] is None  # the rehearsal runs are gone


def test_the_pipeline_rehearsal_picks_a_size_the_manifest_allows():
    from fp8ops.preflight.rehearsal import other_pipeline_parallel

    plain = load_manifest(MANIFESTS / "tiny-gpt-cpu.yaml")
    assert other_pipeline_parallel(plain)[0] == {"pipeline_parallel": 2}
    staged = derive(plain, {"topology.pipeline_parallel": 2}, "t")
    assert other_pipeline_parallel(staged)[0] == {"pipeline_parallel": 1}
    padded = derive(plain, {"data.pad_to": "longest"}, "t")
    changes, invalid, too_big = other_pipeline_parallel(padded)
    assert changes is None and not too_big and "one fixed shape" in invalid[0], invalid


def test_a_rehearsal_writes_to_no_metric_sink_and_pages_nobody():
    from fp8ops.preflight.rehearsal import derived, fitted_changes

    plain = load_manifest(MANIFESTS / "tiny-gpt-cpu.yaml")
    reporting = {
        "logging.tensorboard": {},
        "logging.wandb": {"project": "team"},
        "logging.mlflow": {},
        "notifications.webhooks": [{"url_env": "ONCALL_WEBHOOK", "level": "stop"}],
    }
    rehearsal = derived(derive(plain, reporting, "t"), fitted_changes(plain, 4), "r")
    assert not rehearsal.logging.configured and rehearsal.notifications.webhooks == ()
    # A manifest without them rehearses as before: the same revision as without the rule.
    assert "logging" not in canonical_dict(derived(plain, fitted_changes(plain, 4), "r"))


# -- record items fail on real inputs -------------------------------------------------------------


def _without(manifest, section: str) -> str:
    data = canonical_dict(manifest)
    del data[section]
    return yaml.safe_dump(data, sort_keys=True)


@pytest.mark.parametrize(
    "case", ["untracked", "modified", "no gates", "unpinned data", "wrong data"]
)
def test_each_record_item_fails_with_its_evidence(cli, pinned, repo, tmp_path, case):
    item, expected = {
        "untracked": ("version-control", "not tracked by git"),
        "modified": ("version-control", "changed since its last commit"),
        "no gates": ("gates", "writes no gates section"),
        "unpinned data": ("fingerprints", "data.fingerprint is not pinned"),
        "wrong data": ("fingerprints", f"data.fingerprint is pinned to {'0' * 64}"),
    }[case]
    if case == "untracked":
        file = write_manifest(pinned, repo / "finetune.yaml")
    elif case == "modified":
        file = _committed(repo, pinned)
        file.write_text(file.read_text() + "# edited after the commit\n")
    elif case == "no gates":
        file = repo / "finetune.yaml"
        file.write_text(_without(pinned, "gates"))
        _git(repo, "add", file.name)
        _git(repo, "commit", "-q", "-m", "no gates")
    else:
        value = None if case == "unpinned data" else "0" * 64
        file = _committed(repo, derive(pinned, {"data.fingerprint": value}, "test"))

    code, results, _ = _preflight(cli, file, tmp_path, *RECORD_ITEMS_ONLY)
    assert code == 1 and results["exit_code"] == 1
    outcomes = {i["key"]: i["result"] for i in results["items"]}
    assert outcomes.pop(item) == "fail"
    assert set(outcomes.values()) == {"pass", "skipped"}  # only the item the input breaks fails
    assert expected in _texts(_item(results, item), "fail")
    assert results["summary"]["skipped"] == 5
    if case in ("unpinned data", "wrong data"):
        actual = build_data(pinned).fingerprint
        assert _item(results, item)["facts"]["data.fingerprint"]["actual"] == actual
    if case == "unpinned data":  # the value to pin, and the revision that pins it
        command = _item(results, item)["facts"]["pin_command"]
        assert f"fp8ops manifest derive {file} --set data.fingerprint={actual}" in command


def test_weights_other_than_the_pinned_ones_fail_the_fingerprints_and_every_rehearsal(
    cli, pinned, repo, tmp_path
):
    """Not a mock: the trainer itself refuses the base, so every rehearsal run fails."""
    file = _committed(repo, derive(pinned, {"model.fingerprint": "f" * 64}, "test: wrong"))
    code, results, _ = _preflight(cli, file, tmp_path, "--steps", STEPS)
    assert code == 1
    outcomes = {i["key"]: i["result"] for i in results["items"]}
    for key in ("fingerprints", "fp8-state", "bf16-control", "telemetry", "fallback", "topology"):
        assert outcomes[key] == "fail", key
    assert f"model.fingerprint is pinned to {'f' * 64}" in _texts(_item(results, "fingerprints"))
    for key in ("fp8-state", "bf16-control", "fallback", "topology"):
        assert f"model.fingerprint is {'f' * 64} but" in _texts(_item(results, key)), key


# -- a run directory --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def run(pinned, tmp_path_factory) -> Path:
    """A real small run, started as `fp8ops train FILE --run-dir RUN` from a committed file."""
    tmp = tmp_path_factory.mktemp("rundir")
    repo = tmp / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    file = _committed(repo, pinned)
    run = tmp / "run"
    argv = sys.argv
    sys.argv = ["fp8ops", "train", str(file), "--run-dir", str(run)]  # what run.json records
    try:
        run_training(file, run, progress=False)
    finally:
        sys.argv = argv
    return run


@pytest.mark.slow
def test_a_run_directory_is_judged_from_its_records(cli, run, pinned, tmp_path):
    code, results, out = _preflight(cli, run, tmp_path, *NO_REHEARSALS)
    assert code == 0, out
    assert results["mode"] == "run"
    outcomes = {i["key"]: i["result"] for i in results["items"]}
    for key in ("versions", "version-control", "fingerprints", "telemetry", "gates"):
        assert outcomes[key] == "pass", (key, out)
    assert "equal to the environment checkpoint step_00000004 recorded" in _texts(
        _item(results, "versions")
    )
    control = _item(results, "version-control")
    assert control["facts"]["chain_root"] == manifest_hash(pinned)
    assert "is the root of the run's revision chain" in _texts(control)
    assert "built now from the run's manifest, it hashes the same" in _texts(
        _item(results, "fingerprints")
    )
    assert "tokenizer: read now, it hashes the same" in _texts(_item(results, "fingerprints"))
    telemetry = _texts(_item(results, "telemetry"))
    assert "rank 0: steps 1-4 committed" in telemetry
    assert "cast statistics on the 2 steps due (every 2)" in telemetry
    assert "no item failed, but skipped items were not checked" in out


@pytest.mark.slow
def test_a_run_recorded_under_another_torch_fails_the_versions_item(cli, run, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    meta_file = CheckpointDir(copy).latest() / "fp8ops_checkpoint.json"
    meta = json.loads(meta_file.read_text())
    now = meta["environment"]["torch"]
    meta["environment"]["torch"] = "2.0.0"
    meta_file.write_text(json.dumps(meta))
    code, results, _ = _preflight(cli, copy, tmp_path, *NO_REHEARSALS)
    versions = _item(results, "versions")
    assert code == 1 and versions["result"] == "fail"
    assert f"torch '2.0.0' -> '{now}'" in _texts(versions, "fail")
    assert "refused as drift" in _texts(versions, "fail")
    assert versions["facts"]["drift"] == [{"field": "torch", "recorded": "2.0.0", "now": now}]


@pytest.mark.slow
def test_a_run_whose_tokenizer_changed_fails_the_fingerprints_item(cli, run, tmp_path):
    copy = Path(shutil.copytree(run, tmp_path / "run"))
    info = json.loads((copy / "run.json").read_text())
    now, info["tokenizer"]["fingerprint"] = info["tokenizer"]["fingerprint"], "0" * 64
    (copy / "run.json").write_text(json.dumps(info))
    code, results, _ = _preflight(cli, copy, tmp_path, *NO_REHEARSALS)
    item = _item(results, "fingerprints")
    assert code == 1 and item["result"] == "fail"
    assert f"hashes to {now}, not {'0' * 64}: a resume would encode and decode otherwise" in (
        _texts(item, "fail")
    )


@pytest.mark.slow
def test_a_run_whose_manifest_file_was_edited_fails_the_version_control_item(cli, run, tmp_path):
    copy = Path(shutil.copytree(run, tmp_path / "run"))
    file = copy / "manifest.yaml"
    file.write_text(file.read_text().replace("margin: 0", "margin: 1"))
    code, results, _ = _preflight(cli, copy, tmp_path, *NO_REHEARSALS)
    control = _item(results, "version-control")
    assert code == 1 and control["result"] == "fail"
    assert f"{file} hashes to " in _texts(control, "fail")
    assert "the file was edited after the run wrote it" in _texts(control, "fail")


# -- bad input --------------------------------------------------------------------------------------


def test_bad_input_exits_2_naming_the_path_and_what_to_do(cli, pinned, repo, tmp_path):
    results = tmp_path / "results.json"
    missing = cli("preflight", tmp_path / "nothing.yaml", "--json", results)
    assert missing.code == 2
    assert f"{tmp_path / 'nothing.yaml'}: no such file or directory" in missing.err
    assert "give a manifest file" in missing.err

    not_a_run = tmp_path / "somedir"
    not_a_run.mkdir()
    (not_a_run / "notes.txt").write_text("x")
    refused = cli("preflight", not_a_run, "--json", results)
    assert refused.code == 2
    assert f"{not_a_run} is a directory but not an fp8ops run (no run.json)" in refused.err

    broken = tmp_path / "broken.yaml"
    broken.write_text("schema_version: 1\nname: x\n")
    invalid = cli("preflight", broken, "--json", results)
    assert invalid.code == 2 and str(broken) in invalid.err

    file = _committed(repo, pinned)
    assert cli("preflight", file, "--steps", 1).code == 2
    unknown = cli("preflight", file, "--skip", "10")
    assert unknown.code == 2 and "not a checklist item" in unknown.err
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    occupied = cli("preflight", file, "--work-dir", busy, *RECORD_ITEMS_ONLY)
    assert occupied.code == 2 and f"--work-dir {busy}: not an empty directory" in occupied.err
    assert not results.exists()  # no results for input that was never checked


def test_a_dual_track_run_names_the_manifest_it_started_from(tmp_path, monkeypatch):
    """A track of `fp8ops dualtrack` records that command line; its manifest file is found as
    a train run's is (the bf16 track's chain then starts at a revision of that file)."""
    from fp8ops.preflight.target import resolve_target

    monkeypatch.chdir(tmp_path)
    manifest = shutil.copy(MANIFESTS / "tiny-gpt-cpu.yaml", tmp_path / "ft.yaml")
    track = tmp_path / "dt" / "bf16"
    track.mkdir(parents=True)
    shutil.copy(manifest, track / "manifest.yaml")
    command = ["fp8ops", "dualtrack", "--set", "schedule.train_steps=4", "ft.yaml", "--out", "dt"]
    (track / "run.json").write_text(json.dumps({"command": command}))
    target = resolve_target(track)
    assert target.manifest_file == Path("ft.yaml") and target.source_problem is None
