#!/usr/bin/env bash
# Run tests/megatron in the Python 3.12 Megatron env, building it first if it is missing
# (tools/megatron_env.sh: ~1.5-2 min and ~5 GB the first time). Extra arguments go to pytest:
#
#   bash tools/run_megatron_tests.sh            # the CPU tests (gpu/slow deselected)
#   bash tools/run_megatron_tests.sh -m gpu     # the unpatched GPU round trip (needs CUDA)
#
# Env: MEGATRON_VENV (default .venv-megatron).
set -euo pipefail

cd "$(dirname "$0")/.."
export MEGATRON_VENV="${MEGATRON_VENV:-.venv-megatron}"

SECONDS=0
bash tools/megatron_env.sh
env_seconds=$SECONDS

set +e
"$MEGATRON_VENV/bin/python" -m pytest tests/megatron "$@"
rc=$?
set -e
test_seconds=$((SECONDS - env_seconds))
echo "run_megatron_tests.sh: env ${env_seconds}s, tests ${test_seconds}s, total ${SECONDS}s (pytest exit ${rc})"
if [ "$rc" -eq 5 ]; then
  echo "run_megatron_tests.sh: pytest collected no tests" >&2
fi
exit "$rc"
