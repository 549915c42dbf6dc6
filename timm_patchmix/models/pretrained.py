"""Pretrained tags of ``patchhead_*`` models: weights that hold both heads, shipped inside the package.

``timm.create_model('patchhead_resnet32_cifar.gpm_fmnist', pretrained=True)`` loads
``timm_patchmix/weights/<name>/model.safetensors`` through timm's own loader, offline, from a wheel or an editable
install alike; ``num_classes=N`` for another N re-initialises both heads for fine-tuning. ``timm.list_pretrained(
'patchhead_*')`` lists exactly these tags, and ``timm.is_model_pretrained`` is true for them and for the architecture
whose default they are.

The backbone's own timm tags (``patchhead_resnet50.a1_in1k``) are accepted too: they load the backbone's timm weights
under a fresh patch head, and are not listed (registering a copy of every timm tag would cost ~30 ms per import).

Tags: ``gpm`` = Guided PatchMix (the paper's final model f_O), ``rpm`` = Random PatchMix (f_T); then the training data.
ImageNet weights are not published: ``docs/hub.md`` has the recipe, and the names below fail at once saying so.
"""
from __future__ import annotations

import os
from typing import Any, Dict

__all__ = ['HUB_NAMESPACE', 'WEIGHTS_DIR', 'PATCHHEAD_PRETRAINED', 'UNPUBLISHED', 'pretrained_cfgs']

HUB_NAMESPACE = 'timm-patchmix'
WEIGHTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'weights')
_CIFAR_MEAN, _CIFAR_STD = (0.4914, 0.4822, 0.4465), (0.247, 0.2435, 0.2616)
_SMALL = dict(input_size=(3, 32, 32), pool_size=(8, 8), crop_pct=1.0, crop_mode='center', interpolation='bilinear',
              mean=_CIFAR_MEAN, std=_CIFAR_STD, first_conv='backbone.conv1',
              classifier=('backbone.fc', 'patch_head.fc'), license='apache-2.0')

# the first tag of an architecture is its default (what pretrained=True without a tag loads)
PATCHHEAD_PRETRAINED: Dict[str, Dict[str, Any]] = {
    'patchhead_resnet32_cifar.gpm_fmnist': dict(_SMALL, num_classes=10),
    'patchhead_resnet32_cifar.rpm_patchshapes': dict(_SMALL, num_classes=10),
}

# names of the ImageNet recipe's targets, whose weights do not exist yet
UNPUBLISHED = {
    'patchhead_resnet50.gpm_in1k': 'Guided PatchMix, ImageNet-1k',
    'patchhead_resnet50.rpm_in1k': 'Random PatchMix, ImageNet-1k',
}


def pretrained_cfgs() -> Dict[str, Dict[str, Any]]:
    """``{'arch.tag': cfg fields}`` for ``timm.models.generate_default_cfgs``: each tag's weights file in the
    package, and its Hub folder's model card as the ``origin_url``."""
    out = {}
    for full, fields in PATCHHEAD_PRETRAINED.items():
        folder = os.path.join(WEIGHTS_DIR, full)
        out[full] = dict(fields, file=os.path.join(folder, 'model.safetensors'),
                         origin_url=os.path.join(folder, 'README.md'))
        names = _label_names(os.path.join(folder, 'config.json'), fields['num_classes'])
        if names:  # the class names, as a model from the same folder through local-dir: carries them
            out[full]['label_names'] = names
    return out


def _label_names(path: str, num_classes: int):
    """The ``label_names`` of the weights folder's ``config.json`` (a tuple of ``num_classes`` strings), or None
    where the file or the list is missing or malformed (a tag loads without names then, as before)."""
    import json
    try:
        with open(path, encoding='utf-8') as f:
            names = json.load(f).get('label_names')
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(names, list) and len(names) == num_classes and all(isinstance(n, str) for n in names):
        return tuple(names)
    return None
