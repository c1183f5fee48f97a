"""The kinds of machines a run trains on, stated once (``NODE_TYPES``): GPUs and their memory,
host memory and what the system keeps of it, the attention kernel the GPU runs, and what a
training job's pod requests there. ``cluster.hardware`` (a preset's machines), the capacity
planner's layouts (``capacity.layouts``), the platform settings and the job configs read
them from here. Only pydantic is imported."""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field

from core.config_model import ConfigModel

# What nvidia-smi reports as total memory (MiB / 1024): A10G 23028 MiB, H100 80GB HBM3
# 81559 MiB, H200 143771 MiB.
A10G_GIB = 22.49
H100_GIB = 79.65
H200_GIB = 140.4

LOCAL = "local"
"""The node type of a run without a cluster: the pipeline's own process, on CPU."""


def rollout_nodes(processes: int, per_node: int) -> int:
    """Nodes that ``processes`` rollout-only processes (dedicated engines) fill, ``per_node``
    to a node, after the training nodes."""
    return -(-processes // per_node)


OMP_THREADS_ENV = "OMP_NUM_THREADS"
"""The variable that sizes a process's CPU thread pools (OpenMP, torch's intra-op pool)."""


def cpu_cores(quantity: str) -> float:
    """A Kubernetes CPU quantity (``"44"``, ``"1.5"``, ``"500m"``) in cores.

    Raises:
        ValueError: not a CPU quantity (the message names it).
    """
    text = quantity.strip()
    try:
        cores = float(text[:-1]) / 1000 if text.endswith("m") else float(text)
    except ValueError:
        cores = -1.0
    if not cores > 0:
        raise ValueError(
            f"cpu={quantity!r}: not a Kubernetes CPU quantity (cores such as '44' or '1.5', "
            "or millicores such as '500m')"
        )
    return cores


def omp_threads(cpu: str | float, processes: int) -> int:
    """CPU threads of one process: the pod's CPUs shared by its processes, floor, at least 1.

    torchrun sets ``OMP_NUM_THREADS=1`` in every process when the variable is unset and it
    starts more than one (``torch/distributed/run.py``), so without it each rank's CPU work
    (DeepSpeed's CPU Adam, Megatron's host optimizer, MXFP4 dequantization) runs on one
    thread; more threads than the pod's share would oversubscribe its CPUs.

    Args:
        cpu: the pod's CPUs, a Kubernetes quantity (its CPU request) or a count of cores.
        processes: processes per pod (``torchrun --nproc_per_node``).
    """
    if processes < 1:
        raise ValueError(f"processes={processes}: a pod runs at least one process")
    cores = cpu_cores(cpu) if isinstance(cpu, str) else float(cpu)
    return max(1, int(cores // processes))


class NodeType(ConfigModel):
    """One kind of machine.

    Attributes:
        name: the instance type (``node.kubernetes.io/instance-type``), or ``local``.
        gpu_product: the GPU as ``nvidia.com/gpu.product`` labels it; ``None`` on CPU.
        gpus: GPUs per node (1 on CPU: one training process).
        gpu_memory_gib: memory of one GPU as the driver reports it; ``None`` on CPU.
        host_memory_gib: RAM of one node.
        host_reserved_gib: RAM the OS, kubelet and sidecars keep.
        flash_attention: the GPU has a fused attention kernel that takes attention sinks
            (Hopper: vLLM's FA3, Transformer Engine's fused attention). Whether a training
            process runs it is its backend's (``core.attention.training_attention``): the HF
            trainer runs ``eager`` everywhere, Megatron the fused kernel where this is set.
        job_cpu: CPU a training job's pod requests on this node.
        job_memory: memory a training job's pod requests on this node.
        job_shm: size of a training job pod's memory-backed ``/dev/shm``.
        network_gbps: the node's network bandwidth, all its interfaces together, Gb/s, as
            the instance type's published figure states it; ``None``: none stated (the local
            run: one host, no network between its processes).
        network_links: network interfaces that bandwidth is spread over (EFA cards); one
            GPU's process reaches ``network_gbps / network_links`` per interface it is
            nearest to (``network_links // gpus`` of them, at least one).
        intra_node_gbps: one GPU's bandwidth to the node's other GPUs, Gb/s (NVLink, or PCIe
            where the GPUs have no NVLink); ``None`` on CPU.
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
    network_gbps: float | None = Field(None, gt=0)
    network_links: int = Field(1, ge=1)
    intra_node_gbps: float | None = Field(None, gt=0)

    @property
    def device(self) -> Literal["cuda", "cpu"]:
        """``cuda`` on a GPU node, ``cpu`` otherwise."""
        return "cpu" if self.gpu_product is None else "cuda"


_P5_FAMILY: dict = {
    "gpus": 8,
    "host_memory_gib": 2048.0,
    "host_reserved_gib": 32.0,
    "flash_attention": True,
    "job_cpu": "180",
    "job_memory": "1800Gi",
    "job_shm": "256Gi",
    "network_gbps": 3200.0,
    "intra_node_gbps": 7200.0,
}
"""What the p5 family's nodes share (8 GPUs, 192 vCPU, 2 TiB, 3200 Gb/s EFA, NVLink); its
members differ in the GPU and in how the EFA bandwidth is split into cards."""


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
        # https://aws.amazon.com/ec2/instance-types/g5/ : g5.12xlarge "Network Bandwidth
        # (Gbps) 40" (100 is g5.48xlarge's); the A10Gs have no NVLink: PCIe 4.0 x16, 16 GT/s
        # × 16 lanes ≈ 31.5 GB/s ≈ 252 Gb/s each way (PCI-SIG PCIe 4.0 base specification)
        network_gbps=40.0,
        network_links=1,
        intra_node_gbps=252.0,
    ),
    # 192 vCPU, 2 TiB, 8x H100 80 GB
    "p5.48xlarge": NodeType(
        name="p5.48xlarge",
        gpu_product="NVIDIA-H100-80GB-HBM3",
        gpu_memory_gib=H100_GIB,
        # https://aws.amazon.com/ec2/instance-types/p5/ : p5.48xlarge "3200 Gbps" EFAv2,
        # 32 × 100 Gb/s cards (four per GPU); NVLink: H100 SXM "NVLink 900 GB/s" per GPU
        # (NVIDIA H100 Tensor Core GPU datasheet) = 7200 Gb/s
        network_links=32,
        **_P5_FAMILY,
    ),
    # 192 vCPU, 2 TiB, 8x H200 141 GB
    "p5en.48xlarge": NodeType(
        name="p5en.48xlarge",
        gpu_product="NVIDIA-H200",
        gpu_memory_gib=H200_GIB,
        # https://aws.amazon.com/ec2/instance-types/p5/ : p5en.48xlarge "3200 Gbps" EFAv3,
        # 16 × 200 Gb/s cards (two per GPU); NVLink: H200 "NVLink 900 GB/s" per GPU (NVIDIA
        # H200 Tensor Core GPU datasheet) = 7200 Gb/s
        network_links=16,
        **_P5_FAMILY,
    ),
}


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


def sender_network_gbps(node: NodeType) -> float | None:
    """What one GPU's process (the trainer's weight sender) reaches of ``node``'s network:
    its share of the interfaces nearest to it, at least one interface (p5en: two 200 Gb/s
    EFA cards per GPU, 400 Gb/s; g5.12xlarge: its one 40 Gb/s interface)."""
    if node.network_gbps is None:
        return None
    per_link = node.network_gbps / node.network_links
    return per_link * max(1, node.network_links // node.gpus)
