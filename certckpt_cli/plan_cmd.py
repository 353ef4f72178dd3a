"""``certckpt plan``: a thin front end to certckpt.ops.planner (parse, merge sources, print, exit code).

No torch and no matplotlib here: the planner is arithmetic, and ``certckpt --help`` stays fast.
"""

from __future__ import annotations

import json
import sys

import click

from .common import EXIT_FAILED, EXIT_OK, echo_table, expected_errors

# (option, input name, click type, help); defaults live in certckpt.ops.planner.DEFAULT_COSTS.
_COST_OPTIONS = (
    ("--step-time", "step_time", click.FloatRange(0, min_open=True), "S: seconds per optimizer step"),
    ("--gpus", "gpus", click.IntRange(1), "G: GPUs the job holds"),
    (
        "--gpu-hour-cost",
        "gpu_hour_cost",
        click.FloatRange(0),
        "P: price of a GPU-hour (every cost is in this currency)",
    ),
    (
        "--audit-overhead",
        "audit_overhead",
        click.FloatRange(0),
        "X: audits' extra compute, fraction of training compute",
    ),
    (
        "--false-positive-rate",
        "false_positive_rate",
        click.FloatRange(0, 1),
        "F: probability that one audit fails without a fault",
    ),
    ("--investigation-cost", "investigation_cost", click.FloatRange(0), "I: cost of investigating one failed audit"),
    ("--defect-cost", "defect_cost", click.FloatRange(0), "D: cost of shipping a model an undetected fault damaged"),
    ("--fault-rate", "fault_rate", click.FloatRange(0), "R: silent data corruptions per GPU-hour"),
    ("--transient-fraction", "transient_fraction", click.FloatRange(0, 1), "T: share of faults that are one-time"),
    ("--run-steps", "run_steps", click.IntRange(1), "STEPS: optimizer steps in one run"),
)

_LABELS = {
    "audit_every": "audit every (K)",
    "ckpt_every": "checkpoint every (C)",
    "keep": "keep (N)",
    "step_time": "step time (S, s)",
    "gpus": "GPUs (G)",
    "gpu_hour_cost": "GPU-hour cost (P)",
    "audit_overhead": "audit overhead (X)",
    "false_positive_rate": "false positives per audit (F)",
    "investigation_cost": "investigation cost (I)",
    "defect_cost": "defect cost (D)",
    "fault_rate": "faults per GPU-hour (R)",
    "transient_fraction": "transient fraction (T)",
    "run_steps": "run steps (STEPS)",
}
_SYMBOLS = {
    "step_time": "S",
    "gpus": "G",
    "gpu_hour_cost": "P",
    "audit_overhead": "X",
    "false_positive_rate": "F",
    "investigation_cost": "I",
    "defect_cost": "D",
    "fault_rate": "R",
    "transient_fraction": "T",
    "run_steps": "STEPS",
}


def _cost_options(fn):
    from certckpt.ops.planner import DEFAULT_COSTS  # pure stdlib module: cheap

    for flag, name, kind, text in reversed(_COST_OPTIONS):
        fn = click.option(
            flag, name, type=kind, default=None, help=f"{text} [default: {_num(getattr(DEFAULT_COSTS, name))}]"
        )(fn)
    return fn


def _num(v: float) -> str:
    """Four significant digits, whole numbers without an exponent (100000, not 1e+05)."""
    if isinstance(v, float) and v.is_integer() and abs(v) < 1e15:
        return str(int(v))
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def _source(inp) -> str:
    if inp.source == "from":
        return f"from {inp.origin}: {inp.note}"
    return inp.source


@click.command("plan")
@click.option(
    "--audit-every", "audit_every", type=click.IntRange(1), default=None, help="K: full-audit interval in steps."
)
@click.option(
    "--ckpt-every", "ckpt_every", type=click.IntRange(1), default=None, help="C: checkpoint interval in steps."
)
@click.option(
    "--keep", "keep", type=click.IntRange(0), default=None, help="N: newest checkpoints kept on node storage."
)
@_cost_options
@click.option(
    "--from",
    "sources",
    multiple=True,
    metavar="URL",
    help="Read K, C, N from a run store's ledger, or X from an envelope report (.json); repeatable. Flags override.",
)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON report.")
@expected_errors
def plan_cmd(sources: tuple[str, ...], as_json: bool, **flags) -> None:
    """What a checkpoint policy detects, loses and costs: audits every K, checkpoints every C, keep N.

    Prints the detection window, worst and expected rollback, whether retention always keeps a
    known-good checkpoint, warnings and the expected cost of one run. The formulas are in
    certckpt/planner.py. Exit 0 when the combination is defensible, 1 when a warning says it is not
    (checkpoints not aligned with audits, keep too small, no audit in the run), 2 on usage errors.
    """
    from certckpt.ops.planner import plan_inputs, read_policy, resolve_inputs

    found = [read_policy(url) for url in sources]
    try:
        inputs = resolve_inputs(flags=flags, found=found)
    except ValueError as e:
        raise click.UsageError(str(e)) from e
    result = plan_inputs(inputs)
    if as_json:
        doc = {"inputs": {name: inp.to_dict() for name, inp in inputs.items()}, **result.to_dict()}
        click.echo(json.dumps(doc, indent=2))
    else:
        _print(inputs, result)
    sys.exit(EXIT_FAILED if result.indefensible else EXIT_OK)


def _print(inputs, p) -> None:
    k, c, n = p.audit_every, p.ckpt_every, p.keep
    click.echo(f"policy: audit every {k} steps, checkpoint every {c}, keep {n}")
    click.echo("")
    echo_table(
        ("input", "value", "source"), [(_LABELS[name], _num(inp.value), _source(inp)) for name, inp in inputs.items()]
    )

    d = p.detection
    click.echo("")
    click.echo("detection")
    click.echo(
        "  a persistent fault is caught by the next replay audit: "
        f"at most {d.max_contaminated_updates} update(s) "
        f"contaminated (mean {_num(d.mean_contaminated_updates)}), "
        f"suspect interval {d.suspect_interval_updates} update(s)"
    )
    click.echo(f"  a one-time fault escapes on {d.transient_escape_fraction:.0%} of steps (those no audit replays)")

    r = p.rollback
    click.echo("")
    click.echo("rollback (to the newest checkpoint at or before the last clean audit)")

    def hours(v):
        return f"  ({_num(v)} GPU-hours)" if v is not None else ""

    click.echo(f"  worst     {r.worst_steps} steps{hours(r.worst_gpu_hours)}")
    click.echo(f"  expected  {_num(r.expected_steps)} steps{hours(r.expected_gpu_hours)}")
    if r.worst_gpu_hours is None:
        click.echo("  (give --step-time and --gpus for GPU-hours)")
    click.echo(f"  a checkpoint waits up to {r.max_certification_delay} step(s) for the audit that certifies it")

    t = p.retention
    click.echo("")
    click.echo("retention")
    click.echo(
        f"  keep {t.keep} newest; a detected fault needs up to {t.needed} on node storage (the rollback target and "
        f"{t.needed - 1} written after it); keeps known-good: {'yes' if t.keeps_known_good else 'NO'}"
        + ("" if t.keeps_known_good else f" (keep at least {t.smallest_keep})")
    )

    cost = p.cost
    click.echo("")
    defaulted = [_SYMBOLS[name] for name, inp in inputs.items() if inp.source == "default"]
    click.echo(
        f"expected cost of one run of {p.costs.run_steps} steps ({_num(cost.gpu_hours)} GPU-hours, "
        f"{_num(cost.expected_faults)} expected faults), in the currency of P"
    )
    rows = [(name.replace("_", " "), _num(v)) for name, v in cost.components.items()]
    rows += [("total", _num(cost.total)), ("per 1000 steps", _num(cost.per_1000_steps))]
    echo_table(("component", "cost"), rows)
    if defaulted:
        click.echo(f"  defaults used: {', '.join(defaulted)}")

    click.echo("")
    if not p.warnings:
        click.echo("no warnings")
    for w in p.warnings:
        click.echo(f"{'INDEFENSIBLE' if w.indefensible else 'warning'}: {w.message}")
