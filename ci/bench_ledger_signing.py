"""Benchmark (not a test): signing and verifying override-ledger records.

    .venv/bin/python ci/bench_ledger_signing.py [--records 10000] [--workdir DIR]

Two throwaway ed25519 operator keys and an allowed-signers file; a run directory whose manifest
requires signatures; ``--records`` signed records (staged by one operator, rejected by the
other, in pairs) written as the ledger writes them, each signed by ``ssh-keygen -Y sign``. Then:
the whole ledger verified by ``Ledger.verify`` cold (no verdict remembered) and warm (as the
next read in the same process), one ``ssh-keygen -Y verify`` per record for comparison (a
sample), and one more signed append on the full ledger. Prints a table.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import subprocess
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from rich.console import Console
from rich.table import Table

from fp8ops.manifest import ManifestStore, derive, load_manifest, manifest_hash, write_manifest
from fp8ops.overrides import Ledger, signing
from fp8ops.overrides.chain import GENESIS, canonical_json, record_hash
from fp8ops.overrides.signing import NAMESPACE, sign, signed_body

ROOT = Path(__file__).resolve().parents[1]
MODULE = "decoder.layers.0.mlp.linear_fc1"


def keys(home: Path) -> tuple[dict[str, Path], Path]:
    paths = {}
    lines = []
    for name in ("ana", "ben"):
        paths[name] = home / name
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", name, "-f", str(paths[name])],
            check=True,
        )
        lines.append(f'{name} namespaces="{NAMESPACE}" {(home / f"{name}.pub").read_text()}')
    allowed = home / "allowed_signers"
    allowed.write_text("".join(lines))
    return paths, allowed


def run_dir(path: Path, allowed: Path) -> Path:
    manifest = derive(
        load_manifest(ROOT / "manifests" / "tiny-gpt-cpu.yaml"),
        {
            "review.allowed_signers": str(allowed),
            "review.allowed_signers_sha256": hashlib.sha256(allowed.read_bytes()).hexdigest(),
            "review.require_signatures": True,
        },
        "signed ledger benchmark",
    )
    path.mkdir(parents=True)
    write_manifest(manifest, path / "manifest.yaml")
    ManifestStore(path / "manifests").put(manifest)
    (path / "status.json").write_text(
        json.dumps({"state": "running", "step": 1, "manifest": manifest_hash(manifest)})
    )
    return path


def write_signed(run: Path, count: int, paths: dict[str, Path]) -> list[float]:
    """``count`` records as Ledger._append seals them, each signed; the seconds per signature."""
    prev, lines, sign_s = GENESIS, [], []
    now = datetime.now(timezone.utc).isoformat(timespec="seconds")
    for seq in range(count):
        if seq % 2 == 0:
            body = {
                "kind": "staged",
                "module": MODULE,
                "dtype": "bf16",
                "reason": f"benchmark {seq}",
                "who": "ana",
                "triggers": [],
                "step": seq,
                "data_version": None,
            }
        else:
            body = {"kind": "rejected", "override": prev, "who": "ben", "reason": "benchmark"}
        record = {**body, "seq": seq, "prev": prev, "time": now}
        start = time.perf_counter()
        record["signature"] = sign(signed_body(record), paths[body["who"]])
        sign_s.append(time.perf_counter() - start)
        record["hash"] = prev = record_hash(record)
        lines.append(canonical_json(record) + "\n")
    (run / "overrides.jsonl").write_text("".join(lines))
    return sign_s


def ssh_keygen_verify(run: Path, allowed: Path, sample: int) -> float:
    records = [json.loads(line) for line in (run / "overrides.jsonl").read_text().splitlines()]
    times = []
    with tempfile.TemporaryDirectory() as tmp:
        sig = Path(tmp) / "record.sig"
        for record in records[:sample]:
            sig.write_text(record["signature"])
            start = time.perf_counter()
            subprocess.run(
                ["ssh-keygen", "-Y", "verify", "-f", str(allowed), "-I", record["who"]]
                + ["-n", NAMESPACE, "-s", str(sig)],
                input=signed_body(record),
                capture_output=True,
                check=True,
            )
            times.append(time.perf_counter() - start)
    return statistics.mean(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=10_000)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="fp8ops-ledger-bench-"))
    paths, allowed = keys(work)
    run = run_dir(work / "run", allowed)

    start = time.perf_counter()
    sign_s = write_signed(run, args.records, paths)
    written_s = time.perf_counter() - start

    signing._VERDICTS.clear()  # cold: as a fresh process (a resume, `overrides verify`)
    start = time.perf_counter()
    count = Ledger(run).verify()
    cold_s = time.perf_counter() - start
    start = time.perf_counter()
    Ledger(run).verify()
    warm_s = time.perf_counter() - start
    sample = min(200, args.records)
    keygen_s = ssh_keygen_verify(run, allowed, sample)
    start = time.perf_counter()
    _append_staged(run, paths["ana"])
    append_s = time.perf_counter() - start

    table = Table(title=f"signed override ledger, {count:,} records (ed25519, ssh-keygen)")
    table.add_column("what")
    table.add_column("time", justify="right")
    table.add_row(
        "sign one record (ssh-keygen -Y sign), mean", f"{statistics.mean(sign_s) * 1e3:.1f} ms"
    )
    table.add_row("sign one record, median", f"{statistics.median(sign_s) * 1e3:.1f} ms")
    table.add_row(f"write {count:,} signed records", f"{written_s:.1f} s")
    table.add_row(f"verify the ledger of {count:,}, cold (Ledger.verify)", f"{cold_s:.2f} s")
    table.add_row("  per record", f"{cold_s / count * 1e3:.3f} ms")
    table.add_row("verify it again in the same process (warm)", f"{warm_s:.2f} s")
    table.add_row(
        f"ssh-keygen -Y verify, one record (mean of {sample})", f"{keygen_s * 1e3:.1f} ms"
    )
    table.add_row("one more signed append on the full ledger (warm)", f"{append_s * 1e3:.0f} ms")
    Console().print(table)


def _append_staged(run: Path, key: Path) -> None:
    """A signed append through the Ledger API (it checks the module against layers.json, which
    this run directory does not have, so the record goes through the internal append)."""
    ledger = Ledger(run, key=key)
    ledger._append(
        lambda overrides: [
            {
                "kind": "staged",
                "module": MODULE,
                "dtype": "bf16",
                "reason": "one more",
                "who": "ana",
                "triggers": [],
                "step": None,
                "data_version": None,
            }
        ]
    )


if __name__ == "__main__":
    main()
