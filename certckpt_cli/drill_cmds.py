"""``certckpt drill faults`` and ``certckpt drill restore``: inject faults and check the checks; restore
latest-good from a vault and prove it."""

from __future__ import annotations

import json
import sys

import click

from certckpt.errors import ConfigurationError

from .common import COPY_PROGRESS, EXIT_FAILED, EXIT_OK, Progress, echo_table, expected_errors


@click.group()
def drill() -> None:
    """Drills: inject faults and check the checks; restore latest-good from a vault and prove it."""


@drill.command("faults")
@click.option("--ranks", default=3, show_default=True, type=click.IntRange(1, 8), help="gloo ranks on this machine.")
@click.option(
    "--audit-every", default=10, show_default=True, type=click.IntRange(2, 1000), help="K: replay-audit interval."
)
@click.option(
    "--ckpt-every",
    default=5,
    show_default=True,
    type=click.IntRange(1, 1000),
    help="checkpoint interval (a consensus step).",
)
@click.option(
    "--dir",
    "directory",
    default=None,
    type=click.Path(file_okay=False),
    help="Keep each case's run store (checkpoints and events) here.",
)
@click.option(
    "--device",
    default="cpu",
    show_default=True,
    type=click.Choice(["cpu", "cuda"]),
    help="Where the ranks train (cuda: round-robin over the visible GPUs, gloo between ranks).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the matrix (or the sweep) as JSON.")
@click.option(
    "--sweep",
    is_flag=True,
    help="The magnitude sweep instead of the matrix: one-time faults between audits over a range of magnitudes "
    "and kinds, with and without the sentinels; prints the catch rate per kind and magnitude.",
)
@click.option(
    "--trials", default=3, show_default=True, type=click.IntRange(1, 1000), help="--sweep: runs per kind and magnitude."
)
@click.option(
    "--kinds",
    default=None,
    metavar="LIST",
    help="--sweep: comma-separated kinds (backward-scale...), perturbations (scale, bitflip-fp32, bitflip-bf16, "
    "set, zero) or sites (forward, backward); default: all.",
)
@click.option(
    "--magnitudes",
    default=None,
    metavar="LIST",
    help="--sweep: comma-separated magnitudes instead of each kind's defaults (bit indexes for bit flips).",
)
@click.option(
    "--clean-steps",
    default=100,
    show_default=True,
    type=click.IntRange(1, 100_000),
    help="--sweep: steps of each clean run (no fault: the false triggers).",
)
@click.option(
    "--svg",
    "svg_path",
    default=None,
    type=click.Path(dir_okay=False),
    help="--sweep: draw the catch rate against the magnitude to this .svg file.",
)
@expected_errors
def drill_faults(
    ranks: int,
    audit_every: int,
    ckpt_every: int,
    directory: str | None,
    device: str,
    as_json: bool,
    sweep: bool,
    trials: int,
    kinds: str | None,
    magnitudes: str | None,
    clean_steps: int,
    svg_path: str | None,
) -> None:
    """Run the fault-injection matrix on a small model and print which check caught what.

    Exit 0 when every case behaved as designed (escapes included), 1 otherwise. With --sweep: exit 0
    when no clean run had a detection, 1 otherwise (--ckpt-every does not apply: the sweep saves nothing).
    """
    from certckpt.detect.drill import matrix_cases, run_matrix

    if sweep:
        if directory:
            raise ConfigurationError("--dir keeps the matrix's run stores; the sweep keeps none (leave --dir out)")
        _sweep(
            ranks=ranks,
            audit_every=audit_every,
            device=device,
            as_json=as_json,
            trials=trials,
            kinds=kinds,
            magnitudes=magnitudes,
            clean_steps=clean_steps,
            svg_path=svg_path,
        )
    ctx = click.get_current_context()
    sweep_only = ("trials", "kinds", "magnitudes", "clean_steps", "svg_path")
    given = [
        f"--{p.replace('_path', '').replace('_', '-')}"
        for p in sweep_only
        if ctx.get_parameter_source(p) is click.core.ParameterSource.COMMANDLINE
    ]
    if given:
        raise ConfigurationError(f"{', '.join(given)} only apply to the sweep: add --sweep")
    if not as_json:
        n = len(matrix_cases(audit_every=audit_every, ckpt_every=ckpt_every))
        click.echo(
            f"running {n} fault cases on {ranks} gloo ranks ({device}) "
            f"(audit every {audit_every}, checkpoint every {ckpt_every})...",
            err=True,
        )
    matrix = run_matrix(ranks=ranks, audit_every=audit_every, ckpt_every=ckpt_every, directory=directory, device=device)
    as_designed = all(
        (c["caught_by"], c["detected_step"]) == (c["expected"]["caught_by"], c["expected"]["detected_step"])
        and (c["caught_by"] is None or ranks < 3 or c["suspect_ranks"] == [c["rank"]])
        for c in matrix["cases"]
    )
    if as_json:
        click.echo(json.dumps(matrix, indent=2))
    else:
        head = ("fault", "timing", "rank", "injected", "caught by", "at step", "named", "updates", "as designed")
        rows = []
        for c in matrix["cases"]:
            ok = (c["caught_by"], c["detected_step"]) == (c["expected"]["caught_by"], c["expected"]["detected_step"])
            rows.append(
                (
                    c["fault"],
                    c["timing"] + _magnitude(c),
                    str(c["rank"]),
                    str(c["injected_step"]),
                    (c["caught_by"] + (" (triggered)" if c.get("triggered") else "")) if c["caught_by"] else "ESCAPED",
                    "-" if c["detected_step"] is None else str(c["detected_step"]),
                    ",".join(map(str, c["suspect_ranks"])) or "-",
                    "-" if c["updates_before_detection"] is None else str(c["updates_before_detection"]),
                    "yes" if ok else "NO",
                )
            )
        echo_table(head, rows)
        escapes = [c for c in matrix["cases"] if c["caught_by"] is None]
        if escapes:
            click.echo(
                f"{len(escapes)} escape(s): a one-time finite fault between audits that the sentinels do not flag"
                " (a small one, or one a saturating layer hides) is averaged into every replica; no later check can"
                " see it."
            )
        notes = {n for c in matrix["cases"] for n in c["notes"]}
        for n in sorted(notes):
            click.echo(f"note: {n}")
        if directory:
            click.echo(f"run stores (checkpoints and their ledgers) kept under {directory}/<fault>-<timing>/")
    sys.exit(EXIT_OK if as_designed else EXIT_FAILED)


def _sweep(
    *,
    ranks: int,
    audit_every: int,
    device: str,
    as_json: bool,
    trials: int,
    kinds: str | None,
    magnitudes: str | None,
    clean_steps: int,
    svg_path: str | None,
) -> None:
    """``--sweep``: run it, print the table (or the JSON), draw the picture; exits."""
    from certckpt.detect import sweep as sw
    from certckpt.detect import sweep_table as st
    from certckpt.detect.sweep_run import run_sweep

    chosen = sw.select_kinds(kinds)
    values = sw.parse_magnitudes(magnitudes, chosen)
    if svg_path is not None and not svg_path.lower().endswith(".svg"):
        raise ConfigurationError(f"--svg {svg_path}: the picture is written as SVG; name a .svg file")
    cases = sw.sweep_cases(
        kinds=chosen, trials=trials, ranks=ranks, audit_every=audit_every, magnitudes=values, clean_steps=clean_steps
    )
    click.echo(
        f"sweep: {len(cases)} runs ({len(chosen)} kind(s), {trials} trial(s), sentinels on and off, and clean runs) "
        f"on {ranks} gloo ranks ({device}), audits every {audit_every}...",
        err=True,
    )
    result = run_sweep(
        cases, ranks=ranks, audit_every=audit_every, device=device, progress=lambda line: click.echo(line, err=True)
    )
    doc = st.report(result, trials=trials, kinds=chosen)
    rows, clean = doc["table"], doc["clean"]
    if svg_path is not None:
        from certckpt.ops.sweep_chart import render_sweep

        render_sweep(doc, svg_path)
    if as_json:
        click.echo(json.dumps(doc, indent=2))
    else:
        click.echo(st.CAUGHT_MEANS + ".")
        echo_table(st.TABLE_HEAD, st.table_rows(rows))
        for t in doc["thresholds"]:
            never = "none" if t["largest_never_caught"] is None else f"{t['largest_never_caught']:g}"
            always = "none" if t["always_caught_from"] is None else f"{t['always_caught_from']:g}"
            click.echo(
                f"{t['kind']}: largest magnitude never caught with the sentinels {never}; always caught from {always}"
            )
        for dtype, c in clean.items():
            click.echo(
                f"clean runs ({dtype}, no fault, sentinels on): {c['triggered']} triggered replay(s) that found "
                f"nothing in {c['steps']} steps ({c['per_1000_steps']:.1f} per 1,000 steps); "
                f"{c['detections']} detection(s)"
            )
        click.echo(
            f"{len(result['cases'])} runs in {result['seconds']:.0f} s" + (f"; picture: {svg_path}" if svg_path else "")
        )
    sys.exit(EXIT_OK if all(c["detections"] == 0 for c in clean.values()) else EXIT_FAILED)


def _magnitude(case: dict) -> str:
    """The label of a large case: where it lands when that decides whether the sentinels see it."""
    if not case.get("magnitude"):
        return ""
    if case.get("saturated"):
        return f" ({case['magnitude']}, into a tanh)"
    return f" ({case['magnitude']}, output layer)" if case.get("target") else f" ({case['magnitude']})"


@drill.command("restore")
@click.argument("vault_url")
@click.option("--model", "model_spec", required=True, help="module:callable building a fresh model.")
@click.option(
    "--eval", "eval_spec", required=True, help="module:callable(model) returning a number or {metric: number}."
)
@click.option(
    "--reference",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="Metrics of a clean reference run (JSON).",
)
@click.option("--rtol", type=float, default=1e-5, show_default=True, help="Relative tolerance for the metrics.")
@click.option("--atol", type=float, default=1e-8, show_default=True, help="Absolute tolerance for the metrics.")
@click.option("--key", default=None, help="Checkpoint entry holding the state dict (default: 'model' when present).")
@click.option(
    "--scratch",
    type=click.Path(file_okay=False),
    default=None,
    help="Restore here and keep it (default: a temporary directory).",
)
@click.option(
    "--save-metrics",
    type=click.Path(dir_okay=False),
    default=None,
    help="Write this drill's metrics as a reference file.",
)
@click.option(
    "--accept",
    type=click.Choice(["trusted", "verified"]),
    default="trusted",
    show_default=True,
    help="Lowest verdict drilled: verified takes the newest verified checkpoint when none is trusted.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@expected_errors
def drill_restore_cmd(
    vault_url, model_spec, eval_spec, reference, rtol, atol, key, scratch, save_metrics, accept, as_json
) -> None:
    """Restore latest-good from VAULT_URL and prove it: bytes, fingerprints, load, metrics.

    Exit 0 when all four pass; 1 when a stage fails or there is no reference to compare with.
    The drill is recorded in the vault's ledger. A sharded (DCP) checkpoint is put together from its
    shards in this process (no torch.distributed) and its whole-tensor fingerprints matched before
    it is loaded; a checkpoint directory with companions loads its model.safetensors.
    """
    from certckpt.vault import drill_restore, load_callable

    result = drill_restore(
        vault_url,
        model_factory=load_callable(model_spec),
        eval_fn=load_callable(eval_spec),
        reference=reference,
        rtol=rtol,
        atol=atol,
        key=key,
        scratch=scratch,
        progress=Progress(f"restoring latest-good of {vault_url}", threshold=COPY_PROGRESS),
        accept=accept,
    )
    if save_metrics and result.metrics and result.step is not None:
        with open(save_metrics, "w", encoding="utf-8") as f:
            json.dump({str(result.step): result.metrics}, f, indent=2)
    if as_json:
        click.echo(json.dumps(result.to_dict(), indent=2))
    else:
        click.echo(
            f"restore drill of {vault_url}: {result.ckpt_id or 'no checkpoint'}"
            + (f" (step {result.step})" if result.step is not None else "")
        )
        for stage, st in result.stages.items():
            mark = {True: "pass", False: "FAIL", None: "-"}[st["ok"]]
            click.echo(f"  {stage:<13} {mark:<5} {st['detail']}")
        if result.metrics:
            click.echo("  values        " + ", ".join(f"{k}={v:.6g}" for k, v in sorted(result.metrics.items())))
        if result.time_to_model_s is not None:
            click.echo(f"  time to a usable restored model: {result.time_to_model_s:.2f} s")
        click.echo(
            f"outcome: {result.outcome.upper()}"
            + (
                f" (recorded as drill {result.drill_id})"
                if result.recorded
                else " (could not record it in the vault's ledger)"
            )
        )
    sys.exit(EXIT_OK if result.passed else EXIT_FAILED)
