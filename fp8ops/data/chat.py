"""Chat data (data kind ``chat``): conversations rendered by the tokenizer's own chat template,
the loss on the assistant's turns only.

A line of the file is ``{"messages": [{"role": ..., "content": ...}, ...], "buckets": {...}}``:
roles ``system`` (first only), ``user`` and ``assistant``, at least one assistant turn, string
contents; ``buckets`` as in SFT JSONL. Anything else is a ``ManifestError`` naming the file, the
line and what to fix.

The template is the one the tokenizer ships (``tokenizer_config.json``'s ``chat_template``, or
``chat_template.jinja`` beside it), rendered by transformers exactly as its
``apply_chat_template`` renders it. Which tokens are the assistant's is found by rendering: for
each assistant turn, the conversation before it with the generation prompt, and the conversation
up to its end. The characters between the two are the turn (its content and whatever the
template closes it with, such as an end-of-turn token: the model must learn to stop). The
rendered text is tokenized once, with character offsets, and a token is scored when it starts
inside an assistant turn. A template whose renderings are not prefixes of one another (one that
rewrites earlier turns) cannot be split this way and is refused.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from fp8ops.data.jsonl import bucket_labels, parse_line, text_field
from fp8ops.data.tasks import Example
from fp8ops.errors import ManifestError, relative

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Conversation:
    messages: tuple[dict[str, str], ...]
    buckets: dict[str, str]
    origin: str  # "FILE: line N"
    # A built-in task rendered as a chat (data.as_chat): its problem keys the records.
    task: Example | None = None


def task_conversation(example: Example) -> Conversation:
    """A built-in task as one user turn (its prompt) and the assistant's answer."""
    messages = (
        {"role": "user", "content": example.prompt.strip()},
        {"role": "assistant", "content": example.answer},
    )
    return Conversation(messages, example.buckets, example.origin, task=example)


@dataclass(frozen=True)
class Rendered:
    """A conversation as the model sees it: ids, which of them are scored, and the example its
    last assistant turn makes for generation-based evaluation."""

    ids: np.ndarray
    scored: np.ndarray  # uint8, 1 where the id is an assistant token
    example: Example


def read_chat(path: str | Path) -> list[Conversation]:
    """Read and check the chat JSONL file at ``path`` (``data.path``)."""
    path = Path(path)
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "no such file"
        raise ManifestError(f"data.path: {path}: {what}{relative(path)}; it must name a JSONL file")
    conversations: list[Conversation] = []
    bucket_names: tuple[str, ...] | None = None
    for number, line in enumerate(path.read_bytes().removeprefix(b"\xef\xbb\xbf").split(b"\n"), 1):
        where = f"{path}: line {number}"
        obj = parse_line(line, where)
        if obj is None:
            continue
        unknown = sorted(set(obj) - {"messages", "buckets"})
        if unknown or "messages" not in obj:
            what = f"has the key {unknown[0]!r}" if unknown else "has no 'messages'"
            raise ManifestError(
                f'{where}: {what}; a chat line is {{"messages": [...], "buckets": {{...}}}}'
            )
        buckets = bucket_labels(obj.get("buckets", {}), where)
        names = tuple(sorted(buckets))
        if bucket_names is None:
            bucket_names = names
        elif names != bucket_names:
            raise ManifestError(
                f"{where}: buckets are named {list(names)} but earlier lines name "
                f"{list(bucket_names)}; every conversation needs the same bucket names"
            )
        conversations.append(Conversation(_messages(obj["messages"], where), buckets, where))
    if not conversations:
        raise ManifestError(f"data.path: {path}: holds no conversations")
    return conversations


def _messages(messages: Any, where: str) -> tuple[dict[str, str], ...]:
    if not isinstance(messages, list) or not messages:
        raise ManifestError(f"{where}: 'messages' must be a non-empty list of turns")
    checked = []
    for index, message in enumerate(messages):
        at = f"{where}: messages[{index}]"
        if not isinstance(message, dict) or set(message) != {"role", "content"}:
            raise ManifestError(f'{at}: a turn is {{"role": ..., "content": ...}}, nothing else')
        role = message["role"]
        if role not in ROLES:
            raise ManifestError(f"{at}: role {role!r} is not one of {list(ROLES)}")
        if role == "system" and index != 0:
            raise ManifestError(f"{at}: a system turn may only come first")
        checked.append({"role": role, "content": text_field(message, "content", at)})
    if not any(m["role"] == "assistant" for m in checked):
        raise ManifestError(f"{where}: no assistant turn, so nothing to learn from; add one")
    return tuple(checked)


def template_sha256(template: str) -> str:
    return hashlib.sha256(template.encode()).hexdigest()


def render(
    conversations: list[Conversation], tokenizer, tokenizer_dir: Path
) -> tuple[list[Rendered], str]:
    """Each conversation's ids and assistant mask (module docstring), through transformers'
    rendering of the template in ``tokenizer_dir`` and fp8ops' ``tokenizer``; and the template
    that rendered them (transformers' choice when a directory holds more than one)."""
    import jinja2
    from transformers import AutoTokenizer

    renderer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    template = renderer.chat_template
    if isinstance(template, dict):  # named templates: the default one renders conversations
        template = template.get("default")
    if not isinstance(template, str) or not template.strip():
        raise ManifestError(
            f"tokenizer.path: {tokenizer_dir} has no chat template (tokenizer_config.json "
            "'chat_template', or chat_template.jinja), which chat data is rendered with; use a "
            "chat model's tokenizer, or data.kind 'jsonl'"
        )
    specials = [t for t in renderer.all_special_tokens if t]
    specials += [t.content for t in renderer.added_tokens_decoder.values() if t.special]

    def text(conversation: Conversation, messages, generation: bool) -> str:
        try:
            return renderer.apply_chat_template(
                list(messages),
                chat_template=template,
                tokenize=False,
                add_generation_prompt=generation,
            )
        except (jinja2.TemplateError, ValueError, TypeError) as exc:  # the template's own refusal
            raise ManifestError(
                f"{conversation.origin}: the chat template refuses this conversation ({exc}); "
                "change the conversation to what the model's template accepts"
            ) from None

    texts, spans, examples = [], [], []
    for conversation in conversations:
        messages = conversation.messages
        for index, message in enumerate(messages):
            inside = next((t for t in set(specials) if t in message["content"]), None)
            if inside is not None:
                raise ManifestError(
                    f"{conversation.origin}: messages[{index}]: content holds the tokenizer's "
                    f"special token {inside!r}, which would read as the template's own marker; "
                    "remove it from the text"
                )
        full = text(conversation, messages, False)
        turns = []
        for index, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = text(conversation, messages[:index], True)
            through = text(conversation, messages[: index + 1], False)
            if not (through.startswith(before) and full.startswith(through)):
                raise ManifestError(
                    f"{conversation.origin}: the chat template renders this conversation's turns "
                    "differently once later turns follow (or cannot render the turns before an "
                    "assistant turn alone), so the assistant's tokens cannot be told apart; "
                    "fp8ops needs a template that only appends"
                )
            turns.append((before, len(before), len(through)))
        prompt = turns[-1][0]  # the conversation up to its last assistant turn, prompted
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        task = conversation.task
        examples.append(
            Example(
                prompt,
                messages[last]["content"],
                conversation.buckets,
                # What the split hashes and the records name: the conversation itself, not its
                # rendering (which another tokenizer, or a date in the template, would change).
                problem=task.key if task else json.dumps(messages[:last], sort_keys=True),
                canonical=task.canonical if task else "",
                origin=conversation.origin,
                rendered=True,
            )
        )
        texts.append(full)
        spans.append([(begin, end) for _, begin, end in turns])
    rendered = []
    for (ids, offsets), turns, example in zip(
        tokenizer.encode_rendered(texts), spans, examples, strict=True
    ):
        ids = np.asarray(ids, dtype=np.int64)
        starts = np.array([start for start, _ in offsets], dtype=np.int64)
        scored = np.zeros(len(ids), dtype=np.uint8)
        for begin, end in turns:
            turn = (starts >= begin) & (starts < end)
            if not (ids[turn] == tokenizer.eod).any():
                raise ManifestError(
                    f"{example.origin}: the chat template ends the assistant's turn without the "
                    f"end-of-document token {tokenizer.eod_token!r}, so the model would never "
                    "learn to stop; set tokenizer.eod_token to the template's end-of-turn token "
                    "(ChatML: <|im_end|>)"
                )
            scored |= turn.astype(np.uint8)
        rendered.append(Rendered(ids, scored, example))
    return rendered, template
