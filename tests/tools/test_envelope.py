"""certckpt envelope: the premium / share / floor arithmetic, the gate, the report, and real sweeps.

The pure tests use hand-computed numbers. The slow ones run real 3-rank gloo sweeps through the CLI
(a single tiny shape each, a few seconds), one with the built-in model and one with this module's
``user_factory`` plugged in as ``--model tests.tools.test_envelope:user_factory`` (``USER_MODEL``).
"""

from __future__ import annotations

import json
import math
import pathlib
import sys

import pytest
from click.testing import CliRunner

from certckpt.detect.launch import importable
from certckpt.errors import ConfigurationError, MissingDependencyError
from certckpt.ops.planner import read_policy
from certckpt.tools.envelope import (
    EnvelopeConfig,
    build_report,
    exit_code,
    figures,
    format_table,
    over_budget,
    parse_int_list,
    plot,
    premium_se,
    require_matplotlib,
    resolve_model,
    trimmed_mean,
)
from certckpt_cli.main import main
from tests.support.helpers import ROOT

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


# --- a user model, plugged in as MODULE:FACTORY by the slow test (imported in the rank processes) --


def user_factory():
    """A per-position MLP regression: (model, batch_fn, loss_fn) as `--model` expects."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    def batch_fn(rank, step, seq_len, micro_batch):
        g = torch.Generator().manual_seed(rank * 7919 + step)
        x = torch.randn(micro_batch, seq_len, 8, generator=g)
        return x, x[..., :1].sin()

    def loss_fn(m, batch):
        return F.mse_loss(m(batch[0]), batch[1])

    return model, batch_fn, loss_fn


USER_PARAMS = 8 * 16 + 16 + 16 * 1 + 1
USER_MODEL, _ = importable(user_factory)  # what --model takes: "tests.tools.test_envelope:user_factory"


# --- the arithmetic ------------------------------------------------------------------------------


def test_figures_hand_computed():
    # P 100 ms, N 102 ms, A 160 ms, C 8 ms, F 60 ms, K 10:
    # T = 102 + (160 - 102) / 10 = 107.8 ms; premium 7.8 / 100 = 0.078
    # parts: nonfinite (102-100)/100 = 0.02; consensus 8/10/100 = 0.008; replay (160-102-8)/10/100 = 0.05
    f = figures(plain_s=0.100, nonaudit_s=0.102, audit_s=0.160, consensus_s=0.008, fb_s=0.060, audit_every=10)
    assert f["plain_s"] == 0.100
    assert f["audited_s"] == pytest.approx(0.1078)
    assert f["premium"] == pytest.approx(0.078)
    assert f["premium_parts"] == pytest.approx({"nonfinite": 0.02, "consensus": 0.008, "replay": 0.05})
    assert sum(f["premium_parts"].values()) == pytest.approx(f["premium"])
    assert f["shares"] == pytest.approx({"nonfinite": 0.02 / 0.078, "consensus": 0.008 / 0.078, "replay": 0.05 / 0.078})
    assert sum(f["shares"].values()) == pytest.approx(1.0)
    # replay floor: forward+backward share of a plain step (60/100) over K
    assert f["replay_floor"] == pytest.approx(0.06)


def test_figures_k100_and_consistency():
    # Same step times, K 100: T = 102 + 58/100 = 102.58 ms; premium 0.0258; floor 0.006
    f = figures(plain_s=0.100, nonaudit_s=0.102, audit_s=0.160, consensus_s=0.008, fb_s=0.060, audit_every=100)
    assert f["audited_s"] == pytest.approx(0.10258)
    assert f["premium"] == pytest.approx((f["audited_s"] - f["plain_s"]) / f["plain_s"])
    assert f["premium"] == pytest.approx(0.0258)
    assert f["premium_parts"]["replay"] == pytest.approx(0.005)
    assert f["premium_parts"]["consensus"] == pytest.approx(0.0008)
    assert f["replay_floor"] == pytest.approx(0.006)


def test_figures_take_a_negative_audit_estimate_as_noise():
    # A is estimated by a difference of two timed blocks; CI once measured A = -2.5 ms on a tiny model
    f = figures(plain_s=0.005, nonaudit_s=0.005, audit_s=-0.0025, consensus_s=0.001, fb_s=0.003, audit_every=10)
    assert f["audited_s"] == pytest.approx(0.005 - 0.00075)
    assert f["premium"] == pytest.approx(-0.15)
    assert f["shares"] is None


def test_figures_no_shares_without_a_premium():
    # Audited faster than plain (noise): premium -0.01, shares mean nothing
    f = figures(plain_s=0.100, nonaudit_s=0.098, audit_s=0.108, consensus_s=0.001, fb_s=0.05, audit_every=10)
    assert f["audited_s"] == pytest.approx(0.099)
    assert f["premium"] == pytest.approx(-0.01)
    assert f["shares"] is None
    assert sum(f["premium_parts"].values()) == pytest.approx(-0.01)


@pytest.mark.parametrize(
    "bad",
    [
        {"plain_s": 0.0},
        {"plain_s": -1.0},
        {"audit_s": float("nan")},
        {"audit_s": float("inf")},
        {"nonaudit_s": -0.001},
        {"fb_s": -0.001},
        {"consensus_s": -0.1},
        {"audit_every": 0},
        {"audit_every": True},
        {"audit_every": 2.5},
    ],
)
def test_figures_rejects_bad_input(bad):
    args = {
        "plain_s": 0.1,
        "nonaudit_s": 0.1,
        "audit_s": 0.2,
        "consensus_s": 0.0,
        "fb_s": 0.05,
        "audit_every": 10,
    } | bad
    with pytest.raises(ConfigurationError):
        figures(**args)


def test_premium_se_paired_hand_computed():
    # K 2: D_i = N_i/2 + A_i/2 - P_i = [0.5 + 1.0 - 1.0, 0.6 + 1.0 - 1.0] = [0.5, 0.6]
    # stdev(D) = 0.0707107; / sqrt(2) = 0.05; / mean(P) = 1.0 -> 0.05
    se = premium_se(plain=[1.0, 1.0], nonaudit=[1.0, 1.2], audit=[2.0, 2.0], audit_every=2)
    assert se == pytest.approx(0.05)
    # a constant offset between trials (load drift shared by the pair) does not count as noise
    assert premium_se(plain=[1.0, 2.0], nonaudit=[1.1, 2.1], audit=[1.1, 2.1], audit_every=10) == pytest.approx(
        0.0, abs=1e-12
    )
    assert premium_se(plain=[1.0], nonaudit=[1.0], audit=[1.0], audit_every=10) is None


def test_trimmed_mean():
    xs = [10, 11, 12, 13, 14, 15, 16, 17, 18, 1000]  # 10 values: drop 1 at each end
    assert trimmed_mean(xs) == pytest.approx(sum(range(11, 19)) / 8)
    assert trimmed_mean([3.0, 1.0, 2.0]) == pytest.approx(2.0)  # fewer than 10: the plain mean
    assert trimmed_mean(list(range(20)), 0.25) == pytest.approx(9.5)
    with pytest.raises(ConfigurationError):
        trimmed_mean([])


def _combo(seq, mb, k, premium):
    return {"seq_len": seq, "micro_batch": mb, "audit_every": k, "premium": premium}


def test_gate():
    combos = [
        _combo(128, 1, 10, 0.08),
        _combo(128, 1, 100, 0.05),
        _combo(512, 4, 10, 0.051),
        _combo(512, 4, 100, -0.01),
    ]
    over = over_budget(combos, 0.05)
    # strictly greater: 0.05 itself is within budget
    assert [(c["seq_len"], c["micro_batch"], c["audit_every"]) for c in over] == [(128, 1, 10), (512, 4, 10)]
    assert exit_code({"over_budget": over}) == 1
    assert exit_code({"over_budget": over_budget(combos, 0.1)}) == 0
    assert len(over_budget(combos, -1.0)) == 4
    assert over_budget([], 0.0) == []


def test_parse_int_list():
    assert parse_int_list("128,512, 2048", "--seq-lens") == (128, 512, 2048)
    assert parse_int_list("10", "--audit-every", low=2) == (10,)
    for bad in ("", "a,b", "1,,2", "0", "4,4", "1.5"):
        with pytest.raises(ConfigurationError):
            parse_int_list(bad, "--x")
    with pytest.raises(ConfigurationError, match=">= 2"):
        parse_int_list("1,10", "--audit-every", low=2)


def test_config_validation():
    with pytest.raises(ConfigurationError, match="K must be >= 2"):
        EnvelopeConfig(audit_every=(1, 10))
    with pytest.raises(ConfigurationError, match="nccl"):
        EnvelopeConfig(backend="nccl", device="cpu")
    with pytest.raises(ConfigurationError):
        EnvelopeConfig(max_premium=float("inf"))
    assert EnvelopeConfig(seq_lens=(8, 16), micro_batches=(1, 2)).shapes == [(8, 1), (8, 2), (16, 1), (16, 2)]


def _synthetic_report(max_premium=0.05):
    """build_report over a hand-made rank-0 result: two shapes, K 10 and 100."""
    shapes = []
    for seq, p in ((64, 0.010), (256, 0.040)):
        combos = []
        for k in (10, 100):
            f = figures(
                plain_s=p, nonaudit_s=p * 1.01, audit_s=p * 2.0, consensus_s=p * 0.05, fb_s=p * 0.6, audit_every=k
            )
            combos.append({"seq_len": seq, "micro_batch": 1, "audit_every": k, **f, "premium_se": 0.01})
        shapes.append(
            {
                "seq_len": seq,
                "micro_batch": 1,
                "trials": 5,
                "warmup": 1,
                "block": 1,
                "mean_s": {},
                "untrimmed_mean_s": {},
                "combinations": combos,
            }
        )
    r0 = {"params": 123, "deterministic": True, "torch": "x", "torch_threads": 1, "shapes": shapes}
    return build_report(
        EnvelopeConfig(seq_lens=(64, 256), micro_batches=(1,), audit_every=(10, 100), max_premium=max_premium),
        r0,
        elapsed_s=1.0,
    )


def test_report_and_table():
    rep = _synthetic_report()
    # K 10: T = 1.01p + (2 - 1.01)p/10 = 1.109p -> +10.9% (over); K 100: 1.0199p -> +1.99% (within)
    assert [round(c["premium"], 4) for c in rep["combinations"]] == [0.109, 0.0199, 0.109, 0.0199]
    assert [c["over_budget"] for c in rep["combinations"]] == [True, False, True, False]
    assert [(c["seq_len"], c["audit_every"]) for c in rep["over_budget"]] == [(64, 10), (256, 10)]
    assert exit_code(rep) == 1
    text = format_table(rep)
    assert "OVER BUDGET" in text and "seq 64 x mb 1, K 10" in text and "+10.9%" in text
    assert read_policy_from(rep) == pytest.approx(0.109)


def read_policy_from(rep):
    """What ``certckpt plan --from`` reads from this report: X, the largest premium."""
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "envelope.json")
        with open(path, "w", encoding="utf-8") as f:
            json.dump(rep, f)
        return read_policy(path).values["audit_overhead"]


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "env.png"
    plot(_synthetic_report(), out)
    assert out.read_bytes()[:8] == PNG_MAGIC
    with pytest.raises(ConfigurationError, match=".png"):
        plot(_synthetic_report(), tmp_path / "env.svg")


def test_plot_without_matplotlib(monkeypatch, tmp_path):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib...` now raises ImportError
    with pytest.raises(MissingDependencyError, match=r"pip install 'certckpt\[report\]'"):
        plot(_synthetic_report(), tmp_path / "env.png")
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(MissingDependencyError, match=r"certckpt\[report\]"):
        require_matplotlib()


def test_resolve_model():
    assert resolve_model("tiny-transformer") == ("tiny-transformer", None)
    assert resolve_model("gpt2-small") == ("gpt2-small", None)
    spec, extra = resolve_model(USER_MODEL)
    assert spec == USER_MODEL and extra is not None and pathlib.Path(extra).resolve() == ROOT
    for bad in ("nomodule_xyz:f", f"{__name__}:nothing", __name__, "a:b:c"):
        with pytest.raises(ConfigurationError):
            resolve_model(bad)


def test_gpt2_small_has_gpt2s_shape():
    import torch

    from certckpt.tools.envelope.models import load_factory

    with torch.device("meta"):  # the shape without 0.5 GB of weights; the GPU session trains it
        model, batch_fn, loss_fn = load_factory("gpt2-small")()
    assert model.head.weight is model.embed.weight  # tied, as GPT-2's
    assert 123e6 < sum(p.numel() for p in model.parameters()) < 125e6
    assert len(model.blocks) == 12 and model.embed.weight.shape == (50257, 768)


@pytest.mark.parametrize(
    "args",
    [
        ["--seq-lens", "abc"],
        ["--micro-batches", "0"],
        ["--audit-every", "1,10"],
        ["--ranks", "0"],
        ["--ranks", "many"],
        ["--model", "nomodule_xyz:factory"],
        ["--plot", "out.svg"],
        ["--backend", "nccl"],
        ["--bogus-flag"],
    ],
)
def test_usage_errors_are_one_line_exit_2(args):
    r = CliRunner().invoke(main, ["envelope", *args])
    assert r.exit_code == 2, r.output
    assert r.stdout == ""
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("certckpt: "), r.stderr
    assert "Traceback" not in r.stderr


def test_plot_missing_dependency_is_exit_2_before_running(monkeypatch, tmp_path):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "matplotlib" else real(name, *a))
    r = CliRunner().invoke(main, ["envelope", "--plot", str(tmp_path / "p.png")])
    assert r.exit_code == 2
    assert "pip install 'certckpt[report]'" in r.stderr and len(r.stderr.strip().splitlines()) == 1


# --- real sweeps (3 gloo ranks) --------------------------------------------------------------------


TINY = ["--seq-lens", "32", "--micro-batches", "1", "--audit-every", "10", "--steps", "3", "--seconds-per-shape", "0"]


def _check_shape(rep, *, model):
    assert set(rep) >= {"ranks", "model", "max_premium", "combinations", "over_budget"}
    assert rep["ranks"] == 3 and rep["model"] == model
    (c,) = rep["combinations"]
    assert set(c) >= {
        "seq_len",
        "micro_batch",
        "audit_every",
        "plain_s",
        "audited_s",
        "premium",
        "shares",
        "replay_floor",
        "over_budget",
    }
    assert (c["seq_len"], c["micro_batch"], c["audit_every"]) == (32, 1, 10)
    assert c["plain_s"] > 0 and c["audited_s"] > 0
    assert c["premium"] == pytest.approx((c["audited_s"] - c["plain_s"]) / c["plain_s"])
    assert sum(c["premium_parts"].values()) == pytest.approx(c["premium"])
    if c["shares"] is not None:
        assert set(c["shares"]) == {"replay", "consensus", "nonfinite"}
        assert sum(c["shares"].values()) == pytest.approx(1.0)
    assert 0 < c["replay_floor"] < 1
    assert math.isfinite(c["premium_se"])
    (m,) = rep["measurements"]
    assert m["trials"] >= 3 and m["block"] >= 1
    return c


@pytest.mark.slow
def test_cli_real_sweep_gate_fails_plot_and_plan(tmp_path):
    png = tmp_path / "envelope.png"
    r = CliRunner().invoke(main, ["envelope", *TINY, "--max-premium", "-1", "--json", "--plot", str(png)])
    assert r.exit_code == 1, r.output
    rep = json.loads(r.stdout)  # stdout is the JSON alone; progress went to stderr
    c = _check_shape(rep, model="tiny-transformer")
    assert rep["max_premium"] == -1 and c["over_budget"] is True
    assert rep["over_budget"] == [{"seq_len": 32, "micro_batch": 1, "audit_every": 10, "premium": c["premium"]}]
    assert "1/1  seq 32 x mb 1, K 10" in r.stderr and "over budget: seq 32 x mb 1, K 10" in r.stderr
    assert rep["deterministic_algorithms"] is True
    assert png.read_bytes()[:8] == PNG_MAGIC

    # certckpt plan --from reads the same file: its premium becomes the audit overhead X
    path = tmp_path / "envelope.json"
    path.write_text(r.stdout)
    got = CliRunner().invoke(
        main, ["plan", "--from", str(path), "--audit-every", "10", "--ckpt-every", "10", "--keep", "2", "--json"]
    )
    assert got.exit_code in (0, 1), got.output
    inputs = json.loads(got.stdout)["inputs"]
    assert inputs["audit_overhead"]["source"] == "from"
    # a tiny step usually pays the hook's fixed cost (a positive premium); when noise makes the
    # audited run time faster than plain, the planner takes the premium as 0, never as a negative cost
    assert inputs["audit_overhead"]["value"] == pytest.approx(max(c["premium"], 0.0))
    if c["premium"] < 0:
        assert "within noise; taken as 0" in read_policy(str(path)).notes["audit_overhead"]


@pytest.mark.slow
def test_cli_real_sweep_user_factory_within_budget():
    r = CliRunner().invoke(main, ["envelope", *TINY, "--model", USER_MODEL, "--max-premium", "1e9", "--json"])
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    _check_shape(rep, model=USER_MODEL)
    assert rep["params"] == USER_PARAMS and rep["over_budget"] == [] and exit_code(rep) == 0
    text = format_table(rep)
    assert "every premium within" in text and f"{USER_MODEL} ({USER_PARAMS:,} parameters)" in text
