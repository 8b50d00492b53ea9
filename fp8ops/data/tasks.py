"""Supervised tasks with checkable answers, and their evaluation buckets (data kind ``tasks``).

Three tasks a tiny byte-level GPT can partly learn in a few hundred steps::

    task     terse prompt       verbose prompt, then a newline and "A: "   answer  hard when
    add      "add 12 39 = "     "Q: What is 12 plus 39?"                   "51"    a column carries
    reverse  "reverse abca = "  "Q: What is abca backwards?"               "acba"  a letter repeats
    sort     "sort 3142 = "     "Q: Sort the digits 3142."                 "1234"  a digit repeats

Every example carries four buckets: ``task``; ``length`` (``short``/``medium``/``long``:
operands of 1/2/3 digits for add, 3-4/5-6/7-8 characters for reverse and sort);
``difficulty`` (``easy``/``hard``, the last column above); ``format`` (``terse``/``verbose``).
Task, length, difficulty and format are drawn uniformly and independently, then an instance
that fits them, so every bucket cell is populated.

An answer is right only if it matches exactly (``check``). Examples go to evaluation by a hash
of their problem (``held_out`` on ``split_key``). Under ``data.split_version`` 2 the problem is
written the same whatever the wording and the order of what does not matter: "add 12 39" and
"add 39 12" are one problem, and so are "sort 3142" and "sort 2413"; neither can be trained in
one form and evaluated in another, whatever the seed. The evaluation split is then in hash
order, so any prefix of it (the capability items, the loss evaluation's batches) is a fair
sample of it, however the data was ordered. Version 1, the split of earlier runs, keys on the
terse statement alone ("add 12 39" in both formats) and keeps the data's order.
"""

from __future__ import annotations

import hashlib
import itertools
import random
import string
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

TASKS = ("add", "reverse", "sort")
LENGTHS = ("short", "medium", "long")
DIFFICULTIES = ("easy", "hard")
FORMATS = ("terse", "verbose")
BUCKETS = {"task": TASKS, "length": LENGTHS, "difficulty": DIFFICULTIES, "format": FORMATS}

# The schema's upper bound on data.eval_fraction. The corpus only uses prompts at or above it in
# hash space, so they are training prompts for every eval_fraction a manifest can have.
MAX_EVAL_FRACTION = 0.5


@dataclass(frozen=True)
class Example:
    """One supervised example: the model sees ``prompt`` and must produce ``answer``."""

    prompt: str
    answer: str
    buckets: dict[str, str] = field(default_factory=dict)  # bucket name -> value
    # The problem whatever its wording ("add 12 39"); empty for your own data, whose prompt is
    # then its problem.
    problem: str = ""
    # The problem whatever the order of what does not change its answer ("add 12 39" for
    # "add 39 12" too): what split version 2 hashes. Empty: the problem is its own.
    canonical: str = ""
    origin: str = field(default="", compare=False)  # "FILE: line N" for your own data
    # A chat template's rendering (data kind 'chat'): the prompt holds the template's own
    # special tokens, its end-of-turn token among them, and is encoded as such.
    rendered: bool = False

    @property
    def key(self) -> str:
        """The problem, or the prompt when there is none (split version 1's key, and the
        record's name for the item)."""
        return self.problem or self.prompt


def split_key(example: Example, version: int) -> str:
    """What the train/eval split hashes (``data.split_version``): version 1, ``example.key``;
    version 2, the canonical problem, or else the prompt with its runs of whitespace read as
    one space (a prompt and its copy with a trailing space are one)."""
    if version == 1:
        return example.key
    return example.canonical or example.problem or " ".join(example.prompt.split())


def check(example: Example, generated: str) -> bool:
    """Whether ``generated`` (the text after the prompt, decoded by the tokenizer, which stops at
    end-of-document) is exactly the answer.

    Trailing whitespace on either side is ignored: an answer written with a final newline is
    right when generated with it, or without it.
    """
    return generated.rstrip() == example.answer.rstrip()


def held_out(key: str, eval_fraction: float) -> bool:
    """Whether the example with ``key`` (``Example.key``) belongs to the evaluation split."""
    return split_point(key) < eval_fraction


def split_point(prompt: str) -> float:
    """A fixed pseudo-random number in [0, 1) for ``prompt``: the first 6 bytes of its sha256.

    Six bytes, not eight: 48 bits divide exactly in a float, so the result is never 1.0.
    """
    digest = hashlib.sha256(prompt.encode("utf-8")).digest()
    return int.from_bytes(digest[:6], "big") / 2**48


def split_examples(
    examples: Sequence[Example], eval_fraction: float, version: int
) -> tuple[list[Example], list[Example]]:
    """(train, eval) under ``data.split_version`` ``version``: train in the original order;
    eval in hash order (version 2) or the original order (version 1).

    Hash order (``split_point``, then the original order among equal keys) makes every prefix of
    the evaluation split a fair sample: a file sorted by topic would otherwise give the first
    capability items all from its first topic.
    """
    train, evaluation = [], []
    for example in examples:
        held = held_out(split_key(example, version), eval_fraction)
        (evaluation if held else train).append(example)
    if version >= 2:
        evaluation.sort(key=lambda example: split_point(split_key(example, version)))  # stable
    return train, evaluation


def generate_examples(seed: int | str, count: int) -> list[Example]:
    """``count`` examples drawn from ``random.Random(seed)`` (never the global RNG).

    Prompts may repeat, as the short cells are small (there are only 100 one-digit sums):
    the examples sample the task distribution, they do not enumerate it.
    """
    return list(itertools.islice(example_stream(seed), count))


def example_stream(seed: int | str) -> Iterator[Example]:
    """The endless stream ``generate_examples`` takes its first ``count`` from."""
    rng = random.Random(seed)
    while True:
        task = rng.choice(TASKS)
        length = rng.choice(LENGTHS)
        difficulty = rng.choice(DIFFICULTIES)
        style = rng.choice(FORMATS)
        problem, verbose, answer, canonical = _MAKERS[task](rng, length, difficulty)
        prompt = f"{problem} = " if style == "terse" else f"Q: {verbose}\nA: "
        buckets = {"task": task, "length": length, "difficulty": difficulty, "format": style}
        yield Example(prompt, answer, buckets, problem, canonical)


# --------------------------------------------------------------------------------------
# The tasks. Each maker returns (terse problem, verbose question, answer, the problem's key:
# one for every order of operands that gives the same answer) for the cell.
# --------------------------------------------------------------------------------------


def _add(rng: random.Random, length: str, difficulty: str) -> tuple[str, str, str, str]:
    digits = LENGTHS.index(length) + 1
    low, high = (0 if digits == 1 else 10 ** (digits - 1)), 10**digits - 1
    while True:  # rejection sampling: at worst ~1 in 6 three-digit pairs has no carry
        a, b = rng.randint(low, high), rng.randint(low, high)
        if carries(a, b) == (difficulty == "hard"):
            break
    return f"add {a} {b}", f"What is {a} plus {b}?", str(a + b), f"add {min(a, b)} {max(a, b)}"


def carries(a: int, b: int) -> bool:
    """Whether adding ``a`` and ``b`` column by column carries anywhere."""
    while a or b:
        if a % 10 + b % 10 >= 10:
            return True
        a, b = a // 10, b // 10
    return False


def _text_size(rng: random.Random, length: str) -> int:
    return rng.choice({"short": (3, 4), "medium": (5, 6), "long": (7, 8)}[length])


def _draw(rng: random.Random, alphabet: str, size: int, repeated: bool) -> str:
    if not repeated:
        return "".join(rng.sample(alphabet, size))
    while True:  # at worst ~1 in 9 three-letter strings repeats a letter
        text = "".join(rng.choice(alphabet) for _ in range(size))
        if len(set(text)) < size:
            return text


def _reverse(rng: random.Random, length: str, difficulty: str) -> tuple[str, str, str, str]:
    word = _draw(rng, string.ascii_lowercase, _text_size(rng, length), difficulty == "hard")
    return f"reverse {word}", f"What is {word} backwards?", word[::-1], f"reverse {word}"


def _sort(rng: random.Random, length: str, difficulty: str) -> tuple[str, str, str, str]:
    digits = _draw(rng, string.digits, _text_size(rng, length), difficulty == "hard")
    answer = "".join(sorted(digits))
    return f"sort {digits}", f"Sort the digits {digits}.", answer, f"sort {answer}"


_MAKERS: dict[str, Callable[[random.Random, str, str], tuple[str, str, str, str]]] = {
    "add": _add,
    "reverse": _reverse,
    "sort": _sort,
}
