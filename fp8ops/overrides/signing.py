"""Who approved: ledger records signed with the operator's SSH key, as git signs commits.

An operator's record (staged, approved, rejected, revoked) is signed with ``ssh-keygen -Y sign``
in the namespace :data:`NAMESPACE` (a key file, or a public key whose private half is in the
ssh-agent), over the canonical JSON of the record without its ``hash`` and ``signature``. The
signed body holds ``seq`` and ``prev``, so a signature moved onto another record, or the record
moved elsewhere in the chain, no longer verifies. Verification runs in this process
(``sshsig``, the SSHSIG format of ``ssh-keygen -Y verify``) against the allowed-signers file the
manifest names (``review.allowed_signers``, pinned by sha256): the record's ``who`` must be a
principal the file binds to the key that signed it. ``ssh-keygen`` is needed to sign only.

Records that no person writes (the alert engine's proposals, a resume's ``applied``, the
auto-degrade policy's approval) carry no signature; what they may say is checked instead
(``ledger.py``).
"""

from __future__ import annotations

import fnmatch
import hashlib
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from sshsig import InvalidSignature, PublicKey, check_signature
from sshsig.allowed_signers import load_allowed_signers_file

from fp8ops.errors import Fp8opsError
from fp8ops.overrides.chain import canonical_json

NAMESPACE = "fp8ops-ledger"  # ssh-keygen -n: a signature made for git or ssh never verifies here
SIGNED_KINDS = frozenset({"staged", "approved", "rejected", "revoked"})  # what a person writes
KEY_ENV = "FP8OPS_SIGNING_KEY"

# (allowed-signers sha256, record hash) -> the verdict. A record's hash covers its signature and
# content (the chain checks it on every read), so a verdict stays true for the same file of
# signers: an append or a console refresh re-verifies only the records it has not seen.
_VERDICTS: dict[tuple[str, str], str | None] = {}


class SigningError(Fp8opsError):
    """A record could not be signed, or the allowed-signers file cannot be used."""


def signing_key(key: str | Path | None = None) -> Path | None:
    """The operator's key: ``key``, else ``$FP8OPS_SIGNING_KEY``; None: records go unsigned."""
    chosen = key if key is not None else os.environ.get(KEY_ENV) or None
    return None if chosen is None else Path(chosen).expanduser()


def signed_body(record: dict) -> bytes:
    """What a signature covers: the record's canonical JSON without ``hash`` and ``signature``."""
    body = {k: v for k, v in record.items() if k not in ("hash", "signature")}
    return canonical_json(body).encode("utf-8")


def sign(message: bytes, key: Path) -> str:
    """An armored SSH signature of ``message`` by ``key`` (``ssh-keygen -Y sign``)."""
    keygen = shutil.which("ssh-keygen")
    if keygen is None:
        raise SigningError(
            "ssh-keygen is not installed: install OpenSSH's client (apt install openssh-client) "
            f"to sign ledger records, or unset {KEY_ENV} to write them unsigned"
        )
    if not key.is_file():
        raise SigningError(
            f"{key}: no such signing key (--key or ${KEY_ENV}): give an SSH private key file, "
            "or a public key whose private key is loaded in ssh-agent"
        )
    done = subprocess.run(
        [keygen, "-q", "-Y", "sign", "-f", str(key), "-n", NAMESPACE],
        input=message,
        capture_output=True,
        timeout=60,
        check=False,
    )
    if done.returncode != 0 or not done.stdout.startswith(b"-----BEGIN SSH SIGNATURE-----"):
        why = done.stderr.decode("utf-8", "replace").strip() or f"exit {done.returncode}"
        raise SigningError(
            f"ssh-keygen could not sign with {key}: {why} (a passphrase-protected key must be in "
            "ssh-agent: ssh-add it, and give its .pub file)"
        )
    return done.stdout.decode("ascii")


@dataclass(frozen=True)
class _Entry:
    principals: tuple[str, ...]  # patterns, as ssh-keygen matches them
    key: PublicKey


class AllowedSigners:
    """An allowed-signers file (ssh-keygen(1), ALLOWED SIGNERS), read once, sha256 checked."""

    def __init__(self, path: Path, entries: list[_Entry], sha256: str):
        self.path, self.entries, self.sha256 = path, entries, sha256

    @classmethod
    def load(cls, path: str | Path, sha256: str) -> AllowedSigners:
        path = Path(path).expanduser()
        where = "review.allowed_signers"
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise SigningError(
                f"{path} ({where} of the run's manifest): cannot read it ({exc.strerror}); "
                "restore the file or give its path in a new manifest revision"
            ) from None
        digest = hashlib.sha256(data).hexdigest()
        if digest != sha256:
            raise SigningError(
                f"{path} ({where}): its sha256 is {digest}, not review.allowed_signers_sha256 "
                f"{sha256}: the file was edited or swapped. Restore it, or review the change and "
                "name the new sha256 in a new manifest revision"
            )
        entries = []
        try:
            for line in load_allowed_signers_file(path):
                options = line.options or {}
                if "cert-authority" in options:
                    raise ValueError("certificate authorities (cert-authority) are not supported")
                namespaces = options.get("namespaces")
                if namespaces is not None and not any(
                    fnmatch.fnmatchcase(NAMESPACE, n) for n in namespaces.split(",")
                ):
                    continue  # a key for other uses (git, ssh) signs nothing here
                key = PublicKey.from_openssh_str(f"{line.key_type} {line.base64_key}")
                entries.append(_Entry(tuple(line.principals.split(",")), key))
        except (ValueError, NotImplementedError) as exc:
            raise SigningError(
                f"{path} ({where}): not an allowed-signers file fp8ops can use: {exc} (one line "
                f'per operator: NAME namespaces="{NAMESPACE}" ssh-ed25519 AAAA...; ed25519 and '
                "RSA keys)"
            ) from None
        return cls(path, entries, sha256)

    def principals_of(self, key: PublicKey) -> list[tuple[str, ...]]:
        return [e.principals for e in self.entries if e.key == key]

    def problem(self, record: dict) -> str | None:
        """Why ``record``'s signature does not prove that its ``who`` wrote it; None if it does."""
        known = (self.sha256, record["hash"])  # records are checked sealed
        if known not in _VERDICTS:
            _VERDICTS[known] = self._check(record)
        return _VERDICTS[known]

    def _check(self, record: dict) -> str | None:
        signature = record.get("signature")
        if signature is None:
            return "not signed"
        try:
            key = check_signature(signed_body(record), signature, NAMESPACE)
        except (InvalidSignature, ValueError, NotImplementedError) as exc:
            return f"the signature does not verify for this record ({exc})"
        bound = self.principals_of(key)
        if not bound:
            return (
                f"signed by a key that {self.path} does not list ({key.sha256_str()}): not an "
                "allowed signer"
            )
        who = record.get("who")
        if not any(fnmatch.fnmatchcase(str(who), p) for patterns in bound for p in patterns):
            names = ", ".join(p for patterns in bound for p in patterns)
            return f"written as {who!r} but signed by the key of {names} ({self.path})"
        return None
