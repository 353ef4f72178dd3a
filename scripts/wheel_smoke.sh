#!/usr/bin/env bash
# Build the wheel, install it (not editable) into a fresh venv, and use it from outside the checkout:
# catches a package the wheel leaves out, which an editable install hides.
#   bash scripts/wheel_smoke.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
rm -rf build  # setuptools would reuse a stale build/lib (modules since removed)
"$PY" -m pip wheel --disable-pip-version-check -q --no-deps -w "$work/dist" .
"$PY" -m venv "$work/venv"
vpip() { "$work/venv/bin/python" -m pip install --disable-pip-version-check -q "$@"; }
vpip torch==2.13.0          # the CPU build, from local disk; an unpinned torch would pull CUDA
vpip "$work"/dist/certckpt-*.whl
cd "$work"                   # away from the checkout: only the installed wheel can be imported
"$work/venv/bin/certckpt" --help >/dev/null
"$work/venv/bin/python" - <<'PY'
import os, sys, torch
import certckpt, certckpt.detect.auditor, certckpt.vault, certckpt.ops.report, certckpt_cli.main
assert "site-packages" in certckpt.__file__, certckpt.__file__
state = {"model": {"w": torch.arange(12.0).reshape(3, 4)}, "step": 7}
certckpt.save(state, "smoke.safetensors", step=7, run="smoke")
assert certckpt.verify("smoke.safetensors").ok
back = certckpt.load("smoke.safetensors")
assert torch.equal(back["model"]["w"], state["model"]["w"]) and back["step"] == 7
print(f"wheel smoke: certckpt {certckpt.__version__} from {os.path.dirname(certckpt.__file__)}")
PY
"$work/venv/bin/certckpt" verify smoke.safetensors
