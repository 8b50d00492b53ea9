"""tokenizer.kind 'huggingface': a tokenizer.json read with the tokenizers library, through the
data pipeline, the capability evaluation and a training run (docs/data.md).

The tokenizer is a small byte-level BPE trained here (the tokenizers library, no network), with
Llama 3's end-of-text token, saved as models ship it: tokenizer.json plus a
tokenizer_config.json naming its eos_token."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

tokenizers = pytest.importorskip("tokenizers", reason="needs the hf extra: pip install -e '.[hf]'")

from support.hf_models import EOT, TEXTS, make_tokenizer
from support.small_model import MANIFESTS, SCHEDULE, SMALL_MODEL, write_derived

from fp8ops.data import build_data, tokenizer_for
from fp8ops.data.tokenizer import TextRefused
from fp8ops.errors import ManifestError
from fp8ops.manifest import derive, load_manifest
from fp8ops.manifest.load import parse_manifest
from fp8ops.manifest.schema import TokenizerConfig


def config(path: Path, **fields) -> TokenizerConfig:
    return TokenizerConfig(kind="huggingface", path=str(path), **fields)


def test_text_round_trips_and_the_end_of_text_token_ends_it(tmp_path):
    tokenizer = tokenizer_for(config(make_tokenizer(tmp_path / "tok")))
    assert tokenizer.kind == "huggingface" and tokenizer.eod == tokenizer.pad == 1
    assert 256 < tokenizer.vocab_size <= 300
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert tokenizer.eod not in ids and tokenizer.decode(ids) == text
    ids = tokenizer.encode("add 12 39 = 51")
    assert len(ids) < len("add 12 39 = 51")  # merges: not one id per byte
    assert tokenizer.decode([*ids, tokenizer.eod, *ids]) == "add 12 39 = 51"
    with pytest.raises(ValueError, match=f"contains the end-of-document token '{EOT}'"):
        tokenizer.encode(f"one{EOT}two")
    # In batches (and chunks of them), the same ids; a refusal names the text.
    many = [f"{text} {i}" for i in range(1100) for text in TEXTS[:2]]
    assert tokenizer.encode_many(many) == [tokenizer.encode(text) for text in many]
    with pytest.raises(TextRefused) as refused:
        tokenizer.encode_many([*many[:1500], f"x{EOT}", "y"])
    assert refused.value.index == 1500 and EOT in str(refused.value)
    # No special tokens added: what the model sees is the text's own ids.
    assert tokenizer.encode("6") == [tokenizer._tokenizer.token_to_id("6")]


def test_the_fingerprint_covers_the_file_and_the_end_of_text_token(tmp_path):
    directory = make_tokenizer(tmp_path / "tok")
    first = tokenizer_for(config(directory)).fingerprint()
    assert tokenizer_for(config(directory / "tokenizer.json")).fingerprint() == first
    assert tokenizer_for(config(directory, eod_token="<|pad|>")).fingerprint() != first
    make_tokenizer(tmp_path / "tok", extra="a new merge a new merge")
    second = tokenizer_for(config(directory)).fingerprint()
    assert second != first
    with pytest.raises(ManifestError) as err:
        tokenizer_for(config(directory, fingerprint=first))
    assert str(err.value).startswith(
        f"tokenizer.fingerprint: the manifest expects {first} but the huggingface tokenizer is "
        f"{second} ({directory / 'tokenizer.json'} changed)"
    )


def test_a_missing_relative_tokenizer_path_says_where_it_was_looked_for(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ManifestError) as err:
        tokenizer_for(config(Path("tok/tokenizer.json")))
    assert str(err.value).startswith(
        "tokenizer.path: tok/tokenizer.json: no such file (relative to the current directory, "
        f"{tmp_path})"
    )


def test_bad_tokenizer_paths_and_tokens_are_named(tmp_path):
    directory = make_tokenizer(tmp_path / "tok")
    (tmp_path / "empty").mkdir()
    (tmp_path / "broken.json").write_text('{"version": "1.0", "model": 3}')
    no_config = make_tokenizer(tmp_path / "bare", config=False)
    other_eos = make_tokenizer(tmp_path / "other", config=False)
    (other_eos / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    cases = [
        (
            config(tmp_path / "missing.json"),
            (
                f"tokenizer.path: {tmp_path / 'missing.json'}: no "
                "such file; give a tokenizer.json or the directory holding it"
            ),
        ),
        (config(tmp_path / "empty"), f"tokenizer.path: {tmp_path / 'empty'} has no tokenizer.json"),
        (
            config(tmp_path / "broken.json"),
            (
                f"tokenizer.path: {tmp_path / 'broken.json'} is not "
                "a tokenizer.json the tokenizers library reads"
            ),
        ),
        (
            config(directory, eod_token="</s>"),
            (f"tokenizer.eod_token: '</s>' is not a token of {directory / 'tokenizer.json'}"),
        ),
        (
            config(no_config),
            (
                f"tokenizer.eod_token: not set, and there is no "
                f"{no_config / 'tokenizer_config.json'} to take an eos_token from"
            ),
        ),
        (
            config(directory, eod_token="A"),
            (
                f"tokenizer.eod_token: 'A' is a token of "
                f"{directory / 'tokenizer.json'}'s vocabulary, which ordinary text encodes to, not one "
                "of its added tokens"
            ),
        ),
        (
            config(other_eos),
            (
                f"tokenizer.eod_token: '</s>' (the eos_token of "
                f"{other_eos / 'tokenizer_config.json'}) is not a token of "
            ),
        ),
    ]
    for given, message in cases:
        with pytest.raises(ManifestError) as err:
            tokenizer_for(given)
        assert str(err.value).startswith(message), (str(err.value), message)
    assert tokenizer_for(config(no_config, eod_token=EOT)).eod == 1
    # An added token that is not marked special ends documents as well (fine-tuning adds them).
    from tokenizers import AddedToken, Tokenizer

    added = Tokenizer.from_file(str(no_config / "tokenizer.json"))
    added.add_tokens([AddedToken("<eos>", special=False)])
    added.save(str(no_config / "tokenizer.json"))
    assert tokenizer_for(config(no_config, eod_token="<eos>")).eod == added.token_to_id("<eos>")


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ("kind: huggingface", "tokenizer.path: required for kind 'huggingface'"),
        ("kind: byte\neod_token: x", "tokenizer.eod_token: must be null for kind 'byte'"),
        ("kind: sentencepiece\npath: t.model", "tokenizer.kind: is not supported: convert"),
    ],
)
def test_the_manifest_refuses_what_no_tokenizer_can_do(section, message):
    original = (MANIFESTS / "tiny-gpt-cpu.yaml").read_text()
    text = re.sub(
        r"(?m)^tokenizer:\n  kind: byte.*\n",
        "tokenizer:\n  " + section.replace("\n", "\n  ") + "\n",
        original,
    )
    assert text != original
    with pytest.raises(ManifestError, match=message.replace("(", r"\(")):
        parse_manifest(text, "m.yaml")


def _manifest(tmp_path: Path, data: Path, **changes):
    base = load_manifest(MANIFESTS / "tiny-gpt-cpu.yaml")
    return derive(
        base,
        {
            **SMALL_MODEL,
            "model.vocab_size": 300,
            "model.init_checkpoint": None,
            "tokenizer.kind": "huggingface",
            "tokenizer.path": str(make_tokenizer(tmp_path / "tok")),
            "data.kind": "jsonl",
            "data.path": str(data),
            **changes,
        },
        "test: hf tokenizer",
    )


def _sft_file(tmp_path: Path, count: int = 300) -> Path:
    path = tmp_path / "sft.jsonl"
    rows = [{"prompt": f"add {i} {i + 1} = ", "answer": str(2 * i + 1)} for i in range(count)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_sft_sequences_are_the_tokenizers_ids_ended_by_its_end_of_text(tmp_path):
    manifest = _manifest(tmp_path, _sft_file(tmp_path))
    data = build_data(manifest)
    tokenizer = tokenizer_for(manifest.tokenizer)
    assert data.source["tokenizer"] == "huggingface"
    assert data.source["tokenizer_fingerprint"] == tokenizer.fingerprint()
    batch = data.train.batch([0])
    example, tokens, mask = data.train.examples[0], batch.tokens[0], batch.loss_mask[0]
    prompt, answer = tokenizer.encode(example.prompt), tokenizer.encode(example.answer)
    ids = prompt + answer + [tokenizer.eod]
    assert tokens[: len(ids) - 1].tolist() == ids[:-1]
    assert batch.labels[0][: len(ids) - 1].tolist() == ids[1:]
    scored = mask.nonzero().flatten().tolist()
    assert scored == list(range(len(prompt) - 1, len(ids) - 1))  # the answer and its end
    assert data.train.ids.dtype == np.uint16  # a vocabulary past 256 ids, under 65,536
    # Padded with the end-of-text id (never scored), not with the byte tokenizer's 0.
    assert set(tokens[len(ids) - 1 :].tolist()) == {tokenizer.eod}


def always_predicting(token: int):
    """A stand-in for the GPT in generation: every position's logits favour ``token``."""
    import torch

    class Always(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.unused = torch.nn.Parameter(torch.zeros(1))  # generation reads its device

        def forward(self, tokens, positions, labels, runtime_gather_output=False):
            logits = torch.zeros(*tokens.shape, 300)
            logits[..., token] = 1.0
            return logits

    return Always()


def test_generation_stops_at_the_tokenizers_end_of_text_id():
    """A model that always predicts id 1: with the end-of-text id 1 every answer is that one
    token; under the byte tokenizer's 0 it would run to max_new_tokens."""
    from fp8ops.evaluate.capability import generate

    prompts = [[5, 6, 7], [8]]
    kwargs = {"max_new_tokens": 6, "seq_length": 64, "vocab_size": 300}
    assert generate(always_predicting(1), prompts, eod=1, **kwargs) == [[1], [1]]
    assert generate(always_predicting(1), prompts, eod=0, **kwargs) == [[1] * 6, [1] * 6]


def test_the_capability_evaluation_generates_up_to_the_tokenizers_end_of_text(tmp_path):
    """A model that always predicts id 0, "<|pad|>" here: not the end of text (id 1), so every
    answer runs to max_new_tokens; the byte tokenizer's end (0) would stop it at one."""
    from fp8ops.data.tasks import Example
    from fp8ops.evaluate.capability import evaluate_capability

    manifest = _manifest(tmp_path, _sft_file(tmp_path), **{"capability.max_new_tokens": 5})
    tokenizer = tokenizer_for(manifest.tokenizer)
    examples = [Example("add 1 2 = ", "3"), Example("add 2 2 = ", "4")]
    predictions = evaluate_capability(always_predicting(0), examples, manifest, tokenizer)
    assert [p["generated"] for p in predictions] == ["<|pad|>" * 5] * 2
    assert not any(p["correct"] for p in predictions)


def test_truncation_and_padding_a_tokenizer_json_ships_are_switched_off(tmp_path):
    """fp8ops cuts and pads the data itself and says so; a tokenizer.json's own settings would
    cut documents and answers silently."""
    from tokenizers import Tokenizer

    directory = make_tokenizer(tmp_path / "tok")
    raw = Tokenizer.from_file(str(directory / "tokenizer.json"))
    raw.enable_truncation(max_length=4)
    raw.enable_padding(length=16, pad_id=0, pad_token="<|pad|>")
    raw.save(str(directory / "tokenizer.json"))
    tokenizer = tokenizer_for(config(directory))
    text = "add 12 39 = 51 and then some more words"
    shipped = raw.encode(text, add_special_tokens=False).ids  # what the file says: cut, padded
    assert len(shipped) == 16 and shipped[4:] == [0] * 12
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert len(tokenizer.encode("6")) == 1


def test_the_vocabulary_size_is_the_largest_id_plus_one(tmp_path):
    """Ids need not be contiguous: a tokenizer.json with a token at id 5000 needs an embedding
    of 5001 rows, however many tokens it has."""
    directory = make_tokenizer(tmp_path / "tok")
    document = json.loads((directory / "tokenizer.json").read_text())
    vocab = document["model"]["vocab"]
    token = next(t for t, i in vocab.items() if i == max(vocab.values()))
    vocab[token] = 5000
    (directory / "tokenizer.json").write_text(json.dumps(document))
    tokenizer = tokenizer_for(config(directory))
    assert tokenizer.vocab_size == 5001


def test_text_holding_the_end_of_text_token_is_named_by_line(tmp_path):
    path = tmp_path / "text.jsonl"
    lines = [json.dumps({"text": f"document {i} " * 20}) for i in range(30)]
    lines[6] = json.dumps({"text": f"a chat log {EOT} that ends early"})
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(ManifestError) as err:
        build_data(_manifest(tmp_path, path))
    assert str(err.value).startswith(
        f"{path}: line 7: text contains the end-of-document token '{EOT}'"
    )
    # An SFT answer too: the example is named by its line.
    sft = tmp_path / "sft.jsonl"
    rows = [{"prompt": f"add {i} 1 = ", "answer": str(i + 1)} for i in range(40)]
    rows[2]["answer"] = f"3{EOT}"
    sft.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(ManifestError) as err:
        build_data(_manifest(tmp_path, sft))
    assert str(err.value).startswith(f"{sft}: line 3: text contains the end-of-document token")


def test_a_model_vocabulary_smaller_than_the_tokenizers_and_the_corpus_are_refused(tmp_path):
    with pytest.raises(
        ManifestError,
        match=r"^model.vocab_size: 256 is smaller than the tokenizer's \d+ ids; set it to at least",
    ):
        build_data(_manifest(tmp_path, _sft_file(tmp_path), **{"model.vocab_size": 256}))
    with pytest.raises(ManifestError, match="'corpus' is fp8ops' byte-level demo text"):
        build_data(
            _manifest(tmp_path, _sft_file(tmp_path), **{"data.kind": "corpus", "data.path": None})
        )


@pytest.mark.slow
def test_a_run_trains_evaluates_and_records_the_tokenizer(tmp_path):
    """End to end on the CPU: FP8 training, the held-out loss, and greedy answers decoded by the
    tokenizer and stopped at its end-of-text id."""
    from fp8ops.evaluate.records import read_predictions
    from fp8ops.run import read_metrics
    from fp8ops.train import run_training

    manifest_file = tmp_path / "hf.yaml"
    write_derived(
        manifest_file,
        MANIFESTS / "tiny-gpt-cpu.yaml",
        {
            **SMALL_MODEL,
            **SCHEDULE,
            "model.vocab_size": 300,
            "model.init_checkpoint": None,
            "tokenizer.kind": "huggingface",
            "tokenizer.path": str(make_tokenizer(tmp_path / "tok")),
            "data.kind": "jsonl",
            "data.path": str(_sft_file(tmp_path)),
            "schedule.train_steps": 4,
            "schedule.eval_interval": 4,
            "schedule.checkpoint_interval": 4,
            "capability.items": 8,
            "capability.max_new_tokens": 8,
            "optimizer.lr": 1e-3,
        },
    )
    run = tmp_path / "run"
    run_training(manifest_file, run, progress=False)
    metrics = read_metrics(run)
    assert [m.step for m in metrics] == [1, 2, 3, 4]
    info = json.loads((run / "run.json").read_text())
    tokenizer = tokenizer_for(load_manifest(run / "manifest.yaml").tokenizer)
    assert info["tokenizer"] == {"kind": "huggingface", "fingerprint": tokenizer.fingerprint()}
    [record] = [json.loads(line) for line in (run / "capability.jsonl").read_text().splitlines()]
    assert record["step"] == 4 and record["items"] == 8
    predictions = read_predictions(run, record)
    assert len(predictions) == 8
    for item in predictions:
        assert EOT not in item["generated"]  # decoding stops at the end-of-text id
        assert tokenizer.decode(tokenizer.encode(item["generated"])) == item["generated"]


@pytest.fixture(scope="module")
def paused_run(tmp_path_factory):
    """A run with its own tokenizer.json and JSONL data, paused at step 2 of 6."""
    from fp8ops.train import run_training

    tmp = tmp_path_factory.mktemp("paused")
    manifest_file = tmp / "hf.yaml"
    write_derived(
        manifest_file,
        MANIFESTS / "tiny-gpt-cpu.yaml",
        {
            **SMALL_MODEL,
            **SCHEDULE,
            "model.vocab_size": 300,
            "model.init_checkpoint": None,
            "tokenizer.kind": "huggingface",
            "tokenizer.path": str(make_tokenizer(tmp / "tok")),
            "data.kind": "jsonl",
            "data.path": str(_sft_file(tmp)),
            "schedule.train_steps": 6,
            "schedule.eval_interval": 6,
            "schedule.checkpoint_interval": 6,
            "capability.items": 4,
            "capability.max_new_tokens": 8,
        },
    )
    run_training(manifest_file, tmp / "run", progress=False, stop_at=2)
    return tmp


@pytest.mark.parametrize("edit", ["decoder", "merges", "data"])
@pytest.mark.slow
def test_a_resume_refuses_a_tokenizer_or_data_file_edited_since_the_run_started(
    edit, paused_run, cli
):
    """The manifest is locked, the files it names are not. A tokenizer.json whose decoder
    changed encodes the same data (only the capability answers would read otherwise); one
    retrained changes the ids and, with a token more, would fail model.vocab_size first.
    Either is refused as the tokenizer, before the data is built; an edited data file as the
    data, naming the file and both hashes."""
    run, tok = paused_run / "run", paused_run / "tok" / "tokenizer.json"
    data = paused_run / "sft.jsonl"
    originals = {tok: tok.read_bytes(), data: data.read_bytes()}
    files = {path: path.read_bytes() for path in run.rglob("*") if path.is_file()}
    try:
        if edit == "decoder":
            tok.write_text(json.dumps({**json.loads(tok.read_text()), "decoder": None}))
        elif edit == "merges":
            make_tokenizer(tok.parent, extra="add add add 1 2 3 = " * 50)
        else:
            data.write_text(data.read_text().replace('"answer": "7"', '"answer": "8"', 1))
        refused = cli("resume", run, "--no-progress")
        assert refused.code == 4, refused.err
        if edit == "data":
            recorded = json.loads((run / "run.json").read_text())["data"]["source"]
            assert (
                f"the training data changed since the run started (data.path {data}: "
                f"file_sha256 {recorded['file_sha256'][:12]} -> "
            ) in refused.err, refused.err
            assert "in a new run (another --run-dir)" in refused.err
        else:
            recorded = json.loads((run / "run.json").read_text())["tokenizer"]["fingerprint"]
            assert (
                f"tokenizer.path {tok.parent} (its bytes or the end-of-document token "
                f"'{EOT}') changed since the run started (run.json records tokenizer "
                f"fingerprint {recorded[:12]}, it now hashes to "
            ) in refused.err, refused.err
            assert "vocab_size" not in refused.err
        assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == files
    finally:
        for path, content in originals.items():
            path.write_bytes(content)
    step = json.loads((run / "status.json").read_text())["step"]
    resumed = cli("resume", run, "--stop-at", step + 1, "--no-progress")  # restored: it goes on
    assert resumed.code == 0 and f"paused at step {step + 1}" in resumed.out, resumed.err
