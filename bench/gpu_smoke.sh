#!/usr/bin/env bash
# The gpu-marked tests (Megatron, vLLM) in one script, for a machine with CUDA on which the
# environments are already built (the GPU and Megatron images). Installs nothing. Prints one
# line per test (PASS / FAIL / SKIP), then a summary; exits 1 if any test failed or was
# skipped (a skip means the machine lacks what the test checks), or no test passed.
# On a bare GPU machine (no network, no project environment) use bench/gpu_check.py instead.
#
#   bash bench/gpu_smoke.sh
#
# What it runs, each with `pytest -m gpu`:
#   megatron round trip  tests/megatron                         in $MEGATRON_PYTHON
#   megatron path        tests/trainer/test_megatron_gpu.py     in $MEGATRON_PYTHON
#   trainer on GPU       tests/trainer/test_gpu.py              in $PYTHON
# Environments it expects:
#   MEGATRON_PYTHON (default .venv-megatron/bin/python): Python 3.12, CUDA torch,
#     megatron-core 0.19 / megatron-bridge 0.6 and Transformer Engine (the GPU image), with
#     lingo-rl's dependencies (tools/megatron_env.sh --with-project, then TE).
#   PYTHON (default .venv/bin/python): lingo-rl[gpu,dev] with CUDA torch (vLLM, DeepSpeed).
# Env: SMOKE_OUT (default a temp dir) keeps the JUnit XML of each group.
set -uo pipefail

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-.venv/bin/python}"
MEGATRON_PYTHON="${MEGATRON_PYTHON:-.venv-megatron/bin/python}"
OUT="${SMOKE_OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
SECONDS=0
failed=0
passed=0
tests_passed=0

line() {  # STATUS NAME DETAIL
  printf '%-4s %s%s\n' "$1" "$2" "${3:+  ($3)}"
  case "$1" in FAIL | SKIP) failed=$((failed + 1)) ;; PASS) passed=$((passed + 1)) ;; esac
}

check_cuda() {  # NAME PYTHON
  local info
  if [ ! -x "$2" ]; then
    line FAIL "$1: cuda" "$2 not found; build that environment first"
    return 1
  fi
  if info="$("$2" -c 'import torch; assert torch.cuda.is_available(), "torch.cuda.is_available() is False"; print(torch.__version__, torch.cuda.get_device_name(0))' 2>&1)"; then
    line PASS "$1: cuda" "$info"
  else
    line FAIL "$1: cuda" "$(echo "$info" | tail -1)"
    return 1
  fi
}

run_group() {  # NAME PYTHON TEST_PATH
  local name="$1" python="$2" path="$3" xml="$OUT/$1.xml"
  "$python" -m pytest "$path" -m gpu -q -p no:cacheprovider --junitxml="$xml" >"$OUT/$name.log" 2>&1
  local rc=$?
  if [ ! -s "$xml" ]; then
    line FAIL "$name" "pytest exit $rc before any result; see $OUT/$name.log"
    return
  fi
  local results
  results="$("$python" - "$xml" <<'EOF'
import sys
import xml.etree.ElementTree as ET

for case in ET.parse(sys.argv[1]).getroot().iter("testcase"):
    name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
    status, detail = "PASS", f"{float(case.get('time', 0)):.1f}s"
    for tag, label in (("failure", "FAIL"), ("error", "FAIL"), ("skipped", "SKIP")):
        node = case.find(tag)
        if node is not None:
            message = (node.get("message") or node.text or "").strip().splitlines()
            status, detail = label, (message[0] if message else tag)[:200]
            break
    print(f"{status}\t{name}\t{detail}")
EOF
)"
  if [ -z "$results" ]; then
    line FAIL "$name" "no gpu-marked test collected in $path; see $OUT/$name.log"
    return
  fi
  while IFS=$'\t' read -r status test detail; do
    line "$status" "$test" "$detail"
    if [ "$status" = PASS ]; then tests_passed=$((tests_passed + 1)); fi
  done <<<"$results"
}

echo "gpu_smoke: $(date -u +%FT%TZ) on $(hostname); logs in $OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null \
  | sed 's/^/info nvidia-smi: /'
if check_cuda megatron "$MEGATRON_PYTHON"; then
  run_group megatron_round_trip "$MEGATRON_PYTHON" tests/megatron
  run_group megatron_path "$MEGATRON_PYTHON" tests/trainer/test_megatron_gpu.py
fi
if check_cuda trainer "$PYTHON"; then
  run_group trainer_gpu "$PYTHON" tests/trainer/test_gpu.py
fi
echo "gpu_smoke: ${passed} passed (${tests_passed} tests), ${failed} failed or skipped in ${SECONDS}s"
[ "$failed" -eq 0 ] && [ "$tests_passed" -gt 0 ]
