"""The ``certckpt`` command line: parse, call one library function, print, map errors to exit codes.

Commands live in their own modules and are registered here by name only: a command's module is
imported when that command runs, so ``certckpt --help`` imports click and nothing else of ours, and
``certckpt verify`` imports the format layer without torch. Exit codes: see ``common``.
"""

from __future__ import annotations

import importlib
from typing import NamedTuple

import click


def _short(text: str, limit: int) -> str:
    """``text`` cut at a word boundary to fit ``limit`` characters, with "..." when cut (what click's
    own listing does; its helper for it is deprecated in click 8.2 and gone in 9)."""
    if len(text) <= limit:
        return text
    cut = text[: max(limit - 3, 1)].rsplit(" ", 1)[0].rstrip(" .,;:")
    return f"{cut}..."


class Entry(NamedTuple):
    """Where a command lives and what ``--help`` says of it (checked against the command by a test)."""

    module: str
    attr: str
    summary: str  # the command's short help (its docstring's first sentence), in full


COMMANDS: dict[str, Entry] = {
    "verify": Entry("check_cmds", "verify", "Check every byte of the checkpoint at LOCATION (path or fsspec URL)."),
    "inspect": Entry(
        "check_cmds", "inspect", "Show the tensor table and certckpt record of LOCATION without reading the data."
    ),
    "status": Entry(
        "store_cmds",
        "status",
        "Every checkpoint of STORE with its verdict and reasons, the detections, uncommitted files.",
    ),
    "latest-good": Entry(
        "store_cmds",
        "latest_good",
        "Print the newest trusted checkpoint of STORE that precedes every open suspect interval.",
    ),
    "run": Entry(
        "run_cmd",
        "run",
        "Run COMMAND (a launcher: torchrun, srun, python ...); exit 86 when it failed on a detected fault, "
        "87 when its ranks were refused on a convicted device.",
    ),
    "gc": Entry(
        "gc_cmd",
        "gc",
        "Temp files of killed writers in STORE (never a checkpoint or a record): list, or remove with --apply.",
    ),
    "keygen": Entry(
        "keygen_cmd", "keygen", "Write a new private signing key to PATH (mode 0600) and its public key to PATH.pub."
    ),
    "revoke": Entry(
        "store_cmds",
        "revoke",
        "Revoke checkpoint CKPT (an id like main@120) of STORE; it and its descendants become suspect.",
    ),
    "vault": Entry("vault_cmds", "vault", "The off-node vault: promote trusted checkpoints, list, prune, restore."),
    "drill": Entry(
        "drill_cmds",
        "drill",
        "Drills: inject faults and check the checks; restore latest-good from a vault and prove it.",
    ),
    "incident": Entry(
        "incident_cmds", "incident", "Incidents opened by uncontained detections, and the decisions taken on them."
    ),
    "fleet": Entry(
        "fleet_cmds",
        "fleet",
        "The fleet registry: convicted devices, appeals, clearances, what a conviction changes, detection rates.",
    ),
    "plan": Entry(
        "plan_cmd",
        "plan_cmd",
        "What a checkpoint policy detects, loses and costs: audits every K, checkpoints every C, keep N.",
    ),
    "report": Entry(
        "report_cmd", "report", "Draw the timeline of STORE: branches, verdicts, audits, detections, latest-good."
    ),
    "envelope": Entry(
        "envelope_cmd", "envelope", "Measure the auditor's per-step premium over plain DDP, and gate on it."
    ),
    "release": Entry(
        "release_cmds",
        "release",
        "Release CKPT (a checkpoint, or a store's latest-good) as signed safetensors with its certificate.",
    ),
    "verify-release": Entry(
        "release_cmds",
        "verify_release",
        "Check a release DIRECTORY: model_signing signature, certificate, files, verdict (exit 1 if not).",
    ),
    "certify": Entry(
        "certify_cmd", "certify", "Certify SRC (a torch.save file, a safetensors file or a model directory) into DEST."
    ),
    "demo": Entry("demo", "demo", "The whole story on CPU: a planted fault caught, rolled back, vaulted, drilled."),
}


class LazyGroup(click.Group):
    """A click group whose subcommands are imported only when they are run (or asked for ``--help``)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *COMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in COMMANDS:
            entry = COMMANDS[cmd_name]
            module = importlib.import_module(f"{__package__}.{entry.module}")
            self.add_command(getattr(module, entry.attr), cmd_name)
        return super().get_command(ctx, cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # The listing uses the registry's short help so that `certckpt --help` imports no command.
        names = self.list_commands(ctx)
        limit = formatter.width - 6 - max(map(len, names))
        rows = [(name, _short(COMMANDS[name].summary, limit)) for name in names]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="certckpt", prog_name="certckpt")
def main() -> None:
    """Certified, pickle-free PyTorch checkpoints.

    Exit codes: 0 verified; 1 verification failed (corrupt, truncated, tampered);
    2 could not verify (usage, not found, not a certckpt checkpoint, store unreachable).
    """
    import logging
    import os

    from certckpt.log import ENV, enable

    # s3fs's event loop reports the requests a dead or dropped connection abandoned ("Task exception
    # was never retrieved", with aiohttp's traceback) through the asyncio logger, which Python prints
    # to stderr when nothing is configured: the command's error is one line, and those tasks' errors
    # are already in it (the request they belonged to failed and was retried or reported).
    quiet = logging.getLogger("asyncio")
    quiet.addHandler(logging.NullHandler())
    quiet.propagate = False

    # Audits and resumes say one line each on stderr, here and in the training ranks a command starts.
    os.environ.setdefault(ENV, "info")
    enable()


if __name__ == "__main__":  # pragma: no cover
    main()
