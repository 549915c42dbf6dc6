"""The evolutionary search over class pairs and masks (the paper's second phase)."""
from .fitness import GeneScorer, aggregate, cell_mask_to_pixels, draw_image_pairs
from .genome import Individual, MaskOps, Operators, PairSpace, bits_to_grid, grid_to_bits

__all__ = ['GeneScorer', 'aggregate', 'cell_mask_to_pixels', 'draw_image_pairs', 'Individual', 'MaskOps',
           'Operators', 'PairSpace', 'bits_to_grid', 'grid_to_bits']
