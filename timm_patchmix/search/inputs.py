"""What :meth:`Search.from_checkpoint <timm_patchmix.search.core.Search.from_checkpoint>` reads: the Random-PatchMix
model f_T, the validation images the genes are scored on, and the record of settings a resume must share.

Every problem is an exception naming the file or the setting and what to change: a
:class:`~timm_patchmix.checkpoint.CheckpointError` for an unreadable checkpoint, a :class:`SearchError` for one that
does not fit the search (no patch head, another grid or label set) or for data the search cannot use.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Tuple

import numpy as np
import torch

from ..settings import file_record
from .config import SearchConfig
from .genome import MaskOps

__all__ = ['SearchError', 'ValidationData', 'load_model', 'load_validation', 'resume_settings']


class SearchError(ValueError):
    """A search that cannot start or resume: inputs that do not fit each other or the settings, or a state file
    that cannot be used."""


def load_model(cfg: SearchConfig) -> Tuple[torch.nn.Module, Dict[str, Any]]:
    """f_T from ``cfg.checkpoint`` with its metadata, checked to have a patch head on a grid the search handles
    (and ``cfg.grid``, when given)."""
    from ..hub import model_from_weights
    from ..models import PatchHeadModel
    model, meta = model_from_weights(cfg.checkpoint)
    if not isinstance(model, PatchHeadModel):
        raise SearchError(f'{cfg.checkpoint} holds {meta.get("model")!r}, which has no patch head; the search scores '
                          f'patches, so train f_T with --model patchhead_<arch> --patchmix')
    rows, cols = tuple(model.grid)
    if rows * cols > MaskOps.MAX_CELLS:
        raise SearchError(f'the model in {cfg.checkpoint} has a {rows}x{cols} grid, {rows * cols} cells; the search '
                          f'handles grids of up to {MaskOps.MAX_CELLS} cells')
    if cfg.grid is not None and tuple(cfg.grid) != (rows, cols):
        want = cfg.grid
        raise SearchError(f'--grid {want[0]}x{want[1]} differs from the {rows}x{cols} grid of the model in '
                          f'{cfg.checkpoint}; leave --grid unset to use the model\'s')
    return model, meta


@dataclass
class ValidationData:
    """The validation split as the search uses it: its classes and labels, and its images on demand."""
    dataset: str
    data_dir: str
    split: str
    class_names: List[str]
    labels: np.ndarray
    ds: Any
    data_meta: Dict[str, Any]

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def images(self, device) -> torch.Tensor:
        """Every image, normalised as f_T was trained, ``[N, C, H, W]`` on ``device``."""
        from timm.data.loader import adapt_to_chs
        from ..data import pixel_transform
        c = self.data_meta['input_size'][0]
        mean = torch.tensor(adapt_to_chs(self.data_meta['mean'], c))
        std = torch.tensor(adapt_to_chs(self.data_meta['std'], c))
        self.ds.transform = pixel_transform(*self.data_meta['input_size'])
        x = torch.stack([self.ds[i][0] for i in range(len(self.ds))])
        x = (x - mean.view(1, -1, 1, 1)) / std.view(1, -1, 1, 1)
        return x.to(device)


def load_validation(cfg: SearchConfig, model, meta: Dict[str, Any]) -> ValidationData:
    """The validation split of ``cfg`` (default: the checkpoint's), checked against the model's classes."""
    from ..data import build_dataset, dataset_num_classes
    data = meta.get('data', {})
    dataset = cfg.dataset if cfg.dataset is not None else data.get('dataset', '')
    data_dir = cfg.data_dir if cfg.data_dir is not None else data.get('data_dir', '')
    split = cfg.val_split or data.get('val_split', 'validation')
    try:
        ds = build_dataset(dataset, data_dir, split, subset=cfg.val_subset)
    except FileNotFoundError as e:
        raise SearchError(str(e)) from None
    try:
        num_classes = dataset_num_classes(ds)
    except ValueError as e:
        raise SearchError(str(e)) from None
    if cfg.num_classes is not None and cfg.num_classes != num_classes:
        raise SearchError(f'--num-classes {cfg.num_classes} differs from the {num_classes} classes of dataset '
                          f'{dataset or "patchshapes"}')
    if model.num_classes != num_classes:
        raise SearchError(f'the model in {cfg.checkpoint} has {model.num_classes} classes, dataset '
                          f'{dataset or "patchshapes"} has {num_classes}')
    names = list(ds.classes) or [str(i) for i in range(num_classes)]
    labels = np.array([ds.base.targets[i] for i in ds.indices]) if hasattr(ds.base, 'targets') else \
        np.array([ds[i][1] for i in range(len(ds))])
    return ValidationData(dataset, data_dir, split, names, labels, ds, data)


def resume_settings(cfg: SearchConfig, data: ValidationData, grid: Tuple[int, int], n_active: int
                    ) -> Dict[str, Any]:
    """What the population and the cached gene scores mean, by flag: a resume must have the same (generations and
    patience only say when to stop, so a resume may change them). f_T is compared by content."""
    return {'--checkpoint': file_record(cfg.checkpoint), '--dataset': data.dataset, '--data-dir': data.data_dir,
            '--val-split': data.split, '--val-subset': cfg.val_subset, '--grid': list(grid),
            '--population': cfg.population, '--n-active': n_active, '--k': cfg.k, '--seed': cfg.seed,
            '--fitness': cfg.fitness, '--score': cfg.score, '--same-class-pairs': cfg.same_class_pairs,
            '--cxpb': cfg.cxpb, '--mutpb': cfg.mutpb, '--tournsize': cfg.tournsize, '--hof': cfg.hof}
