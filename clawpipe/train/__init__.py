"""Tree-aware training: GRPO and PPO over packed prefix trees (each unique token computed once).

Public API: :func:`train_step` (the pipeline's stage), :class:`TrainConfig` / :func:`load_config`,
:class:`Trainer` and :func:`build_batch` for custom loops. Heavy imports (torch, transformers) happen
when these names are first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from clawpipe.train.batch import build_batch
    from clawpipe.train.config import TrainConfig, load_config
    from clawpipe.train.step import TrainResult, train_step
    from clawpipe.train.trainer import Trainer

__all__ = ["TrainConfig", "TrainResult", "Trainer", "build_batch", "load_config", "train_step"]

_WHERE = {
    "TrainConfig": "clawpipe.train.config",
    "load_config": "clawpipe.train.config",
    "build_batch": "clawpipe.train.batch",
    "TrainResult": "clawpipe.train.step",
    "train_step": "clawpipe.train.step",
    "Trainer": "clawpipe.train.trainer",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(name)
