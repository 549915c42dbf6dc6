"""Checkpoint loading: rebuild a model from weights written by ``train.py`` (safetensors + JSON metadata)."""
from __future__ import annotations

from typing import Any, Dict, Tuple

import torch.nn as nn
import timm

from .checkpoint import CheckpointError, load_weights

__all__ = ['model_from_weights']


def model_from_weights(path: str, **overrides) -> Tuple[nn.Module, Dict[str, Any]]:
    """Build the model recorded in ``path``'s metadata, load its weights strictly, return ``(model, meta)``."""
    state, meta = load_weights(path)
    arch = meta.get('model')
    if not arch:
        raise CheckpointError(f'{path} carries no timm_patchmix metadata naming its model; build the model '
                              f'yourself and load the file with safetensors.torch.load_file')
    if not timm.is_model(arch):
        raise CheckpointError(f'{path} was saved from {arch!r}, which is not a registered model; '
                              f'`import timm_patchmix` registers the patchhead_* models')
    kwargs = dict(meta.get('model_kwargs') or {})
    kwargs.update(num_classes=meta.get('num_classes'), **overrides)
    model = timm.create_model(arch, **kwargs)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise CheckpointError(f'{path} does not fit {arch}: missing {list(missing)[:5]}, '
                              f'unexpected {list(unexpected)[:5]}')
    return model.eval(), meta
