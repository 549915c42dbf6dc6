"""timm_patchmix: PatchMix (Cascante-Bonilla et al., BMVC 2021) for the timm ecosystem.

``import timm_patchmix`` registers the ``patchhead_*`` models with timm and gives the mixers, the loss and the
patch-head model. The mixers, the loss, ``GuidedPatchMix``, ``MaskTable``, ``MaskTableError`` and the ``hub`` module
load on first use (PEP 562), so the import stays cheap.
"""
import importlib
from typing import Any, List

from .grid import cell_areas, cell_bounds, grid_bounds, to_grid
from .models import PatchHeadModel, create_patchhead, register_patchhead_models

register_patchhead_models()

__version__ = '0.1.0'

# name -> (module, attribute); attribute None means the module itself
_LAZY = {
    'PatchMix': ('.mix', 'PatchMix'),
    'PatchMixParams': ('.mix', 'PatchMixParams'),
    'pack_target': ('.mix', 'pack_target'),
    'split_target': ('.mix', 'split_target'),
    'FastCollatePatchMix': ('.collate', 'FastCollatePatchMix'),
    'FastCollateGuidedPatchMix': ('.collate', 'FastCollateGuidedPatchMix'),
    'PatchMixLoss': ('.loss', 'PatchMixLoss'),
    'GuidedPatchMix': ('.guided', 'GuidedPatchMix'),
    'MaskTable': ('.table', 'MaskTable'),
    'MaskTableError': ('.table', 'MaskTableError'),
    'hub': ('.hub', None),
}

__all__ = [
    'PatchMix', 'PatchMixParams', 'FastCollatePatchMix', 'FastCollateGuidedPatchMix', 'PatchMixLoss', 'split_target',
    'pack_target', 'cell_bounds', 'grid_bounds', 'cell_areas', 'to_grid', 'PatchHeadModel', 'create_patchhead',
    'GuidedPatchMix', 'MaskTable', 'MaskTableError', 'hub',
]


def __getattr__(name: str) -> Any:
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f'module {__name__!r} has no attribute {name!r}') from None
    mod = importlib.import_module(module, __name__)
    value = mod if attr is None else getattr(mod, attr)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> List[str]:
    return sorted(set(globals()) | set(_LAZY))
