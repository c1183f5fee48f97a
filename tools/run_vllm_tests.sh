#!/usr/bin/env bash
# Run tests/vllm_engines in the vLLM CPU env, building it first if it is missing or out of date
# (tools/vllm_env.sh: ~3.5 min the first time). Extra arguments go to pytest.
#
# Env: VLLM_VENV (default .venv-vllm).
set -euo pipefail

cd "$(dirname "$0")/.."
export VLLM_VENV="${VLLM_VENV:-.venv-vllm}"
# vLLM's CPU build sizes its KV cache from host RAM minus the process's RSS unless told
export VLLM_CPU_KVCACHE_SPACE="${VLLM_CPU_KVCACHE_SPACE:-1}"

SECONDS=0
bash tools/vllm_env.sh
env_seconds=$SECONDS

set +e
"$VLLM_VENV/bin/python" -m pytest tests/vllm_engines -p no:cacheprovider "$@"
rc=$?
set -e
echo "run_vllm_tests.sh: env ${env_seconds}s, tests $((SECONDS - env_seconds))s, total ${SECONDS}s (pytest exit ${rc})"
if [ "$rc" -eq 5 ]; then
  echo "run_vllm_tests.sh: pytest collected no tests" >&2
fi
exit "$rc"
