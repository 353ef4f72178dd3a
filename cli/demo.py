"""``certckpt demo``: train a small model, save certified checkpoints, verify them, show a tamper caught.

A later issue grows this into the full multi-rank demo (fault injection, verdicts, vault).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable


def run_demo(directory: str, *, echo: Callable[[str], None] = print, steps: int = 30, every: int = 10) -> dict:
    """Run the demo in ``directory``; returns what it produced (paths and verification outcomes)."""
    import torch

    import certckpt

    os.makedirs(directory, exist_ok=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=10, gamma=0.5)
    x, y = torch.randn(256, 32), torch.randn(256, 8)
    saved = []
    echo(f"training a {sum(p.numel() for p in model.parameters())}-parameter MLP for {steps} steps, checkpoint every {every}")
    for step in range(1, steps + 1):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % every == 0:
            path = os.path.join(directory, f"step{step:06d}.safetensors")
            state = {"model": model.state_dict(), "optim": opt.state_dict(), "sched": sched.state_dict(),
                     "rng": torch.get_rng_state(), "step": step, "loss": loss.item()}
            res = certckpt.save(state, path, step=step, run="demo", overwrite=True)
            report = certckpt.verify(path, deep=True)
            saved.append({"path": path, "ok": report.ok, "state_fp": res.state_fp})
            echo(f"  step {step:3d}  loss {loss.item():.4f}  saved {path} ({res.nbytes} bytes, state fp {res.state_fp})"
                 f"  verify: {'OK' if report.ok else 'FAILED'}")

    restored = certckpt.load(saved[-1]["path"])
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), restored["model"].values()))
    echo(f"reloaded {saved[-1]['path']}: weights identical: {same}")

    tampered = os.path.join(directory, "tampered.safetensors")
    shutil.copyfile(saved[-1]["path"], tampered)
    with open(tampered, "r+b") as f:
        f.seek(-5, os.SEEK_END)
        b = f.read(1)
        f.seek(-5, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x01]))
    report = certckpt.verify(tampered)
    echo(f"flipped one bit of {tampered}: verify {'OK (!)' if report.ok else 'FAILED as it should'}")
    for p in report.problems:
        echo(f"  {p.message}")
    echo(f"next: certckpt inspect {saved[-1]['path']}  |  certckpt verify {tampered}")
    return {"saved": saved, "reload_identical": same, "tamper_detected": not report.ok, "tampered": tampered}
