"""Pretrained tags of ``patchhead_*`` models: weights that include the patch head, in the project's Hub namespace.

``timm.create_model('patchhead_resnet50.gpm_in1k', pretrained=True)`` downloads ``model.safetensors`` from the tag's
``hf_hub_id`` through timm's own loader; ``num_classes=N`` for another N re-initialises both heads for fine-tuning.
Any other tag (``patchhead_resnet50.a1_in1k``) and no tag select the backbone's own timm weights under a fresh
patch head.

Tags: ``gpm`` = Guided PatchMix (the paper's final model f_O), ``rpm`` = Random PatchMix (f_T); then the training
data. The ImageNet tags are the recipe's targets (see the README's "Hub" section): they need ImageNet and GPUs. The
small tags are the example checkpoints trained on the machines of this project, kept in ``hub/`` in the
repository in the Hub-folder layout.
"""
from __future__ import annotations

from typing import Any, Dict

from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from timm.models import PretrainedCfg

from . import registry as patchhead
from ..compat import registry as _registry

__all__ = ['HUB_NAMESPACE', 'PATCHHEAD_PRETRAINED', 'register_patchhead_pretrained']

HUB_NAMESPACE = 'timm-patchmix'
_CIFAR_MEAN, _CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.247, 0.2435, 0.2616)

_IN1K = dict(num_classes=1000, input_size=(3, 224, 224), pool_size=(7, 7), crop_pct=0.95, interpolation='bicubic',
             mean=IMAGENET_DEFAULT_MEAN, std=IMAGENET_DEFAULT_STD, first_conv='backbone.conv1',
             classifier=('backbone.fc', 'patch_head.fc'))
_SMALL = dict(input_size=(3, 32, 32), pool_size=(8, 8), crop_pct=1.0, interpolation='bilinear', mean=_CIFAR_MEAN,
              std=_CIFAR_STD, first_conv='backbone.conv1', classifier=('backbone.fc', 'patch_head.fc'))

PATCHHEAD_PRETRAINED: Dict[str, Dict[str, Any]] = {
    'patchhead_resnet50.gpm_in1k': dict(_IN1K),
    'patchhead_resnet50.rpm_in1k': dict(_IN1K),
    # example checkpoints (hub/<name>/ in the repository)
    'patchhead_resnet32_cifar.rpm_patchshapes': dict(_SMALL, num_classes=10),
    'patchhead_resnet32_cifar.gpm_fmnist': dict(_SMALL, num_classes=10),
}


def register_patchhead_pretrained() -> int:
    """Add the tags above to timm's pretrained registry (``timm.list_pretrained('patchhead_*')`` lists them)."""
    added = 0
    for full, fields in PATCHHEAD_PRETRAINED.items():
        arch, tag = full.split('.', 1)
        if full in _registry._model_pretrained_cfgs or arch not in _registry._model_entrypoints:
            continue
        cfg = PretrainedCfg(hf_hub_id=f'{HUB_NAMESPACE}/{full}', architecture=arch, tag=tag, license='apache-2.0',
                            **fields)
        _registry._model_pretrained_cfgs[full] = cfg
        _registry._model_has_pretrained.add(full)
        _registry._model_with_tags[arch].append(full)
        patchhead._PATCHHEAD_TAGS.add(full)
        added += 1
    return added
