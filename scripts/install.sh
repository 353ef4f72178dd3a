#!/usr/bin/env bash
# Install certckpt from this checkout on a fresh machine (Python >= 3.10 and pip).
#   bash scripts/install.sh         the library and the `certckpt` command
#   bash scripts/install.sh test    plus what the test suite needs (pytest, hypothesis, s3fs, moto server,
#                                   SeaweedFS's weed binary, model-signing)
#   bash scripts/install.sh release plus what `certckpt release` needs (OpenSSF model-signing)
#   bash scripts/install.sh deepspeed  plus DeepSpeed 0.19.8 (certckpt.integrations.deepspeed; `test` installs it too)
#   bash scripts/install.sh torchtitan plus TorchTitan 0.3.0 (certckpt.integrations.torchtitan; `test` installs it too)
# Arguments after the first go to every `pip install` (CI passes --no-compile: see .ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
what=${1:-}
shift || true
pipi() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }
# An unpinned `torch` would pull a multi-GB CUDA build; take the CPU build first when torch is missing.
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
  echo "installing torch==2.13.0 (CPU build)" >&2
  pipi "$@" torch==2.13.0
fi
# DeepSpeed is an sdist whose build imports torch: build it against the torch above (--no-build-isolation;
# an isolated build pulls an unpinned multi-GB CUDA torch), with no C++/CUDA op compiled (DS_BUILD_OPS=0).
pipi_deepspeed() {
  pipi "$@" wheel
  DS_BUILD_OPS=0 pipi "$@" --no-build-isolation deepspeed==0.19.8
}
# TorchTitan's wheel requires wandb, tensorboard, datasets and more, and pins nightly torch builds in its
# docs: install it alone (--no-deps, pure Python), with the few modules it imports from the extra.
pipi_torchtitan() {
  pipi "$@" --no-deps torchtitan==0.3.0
}
if [ "$what" = "test" ]; then
  pipi "$@" -e ".[test]"
  pipi_deepspeed "$@"
  pipi_torchtitan "$@"
elif [ "$what" = "torchtitan" ]; then
  pipi "$@" -e ".[torchtitan]"
  pipi_torchtitan "$@"
elif [ "$what" = "deepspeed" ]; then
  pipi "$@" -e .
  pipi_deepspeed "$@"
elif [ "$what" = "release" ]; then
  pipi "$@" -e ".[release]"
else
  pipi "$@" -e .
fi
