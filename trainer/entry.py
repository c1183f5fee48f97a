"""The command line of one training process (``python -m trainer.sft`` / ``trainer.grpo``)."""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import sys
from collections.abc import Callable
from pathlib import Path

from pydantic import BaseModel

from core.errors import describe_error
from core.image_checks import require_supported_driver
from core.processes import die_with_parent
from core.redact import configure_logging

log = logging.getLogger(__name__)


def step_main(
    prog: str,
    config_class: type[BaseModel],
    run: Callable[..., object],
    model_flag: str,
    eval_required: bool,
    argv: list[str] | None = None,
) -> None:
    """Parse ``--config JSON --<model_flag> DIR --train --eval --model-output --work-dir`` and
    call ``run(config, model, train, eval, model_output, work_dir)``.

    The process dies with its parent (``core.processes.die_with_parent``: a killed torchrun
    or step leaves no rank behind), logs through the redaction, and an expected failure
    (``core.errors.describe_error``) ends it with one ``error: …`` line and exit status 1
    (``LINGO_TRACEBACK=1``: the traceback instead), a node driver older than the image's
    (``core.image_checks.require_supported_driver``) among them."""
    parser = argparse.ArgumentParser(prog=prog, description=f"One process of {prog}.")
    parser.add_argument(
        "--config", type=Path, required=True, help=f"{config_class.__name__} as JSON"
    )
    parser.add_argument(f"--{model_flag}", dest="model", required=True)
    parser.add_argument("--train", required=True)
    parser.add_argument("--eval", required=eval_required, default=None)
    parser.add_argument("--model-output", required=True)
    parser.add_argument("--work-dir", required=True)
    args = parser.parse_args(argv)
    die_with_parent()
    configure_logging(logging.INFO, "%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        require_supported_driver()  # the GPU image on a node whose driver is too old
        config = config_class.model_validate(json.loads(args.config.read_text()))
        run(config, args.model, args.train, args.eval, args.model_output, args.work_dir)
    except Exception as exc:
        line = describe_error(exc, args.work_dir)
        if line is None or os.environ.get("LINGO_TRACEBACK"):
            raise  # a bug, or asked for: the traceback
        log.error("%s", line)
        raise SystemExit(f"error: {line}") from None
    shut_down_process_group()


def end_process() -> None:
    """End a step process whose run succeeded: exit status 0 without the interpreter's
    finalization. Every output is in place by then (written, renamed, the process group
    destroyed); what finalization would still tear down are the C++ threads of objects
    Python frees in no set order (gloo groups of the rollout channels, stores), and one of
    them destroyed while still joinable aborts the process ("terminate called without an
    active exception", exit -6), which torchrun reports as a failed job after the work is
    done (seen: 1 in 5 suite runs of the kill-and-resume test with dedicated engines)."""
    # Finalization would also stop this process's multiprocessing children; without it they
    # outlive the run holding its stdout and stderr (a caller reading them waits forever).
    # Megatron-Core's torch_dist save starts one: a Manager server for its write results
    # (dist_checkpointing/strategies/filesystem_async.py:65 `ctx.Manager().Queue()`).
    for child in multiprocessing.active_children():
        child.terminate()
        child.join(timeout=10)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def shut_down_process_group() -> None:
    """Destroy the process group of a run that succeeded, once ``run`` has returned (its
    models, optimizers and autograd graphs, which hold the group, are freed by then).

    A group left to the interpreter's exit is torn down while Python is being finalized:
    with gloo it can abort (``terminate called without an active exception``, exit -6,
    after the work is done: 3 runs in 24 of a two-rank test script that kept references to
    the group), which torchrun reports as a failed job.
    Not after an exception: destroying while another rank is still in a collective can
    hang, and torchrun stops the other ranks anyway.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
