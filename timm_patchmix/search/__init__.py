"""The evolutionary search over class pairs and masks (the paper's second phase).

    from timm_patchmix.search import SearchConfig, search
    result = search(SearchConfig(checkpoint='output/train/rpm/best.safetensors', output='output/search'))
    result.table_path, result.best_fitness, result.generations

``search(cfg)`` runs a whole search from files to files; :class:`Search` is the loop itself, built from a pair
space, a grid, a gene scorer and :class:`Evolution` settings (no I/O), or from files with
``Search.from_checkpoint(cfg)``. ``cli`` is the command line (``search.py``).
"""
from .command import build_parser, cli, config_from_args, main, parse_config
from .config import Evolution, SearchConfig, SearchResult
from .core import GenerationCallback, Search, SearchError
from .inputs import HOLDOUT, SearchUsageError, TooFewScoredImagesError
from .fitness import GeneScorer, aggregate, cell_mask_to_pixels, draw_image_pairs
from .genome import Individual, MaskOps, Operators, PairSpace, bits_to_grid, grid_to_bits
from .run import search

__all__ = ['search', 'SearchConfig', 'SearchResult', 'Evolution', 'Search', 'SearchError', 'SearchUsageError',
           'TooFewScoredImagesError', 'HOLDOUT', 'GenerationCallback',
           'cli', 'main', 'build_parser', 'parse_config', 'config_from_args',
           'GeneScorer', 'aggregate', 'cell_mask_to_pixels', 'draw_image_pairs', 'Individual', 'MaskOps',
           'Operators', 'PairSpace', 'bits_to_grid', 'grid_to_bits']
