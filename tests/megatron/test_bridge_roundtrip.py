"""HF → Megatron (torch_dist) → HF with megatron-bridge, on tiny GPT-OSS models.

``trainer.megatron.bridge`` converts a HF directory to a Megatron distributed checkpoint,
computes next-token logits with the Megatron model, and exports the checkpoint back to HF.
In fp32 the exported tensors must equal the originals bit for bit, and the Megatron logits
must match the HF model's (eager attention, sliding window exercised by a prompt longer than
the window). On a CPU the same code runs with the test-only patches of ``cpu_patches`` (each
explained there); under ``@pytest.mark.gpu`` it runs unpatched on CUDA.

Needs Python >= 3.12 with megatron-core / megatron-bridge (``bash tools/run_megatron_tests.sh``);
elsewhere the megatron tests skip, saying why, and only the argument checks run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from convert_worker import layout_dir

from plan import ParallelSizes
from trainer.megatron import bridge
from trainer.megatron.layout import MegatronLayout

FP32 = MegatronLayout(params_dtype="fp32")

# megatron-core's own deprecation noise (ShardedTensor, tp_group=None, GPTModel → HybridModel)
pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning")

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
PROMPTS = [
    "How many minutes are there in three and a half hours?",
    "Réponds en français : combien de jours y a-t-il dans une semaine ?",
    # longer than the sliding window (32 tokens), so the windowed layer masks something
    " ".join(["Ich überlege, was der Nutzer braucht, und antworte kurz und klar."] * 6),
]
LOGITS_ATOL = {("cpu", "fp32"): 1e-5, ("cuda", "fp32"): 1e-3, ("cpu", "bf16"): 0.05}
LOGITS_ATOL[("cuda", "bf16")] = 0.05


def _hf_weights(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    weights: dict[str, torch.Tensor] = {}
    for shard in sorted(directory.glob("*.safetensors")):
        weights.update(load_file(shard))
    return weights


def _prompt_ids(hf_dir: Path) -> list[list[int]]:
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    ids = [tokenizer(p, add_special_tokens=False).input_ids for p in PROMPTS]
    window = AutoConfig.from_pretrained(hf_dir).sliding_window
    assert max(map(len, ids)) > window, "no prompt is longer than the sliding window"
    return ids


def _hf_logits(hf_dir: Path, ids: list[list[int]], dtype: torch.dtype) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype, attn_implementation="eager")
    model.eval()
    with torch.no_grad():
        return torch.stack([model(torch.tensor([x])).logits[0, -1].float() for x in ids])


def _as_dtype(hf_dir: Path, dtype: torch.dtype, out: Path) -> Path:
    """``hf_dir`` saved in ``dtype`` (with its tokenizer), as gpt-oss ships in bf16."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype).save_pretrained(out)
    AutoTokenizer.from_pretrained(hf_dir).save_pretrained(out)
    return out


def check_megatron_checkpoint(megatron_dir: Path) -> None:
    """The Megatron-LM / megatron-bridge layout: tracker file + iter_0000000 torch_dist."""
    assert (megatron_dir / bridge.TRACKER_FILE).read_text() == "0"
    iteration = megatron_dir / bridge.ITERATION_DIR
    assert (iteration / ".metadata").is_file()
    assert list(iteration.glob("*.distcp"))
    assert not list(megatron_dir.parent.glob(f".{megatron_dir.name}.converting"))


def check_logits(megatron_dir: Path, hf_dir: Path, dtype: str, device: str) -> float:
    """Megatron next-token logits vs the HF model's; returns the max |Δ|."""
    ids = _prompt_ids(hf_dir)
    megatron = bridge.megatron_next_token_logits(str(megatron_dir), str(hf_dir), ids)
    reference = _hf_logits(hf_dir, ids, bridge.DTYPES[dtype])
    assert megatron.dtype == torch.float32
    assert megatron.shape == reference.shape
    max_diff = (megatron - reference).abs().max().item()
    assert max_diff <= LOGITS_ATOL[(device, dtype)], f"max |Δ logits| = {max_diff:.3g}"
    assert torch.equal(megatron.argmax(-1), reference.argmax(-1))
    return max_diff


def check_exact_export(megatron_dir: Path, hf_dir: Path, out: Path) -> None:
    """Exported HF weights equal the source's bit for bit (names, shapes, dtypes, values)."""
    bridge.export_megatron_to_hf(str(megatron_dir), str(hf_dir), str(out))
    source, exported = _hf_weights(hf_dir), _hf_weights(out)
    assert sorted(exported) == sorted(source)
    differing = [
        name
        for name, tensor in source.items()
        if exported[name].dtype != tensor.dtype
        or exported[name].shape != tensor.shape
        or not torch.equal(exported[name], tensor)
    ]
    assert not differing, f"exported tensors differ from the source: {differing}"
    source_config = json.loads((hf_dir / "config.json").read_text())
    exported_config = json.loads((out / "config.json").read_text())
    for key in ("architectures", "hidden_size", "num_hidden_layers", "vocab_size", "dtype"):
        assert exported_config[key] == source_config[key], key
    assert exported_config["rope_parameters"] == source_config["rope_parameters"]


def round_trip(hf_dir: Path, tmp_path: Path, dtype: str, device: str) -> float:
    megatron_dir = tmp_path / "megatron"
    bridge.convert_hf_to_megatron(
        str(hf_dir), str(megatron_dir), MegatronLayout(params_dtype=dtype)
    )
    check_megatron_checkpoint(megatron_dir)
    assert bridge.checkpoint_dtype(megatron_dir) == bridge.DTYPES[dtype]
    max_diff = check_logits(megatron_dir, hf_dir, dtype, device)
    check_exact_export(megatron_dir, hf_dir, tmp_path / "hf")
    return max_diff


@pytest.fixture
def on_cpu(megatron_bridge):
    """The CPU side: skip where CUDA is present (the gpu tests cover it), else patch."""
    if torch.cuda.is_available():
        pytest.skip("CUDA is present: the unpatched @pytest.mark.gpu tests cover this")
    from cpu_patches import cpu_patches

    with cpu_patches():
        yield


@pytest.fixture
def on_gpu(megatron_bridge):
    """The GPU side: CUDA, no patches."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")


# --- argument checks (any environment, no megatron needed) -------------------------------
def test_convert_refuses_an_existing_output_directory(tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(FileExistsError, match="already exists"):
        bridge.convert_hf_to_megatron(str(tmp_path), str(tmp_path / "out"), FP32)


def test_an_unknown_dtype_is_refused_by_the_layout_the_conversion_takes():
    with pytest.raises(ValueError, match="params_dtype"):
        MegatronLayout(params_dtype="fp8")


def test_a_directory_without_torch_dist_files_is_not_a_checkpoint(tmp_path):
    (tmp_path / bridge.TRACKER_FILE).write_text("0")
    with pytest.raises(bridge.MegatronCheckpointError, match=r"iter_0000000/\.metadata"):
        bridge.checkpoint_iteration_dir(tmp_path)


# --- megatron on CPU (Python 3.12 env, test-only patches) --------------------------------
def test_parallel_state_is_set_up_and_torn_down(megatron_bridge):
    import torch.distributed as dist
    from megatron.core import parallel_state

    with bridge.megatron_parallel():
        assert dist.is_initialized() and dist.get_world_size() == 1
        assert parallel_state.model_parallel_is_initialized()
        assert parallel_state.get_tensor_model_parallel_world_size() == 1
        # an existing state is reused, not replaced
        with bridge.megatron_parallel(ParallelSizes(tp=8)):
            assert parallel_state.get_tensor_model_parallel_world_size() == 1
        assert parallel_state.model_parallel_is_initialized()
    assert not dist.is_initialized()
    assert not parallel_state.model_parallel_is_initialized()


@pytest.mark.parametrize("shape", ["square", "default"])
def test_fp32_round_trip_is_exact_on_cpu(on_cpu, tiny_models, tmp_path, shape):
    round_trip(tiny_models[shape], tmp_path, "fp32", "cpu")


def test_bf16_round_trip_is_exact_on_cpu(on_cpu, tiny_models, tmp_path):
    hf_dir = _as_dtype(tiny_models["default"], torch.bfloat16, tmp_path / "bf16")
    round_trip(hf_dir, tmp_path, "bf16", "cpu")


def test_an_mxfp4_checkpoint_converts_unpacked_and_exports_without_its_quantization(
    on_cpu, tiny_models, tmp_path, caplog
):
    """The hub's gpt-oss layout (experts as MXFP4 pairs, tests/mxfp4_checkpoint.py): the
    conversion says it dequantizes (megatron-bridge does), and the export back to HF holds the
    very matrices that were packed, in bf16, with no quantization config."""
    import logging

    from mxfp4_checkpoint import write_mxfp4_checkpoint

    source = _as_dtype(tiny_models["default"], torch.bfloat16, tmp_path / "bf16")
    originals = write_mxfp4_checkpoint(source, tmp_path / "mxfp4")
    megatron_dir = tmp_path / "megatron"
    with caplog.at_level(logging.INFO, logger="core.mxfp4"):
        bridge.convert_hf_to_megatron(
            str(tmp_path / "mxfp4"), str(megatron_dir), MegatronLayout(params_dtype="bf16")
        )
    assert any("MXFP4 experts" in r.getMessage() for r in caplog.records)
    bridge.export_megatron_to_hf(str(megatron_dir), str(tmp_path / "mxfp4"), str(tmp_path / "hf"))
    assert "quantization_config" not in json.loads((tmp_path / "hf" / "config.json").read_text())
    exported = _hf_weights(tmp_path / "hf")
    assert not any(name.endswith(("_blocks", "_scales")) for name in exported)
    for name, original in originals.items():
        assert torch.equal(exported[name], original), name


def test_failed_conversion_leaves_nothing(on_cpu, tmp_path):
    hf_dir = tmp_path / "not-a-model"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text('{"model_type": "gpt_oss"}')
    with pytest.raises(Exception):  # noqa: B017 - whatever the bridge raises for a bad model
        bridge.convert_hf_to_megatron(str(hf_dir), str(tmp_path / "out"), FP32)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["not-a-model"]


def _torchrun(worker: str, *args: str) -> None:
    """``worker`` (here) on 2 ranks (torchrun, gloo on a CPU), to its end."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "MASTER_ADDR")}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += [str(HERE / worker), *args]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]


def _cpu_only() -> None:
    """A module fixture of the CPU tests skips where CUDA is present, as ``on_cpu`` does
    (module fixtures are set up before the function-scoped ``on_cpu``)."""
    if torch.cuda.is_available():
        pytest.skip("CUDA is present: the unpatched @pytest.mark.gpu tests cover this")


def _selected_layouts(request, test: str) -> list[tuple[int, int, int]]:
    """The ``(tp, pp, ep)`` of ``test``'s cases this session runs (a ``slow`` one only under
    ``-m slow``): a module's job runs those layouts, one after the other, and no other."""
    return [
        (item.callspec.params["tp"], item.callspec.params["pp"], item.callspec.params["ep"])
        for item in request.session.items
        if getattr(item, "originalname", None) == test and item.path == request.path
    ]


@pytest.fixture(scope="module")
def two_rank_conversions(megatron_bridge, tiny_models, tmp_path_factory, request) -> Path:
    """One torchrun job (2 ranks) converting the tiny model at each layout of
    ``test_a_two_rank_checkpoint_reshards_to_one_rank_exactly``: ``tpT-ppP-epE`` folders."""
    _cpu_only()
    layouts = _selected_layouts(request, "test_a_two_rank_checkpoint_reshards_to_one_rank_exactly")
    out = tmp_path_factory.mktemp("two-rank-conversions")
    _torchrun(
        "convert_worker.py",
        str(tiny_models["default"]),
        str(out),
        *(arg for layout in layouts for arg in ("--layout", ",".join(map(str, layout)))),
    )
    return out


@pytest.mark.parametrize(
    "tp, pp, ep",
    [(2, 1, 1), (1, 2, 1), (1, 1, 2)],
    ids=["tp2", "pp2", "ep2"],
)
def test_a_two_rank_checkpoint_reshards_to_one_rank_exactly(
    on_cpu, tiny_models, two_rank_conversions, tmp_path, tp, pp, ep
):
    """Converted with 2 ranks (torchrun, gloo; the layouts in one job), then loaded, compared
    and exported on 1 rank."""
    hf_dir = tiny_models["default"]
    megatron_dir = two_rank_conversions / layout_dir(tp, pp, ep)
    check_megatron_checkpoint(megatron_dir)
    assert len(list((megatron_dir / bridge.ITERATION_DIR).glob("*.distcp"))) == 2
    check_logits(megatron_dir, hf_dir, "fp32", "cpu")
    check_exact_export(megatron_dir, hf_dir, tmp_path / "hf")


def test_the_training_layout_cannot_be_converted_in_the_one_process_the_step_is(
    on_cpu, tiny_models, tmp_path
):
    """Issue #39, as the convert step ran before: the training layout (here TP 2 / EP 2)
    handed to the conversion in one process, without torchrun, is refused by Megatron-Core
    itself before any weight loads."""
    from trainer.megatron.layout import resolve_megatron_layout

    training = {"tp": 2, "ep": 2, "sequence_parallel": True, "gpus_per_node": 2}
    layout = resolve_megatron_layout({**training, "params_dtype": "fp32"})
    with pytest.raises(RuntimeError, match=r"world_size \(1\) is not divisible by 2"):
        bridge.convert_hf_to_megatron(str(tiny_models["default"]), str(tmp_path / "out"), layout)
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def resharded_loads(megatron_bridge, tiny_models, tmp_path_factory, request) -> Path:
    """The convert step's one-process checkpoint of the tiny model (``conversion_layout`` of
    a training layout of TP 2 / EP 2), then one torchrun job (2 ranks) loading it at each
    layout of ``test_the_convert_steps_one_process_checkpoint_loads_resharded_at_two_ranks``:
    the folder holding ``megatron`` (the checkpoint), ``ids.json`` (the prompts) and a
    ``tpT-ppP-epE`` folder a layout (its export ``hf`` and, where a CPU can run the forward,
    ``logits.pt``)."""
    from cpu_patches import cpu_patches

    from trainer.megatron.layout import conversion_layout

    _cpu_only()
    test = "test_the_convert_steps_one_process_checkpoint_loads_resharded_at_two_ranks"
    hf_dir = tiny_models["default"]
    root = tmp_path_factory.mktemp("resharded-loads")
    training = {"tp": 2, "ep": 2, "sequence_parallel": True, "gpus_per_node": 2}
    layout = conversion_layout({**training, "params_dtype": "fp32"})
    assert (layout.tp, layout.pp, layout.ep, layout.etp, layout.cp) == (1, 1, 1, 1, 1)
    with cpu_patches():
        bridge.convert_hf_to_megatron(str(hf_dir), str(root / "megatron"), layout)
    (root / "ids.json").write_text(json.dumps(_prompt_ids(hf_dir)))
    _torchrun(
        "load_worker.py",
        *(str(path) for path in (root / "megatron", hf_dir, root, root / "ids.json")),
        *(
            arg
            for sizes in _selected_layouts(request, test)
            for arg in ("--layout", ",".join(map(str, sizes)))
        ),
    )
    return root


@pytest.mark.parametrize(
    "tp, pp, ep",
    # TP 2 and EP 2 (the verl layout splits both) in the default run; PP 2 as slow
    [(2, 1, 1), pytest.param(1, 2, 1, marks=pytest.mark.slow), (1, 1, 2)],
    ids=["tp2", "pp2", "ep2"],
)
def test_the_convert_steps_one_process_checkpoint_loads_resharded_at_two_ranks(
    on_cpu, tiny_models, resharded_loads, tp, pp, ep
):
    """Issue #39: the convert step runs as one process, so it writes the checkpoint at the
    one-process layout (``conversion_layout`` of a training layout of TP 2 / EP 2); loaded
    under torchrun at TP 2, PP 2 or EP 2 (gloo; the layouts in one job),
    ``dist_checkpointing`` reshards it: the export gathered back from the two ranks equals
    the source bit for bit, and at TP 2 the logits match the HF model's."""
    hf_dir = tiny_models["default"]
    check_megatron_checkpoint(resharded_loads / "megatron")
    assert len(list((resharded_loads / "megatron" / bridge.ITERATION_DIR).glob("*.distcp"))) == 1
    out = resharded_loads / layout_dir(tp, pp, ep)
    source, exported = _hf_weights(hf_dir), _hf_weights(out / "hf")
    assert sorted(exported) == sorted(source)
    assert all(torch.equal(exported[name], tensor) for name, tensor in source.items())
    if pp == 1 and ep == 1:  # a CPU forward (load_worker.py says why not at PP 2 or EP 2)
        logits = torch.load(out / "logits.pt")
        ids = json.loads((resharded_loads / "ids.json").read_text())
        reference = _hf_logits(hf_dir, ids, torch.float32)
        assert (logits - reference).abs().max().item() <= LOGITS_ATOL[("cpu", "fp32")]


# --- the same round trip on CUDA, unpatched ----------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_round_trip_on_gpu_unpatched(on_gpu, tiny_models, tmp_path, dtype):
    hf_dir = tiny_models["default"]
    if dtype != "fp32":
        hf_dir = _as_dtype(hf_dir, bridge.DTYPES[dtype], tmp_path / dtype)
    round_trip(hf_dir, tmp_path, dtype, "cuda")
