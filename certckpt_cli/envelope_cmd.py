"""``certckpt envelope``: a thin front end to certckpt.tools.envelope (run the sweep, print, gate).

Nothing heavy at import: torch is imported by the library only when the command runs.
"""

from __future__ import annotations

import os
import sys

import click

from certckpt.errors import ConfigurationError

from .common import EXIT_FAILED, EXIT_OK, EXIT_UNVERIFIABLE, OneLineUsage, expected_errors, fail


@click.command(
    "envelope", short_help="Measure the auditor's per-step premium over plain DDP, and gate on it.", cls=OneLineUsage
)
@click.option(
    "--seq-lens", default=None, metavar="L,L,...", help="Sequence lengths [default: 128,512,2048; --quick: 64,256]."
)
@click.option(
    "--micro-batches",
    default=None,
    metavar="B,B,...",
    help="Sequences per rank per step [default: 1,4,16; --quick: 1,4].",
)
@click.option("--audit-every", default=None, metavar="K,K,...", help="Audit intervals, each >= 2 [default: 10,100].")
@click.option(
    "--ranks",
    default=3,
    show_default=True,
    type=click.IntRange(1, 64),
    help="Processes (one per rank, on this machine).",
)
@click.option(
    "--model",
    default="tiny-transformer",
    show_default=True,
    help="tiny-transformer (133k parameters), gpt2-small (124M, for a GPU), or MODULE:FACTORY where FACTORY() "
    "returns (model, batch_fn, loss_fn).",
)
@click.option(
    "--max-premium",
    default=0.05,
    show_default=True,
    type=float,
    help="Largest acceptable premium, a fraction (0.05 = 5%).",
)
@click.option(
    "--steps", default=None, type=click.IntRange(1), help="Timed trials per shape, at least [default: 5; --quick: 10]."
)
@click.option(
    "--seconds-per-shape",
    default=None,
    type=click.FloatRange(0),
    help="Keep adding trials (up to 200) while a shape has used less than this [default: 30; --quick: 15].",
)
@click.option(
    "--quick", is_flag=True, help="A small sweep (seq 64,256 x mb 1,4 x K 10,100; under 2 minutes on 2 cores)."
)
@click.option(
    "--mode",
    default="deterministic",
    show_default=True,
    type=click.Choice(["deterministic", "tolerance"]),
    help="Auditor mode (deterministic: torch.use_deterministic_algorithms(True), bit-exact replay).",
)
@click.option(
    "--nonfinite-read",
    default="immediate",
    show_default=True,
    type=click.Choice(["immediate", "deferred"]),
    help="When the auditor reads each step's non-finite flags (deferred: a step later, without waiting for the GPU).",
)
@click.option(
    "--backend",
    default="gloo",
    show_default=True,
    type=click.Choice(["gloo", "nccl"]),
    help="DDP backend (nccl needs --device cuda, one GPU per rank).",
)
@click.option(
    "--device", default="cpu", show_default=True, type=click.Choice(["cpu", "cuda"]), help="Where the model runs."
)
@click.option(
    "--json", "as_json", is_flag=True, help="Print the report as JSON (the file `certckpt plan --from` reads)."
)
@click.option(
    "--plot",
    "plot_path",
    default=None,
    type=click.Path(dir_okay=False),
    help="Also draw premium against K to this .png (needs matplotlib).",
)
@expected_errors
def envelope(
    seq_lens,
    micro_batches,
    audit_every,
    ranks,
    model,
    max_premium,
    steps,
    seconds_per_shape,
    quick,
    mode,
    nonfinite_read,
    backend,
    device,
    as_json,
    plot_path,
) -> None:
    """Measure the auditor's per-step premium over plain DDP for every (sequence length, micro-batch,
    audit interval K) combination, on real DDP processes, and gate on --max-premium.

    Per combination: plain and audited mean step times, the premium (audited - plain) / plain, its
    shares from replay, consensus and non-finite checks, and the replay floor (the forward+backward
    share of a plain step / K). Progress goes to stderr.

    Exit 0 when every premium is within --max-premium; 1 naming the combinations over it; 2 for
    usage errors or a sweep that could not run.
    """
    from certckpt.tools.envelope import (
        FULL,
        QUICK,
        EnvelopeConfig,
        format_table,
        parse_int_list,
        plot,
        require_matplotlib,
        resolve_model,
        run_envelope,
        to_json,
    )

    preset = QUICK if quick else FULL
    seq = parse_int_list(seq_lens, "--seq-lens") if seq_lens is not None else preset["seq_lens"]
    mbs = parse_int_list(micro_batches, "--micro-batches") if micro_batches is not None else preset["micro_batches"]
    ks = parse_int_list(audit_every, "--audit-every", low=2) if audit_every is not None else preset["audit_every"]
    if plot_path is not None:
        if os.path.splitext(plot_path)[1].lower() != ".png":
            raise ConfigurationError(f"--plot {plot_path}: give a path ending in .png")
        parent = os.path.dirname(os.path.abspath(plot_path))
        if not os.path.isdir(parent):
            raise ConfigurationError(f"--plot {plot_path}: no such directory {parent}")
        require_matplotlib()
    spec, extra = resolve_model(model)
    config = EnvelopeConfig(
        seq_lens=seq,
        micro_batches=mbs,
        audit_every=ks,
        ranks=ranks,
        model=spec,
        max_premium=max_premium,
        steps=steps if steps is not None else preset["steps"],
        min_shape_s=seconds_per_shape if seconds_per_shape is not None else preset["min_shape_s"],
        mode=mode,
        nonfinite_read=nonfinite_read,
        backend=backend,
        device=device,
        extra_path=extra,
    )
    n = len(config.shapes) * len(ks)
    click.echo(
        f"envelope: {n} combination(s) ({len(seq)} seq len x {len(mbs)} micro-batch x {len(ks)} K) on {ranks} "
        f"{backend} rank(s), model {spec}...",
        err=True,
    )

    from certckpt.errors import RanksFailedError

    try:
        report = run_envelope(config, progress=lambda line: click.echo(f"  {line}", err=True))
    except RanksFailedError as e:
        fail(f"envelope: the sweep failed: {e}", EXIT_UNVERIFIABLE)
    if plot_path is not None:
        plot(report, plot_path)
        click.echo(f"envelope: plot written to {plot_path}", err=True)
    if as_json:
        click.echo(to_json(report))
    else:
        click.echo(format_table(report))
    for c in report["over_budget"]:
        click.echo(
            f"certckpt: over budget: seq {c['seq_len']} x mb {c['micro_batch']}, K {c['audit_every']}: "
            f"premium {c['premium']:+.1%} > {max_premium:.1%}",
            err=True,
        )
    sys.exit(EXIT_FAILED if report["over_budget"] else EXIT_OK)
