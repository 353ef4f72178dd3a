#!/usr/bin/env bash
# The one device call of a session lent a GPU (issue 15): the CUDA tests, then bench_gpu.py, all
# output under $OUT. The device machine has torch with CUDA and Triton and no network; whatever else
# certckpt and its tests import comes from a wheelhouse made here and carried along:
#
#   pip download --only-binary=:all: --dest .gpu-wheels xxhash click fsspec safetensors pytest hypothesis
#   echo /.gpu-wheels/ >> .git/info/exclude
#   run(command="bash benchmarks/gpu_session.sh", carry=[".gpu-wheels"], timeout_s=540)
#
# GPU_SESSION_QUICK=1 shrinks the benchmark (a smoke run; with GPU_SESSION_DEVICE=cpu it runs anywhere).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/bench-out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ -d .gpu-wheels ]; then
    python -m pip install -q --no-index --find-links .gpu-wheels xxhash click fsspec safetensors pytest hypothesis \
        2>&1 | tail -3
fi
python - <<'PY' 2>&1 | tee "$OUT/env.txt"
import torch
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
try:
    import triton
    print("triton", triton.__version__)
except Exception as e:
    print("triton missing:", e)
PY
# the tests that only run with CUDA (they skip without), with the CPU tests of the same files around them
timeout 240 python -m pytest -q -p no:cacheprovider -x \
    tests/test_fused.py tests/test_staging.py tests/test_digest.py tests/test_fingerprint.py \
    tests/test_detect_unit.py tests/test_roundtrip.py -k "cuda or gpu or fused or staging" \
    2>&1 | tee "$OUT/pytest-cuda.txt" | tail -15
device="${GPU_SESSION_DEVICE:-cuda}"
if [ "${GPU_SESSION_QUICK:-0}" = 1 ]; then
    timeout 420 python benchmarks/bench_gpu.py --quick --device "$device" --out "$OUT" 2>&1 | tail -40
else
    timeout 420 python benchmarks/bench_gpu.py --state-gib 3 --fp-gib 4 --device "$device" --out "$OUT" 2>&1 | tail -40
fi
