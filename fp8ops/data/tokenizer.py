"""Tokenizers: how text becomes token ids (the manifest's ``tokenizer`` section).

* ``byte`` (the CPU default): a token is one byte of the UTF-8 encoding, ids 0-255. Id 0 (NUL)
  never occurs in text, so it doubles as the end-of-document id and the padding id: a sequence
  is ``text bytes + [0]``, right-padded with more zeros. No file, no training, no vocabulary to
  ship; a non-ASCII character is simply several tokens.
* ``huggingface``: a ``tokenizer.json`` (Hugging Face ``tokenizers``, the format Llama 3, Mistral
  and most current models ship), read with the ``tokenizers`` library (``pip install
  'fp8ops[hf]'``). The end-of-document token is ``tokenizer.eod_token``, or else the
  ``eos_token`` of the ``tokenizer_config.json`` beside the file; it also pads (padding is never
  scored). Text is encoded without the special tokens a chat template or BOS would add: what
  the model sees is exactly the data's text, then the end-of-document id.

Both have the same surface (``kind``, ``eod``, ``pad``, ``vocab_size``, ``encode``, ``decode``,
``fingerprint``); the data pipeline and the capability evaluation use nothing else.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from fp8ops.errors import ManifestError, relative
from fp8ops.files import loads_json

if TYPE_CHECKING:
    from fp8ops.manifest.schema import TokenizerConfig

EOD = 0  # the byte tokenizer's end of document
PAD = 0  # its padding; always masked out of the loss, so sharing the id with EOD is harmless
VOCAB_SIZE = 256

# What the fingerprint stands for. Change it whenever encode/decode change meaning.
_DESCRIPTION = "fp8ops byte tokenizer v1: utf-8 bytes, ids 0-255, eod=pad=0"
_BATCH = 1024  # texts per batch encoding of a tokenizer.json
_HF_DESCRIPTION = b"fp8ops huggingface tokenizer v1: tokenizer.json, no special tokens added\n"


class Tokenizer(Protocol):
    kind: str
    eod: int
    pad: int
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]: ...

    def decode(self, ids: Iterable[int]) -> str: ...

    def fingerprint(self) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as token ids."""

    kind = "byte"
    eod = EOD
    pad = PAD
    vocab_size = VOCAB_SIZE

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text``. Refuses NUL, which would read as end-of-document."""
        if "\x00" in text:
            raise ValueError("text contains NUL (U+0000), the byte tokenizer's end-of-document id")
        return list(text.encode("utf-8"))

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        """``encode`` of each text; a refusal names the text's index (:class:`TextRefused`)."""
        return _each(self.encode, texts)

    def decode(self, ids: Iterable[int]) -> str:
        """Text up to the first end-of-document id; broken UTF-8 becomes U+FFFD.

        Generated ids can stop mid-character, so decoding must never raise.
        """
        out = bytearray()
        for token in ids:
            token = int(token)
            if token == EOD:
                break
            out.append(token)
        return out.decode("utf-8", errors="replace")

    def fingerprint(self) -> str:
        """sha256 of what this tokenizer does (there are no files to hash)."""
        return hashlib.sha256(_DESCRIPTION.encode()).hexdigest()


class HuggingFaceTokenizer:
    """A ``tokenizer.json`` through the ``tokenizers`` library."""

    kind = "huggingface"

    def __init__(self, file: Path, eod_token: str, tokenizer) -> None:
        self.file, self.eod_token, self._tokenizer = file, eod_token, tokenizer
        # A tokenizer.json may ship truncation or padding settings; the data is cut and padded
        # by fp8ops (never silently), so they are switched off.
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self.eod = self.pad = tokenizer.token_to_id(eod_token)
        # The largest id plus one: ids need not be contiguous, and the embedding must hold all.
        self.vocab_size = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1
        digest = hashlib.sha256(_HF_DESCRIPTION)
        digest.update(file.read_bytes())
        digest.update(f"\neod {eod_token!r} = {self.eod}\n".encode())
        self._fingerprint = digest.hexdigest()

    def encode(self, text: str) -> list[int]:
        """The ids of ``text``, no special tokens added. Refuses text that holds the
        end-of-document token (its string is matched in text): the document would end there."""
        return self._checked(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def encode_many(self, texts: Sequence[str]) -> list[list[int]]:
        """``encode`` of each text, in parallel threads (the library's batch encoding: about
        twice as fast on two cores); a refusal names the text's index (:class:`TextRefused`).
        In chunks: an encoding holds offsets and token strings besides the ids."""
        ids: list[list[int]] = []
        for start in range(0, len(texts), _BATCH):
            chunk = self._tokenizer.encode_batch(
                list(texts[start : start + _BATCH]), add_special_tokens=False
            )
            ids += [encoding.ids for encoding in chunk]
        return _each(self._checked, ids)

    def encode_rendered(
        self, texts: Sequence[str]
    ) -> list[tuple[list[int], list[tuple[int, int]]]]:
        """Each text a chat template rendered as (ids, each id's character span): the turn
        markers and end-of-turn tokens the template placed stay special tokens, and the
        end-of-document token may occur (it ends each turn), so nothing is refused."""
        out = []
        for start in range(0, len(texts), _BATCH):
            chunk = self._tokenizer.encode_batch(
                list(texts[start : start + _BATCH]), add_special_tokens=False
            )
            out += [(encoding.ids, encoding.offsets) for encoding in chunk]
        return out

    def _checked(self, ids: list[int]) -> list[int]:
        if self.eod in ids:
            raise ValueError(
                f"text contains the end-of-document token {self.eod_token!r}, which would end "
                "the document there"
            )
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text up to the first end-of-document id (special tokens kept as their text)."""
        kept = []
        for token in ids:
            token = int(token)
            if token == self.eod:
                break
            kept.append(token)
        return self._tokenizer.decode(kept, skip_special_tokens=False)

    def fingerprint(self) -> str:
        """sha256 of the tokenizer.json bytes and the end-of-document token."""
        return self._fingerprint


class TextRefused(ValueError):
    """``encode_many`` refused its ``index``-th text."""

    def __init__(self, index: int, reason: str) -> None:
        super().__init__(reason)
        self.index = index


def _each(encode, items) -> list[list[int]]:
    out = []
    for index, item in enumerate(items):
        try:
            out.append(encode(item))
        except ValueError as exc:
            raise TextRefused(index, str(exc)) from None
    return out


def tokenizer_for(config: TokenizerConfig) -> Tokenizer:
    """The tokenizer a manifest's ``tokenizer`` section asks for, its fingerprint checked."""
    if config.kind == "byte":
        tokenizer: Tokenizer = ByteTokenizer()
        changed = "this fp8ops version encodes differently"
    elif config.kind == "huggingface":
        tokenizer = _huggingface(config)
        changed = f"{tokenizer.file} changed"
    else:  # the manifest's validation refuses the others; a hand-made config still may not pass
        raise ManifestError(f"tokenizer.kind: '{config.kind}' is not supported")
    if config.fingerprint is not None and config.fingerprint != tokenizer.fingerprint():
        raise ManifestError(
            f"tokenizer.fingerprint: the manifest expects {config.fingerprint} but the "
            f"{config.kind} tokenizer is {tokenizer.fingerprint()} ({changed}). Set "
            "tokenizer.fingerprint to the new value in a derived revision if that is intended, "
            "or to null to record it without checking."
        )
    return tokenizer


def _huggingface(config: TokenizerConfig) -> HuggingFaceTokenizer:
    try:
        from tokenizers import Tokenizer as HfTokenizer
    except ImportError:
        raise ManifestError(
            "tokenizer.kind 'huggingface' reads tokenizer.json with the tokenizers library, "
            "which is not installed: pip install 'fp8ops[hf]'"
        ) from None
    path = Path(config.path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        where = f"{path} has no tokenizer.json" if path.is_dir() else f"{path}: no such file"
        raise ManifestError(
            f"tokenizer.path: {where}{relative(path)}; give a tokenizer.json or the directory "
            "holding it"
        )
    try:
        tokenizer = HfTokenizer.from_file(str(file))
    except Exception as exc:  # noqa: BLE001 - the library raises plain Exception for a bad file
        raise ManifestError(
            f"tokenizer.path: {file} is not a tokenizer.json the tokenizers library reads "
            f"({str(exc).strip() or type(exc).__name__})"
        ) from None
    eod_token = config.eod_token or _eos_from_config(file)
    given = (
        f"{eod_token!r}"
        if config.eod_token
        else f"{eod_token!r} (the eos_token of {file.parent / 'tokenizer_config.json'})"
    )
    if tokenizer.token_to_id(eod_token) is None:
        raise ManifestError(
            f"tokenizer.eod_token: {given} is not a token of {file}; name the token that "
            "ends a document (Llama 3: <|end_of_text|>)"
        )
    # A token of the base vocabulary is what ordinary text encodes to ("A", "the"): every text
    # holding it would be refused. An added token (special or not) is matched only whole.
    added = {token.content for token in tokenizer.get_added_tokens_decoder().values()}
    if eod_token not in added:
        raise ManifestError(
            f"tokenizer.eod_token: {given} is a token of {file}'s vocabulary, which ordinary "
            "text encodes to, not one of its added tokens; name the token that ends a document "
            "(Llama 3: <|end_of_text|>)"
        )
    return HuggingFaceTokenizer(file, eod_token, tokenizer)


def _eos_from_config(file: Path) -> str:
    """The ``eos_token`` of the ``tokenizer_config.json`` beside ``file``."""
    config = file.parent / "tokenizer_config.json"
    missing = (
        f"tokenizer.eod_token: not set, and {config} does not name an eos_token; set it to the "
        "token that ends a document (Llama 3: <|end_of_text|>)"
    )
    try:
        eos = loads_json(config.read_text(encoding="utf-8")).get("eos_token")
    except FileNotFoundError:
        raise ManifestError(
            f"tokenizer.eod_token: not set, and there is no {config} to take an eos_token from; "
            "set it to the token that ends a document (Llama 3: <|end_of_text|>)"
        ) from None
    except (OSError, ValueError, AttributeError) as exc:
        raise ManifestError(
            f"tokenizer.eod_token: not set, and {config} is unreadable ({exc})"
        ) from None
    if isinstance(eos, dict):  # {"content": "<|end_of_text|>", ...} in older files
        eos = eos.get("content")
    if not isinstance(eos, str) or not eos:
        raise ManifestError(missing)
    return eos
