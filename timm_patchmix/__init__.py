"""timm_patchmix: PatchMix (Cascante-Bonilla et al., BMVC 2021) for the timm ecosystem."""
from .grid import cell_areas, cell_bounds, grid_bounds, to_grid
from .mix import PatchMix, PatchMixParams, pack_target, split_target
from .collate import FastCollatePatchMix
from .loss import PatchMixLoss
from .models import PatchHeadModel, create_patchhead, register_patchhead_models, register_patchhead_pretrained

register_patchhead_models()
register_patchhead_pretrained()

__version__ = '0.1.0'

__all__ = [
    'PatchMix', 'PatchMixParams', 'FastCollatePatchMix', 'PatchMixLoss', 'split_target', 'pack_target',
    'cell_bounds', 'grid_bounds', 'cell_areas', 'to_grid', 'PatchHeadModel', 'create_patchhead',
]
