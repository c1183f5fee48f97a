"""Check a Hugging Face model directory before any work uses it: its config, its tokenizer
files and its weight files are there and readable, and (``nonfinite_weights``) its weights
are finite.

What transformers needs to load a directory: ``config.json``; a tokenizer, which without
``tokenizer.json`` it tries to build from a slow tokenizer's files and, missing those, fails
with "install sentencepiece or tiktoken" (``tokenization_utils_fast``); and the weights, one
``model.safetensors`` or the shards a ``model.safetensors.index.json`` lists (or PyTorch's
``pytorch_model.bin`` files). The checks read the safetensors headers only; the finiteness
check streams the tensors one at a time (memory: one tensor).
"""

from __future__ import annotations

import json
from pathlib import Path

TOKENIZER_FILE_SETS: tuple[tuple[str, ...], ...] = (
    ("tokenizer.json",),
    ("tokenizer.model",),
    ("vocab.json", "merges.txt"),
    ("tiktoken.model",),
)
"""Each set is enough for transformers to build the tokenizer (fast tokenizer file,
sentencepiece model, byte-level BPE vocabulary and merges, tiktoken file)."""

WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def model_dir_problems(path: str | Path) -> list[str]:
    """What keeps ``path`` from loading as a Hugging Face model (each problem names the file
    and the fix); empty when none."""
    path = Path(path)
    if not path.is_dir():
        return [f"{path} is not a directory (a Hugging Face model directory is expected)"]
    problems = []
    config = path / "config.json"
    if not config.is_file():
        problems.append(f"{path} has no config.json: not a Hugging Face model directory")
    else:
        try:
            json.loads(config.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            problems.append(f"{config} is not readable JSON ({exc})")
    if not any(all((path / name).is_file() for name in names) for names in TOKENIZER_FILE_SETS):
        wanted = " or ".join(" + ".join(names) for names in TOKENIZER_FILE_SETS)
        problems.append(
            f"{path} has no tokenizer files ({wanted}); save the tokenizer of the model it "
            "was trained from into it (tokenizer.save_pretrained)"
        )
    problems += _weight_problems(path)
    return problems


def weight_files(path: Path) -> list[Path]:
    """The weight files of a model directory: the shards its index lists, or the one file."""
    for index_name in WEIGHT_INDEXES:
        index = path / index_name
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            return [path / shard for shard in shards]
    return [path / name for name in WEIGHT_FILES if (path / name).is_file()]


def _weight_problems(path: Path) -> list[str]:
    try:
        files = weight_files(path)
    except (OSError, ValueError, KeyError, AttributeError) as exc:
        return [f"{path}: its weight index is not readable ({type(exc).__name__}: {exc})"]
    if not files:
        wanted = " or ".join(WEIGHT_FILES + WEIGHT_INDEXES)
        return [f"{path} has no weights ({wanted})"]
    problems = []
    for file in files:
        if not file.is_file():
            problems.append(f"{file} is missing (listed in {path.name}'s weight index)")
        elif file.suffix == ".safetensors":
            problem = _safetensors_header_problem(file)
            if problem:
                problems.append(problem)
    return problems


def _safetensors_header_problem(file: Path) -> str | None:
    from safetensors import safe_open

    try:
        with safe_open(str(file), framework="pt") as handle:
            handle.keys()
    except Exception as exc:  # SafetensorError and OSError: a truncated or foreign file
        return f"{file} is not a readable safetensors file ({type(exc).__name__}: {exc})"
    return None


def nonfinite_weights(path: str | Path) -> str | None:
    """The first weight of a model directory holding NaN or infinite values, named with its
    file and count; None when every weight is finite (safetensors files are streamed, one
    tensor at a time; other formats are not checked)."""
    import torch
    from safetensors import safe_open

    for file in weight_files(Path(path)):
        if file.suffix != ".safetensors":
            continue
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                tensor = handle.get_tensor(name)
                if not tensor.is_floating_point():
                    continue
                bad = int((~torch.isfinite(tensor)).sum())
                if bad:
                    return f"{file}: {name} has {bad} of {tensor.numel()} values NaN or infinite"
    return None
