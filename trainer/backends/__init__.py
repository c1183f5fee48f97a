"""Training backends behind one small interface: plain PyTorch (``torch``), DeepSpeed
ZeRO-0/1/2/3 (``deepspeed``) and Megatron-Core (``megatron``, GRPO only); ``make_backend``
picks one by ``OptimConfig.backend`` from the ``BACKENDS`` registry, and ``build_backend``
loads the model a step trains and builds its backend in one call.

Modules: ``config`` (the typed settings presets and step configs import), ``schedule`` (LR
schedule, optimizer), ``loading`` (the model a step starts from), ``build`` (the registry,
``make_backend``, ``build_backend``), ``interface`` (``TrainingBackend``, ``ResponseBatch``,
``LossFn``, ``DataParallel``: how a loop drives a backend and why N processes match one), and
one module
per backend: ``torch`` and ``deepspeed`` here, Megatron's in the Megatron package
(``trainer.megatron.backend``, imported only when it is picked: it needs Megatron-Core). The
backends call ``ResponseBatch.hf_log_probs`` on the micro-batches they are given; they import
nothing of the GRPO recipe.
"""

from __future__ import annotations

from trainer.backends.build import BACKENDS, BackendRequest, build_backend, make_backend
from trainer.backends.config import (
    RECOMPUTE_MODULES,
    MegatronSettings,
    OptimConfig,
    ProcessSettings,
)
from trainer.backends.deepspeed import DeepSpeedBackend, deepspeed_config
from trainer.backends.interface import (
    DataParallel,
    LossFn,
    NonFiniteLossError,
    ResponseBatch,
    TrainingBackend,
)
from trainer.backends.schedule import lr_factor, rebase_schedule
from trainer.backends.torch import TorchBackend

__all__ = [
    "BACKENDS",
    "RECOMPUTE_MODULES",
    "BackendRequest",
    "DataParallel",
    "DeepSpeedBackend",
    "LossFn",
    "MegatronSettings",
    "NonFiniteLossError",
    "OptimConfig",
    "ProcessSettings",
    "ResponseBatch",
    "TorchBackend",
    "TrainingBackend",
    "build_backend",
    "deepspeed_config",
    "lr_factor",
    "make_backend",
    "rebase_schedule",
]
