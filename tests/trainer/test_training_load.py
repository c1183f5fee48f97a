"""The model a training step starts from, on 2 real DeepSpeed processes (gloo, CPU): SFT and GRPO
share one loader (``trainer.backends.loading``), the capacity check's SFT figure for the load
is what that loader does, and an MXFP4 checkpoint (the hub's gpt-oss) loads partitioned,
dequantized, and is saved back without a quantization config."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")

REPO = Path(__file__).resolve().parents[2]
WORLD = 2
LOADS = {
    "zero3": {"backend": "deepspeed", "zero_stage": 3},
    "zero2": {"backend": "deepspeed", "zero_stage": 2},
}

SCRIPT = textwrap.dedent(
    """
    import json
    import sys
    from pathlib import Path

    import torch
    from deepspeed import zero

    from trainer.backends import OptimConfig
    from trainer.backends.loading import load_training_model
    from trainer.distributed import barrier, init_distributed
    from trainer.zero3 import save_gathered

    model_dir, mxfp4_dir, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    loads = json.loads(sys.argv[4])
    info = init_distributed("cpu", 1)
    report = {}
    for name, optim in loads.items():
        model, ds_config = load_training_model(
            model_dir, torch.float32, OptimConfig(**optim), info, 1, 1
        )
        report[name] = {
            "held": sum(
                p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel()
                for p in model.parameters()
            ),
            "whole_left": [
                n for n, p in model.named_parameters() if hasattr(p, "ds_tensor") and p.numel()
            ],
            "parameters": len(list(model.parameters())),
            "ds_config": ds_config is not None,
        }
        del model
    # the hub's layout: experts as MXFP4 pairs, dequantized as they are read
    model, _ = load_training_model(
        mxfp4_dir, torch.float32, OptimConfig(**loads["zero3"]), info, 1, 1
    )
    originals = torch.load(out / "originals.pt")
    equal = {}
    for name, param in model.named_parameters():
        if name in originals:
            with zero.GatheredParameters([param]):
                equal[name] = torch.equal(param.detach(), originals[name].float())
    report["mxfp4_equal"] = equal
    save_gathered(model, out / "saved", model.config, torch.bfloat16, info.rank == 0)
    barrier(info)
    (out / f"rank{info.rank}.json").write_text(json.dumps(report))
    """
)


@pytest.fixture(scope="module")
def reports(tiny_model_dir, mxfp4_model, tmp_path_factory):
    mxfp4_dir, originals = mxfp4_model
    out = tmp_path_factory.mktemp("training_load")
    torch.save(originals, out / "originals.pt")
    script = out / "load_check.py"
    script.write_text(SCRIPT)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--nproc_per_node={WORLD}", str(script), str(tiny_model_dir), str(mxfp4_dir)]
    command += [str(out), json.dumps(LOADS)]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    subprocess.run(command, env=env, check=True, timeout=600)
    return out, [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


def _planned_sft_load(model_dir, optim: dict) -> tuple[float, set[str]]:
    """Parameters per rank that the capacity check's SFT estimate puts on a training rank at
    load (its weights term plus any whole-model load term), and the terms it used. Full
    fine-tuning: with LoRA the weights term also holds the adapter, which comes after the
    load."""
    from capacity.estimate import estimate_layout
    from capacity.model_spec import load_model_spec
    from trainer.capacity_check import sft_layout
    from trainer.sft.config import SFTConfig

    sft = SFTConfig.model_validate(
        {"optim": optim, "lora": {"r": 0}, "nproc": WORLD, "dtype": "float32", "device": "cpu"}
    )
    layout = sft_layout("tiny-cpu", sft, nodes=1, gpus_per_node=WORLD)
    training = estimate_layout(load_model_spec(model_dir), layout).resource("training_gpu")
    terms = {t.key: t.bytes.expected for t in training.terms}
    loaded = terms["weights"] + terms.get("whole_model_load", 0.0)
    return loaded / layout.weight_bytes, {k for k in terms if k in ("weights", "whole_model_load")}


@pytest.mark.parametrize("load", sorted(LOADS))
def test_the_capacity_checks_sft_load_is_what_the_loader_does(reports, tiny_model_dir, load):
    _, ranks = reports
    planned, used = _planned_sft_load(tiny_model_dir, LOADS[load])
    for report in ranks:
        held = report[load]["held"]
        # DeepSpeed pads each parameter's partition to a multiple of the world size
        padding = report[load]["parameters"] * (WORLD - 1)
        assert abs(held - planned) <= padding, (load, held, planned, used)
    if load == "zero3":  # partitioned: half the model on each rank, nothing left whole
        total = _planned_sft_load(tiny_model_dir, LOADS["zero2"])[0]
        assert math.isclose(planned, total / WORLD)
        assert all(not r["zero3"]["whole_left"] for r in ranks)
        assert used == {"weights"}


def test_the_partitioned_loader_dequantizes_mxfp4_experts(reports, mxfp4_model):
    _, originals = mxfp4_model
    _, ranks = reports
    for report in ranks:
        assert sorted(report["mxfp4_equal"]) == sorted(originals)
        assert all(report["mxfp4_equal"].values()), report["mxfp4_equal"]


def test_the_streamed_save_of_an_mxfp4_load_has_no_quantization_config(reports, mxfp4_model):
    from core.modeling import load_causal_lm

    out, _ = reports
    _, originals = mxfp4_model
    config = json.loads((out / "saved" / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "bfloat16"
    reloaded = load_causal_lm(out / "saved", torch.bfloat16).state_dict()
    for name, original in originals.items():
        assert torch.equal(reloaded[name], original), name


def test_a_model_directory_shows_its_mxfp4_pairs_as_matrices(mxfp4_model):
    from trainer.zero3 import gather_windows, model_entries, safetensors_entries

    mxfp4_dir, originals = mxfp4_model
    entries = model_entries(mxfp4_dir, torch.bfloat16)
    raw = safetensors_entries(mxfp4_dir)
    assert not any(n.endswith(("_blocks", "_scales")) for n in entries)
    assert len(raw) - len(entries) == len(originals)  # each pair became one matrix
    for name, original in originals.items():
        assert entries[name].shape == tuple(original.shape)
        assert torch.equal(entries[name].read(), original), name
    largest = max(math.prod(e.shape) for e in entries.values())
    assert gather_windows(mxfp4_dir)["stage3_max_live_parameters"] == largest
