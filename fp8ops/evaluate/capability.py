"""Capability evaluation: greedy answers to held-out task items, scored by exact match.

The loss on held-out answers says how likely the model finds them; this says whether it
*produces* them. For the first ``capability.items`` examples of the eval split (always the same
ones, in order; under ``data.split_version`` 2 a fair sample of it), the model continues the
prompt greedily and ``fp8ops.data.tasks.check`` compares the continuation with the answer. ``records.py`` writes and reads what comes out.

Decoding, ``micro_batch_size`` prompts at a time::

    rows right-padded to the longest live row  ->  model(tokens)  ->  logits [b, s, padded vocab]
    each row's logits at its own last real token, real vocabulary only  ->  argmax  ->  append

Causal attention: the padding after a row's last real token cannot affect that position. A row
stops at end-of-document, after ``max_new_tokens``, or when it fills the model's positions; it
then leaves the batch, and the forward covers only the positions the live rows need. No KV cache:
every step recomputes the prefix, which on these short prompts is cheap and leaves nothing to get
out of step.

The caller decides the precision and the bookkeeping around it (``fp8ops.train.evaluation``:
FP8 with the training scales, FP8 state restored afterwards, telemetry paused). At TP>1 every
rank runs this together: the logits are gathered across the TP group, so every rank picks the
same tokens and stops rows at the same steps, and their collectives stay in step. Under pipeline
parallelism each forward goes through Megatron's schedule, the last stage picks the tokens, and
every stage receives them (``fp8ops.megatron.pipeline``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from fp8ops.data.batches import TokenizedData
from fp8ops.data.tasks import Example, check
from fp8ops.data.tokenizer import Tokenizer
from fp8ops.errors import ManifestError


def capability_examples(data: TokenizedData, config, tokenizer: Tokenizer) -> list[Example]:
    """The examples a capability evaluation generates for (``config``: the manifest's
    ``capability`` section): the first ``items`` of the eval split (under split version 2 a fair
    sample of it); none when it is off, for text data (nothing to check) or without an eval split.

    Refuses a ``max_new_tokens`` shorter than an item's answer: that item could never be
    answered right, and with every answer too long both runs of a comparison would score 0 and
    pass the accuracy gate without anything measured.
    """
    if not config.enabled or data.objective != "sft":
        return []
    examples = list(data.eval.examples)
    if any(example.rendered for example in examples):
        # A truncated conversation (data.overlong: truncate) can keep a prompt longer than a
        # sequence: it trains and evaluates its loss, but nothing could be generated after it.
        fits = [len(prompt_ids(tokenizer, e)) < data.seq_length for e in examples]
        examples = [e for e, fit in zip(examples, fits, strict=True) if fit]
    examples = examples[: config.items]  # items None: all of them
    lengths = [len(tokenizer.encode(example.answer.rstrip())) for example in examples]
    too_long = [(n, e) for n, e in zip(lengths, examples, strict=True) if n > config.max_new_tokens]
    if too_long:
        longest, example = max(too_long, key=lambda pair: pair[0])
        where = f" ({example.origin})" if example.origin else ""
        raise ManifestError(
            f"capability.max_new_tokens: {config.max_new_tokens} is too few for {len(too_long)} "
            f"of the {len(examples)} capability items, which could never be answered right; the "
            f"longest answer{where} is {longest} tokens. Raise capability.max_new_tokens to at "
            f"least {longest}, or lower capability.items to leave out long answers"
        )
    return examples


def prompt_ids(tokenizer: Tokenizer, example: Example) -> list[int]:
    """What the model is prompted with: the prompt's ids; a chat prompt (rendered by the chat
    template, up to the assistant's turn) with the template's special tokens as they are."""
    if example.rendered:
        return tokenizer.encode_rendered([example.prompt])[0][0]
    return tokenizer.encode(example.prompt)


@torch.no_grad()
def evaluate_capability(
    model,
    examples: Sequence[Example],
    manifest,
    tokenizer: Tokenizer,
    *,
    fp8: Callable = contextlib.nullcontext,
) -> list[dict[str, Any]]:
    """One prediction record per example, in order (the per-item lines of ``records.py``).

    ``examples`` are the eval split's first rows (:func:`capability_examples`), so an example's
    position is its row. ``tokenizer``: the run's, built once when its data was (a tokenizer
    file edited mid-run must not change how prompts are encoded). ``fp8()`` opens the
    precision context each forward runs in."""
    batch_size = manifest.schedule.micro_batch_size
    # A model may have more ids than the tokenizer (byte tokens need vocab_size >= 256, not
    # == 256); ids the tokenizer cannot decode are not answers.
    vocab_size = min(manifest.model.vocab_size, tokenizer.vocab_size)
    length_multiple = 1
    if manifest.precision.enabled and manifest.precision.backend == "te":
        from fp8ops.megatron.te_backend import FP8_TOKEN_MULTIPLE

        length_multiple = FP8_TOKEN_MULTIPLE
    if manifest.topology.sequence_parallel:  # each TP rank takes an equal part of the sequence
        length_multiple = math.lcm(length_multiple, manifest.topology.tensor_parallel)
    predictions = []
    for start in range(0, len(examples), batch_size):
        batch = examples[start : start + batch_size]
        continuations = generate(
            model,
            [prompt_ids(tokenizer, example) for example in batch],
            max_new_tokens=manifest.capability.max_new_tokens,
            seq_length=manifest.model.seq_length,
            vocab_size=vocab_size,
            fp8=fp8,
            length_multiple=length_multiple,
            eod=tokenizer.eod,
        )
        for row, (example, ids) in enumerate(zip(batch, continuations, strict=True), start):
            generated = tokenizer.decode(ids)
            predictions.append(
                {
                    "index": row,
                    "key": example.key,
                    "prompt": example.prompt,
                    "answer": example.answer,
                    "generated": generated,
                    "correct": check(example, generated),
                    "buckets": example.buckets,
                }
            )
    return predictions


@torch.no_grad()
def generate(
    model,
    prompts: Sequence[list[int]],
    *,
    max_new_tokens: int,
    seq_length: int,
    vocab_size: int,
    eod: int,
    fp8: Callable = contextlib.nullcontext,
    length_multiple: int = 1,
) -> list[list[int]]:
    """Greedy continuations of ``prompts`` (token ids), generated as one batch.

    A continuation ends with the tokenizer's end-of-document id ``eod`` when the model produced
    one; otherwise it stopped after ``max_new_tokens``, or when prompt and continuation hold ``seq_length + 1``
    tokens (a training window: the model has no position to read the next one from). Ids are
    below ``vocab_size``: the embedding's padding rows are never chosen. ``length_multiple``:
    each forward's rows are padded to a multiple of it (TE's FP8 GEMMs take token counts in
    multiples of 8), never past ``seq_length``.
    """
    if seq_length % length_multiple:  # else the padding could run past the positions
        raise ValueError(f"seq_length {seq_length} is not a multiple of {length_multiple}")
    for prompt in prompts:
        if not 1 <= len(prompt) <= seq_length:
            raise ValueError(f"a prompt must have 1 to {seq_length} tokens, not {len(prompt)}")
    rows = [list(prompt) for prompt in prompts]
    continuations: list[list[int]] = [[] for _ in prompts]
    live = list(range(len(prompts)))
    while live:
        batch = [rows[i] for i in live]
        for i, token in zip(live, next_tokens(model, batch, vocab_size, fp8, length_multiple)):
            rows[i].append(token)
            continuations[i].append(token)
        live = [
            i
            for i in live
            if continuations[i][-1] != eod
            and len(continuations[i]) < max_new_tokens
            and len(rows[i]) <= seq_length
        ]
    return continuations


def next_tokens(
    model,
    rows: Sequence[list[int]],
    vocab_size: int,
    fp8: Callable = contextlib.nullcontext,
    length_multiple: int = 1,
) -> list[int]:
    """The greedy next token of each row: one forward over the rows right-padded to the longest,
    rounded up to ``length_multiple``. Attention is causal, so no padding reaches the logits a
    row's last token reads."""
    device = next(model.parameters()).device
    lengths = torch.tensor([len(row) for row in rows], device=device)
    b, s = len(rows), -(-max(len(row) for row in rows) // length_multiple) * length_multiple
    # Filled on the host and moved once (no copy on the CPU), not one transfer per row. The
    # padding's id does not matter: no real position attends to it.
    tokens = torch.zeros((b, s), dtype=torch.int64)
    for i, row in enumerate(rows):
        tokens[i, : len(row)] = torch.tensor(row)
    tokens = tokens.to(device)
    positions = torch.arange(s, device=device).expand(b, s)
    # Here, not at the top: prompts are encoded (prompt_ids) without Megatron installed.
    from fp8ops.megatron.pipeline import Prompts, last_stage_output
    from fp8ops.megatron.stages import pipeline_group

    if pipeline_group() is not None:
        chosen = last_stage_output(
            model,
            Prompts(tokens, positions),
            lambda logits: greedy(logits, lengths, vocab_size),
            like=torch.zeros(b, dtype=torch.int64),
            fp8=fp8,
        )
        return chosen.tolist()
    with fp8():
        # labels=None: Megatron returns the logits, [b, s, padded vocab / TP] unless gathered;
        # gathered, every TP rank holds the whole vocabulary and picks the same tokens.
        logits = model(tokens, positions, None, runtime_gather_output=True)
    return greedy(logits, lengths, vocab_size).tolist()


def greedy(logits: torch.Tensor, lengths: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Each row's argmax over the real vocabulary at its last real token: [b] int64."""
    rows = torch.arange(logits.shape[0], device=logits.device)
    return logits[rows, lengths - 1, :vocab_size].argmax(dim=-1)
