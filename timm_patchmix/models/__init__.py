"""Models: the patch-head wrapper for any timm backbone and the paper's CIFAR backbones."""
from . import cifar  # noqa: F401  registers the CIFAR backbones with timm before patchhead_* names are derived
from .cifar import CifarResNet
from .patchhead import PREFIX, PatchHead, PatchHeadModel, create_patchhead
from .pretrained import HUB_NAMESPACE
from .registry import PatchheadWeightsError, register_patchhead_models

__all__ = ['CifarResNet', 'PatchHead', 'PatchHeadModel', 'create_patchhead', 'register_patchhead_models', 'PREFIX',
           'HUB_NAMESPACE', 'PatchheadWeightsError']
