"""``certckpt keygen``: a new Ed25519 key pair for signing ledger records."""

from __future__ import annotations

import click

from .common import expected_errors


@click.command("keygen")
@click.argument("path", type=click.Path(dir_okay=False))
@expected_errors
def keygen(path: str) -> None:
    """Write a new private signing key to PATH (mode 0600) and its public key to PATH.pub.

    Writers sign with CERTCKPT_SIGNING_KEY=PATH; readers trust CERTCKPT_TRUSTED_KEYS=PATH.pub.
    Existing files are never replaced.
    """
    from certckpt.format.signing import generate_key

    private, public = generate_key(path)
    click.echo(f"private key: {private} (keep it on the writers; mode 0600)")
    click.echo(f"public key:  {public} (give it to readers: CERTCKPT_TRUSTED_KEYS={public})")
