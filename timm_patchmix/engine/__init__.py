"""The training engine: a frozen :class:`TrainConfig` in, ``train(cfg)`` runs it, a :class:`TrainResult` out.

    from timm_patchmix.engine import TrainConfig, train
    result = train(TrainConfig(model='patchhead_resnet32_cifar', patchmix=True, epochs=2))
    result.final_top1, result.best_path

Modules: ``config`` (TrainConfig, recipes, resolution), ``runtime`` (device, DDP, seeds), ``model``, ``loaders``,
``loop`` (one step, one epoch, validation), ``records`` (files written and resumed from) and ``run`` (train()).
The command line (``train.py``, :mod:`timm_patchmix.train`) only parses flags into a config and maps the errors
below to exit statuses.
"""
from .config import RECIPES, SCHEDULERS, DataConfig, TrainConfig, resolve, scaled_lr
from .errors import ConfigError, NonFiniteLossError, TrainSetupError
from .loop import StepEvent
from .run import TrainResult, train

__all__ = ['TrainConfig', 'DataConfig', 'TrainResult', 'StepEvent', 'train', 'resolve', 'scaled_lr', 'RECIPES',
           'SCHEDULERS', 'ConfigError', 'TrainSetupError', 'NonFiniteLossError']
