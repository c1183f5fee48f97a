"""The command of a two-image TrainJob's rollout-only pods: torchrun as the node ranks after the
training nodes.

A GRPO job whose dedicated engines run another image than its trainers (a Megatron trainer
beside vLLM engines, ``ClusterJobConfig.two_images``) is a TrainJob of its own
TrainingRuntime (``cluster.trainjob.build_job_runtime``): the Trainer's ``node`` replicated job
holds the ``T`` training nodes, a ``rollout`` replicated job of the rollout image the ``R``
rollout-only ones. The Trainer's torch plugin gives ``PET_*`` only to the ``node`` container,
so each rollout pod starts torchrun with the rendezvous spelled out: ``--nnodes T+R``,
``--node_rank T + JOB_COMPLETION_INDEX`` (Kubernetes sets ``JOB_COMPLETION_INDEX`` in every pod
of an Indexed Job: the pod's index, 0..R-1), ``--master_addr`` the first training pod's DNS name
and ``--master_port`` the port the torch plugin gives it. The training pods pass ``--nnodes
T+R`` too; torchrun's ``env`` arguments take ``PET_*`` only as their default
(``torch/distributed/argparse_util.py``, ``env.__init__``), so it wins over ``PET_NNODES=T``.

    python -m cluster.rollout_node --training-nodes T --rollout-nodes R --nproc-per-node P \\
        --master-addr ADDR --master-port PORT -- -m trainer.grpo --config …

Only the standard library is imported: the rollout image needs nothing else to start.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import dataclass

log = logging.getLogger(__name__)

COMPLETION_INDEX_ENV = "JOB_COMPLETION_INDEX"
"""The index Kubernetes gives each pod of an Indexed Job (0..completions-1)."""


class RolloutNodeError(ValueError):
    """The rollout pod's arguments or environment cannot place it in the job."""


@dataclass(frozen=True)
class RolloutLayout:
    """Where a two-image job's rollout pods join its rendezvous.

    Attributes:
        training_nodes: the job's first nodes, which train (``T``).
        rollout_nodes: the rollout-only nodes after them (``R``), one pod each.
        nproc_per_node: processes per node, the same on every node.
        master_addr: the first training pod's address (node rank 0 hosts the store).
        master_port: its rendezvous port.
    """

    training_nodes: int
    rollout_nodes: int
    nproc_per_node: int
    master_addr: str
    master_port: int

    def command(self, entry: list[str]) -> list[str]:
        """The rollout container's command: this module with the layout, then ``--`` and
        torchrun's entry (``-m module args…``)."""
        return [
            "python", "-m", "cluster.rollout_node",
            "--training-nodes", str(self.training_nodes),
            "--rollout-nodes", str(self.rollout_nodes),
            "--nproc-per-node", str(self.nproc_per_node),
            "--master-addr", self.master_addr, "--master-port", str(self.master_port),
            "--", *entry,
        ]  # fmt: skip

    def torchrun_argv(self, index: int, entry: list[str]) -> list[str]:
        """torchrun's command line for the rollout pod of completion index ``index``: node
        rank ``training_nodes + index`` of ``training_nodes + rollout_nodes``.

        Raises:
            RolloutNodeError: ``index`` is not one of the rollout pods' indexes.
        """
        if not 0 <= index < self.rollout_nodes:
            raise RolloutNodeError(
                f"{COMPLETION_INDEX_ENV}={index} is outside 0..{self.rollout_nodes - 1}: the "
                f"rollout replicated job must run --rollout-nodes ({self.rollout_nodes}) pods"
            )
        return [
            sys.executable, "-m", "torch.distributed.run",
            f"--nnodes={self.training_nodes + self.rollout_nodes}",
            f"--node_rank={self.training_nodes + index}",
            f"--nproc_per_node={self.nproc_per_node}",
            f"--master_addr={self.master_addr}", f"--master_port={self.master_port}",
            *entry,
        ]  # fmt: skip


def completion_index(environ: dict[str, str]) -> int:
    """The pod's ``JOB_COMPLETION_INDEX``.

    Raises:
        RolloutNodeError: it is missing or not a whole number.
    """
    value = environ.get(COMPLETION_INDEX_ENV)
    if value is None or not value.isdigit():
        raise RolloutNodeError(
            f"{COMPLETION_INDEX_ENV}={value!r}: cluster.rollout_node runs in a pod of an "
            "Indexed Job (a two-image TrainJob's 'rollout' replicated job), which sets it"
        )
    return int(value)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not a positive count")
    return value


def parse(argv: list[str]) -> tuple[RolloutLayout, list[str]]:
    """The layout and torchrun's entry (what follows ``--``).

    Raises:
        RolloutNodeError: no ``--`` or nothing after it.
    """
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        raise RolloutNodeError(
            "no entry point: end the arguments with `-- -m <module> <its args…>`"
        )
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="python -m cluster.rollout_node", description=__doc__)
    parser.add_argument("--training-nodes", type=_positive, required=True)
    parser.add_argument("--rollout-nodes", type=_positive, required=True)
    parser.add_argument("--nproc-per-node", type=_positive, required=True)
    parser.add_argument("--master-addr", required=True)
    parser.add_argument("--master-port", type=int, required=True)
    args = parser.parse_args(argv[:split])
    layout = RolloutLayout(
        args.training_nodes, args.rollout_nodes, args.nproc_per_node, args.master_addr,
        args.master_port,
    )  # fmt: skip
    return layout, argv[split + 1 :]


def main(argv: list[str] | None = None) -> None:
    """Replace this process with torchrun at the pod's node rank."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        layout, entry = parse(sys.argv[1:] if argv is None else argv)
        command = layout.torchrun_argv(completion_index(dict(os.environ)), entry)
    except RolloutNodeError as error:
        raise SystemExit(f"cluster.rollout_node: {error}") from None
    log.info("rollout node: %s", " ".join(command))
    sys.stdout.flush()
    os.execv(command[0], command)


if __name__ == "__main__":
    main()
