"""Models: the patch-head wrapper for any timm backbone and the paper's CIFAR backbones."""
from . import cifar  # noqa: F401  registers the CIFAR backbones with timm before patchhead_* names are derived
from .cifar import CifarResNet
from .patchhead import PREFIX, PatchHead, PatchHeadModel, create_patchhead
from .registry import register_patchhead_models
from .pretrained import HUB_NAMESPACE, register_patchhead_pretrained

__all__ = ['CifarResNet', 'PatchHead', 'PatchHeadModel', 'create_patchhead', 'register_patchhead_models', 'PREFIX',
           'HUB_NAMESPACE', 'register_patchhead_pretrained']
