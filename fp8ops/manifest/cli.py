"""``fp8ops manifest ...``: validate, hash, compare and revise run manifests."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from fp8ops.errors import ManifestError, RevisionError
from fp8ops.files import atomic_write_text
from fp8ops.manifest import (
    ManifestStore,
    derive,
    diff_manifests,
    load_manifest,
    manifest_hash,
    parse_assignments,
    write_manifest,
)
from fp8ops.manifest.messages import yaml_value
from fp8ops.manifest.summary import summary_rows
from fp8ops.terminal import output

manifest_app = typer.Typer(
    help="Validate, hash, compare and revise run manifests.", no_args_is_help=True
)

ManifestFile = Annotated[
    Path, typer.Argument(help="A manifest YAML file.", metavar="MANIFEST", show_default=False)
]


@manifest_app.command()
def validate(
    file: ManifestFile,
    inputs: Annotated[
        bool,
        typer.Option(
            "--inputs",
            help="Also read the files it names, as train does before it starts: the "
            "tokenizer, and the data built and tokenized (model.vocab_size and model.seq_length "
            "checked against them). Without it only the manifest itself is checked, so a "
            "cluster's manifest validates anywhere.",
        ),
    ] = False,
) -> None:
    """Check a manifest and summarise it."""
    m = load_manifest(file)
    rows = summary_rows(m)
    if inputs:
        rows.append(("inputs", _check_inputs(m, file)))
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold", no_wrap=True)
    table.add_column(overflow="fold")
    for label, text in rows:
        table.add_row(label, text)
    out = output()
    out.print(f"{file}: valid" + (", and its inputs read" if inputs else ""))
    out.print(table)


def _check_inputs(m, file: Path) -> str:
    """What ``validate --inputs`` reads: the tokenizer and the data, built as a run builds them."""
    from fp8ops.data import build_data, tokenizer_for

    try:
        tokenizer = tokenizer_for(m.tokenizer)
        data = build_data(m, tokenizer)
    except ManifestError as exc:
        raise ManifestError(f"{file}: {exc}") from None
    return (
        f"tokenizer {tokenizer.kind}, {tokenizer.vocab_size:,} ids, end-of-document id "
        f"{tokenizer.eod}; data {len(data.train):,} train and {len(data.eval):,} eval "
        f"sequences, fingerprint {data.fingerprint[:12]}"
    )


@manifest_app.command("hash")
def hash_(file: ManifestFile) -> None:
    """Print the manifest's sha256 (of its canonical form: formatting and comments don't count)."""
    print(manifest_hash(load_manifest(file)))


@manifest_app.command()
def diff(a: ManifestFile, b: ManifestFile) -> None:
    """Compare two manifests field by field. Exit 0 if they mean the same run, 1 if not."""
    changes = diff_manifests(load_manifest(a), load_manifest(b))
    out = output()
    if not changes:
        out.print(f"identical: {a} and {b} mean the same run")
        return
    table = Table(
        title=f"{len(changes)} field(s) differ: old = {a}, new = {b}", title_justify="left"
    )
    table.add_column("field", no_wrap=True)
    table.add_column("old", overflow="fold")
    table.add_column("new", overflow="fold")
    for change in changes:
        old = "(absent)" if change.kind == "added" else yaml_value(change.old, limit=None)
        new = "(absent)" if change.kind == "removed" else yaml_value(change.new, limit=None)
        table.add_row(change.path, old, new)
    out.print(table)
    raise typer.Exit(1)


@manifest_app.command("derive")
def derive_(
    parent: ManifestFile,
    assignments: Annotated[
        list[str],
        typer.Option(
            "--set", help="PATH=VALUE, VALUE in YAML (repeatable), e.g. precision.margin=1."
        ),
    ],
    reason: Annotated[str, typer.Option(help="Why this revision exists (recorded in it).")],
    out: Annotated[Path | None, typer.Option(help="Write the new revision here.")] = None,
    store: Annotated[
        Path | None, typer.Option(help="Also keep parent and child in this manifest store.")
    ] = None,
) -> None:
    """Make the next revision of PARENT with some fields changed."""
    if out is None and store is None:
        raise typer.BadParameter("give --out FILE, --store DIR or both")
    parent_manifest = load_manifest(parent)
    child = derive(
        parent_manifest, parse_assignments(assignments), reason, source=f"{parent} with --set"
    )
    if out is not None:
        write_manifest(child, out)
    if store is not None:
        manifest_store = ManifestStore(store)
        manifest_store.put(parent_manifest)
        manifest_store.put(child)
    print(manifest_hash(child))


@manifest_app.command()
def chain(
    store: Annotated[
        Path, typer.Argument(help="A manifest store directory, or a manifest file inside one.")
    ],
    head: Annotated[
        str | None, typer.Argument(help="Hash (or unique prefix) of the last revision.")
    ] = None,
) -> None:
    """Verify a store and list a revision chain, root first."""
    if store.is_file():
        head = head or manifest_hash(load_manifest(store))
        store = store.parent
    if not store.is_dir():
        raise RevisionError(f"{store}: no such manifest store directory")
    manifest_store = ManifestStore(store)
    manifest_store.verify()
    if head is None:
        heads = manifest_store.heads()
        if len(heads) != 1:
            found = ", ".join(h[:12] for h in heads) or "none (empty store)"
            raise RevisionError(f"{store}: name the head revision; heads found: {found}")
        head = heads[0]
    revisions = manifest_store.chain(manifest_store.resolve(head))
    table = Table(title=f"{store}: {len(revisions)} revision(s), verified", title_justify="left")
    table.add_column("#", justify="right")
    table.add_column("sha256", no_wrap=True)
    table.add_column("name", no_wrap=True)
    table.add_column("reason", overflow="fold")
    for m in revisions:
        table.add_row(
            str(m.revision.number), manifest_hash(m)[:12], m.name, m.revision.reason or "(root)"
        )
    output().print(table)


@manifest_app.command("from-hf")
def from_hf(
    hf_dir: Annotated[
        Path,
        typer.Argument(
            help="A Hugging Face checkpoint directory (config.json, safetensors, tokenizer.json).",
            metavar="HF_DIR",
            show_default=False,
        ),
    ],
    out: Annotated[
        Path, typer.Option("--out", help="The manifest to write (a new file).", show_default=False)
    ],
    name: Annotated[
        str | None, typer.Option(help="The run name (default: from HF_DIR's name).")
    ] = None,
    seq_length: Annotated[
        int | None,
        typer.Option(help="model.seq_length (default: the model's context, at most 2048)."),
    ] = None,
    tensor_parallel: Annotated[int, typer.Option(help="topology.tensor_parallel.")] = 1,
    data: Annotated[
        Path | None,
        typer.Option(
            help='A JSONL data file: conversations ("messages") become data.kind chat, other '
            "lines jsonl (default: the built-in tasks).",
            show_default=False,
        ),
    ] = None,
) -> None:
    """Write a manifest that fine-tunes HF_DIR: model and tokenizer from its files (with
    fingerprints), FP8 defaults for its size; anything in config.json fp8ops cannot honour is
    refused, naming the key."""
    from fp8ops.hf.manifest import manifest_from_hf, render  # reads safetensors headers

    if out.exists():
        raise ManifestError(f"--out {out}: already exists; fp8ops never writes over a manifest")
    m = manifest_from_hf(
        hf_dir, name=name, seq_length=seq_length, tensor_parallel=tensor_parallel, data=data
    )
    atomic_write_text(out, render(m, hf_dir))
    output().print(
        f"{out}: {m.name}, {manifest_hash(m)[:12]}; check it with `fp8ops manifest validate {out}`"
    )
