"""The vault on local fsspec storage (file:// paths and memory://): promote, list, prune, restore, drill.

The run stores come from real 3-rank gloo training with the auditor (``drill_runs`` in conftest).
"""

import json
import os
import stat
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import certckpt
from certckpt.errors import CheckpointExistsError, CheckpointNotFoundError, UntrustedCheckpointError
from certckpt.trust.ledger import Ledger
from certckpt.trust.runstore import find_latest_good
from certckpt.vault import holdings, promote, prune, restore
from certckpt.vault.drill import compare_metrics, drill_restore, pick_reference
from certckpt.vault.retention import (
    AnyOf,
    KeepBest,
    KeepEvery,
    KeepFor,
    KeepLatest,
    RetentionEntry,
    plan_prune,
    protected_checkpoints,
)
from tests.support.helpers import console_script

DAY = 86400.0


def entry(step, *, branch="main", trusted=True, at=None, **metrics):
    return RetentionEntry(
        ckpt_id=f"{branch}@{step}",
        branch=branch,
        step=step,
        trusted=trusted,
        committed_at=float(step if at is None else at),
        metrics=metrics,
    )


# --- retention policies (pure) -------------------------------------------------------------------


def test_each_policy_keeps_what_it_says():
    es = [entry(s, trusted=s != 40) for s in range(10, 70, 10)]  # main@40 suspect
    assert set(KeepLatest(2).keeps(es, now=0)) == {"main@60", "main@50"}
    assert set(KeepLatest(0).keeps(es, now=0)) == set()
    # newest trusted in each 25-step window: [0,25) -> 20, [25,50) -> 30 (40 is suspect), [50,75) -> 60
    assert set(KeepEvery(25).keeps(es, now=0)) == {"main@20", "main@30", "main@60"}
    # younger than one day at now = 60 + 1 day - 1 s: committed_at 60 only... and anything after
    assert set(KeepFor(1).keeps(es, now=DAY + 45)) == {"main@50", "main@60"}
    best = [
        entry(10, loss=0.5),
        entry(20, loss=0.2),
        entry(30, loss=0.3),
        entry(40, trusted=False, loss=0.1),
        entry(50),
    ]
    assert set(KeepBest("loss").keeps(best, now=0)) == {"main@20"}  # the suspect one never ranks
    assert set(KeepBest("loss", n=2, higher_is_better=True).keeps(best, now=0)) == {"main@10", "main@30"}


def test_policies_compose_as_a_union():
    es = [entry(s) for s in range(10, 110, 10)]
    p = KeepLatest(1) | KeepEvery(50)
    assert isinstance(p, AnyOf) and len((p | KeepFor(0)).policies) == 3
    assert set(p.keeps(es, now=0)) == set(KeepLatest(1).keeps(es, now=0)) | set(KeepEvery(50).keeps(es, now=0))
    assert str(p) == "keep-last 1 | keep-every 50 steps"


def test_rollback_target_is_protected_until_a_recovery_branch_passes_the_interval():
    es = [entry(5), entry(10), entry(15, trusted=False)]
    intervals = [("main", 10, 20)]
    prot = protected_checkpoints(es, latest_good="main@10", intervals=intervals)
    assert prot == {"main@10": "latest-good"}
    # training recovered on b2 from main@5 (say main@10 was revoked): main@5 is the target while b2 is behind
    es2 = [entry(5), entry(10, trusted=False), entry(15, trusted=False), entry(15, branch="b2")]
    parents = {"b2": "main@5"}
    prot = protected_checkpoints(es2, latest_good="b2@15", intervals=[("main", 5, 20)], branch_parents=parents)
    assert "main@5" in prot and "rollback target" in prot["main@5"]
    es2.append(entry(25, branch="b2"))  # b2 is trusted past the detection step: the interval is closed
    prot = protected_checkpoints(es2, latest_good="b2@25", intervals=[("main", 5, 20)], branch_parents=parents)
    assert prot == {"b2@25": "latest-good"}


entries_st = st.lists(
    st.tuples(st.integers(1, 200), st.booleans(), st.floats(0, 30 * DAY)),
    min_size=0,
    max_size=25,
    unique_by=lambda t: t[0],
).map(lambda xs: [entry(s, trusted=t, at=a) for s, t, a in xs])
policy_st = st.lists(
    st.one_of(
        st.builds(KeepLatest, st.integers(0, 4)),
        st.builds(KeepEvery, st.integers(1, 80)),
        st.builds(KeepFor, st.floats(0, 40)),
    ),
    min_size=1,
    max_size=3,
).map(lambda ps: AnyOf(*ps))


@settings(max_examples=300, deadline=None)
@given(entries_st, policy_st, st.booleans(), st.integers(0, 200), st.integers(1, 50))
def test_prune_plan_invariants(entries, policy, incident, c, width):
    trusted = sorted((e for e in entries if e.trusted), key=lambda e: e.step)
    latest = trusted[-1].ckpt_id if trusted else None
    prot = protected_checkpoints(entries, latest_good=latest, intervals=[("main", c, c + width)])
    plan = plan_prune(entries, policy, now=30 * DAY, protected=prot, open_incidents=["inc-1"] if incident else [])
    ids = {e.ckpt_id for e in entries}
    assert set(plan.keep) | set(plan.delete) == ids and not set(plan.keep) & set(plan.delete)
    assert latest is None or latest not in plan.delete  # never the newest trusted
    target = max((e for e in trusted if e.step <= c), key=lambda e: e.step, default=None)
    assert target is None or target.ckpt_id not in plan.delete  # never the rollback target
    if incident:
        assert plan.delete == []  # nothing while an incident is open
    assert not set(policy.keeps(entries, now=30 * DAY)) & set(plan.delete)  # never what a policy keeps


def test_reference_metrics_are_picked_by_step_or_flat_and_compared_with_tolerance():
    assert pick_reference({"10": {"loss": 1.0}, "20": {"loss": 2.0}}, ckpt_id="main@20", step=20) == {"loss": 2.0}
    assert pick_reference({"main@20": {"loss": 3.0}}, ckpt_id="main@20", step=20) == {"loss": 3.0}
    assert pick_reference({"loss": 1.5}, ckpt_id="x@1", step=1) == {"loss": 1.5}
    assert pick_reference({"10": {"loss": 1.0}}, ckpt_id="main@20", step=20) is None
    assert compare_metrics({"loss": 1.0 + 1e-7}, {"loss": 1.0}, rtol=1e-5, atol=0)[0]
    ok, problems = compare_metrics({"loss": 1.1}, {"loss": 1.0, "acc": 0.5}, rtol=1e-5, atol=0)
    assert not ok and len(problems) == 2 and any("acc: missing" in p for p in problems)
    assert not compare_metrics({"loss": float("nan")}, {"loss": 1.0}, rtol=1, atol=1)[0]


# --- promote / ls / prune / restore on real run stores -------------------------------------------


def _reference(clean_run, step):
    """Metrics of the clean reference run's own checkpoint at ``step`` (what the drill compares with)."""
    from certckpt.detect.drill import evaluate, make_model

    model = make_model()
    model.load_state_dict(certckpt.load(os.path.join(clean_run, f"step{step:06d}.safetensors"))["model"])
    return {str(step): evaluate(model)}


@pytest.mark.slow
def test_after_an_injected_fault_only_trusted_checkpoints_enter_the_vault_and_latest_good_restores(
    copy_run, drill_runs, tmp_path
):
    run, vault = copy_run("faulty"), str(tmp_path / "vault")
    done = promote(run, vault)
    assert [p.ckpt_id for p in done] == ["main@5", "main@10"] and all(p.written for p in done)
    for p in done:
        mode = os.stat(p.url).st_mode
        assert not mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH)  # read-only once published
        assert certckpt.verify(p.url).ok
    assert not [n for n in os.listdir(vault) if "certckpt-tmp" in n]  # no temp file left behind
    # the suspect checkpoint is refused, by name
    with pytest.raises(UntrustedCheckpointError, match=r"main@15 is suspect \(after-fault\)"):
        promote(run, vault, ckpts=["main@15"])
    # the vault certifies from its own evidence: latest-good there precedes the suspect interval (10, 20]
    status, good = find_latest_good(vault)
    assert good == "main@10" and status.entry(good).url == os.path.join(vault, "main@10.safetensors")
    assert [(d.interval, d.suspect_ranks) for d in status.certification.detections] == [((10, 20), (1,))]
    # promoting again is a no-op
    assert promote(run, vault) == []
    again = promote(run, vault, ckpts=["main@10"])
    assert [(p.ckpt_id, p.written) for p in again] == [("main@10", False)]
    # restore copies it back and verifies it
    r = restore(vault, "latest-good", str(tmp_path / "node") + "/")
    assert r.ckpt_id == "main@10" and r.nbytes == os.path.getsize(r.dest) and r.bytes_per_s > 0
    assert certckpt.load(r.dest)["step"] == 10
    # the drill: bytes, fingerprints, load, metrics against the clean run's checkpoint at the same step
    ref = _reference(drill_runs["clean"], 10)
    from certckpt.detect.drill import evaluate, make_model

    d = drill_restore(vault, model_factory=make_model, eval_fn=evaluate, reference=ref)
    assert d.outcome == "pass" and d.ckpt_id == "main@10" and d.step == 10 and d.recorded
    assert all(d.stages[s]["ok"] for s in ("bytes", "fingerprints", "load", "metrics"))
    assert d.time_to_model_s is not None and d.time_to_model_s <= d.seconds
    drills = Ledger(vault).snapshot().drills
    assert len(drills) == 1 and drills[0]["outcome"] == "pass" and drills[0]["ckpt_id"] == "main@10"


@pytest.mark.slow
def test_a_drill_says_which_stage_failed(copy_run, drill_runs, tmp_path):
    import torch

    from certckpt.detect.drill import evaluate, make_model

    run, vault = copy_run("clean"), str(tmp_path / "vault")
    promote(run, vault)
    ref = _reference(drill_runs["clean"], 30)
    # no reference: loads fine, but nothing says it is undamaged
    d = drill_restore(vault, model_factory=make_model, eval_fn=evaluate)
    assert d.outcome == "incomplete" and d.stages["load"]["ok"] and d.stages["metrics"]["ok"] is None
    # metrics off the reference: fails at "metrics" although bytes, fingerprints and load pass
    off = {"30": {"eval_loss": ref["30"]["eval_loss"] * 1.01}}
    d = drill_restore(vault, model_factory=make_model, eval_fn=evaluate, reference=off)
    assert d.outcome == "fail" and d.stages["load"]["ok"] and d.stages["metrics"]["ok"] is False
    assert "eval_loss" in d.stages["metrics"]["detail"]
    # a model that does not fit the state fails at "load"
    d = drill_restore(vault, model_factory=lambda: torch.nn.Linear(16, 8), eval_fn=evaluate, reference=ref)
    assert d.outcome == "fail" and d.stages["fingerprints"]["ok"] and d.stages["load"]["ok"] is False
    assert d.stages["metrics"]["ok"] is None
    outcomes = [x["outcome"] for x in Ledger(vault).snapshot().drills]
    assert sorted(outcomes) == ["fail", "fail", "incomplete"]


@pytest.mark.slow
def test_write_once_different_content_under_a_vaulted_name_is_refused_and_changes_nothing(copy_run, tmp_path):
    run, vault = copy_run("clean"), str(tmp_path / "vault")
    os.makedirs(vault)
    squatter = os.path.join(vault, "main@5.safetensors")
    certckpt.save({"x": __import__("torch").zeros(3)}, squatter)
    with open(squatter, "rb") as fh:
        before = fh.read()
    with pytest.raises(CheckpointExistsError, match="already holds different content"):
        promote(run, vault, ckpts=["main@5"])
    with open(squatter, "rb") as fh:
        assert fh.read() == before
    assert "main@5" not in Ledger(vault).snapshot().holdings  # never recorded as held
    # another run cannot share the vault: checkpoint ids are only unique within a run
    promote(run, vault, ckpts=["main@10"])
    other = copy_run("faulty")
    with pytest.raises(certckpt.CertckptError, match="use one vault prefix per run"):
        promote(other, vault)


@pytest.mark.slow
def test_prune_keeps_latest_good_is_a_dry_run_by_default_and_records_what_it_deletes(copy_run, tmp_path):
    run, vault = copy_run("clean"), str(tmp_path / "vault")
    promote(run, vault)
    files = sorted(os.listdir(vault))
    dry = prune(vault, KeepLatest(0))
    assert dry.plan.delete == ["main@5", "main@10", "main@15", "main@20", "main@25"]
    assert dry.plan.guarded == {"main@30": "latest-good"} and sorted(os.listdir(vault)) == files
    # keep-last 1 keeps main@30; keep-every 20 keeps the newest trusted in [0, 20) and [20, 40): 15 and 30
    done = prune(vault, KeepLatest(1) | KeepEvery(20), apply=True)
    assert done.deleted == ["main@5", "main@10", "main@20", "main@25"] and done.refused == {}
    assert sorted(n for n in os.listdir(vault) if n.endswith(".safetensors")) == [
        "main@15.safetensors",
        "main@30.safetensors",
    ]
    _, rows = holdings(vault)
    assert {r["ckpt_id"] for r in rows if r["pruned"]} == {"main@5", "main@10", "main@20", "main@25"}
    retired = Ledger(vault).snapshot().retired
    assert (
        set(retired) == {"main@5", "main@10", "main@20", "main@25"}
        and retired["main@5"]["policy"] == "keep-last 1 | keep-every 20 steps"
    )
    with pytest.raises(CheckpointNotFoundError, match="was pruned"):
        restore(vault, "main@10", str(tmp_path / "x.safetensors"))
    assert find_latest_good(vault)[1] == "main@30"


@pytest.mark.slow
def test_a_revocation_after_promotion_reaches_the_vault(copy_run, tmp_path):
    run, vault = copy_run("clean"), str(tmp_path / "vault")
    promote(run, vault)
    Ledger(run).revoke("main@25", reason="bad data shard found later", by="alice")
    promote(run, vault)  # mirrors the revocation
    status, good = find_latest_good(vault)
    assert good == "main@20"
    assert status.certification.verdicts["main@30"].reasons == ("tainted-parent",)
    with pytest.raises(UntrustedCheckpointError, match="revoked"):
        restore(vault, "main@25", str(tmp_path / "r.safetensors"))
    r = restore(vault, "main@25", str(tmp_path / "r.safetensors"), allow_suspect=True)
    assert certckpt.verify(r.dest).ok


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["memory", "file"])
def test_fsspec_url_vaults_promote_restore_and_drill(scheme, copy_run, drill_runs, memroot, tmp_path):
    from certckpt.detect.drill import evaluate, make_model

    base = memroot if scheme == "memory" else f"file://{tmp_path}"
    run, vault = copy_run("faulty"), f"{base}/vault"
    done = promote(run, vault)
    assert [p.ckpt_id for p in done] == ["main@5", "main@10"]
    assert find_latest_good(vault)[1] == "main@10"
    r = restore(vault, "latest-good", f"{base}/restored/main@10.safetensors")
    assert certckpt.verify(r.dest).ok and r.nbytes > 0
    with pytest.raises(CheckpointExistsError):  # a different file under the restored name is never overwritten
        restore(vault, "main@5", r.dest)
    d = drill_restore(vault, model_factory=make_model, eval_fn=evaluate, reference=_reference(drill_runs["clean"], 10))
    assert d.outcome == "pass" and d.ckpt_id == "main@10" and len(Ledger(vault).snapshot().drills) == 1


def _promote_in_process(args):
    run, vault = args
    from certckpt.vault import promote as p

    return [(x.ckpt_id, x.written) for x in p(run, vault, ckpts=["main@10"])]


@pytest.mark.slow
def test_eight_concurrent_promoters_write_once(copy_run, tmp_path):
    import multiprocessing as mp

    run, vault = copy_run("clean"), str(tmp_path / "vault")
    with mp.get_context("spawn").Pool(8) as pool:
        results = pool.map(_promote_in_process, [(run, vault)] * 8)
    assert all(r[0][0] == "main@10" for r in results)
    assert sum(r[0][1] for r in results) == 1  # exactly one copy written, the others found it identical
    assert [n for n in os.listdir(vault) if n.endswith(".safetensors")] == ["main@10.safetensors"]
    assert list(Ledger(vault).snapshot().holdings) == ["main@10"]
    assert certckpt.verify(os.path.join(vault, "main@10.safetensors"), deep=True).ok


# --- the command line ----------------------------------------------------------------------------


def cli(*args, env=None):
    return subprocess.run([console_script("certckpt"), *args], capture_output=True, text=True, timeout=120, env=env)


@pytest.mark.slow
def test_cli_vault_promote_ls_prune_restore_and_drill(copy_run, drill_runs, tmp_path):
    run, vault = copy_run("faulty"), str(tmp_path / "vault")
    r = cli("vault", "promote", run, vault)
    assert r.returncode == 0, r.stderr
    assert (
        "main@5" in r.stdout and "main@10" in r.stdout and "copied, verified" in r.stdout and "main@15" not in r.stdout
    )
    r = cli("vault", "promote", run, vault, "--ckpt", "main@15")
    assert r.returncode == 1 and r.stderr.count("\n") == 1 and "suspect" in r.stderr and "Traceback" not in r.stderr
    r = cli("vault", "ls", vault, "--json")
    doc = json.loads(r.stdout)
    assert (
        r.returncode == 0
        and doc["latest_good"] == "main@10"
        and [c["ckpt_id"] for c in doc["checkpoints"]] == ["main@5", "main@10"]
    )
    r = cli("latest-good", vault)
    assert r.returncode == 0 and r.stdout.strip() == os.path.join(vault, "main@10.safetensors")
    # the training job opened an incident for the detection: nothing is deleted while it is open
    r = cli("vault", "prune", vault, "--keep-last", "0", "--apply")
    assert r.returncode == 0 and "incident(s) open (inc-main-20-replay): nothing is deleted" in r.stdout
    assert os.path.exists(os.path.join(vault, "main@5.safetensors"))
    r = cli("vault", "prune", vault)
    assert r.returncode == 2 and "say what to keep" in r.stderr
    clean_vault = str(tmp_path / "clean-vault")
    assert cli("vault", "promote", copy_run("clean"), clean_vault).returncode == 0
    r = cli("vault", "prune", clean_vault, "--keep-last", "1")
    assert r.returncode == 0 and "would delete" in r.stdout and "dry run: pass --apply to delete 5" in r.stdout
    r = cli("vault", "prune", clean_vault, "--keep-last", "0", "--apply", "--json")
    doc = json.loads(r.stdout)
    assert r.returncode == 0 and doc["deleted"] == ["main@5", "main@10", "main@15", "main@20", "main@25"]
    assert doc["guarded"] == {"main@30": "latest-good"}
    dest = tmp_path / "node"
    dest.mkdir()
    r = cli("vault", "restore", vault, "latest-good", str(dest))
    assert r.returncode == 0 and "main@10 -> " in r.stdout and "MB/s" in r.stdout
    assert (dest / "main@10.safetensors").exists()
    r = cli("vault", "restore", vault, "main@99", str(dest))
    assert r.returncode == 2 and "holds no checkpoint 'main@99'" in r.stderr
    ref = tmp_path / "ref.json"
    ref.write_text(json.dumps(_reference(drill_runs["clean"], 10)))
    from certckpt.detect.drill import evaluate, make_model
    from certckpt.detect.launch import importable

    (model, _), (evaluation, _) = importable(make_model), importable(evaluate)  # "certckpt.detect.drill:make_model"
    args = ["drill", "restore", vault, "--model", model, "--eval", evaluation]
    r = cli(*args, "--reference", str(ref))
    assert r.returncode == 0 and "outcome: PASS" in r.stdout
    for stage in ("bytes", "fingerprints", "load", "metrics"):
        assert any(line.split()[:2] == [stage, "pass"] for line in r.stdout.splitlines()), stage
    r = cli(*args, "--json")
    assert r.returncode == 1 and json.loads(r.stdout)["outcome"] == "incomplete"
    r = cli("drill", "restore", vault, "--model", "no.such.module:f", "--eval", evaluation)
    assert r.returncode == 2 and "cannot import no.such.module" in r.stderr


def test_cli_vault_errors_are_one_line(tmp_path):
    r = cli("vault", "ls", str(tmp_path / "nope"))
    assert (
        r.returncode == 2 and r.stderr.strip() == f"certckpt: {tmp_path / 'nope'}: no such vault (directory not found)"
    )
    r = cli("vault", "promote", str(tmp_path / "norun"), str(tmp_path / "v"))
    assert r.returncode == 2 and "no such run store" in r.stderr and r.stderr.count("\n") == 1
    (tmp_path / "empty-run").mkdir()
    r = cli("vault", "promote", str(tmp_path / "empty-run"), str(tmp_path / "v"))
    assert r.returncode == 0 and "nothing to promote: no checkpoint of" in r.stdout and "trusted yet" in r.stdout
    r = cli("vault", "promote", str(tmp_path / "norun"), "s3x://bucket/v")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


def test_vault_modules_import_without_torch():
    code = "import sys, certckpt.vault, certckpt_cli.main; assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.mark.slow
def test_a_damaged_source_never_reaches_the_vault(copy_run, tmp_path):
    from certckpt.errors import CorruptCheckpointError

    run, vault = copy_run("faulty"), str(tmp_path / "vault")
    src = os.path.join(run, "step000005.safetensors")
    with open(src, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        b = f.read(1)
        f.seek(-3, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(CorruptCheckpointError, match="nothing was published"):
        promote(run, vault, ckpts=["main@5"])
    assert not [n for n in os.listdir(vault) if n.endswith(".safetensors") or "certckpt-tmp" in n]
    assert "main@5" not in Ledger(vault).snapshot().holdings
