"""Capability evaluation (``fp8ops.evaluate``) on the small model, a real Megatron GPT in FP8:

* the batched greedy generator against a slow reference (one row at a time, every step
  recomputed over the full, padded sequence), whatever the batching; padded-vocabulary ids are
  never produced, however high their logits; the seq_length stop;
* the records: exact schema, per-bucket counts adding up, latest line per step, torn lines,
  a damaged predictions file refused;
* the run: training (losses, FP8 state, weights, optimizer, telemetry) bit for bit the same as
  with capability evaluation off; stop + resume gives the same records as a straight run; text
  data and ``enabled: false`` skip it; at TP=2 both ranks produce the same answers.

The model starts from random weights (no base run) and fine-tunes at a low learning rate, so
its continuations stay varied: a model that answers "" everywhere would make the comparisons
below vacuous. The generator's test picks its stop token so that some continuations end at it
and others at ``max_new_tokens``.
"""

import contextlib
import importlib.util
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

if importlib.util.find_spec("megatron") is None:
    pytest.skip("needs the megatron extra: pip install -e '.[megatron]'", allow_module_level=True)

import torch
from support.small_model import MANIFESTS, SCHEDULE, SMALL_MODEL, write_derived

from fp8ops.checkpoint import read_meta
from fp8ops.checkpoint.directory import checkpoint_name
from fp8ops.data import EOD, ByteTokenizer, build_data
from fp8ops.errors import Fp8opsError, ManifestError
from fp8ops.evaluate.capability import capability_examples, evaluate_capability, generate
from fp8ops.evaluate.records import read_capability, read_predictions, score
from fp8ops.files import read_jsonl
from fp8ops.manifest import derive, load_manifest
from fp8ops.run import read_metrics
from fp8ops.start import New
from fp8ops.telemetry import open_run
from fp8ops.train import open_trainer, resume_training, run_training
from fp8ops.train.distributed import init_distributed, shutdown_distributed

pytestmark = [
    pytest.mark.filterwarnings("ignore:MLP requires ffn_hidden_size:DeprecationWarning"),
    pytest.mark.filterwarnings("ignore:Warning. tp_group is None:DeprecationWarning"),
]

N = 4  # steps between evaluations (loss, capability, checkpoint); the run is 2N steps
ITEMS, MAX_NEW = 16, 8  # the run's capability.items and max_new_tokens
GENERATE = 16  # max_new_tokens in the generator's tests
SEQ_LENGTH, VOCAB = SMALL_MODEL["model.seq_length"], 256
RECORD_KEYS = {
    "step",
    "items",
    "correct",
    "accuracy",
    "buckets",
    "seconds",
    "predictions",
    "predictions_sha256",
}
ITEM_KEYS = {"index", "key", "prompt", "answer", "generated", "correct", "buckets"}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """This model's GEMMs are tiny: a second thread only adds synchronisation, and on a busy
    CPU it waits for a core (one batched generation: 0.19 s on one thread, 4.3 s on two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def manifest(tmp_path_factory) -> Path:
    return write_derived(
        tmp_path_factory.mktemp("capability") / "finetune.yaml",
        MANIFESTS / "tiny-gpt-cpu.yaml",
        {
            **SMALL_MODEL,
            **SCHEDULE,
            "schedule.eval_iters": 2,
            "model.init_checkpoint": None,
            "data.num_examples": 400,
            "optimizer.lr": 1e-4,
            "optimizer.min_lr": 1e-5,
            "schedule.train_steps": 2 * N,
            "schedule.eval_interval": N,
            "schedule.checkpoint_interval": N,
            "telemetry.every_steps": 1,
            "telemetry.error_sample_every": 2,
            "capability.interval": N,
            "capability.items": ITEMS,
            "capability.max_new_tokens": MAX_NEW,
        },
    )


@pytest.fixture(scope="module")
def straight(manifest, tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("straight") / "run"
    run_training(manifest, run, progress=False)
    return run


@contextlib.contextmanager
def _trainer(manifest: Path, run_dir: Path, changes: dict | None = None):
    """The run's Trainer in this process, before its first step (random weights)."""
    loaded = load_manifest(manifest)
    if changes:
        loaded = derive(loaded, changes, "test")
    ranks = init_distributed(loaded.topology, source="test")
    try:
        trainer = open_trainer(New(loaded, [loaded], run_dir, "test"), ranks, progress=False)
        yield trainer
        trainer.telemetry.close()
    finally:
        shutdown_distributed()


@pytest.fixture
def trainer(manifest, tmp_path):
    """The run's model at its random initial weights."""
    with _trainer(manifest, tmp_path / "run") as trainer:
        yield trainer


# -- the generator -------------------------------------------------------------------------


def _prompts(trainer) -> list[list[int]]:
    return [ByteTokenizer().encode(e.prompt) for e in trainer.inputs.capability_examples]


def _generate(
    trainer, prompts, max_new_tokens=GENERATE, vocab_size=VOCAB, length_multiple=1, eod=EOD
) -> list[list[int]]:
    with trainer.evaluator.held_out():
        return generate(
            trainer.model,
            prompts,
            max_new_tokens=max_new_tokens,
            seq_length=SEQ_LENGTH,
            vocab_size=vocab_size,
            eod=eod,
            fp8=trainer.fp8,
            length_multiple=length_multiple,
        )


def _reference(
    trainer, prompt: list[int], max_new_tokens: int = GENERATE, eod: int = EOD
) -> list[int]:
    """Greedy decoding the slow way: one row, every step a forward over all seq_length positions
    (the row right-padded, as in training), the next token read at the row's last one."""
    row, new = list(prompt), []
    with trainer.evaluator.held_out():
        while len(new) < max_new_tokens and len(row) <= SEQ_LENGTH:
            tokens = torch.zeros(1, SEQ_LENGTH, dtype=torch.int64)
            tokens[0, : len(row)] = torch.tensor(row)
            positions = torch.arange(SEQ_LENGTH).unsqueeze(0)
            with trainer.fp8():
                logits = trainer.model(tokens, positions, None)  # [1, s, padded vocab]
            token = int(logits[0, len(row) - 1, :VOCAB].argmax())
            row.append(token)
            new.append(token)
            if token == eod:
                break
    return new


@pytest.mark.slow
def test_generation_matches_the_slow_reference(trainer):
    prompts = _prompts(trainer)
    # Whether random weights ever produce end-of-document is luck: the stop token is instead one
    # that some full-length continuations contain and others do not, so both ways of stopping
    # occur whatever the weights.
    full = _generate(trainer, prompts, eod=-1)
    counts = Counter(t for c in full for t in set(c))
    stop = min((t for t in counts if counts[t] < len(full)), key=lambda t: (-counts[t], t))
    batched = _generate(trainer, prompts, eod=stop)
    assert batched == [_reference(trainer, p, eod=stop) for p in prompts]
    # Not vacuous: both ways of stopping occur, and the answers differ.
    assert any(c[-1] == stop for c in batched) and any(len(c) == GENERATE for c in batched)
    assert len({tuple(c) for c in batched}) > len(batched) // 2


def test_rows_padded_for_tes_fp8_gemms_give_the_same_answers(trainer):
    """TE's FP8 GEMMs take token counts in multiples of 8: generation pads each forward's rows
    that far; causal attention keeps the padding out of every logit a row reads."""
    prompts = _prompts(trainer)
    lengths = []
    hook = trainer.model.register_forward_pre_hook(lambda _, args: lengths.append(args[0].shape[1]))
    try:
        padded = _generate(trainer, prompts, length_multiple=8)
    finally:
        hook.remove()
    assert padded == _generate(trainer, prompts)
    assert lengths and all(s % 8 == 0 for s in lengths)
    assert len(set(lengths)) > 1  # the batch grows as it generates
    with pytest.raises(ValueError, match=f"seq_length {SEQ_LENGTH} is not a multiple of 48"):
        _generate(trainer, prompts, length_multiple=48)


@pytest.mark.slow
def test_batching_and_order_do_not_change_answers(trainer):
    prompts = _prompts(trainer)
    together = _generate(trainer, prompts)  # (one row at a time: the reference test above)
    assert _generate(trainer, prompts[::-1])[::-1] == together
    # The same through the evaluation itself, at micro-batch sizes 4 (the manifest's) and 3.
    texts = [ByteTokenizer().decode(c) for c in together]
    for size in (4, 3):
        manifest = derive(
            trainer.manifest,
            {
                "schedule.micro_batch_size": size,
                "schedule.global_batch_size": 2 * size,
                "capability.max_new_tokens": GENERATE,
            },
            "test",
        )
        with trainer.evaluator.held_out():
            predictions = evaluate_capability(
                trainer.model,
                trainer.inputs.capability_examples,
                manifest,
                trainer.inputs.tokenizer,
                fp8=trainer.fp8,
            )
        assert [p["generated"] for p in predictions] == texts
        assert [p["index"] for p in predictions] == list(range(ITEMS))


def _winning(first_id: int):
    """A forward hook on the output layer making the logits of ids >= first_id the largest."""

    def hook(module, args, output):
        logits, bias = output
        logits = logits.clone()
        logits[..., first_id:] = 1e4  # [s, b, padded vocab]
        return logits, bias

    return hook


def _with_hook(trainer, hook, run):
    handle = trainer.model.output_layer.register_forward_hook(hook)
    try:
        return run()
    finally:
        handle.remove()


@pytest.mark.slow
def test_padded_vocabulary_ids_are_never_produced(manifest, tmp_path):
    """vocab_size 300 (byte tokens need >= 256): 384 embedding rows, 84 of them padding; ids
    256-299 are real to the model but not bytes. Made the most likely by far, neither kind is
    produced, and the answers do not change."""
    with _trainer(manifest, tmp_path / "run", {"model.vocab_size": 300}) as trainer:
        assert trainer.model.vocab_size == 384
        prompts = _prompts(trainer)
        plain = _generate(trainer, prompts, vocab_size=300)
        padding_wins = _with_hook(
            trainer, _winning(300), lambda: _generate(trainer, prompts, vocab_size=300)
        )
        assert padding_wins == plain and max(max(c) for c in plain) < 300

        def answers():
            with trainer.evaluator.held_out():
                return evaluate_capability(
                    trainer.model,
                    trainer.inputs.capability_examples,
                    trainer.manifest,
                    trainer.inputs.tokenizer,
                    fp8=trainer.fp8,
                )

        assert _with_hook(trainer, _winning(256), answers) == answers()  # decodable bytes only


def test_a_row_stops_when_it_fills_the_sequence(trainer):
    prompt = ByteTokenizer().encode("sort 3142 = " * 6)[: SEQ_LENGTH - 2]
    (continuation,) = _generate(trainer, [prompt], max_new_tokens=16)
    assert continuation == _reference(trainer, prompt, max_new_tokens=16)
    # Prompt and continuation fill at most seq_length + 1 tokens, a training window.
    assert len(continuation) == 3 or continuation[-1] == EOD
    with pytest.raises(ValueError, match="1 to 64 tokens"):
        _generate(trainer, [prompt + [32] * 3])


# -- which items ---------------------------------------------------------------------------


def test_items_are_the_first_of_the_eval_split(manifest):
    loaded = load_manifest(manifest)
    data = build_data(loaded)
    assert capability_examples(data, loaded.capability, ByteTokenizer()) == list(
        data.eval.examples[:ITEMS]
    )
    everything = derive(loaded, {"capability.items": None}, "test").capability
    assert capability_examples(data, everything, ByteTokenizer()) == list(data.eval.examples)
    off = derive(loaded, {"capability.enabled": False}, "test").capability
    assert capability_examples(data, off, ByteTokenizer()) == []
    no_eval = derive(loaded, {"data.eval_fraction": 0.0}, "test")
    assert capability_examples(build_data(no_eval), no_eval.capability, ByteTokenizer()) == []


def test_more_items_than_the_eval_split_holds_are_said_not_silently_cut(manifest, tmp_path, capsys):
    with _trainer(manifest, tmp_path / "run", {"capability.items": 100_000}) as trainer:
        held_out = len(trainer.data.eval)
        assert len(trainer.inputs.capability_examples) == held_out
    assert (
        f"warning: capability.items is 100000, but the eval split holds {held_out} items; "
        "all of them are evaluated"
    ) in capsys.readouterr().err
    with _trainer(manifest, tmp_path / "run2"):
        pass
    assert "capability.items" not in capsys.readouterr().err


def test_answers_longer_than_max_new_tokens_are_refused(manifest):
    """An answer longer than generation may run can never be right: with every answer that
    long both runs of a comparison would score 0 and pass the accuracy gate. Refused, named."""
    loaded = derive(load_manifest(manifest), {"capability.max_new_tokens": 2}, "test")
    data = build_data(loaded)
    examples = list(data.eval.examples[:ITEMS])
    too_long = [e for e in examples if len(e.answer) > 2]
    assert too_long and len(too_long) < len(examples)
    with pytest.raises(ManifestError) as err:
        capability_examples(data, loaded.capability, ByteTokenizer())
    longest = max(len(e.answer) for e in examples)
    assert str(err.value) == (
        f"capability.max_new_tokens: 2 is too few for {len(too_long)} of the {ITEMS} capability "
        f"items, which could never be answered right; the longest answer is {longest} tokens. "
        f"Raise capability.max_new_tokens to at least {longest}, or lower capability.items to "
        "leave out long answers"
    )
    enough = derive(loaded, {"capability.max_new_tokens": longest}, "test")
    assert capability_examples(data, enough.capability, ByteTokenizer()) == examples


def test_text_data_has_no_capability_evaluation(tmp_path):
    manifest = write_derived(
        tmp_path / "base.yaml",
        MANIFESTS / "tiny-gpt-cpu-base.yaml",
        {
            **SMALL_MODEL,
            **SCHEDULE,
            "schedule.train_steps": 1,
            "schedule.eval_iters": 1,
            "capability.interval": 1,
        },
    )
    result = run_training(manifest, tmp_path / "run", progress=False)
    assert result.capability_accuracy is None
    assert not (tmp_path / "run" / "capability.jsonl").exists()
    assert not (tmp_path / "run" / "capability").exists()
    events = [e["event"] for e in read_jsonl(tmp_path / "run" / "events.jsonl")]
    assert "evaluated" in events and "capability_evaluated" not in events


# -- the records ---------------------------------------------------------------------------


@pytest.mark.slow
def test_records_have_the_schema_and_add_up(straight):
    records = read_capability(straight)
    assert [r["step"] for r in records] == [N, 2 * N]
    for record in records:
        assert set(record) == RECORD_KEYS
        assert record["predictions"] == f"capability/step_{record['step']:08d}.jsonl"
        predictions = read_predictions(straight, record)
        assert [p["index"] for p in predictions] == list(range(ITEMS))
        assert all(set(p) == ITEM_KEYS for p in predictions)
        assert record["items"] == ITEMS
        assert record["correct"] == sum(p["correct"] for p in predictions)
        assert record["accuracy"] == record["correct"] / ITEMS
        assert list(record["buckets"]) == sorted(record["buckets"])
        for name in ("task", "length", "difficulty", "format"):  # each bucket family adds up
            cells = [v for k, v in record["buckets"].items() if k.startswith(f"{name}=")]
            assert sum(c["items"] for c in cells) == ITEMS
            assert sum(c["correct"] for c in cells) == record["correct"]
        for bucket, cell in record["buckets"].items():
            name, value = bucket.split("=")
            mine = [p for p in predictions if p["buckets"][name] == value]
            assert cell == {
                "items": len(mine),
                "correct": sum(p["correct"] for p in mine),
                "accuracy": sum(p["correct"] for p in mine) / len(mine),
            }
    events = [
        e for e in read_jsonl(straight / "events.jsonl") if e["event"] == "capability_evaluated"
    ]
    assert [(e["step"], e["accuracy"]) for e in events] == [
        (r["step"], r["accuracy"]) for r in records
    ]


def test_score_counts_per_bucket():
    predictions = [
        {"correct": True, "buckets": {"task": "add", "format": "terse"}},
        {"correct": False, "buckets": {"task": "add", "format": "verbose"}},
        {"correct": True, "buckets": {"task": "sort", "format": "terse"}},
    ]
    assert score(predictions) == {
        "items": 3,
        "correct": 2,
        "accuracy": 2 / 3,
        "buckets": {
            "format=terse": {"items": 2, "correct": 2, "accuracy": 1.0},
            "format=verbose": {"items": 1, "correct": 0, "accuracy": 0.0},
            "task=add": {"items": 2, "correct": 1, "accuracy": 0.5},
            "task=sort": {"items": 1, "correct": 1, "accuracy": 1.0},
        },
    }


def test_read_capability_takes_the_latest_line_per_step_and_skips_a_torn_one(tmp_path):
    assert read_capability(tmp_path) == []
    lines = [
        {"step": 8, "accuracy": 0.5},
        {"step": 4, "accuracy": 0.1},
        {"step": 8, "accuracy": 0.6},
    ]
    text = "".join(json.dumps(line) + "\n" for line in lines) + '{"step": 12, "accu'
    (tmp_path / "capability.jsonl").write_text(text)
    assert read_capability(tmp_path) == [{"step": 4, "accuracy": 0.1}, {"step": 8, "accuracy": 0.6}]


@pytest.mark.slow
def test_read_predictions_refuses_a_changed_or_missing_file(straight, tmp_path):
    record = read_capability(straight)[-1]
    copy = tmp_path / record["predictions"]
    copy.parent.mkdir()
    text = (straight / record["predictions"]).read_text()
    copy.write_text(text)
    assert read_predictions(tmp_path, record) == read_predictions(straight, record)
    copy.write_text(text.replace('"correct": false', '"correct": true', 1))
    with pytest.raises(Fp8opsError, match=f"{copy}: sha256 .* step {2 * N}.*changed or damaged"):
        read_predictions(tmp_path, record)
    copy.unlink()
    with pytest.raises(Fp8opsError, match="missing"):
        read_predictions(tmp_path, record)


# -- the run -------------------------------------------------------------------------------


def _telemetry(run: Path) -> dict[str, np.ndarray]:
    store = open_run(run)
    return {m: store.module_history(m).to_numpy() for m in store.modules}


@pytest.mark.slow
def test_capability_evaluation_does_not_change_training(manifest, straight, tmp_path):
    off = tmp_path / "off"
    run_training(manifest, off, assignments={"capability.enabled": False}, progress=False)
    assert not (off / "capability.jsonl").exists()
    a, b = read_metrics(straight), read_metrics(off)
    # Exact: the same training arithmetic in this process, the evaluation aside of it.
    for key in ("loss", "grad_norm", "update_norm", "lr", "skipped"):
        assert [getattr(m, key) for m in a] == [getattr(m, key) for m in b], key
    assert [e["loss"] for e in read_jsonl(straight / "eval.jsonl")] == [
        e["loss"] for e in read_jsonl(off / "eval.jsonl")
    ]
    for step in (N, 2 * N):  # FP8 scales and histories of every module, weights, optimizer
        ma, mb = (read_meta(run / "checkpoints" / checkpoint_name(step)) for run in (straight, off))
        assert ma.fp8.digests == mb.fp8.digests
        assert ma.weights_fingerprint == mb.weights_fingerprint
        files = [
            {k: f["sha256"] for k, f in m.files.items() if k.endswith(".distcp")} for m in (ma, mb)
        ]
        assert files[0] == files[1]
    ta, tb = _telemetry(straight), _telemetry(off)  # the evaluation's casts are not recorded
    for module in ta:
        assert np.array_equal(ta[module], tb[module], equal_nan=True), module


def _without_seconds(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "seconds"} for r in records]


@pytest.mark.slow
def test_stop_and_resume_gives_the_straight_runs_records(manifest, straight, tmp_path):
    run = tmp_path / "run"
    paused = run_training(manifest, run, progress=False, stop_at=N)
    assert paused.paused and [r["step"] for r in read_capability(run)] == [N]
    resumed = resume_training(run, progress=False)
    assert resumed.capability_accuracy == read_capability(straight)[-1]["accuracy"]
    assert _without_seconds(read_capability(run)) == _without_seconds(read_capability(straight))
    for record in read_capability(run):
        assert read_predictions(run, record) == read_predictions(straight, record)


# -- TP=2 ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_tp2_ranks_produce_the_same_answers(manifest, straight, tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            __file__,
            str(manifest),
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rank0, rank1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert rank0 == rank1
    records = read_capability(tmp_path / "run")
    assert [r["step"] for r in records] == [N, 2 * N]
    assert read_predictions(tmp_path / "run", records[-1]) == rank0  # what rank 0 wrote
    # Against TP=1: each rank rounds its bf16 partial sums before the all-reduce, and this
    # barely trained model's logits are close to uniform, so near-ties go either way. Measured:
    # 11 of 16 answers equal, the others the same up to a character or two.
    tp1 = read_predictions(straight, read_capability(straight)[-1])
    same = sum(a["generated"] == b["generated"] for a, b in zip(rank0, tp1, strict=True))
    assert same >= ITEMS // 2, (
        same,
        [p["generated"] for p in rank0],
        [p["generated"] for p in tp1],
    )


def _tp2_worker(manifest_file: Path, out: Path) -> None:
    """Under torchrun: train the run at TP=2 (rank 0 writes its records), then each rank
    writes the answers it computes for the final weights to OUT/rank{r}.json."""
    manifest = derive(load_manifest(manifest_file), {"topology.tensor_parallel": 2}, "test: TP=2")
    ranks = init_distributed(manifest.topology, source="test")
    try:
        trainer = open_trainer(
            New(manifest, [manifest], out / "run", "test"), ranks, progress=False
        )
        trainer.train()
        with trainer.evaluator.held_out():
            predictions = evaluate_capability(
                trainer.model,
                trainer.inputs.capability_examples,
                manifest,
                trainer.inputs.tokenizer,
                fp8=trainer.fp8,
            )
        (out / f"rank{ranks.rank}.json").write_text(json.dumps(predictions))
    finally:
        shutdown_distributed()


if __name__ == "__main__":
    _tp2_worker(Path(sys.argv[1]), Path(sys.argv[2]))
