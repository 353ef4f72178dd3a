"""``certckpt demo``: the whole story on this machine in well under three minutes.

3 gloo ranks on CPU train a small model with the auditor; a persistent finite fault planted on one
rank is caught by the replay audit; the verdicts and the incident are printed; latest-good is
found; training rolls back to it on a new branch and finishes; trusted checkpoints are promoted to a
local vault; a restore drill proves latest-good against a clean reference run; the incident is
resolved and closed; the timeline picture is drawn. Every artefact stays in the directory.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import click

from certckpt.errors import CertckptError

from .common import expected_errors


def run_demo(directory: str, *, echo: Callable[[str], None] = print, ranks: int = 3) -> dict[str, Any]:
    """Run the demo in ``directory`` (created; must be empty); returns its key facts."""
    from certckpt.detect.launch import run_ranks
    from certckpt.ops.report import render, timeline
    from certckpt.tools.demo import SCHEDULE
    from certckpt.trust.runstore import certify_store, decide, find_latest_good, get_incident
    from certckpt.vault import drill_restore, promote

    from .store_cmds import status_lines

    root = os.path.abspath(directory)
    if os.path.isdir(root) and os.listdir(root):
        raise CertckptError(f"{directory} is not empty; choose a new --dir (the demo never overwrites files)")
    store, vault = os.path.join(root, "run"), os.path.join(root, "vault")
    reference = os.path.join(root, "reference-metrics.json")
    os.makedirs(store)
    s = dict(SCHEDULE)
    t0 = time.perf_counter()
    began = [t0]  # when the stage under way began

    def stage_done() -> None:
        echo(f"  ({time.perf_counter() - began[0]:.1f} s)")

    def stage(n: int, text: str) -> None:
        if n > 1:
            stage_done()  # each stage's own duration, printed when it ends
        began[0] = time.perf_counter()
        echo(f"\n[{n}/7] {text}")

    stage(
        1,
        f"training on {ranks} gloo ranks (CPU): audit every {s['audit_every']} steps, "
        f"checkpoint every {s['ckpt_every']}; "
        f"a persistent fault is planted on rank {s['fault_rank']} from step {s['fault_step']}",
    )
    res = run_ranks("certckpt.tools.demo:train_faulty", ranks, {"store": store, "schedule": s}, timeout=300)[0]
    if res["stopped_at"] is None:
        raise CertckptError("the planted fault was not detected; the demo expects the replay audit to catch it")
    iid = res["incident"]
    echo(
        f"  step {res['stopped_at']}: the {res['kind']} check failed and named rank(s) {res['suspect_ranks']}; "
        f"training stopped before applying the update; incident {iid} opened"
    )

    stage(2, "verdicts (certckpt status)")
    st = certify_store(store)
    for line in status_lines(st):
        echo("  " + line)

    stage(3, f"the incident (certckpt incident show {iid})")
    inc = get_incident(store, iid)
    o = inc.opened
    c, d = o["suspect_interval"]
    echo(
        f"  check {o['signature']['check']} at step {o['detected_step']}; "
        f"suspect rank(s) {o['suspect_ranks']} on node(s) "
        f"{', '.join(o['suspect_nodes']) or '?'}; tensors {', '.join(o['signature']['tensors'][:4])}"
    )
    echo(f"  suspect steps ({c}, {d}]; made suspect: {', '.join(o['checkpoints']['made_suspect']) or 'none'}")

    stage(4, "latest-good: the newest trusted checkpoint before the suspect interval")
    _, good = find_latest_good(store)
    assert good is not None  # the demo's run is trusted up to the audit before the fault
    good_url = st.entry(good).url
    echo(f"  {good}  ->  {good_url}")
    decide(store, iid, action="quarantine", by="demo", reason=f"rank {o['suspect_ranks']} named by the replay audit")
    decide(store, iid, action="rollback", by="demo", reason="restart from latest-good on a new branch", ckpt=good)

    stage(
        5, f"rolling back: branch b2 resumes from {good} on healthy hardware (and a clean reference run for the drill)"
    )
    rec = run_ranks(
        "certckpt.tools.demo:train_recovery",
        ranks,
        {"store": store, "schedule": s, "resume_from": good_url, "parent": good, "reference_out": reference},
        timeout=300,
    )[0]
    if rec["stopped_at"] is not None:
        raise CertckptError(f"the recovered branch failed a check at step {rec['stopped_at']}")
    st = certify_store(store)
    for line in status_lines(st):
        echo("  " + line)
    decide(store, iid, action="resolve", by="demo", reason=f"training resumed from {good} as b2 and finished")

    stage(6, "vault: promote trusted checkpoints, then a restore drill of latest-good against the clean reference")
    done = promote(store, vault)
    echo(f"  promoted {len(done)} checkpoints: {', '.join(p.ckpt_id for p in done)}")
    from certckpt.tools.demo import evaluate, make_model

    drill = drill_restore(vault, model_factory=make_model, eval_fn=evaluate, reference=reference)
    for name, r in drill.stages.items():
        echo(f"  {name:<13} {'pass' if r['ok'] else 'FAIL' if r['ok'] is False else '-':<5} {r['detail']}")
    echo(
        f"  drill {drill.outcome.upper()} on {drill.ckpt_id}; time to a usable model {drill.time_to_model_s or 0:.2f} s"
    )
    if drill.passed:
        decide(
            store,
            iid,
            action="close",
            by="demo",
            reason="restore drill passed against the clean reference",
            drill=drill.drill_id,
            vault=vault,
        )
        promote(store, vault)  # the closing decision reaches the vault
    echo(f"  incident {iid}: {get_incident(store, iid).status}")

    stage(7, "timeline picture")
    picture = os.path.join(root, "timeline.svg")  # the base install draws SVG; PNG needs matplotlib
    render(timeline(certify_store(store, write_certificates=False)), picture)
    echo(f"  {picture}")

    stage_done()
    echo(f"\ndone in {time.perf_counter() - t0:.0f} s. Everything is in {directory}/; try:")
    for cmd in (
        f"certckpt status {store}",
        f"certckpt latest-good {store}",
        f"certckpt incident show {store} {iid}",
        f"certckpt vault ls {vault}",
        f"certckpt verify --deep {good_url}",
        f"certckpt plan --from {store} --keep 3",
        f"certckpt report {store} --out {os.path.join(directory, 'timeline.html')}",
    ):
        echo(f"  {cmd}")
    return {
        "store": store,
        "vault": vault,
        "incident": iid,
        "detected_step": res["stopped_at"],
        "suspect_ranks": res["suspect_ranks"],
        "latest_good": good,
        "suspect_interval": [c, d],
        "final_latest_good": st.latest_good,
        "drill": drill.to_dict(),
        "incident_status": get_incident(store, iid).status,
        "timeline": picture,
        "seconds": time.perf_counter() - t0,
    }


@click.command(short_help="The whole story on CPU: a planted fault caught, rolled back, vaulted, drilled.")
@click.option(
    "--dir",
    "directory",
    default="certckpt-demo",
    show_default=True,
    type=click.Path(file_okay=False),
    help="Where to leave every artefact (must be new or empty).",
)
@expected_errors
def demo(directory: str) -> None:
    """The whole story in under 3 minutes on CPU: 3 gloo ranks, a planted fault caught, verdicts,
    an incident, rollback to latest-good, a vault, a restore drill, the timeline picture."""
    run_demo(directory, echo=click.echo)
