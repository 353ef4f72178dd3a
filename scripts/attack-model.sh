#!/usr/bin/env bash
# The attacker model-checker (tests/trust/test_attack_model.py) for as long as you like: random sequences
# of a keyless attacker's file edits and an operator's commands over a world trained on 3 gloo ranks,
# four invariants checked after every step. CI runs a fixed, derandomized set; this explores.
#   bash scripts/attack-model.sh [EXAMPLES] [STEPS]     (default 200 sequences of up to 12 moves)
# A counterexample is printed with the moves that led to it (and a @reproduce_failure blob): make it a
# named test in tests/trust/test_trust_kernel.py before fixing it.
set -euo pipefail
cd "$(dirname "$0")/.."
export CERTCKPT_ATTACK_EXAMPLES="${1:-200}" CERTCKPT_ATTACK_STEPS="${2:-12}"
exec python3 -m pytest -q -x -s -p no:cacheprovider tests/trust/test_attack_model.py
