"""The data package: tokenizer, corpus, tasks, JSONL, sequences, build_data, the sampler."""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import re
import textwrap
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from fp8ops.data import (
    BUCKETS,
    EOD,
    ByteTokenizer,
    Example,
    TrainSampler,
    batches,
    build_corpus,
    build_data,
    check,
    generate_examples,
    held_out,
    read_jsonl,
    split_examples,
)
from fp8ops.data.batches import MicroBatch, Sequences, text_sequences
from fp8ops.data.corpus import MAX_BYTES, TASK_SHARE
from fp8ops.data.tasks import MAX_EVAL_FRACTION, split_key, split_point
from fp8ops.errors import ManifestError
from fp8ops.manifest import Manifest, derive, load_manifest, parse_manifest


def make_manifest(
    data: str = "kind: tasks", *, seq_length: int = 64, seed: int = 1234, tokenizer: str = ""
) -> Manifest:
    """A valid manifest with the given ``data`` section (YAML body) and a few knobs."""
    text = f"""\
schema_version: 1
name: data-test
model:
  num_layers: 2
  hidden_size: 64
  ffn_hidden_size: 256
  num_attention_heads: 4
  seq_length: {seq_length}
  vocab_size: 256
data:
{textwrap.indent(data, "  ")}
schedule:
  train_steps: 10
  global_batch_size: 8
seeds:
  data: {seed}
"""
    if tokenizer:
        text += f"tokenizer:\n{textwrap.indent(tokenizer, '  ')}\n"
    return parse_manifest(text, "test.yaml")


@pytest.fixture(scope="module")
def corpus():
    return build_corpus(1234, split_version=2)


@pytest.fixture(scope="module")
def tasks_data():
    return build_data(make_manifest())


# --------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------


def problem_of(prompt: str) -> str:
    """The problem of a task prompt whatever its format and the order of what does not change
    the answer (12 + 39 is 39 + 12; 3142 and 2413 sort alike), parsed here independently of
    tasks.py."""
    canonical = {
        "add": lambda a, b: f"add {min(int(a), int(b))} {max(int(a), int(b))}",
        "reverse": lambda word: f"reverse {word}",
        "sort": lambda digits: f"sort {''.join(sorted(digits))}",
    }
    patterns = [
        (r"(add) (\d+) (\d+) = ", "add"),
        (r"(reverse) ([a-z]+) = ", "reverse"),
        (r"(sort) (\d+) = ", "sort"),
        (r"Q: What is (\d+) plus (\d+)\?\nA: ", "add"),
        (r"Q: What is ([a-z]+) backwards\?\nA: ", "reverse"),
        (r"Q: Sort the digits (\d+)\.\nA: ", "sort"),
    ]
    for pattern, task in patterns:
        match = re.fullmatch(pattern, prompt)
        if match:
            groups = [g for g in match.groups() if g != task]
            return canonical[task](*groups)
    raise AssertionError(f"not a task prompt: {prompt!r}")


def test_no_problem_is_in_both_splits_in_any_format():
    train, evaluation = split_examples(generate_examples(1234, 6000), 0.1, 2)
    train_problems = {problem_of(e.prompt) for e in train}
    eval_problems = {problem_of(e.prompt) for e in evaluation}
    assert len(eval_problems) > 300
    assert not train_problems & eval_problems
    # Split version 1 (earlier runs) keys on the terse statement: the same problem in another
    # format never crosses, but "add 39 12" can be trained while "add 12 39" is held out.
    train, evaluation = split_examples(generate_examples(1234, 6000), 0.1, 1)
    assert {e.problem for e in train}.isdisjoint(e.problem for e in evaluation)
    assert {problem_of(e.prompt) for e in train} & {problem_of(e.prompt) for e in evaluation}


# What split version 1 built before version 2 existed (fp8ops at 03a0c54): the CPU default's
# tasks, and the two small JSONL files below. Runs made then resume on exactly this data.
V1_TASKS = "c80632b74fe5a00a3af224ff0a7ad72d3bef9397683d21d141fb321540241d6e"
V1_JSONL = {
    "sft": "d421ebff0d373878269cbc18309894ca58a71c97c1b0482caae8974652fe913e",
    "text": "4a750fea01d78d0ccda6a65503984628d8fa03877bcfc43b6aeec59658cc10dd",
}


def test_split_version_1_builds_the_data_of_earlier_runs_bit_for_bit(tmp_path):
    tiny = load_manifest(Path(__file__).resolve().parents[1] / "manifests" / "tiny-gpt-cpu.yaml")
    assert tiny.data.split_version == 1
    assert build_data(tiny).fingerprint == V1_TASKS
    sorted_rows = [
        {
            "prompt": f"Q{i % 7}: what is {i} plus 1? ",
            "answer": f" {i + 1}",
            "buckets": {"topic": ["math", "code"][i % 2]},
        }
        for i in range(300)
    ]
    files = {
        "sft": sorted_rows,
        "text": [{"text": f"document {i}: " + "naïve words " * (i % 5 + 1)} for i in range(200)],
    }
    for name, rows in files.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        data = build_data(_jsonl_manifest(path))
        assert data.fingerprint == V1_JSONL[name], name
        version_2 = build_data(make_manifest(f"kind: jsonl\npath: '{path}'\nsplit_version: 2"))
        assert version_2.fingerprint != data.fingerprint, name


@pytest.mark.parametrize("positions", [1, 1000])
def test_the_fingerprint_does_not_depend_on_how_many_rows_are_hashed_at_once(
    positions, monkeypatch
):
    # Held ragged, the data are padded a few rows at a time to be hashed: one row, and 15 rows
    # (the last part shorter), give the digest of the whole padded tensors.
    monkeypatch.setattr(batches, "DIGEST_POSITIONS", positions)
    tiny = load_manifest(Path(__file__).resolve().parents[1] / "manifests" / "tiny-gpt-cpu.yaml")
    assert build_data(tiny).fingerprint == V1_TASKS


def test_tokenizer_round_trips_utf8_bytes():
    tok = ByteTokenizer()
    text = "plain ASCII, Grüße, naïve, 数字 and 🙂"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert len(ids) > len(text)  # the non-ASCII characters are several tokens
    assert all(0 < i < 256 for i in ids)
    assert tok.decode(ids) == text


def test_tokenizer_end_of_document():
    tok = ByteTokenizer()
    assert tok.eod == tok.pad == EOD == 0
    assert tok.decode(tok.encode("answer") + [EOD] + tok.encode("ignored")) == "answer"
    assert tok.decode(torch.tensor([104, 105, 0, 0])) == "hi"
    # Generation can stop mid-character: decoding never raises.
    assert tok.decode(list("é".encode())[:1]) == "\ufffd"
    with pytest.raises(ValueError, match="NUL"):
        tok.encode("a\x00b")


def test_tokenizer_fingerprint_and_manifest_checks():
    fingerprint = ByteTokenizer().fingerprint()
    assert re.fullmatch(r"[0-9a-f]{64}", fingerprint)
    assert fingerprint == ByteTokenizer().fingerprint()

    with pytest.raises(ManifestError, match="tokenizer.kind") as err:
        build_data(make_manifest(tokenizer="kind: sentencepiece\npath: tok.model"))
    assert "'sentencepiece'" in str(err.value)

    with pytest.raises(ManifestError, match="tokenizer.fingerprint") as err:
        build_data(make_manifest(tokenizer=f"fingerprint: {'ab' * 32}"))
    assert fingerprint in str(err.value)
    build_data(
        make_manifest("kind: tasks\nnum_examples: 20", tokenizer=f"fingerprint: {fingerprint}")
    )


# --------------------------------------------------------------------------------------
# Corpus
# --------------------------------------------------------------------------------------


def test_corpus_is_deterministic_and_sized(corpus):
    again = build_corpus(1234, split_version=2)  # another clean interpreter, another hash seed
    assert again.data == corpus.data
    assert again.fingerprint == corpus.fingerprint == hashlib.sha256(corpus.data).hexdigest()
    assert 300_000 < len(corpus.data) <= MAX_BYTES
    # Every document is followed by EOD, and none contains it.
    assert corpus.data.count(EOD) == len(corpus.documents)
    assert corpus.data.endswith(bytes([EOD]))
    assert corpus.data.split(bytes([EOD]))[:-1] == [d.encode() for d in corpus.documents]
    assert any(d.startswith("json.dumps\n\n") for d in corpus.documents)


def test_corpus_mixes_in_task_lines_from_the_training_side(corpus):
    task_line = re.compile(r"(add \d+ \d+ = \d+|reverse [a-z]+ = [a-z]+|sort \d+ = \d+|Q: .*)")
    task_docs = [d for d in corpus.documents if task_line.fullmatch(d.split("\n")[0])]
    assert task_docs
    share = sum(len(d) + 1 for d in task_docs) / len(corpus.data)
    assert 0.5 * TASK_SHARE < share <= TASK_SHARE
    prompt = re.compile(r"^(?:add|reverse|sort) [^=]+= |^Q: .*\nA: ", re.MULTILINE)
    prompts = prompt.findall("\n".join(task_docs))
    assert len(prompts) > 1000
    assert not any(held_out(problem_of(p), MAX_EVAL_FRACTION) for p in prompts)
    # Nor under version 1's key, the terse statement as written.
    terse = [p.removesuffix(" = ") for p in prompts if not p.startswith("Q: ")]
    assert terse and not any(held_out(t, MAX_EVAL_FRACTION) for t in terse)
    # Task documents are spread through the stream, so the held-out tail has some too.
    positions = [i for i, d in enumerate(corpus.documents) if d in set(task_docs)]
    assert positions[0] < len(corpus.documents) * 0.1
    assert positions[-1] > len(corpus.documents) * 0.9


def test_task_lines_guard_is_the_schema_limit():
    # The corpus keeps task prompts with split points >= MAX_EVAL_FRACTION; that is only
    # leak-free if no manifest can ask for a larger evaluation fraction.
    make_manifest(f"kind: tasks\neval_fraction: {MAX_EVAL_FRACTION}")
    with pytest.raises(ManifestError, match="eval_fraction"):
        make_manifest(f"kind: tasks\neval_fraction: {MAX_EVAL_FRACTION + 1e-9}")


def test_corpus_seed_changes_order_and_task_lines_not_the_docs(corpus):
    other = build_corpus(99, split_version=2)
    assert other.fingerprint != corpus.fingerprint
    assert other.docs_bytes == corpus.docs_bytes
    docs = {d for d in corpus.documents if not d.startswith(("add", "reverse", "sort", "Q: "))}
    assert docs <= set(other.documents)


def test_corpus_cap():
    small = build_corpus(1234, max_bytes=100_000, split_version=2)
    assert 80_000 < len(small.data) <= 100_000


def test_corpus_ignores_a_patched_stdlib(monkeypatch, corpus):
    def getfile(obj):
        """PATCHED BY A THIRD-PARTY PACKAGE"""

    # What importing torch does to inspect.getfile; the corpus must not see it.
    monkeypatch.setattr(inspect, "getfile", getfile)
    patched = build_corpus(1234, split_version=2)
    assert b"PATCHED" not in patched.data
    assert patched.data == corpus.data


# --------------------------------------------------------------------------------------
# Tasks
# --------------------------------------------------------------------------------------

_TERSE = re.compile(r"(add|reverse|sort) (.+) = ")
_VERBOSE = {
    "add": re.compile(r"Q: What is (\d+) plus (\d+)\?\nA: "),
    "reverse": re.compile(r"Q: What is ([a-z]+) backwards\?\nA: "),
    "sort": re.compile(r"Q: Sort the digits (\d+)\.\nA: "),
}


def _solve(example: Example) -> tuple[str, dict[str, str]]:
    """The answer and buckets, recomputed from the prompt alone."""
    match = _TERSE.fullmatch(example.prompt)
    if match:
        task, operands, style = match[1], match[2].split(" "), "terse"
    else:
        ((task, match),) = [
            (t, m) for t, r in _VERBOSE.items() if (m := r.fullmatch(example.prompt))
        ]
        operands, style = list(match.groups()), "verbose"
    if task == "add":
        a, b = operands
        answer = str(int(a) + int(b))
        length = {1: "short", 2: "medium", 3: "long"}[max(len(a), len(b))]
        # A carry happens somewhere exactly when some column's two digits reach 10.
        hard = any(int(x) + int(y) >= 10 for x, y in zip(a.zfill(3), b.zfill(3)))
    else:
        (text,) = operands
        answer = text[::-1] if task == "reverse" else "".join(sorted(text))
        length = {3: "short", 4: "short", 5: "medium", 6: "medium", 7: "long", 8: "long"}[len(text)]
        hard = len(set(text)) < len(text)
    difficulty = "hard" if hard else "easy"
    return answer, {"task": task, "length": length, "difficulty": difficulty, "format": style}


def test_tasks_answers_and_buckets_are_right():
    examples = generate_examples(7, 3000)
    cells = Counter()
    for example in examples:
        answer, buckets = _solve(example)
        assert example.answer == answer, example
        assert example.buckets == buckets, example
        cells[tuple(buckets.values())] += 1
    # Every combination of bucket values occurs.
    assert len(cells) == 3 * 3 * 2 * 2
    assert set(BUCKETS) == {"task", "length", "difficulty", "format"}


def test_tasks_are_deterministic_per_seed():
    assert generate_examples(5, 500) == generate_examples(5, 500)
    assert generate_examples("corpus", 50) == generate_examples("corpus", 50)
    assert generate_examples(5, 500) != generate_examples(6, 500)
    assert generate_examples(5, 100) == generate_examples(5, 500)[:100]


def test_check_is_exact_match():
    example = Example("add 2 3 = ", "5", {})
    assert check(example, "5")
    assert check(example, "5 \n")
    # The text is the decoded continuation, which the tokenizer ended at end-of-document: a
    # NUL in it is text (a token another tokenizer can produce), not an end.
    assert not check(example, "5\x00garbage")
    assert not check(example, "05")
    assert not check(example, " 5")
    assert not check(example, "56")
    assert not check(example, "")
    # An answer written with a final newline, as JSONL answers often are, can be right.
    with_newline = Example("Q: 2+2?\nA:", " 4\n", {})
    assert check(with_newline, " 4\n") and check(with_newline, " 4")
    assert not check(with_newline, "4\n")


def test_eval_split_is_in_hash_order_so_its_first_items_sample_every_topic():
    """A file sorted by topic: the first capability items (and loss batches) of the held-out
    split must not all come from its first topic."""
    topics = ["math", "code", "chat", "safety"]
    examples = [
        Example(f"{topic} question {i}?", "yes", {"topic": topic})
        for topic in topics
        for i in range(1500)
    ]
    _, evaluation = split_examples(examples, 0.1, 2)
    points = [split_point(split_key(e, 2)) for e in evaluation]
    assert points == sorted(points)
    first = Counter(e.buckets["topic"] for e in evaluation[:60])
    assert set(first) == set(topics) and min(first.values()) >= 5, first
    # Version 1 keeps the file's order: its first items are all from the first topic.
    _, evaluation = split_examples(examples, 0.1, 1)
    assert {e.buckets["topic"] for e in evaluation[:60]} == {"math"}


def test_a_prompt_and_its_copy_with_other_whitespace_are_one_problem():
    a, b = Example("What is 5 plus 1?", "6"), Example("  What is 5   plus 1? \n", "6")
    assert split_key(a, 2) == split_key(b, 2) == "What is 5 plus 1?"
    assert split_key(b, 1) == b.key == b.prompt  # version 1: the prompt as written
    train, evaluation = split_examples(
        [a, b] * 50 + [Example(f"q{i}", "a") for i in range(400)], 0.5, 2
    )
    assert (a in train) != (a in evaluation) and (b in train) == (a in train)


def test_split_has_no_shared_prompt_and_respects_the_fraction(tasks_data):
    train, evaluation = split_examples(generate_examples(1234, 6000), 0.1, 1)
    assert {e.prompt for e in train}.isdisjoint(e.prompt for e in evaluation)
    assert 0.07 < len(evaluation) / 6000 < 0.13
    assert list(tasks_data.eval.examples) == evaluation
    assert list(tasks_data.train.examples) == train
    # The split is by prompt alone: the same prompt goes the same way under any seed.
    assert all(split_point(e.key) < 0.1 for e in evaluation)


# --------------------------------------------------------------------------------------
# Sequences
# --------------------------------------------------------------------------------------


def whole(split: Sequences) -> MicroBatch:
    """Every row of ``split`` as one batch."""
    return split.batch(range(len(split)))


def test_sft_loss_mask_is_exactly_the_answer_and_eod(tasks_data):
    assert len(tasks_data.train) + len(tasks_data.eval) == 6000
    for split in (tasks_data.train, tasks_data.eval):
        batch = whole(split)
        assert batch.tokens.dtype == batch.labels.dtype == torch.int64
        assert batch.loss_mask.dtype == torch.float32
        assert batch.tokens.shape == batch.labels.shape == batch.loss_mask.shape
        assert batch.tokens.shape[1] == 64
        for row, example in enumerate(split.examples):
            mask = batch.loss_mask[row].bool()
            scored = bytes(batch.labels[row][mask].tolist())
            assert scored == example.answer.encode() + bytes([EOD])
            # The scored positions are contiguous, right after the prompt.
            first = len(example.prompt) - 1
            assert mask.nonzero().flatten().tolist() == list(
                range(first, first + len(example.answer) + 1)
            )
            assert bytes(batch.tokens[row][: len(example.prompt)].tolist()) == (
                example.prompt.encode()
            )
            assert batch.labels[row][:-1].tolist() == batch.tokens[row][1:].tolist()


def test_pad_to_longest_cuts_each_batch_to_its_longest_row_rounded_to_16(tasks_data):
    longest = build_data(make_manifest("kind: tasks\npad_to: longest"))
    assert longest.fingerprint == tasks_data.fingerprint  # the same data, batched narrower
    lengths = np.diff(longest.train.starts) - 1  # label positions a row fills
    widths = set()
    for rows in (range(8), range(8, 11), [5], range(len(longest.train))):
        full, narrow = tasks_data.train.batch(rows), longest.train.batch(rows)
        width = narrow.tokens.shape[1]
        need = int(lengths[list(rows)].max())
        assert width % 16 == 0 and need <= width < need + 16, (need, width)
        widths.add(width)
        for name in ("tokens", "labels", "loss_mask"):  # the seq_length batch, cut short
            assert torch.equal(getattr(narrow, name), getattr(full, name)[:, :width]), name
        assert full.loss_mask[:, width:].sum() == 0  # nothing scored was cut
        assert narrow.position_ids[0].tolist() == list(range(width))
    assert len(widths) > 1  # the width follows the rows
    # Never wider than seq_length, when the longest row rounds up past it.
    data = build_data(make_manifest("kind: tasks\npad_to: longest", seq_length=44))
    rows = [int(np.argmax(np.diff(data.train.starts)))]
    assert np.diff(data.train.starts)[rows[0]] - 1 > 32  # rounds up to 48 > 44
    assert data.train.batch(rows).tokens.shape[1] == 44
    # Pre-training windows are full: no narrower batch.
    text = build_data(make_manifest("kind: corpus\npad_to: longest"))
    assert text.train.batch(range(4)).tokens.shape == (4, 64)
    with pytest.raises(ValueError, match="pad_to must be"):
        dataclasses.replace(tasks_data.train, pad_to="shortest")
    with pytest.raises(ManifestError, match=r"data\.pad_to: must be 'seq_length' or 'longest'"):
        make_manifest("kind: tasks\npad_to: shortest")


def test_too_long_example_names_model_seq_length():
    with pytest.raises(ManifestError, match=r"model\.seq_length") as err:
        build_data(make_manifest("kind: tasks\nnum_examples: 200", seq_length=16))
    message = str(err.value)
    assert re.search(r"\d+ of 200 examples do not fit; the longest is \d+ tokens", message)
    longest = max(
        len(e.prompt) + len(e.answer) + 1 for e in generate_examples(1234, 200)
    )  # ASCII: one byte per character
    assert f"is {longest} tokens" in message
    build_data(make_manifest("kind: tasks\nnum_examples: 200", seq_length=longest - 1))


def test_pretraining_windows_tile_the_corpus(corpus):
    data = build_data(make_manifest("kind: corpus\nsplit_version: 2", seq_length=128))
    width = 129
    n = len(corpus.data) // width
    assert len(data.train) + len(data.eval) == n
    assert len(data.eval) == -(-n // 10)  # ceil(n * 0.1): the tail
    windows = torch.cat([whole(data.train).tokens, whole(data.eval).tokens])
    labels = torch.cat([whole(data.train).labels, whole(data.eval).labels])
    assert bytes(windows[:, 0].tolist()) == corpus.data[: n * width : width]
    assert (
        bytes(windows[-1].tolist()) + bytes([labels[-1, -1]])
        == (corpus.data[(n - 1) * width : n * width])
    )
    assert torch.equal(labels[:, :-1], windows[:, 1:])
    assert torch.equal(whole(data.train).loss_mask, torch.ones(len(data.train), 128))
    assert data.train.ids.dtype == np.uint8  # bytes stay one byte per token
    assert data.objective == "pretrain" and data.summary()["train"]["buckets"] == {}
    assert data.summary()["source"]["corpus_fingerprint"] == corpus.fingerprint


def test_text_sequences_drop_the_tail():
    windows = text_sequences(bytes(range(1, 11)), seq_length=2)
    assert whole(windows).tokens.tolist() == [[1, 2], [4, 5], [7, 8]]
    assert whole(windows).labels.tolist() == [[2, 3], [5, 6], [8, 9]]
    assert len(text_sequences(b"ab", seq_length=4)) == 0


def test_a_batch_of_rows_outside_the_split_is_refused(tasks_data):
    split = tasks_data.eval
    assert len(split.batch([]).indices) == 0
    assert torch.equal(split.batch(np.array([len(split) - 1])).tokens, whole(split).tokens[-1:])
    # Ragged, starts[-1] is the end of the last row: -1 would read as an empty, unscored row.
    for rows in ([-1], [0, len(split)], [[0, 1]]):
        with pytest.raises(IndexError):
            split.batch(rows)


def test_ids_are_held_in_the_smallest_dtype_of_the_vocabulary(tasks_data):
    assert tasks_data.train.ids.dtype == np.uint8  # bytes: one byte a token, SFT too
    assert [batches.id_dtype(n) for n in (256, 257, 65536, 65537, 128256)] == [
        np.uint8,
        np.uint16,
        np.uint16,
        np.int32,
        np.int32,
    ]


def test_summary_is_json_and_counts(tasks_data):
    summary = json.loads(json.dumps(tasks_data.summary()))
    assert summary["kind"] == "tasks" and summary["objective"] == "sft"
    assert summary["fingerprint"] == tasks_data.fingerprint
    assert summary["train"]["sequences"] == len(tasks_data.train)
    assert summary["eval"]["loss_tokens"] == sum(
        len(e.answer) + 1 for e in tasks_data.eval.examples
    )
    for split in ("train", "eval"):
        for name, values in BUCKETS.items():
            histogram = summary[split]["buckets"][name]
            assert set(histogram) == set(values)
            assert sum(histogram.values()) == summary[split]["sequences"]


def test_eval_batches_in_fixed_order(tasks_data):
    batches = list(tasks_data.eval_batches(64))
    assert [len(b.indices) for b in batches[:-1]] == [64] * (len(batches) - 1)
    assert 0 < len(batches[-1].indices) <= 64
    assert torch.equal(torch.cat([b.indices for b in batches]), torch.arange(len(tasks_data.eval)))
    assert torch.equal(torch.cat([b.tokens for b in batches]), whole(tasks_data.eval).tokens)
    assert torch.equal(batches[0].position_ids[3], torch.arange(64))


# --------------------------------------------------------------------------------------
# Fingerprint
# --------------------------------------------------------------------------------------


def test_fingerprint_tracks_what_the_model_sees(tasks_data):
    assert build_data(make_manifest()).fingerprint == tasks_data.fingerprint
    assert build_data(make_manifest(seed=1)).fingerprint != tasks_data.fingerprint
    assert build_data(make_manifest(seq_length=65)).fingerprint != tasks_data.fingerprint
    assert build_data(make_manifest("kind: tasks\neval_fraction: 0.2")).fingerprint != (
        tasks_data.fingerprint
    )


def test_fingerprint_covers_bucket_labels(tmp_path):
    def build(label: str):
        row = {"prompt": "p: ", "answer": "a", "buckets": {"kind": label}}
        path = _write(tmp_path, [json.dumps(row)] * 4, f"{label}.jsonl")
        return build_data(make_manifest(f"kind: jsonl\npath: '{path}'\neval_fraction: 0"))

    one, other = build("one"), build("other")
    assert torch.equal(whole(one.train).tokens, whole(other.train).tokens)
    assert one.fingerprint != other.fingerprint


def test_data_fingerprint_mismatch_is_refused(tasks_data):
    base = make_manifest()
    pinned = derive(base, {"data.fingerprint": tasks_data.fingerprint}, "pin the data")
    assert build_data(pinned).fingerprint == tasks_data.fingerprint

    wrong = "0" * 64
    stale = derive(base, {"data.fingerprint": wrong}, "a stale pin")
    with pytest.raises(ManifestError, match=r"^data\.fingerprint") as err:
        build_data(stale)
    assert wrong in str(err.value) and tasks_data.fingerprint in str(err.value)
    assert "derive a revision" in str(err.value)


# --------------------------------------------------------------------------------------
# JSONL
# --------------------------------------------------------------------------------------


def _write(tmp_path: Path, lines: list[str], name: str = "data.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _jsonl_manifest(path: Path, **kwargs) -> Manifest:
    return make_manifest(f"kind: jsonl\npath: '{path}'", **kwargs)


def test_jsonl_text_file_is_pretraining(tmp_path):
    texts = [f"document {i}: naïve text, repeated. " * 5 for i in range(40)]
    path = _write(tmp_path, [json.dumps({"text": t}) for t in texts] + [""])
    # Split version 2: the documents in hash order, so the held-out tail is a fair sample of a
    # sorted file; version 1 packs them in the file's order.
    ordered = sorted(texts, key=split_point)
    assert ordered != texts
    for version, documents in ((2, ordered), (1, texts)):
        manifest = make_manifest(
            f"kind: jsonl\npath: '{path}'\nsplit_version: {version}", seq_length=32
        )
        data = build_data(manifest)
        assert data.objective == "pretrain" and data.kind == "jsonl"
        stream = b"".join(t.encode() + b"\x00" for t in documents)
        assert len(data.train) + len(data.eval) == len(stream) // 33
        assert bytes(whole(data.train).tokens[0].tolist()) == stream[:32]
        last = (len(stream) // 33 - 1) * 33
        assert bytes(whole(data.eval).tokens[-1].tolist()) == stream[last : last + 32]
    assert data.summary()["source"]["file_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()


def test_jsonl_sft_file_keeps_prompts_answers_and_buckets(tmp_path):
    rows = [
        {
            "prompt": f"Say {i}: ",
            "answer": str(i),
            "buckets": {"size": "big" if i > 50 else "small"},
        }
        for i in range(100)
    ]
    path = _write(tmp_path, [json.dumps(r) for r in rows])
    data = build_data(_jsonl_manifest(path))
    assert data.objective == "sft"
    examples = [*data.train.examples, *data.eval.examples]
    assert sorted(e.prompt for e in examples) == sorted(r["prompt"] for r in rows)
    assert all(e.buckets == {"size": "big" if int(e.answer) > 50 else "small"} for e in examples)
    assert all(not held_out(e.key, 0.1) for e in data.train.examples)
    assert all(held_out(e.key, 0.1) for e in data.eval.examples)
    row = data.train.examples.index(next(e for e in data.train.examples if e.answer == "42"))
    batch = data.train.batch([row])
    assert bytes(batch.labels[0][batch.loss_mask[0].bool()].tolist()) == b"42\x00"
    # Buckets are optional (the same on every line).
    plain = _write(tmp_path, ['{"prompt": "a", "answer": "b"}'], "plain.jsonl")
    assert read_jsonl(plain).examples == (Example("a", "b", {}),)


def test_sft_data_that_holds_out_nothing_is_refused(tmp_path):
    """eval_fraction 0.1 of a small file can hold out nothing: the run would never evaluate."""
    prompts = [f"Say {i}: " for i in range(200) if split_point(f"Say {i}: ") >= 0.1][:30]
    path = _write(tmp_path, [json.dumps({"prompt": p, "answer": "x"}) for p in prompts])
    with pytest.raises(ManifestError) as err:
        build_data(make_manifest(f"kind: jsonl\npath: '{path}'\neval_fraction: 0.1"))
    assert str(err.value).startswith(
        "data.eval_fraction: 0.1 held out none of the 30 examples"
    ) and "set it to 0 to train without evaluation" in str(err.value)
    assert (
        build_data(make_manifest(f"kind: jsonl\npath: '{path}'\neval_fraction: 0")).eval.examples
        == ()
    )


def test_a_missing_relative_path_says_where_it_was_looked_for(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ManifestError) as err:
        read_jsonl("data/sft.jsonl")
    assert str(err.value).startswith(
        f"data.path: data/sft.jsonl: no such file (relative to the current directory, {tmp_path})"
    )
    with pytest.raises(ManifestError) as err:
        read_jsonl(tmp_path / "sft.jsonl")
    assert "relative to" not in str(err.value)


def test_too_long_jsonl_examples_are_named_by_file_and_line(tmp_path):
    rows = [
        {"prompt": f"p{i}: ", "answer": "a" * {11: 90, 3: 80, 7: 80, 8: 80, 9: 80}.get(i, 2)}
        for i in range(20)
    ]
    path = _write(tmp_path, [json.dumps(row) for row in rows])
    with pytest.raises(ManifestError) as err:
        build_data(_jsonl_manifest(path, seq_length=32))
    message = str(err.value)
    named = re.search(
        r"5 of 20 examples do not fit \((.*) and 2 more\); the longest is 96 tokens", message
    )
    assert named, message
    assert f"(prompt + answer + end-of-document, {path}: line 12)" in message
    lines = [int(part.removeprefix(f"{path}: line ")) for part in named.group(1).split("; ")]
    assert len(lines) == 3 and set(lines) <= {4, 8, 9, 10, 12}, message


GOOD_TEXT = '{"text": "hello"}'
GOOD_SFT = '{"prompt": "p", "answer": "a", "buckets": {"k": "v"}}'


@pytest.mark.parametrize(
    ("lines", "line", "problem"),
    [
        ([GOOD_TEXT, '{"text": "unclosed}'], 2, "not valid JSON"),
        ([GOOD_SFT, "", '{"prompt": "p", "buckets": {"k": "v"}}'], 3, "missing key 'answer'"),
        ([GOOD_TEXT, GOOD_TEXT, GOOD_SFT], 3, "but line 1 is a text document"),
        ([GOOD_SFT, GOOD_TEXT], 2, "one file holds one kind"),
        (['["text", "x"]'], 1, "expected a JSON object, got an array"),
        (['{"txt": "x"}'], 1, "has keys ['txt']"),
        (['{"text": "x", "id": 3}'], 1, "unknown key 'id'"),
        (['{"prompt": "p", "answer": 5}'], 1, "'answer' must be a string, got a number"),
        (['{"prompt": "", "answer": "a"}'], 1, "'prompt' is empty"),
        (['{"text": "a\\u0000b"}'], 1, "contains NUL"),
        ([GOOD_SFT, '{"prompt": "p", "answer": "a", "buckets": {"j": "v"}}'], 2, "bucket names"),
        (['{"prompt": "p", "answer": "a", "buckets": {"k": 1}}'], 1, "bucket 'k' must be"),
        (
            [GOOD_SFT, '{"prompt": "a\\ud800", "answer": "b", "buckets": {"k": "v"}}'],
            2,
            "'prompt' contains an unpaired surrogate (\\ud800)",
        ),
        (['{"text": "x\\udc80"}'], 1, "'text' contains an unpaired surrogate (\\udc80)"),
        (
            ['{"prompt": "a", "prompt": "zz", "answer": "b"}'],
            1,
            "key 'prompt' appears twice in one object",
        ),
        (['{"text": "x", "n": ' + "1" * 5000 + "}"], 1, "not readable JSON (a number too long)"),
        (["[" * 100_000 + "]" * 100_000], 1, "not readable JSON (nested too deeply)"),
    ],
)
def test_jsonl_bad_lines_name_file_and_line(tmp_path, lines, line, problem):
    path = _write(tmp_path, lines)
    with pytest.raises(ManifestError) as err:
        build_data(_jsonl_manifest(path))
    message = str(err.value)
    assert message.startswith(f"{path}: line {line}: "), message
    assert problem in message


@pytest.mark.parametrize("content", ["", "\n  \n\n"])
def test_jsonl_empty_file(tmp_path, content):
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(ManifestError, match="no JSON objects") as err:
        read_jsonl(path)
    assert str(path) in str(err.value)


def test_jsonl_missing_file_names_data_path(tmp_path):
    with pytest.raises(ManifestError, match=r"^data\.path: .*nope\.jsonl: no such file"):
        build_data(_jsonl_manifest(tmp_path / "nope.jsonl"))


def test_jsonl_not_utf8(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(GOOD_TEXT.encode() + b"\n" + '{"text": "caf\xe9"}'.encode("latin-1"))
    with pytest.raises(ManifestError, match=r"line 2: not UTF-8 \(byte 0xe9 at column 14\); save "):
        read_jsonl(path)


# --------------------------------------------------------------------------------------
# Sampler
# --------------------------------------------------------------------------------------


def _sequences(n: int, s: int = 4) -> Sequences:
    """n sequences whose tokens start with the row index and labels with it plus 1000 (so a
    batch shows which rows it holds)."""
    windows = np.arange(n, dtype=np.int64)[:, None].repeat(s + 1, axis=1)
    windows[:, 1] += 1000
    starts = np.arange(n + 1, dtype=np.int64) * (s + 1)
    return Sequences(windows.ravel(), starts, np.zeros(n, dtype=np.int64), s, pad=0)


def _global_batches(sampler: TrainSampler, steps: int) -> list[list[int]]:
    return [sampler.next_global_batch().tolist() for _ in range(steps)]


def _rank_steps(sampler: TrainSampler, steps: int) -> list[list[list[int]]]:
    return [[mb.indices.tolist() for mb in sampler.next_step()] for _ in range(steps)]


def test_sampler_is_deterministic_and_batches_hold_their_rows():
    data = _sequences(50)
    a = TrainSampler(data, seed=3, global_batch_size=8, micro_batch_size=2)
    b = TrainSampler(data, seed=3, global_batch_size=8, micro_batch_size=2)
    c = TrainSampler(data, seed=4, global_batch_size=8, micro_batch_size=2)
    steps_a = [a.next_step() for _ in range(10)]
    assert _rank_steps(b, 10) == [[mb.indices.tolist() for mb in step] for step in steps_a]
    assert _rank_steps(c, 10) != [[mb.indices.tolist() for mb in step] for step in steps_a]
    for step in steps_a:
        assert len(step) == 4
        for mb in step:
            assert mb.tokens.shape == mb.labels.shape == mb.position_ids.shape == (2, 4)
            assert mb.tokens.dtype == mb.labels.dtype == mb.position_ids.dtype == torch.int64
            assert mb.loss_mask.dtype == torch.float32
            assert torch.equal(mb.tokens[:, 0], mb.indices)
            assert torch.equal(mb.labels[:, 0], mb.indices + 1000)
            assert torch.equal(mb.position_ids, torch.arange(4).expand(2, 4))


def test_sampler_epochs_reshuffle_and_drop_the_incomplete_batch():
    sampler = TrainSampler(_sequences(10), seed=0, global_batch_size=4, micro_batch_size=4)
    assert sampler.steps_per_epoch == 2
    batches = _global_batches(sampler, 6)
    epochs = [batches[0] + batches[1], batches[2] + batches[3], batches[4] + batches[5]]
    for epoch, seen in enumerate(epochs):
        assert len(set(seen)) == 8  # no repeats within an epoch; 2 of 10 dropped
        order = torch.randperm(10, generator=torch.Generator().manual_seed(0 + epoch))
        assert seen == order[:8].tolist()
    assert epochs[0] != epochs[1] != epochs[2]
    assert sampler.state_dict() == {"epoch": 2, "cursor": 8, "seed": 0}


def test_sampler_resumes_exactly():
    data = _sequences(23)
    kwargs = {"seed": 11, "global_batch_size": 6, "micro_batch_size": 3}
    straight = _rank_steps(TrainSampler(data, **kwargs), 12)

    first = TrainSampler(data, **kwargs)
    head = _rank_steps(first, 5)
    state = json.loads(json.dumps(first.state_dict()))  # survives a JSON round trip
    assert all(type(v) is int for v in state.values())
    resumed = TrainSampler(data, **kwargs)
    resumed.load_state_dict(state)
    assert head + _rank_steps(resumed, 7) == straight

    with pytest.raises(ManifestError, match=r"seeds\.data"):
        TrainSampler(data, **{**kwargs, "seed": 12}).load_state_dict(state)


def test_sampler_global_batch_is_independent_of_data_parallel_size():
    data = _sequences(40)
    kwargs = {"seed": 5, "global_batch_size": 8, "micro_batch_size": 2}
    single = _rank_steps(TrainSampler(data, **kwargs), 9)
    ranks = [_rank_steps(TrainSampler(data, **kwargs, dp_rank=r, dp_size=2), 9) for r in (0, 1)]
    for step in range(9):
        assert len(ranks[0][step]) == len(ranks[1][step]) == 2  # 4 sequences per rank
        union = [i for rank in ranks for mb in rank[step] for i in mb]
        assert union == [i for mb in single[step] for i in mb]


def test_sampler_refuses_layouts_that_do_not_fit():
    with pytest.raises(ManifestError, match=r"schedule\.global_batch_size: 8 is more than"):
        TrainSampler(_sequences(5), seed=0, global_batch_size=8, micro_batch_size=1)
    with pytest.raises(ManifestError, match=r"micro_batch_size \* topology\.data_parallel"):
        TrainSampler(_sequences(50), seed=0, global_batch_size=8, micro_batch_size=3)
