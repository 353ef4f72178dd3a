"""``certckpt certify``: turn a torch.save file, a plain safetensors file or a Hugging Face model
directory into certified files, optionally committed to a ledger (then they can reach ``verified``)."""

from __future__ import annotations

import json
import os
import shutil

import click

from .common import expected_errors


@click.command("certify")
@click.argument("src")
@click.argument("dest")
@click.option("--ledger", default=None, help="Run store whose ledger commits the result (one file only).")
@click.option("--run", default=None, help="The run's name, for the record.")
@click.option("--step", type=click.IntRange(0), default=None, help="The optimizer step (required with --ledger).")
@click.option("--branch", default="main", show_default=True, help="The branch, with --ledger.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@expected_errors
def certify(
    src: str, dest: str, ledger: str | None, run: str | None, step: int | None, branch: str, as_json: bool
) -> None:
    """Certify SRC (a torch.save file, a safetensors file or a model directory) into DEST.

    torch.save files are read with torch.load(weights_only=True) only; one that needs more pickle is
    refused. A directory's safetensors files are certified under their own names and its other files
    copied; pickled weight files in it are refused (certify each file first). DEST is never replaced.
    """
    from certckpt.errors import ConfigurationError
    from certckpt.format.importing import plan_directory, read_foreign
    from certckpt.trust.commit import save

    done = []
    if os.path.isdir(src):
        if ledger:
            raise ConfigurationError("--ledger commits one file: certify a directory without it")
        plan = plan_directory(src)
        if plan.refused:
            raise ConfigurationError(
                f"{src}: pickled weight files {', '.join(plan.refused[:5])}: certify each with "
                "`certckpt certify FILE DEST.safetensors` first; nothing was written"
            )
        if not plan.weights:
            raise ConfigurationError(f"{src}: no safetensors file to certify")
        for rel in plan.weights:
            got = read_foreign(os.path.join(src, rel))
            out = os.path.join(dest, rel)
            os.makedirs(os.path.dirname(out), exist_ok=True)
            done.append((rel, save(got.obj, out, metadata=got.metadata, run=run, step=step, overwrite=False)))
        for rel in plan.copies:
            os.makedirs(os.path.dirname(os.path.join(dest, rel)), exist_ok=True)
            if os.path.exists(os.path.join(dest, rel)):
                raise ConfigurationError(f"{os.path.join(dest, rel)} exists; certify never replaces files")
            shutil.copy2(os.path.join(src, rel), os.path.join(dest, rel))
    else:
        got = read_foreign(src)
        kw = {"ledger": ledger, "branch": branch} if ledger else {"overwrite": False}
        done.append((os.path.basename(src), save(got.obj, dest, metadata=got.metadata, run=run, step=step, **kw)))
    if as_json:
        click.echo(
            json.dumps(
                [{"source": s, "location": r.location, "state_fp": r.state_fp, "bytes": r.nbytes} for s, r in done],
                indent=2,
            )
        )
        return
    for s, r in done:
        click.echo(f"{s} -> {r.location}: certified, state fp {r.state_fp}")
    if ledger:
        click.echo(f"committed to {ledger} as {branch}@{step}: `certckpt latest-good {ledger} --accept verified`")
