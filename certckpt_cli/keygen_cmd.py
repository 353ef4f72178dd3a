"""``certckpt keygen``: a new Ed25519 key pair for signing ledger records."""

from __future__ import annotations

import click

from .common import expected_errors


@click.command("keygen")
@click.argument("path", type=click.Path(dir_okay=False))
@click.option(
    "--release",
    "for_release",
    is_flag=True,
    help="An ECDSA P-256 key for `certckpt release` (what OpenSSF model_signing verifies), not a ledger key.",
)
@expected_errors
def keygen(path: str, for_release: bool = False) -> None:
    """Write a new private signing key to PATH (mode 0600) and its public key to PATH.pub.

    Writers sign with CERTCKPT_SIGNING_KEY=PATH; readers trust CERTCKPT_TRUSTED_KEYS=PATH.pub.
    Existing files are never replaced.
    """
    if for_release:
        from certckpt.ops.release_cert import generate_release_key

        private, public = generate_release_key(path)
        click.echo(f"private key: {private} (signs releases: certckpt release CKPT --key {private}; mode 0600)")
        click.echo(
            f"public key:  {public} (consumers verify with it: certckpt verify-release DIR --public-key {public})"
        )
        return
    from certckpt.format.signing import generate_key

    private, public = generate_key(path)
    click.echo(f"private key: {private} (keep it on the writers; mode 0600)")
    click.echo(f"public key:  {public} (give it to readers: CERTCKPT_TRUSTED_KEYS={public})")
