"""The machines a run trains on, stated once: a node type and how many nodes each step takes.

A preset names its ``Hardware``; everything else that describes machines is derived from it:
the training steps' processes (``Hardware.processes``, a cluster preset's ``nproc``), the
Kubernetes platform settings (``pipelines.platform``), each training step's job
(``Hardware.execution``), the GRPO placement plan (``trainer.placement.grpo_placement`` over
``Hardware.cluster``), the capacity check's layout (``trainer.capacity_check``) and the
Megatron layout's machine fields (``Hardware.megatron_fields``). Only pydantic is imported, so
presets and the CLI use it without the ``cluster`` extra. The node types themselves
(``NODE_TYPES``) are in ``cluster.nodes``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import ConfigDict, Field, model_validator

from cluster.config import ExecutionConfig
from cluster.nodes import LOCAL, NODE_TYPES, NodeType, rollout_nodes
from core.config_model import ConfigModel

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

    def processes(self, step: Step) -> int | None:
        """Training processes of ``step``: one per GPU of its nodes; ``None`` for ``local``,
        where the step's own config says how many processes its pod runs (``nproc``)."""
        return None if self.local else self.nodes(step) * self.node.gpus

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

    def execution(self, step: Step, rollout_processes: int = 0) -> ExecutionConfig:
        """``step``'s ``ExecutionConfig``: in its own pod (``local``), or a job (TrainJob or
        PyTorchJob) of this node type's reference layout on ``job_nodes(step,
        rollout_processes)`` nodes."""
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
