#!/usr/bin/env bash
# Build the wheel, install it (not editable) into a fresh venv, and use it from outside the checkout:
# catches a package the wheel leaves out, which an editable install hides.
#   bash scripts/wheel_smoke.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
checkout=$(pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
rm -rf build  # setuptools would reuse a stale build/lib (modules since removed)
"$PY" -m pip wheel --disable-pip-version-check -q --no-deps -w "$work/dist" .
"$PY" -m venv "$work/venv"
# The venv sees the dependencies already installed for this interpreter (torch: reinstalling it
# unpacks ~800 MB again) through a .pth of plain paths, after its own site-packages. A plain path
# entry runs none of that directory's .pth files, so an editable install of this checkout stays
# invisible; the check below asserts that every certckpt module comes from the venv all the same.
"$PY" -c 'import sys; print("\n".join(p for p in sys.path if p.endswith(("site-packages", "dist-packages"))))' \
  >"$("$work/venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_deps.pth"
vpip() { "$work/venv/bin/python" -m pip install --disable-pip-version-check -q "$@"; }
vpip "$work"/dist/certckpt-*.whl  # its dependencies are satisfied by the paths above: nothing else installs
cd "$work"                   # away from the checkout: only the installed wheel can be imported
"$work/venv/bin/certckpt" --help >/dev/null
CHECKOUT="$checkout" "$work/venv/bin/python" - <<'PY'
import glob, os, sys, sysconfig, torch
import certckpt, certckpt.detect.auditor, certckpt.vault, certckpt.ops.report, certckpt_cli.main
site = sysconfig.get_paths()["purelib"]
assert certckpt.__file__.startswith(site + os.sep), certckpt.__file__
# every module of the checkout's packages is in the wheel...
def modules(root):
    return {os.path.relpath(p, root) for pkg in ("certckpt", "certckpt_cli")
            for p in glob.glob(os.path.join(root, pkg, "**", "*.py"), recursive=True)}
missing = modules(os.environ["CHECKOUT"]) - modules(site)
assert not missing, f"the wheel leaves out {sorted(missing)}"
# ...and every certckpt module imported so far came from it
stray = [m.__file__ for n, m in list(sys.modules.items())
         if n.split(".")[0] in ("certckpt", "certckpt_cli") and getattr(m, "__file__", None)
         and not m.__file__.startswith(site + os.sep)]
assert not stray, stray
state = {"model": {"w": torch.arange(12.0).reshape(3, 4)}, "step": 7}
certckpt.save(state, "smoke.safetensors", step=7, run="smoke")
assert certckpt.verify("smoke.safetensors").ok
back = certckpt.load("smoke.safetensors")
assert torch.equal(back["model"]["w"], state["model"]["w"]) and back["step"] == 7
print(f"wheel smoke: certckpt {certckpt.__version__} from {os.path.dirname(certckpt.__file__)}")
PY
"$work/venv/bin/certckpt" verify smoke.safetensors
