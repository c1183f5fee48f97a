"""The machines a run trains on, stated once: a node type and how many nodes each step takes.

A preset names its ``Hardware``; everything else that describes machines is derived from it:
the Kubernetes platform settings (``pipelines.platform``), each training step's job
(``Hardware.execution``), the GRPO placement plan (``trainer.placement.grpo_placement`` over
``Hardware.cluster``), the capacity check's layout (``trainer.capacity_check``) and the
Megatron layout's machine fields (``Hardware.megatron_fields``). Only pydantic is imported, so
presets and the CLI use it without the ``cluster`` extra.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from core.config_model import ConfigModel

# What nvidia-smi reports as total memory (MiB / 1024): A10G 23028 MiB, H200 143771 MiB.
A10G_GIB = 22.49
H200_GIB = 140.4

LOCAL = "local"
"""The node type of a run without a cluster: the pipeline's own process, on CPU."""


def rollout_nodes(processes: int, per_node: int) -> int:
    """Nodes that ``processes`` rollout-only processes (dedicated engines) fill, ``per_node``
    to a node, after the training nodes."""
    return -(-processes // per_node)


class NodeType(ConfigModel):
    """One kind of machine.

    Attributes:
        name: the instance type (``node.kubernetes.io/instance-type``), or ``local``.
        gpu_product: the GPU as ``nvidia.com/gpu.product`` labels it; ``None`` on CPU.
        gpus: GPUs per node (1 on CPU: one training process).
        gpu_memory_gib: memory of one GPU as the driver reports it; ``None`` on CPU.
        host_memory_gib: RAM of one node.
        host_reserved_gib: RAM the OS, kubelet and sidecars keep.
        flash_attention: a fused attention kernel with attention sinks runs on this GPU
            (Hopper); otherwise attention is ``eager`` (pre-Hopper GPUs and CPU).
        job_cpu: CPU a training job's pod requests on this node.
        job_memory: memory a training job's pod requests on this node.
        job_shm: size of a training job pod's memory-backed ``/dev/shm``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    gpu_product: str | None = None
    gpus: int = Field(1, ge=1)
    gpu_memory_gib: float | None = Field(None, gt=0)
    host_memory_gib: float = Field(gt=0)
    host_reserved_gib: float = Field(8.0, ge=0)
    flash_attention: bool = False
    job_cpu: str = "4"
    job_memory: str = "16Gi"
    job_shm: str = "8Gi"

    @property
    def device(self) -> Literal["cuda", "cpu"]:
        """``cuda`` on a GPU node, ``cpu`` otherwise."""
        return "cpu" if self.gpu_product is None else "cuda"


NODE_TYPES: dict[str, NodeType] = {
    # the laptop / kfp.local run: one CPU process, the host's memory
    LOCAL: NodeType(name=LOCAL, host_memory_gib=8.0, host_reserved_gib=2.0),
    # 48 vCPU, 192 GiB, 4x A10G 24 GB
    "g5.12xlarge": NodeType(
        name="g5.12xlarge",
        gpu_product="NVIDIA-A10G",
        gpus=4,
        gpu_memory_gib=A10G_GIB,
        host_memory_gib=192.0,
        job_cpu="44",
        job_memory="160Gi",
        job_shm="32Gi",
    ),
    # 192 vCPU, 2 TiB, 8x H200 141 GB
    "p5en.48xlarge": NodeType(
        name="p5en.48xlarge",
        gpu_product="NVIDIA-H200",
        gpus=8,
        gpu_memory_gib=H200_GIB,
        host_memory_gib=2048.0,
        host_reserved_gib=32.0,
        flash_attention=True,
        job_cpu="180",
        job_memory="1800Gi",
        job_shm="256Gi",
    ),
}

Step = Literal["sft", "grpo"]


class Hardware(ConfigModel):
    """The machines of a run: one node type, the nodes each training step takes, the volume.

    Attributes:
        node_type: a ``NODE_TYPES`` name; ``local`` trains in the pipeline step's own pod.
        sft_nodes: nodes of the SFT job.
        grpo_nodes: nodes of the GRPO job's training processes; dedicated rollout
            engines' processes fill the nodes after them, which the job takes too
            (``job_nodes``).
        storage_gib: size of the volume that holds checkpoints.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    node_type: str = LOCAL
    sft_nodes: int = Field(1, ge=1)
    grpo_nodes: int = Field(1, ge=1)
    storage_gib: float = Field(10.0, gt=0)

    @model_validator(mode="after")
    def _known_node_type(self) -> Hardware:
        if self.node_type not in NODE_TYPES:
            raise ValueError(f"unknown node_type {self.node_type!r}; known: {sorted(NODE_TYPES)}")
        if self.node_type == LOCAL and (self.sft_nodes, self.grpo_nodes) != (1, 1):
            raise ValueError("node_type 'local' is one machine: sft_nodes and grpo_nodes are 1")
        return self

    @property
    def node(self) -> NodeType:
        """The node type."""
        return NODE_TYPES[self.node_type]

    @property
    def local(self) -> bool:
        """True when the steps train in their own pipeline pods (no cluster)."""
        return self.node_type == LOCAL

    @property
    def platform(self) -> str:
        """The ``pipelines.platform`` preset of these machines (named as the node type)."""
        return self.node_type

    def nodes(self, step: Step) -> int:
        """Nodes ``step`` trains on."""
        return self.sft_nodes if step == "sft" else self.grpo_nodes

    def cluster(self, step: Step, nproc: int) -> tuple[int, int]:
        """``(nodes, processes per node)`` of ``step``: its job, or one node of
        ``nproc`` processes (``local``)."""
        if self.local:
            return 1, nproc
        return self.nodes(step), self.node.gpus

    def job_nodes(self, step: Step, rollout_processes: int = 0) -> int:
        """Nodes of ``step``'s job: its training nodes, then the nodes that
        ``rollout_processes`` (GRPO's dedicated engines) fill after them."""
        return self.nodes(step) + rollout_nodes(rollout_processes, self.node.gpus)

    def execution(self, step: Step, rollout_processes: int = 0):
        """``step``'s ``ExecutionConfig``: in its own pod (``local``), or a job (TrainJob or
        PyTorchJob) of this node type's reference layout on ``job_nodes(step,
        rollout_processes)`` nodes."""
        from cluster.config import ExecutionConfig

        if self.local:
            return ExecutionConfig()
        nodes = self.job_nodes(step, rollout_processes)
        return ExecutionConfig(mode="job", reference=self.node_type, job={"nodes": nodes})

    def megatron_fields(self, nproc: int) -> dict:
        """The Megatron layout's machine fields: the GRPO job's nodes, processes per node and
        GPU memory (``nproc``: GRPO's processes, which a local run puts on one node)."""
        nodes, per_node = self.cluster("grpo", nproc)
        memory = self.node.gpu_memory_gib
        return {"nodes": nodes, "gpus_per_node": per_node} | (
            {"gpu_memory_gib": memory} if memory else {}
        )


def job_fields(node_type: str) -> dict:
    """The ``ClusterJobConfig`` fields a training job's pod takes from its node type (GPUs, CPU,
    memory, ``/dev/shm``, node selector, GPU toleration)."""
    node = NODE_TYPES[node_type]
    return {
        "gpus_per_node": node.gpus,
        "cpu": node.job_cpu,
        "memory": node.job_memory,
        "shm_size": node.job_shm,
        "node_selector": {"node.kubernetes.io/instance-type": node.name},
        "tolerations": [{"key": "nvidia.com/gpu"}],
    }
