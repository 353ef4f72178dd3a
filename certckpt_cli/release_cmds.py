"""``certckpt release`` and ``verify-release``: a certified model that travels (docs/release.md)."""

from __future__ import annotations

import json

import click

from .common import expected_errors


@click.command("release")
@click.argument("ckpt")
@click.option("--key", required=True, type=click.Path(dir_okay=False), help="Elliptic-curve private key, PEM.")
@click.option("--out", required=True, type=click.Path(file_okay=False), help="The new release directory.")
@click.option("--store", default=None, help="The run store that committed CKPT (default: the one around it).")
@click.option(
    "--accept",
    type=click.Choice(["trusted", "verified"]),
    default="trusted",
    show_default=True,
    help="Lowest verdict released: verified also releases a run without audit evidence (and says so).",
)
@click.option(
    "--part",
    default=None,
    help="Where the model's tensors are: an entry of a file (default: model, else state_dict), a weight file of a"
    " checkpoint directory (default: model.safetensors), a name prefix of a DCP checkpoint (default: model).",
)
@click.option("--with", "extra", multiple=True, type=click.Path(dir_okay=False), help="A file signed with the model.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON answer.")
@expected_errors
def release(
    ckpt: str, key: str, out: str, store: str | None, accept: str, part: str | None, extra: tuple, as_json: bool
) -> None:
    """Release CKPT (a checkpoint, or a store's latest-good) as signed safetensors with its certificate."""
    from certckpt.ops.release import make_release

    r = make_release(ckpt, key=key, out=out, store=store, accept=accept, part=part, extra_files=extra)
    if as_json:
        doc = {"directory": r.directory, "ckpt_id": r.ckpt_id, "verdict": r.level, "files": r.files, "key": r.key_id}
        click.echo(json.dumps(doc, indent=2))
        return
    click.echo(f"released {r.ckpt_id} ({r.level}) into {r.directory}, signed by key {r.key_id[:16]}")
    for name, digest in r.files.items():
        click.echo(f"  {name}  sha256 {digest}")
    click.echo(f"check it: certckpt verify-release {r.directory} --public-key KEY.pub")


@click.command("verify-release")
@click.argument("directory", type=click.Path(file_okay=False))
@click.option("--public-key", required=True, type=click.Path(dir_okay=False), help="The release key to trust (PEM).")
@click.option(
    "--accept",
    type=click.Choice(["trusted", "verified"]),
    default="trusted",
    show_default=True,
    help="Lowest verdict taken: verified also takes a release without audit evidence.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the certificate's predicate as JSON.")
@expected_errors
def verify_release(directory: str, public_key: str, accept: str, as_json: bool) -> None:
    """Check a release DIRECTORY: model_signing signature, certificate, files, verdict (exit 1 if not)."""
    from certckpt.ops.release import verify_release as check

    r = check(directory, public_key=public_key, accept=accept)
    if as_json:
        click.echo(json.dumps({"ok": True, "files": r.files, "predicate": r.predicate}, indent=2))
        return
    reasons = f" ({', '.join(r.reasons)})" if r.reasons else ""
    click.echo(f"{directory}: release of {r.ckpt_id} verified: {r.level}{reasons}; {len(r.files)} file(s) signed")
    if r.coverage:
        click.echo(f"  coverage: {r.coverage}")
