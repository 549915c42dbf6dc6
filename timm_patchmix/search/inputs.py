"""What :meth:`Search.from_checkpoint <timm_patchmix.search.core.Search.from_checkpoint>` reads: the Random-PatchMix
model f_T, the validation images the genes are scored on, and the record of settings a resume must share.

The genes are scored on the held-out images of f_T's training split when f_T was trained with ``--holdout`` (split
``'holdout'``, the default then; the fraction and seed come from the checkpoint), never on its test split. A
checkpoint without a holdout is scored on its validation split, as it was evaluated.

Every problem is an exception naming the file or the setting and what to change: a
:class:`~timm_patchmix.checkpoint.CheckpointError` for an unreadable checkpoint, a :class:`SearchError` for one that
does not fit the search (no patch head, another grid or label set) or for data the search cannot use, and a
:class:`SearchUsageError` (exit status 2) for a ``--val-split`` the checkpoint cannot give: ``holdout`` without a
holdout, or the test split of a checkpoint with one.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch

from ..holdout import index_hash
from ..settings import file_record
from .config import SearchConfig
from .fitness import TooFewImagesError
from .genome import MaskOps

__all__ = ['SearchError', 'SearchUsageError', 'TooFewScoredImagesError', 'HOLDOUT', 'ValidationData', 'load_model',
           'load_validation', 'resume_settings', 'too_few_images']

_logger = logging.getLogger(__name__)

HOLDOUT = 'holdout'  # --val-split: the held-out images of the checkpoint's training split


class SearchError(ValueError):
    """A search that cannot start or resume: inputs that do not fit each other or the settings, or a state file
    that cannot be used."""


class TooFewScoredImagesError(SearchError):
    """A class of the split the genes are scored on with fewer images than K image pairs need: the class's name,
    the images it has and needs, K, and the split (``'holdout'`` for f_T's held-out images)."""

    def __init__(self, message: str, class_name: str, have: int, need: int, k: int, split: str):
        super().__init__(message)
        self.class_name, self.have, self.need, self.k, self.split = class_name, have, need, k, split


class SearchUsageError(SearchError):
    """A flag value the checkpoint cannot honour (a usage error, exit status 2): ``--val-split holdout`` on a
    checkpoint trained without ``--holdout``, or the test split of one trained with it."""


def load_model(cfg: SearchConfig) -> Tuple[torch.nn.Module, Dict[str, Any]]:
    """f_T from ``cfg.checkpoint`` with its metadata, checked to have a patch head on a grid the search handles
    (and ``cfg.grid``, when given)."""
    from ..hub import model_from_weights
    from ..models import PatchHeadModel
    model, meta = model_from_weights(cfg.checkpoint)
    if not isinstance(model, PatchHeadModel):
        raise SearchError(f'{cfg.checkpoint} holds {meta.get("model")!r}, which has no patch head; the search scores '
                          f'patches, so train f_T with --model patchhead_<arch> --patchmix')
    if (meta.get('patchmix') or {}).get('patch_loss') is False:
        raise SearchError(f'{cfg.checkpoint} was trained without the patch loss (--no-patch-loss, or '
                          f'--patch-loss-weight 0): its patch head never trained, and the search scores the patch '
                          f'head\'s predictions; train f_T with the patch loss')
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
    """The images the search scores genes on: their classes and labels, and the images on demand. ``split`` is the
    split's name (``'holdout'`` for the held-out images of the training split, whose record is ``holdout``);
    ``indices`` are the images' indices in that split's dataset (the training split's for the holdout)."""
    dataset: str
    data_dir: str
    split: str
    class_names: List[str]
    labels: np.ndarray
    ds: Any
    data_meta: Dict[str, Any]
    holdout: Optional[Dict[str, Any]] = None
    note: Optional[str] = None  # what the record says these images are to f_T, where that is not the holdout

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def indices(self) -> List[int]:
        return list(self.ds.indices)

    def record(self) -> Dict[str, Any]:
        """Which images the genes were scored on, as the table's ``search_args['scored_on']`` records it."""
        out = {'split': self.split, 'dataset': self.dataset, 'images': len(self.ds), 'sha256': index_hash(self.indices)}
        if self.holdout is not None:
            out['holdout'] = dict(self.holdout)
        if self.note:
            out['note'] = self.note
        return out

    def images(self, device) -> torch.Tensor:
        """Every image, normalised as f_T was trained, ``[N, C, H, W]`` on ``device``."""
        from timm.data.loader import adapt_to_chs
        from ..data import DatasetError, labelled_image, pixel_transform
        c = self.data_meta['input_size'][0]
        mean = torch.tensor(adapt_to_chs(self.data_meta['mean'], c))
        std = torch.tensor(adapt_to_chs(self.data_meta['std'], c))
        self.ds.transform = pixel_transform(*self.data_meta['input_size'],  # as validation made them
                                            self.data_meta['interpolation'], self.data_meta['crop_pct'])
        try:  # each image with the label the genes are scored against
            x = torch.stack([labelled_image(self.ds, i, self.labels[i]) for i in range(len(self.ds))])
        except DatasetError as e:
            raise SearchError(f'the {self.split} images of {self.dataset or self.data_dir or "patchshapes"}: {e}') \
                from None
        x = (x - mean.view(1, -1, 1, 1)) / std.view(1, -1, 1, 1)
        return x.to(device)


def too_few_images(e: TooFewImagesError, data: ValidationData) -> TooFewScoredImagesError:
    """:func:`~timm_patchmix.search.fitness.draw_image_pairs`' error for the images of ``data``, in words: the
    class's name, which images those are, and what gives more."""
    name = data.class_names[e.label] if 0 <= e.label < len(data.class_names) else str(e.label)
    held = data.split == HOLDOUT
    what = "held-out images of f_T's training split" if held else f'images in split {data.split!r}'
    more = 'train f_T with a larger --holdout' if held else 'score the genes on a larger split (--val-split)'
    same = ' (2K: the class is paired with itself)' if e.need > e.k else ''
    return TooFewScoredImagesError(
        f'class {name!r} has {e.have} {what}, fewer than the {e.need} that K={e.k} needs{same}; lower --k or '
        f'{more}', name, e.have, e.need, e.k, data.split)


def _same_split(data_dir: str, a: str, b: str) -> bool:
    """Whether split names ``a`` and ``b`` open the same split: the same name, or the same subfolder of the
    ``data_dir`` of a dataset in a folder (``validation/``, ``./validation``)."""
    if a == b:
        return True
    if not data_dir:
        return False
    pa, pb = os.path.join(data_dir, a), os.path.join(data_dir, b)
    return os.path.isdir(pa) and os.path.isdir(pb) and os.path.samefile(pa, pb)


def _is_test_split(dataset: str, data_dir: str, split: str, test_split: str) -> bool:
    """``split`` reads the test split ``test_split``: the same name (or folder), or (for a dataset whose evaluation
    names all open one split, see :func:`~timm_patchmix.data.has_fixed_splits`) any evaluation split."""
    from ..data import has_fixed_splits, is_train_split
    return _same_split(data_dir, split, test_split) or (
        has_fixed_splits(dataset, data_dir) and not is_train_split(split) and not is_train_split(test_split))


def _scored_split(cfg: SearchConfig, data: Dict[str, Any], dataset: str, data_dir: str) -> str:
    """The split the genes are scored on: ``--val-split``, else ``'holdout'`` for a checkpoint trained with a
    holdout, else the checkpoint's validation split. :class:`SearchUsageError` for a split the checkpoint cannot
    give or must not be scored on."""
    from ..data import split_name_problem
    holdout = data.get('holdout')
    test_split = data.get('val_split', 'validation')
    split = cfg.val_split or (HOLDOUT if holdout else test_split)
    problem = split_name_problem(dataset, data_dir, split) if cfg.val_split not in (None, HOLDOUT) else None
    if problem:
        raise SearchUsageError(f'--val-split {split}: {problem}')
    if split == HOLDOUT and not holdout:
        raise SearchUsageError(
            f'--val-split holdout: {cfg.checkpoint} was trained without --holdout, so it records no held-out '
            f'images to score the genes on. Train f_T with train.py --holdout FRACTION (the pipeline does by '
            f'default), or name a split with --val-split')
    if split != HOLDOUT and holdout and _is_test_split(dataset, data_dir, split, test_split):
        raise SearchUsageError(
            f'--val-split {split}: {cfg.checkpoint} was trained with --holdout {holdout["fraction"]:g}, which makes '
            f'{test_split!r} its test split; the search must not see the test split. Leave --val-split unset (or '
            f'pass --val-split holdout) to score the genes on its held-out training images')
    if not holdout and cfg.val_split is None:
        _logger.warning('%s was trained without --holdout: scoring the genes on its evaluation split %r, the split '
                        'that also selected its best epoch; train f_T with --holdout to keep the search off the test '
                        'split', cfg.checkpoint, split)
    return split


def load_validation(cfg: SearchConfig, model, meta: Dict[str, Any]) -> ValidationData:
    """The images of ``cfg``'s split (see :func:`_scored_split`), checked against the model's classes; ``--val-subset``
    keeps a fixed random subset of them (of the held-out images by the rule ``train.py --val-subset`` uses, so
    the same value scores the images f_T's epochs were evaluated on)."""
    from ..data import DatasetError, build_dataset, dataset_num_classes, make_view, open_dataset, recorded_data_config
    from ..holdout import Holdout, HoldoutError
    data = meta.get('data', {})
    dataset = cfg.dataset if cfg.dataset is not None else data.get('dataset', '')
    data_dir = cfg.data_dir if cfg.data_dir is not None else data.get('data_dir', '')
    split = _scored_split(cfg, data, dataset, data_dir)
    holdout = data.get('holdout') if split == HOLDOUT else None
    trained_on = f'the model in {cfg.checkpoint}'
    try:
        if holdout is not None:
            base, classes = open_dataset(dataset, data_dir, data.get('train_split', 'train'),
                                         class_names=meta.get('class_names') or None, classes_of=trained_on)
            try:
                hold = Holdout.from_record(holdout, len(base), f'{cfg.checkpoint}')
            except HoldoutError as e:
                raise SearchError(str(e)) from None
            ds = make_view(base, classes, hold.subsets(val_subset=cfg.val_subset)[1])
        else:
            ds = build_dataset(dataset, data_dir, split, subset=cfg.val_subset,
                               class_names=meta.get('class_names') or None, classes_of=trained_on)
    except (FileNotFoundError, DatasetError) as e:
        raise SearchError(str(e)) from None
    try:
        num_classes = dataset_num_classes(ds, cfg.num_classes)
    except DatasetError as e:
        raise SearchError(str(e)) from None
    if cfg.num_classes is not None and cfg.num_classes != num_classes:
        raise SearchError(f'--num-classes {cfg.num_classes} differs from the {num_classes} classes of dataset '
                          f'{dataset or "patchshapes"}')
    if model.num_classes != num_classes:
        raise SearchError(f'the model in {cfg.checkpoint} has {model.num_classes} classes, dataset '
                          f'{dataset or "patchshapes"} has {num_classes}')
    names = list(ds.classes) or [str(i) for i in range(num_classes)]
    from ..data import view_labels
    labels = np.array(view_labels(ds))
    note = _scored_note(cfg, meta.get('data', {}), dataset, data_dir, split)
    data = recorded_data_config(data, model)  # how validation made f_T's pixels
    return ValidationData(dataset, data_dir, split, names, labels, ds, data, holdout, note)


def _scored_note(cfg: SearchConfig, data: Dict[str, Any], dataset: str, data_dir: str, split: str) -> Optional[str]:
    """What the scored split is to f_T, for the table's record, where that is not its held-out images: the split
    it trained on (with a warning: the fitness is meant for images f_T did not train on), or the evaluation split
    that chose its best epoch; None for another split."""
    from ..data import is_train_split
    if split == HOLDOUT:
        return None
    if is_train_split(split) or _same_split(data_dir, split, data.get('train_split', 'train')):
        held = ' and its held-out ones' if data.get('holdout') else ''
        _logger.warning('--val-split %s: scoring the genes on the split that %s trained on (its training images '
                        'among them%s), whose accuracy its training flatters; the paper scores them on validation '
                        'images f_T did not train on%s', split, cfg.checkpoint, held,
                        ' (leave --val-split unset to use its held-out images)' if data.get('holdout') else '')
        return f'the split the checkpoint trained on: its training images among them{held}'
    if not data.get('holdout') and _is_test_split(dataset, data_dir, split, data.get('val_split', 'validation')):
        return ('the checkpoint was trained without --holdout: these are its evaluation split\'s images, the split '
                'it was also evaluated on')
    return None


def resume_settings(cfg: SearchConfig, data: ValidationData, grid: Tuple[int, int], n_active: int,
                    device: torch.device) -> Dict[str, Any]:
    """What the population and the cached gene scores mean, by flag: a resume must have the same (generations and
    patience only say when to stop, so a resume may change them). f_T is compared by content. The device type,
    ``--amp`` (where it takes effect: on CUDA) and ``--channels-last`` change the scores' rounding, and AMP more than
    that, so a resume keeps them too rather than mixing two precisions in one cache."""
    return {'--device': device.type, '--amp': bool(cfg.amp and device.type == 'cuda'),
            '--channels-last': cfg.channels_last,
            '--checkpoint': file_record(cfg.checkpoint), '--dataset': data.dataset, '--data-dir': data.data_dir,
            '--val-split': data.split, '--val-subset': cfg.val_subset, 'scored images': data.record()['sha256'],
            '--grid': list(grid),
            '--population': cfg.population, '--n-active': n_active, '--k': cfg.k, '--seed': cfg.seed,
            '--fitness': cfg.fitness, '--score': cfg.score, '--same-class-pairs': cfg.same_class_pairs,
            '--cxpb': cfg.cxpb, '--mutpb': cfg.mutpb, '--tournsize': cfg.tournsize, '--hof': cfg.hof}
