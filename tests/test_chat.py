"""Chat data (data kind 'chat', docs/data.md): conversations rendered by the tokenizer's own chat
template, as transformers renders them, the loss on the assistant's turns only, checked token by
token; overlong conversations dropped or truncated and counted; bad lines refused by file and
line. The tokenizer is a small BPE with ChatML's turn markers (support/hf_models.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")

from support.hf_models import make_chat_tokenizer
from support.small_model import write_derived
from tokenizers import Tokenizer

from fp8ops.data import build_data
from fp8ops.errors import ManifestError
from fp8ops.evaluate.capability import prompt_ids
from fp8ops.manifest import load_manifest

TINY = Path(__file__).resolve().parents[1] / "manifests" / "tiny-gpt-cpu.yaml"
SYSTEM = {"role": "system", "content": "Answer with a number."}
CONVERSATIONS = [
    [
        SYSTEM,
        {"role": "user", "content": f"add {a} {b}"},
        {"role": "assistant", "content": str(a + b)},
    ]
    for a in range(10)
    for b in range(4)
] + [
    [
        {"role": "user", "content": "add 2 3"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "and 4 4?"},
        {"role": "assistant", "content": "8"},
    ]
]


def write_chat(path: Path, conversations, **line) -> Path:
    lines = [json.dumps({"messages": c, **line}) for c in conversations]
    path.write_text("\n".join(lines) + "\n")
    return path


def manifest_for(tmp_path: Path, data: Path, tokenizer: Path, **changes):
    return load_manifest(
        write_derived(
            tmp_path / f"chat-{len(list(tmp_path.glob('chat-*')))}.yaml",
            TINY,
            {
                "tokenizer.kind": "huggingface",
                "tokenizer.path": str(tokenizer),
                "data.kind": "chat",
                "data.path": str(data),
                "data.eval_fraction": 0.2,
                "data.split_version": 2,
                "model.vocab_size": 320,
                "model.init_checkpoint": None,
                **changes,
            },
        )
    )


@pytest.fixture
def tokenizer_dir(tmp_path) -> Path:
    return make_chat_tokenizer(tmp_path / "tok")


def scored_text(data, tokenizer_dir: Path) -> list[tuple[str, list[str]]]:
    """Each training row as (its whole text, the texts of its scored runs), read back from the
    batch: labels at the positions whose loss mask is 1."""
    raw = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    out = []
    for row in range(len(data.train)):
        batch = data.train.batch([row])
        labels, mask = batch.labels[0].tolist(), batch.loss_mask[0].tolist()
        ids = [batch.tokens[0, 0].item(), *labels]
        runs, current = [], []
        for label, scored in zip(labels, mask, strict=True):
            if scored:
                current.append(label)
            elif current:
                runs.append(raw.decode(current, skip_special_tokens=False))
                current = []
        if current:
            runs.append(raw.decode(current, skip_special_tokens=False))
        length = int(data.train.starts[row + 1] - data.train.starts[row])
        out.append((raw.decode(ids[:length], skip_special_tokens=False), runs))
    return out


def test_only_the_assistants_turns_are_scored_token_by_token(tmp_path, tokenizer_dir):
    data = build_data(
        manifest_for(tmp_path, write_chat(tmp_path / "c.jsonl", CONVERSATIONS), tokenizer_dir)
    )
    rows = scored_text(data, tokenizer_dir)
    rows_by_prompt = {
        text.split("<|im_start|>user\n")[1].split("<|im_end|>")[0]: (text, runs)
        for text, runs in rows
    }
    for prompt, (text, runs) in rows_by_prompt.items():
        if prompt.startswith("add") and "and 4 4?" not in text:
            a, b = map(int, prompt.split()[1:])
            assert text == (
                "<|im_start|>system\nAnswer with a number.<|im_end|>\n"
                f"<|im_start|>user\nadd {a} {b}<|im_end|>\n<|im_start|>assistant\n{a + b}<|im_end|>\n"
            )
            assert runs == [f"{a + b}<|im_end|>\n"]  # the answer and the end of its turn only
    assert data.train.loss_tokens() == sum(
        len(
            Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
            .encode(r, add_special_tokens=False)
            .ids
        )
        for _, runs in rows
        for r in runs
    )


def test_a_multi_turn_conversation_scores_every_assistant_turn(tmp_path, tokenizer_dir):
    conversation = CONVERSATIONS[-1]
    data = build_data(
        manifest_for(
            tmp_path,
            write_chat(tmp_path / "c.jsonl", [conversation] * 1 + CONVERSATIONS[:9]),
            tokenizer_dir,
            **{"data.eval_fraction": 0.0},
        )
    )
    rows = [r for r in scored_text(data, tokenizer_dir) if "and 4 4?" in r[0]]
    assert rows and rows[0][1] == ["5<|im_end|>\n", "8<|im_end|>\n"]


def test_the_evaluation_prompt_is_the_conversation_up_to_the_last_assistant_turn(
    tmp_path, tokenizer_dir
):
    data = build_data(
        manifest_for(tmp_path, write_chat(tmp_path / "c.jsonl", CONVERSATIONS), tokenizer_dir)
    )
    example = data.eval.examples[0]
    assert example.rendered and example.prompt.endswith("<|im_start|>assistant\n")
    assert example.answer.isdigit()
    from fp8ops.data.tokenizer import tokenizer_for

    tokenizer = tokenizer_for(manifest_for(tmp_path, tmp_path / "c.jsonl", tokenizer_dir).tokenizer)
    ids = prompt_ids(tokenizer, example)
    row = data.eval.ids[data.eval.starts[0] : data.eval.starts[1]].tolist()
    assert row[: len(ids)] == ids  # the prompt is the row's own prefix
    assert data.source["chat_template_sha256"] and data.source["conversations"] == len(
        CONVERSATIONS
    )


def test_overlong_conversations_are_dropped_or_truncated_and_counted(tmp_path, tokenizer_dir):
    long = [
        SYSTEM,
        {"role": "user", "content": "add " + "9 " * 120},
        {"role": "assistant", "content": "540"},
    ]
    file = write_chat(tmp_path / "c.jsonl", [*CONVERSATIONS, long, long])
    dropped = build_data(manifest_for(tmp_path, file, tokenizer_dir, **{"model.seq_length": 96}))
    assert dropped.source["overlong_dropped"] == 2 and dropped.source["overlong_truncated"] == 0
    kept = len(dropped.train) + len(dropped.eval)
    truncated = build_data(
        manifest_for(
            tmp_path, file, tokenizer_dir, **{"model.seq_length": 96, "data.overlong": "truncate"}
        )
    )
    # Cut at 97 tokens, the long conversations lose their answer, so they are dropped as well:
    # counted apart, never silently.
    assert truncated.source["overlong_truncated"] == 2
    assert truncated.source["no_assistant_tokens_dropped"] == 2
    assert len(truncated.train) + len(truncated.eval) == kept


def test_the_template_is_part_of_the_data_fingerprint(tmp_path, tokenizer_dir):
    file = write_chat(tmp_path / "c.jsonl", CONVERSATIONS)
    before = build_data(manifest_for(tmp_path, file, tokenizer_dir))
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{#- another template that renders alike -#}" + config["chat_template"]
    )
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps(config))
    after = build_data(manifest_for(tmp_path, file, tokenizer_dir))
    assert after.train.ids.tobytes() == before.train.ids.tobytes()  # the same tokens ...
    assert after.source["chat_template_sha256"] != before.source["chat_template_sha256"]
    assert after.fingerprint != before.fingerprint  # ... but other data: another template


def test_a_truncated_turn_keeps_its_first_tokens_scored(tmp_path, tokenizer_dir):
    long_answer = " ".join(["add"] * 80)
    long = [
        SYSTEM,
        {"role": "user", "content": "say add"},
        {"role": "assistant", "content": long_answer},
    ]
    file = write_chat(tmp_path / "c.jsonl", [*CONVERSATIONS, long])
    data = build_data(
        manifest_for(
            tmp_path,
            file,
            tokenizer_dir,
            **{"model.seq_length": 96, "data.overlong": "truncate", "data.eval_fraction": 0.0},
        )
    )
    assert data.source["overlong_truncated"] == 1
    rows = [r for r in scored_text(data, tokenizer_dir) if "say add" in r[0]]
    (_, runs) = rows[0]
    assert len(runs) == 1 and long_answer.startswith(runs[0]) and len(runs[0]) < len(long_answer)
    assert "<|im_end|>" not in runs[0]  # cut inside the answer, before its end of turn


def test_a_template_without_the_end_of_document_token_is_refused(tmp_path):
    tokenizer_dir = make_chat_tokenizer(tmp_path / "tok")
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    config["eos_token"] = "<|endoftext|>"  # not what ChatML ends a turn with
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps(config))
    file = write_chat(tmp_path / "c.jsonl", CONVERSATIONS)
    with pytest.raises(
        ManifestError, match="ends the assistant's turn without the end-of-document"
    ):
        build_data(manifest_for(tmp_path, file, tokenizer_dir))


def test_content_holding_a_special_token_and_a_refusing_template_are_named(tmp_path, tokenizer_dir):
    file = tmp_path / "c.jsonl"
    injected = [{"role": "user", "content": "hi<|im_end|>"}, {"role": "assistant", "content": "x"}]
    write_chat(file, [CONVERSATIONS[0], injected])
    with pytest.raises(
        ManifestError,
        match=r"line 2: messages\[0\]: content holds the tokenizer's special token '<\|im_end\|>'",
    ):
        build_data(manifest_for(tmp_path, file, tokenizer_dir))
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
        "{% endif %}" + config["chat_template"]
    )
    (tokenizer_dir / "tokenizer_config.json").write_text(json.dumps(config))
    write_chat(file, CONVERSATIONS)
    with pytest.raises(
        ManifestError,
        match="line 1: the chat template refuses this conversation .System role not supported",
    ):
        build_data(manifest_for(tmp_path, file, tokenizer_dir))


BAD_LINES = {
    "unknown role": (
        {"messages": [{"role": "tool", "content": "x"}, {"role": "assistant", "content": "y"}]},
        "line 2: messages[0]: role 'tool' is not one of",
    ),
    "no assistant": (
        {"messages": [{"role": "user", "content": "hi"}]},
        "line 2: no assistant turn",
    ),
    "not a string": (
        {"messages": [{"role": "user", "content": ["hi"]}, {"role": "assistant", "content": "y"}]},
        "line 2: messages[0]: 'content' must be a string, got an array",
    ),
    "system later": (
        {
            "messages": [
                {"role": "user", "content": "a"},
                {"role": "system", "content": "b"},
                {"role": "assistant", "content": "c"},
            ]
        },
        "line 2: messages[1]: a system turn may only come first",
    ),
    "extra key": (
        {
            "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "c"}],
            "id": 3,
        },
        "line 2: has the key 'id'",
    ),
    "no messages": ({"prompt": "a", "answer": "b"}, "line 2: has the key 'answer'"),
}


@pytest.mark.parametrize("case", list(BAD_LINES))
def test_a_bad_line_is_refused_naming_the_file_and_line(case, tmp_path, tokenizer_dir):
    line, message = BAD_LINES[case]
    file = tmp_path / "c.jsonl"
    file.write_text(json.dumps({"messages": CONVERSATIONS[0]}) + "\n" + json.dumps(line) + "\n")
    with pytest.raises(ManifestError) as refused:
        build_data(manifest_for(tmp_path, file, tokenizer_dir))
    assert f"{file}: {message}" in str(refused.value)


def test_a_tokenizer_without_a_chat_template_is_refused(tmp_path):
    tokenizer_dir = make_chat_tokenizer(tmp_path / "plain", template=None)
    file = write_chat(tmp_path / "c.jsonl", CONVERSATIONS)
    with pytest.raises(
        ManifestError, match=f"tokenizer.path: {tokenizer_dir} has no chat template"
    ):
        build_data(manifest_for(tmp_path, file, tokenizer_dir))


def test_the_byte_tokenizer_is_refused_for_chat(tmp_path):
    file = write_chat(tmp_path / "c.jsonl", CONVERSATIONS)
    manifest = load_manifest(
        write_derived(
            tmp_path / "b.yaml",
            TINY,
            {"data.kind": "chat", "data.path": str(file), "model.init_checkpoint": None},
        )
    )
    with pytest.raises(ManifestError, match="tokenizer.kind 'byte' has none"):
        build_data(manifest)


def test_the_built_in_tasks_render_as_chats_with_their_split_and_problems(tmp_path, tokenizer_dir):
    manifest = manifest_for(
        tmp_path,
        tmp_path / "unused.jsonl",
        tokenizer_dir,
        **{"data.kind": "tasks", "data.path": None, "data.as_chat": True, "data.num_examples": 200},
    )
    data = build_data(manifest)
    plain = build_data(
        load_manifest(
            write_derived(
                tmp_path / "plain.yaml",
                TINY,
                {
                    "data.num_examples": 200,
                    "data.split_version": 2,
                    "data.eval_fraction": 0.2,
                    "model.init_checkpoint": None,
                },
            )
        )
    )
    # The same problems held out as the plain tasks: the split is the tasks' own.
    assert [e.key for e in data.eval.examples] == [e.key for e in plain.eval.examples]
    text, runs = scored_text(data, tokenizer_dir)[0]
    example, task = data.train.examples[0], plain.train.examples[0]
    assert example.key == task.key and example.answer == task.answer
    assert f"<|im_start|>user\n{task.prompt.strip()}<|im_end|>\n<|im_start|>assistant\n" in text
    assert runs == [f"{task.answer}<|im_end|>\n"]
    assert data.train.buckets[0].keys() == {"task", "length", "difficulty", "format"}


def test_as_chat_is_only_for_the_built_in_tasks(tmp_path):
    with pytest.raises(ManifestError, match="data.as_chat: only for kind 'tasks'"):
        load_manifest(
            write_derived(
                tmp_path / "m.yaml",
                TINY,
                {
                    "data.kind": "jsonl",
                    "data.path": "x.jsonl",
                    "data.as_chat": True,
                    "model.init_checkpoint": None,
                },
            )
        )
