"""What a run trains and evaluates on, built once per rank: the tokenizer, the data and the
held-out capability items. The data and every capability evaluation encode with the one
tokenizer built here, so an edit of a tokenizer.json mid-run changes nothing."""

from __future__ import annotations

import sys
from dataclasses import dataclass

from fp8ops.data import TokenizedData, build_data, tokenizer_for
from fp8ops.evaluate.capability import capability_examples
from fp8ops.manifest.schema import Manifest

CHAT_COUNTS = ("overlong_dropped", "overlong_truncated", "no_assistant_tokens_dropped")


@dataclass(frozen=True)
class Inputs:
    tokenizer: object  # fp8ops.data.tokenizer: a ByteTokenizer or a Hugging Face tokenizer
    data: TokenizedData
    capability_examples: list


def build_inputs(manifest: Manifest, *, is_main: bool, check_tokenizer=None, check_data=None):
    """The inputs of ``manifest``'s run. ``check_tokenizer(tokenizer)`` runs before the data is
    built with it and ``check_data(data)`` before anything else (a resume's checks against what
    the run started with)."""
    tokenizer = tokenizer_for(manifest.tokenizer)
    if check_tokenizer is not None:
        check_tokenizer(tokenizer)
    data = build_data(manifest, tokenizer)
    if check_data is not None:
        check_data(data)
    examples = capability_examples(data, manifest.capability, tokenizer)
    asked, held = manifest.capability.items, len(examples)
    if is_main and held and asked is not None and asked > held:  # said, not silent
        print(
            f"warning: capability.items is {asked}, but the eval split holds {held} items; "
            "all of them are evaluated",
            file=sys.stderr,
        )
    changed = {k: data.source.get(k, 0) for k in CHAT_COUNTS if data.source.get(k)}
    if is_main and changed:
        said = ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in changed.items())
        print(
            f"warning: of {data.source['conversations']} conversations, {said} "
            f"(data.overlong: {data.source['overlong']}; longer than model.seq_length "
            f"{manifest.model.seq_length} + 1 tokens)",
            file=sys.stderr,
        )
    return Inputs(tokenizer, data, examples)
