"""The byte tokenizer: a token is one byte of the UTF-8 encoding, ids 0-255.

Id 0 (NUL) never occurs in text, so it doubles as the end-of-document id and the padding id:
a sequence is ``text bytes + [0]``, right-padded with more zeros. No file, no training, no
vocabulary to ship; a non-ASCII character is simply several tokens.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import TYPE_CHECKING

from fp8ops.errors import ManifestError

if TYPE_CHECKING:
    from fp8ops.manifest.schema import TokenizerConfig

EOD = 0  # end of document
PAD = 0  # padding; always masked out of the loss, so sharing the id with EOD is harmless
VOCAB_SIZE = 256

# What the fingerprint stands for. Change it whenever encode/decode change meaning.
_DESCRIPTION = "fp8ops byte tokenizer v1: utf-8 bytes, ids 0-255, eod=pad=0"


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


def tokenizer_for(config: TokenizerConfig) -> ByteTokenizer:
    """The tokenizer a manifest's ``tokenizer`` section asks for, its fingerprint checked."""
    if config.kind != "byte":
        raise ManifestError(
            f"tokenizer.kind: '{config.kind}' is not supported yet; fp8ops' data pipeline "
            "reads only 'byte' (UTF-8 bytes, no file). Set tokenizer.kind: byte and remove "
            "tokenizer.path."
        )
    tokenizer = ByteTokenizer()
    if config.fingerprint is not None and config.fingerprint != tokenizer.fingerprint():
        raise ManifestError(
            f"tokenizer.fingerprint: the manifest expects {config.fingerprint} but fp8ops' "
            f"byte tokenizer is {tokenizer.fingerprint()} (this fp8ops version encodes "
            "differently). Set tokenizer.fingerprint to the new value in a derived revision "
            "if that is intended, or to null to record it without checking."
        )
    return tokenizer
