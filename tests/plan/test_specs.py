"""The trainer-backend, rollout-engine and job-API registries: one spec per name, the facts the
layers above read, and one error for a name that is not registered."""

from dataclasses import replace

import pytest

from plan import (
    ENGINE_SPECS,
    TRAINERS,
    UnknownSpecError,
    branch_backend,
    engine_spec,
    trainer_spec,
)


def test_an_unknown_backend_is_one_line_naming_the_field_and_the_known_names():
    with pytest.raises(UnknownSpecError) as error:
        trainer_spec("fsdp")
    assert str(error.value) == (
        "optim.backend='fsdp' is not a trainer backend; valid names: deepspeed, megatron, torch"
    )
    with pytest.raises(ValueError, match=r"^backend='hf' is not a trainer backend"):
        trainer_spec("hf", "backend")


def test_an_unknown_engine_is_one_line_naming_the_field_and_the_known_names():
    with pytest.raises(UnknownSpecError) as error:
        engine_spec("sglang")
    assert str(error.value) == (
        "rollout.engine='sglang' is not a rollout engine; valid names: hf, vllm"
    )
    assert "\n" not in str(error.value)
    with pytest.raises(UnknownSpecError, match=r"^rollout.engine=None is not"):
        engine_spec(None)


@pytest.mark.parametrize(
    ("name", "zero", "model_parallel", "hf_module", "multi", "weights", "conversion", "image"),
    [
        ("torch", False, False, True, False, "huggingface", False, "gpu"),
        ("deepspeed", True, False, True, True, "huggingface", False, "gpu"),
        ("megatron", False, True, False, True, "megatron-torch_dist", True, "megatron"),
    ],
)
def test_each_backend_states_its_facts(
    name, zero, model_parallel, hf_module, multi, weights, conversion, image
):
    spec = trainer_spec(name)
    assert spec.name == name
    assert (spec.zero, spec.model_parallel, spec.trains_hf_module, spec.multi_process) == (
        zero,
        model_parallel,
        hf_module,
        multi,
    )
    assert (spec.weight_format, spec.needs_conversion, spec.image) == (weights, conversion, image)


@pytest.mark.parametrize(
    ("name", "stages_that_shard"),
    [("torch", set()), ("deepspeed", {3}), ("megatron", {0, 1, 2, 3})],
)
def test_parameters_are_sharded_under_zero_3_or_a_model_parallel_split(name, stages_that_shard):
    spec = trainer_spec(name)
    assert {stage for stage in range(4) if spec.shards_parameters(stage)} == stages_that_shard


@pytest.mark.parametrize(
    ("name", "tp", "own_memory", "cuda", "lora", "colocated", "dedicated"),
    [
        ("hf", False, False, False, True, "shared", "channel"),
        ("vllm", True, True, True, False, "in_process_reload", "nccl"),
    ],
)
def test_each_engine_states_its_facts(name, tp, own_memory, cuda, lora, colocated, dedicated):
    spec = engine_spec(name)
    assert spec.name == name
    assert (spec.tensor_parallel, spec.reserves_gpu_memory, spec.needs_cuda) == (
        tp,
        own_memory,
        cuda,
    )
    assert spec.serves_lora is lora
    assert (spec.colocated_transfer, spec.dedicated_transfer) == (colocated, dedicated)
    assert spec.colocated_reason and spec.dedicated_reason
    assert spec.gpus_per_engine(4) == (4 if tp else 1)


def test_specs_are_frozen():
    with pytest.raises(AttributeError):
        trainer_spec("torch").multi_process = True  # type: ignore[misc]


def test_the_pipeline_branch_names_its_backend_except_hf():
    assert branch_backend("megatron") == "megatron"
    assert branch_backend("hf") is None
    assert branch_backend("") is None


def test_the_registries_name_what_the_configs_accept_and_the_builders_build():
    """A name a config accepts has a spec, and a spec a builder: the three lists agree."""
    from trainer.backends import BACKENDS
    from trainer.backends.config import OptimConfig
    from trainer.grpo.config import RolloutConfig
    from trainer.grpo.engines import ENGINES

    assert set(TRAINERS) == set(BACKENDS)
    for backend in TRAINERS:  # the config's validator accepts what the registry holds
        assert OptimConfig._a_registered_backend(backend) == backend
    with pytest.raises(ValueError, match="optim.backend='jax' is not a trainer backend"):
        OptimConfig(backend="jax")
    assert set(ENGINE_SPECS) == set(ENGINES)
    for engine in ENGINE_SPECS:  # the config accepts what the registry holds, and only that
        assert RolloutConfig(engine=engine).engine == engine
    with pytest.raises(ValueError, match="rollout.engine='sglang' is not a rollout engine"):
        RolloutConfig(engine="sglang")


def test_a_registered_engine_is_read_by_the_weight_sync_without_naming_it(monkeypatch):
    """The weight sync picks its transport from the spec's fields: a new engine is its spec."""
    from trainer.grpo.weight_transfer import select_transfer

    fake = replace(
        ENGINE_SPECS["vllm"],  # its transports: reload in process, NCCL to dedicated engines
        name="fake",
        colocated_reason="a test's colocated engine",
        dedicated_reason="a test's dedicated engine",
    )
    monkeypatch.setitem(ENGINE_SPECS, "fake", fake)
    colocated = select_transfer("cpu", True, "fake")
    assert (colocated.transport, colocated.direct, colocated.reason) == (
        "in_process_reload",
        False,
        "a test's colocated engine",
    )
    assert select_transfer("cuda", False, "fake", True).transport == "nccl"
    # NCCL needs the trainer's GPU: on CPU the same engine gets gloo
    assert select_transfer("cpu", False, "fake").transport == "lingo_gloo"


def test_an_unknown_job_api_is_one_line_naming_the_field_and_the_known_names():
    from plan import job_spec

    with pytest.raises(UnknownSpecError) as error:
        job_spec("mpijob")
    assert str(error.value) == (
        "cluster.job_api='mpijob' is not a job API; valid names: pytorchjob, trainjob"
    )
    with pytest.raises(UnknownSpecError, match=r"^--job-api='auto' is not a job API"):
        job_spec("auto", "--job-api")  # auto is the server's answer, not a spec


def test_each_job_api_states_its_runtimes_and_builds_its_manifest():
    """A TrainJob references the cluster's runtime, or (two images) one of its own; a
    PyTorchJob none. The builders named by ``module:function`` are the modules' own."""
    from cluster import pytorchjob, trainjob
    from cluster.jobs import _builder
    from plan import job_spec

    trainer, pytorch = job_spec("trainjob"), job_spec("pytorchjob")
    assert (trainer.runtime_plural, trainer.cluster_runtime_plural) == (
        "trainingruntimes",
        "clustertrainingruntimes",
    )
    assert not (pytorch.own_runtime_builder or pytorch.runtime_plural)
    assert not pytorch.cluster_runtime_plural
    assert _builder(trainer.builder) is trainjob.build_trainjob
    assert _builder(trainer.own_runtime_builder) is trainjob.build_job_runtime
    assert _builder(pytorch.builder) is pytorchjob.build_pytorchjob
    with pytest.raises(ValueError, match="a PyTorchJob has no runtime of its own"):
        pytorch.build_own_runtime("job", None, "trainer.sft", [])


@pytest.mark.parametrize("engine", sorted(ENGINE_SPECS))
@pytest.mark.parametrize("colocate", [True, False])
def test_the_rollout_engines_a_config_asks_for(engine, colocate):
    """One derivation of the engines (``plan.rollout_engines``) for placement and for the
    processes a job starts beside the trainers (``GRPOConfig.rollout_processes``)."""
    from plan import rollout_engines
    from trainer.grpo.config import GRPOConfig

    rollout = {"engine": engine, "tensor_parallel_size": 2, "colocate": colocate}
    engines = rollout_engines(engine, 2, colocate, 3)
    assert engines.tp == engine_spec(engine).gpus_per_engine(2)
    assert engines.dedicated == (0 if colocate else 3)
    assert engines.processes == (0 if colocate else 3 * engines.tp)
    if not colocate:  # a colocated config states no engine count (one per TP group)
        rollout["num_engines"] = 3
    config = GRPOConfig.model_validate({"rollout": rollout})
    assert config.rollout_processes == engines.processes
