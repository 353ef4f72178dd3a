"""Pure parts of the detection checks: attribution, consensus votes, events, fault perturbations."""

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from certckpt.detect import AuditEvent, Fault, JsonlSink, MemorySink, attribute_replay, consensus_verdict
from certckpt.detect.attribution import arbitration_plan, ring_pairs
from certckpt.detect.drill import expected_catch, matrix_cases
from certckpt.detect.inject import Injector, perturb_


def failed_pairs_for(world, faulty, *, persistent):
    """Which ring comparisons fail when `faulty` computes wrongly (always, or on its own step only)."""
    out = []
    for origin, replayer in ring_pairs(world):
        if origin == faulty or (persistent and replayer == faulty):
            out.append((origin, replayer))
    return out


@settings(max_examples=100, deadline=None)
@given(world=st.integers(3, 64), data=st.data())
def test_persistent_fault_is_named_by_both_comparisons(world, data):
    f = data.draw(st.integers(0, world - 1))
    failed = failed_pairs_for(world, f, persistent=True)
    assert arbitration_plan(world, failed) == []  # no arbitration needed
    assert attribute_replay(world, failed).suspects == (f,)


@settings(max_examples=100, deadline=None)
@given(world=st.integers(3, 64), data=st.data())
def test_one_time_fault_is_named_after_arbitration(world, data):
    f = data.draw(st.integers(0, world - 1))
    failed = failed_pairs_for(world, f, persistent=False)  # only f's own local gradients were wrong
    plan = arbitration_plan(world, failed)
    assert len(plan) == 1
    origin, replayer, arbiter = plan[0]
    assert arbiter not in (origin, replayer)
    # the arbiter's replay of f's batch agrees with the replayer, not with f's own gradients
    verdict = attribute_replay(world, failed, {(origin, replayer): "replayer"})
    assert verdict.suspects == (f,)
    # had the replayer been wrong instead, it would be named
    assert attribute_replay(world, failed, {(origin, replayer): "origin"}).suspects == (replayer,)
    unresolved = attribute_replay(world, failed, {(origin, replayer): "neither"})
    assert unresolved.suspects == () and "both candidates" in unresolved.notes[0]


def test_two_and_one_ranks_say_what_they_cannot_do():
    two = attribute_replay(2, [(0, 1), (1, 0)])
    assert two.suspects == () and "needs >= 3 ranks" in two.notes[0]
    one = attribute_replay(1, [(0, 0)])
    assert one.suspects == (0,) and "transient faults only" in one.notes[0]
    assert attribute_replay(5, []).suspects == ()


@settings(max_examples=100, deadline=None)
@given(world=st.integers(3, 16), params=st.integers(1, 8), data=st.data())
def test_consensus_names_the_minority_and_the_tensors(world, params, data):
    good = tuple(data.draw(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=params, max_size=params)))
    bad_rank = data.draw(st.integers(0, world - 1))
    col = data.draw(st.integers(0, params - 1))
    rows = [list(good) for _ in range(world)]
    rows[bad_rank][col] ^= 1
    v = consensus_verdict(rows)
    assert not v.agreed and v.majority == good and v.minority_ranks == (bad_rank,) and v.mismatched == (col,)
    assert consensus_verdict([list(good)] * world).agreed


def test_consensus_tie_names_nobody():
    v = consensus_verdict([[1, 2], [1, 3]])
    assert not v.agreed and v.majority is None and v.minority_ranks == (0, 1) and v.mismatched == (1,)


def test_events_validate_and_roundtrip_through_jsonl(tmp_path):
    with pytest.raises(ValueError, match="unknown audit event kind"):
        AuditEvent(run="r", branch="b", step=1, kind="bogus", outcome="pass", ranks=[0])
    ev = AuditEvent(
        run="r",
        branch="main",
        step=20,
        kind="replay",
        outcome="fail",
        ranks=[0, 1, 2],
        suspect_ranks=[1],
        details={"failed": [{"origin": 1, "replayer": 2}]},
        inventory={"1": {"host": "n1"}},
    )
    sink = JsonlSink(str(tmp_path / "ev" / "events.jsonl"))
    sink.emit(ev)
    sink.flush()
    sink.close()
    assert JsonlSink.read(str(tmp_path / "ev" / "events.jsonl")) == [ev]
    line = json.loads((tmp_path / "ev" / "events.jsonl").read_text())
    assert set(line) == {
        "run",
        "branch",
        "step",
        "kind",
        "outcome",
        "ranks",
        "suspect_ranks",
        "contained",
        "details",
        "inventory",
    }
    mem = MemorySink()
    mem.emit(ev)
    assert list(mem.events) == [ev] and ev.failed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_perturbations_change_exactly_one_element(dtype):
    t = torch.randn(50, generator=torch.Generator().manual_seed(7)).to(dtype)
    t[5] = 2.5  # the largest element, where a 1% bfloat16 change rounds away
    for fault in (
        Fault(kind="backward", rank=0, step=1, scale=0.01),
        Fault(kind="backward", rank=0, step=1, bit=3),
        Fault(kind="backward", rank=0, step=1, bit=8 * t.element_size() - 1),
    ):
        u = t.clone()
        perturb_(u, fault)
        assert int((u != t).sum()) == 1
    u = t.clone()
    perturb_(u, Fault(kind="non-finite", rank=0, step=1))
    assert int(torch.isnan(u).sum()) == 1


def test_fault_activity_and_validation():
    one = Fault(kind="forward", rank=1, step=5)
    assert one.active(5, "train") and not one.active(5, "replay") and not one.active(6, "train")
    pers = Fault(kind="forward", rank=1, step=5, persistent=True)
    assert pers.active(7, "replay") and not pers.active(4, "train")
    with pytest.raises(ValueError, match="fault kind"):
        Fault(kind="cosmic", rank=0, step=1)
    inj = Injector([one, Fault(kind="backward", rank=2, step=1)], rank=1)
    assert inj.faults == [one]  # each rank keeps only its own faults


def test_expected_matrix_is_what_the_design_says():
    cases = {(c["fault"], c["timing"]): c for c in matrix_cases(audit_every=10, ckpt_every=5) if "magnitude" not in c}
    exp = {k: expected_catch(c, audit_every=10, ckpt_every=5) for k, c in cases.items()}
    assert exp[("backward", "persistent")] == ("replay", 20)
    assert exp[("forward", "one-time-between-audits")] == (None, None)
    assert exp[("post-optimizer", "one-time-between-audits")] == ("consensus", 15)
    assert exp[("non-finite", "one-time-audit-step")] == ("nonfinite-pre", 20)


def _draws_after(state: dict[str, torch.Tensor], device: torch.device) -> torch.Tensor:
    from certckpt.detect.auditor import restore_rng

    restore_rng(state, device)
    return torch.rand(4, device=device)


def test_restore_rng_replays_the_draws_from_a_shipped_state():
    # A state that travelled as a tensor of another width (as a generic exchange may deliver it)
    # still restores exactly the draws the origin made.
    state = {"cpu": torch.get_rng_state()}
    first = torch.rand(4)
    shipped = {"cpu": state["cpu"].to(torch.int64)}
    assert torch.equal(_draws_after(shipped, torch.device("cpu")), first)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_restore_rng_accepts_states_that_arrive_on_the_gpu():
    # Under NCCL, and with gloo on a CUDA model, the neighbour's RNG states arrive on the GPU;
    # torch's setters take only a CPU ByteTensor (issue 15: every audited multi-GPU run died at step K).
    device = torch.device("cuda", 0)
    state = {"cpu": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(device)}
    first = torch.rand(4, device=device)
    shipped = {k: v.to(device) for k, v in state.items()}
    assert torch.equal(_draws_after(shipped, device), first)


def test_overflow_is_an_event_kind_the_certifier_leaves_alone():
    from certckpt.trust.certify import certify

    ev = AuditEvent(run="r", branch="main", step=3, kind="overflow", outcome="pass", ranks=[0, 1, 2], contained=True)
    assert AuditEvent.from_dict(json.loads(json.dumps(ev.to_dict()))) == ev
    assert certify([], [ev.to_dict()]).detections == []  # an overflow is never a detection


def test_consensus_buffers_leave_out_per_rank_statistics_only():
    from certckpt.detect.auditor import consensus_buffers

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bn = torch.nn.BatchNorm1d(4)
            self.frozen = torch.nn.BatchNorm1d(4, track_running_stats=False)
            self.register_buffer("table", torch.ones(3))
            self.register_buffer("ids", torch.arange(3))  # integer: out

    names, tensors = consensus_buffers(Net(), broadcast=True)
    assert names == ["table", "bn.running_mean", "bn.running_var"]
    assert all(t.is_floating_point() for t in tensors)
    # without DDP's broadcast each rank's BatchNorm statistics are its own: only the constant stays
    assert consensus_buffers(Net(), broadcast=False)[0] == ["table"]


def test_buffer_fault_perturbs_the_named_buffer_after_the_optimizer():
    net = torch.nn.BatchNorm1d(4)
    inj = Injector([Fault(kind="buffer", rank=0, step=2, scale=999.0, target="running_var")], rank=0)
    inj.install(net)
    named = list(net.named_buffers())
    inj.begin(1, "train")
    inj.after_optimizer_buffers(named)
    assert torch.equal(net.running_var, torch.ones(4))
    inj.begin(2, "train")
    inj.after_optimizer_buffers(named)
    assert float(net.running_var.max()) == 1999.0 and inj.fired == [("buffer", 2, "train")]


def test_sampled_audit_blocks_move_along_and_stay_inside_the_step():
    from types import SimpleNamespace

    from certckpt.detect import AuditOptions
    from certckpt.detect.auditor import Auditor

    def aud(k):
        return SimpleNamespace(options=AuditOptions(replay_micro_batches=k, audit_every=10))

    blocks = [Auditor._sample_block(aud(2), s, 5) for s in range(10, 40, 10)]
    assert all(0 <= a < b <= 5 and b - a == 2 for a, b in blocks)
    assert {i for a, b in blocks for i in range(a, b)} == set(range(5))  # every position in ceil(5/2) audits
    assert Auditor._sample_block(aud(None), 10, 5) is None
    assert Auditor._sample_block(aud(5), 10, 5) is None


def test_audit_options_are_one_typed_object_and_the_shorthand_builds_it():
    import dataclasses
    import inspect

    import pytest

    from certckpt.detect import AuditOptions, Auditor, AuditSession
    from certckpt.detect.options import Mode
    from certckpt.errors import ConfigurationError

    base = AuditOptions(audit_every=20, mode="tolerance")
    assert base.mode is Mode.TOLERANCE and base.mode == "tolerance"  # str enums: either spelling
    built = AuditOptions.build(base, clip_grad_norm=1.0)
    assert (built.audit_every, built.clip_grad_norm, built.mode) == (20, 1.0, Mode.TOLERANCE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        base.audit_every = 5  # type: ignore[misc]
    with pytest.raises(ConfigurationError, match="mode must be 'deterministic' or 'tolerance', got 'bogus'"):
        AuditOptions(mode="bogus")
    with pytest.raises(ConfigurationError, match="audit_every must be an int >= 1"):
        AuditOptions(audit_every=0)
    with pytest.raises(ConfigurationError, match="unknown audit option\\(s\\) audit_evry"):
        AuditOptions.build(audit_evry=10)
    from certckpt.detect import ShardedAuditSession
    from certckpt.detect.options import DDP_ONLY, SHARDED_ONLY, unused_problem

    for cls in (AuditSession, Auditor, ShardedAuditSession):  # the essentials, options, the shorthand
        assert len(inspect.signature(cls.__init__).parameters) - 1 <= 15, cls
    # an option a session does not read is refused by name, never ignored
    assert unused_problem(AuditOptions(clip_grad_norm=1.0), DDP_ONLY, "ShardedAuditSession") == (
        "ShardedAuditSession does not take clip_grad_norm"
    )
    assert unused_problem(AuditOptions(audit_updates=True), SHARDED_ONLY, "the DDP auditor") is not None
    assert unused_problem(AuditOptions(audit_every=3), DDP_ONLY + SHARDED_ONLY, "x") is None
