"""``fp8ops overrides ...``: stage, review, list, verify and export per-layer BF16 overrides.

Thin, as ``fp8ops/cli.py`` is: each command calls one :class:`Ledger` method and prints. Refusals
and a damaged ledger are ``Fp8opsError``s, which ``fp8ops.cli.main`` prints and exits 2 on.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from fp8ops.errors import Fp8opsError
from fp8ops.files import atomic_write_text
from fp8ops.gemm_roles import gemms_problem

if TYPE_CHECKING:
    from fp8ops.overrides.ledger import Override

overrides_app = typer.Typer(
    help="Switch single layers from FP8 to BF16 through the run's reviewed ledger "
    "(overrides.jsonl).",
    no_args_is_help=True,
)

RunDir = Annotated[Path, typer.Argument(help="A run directory.", show_default=False)]
OverrideId = Annotated[
    str,
    typer.Argument(help="Override id, or a unique prefix of 6+ hex digits.", show_default=False),
]
User = Annotated[
    str | None,
    typer.Option(help="Who acts (default: $FP8OPS_USER, else the login name).", show_default=False),
]
Reason = Annotated[str, typer.Option(help="Why (recorded in the ledger).", show_default=False)]
Key = Annotated[
    Path | None,
    typer.Option(
        help="Sign the record with this SSH key: a private key file, or a public key whose "
        "private key is in ssh-agent (default: $FP8OPS_SIGNING_KEY; none: unsigned).",
        show_default=False,
    ),
]


def _console() -> Console:
    # Module names are not markup; piped output gets room for the table.
    return Console(highlight=False, markup=False, width=None if sys.stdout.isatty() else 160)


def _ledger(run_dir: Path, key: Path | None = None):
    # Imported when a command runs: the ledger reads alerts and layers.json, whose modules
    # take a third of a second to import, and every `fp8ops` command would pay for it.
    from fp8ops.overrides.ledger import Ledger

    return Ledger(run_dir, key=key)


def _line(verb: str, o: Override) -> str:
    return f"{verb} {o.id[:12]}: {o.module} to {o.target} ({o.status})"


@overrides_app.command()
def stage(
    run_dir: RunDir,
    modules: Annotated[
        list[str], typer.Argument(help="Full module names, as in layers.json.", show_default=False)
    ],
    reason: Reason,
    user: User = None,
    to: Annotated[
        str,
        typer.Option(
            help="Where the modules go: 'bf16', or 'current' (FP8 under current scaling, a "
            "per-module recipe)."
        ),
    ] = "bf16",
    gemms: Annotated[
        str | None,
        typer.Option(
            help="Only these of each module's GEMMs to bf16, comma-separated: fprop (y = x W^T), "
            "dgrad (dx = dy W), wgrad (dW = dy^T x); e.g. 'dgrad,wgrad' for saturating "
            "gradients (default: all three).",
            show_default=False,
        ),
    ] = None,
    key: Key = None,
) -> None:
    """Ask for MODULE... to run in BF16 (or under current scaling) from the next resume;
    another operator approves."""
    names = None if gemms is None else [g.strip() for g in gemms.split(",") if g.strip()]
    if names is not None:
        problem = gemms_problem(names)
        if problem is not None:
            raise Fp8opsError(f"--gemms: {problem}")
    ledger = _ledger(run_dir, key)
    for o in ledger.stage_many(modules, reason, who=user, to=to, gemms=names):
        print(_line("staged", o))
        print(f"  approve: fp8ops overrides approve {run_dir} {o.id[:12]}")


@overrides_app.command()
def approve(
    run_dir: RunDir,
    override: OverrideId,
    user: User = None,
    note: Annotated[str | None, typer.Option(help="A note kept with the approval.")] = None,
    key: Key = None,
) -> None:
    """Approve an override: the next resume runs its module in BF16 (or its staged recipe)."""
    print(_line("approved", _ledger(run_dir, key).approve(override, who=user, note=note)))


@overrides_app.command()
def reject(
    run_dir: RunDir, override: OverrideId, reason: Reason, user: User = None, key: Key = None
) -> None:
    """Reject a proposed or staged override (final)."""
    print(_line("rejected", _ledger(run_dir, key).reject(override, reason, who=user)))


@overrides_app.command()
def revoke(
    run_dir: RunDir, override: OverrideId, reason: Reason, user: User = None, key: Key = None
) -> None:
    """Withdraw an override; an applied one is lifted (back to FP8) at the next resume."""
    o = _ledger(run_dir, key).revoke(override, reason, who=user)
    print(_line("revoked", o))
    if o.to_lift:
        if o.scaling is None:
            what = "in BF16" if o.gemms is None else f"{', '.join(o.gemms)} in BF16"
            print(f"  {o.module} runs {what} until the next resume, then in FP8 again")
        else:
            print(f"  {o.module} runs {o.target} until the next resume, then the run's recipe")


@overrides_app.command("list")
def list_(
    run_dir: RunDir,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per override.")] = False,
    all_: Annotated[
        bool, typer.Option("--all", help="Also the rejected and finished revoked ones.")
    ] = False,
) -> None:
    """List the overrides that are open or still to be lifted (--all: every one)."""
    ledger = _ledger(run_dir)
    overrides = [o for o in ledger.overrides().values() if all_ or o.is_open or o.to_lift]
    if as_json:
        for o in overrides:
            print(json.dumps(o.to_json(), sort_keys=True))
        return
    out = _console()
    if not overrides:
        out.print(f"{ledger.path}: no {'' if all_ else 'open '}overrides")
        return
    grid = Table(box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False)
    for name in ("id", "module", "to", "status", "who", "decided by", "reason", "step"):
        grid.add_column(name, overflow="fold", justify="right" if name == "step" else "left")
    for o in overrides:
        status = "revoked, lift at resume" if o.to_lift else o.status
        grid.add_row(
            o.id[:12],
            o.module,
            o.target,
            status,
            o.who,
            o.decided_by or "",
            o.reason,
            "" if o.step is None else str(o.step),
        )
    out.print(grid)


@overrides_app.command()
def verify(run_dir: RunDir) -> None:
    """Read the ledger as a resume does: its hash chain, every record's rules, the signatures the
    manifest requires and the checkpoints' anchors; exit 2 naming the first bad line (or the
    checkpoint whose records are gone)."""
    ledger = _ledger(run_dir)
    count = ledger.verify()
    if not ledger.path.exists():  # and no checkpoint saw one (verify says so)
        print(f"{ledger.path}: no ledger yet (nothing was proposed or staged)")
        return
    statuses = [o.status for o in ledger.overrides().values()]
    summary = ", ".join(f"{statuses.count(s)} {s}" for s in dict.fromkeys(statuses))
    print(f"{ledger.path}: {count} record(s), hash chain intact; {summary or 'no overrides'}")
    flagged = ledger.unverified()
    for line in flagged:
        print(f"  unverified: {line}")
    if flagged:
        print(f"  {len(flagged)} record(s) do not prove who wrote them (review.allowed_signers)")


@overrides_app.command("export-te")
def export_te(
    run_dir: RunDir,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Write here (default: stdout).")
    ] = None,
    names: Annotated[
        str,
        typer.Option(
            help="TE layer names: 'fqn' (fp8ops' module names) or 'inferred' "
            "(debug_api.infer_and_assign_layer_names: 'model.' prefix, 1-based layer numbers)."
        ),
    ] = "fqn",
) -> None:
    """TE debug-API YAML: FP8 off in the layers of the applied and approved overrides."""
    from fp8ops.overrides.te_debug import te_debug_yaml

    text = te_debug_yaml(_ledger(run_dir), naming=names)  # type: ignore[arg-type]
    if output is None:
        sys.stdout.write(text)
    else:
        atomic_write_text(output, text)
        print(f"wrote {output}")
