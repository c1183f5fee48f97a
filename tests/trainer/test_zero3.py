"""ZeRO-3 without a whole copy, on 2 real DeepSpeed processes (gloo, CPU): the partitioned load,
the reference, the fp32 master shared with the module, lockstep decoding when one rank stops
early, streamed weights and save (the SFT and GRPO process tests check that ZeRO-3 training
follows a single process)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytest.importorskip("deepspeed")

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import json
    import math
    import sys
    from pathlib import Path

    import torch
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from core.modeling import load_tokenizer
    from trainer.backends import DeepSpeedBackend, OptimConfig, deepspeed_config
    from trainer.distributed import barrier, init_distributed
    from trainer.grpo.config import RolloutConfig
    from trainer.grpo.rollout import HFRolloutEngine
    from trainer.zero3 import load_partitioned

    model_dir, out = sys.argv[1], Path(sys.argv[2])
    info = init_distributed("cpu", 1)
    cfg = OptimConfig(backend="deepspeed", zero_stage=3, learning_rate=1e-3)
    # every parameter partitioned, however small (DeepSpeed keeps those under 1e5 whole)
    ds_config = deepspeed_config(
        cfg, info.device, 2, 1, zero_settings={"stage3_param_persistence_threshold": 0}
    )
    policy = load_partitioned(model_dir, torch.float32, ds_config, info.device)
    report = {"partitioned": [
        [n, p.ds_numel, p.ds_tensor.numel(), p.numel()] for n, p in policy.named_parameters()
    ]}
    backend = DeepSpeedBackend(
        policy, cfg, 10, info, 2, 1, with_reference=True, ds_config=ds_config,
        reference_dir=model_dir,
    )
    report["reference"] = [
        [n, p.ds_numel, p.ds_tensor.numel(), p.numel()]
        for n, p in backend.reference.named_parameters()
    ]
    optimizer = backend.optimizer  # fp32 model: the master partitions are the module's own
    report["master_shared"] = [
        master.data_ptr() == own.data_ptr()
        for master, own in zip(
            optimizer.fp32_partitioned_groups_flat, optimizer.fp16_partitioned_groups_flat
        )
    ]
    saved = load_file(Path(model_dir) / "model.safetensors")
    streamed, previous = [], None
    for name, tensor in backend.hf_weights():
        released = previous is None or previous.ds_status == ZeroParamStatus.NOT_AVAILABLE
        streamed.append([name, torch.equal(tensor, saved[name]), released])
        previous = dict(backend.unwrapped().named_parameters())[name]
    report["streamed"] = streamed

    # rank 0's rows stop at their first token, rank 1's never: rank 0 must keep stepping
    tokenizer = load_tokenizer(model_dir)
    report["forward_is_collective"] = backend.forward_is_collective  # what sets lockstep
    engine = HFRolloutEngine(
        backend.unwrapped(), tokenizer, RolloutConfig(max_new_tokens=6), lockstep=True
    )
    engine.stop_ids = set(range(len(tokenizer))) if info.rank == 0 else {-1}
    rollouts = engine.generate([[5, 6, 7], [8, 9]], [[1, 2], [3, 4]])
    report["lengths"] = [len(r.response_ids) for r in rollouts]
    barrier(info)

    backend.save_policy(out / "saved", model_dir, torch.float32)  # the recipe's call
    barrier(info)
    if info.rank == 0:
        reloaded = AutoModelForCausalLM.from_pretrained(out / "saved").state_dict()
        report["saved_equal"] = all(torch.equal(reloaded[k], v) for k, v in saved.items())
        report["saved_keys"] = sorted(reloaded) == sorted(saved)
    (out / f"rank{info.rank}.json").write_text(json.dumps(report))
    """
)


@pytest.fixture(scope="module")
def reports(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("zero3")
    script = out / "zero3_check.py"
    script.write_text(SCRIPT)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command = [*torchrun, "--nproc_per_node=2", str(script), str(tiny_model_dir), str(out)]
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    subprocess.run(command, env=env, check=True, timeout=300)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


def test_the_policy_and_the_reference_load_partitioned(reports, tiny_model_dir):
    sizes = {k: v.numel() for k, v in load_file(tiny_model_dir / "model.safetensors").items()}
    for report in reports:
        for key in ("partitioned", "reference"):
            names = [name for name, *_ in report[key]]
            assert sorted(names) == sorted(sizes)
            for name, full, local, visible in report[key]:
                assert full == sizes[name], name
                assert local == -(-full // 2), name  # this rank's half, padded
                assert visible == 0, name  # no whole tensor left behind


def test_an_fp32_model_has_no_second_fp32_copy_in_the_optimizer(reports):
    for report in reports:
        assert report["master_shared"] and all(report["master_shared"])


def test_weights_stream_one_gathered_parameter_at_a_time(reports):
    for report in reports:
        assert report["streamed"] and all(equal for _, equal, _ in report["streamed"])
        assert all(released for *_, released in report["streamed"])


def test_lockstep_decoding_when_one_rank_stops_early(reports):
    # the backend says its module's forward is collective: the recipe's HF engine steps in
    # lockstep (trainer.grpo.engines)
    assert [r["forward_is_collective"] for r in reports] == [True, True]
    assert reports[0]["lengths"] == [1, 1, 1, 1]  # stopped at the first token
    assert reports[1]["lengths"] == [6, 6, 6, 6]  # stepped to the limit, rank 0 along


def test_the_streamed_save_is_a_loadable_hf_directory_of_the_same_weights(reports):
    assert reports[0]["saved_keys"] and reports[0]["saved_equal"]


def test_reading_a_safetensors_entry_matches_safetensors(tiny_model_dir):
    from trainer.zero3 import gather_windows, safetensors_entries

    saved = load_file(tiny_model_dir / "model.safetensors")
    entries = safetensors_entries(tiny_model_dir)
    assert set(entries) == set(saved)
    for name, tensor in saved.items():
        assert torch.equal(entries[name].read(), tensor), name
    largest = max(t.numel() for t in saved.values())
    assert set(gather_windows(tiny_model_dir).values()) == {largest}
    windows = gather_windows(tiny_model_dir, world_size=2)
    assert windows.pop("sub_group_size") == -(-largest // 2)  # partition elements
    assert set(windows.values()) == {largest}


STALE_LOCK_SCRIPT = textwrap.dedent(
    """
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
    from trainer.zero3 import init_deepspeed_comm

    init_deepspeed_comm(torch.device("cpu"))
    from deepspeed.comm import comm as ds_comm

    print("shm op:", ds_comm.cdb.shm_comm_op)
    """
)


def test_deepspeed_on_cpu_starts_past_a_stale_shm_op_build_lock(tmp_path):
    """A rank killed while DeepSpeed JIT-compiled its CPU shared-memory op left torch's build
    lock behind, and every DeepSpeed process after it waited on the lock forever (CI hung
    there). Our DeepSpeed start on CPU does not build that op, so a stale lock is harmless."""
    from socket import socket

    with socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    extensions = tmp_path / "torch_extensions"
    (extensions / "deepspeed_shm_comm").mkdir(parents=True)
    (extensions / "deepspeed_shm_comm" / "lock").touch()  # what a killed compile leaves
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(extensions), "PYTHONPATH": str(REPO)}
    try:
        done = subprocess.run(
            [sys.executable, "-c", STALE_LOCK_SCRIPT.format(port=port)],
            env=env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=240,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("DeepSpeed's start waited on the stale build lock")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "shm op: None" in done.stdout
