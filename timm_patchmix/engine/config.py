"""Every setting of a training run in one frozen :class:`TrainConfig`, resolved once.

A config comes from flags (``train.py`` parses them into one), is completed by its recipe
(:meth:`TrainConfig.with_recipe`) and, once the model is built, by :func:`resolve`: the grid is then the model's own
(``model.grid`` is the one source of truth), the learning rate is scaled to the global batch and timm's data config
is fixed. Nothing writes into a config after that; a derived config is a new one (``dataclasses.replace``).
"""
from __future__ import annotations

import dataclasses
import math
import numbers
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Dict, List, Mapping, Optional, Sequence, Tuple

from ..cli_types import (bounds_of, float_range, fraction, nonneg_float, nonneg_int, positive_float, positive_int,
                         probability, seed_int)
from ..data import Augment
from .errors import ConfigError

__all__ = ['TIMM_DEFAULTS', 'RECIPES', 'SCHEDULERS', 'CLIP_MODES', 'DEFAULT_GRID', 'VALUE_TYPES', 'SEQUENCES',
           'PATHS', 'UNFLAGGED', 'KWARG_FLAGS', 'DataConfig', 'TrainConfig', 'resolve', 'scaled_lr', 'normal_grid',
           'check_setting']

# Defaults of timm's train.py for the flags a recipe may change; a recipe fills only flags the user left unset.
TIMM_DEFAULTS: Dict[str, Any] = dict(model='resnet50', epochs=300, batch_size=128, opt='sgd', lr=None, momentum=0.9,
                                     weight_decay=2e-5, sched='cosine', warmup_epochs=5, warmup_lr=1e-5, min_lr=0.0,
                                     smoothing=0.1, workers=4, lr_base=0.1, lr_base_size=256, lr_base_scale='')
# timm's rule for the learning rate when --lr is not given: any of these given, a recipe's lr is left out for it
LR_RULE = ('lr_base', 'lr_base_size', 'lr_base_scale')
RECIPES: Dict[str, Dict[str, Any]] = {
    'timm': {},
    # the embedded data at 32x32: a few minutes on two CPU cores
    'demo': dict(model='resnet32_cifar', epochs=4, batch_size=128, lr=0.1, weight_decay=5e-4, warmup_epochs=0,
                 smoothing=0.0, workers=2),
    # the paper's CIFAR recipe: 400 epochs, batch 100, SGD Nesterov 0.9, wd 5e-4, lr 0.1, cosine
    'paper-cifar': dict(model='preactresnet18_cifar', epochs=400, batch_size=100, opt='sgd', lr=0.1, momentum=0.9,
                        weight_decay=5e-4, sched='cosine', warmup_epochs=0, smoothing=0.0),
}
SCHEDULERS = ('cosine', 'tanh', 'step', 'multistep', 'plateau', 'poly', 'constant', 'rsqrt')  # timm's factory's
CLIP_MODES = ('norm', 'value', 'agc')  # timm.utils.dispatch_clip_grad's
DEFAULT_GRID = (4, 4)
# the values a setting with a fixed set of choices may take (the command line offers the same choices)
CHOICES: Dict[str, Tuple[Any, ...]] = {
    'clip_mode': CLIP_MODES, 'sched': SCHEDULERS, 'recipe': tuple(RECIPES), 'lr_base_scale': ('', 'linear', 'sqrt'),
    'mixup_mode': ('batch', 'pair', 'elem', 'half'), 'patchmix_mode': ('elem', 'pair', 'batch'),
    'amp_dtype': ('float16', 'bfloat16'), 'eval_metric': ('top1', 'top5', 'loss'),
    'interpolation': ('nearest', 'bilinear', 'bicubic', 'box', 'hamming', 'lanczos'),
    'train_interpolation': ('random', 'nearest', 'bilinear', 'bicubic', 'box', 'hamming', 'lanczos'),
    'remode': ('const', 'rand', 'pixel'),
    'lr_source': ('flag', 'recipe', 'rule'),
    'dist_bn': ('', 'broadcast', 'reduce')}
# The range of every numeric setting: the argument type its flag parses each value with (timm_patchmix.cli_types),
# whose bounds TrainConfig also checks a value given in Python against: one table for both (train.py's flags take
# their types from it). An int setting takes an integer (not a bool, a float or a string), a float setting a finite
# int or float; a setting whose default is None also takes None.
VALUE_TYPES: Dict[str, Callable[[str], Any]] = {
    # dataset
    'train_subset': positive_int, 'val_subset': positive_int, 'holdout': fraction, 'holdout_seed': nonneg_int,
    'test_subset': positive_int,
    # model
    'num_classes': positive_int, 'in_chans': positive_int, 'img_size': positive_int, 'input_size': positive_int,
    'drop': probability, 'drop_path': probability, 'drop_block': probability, 'bn_momentum': probability,
    'bn_eps': positive_float, 'head_init_scale': float_range(), 'head_init_bias': float_range(),
    'model_ema_decay': fraction, 'mean': float_range(),
    'std': positive_float, 'crop_pct': positive_float,
    # training augmentation
    'scale': float_range(0.0, 1.0, lo_open=True, name='area_fraction'), 'ratio': positive_float, 'hflip': probability,
    'vflip': probability, 'color_jitter': nonneg_float, 'reprob': probability, 'recount': positive_int,
    'aug_repeats': nonneg_float,
    # optimizer and schedule
    'batch_size': positive_int, 'validation_batch_size': positive_int, 'grad_accum_steps': positive_int,
    'opt_eps': nonneg_float,
    'opt_betas': fraction, 'momentum': nonneg_float, 'weight_decay': nonneg_float, 'layer_decay': positive_float,
    'clip_grad': nonneg_float,
    'lr': positive_float, 'lr_base': positive_float, 'lr_base_size': positive_int, 'min_lr': nonneg_float,
    'warmup_lr': nonneg_float, 'epochs': positive_int, 'warmup_epochs': nonneg_int, 'cooldown_epochs': nonneg_int,
    'decay_epochs': positive_float, 'decay_rate': positive_float, 'decay_milestones': positive_int,
    'patience_epochs': nonneg_int, 'lr_noise': nonneg_float, 'lr_noise_pct': nonneg_float, 'lr_noise_std': nonneg_float,
    'lr_cycle_mul': positive_float, 'lr_cycle_decay': nonneg_float, 'lr_cycle_limit': positive_int,
    'lr_k_decay': positive_float,
    # mixing and loss
    'mixup': nonneg_float, 'cutmix': nonneg_float, 'cutmix_minmax': probability, 'mixup_prob': probability,
    'mixup_switch_prob': probability, 'mixup_off_epoch': nonneg_int, 'smoothing': fraction, 'grid': positive_int,
    'patchmix_alpha': positive_float, 'patchmix_prob': probability, 'patchmix_off_epoch': nonneg_int,
    'patch_loss_weight': nonneg_float, 'guided_prob': probability, 'random_prob': probability,
    'bce_target_thresh': fraction, 'bce_pos_weight': positive_float,
    # running
    'workers': nonneg_int, 'seed': seed_int, 'log_interval': positive_int, 'fgsm': nonneg_float,
    'checkpoint_hist': nonneg_int,
}
# settings that hold several values, each of its VALUE_TYPES: how many (as their flags' nargs: (min, max), None for
# no maximum); ``grid`` (P or rows cols) is checked by normal_grid
SEQUENCES: Dict[str, Tuple[int, Optional[int]]] = {
    'input_size': (3, 3), 'opt_betas': (1, None), 'cutmix_minmax': (2, 2), 'grid': (1, 2), 'fgsm': (1, None),
    'decay_milestones': (1, None), 'lr_noise': (1, 2), 'mean': (1, None), 'std': (1, None), 'scale': (2, 2),
    'ratio': (2, 2)}
# settings of keyword arguments by name (timm's ParseKwargs flags), for the model and the optimizer
KWARGS = ('model_kwargs', 'opt_kwargs')
# settings that name a file or folder: a str or an os.PathLike (kept as its str)
PATHS = ('data_dir', 'initial_checkpoint', 'resume', 'output', 'patchmix_table')
# settings no flag sets: the command line itself, and those resolved from the model and the batch (see resolve)
UNFLAGGED = ('command', 'arch', 'patch_head', 'data_config', 'lr_source')
# the keyword arguments of timm.create_model that train.py passes itself, by the flag that sets each
KWARG_FLAGS = {'drop_path_rate': '--drop-path', 'drop_rate': '--drop', 'in_chans': '--in-chans',
               'grid': '--patchmix-grid', 'per_position': '--per-position-head', 'num_classes': '--num-classes',
               'pretrained': '--pretrained', 'drop_block_rate': '--drop-block', 'global_pool': '--gp',
               'bn_momentum': '--bn-momentum', 'bn_eps': '--bn-eps'}


def _shown(value: Any) -> str:
    """A flag's value as typed: ``2 2`` for a grid, ``0.1``, ``avg``; a switch as itself (empty)."""
    if value is True:
        return ''
    if isinstance(value, tuple):
        return ' '.join(map(str, value))
    return f'{value:g}' if isinstance(value, float) else str(value)


def _flag(name: str) -> str:
    return '--patchmix-grid' if name == 'grid' else '--' + name.replace('_', '-')


def normal_grid(grid) -> Optional[Tuple[int, int]]:
    """``None``, ``P``, ``[P]`` or ``(rows, cols)`` as ``None`` or ``(rows, cols)``."""
    if grid is None:
        return None
    if isinstance(grid, numbers.Integral) and not isinstance(grid, bool):
        cells = [grid]
    elif isinstance(grid, (str, bytes, Mapping)) or not _iterable(grid):
        raise ConfigError(f'takes P or rows cols, integers >= 1, got {grid!r}', '--patchmix-grid')
    else:
        cells = list(grid)
    if len(cells) not in (1, 2):
        raise ConfigError(f'takes P or rows cols, got {len(cells)} values {" ".join(map(str, cells))}',
                          '--patchmix-grid')
    if not all(positive_int.bounds.accepts(c) for c in cells):
        raise ConfigError(f'rows and cols must be integers >= 1, got {cells}', '--patchmix-grid')
    cells = [int(c) for c in cells]
    return (cells[0], cells[0]) if len(cells) == 1 else (cells[0], cells[1])


def _iterable(value: Any) -> bool:
    try:
        iter(value)
    except TypeError:
        return False
    return True


def _builtin(value: Any) -> Any:
    """A number as Python's own int or float (numpy's scalars are numbers too, but not YAML's)."""
    if isinstance(value, bool) or type(value) in (int, float):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        return float(value)
    return value


@dataclass(frozen=True)
class DataConfig:
    """timm's data config of the run (``timm.data.resolve_data_config``'s keys)."""
    input_size: Tuple[int, int, int]
    mean: Tuple[float, ...]
    std: Tuple[float, ...]
    interpolation: str = 'bilinear'
    crop_pct: float = 1.0
    crop_mode: str = 'center'

    @classmethod
    def from_timm(cls, cfg: Mapping[str, Any]) -> 'DataConfig':
        return cls(tuple(cfg['input_size']), tuple(cfg['mean']), tuple(cfg['std']), cfg['interpolation'],
                   cfg['crop_pct'], cfg.get('crop_mode', 'center'))

    def as_timm(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class TrainConfig:
    """The settings of one training run, named as ``train.py``'s flags (``grid`` is ``--patchmix-grid``).

    ``None`` means "the recipe's value" (:meth:`with_recipe`) or "resolved from the model" (``lr``, ``grid``,
    ``num_classes``, ``arch``, ``patch_head``, ``data_config``; see :func:`resolve`). ``lr`` left ``None`` with
    ``lr_base``, ``lr_base_size`` or ``lr_base_scale`` given is timm's rule (:func:`scaled_lr`), whatever the
    recipe's ``lr``."""
    # dataset
    dataset: str = ''
    data_dir: str = ''
    train_split: str = 'train'
    val_split: str = 'validation'
    dataset_download: bool = False
    train_subset: Optional[int] = None
    val_subset: Optional[int] = None
    # held-out validation: a fixed fraction of the training split selects the best epoch; --val-split is then the
    # test split, evaluated once at the end (see timm_patchmix.holdout)
    holdout: float = 0.0
    holdout_seed: int = 0
    test_subset: Optional[int] = None
    # model
    model: Optional[str] = None
    pretrained: bool = False
    initial_checkpoint: str = ''
    resume: str = ''
    # transfer: a fresh classifier after the weights are loaded; train the classifier only (see engine.model)
    reset_head: bool = False
    linear_probe: bool = False
    num_classes: Optional[int] = None
    in_chans: Optional[int] = None
    img_size: Optional[int] = None
    input_size: Optional[Tuple[int, int, int]] = None
    # timm's data config in place of the model's: normalisation (one value, or one per channel), and the evaluation
    # crop and resize of inputs larger than the CIFAR-style transform's (see engine.loaders.resolve_data)
    mean: Optional[Tuple[float, ...]] = None
    std: Optional[Tuple[float, ...]] = None
    crop_pct: Optional[float] = None
    interpolation: Optional[str] = None
    model_kwargs: Dict[str, Any] = field(default_factory=dict)
    drop: float = 0.0
    drop_path: Optional[float] = None
    # timm's other model flags: DropBlock, the global pooling, BatchNorm's momentum and eps (for the models whose
    # builders take them), and the classifier's initial scale and bias (both heads of a patchhead_ model)
    drop_block: Optional[float] = None
    gp: Optional[str] = None
    bn_momentum: Optional[float] = None
    bn_eps: Optional[float] = None
    head_init_scale: Optional[float] = None
    head_init_bias: Optional[float] = None
    grad_checkpointing: bool = False
    torchcompile: Optional[str] = None
    # timm's model EMA (timm.utils.ModelEmaV3): what is evaluated, selected and saved as weights
    model_ema: bool = False
    model_ema_decay: float = 0.9998
    model_ema_warmup: bool = False
    # training augmentation, timm's flags and defaults (see timm_patchmix.data.image_transform): None is timm's
    # value on timm's transform (scale (0.08, 1), ratio (3/4, 4/3), colour jitter 0.4, 'random' interpolation) and
    # off on the CIFAR-style one, which neither resizes nor jitters unless told; random erasing follows normalisation
    # (the fields and defaults of timm_patchmix.data.Augment, which the loaders build from them)
    no_aug: bool = Augment.no_aug
    scale: Optional[Tuple[float, float]] = Augment.scale
    ratio: Optional[Tuple[float, float]] = Augment.ratio
    hflip: float = Augment.hflip
    vflip: float = Augment.vflip
    color_jitter: Optional[float] = Augment.color_jitter
    aa: Optional[str] = Augment.aa
    reprob: float = Augment.reprob
    remode: str = Augment.remode
    recount: int = Augment.recount
    train_interpolation: Optional[str] = Augment.train_interpolation
    aug_repeats: float = 0.0  # timm's RepeatAugSampler: each image this many times an epoch (0: off)
    # optimizer and schedule
    batch_size: Optional[int] = None
    validation_batch_size: Optional[int] = None
    grad_accum_steps: int = 1  # batches whose gradients add up to one optimizer update
    opt: Optional[str] = None
    opt_eps: Optional[float] = None
    opt_betas: Optional[Tuple[float, ...]] = None
    momentum: Optional[float] = None
    weight_decay: Optional[float] = None
    # timm's optimizer factory: extra keyword arguments of the optimizer, and layer-wise lr decay (by the model's
    # group_matcher: each layer's lr is this times the one above it, the classifier and a patch head at the full lr)
    opt_kwargs: Dict[str, Any] = field(default_factory=dict)
    layer_decay: Optional[float] = None
    clip_grad: Optional[float] = None
    clip_mode: str = 'norm'
    sched: Optional[str] = None
    sched_on_updates: bool = False
    lr: Optional[float] = None
    lr_base: Optional[float] = None
    lr_base_size: Optional[int] = None
    lr_base_scale: Optional[str] = None
    min_lr: Optional[float] = None
    warmup_lr: Optional[float] = None
    epochs: Optional[int] = None
    warmup_epochs: Optional[int] = None
    cooldown_epochs: int = 0
    decay_epochs: float = 90
    decay_milestones: Tuple[int, ...] = (90, 180, 270)
    decay_rate: float = 0.1
    patience_epochs: int = 10
    # timm's scheduler options, with its train.py's defaults (see timm.scheduler.create_scheduler_v2)
    warmup_prefix: bool = False
    lr_noise: Optional[Tuple[float, ...]] = None
    lr_noise_pct: float = 0.67
    lr_noise_std: float = 1.0
    lr_cycle_mul: float = 1.0
    lr_cycle_decay: float = 0.5
    lr_cycle_limit: int = 1
    lr_k_decay: float = 1.0
    recipe: Optional[str] = None
    # mixing and loss
    mixup: float = 0.0
    cutmix: float = 0.0
    cutmix_minmax: Optional[Tuple[float, float]] = None
    mixup_prob: float = 1.0
    mixup_switch_prob: float = 0.5
    mixup_mode: str = 'batch'
    mixup_off_epoch: int = 0
    smoothing: Optional[float] = None
    # timm's binary cross-entropy in place of the (soft) cross-entropy: the image's and, in PatchMixLoss, each cell's
    bce_loss: bool = False
    bce_sum: bool = False
    bce_target_thresh: Optional[float] = None
    bce_pos_weight: Optional[float] = None
    patchmix: bool = False
    grid: Optional[Tuple[int, int]] = None
    patchmix_alpha: float = 1.0
    patchmix_prob: float = 1.0
    patchmix_mode: str = 'elem'
    patchmix_collate: bool = False
    patchmix_off_epoch: int = 0
    no_patch_loss: bool = False
    no_image_loss: bool = False
    patch_loss_weight: float = 1.0
    per_position_head: bool = False
    patchmix_table: str = ''
    guided_prob: float = 1 / 3
    random_prob: float = 1 / 3
    # running
    amp: bool = False
    amp_dtype: str = 'float16'
    channels_last: bool = False
    dist_bn: str = 'reduce'  # DDP: BatchNorm running stats made equal on every rank before each validation
    workers: Optional[int] = None
    pin_mem: bool = False
    no_prefetcher: bool = False
    device_data: bool = False  # the dataset whole on the device (see engine.device_data)
    device: Optional[str] = None
    seed: int = 42
    output: str = ''
    experiment: str = ''
    log_interval: int = 50
    eval_metric: str = 'top1'
    checkpoint_hist: int = 0  # the best epochs' weights kept as checkpoint-<epoch>.safetensors (see records)
    fgsm: Optional[Tuple[float, ...]] = None
    no_progress: bool = False
    command: str = ''  # the command line that started the run, recorded in the checkpoints
    # resolved from the model (see resolve)
    arch: Optional[str] = None
    patch_head: Optional[bool] = None
    data_config: Optional[DataConfig] = None
    # where the lr comes from: 'flag' (--lr), 'recipe' (its lr) or 'rule' (timm's, from --lr-base and the global
    # batch); a config file's lr is read only when it was a flag's (the recipe or the rule sets it again)
    lr_source: Optional[str] = None

    def __post_init__(self):
        self._normalise()
        self._check()

    def _normalise(self) -> None:
        """Sequences become tuples (so that no part of a config can change after it is made), numpy's numbers
        Python's, paths str; the grid ``(rows, cols)``. A value that cannot be read so is a :class:`ConfigError`."""
        for name in SEQUENCES:
            value = getattr(self, name)
            if name == 'grid' or value is None:
                continue
            if isinstance(value, (str, bytes, Mapping)) or not _iterable(value):
                raise _value_error(name, value)
            object.__setattr__(self, name, tuple(_builtin(v) for v in value))
        for name in VALUE_TYPES:
            if name not in SEQUENCES:
                object.__setattr__(self, name, _builtin(getattr(self, name)))
        for name in PATHS:
            value = getattr(self, name)
            if isinstance(value, os.PathLike):
                object.__setattr__(self, name, os.fspath(value))
        try:
            object.__setattr__(self, 'grid', normal_grid(self.grid))
        except ConfigError as e:
            raise ConfigError(f'{e.message} (TrainConfig.grid)', e.flag) from None
        for name in KWARGS:
            kwargs = getattr(self, name)
            if kwargs is not None:
                _check_kwargs(name, kwargs)
            object.__setattr__(self, name, dict(kwargs or {}))

    def _check(self) -> None:
        """Each value of its type and in its range (:data:`VALUE_TYPES`, the flags' own), each choice one of its
        flag's, then the settings that contradict each other: each a usage error (:class:`ConfigError`, exit
        status 2 on the command line)."""
        self._check_values()
        for name in CHOICES:
            _check_choice(name, getattr(self, name))
        if self.torchcompile is not None:  # torch names a bad backend only when the first batch is traced
            import torch.compiler
            known = torch.compiler.list_backends(exclude_tags=())
            if self.torchcompile not in known:
                raise ConfigError(f'{self.torchcompile!r} is not a torch.compile backend here; one of '
                                  f'{", ".join(torch.compiler.list_backends())} (or a debug one such as aot_eager)',
                                  '--torchcompile')
        if self.test_subset is not None and not self.holdout:
            raise ConfigError('--test-subset caps the test split of a run with --holdout; without --holdout every '
                              'epoch is evaluated on --val-split, which --val-subset caps')
        if self.data_dir and self.dataset in ('patchshapes', 'sklearn_digits'):  # (it chose timm's recipe, unused)
            raise ConfigError(f'--dataset {self.dataset} is built in and reads no folder, so --data-dir '
                              f'{self.data_dir} would go unused; drop --data-dir, or name the dataset the folder holds '
                              f'(none: an image folder)', '--data-dir')
        from ..data import has_fixed_splits, is_train_split, split_name_problem
        for flag, split, training in (('--train-split', self.train_split, True),
                                      ('--val-split', self.val_split, False)):
            problem = split_name_problem(self.dataset, self.data_dir, split, training)
            if problem:
                raise ConfigError(problem, flag)
        if self.holdout and (self.val_split == self.train_split or (
                has_fixed_splits(self.dataset, self.data_dir) and is_train_split(self.val_split))):
            raise ConfigError(f'with --holdout, --val-split names the test split, evaluated once at the end; it is '
                              f'the training split {self.train_split!r} here. Name the dataset\'s test split')
        if self.cutmix_minmax is not None and self.cutmix_minmax[0] > self.cutmix_minmax[1]:
            raise ConfigError(f'MIN {self.cutmix_minmax[0]:g} is above MAX {self.cutmix_minmax[1]:g}',
                              '--cutmix-minmax')
        if self.sched == 'rsqrt':
            self._check_rsqrt()
        if self.sched == 'plateau' and self.sched_on_updates:  # (timm's factory asserts this once all is built)
            raise ConfigError('--sched plateau steps once an epoch, on the eval metric; drop --sched-on-updates')
        ms = list(self.decay_milestones or ())
        if any(b < a for a, b in zip(ms, ms[1:])):  # timm's multistep bisects them: out of order, they misfire
            raise ConfigError(f'milestones must be epochs in increasing order, got {ms}', '--decay-milestones')
        if self.lr_noise is not None and len(self.lr_noise) == 2 and self.lr_noise[0] >= self.lr_noise[1]:
            # (timm's fractions of the schedule: noise on from the first, off at the second)
            raise ConfigError(f'takes START END with START < END, got {list(self.lr_noise)}: this range adds noise '
                              f'to no epoch', '--lr-noise')
        self._check_augment()
        self._check_model_kwargs()
        bce = [f for f, on in (('--bce-sum', self.bce_sum), ('--bce-target-thresh', self.bce_target_thresh is not None),
                               ('--bce-pos-weight', self.bce_pos_weight is not None)) if on]
        if bce and not self.bce_loss:
            raise ConfigError(f'{" and ".join(bce)} {"sets" if len(bce) == 1 else "set"} the binary cross-entropy of '
                              f'--bce-loss, which is off; add --bce-loss')
        if self.reset_head and not (self.pretrained or self.initial_checkpoint):
            raise ConfigError('--reset-head re-initialises the classifier of loaded weights; add --pretrained or '
                              '--initial-checkpoint (a model without them starts with a fresh classifier already)')
        if self.no_patch_loss and self.no_image_loss:
            raise ConfigError('--no-patch-loss and --no-image-loss together switch off the whole loss; keep one of '
                              'the terms')
        if self.no_image_loss and self.patch_loss_weight == 0:
            raise ConfigError('--no-image-loss leaves a patch-head model the patch loss alone, and --patch-loss-weight '
                              '0 weighs it 0: it would train on a loss of 0 (on a plain model both flags change '
                              'nothing); give a positive weight or keep the image loss')
        if self.patchmix_table and self.guided_prob + self.random_prob > 1:
            raise ConfigError(f'--guided-prob {self.guided_prob:g} and --random-prob {self.random_prob:g} are '
                              f'fractions of one batch and add up to {self.guided_prob + self.random_prob:g}; their '
                              f'sum must be at most 1')
        if self.patchmix_table and not self.patchmix:
            raise ConfigError('--patchmix-table trains on guided PatchMix samples; add --patchmix')
        if self.patchmix and self.mixup_active:
            raise ConfigError('--patchmix and --mixup/--cutmix are alternatives; choose one')
        if self.patchmix and self.mixup_off_epoch:
            raise ConfigError(f'it stops --mixup/--cutmix; PatchMix stops at --patchmix-off-epoch '
                              f'(give --patchmix-off-epoch {self.mixup_off_epoch} instead)', '--mixup-off-epoch')
        if self.mixup_active and self.batch_size is not None and self.batch_size % 2:
            raise ConfigError(f'{self.batch_size} is odd, and timm\'s Mixup/CutMix (--mixup/--cutmix) mix each image '
                              f'with the batch\'s reversed order, which needs an even batch (timm\'s mixers assert '
                              f'it at the first batch); give an even -b', '-b/--batch-size')
        if self.mixup_active and self.mixup_mode == 'half' and (self.device_data or self.no_prefetcher):
            raise ConfigError(f'half is a mode of the loader\'s collate mixer (timm\'s '
                              f'FastCollateMixup), which {"--device-data" if self.device_data else "--no-prefetcher"} '
                              f'replaces with timm\'s Mixup; that one has no half mode and would mix the whole batch '
                              f'in batch mode. Choose elem, pair or batch', '--mixup-mode')
        if not self.model_ema and (self.model_ema_warmup or self.model_ema_decay != _FIELDS['model_ema_decay'].default):
            raise ConfigError(f'{"--model-ema-warmup" if self.model_ema_warmup else "--model-ema-decay"} sets the '
                              f'weight average of --model-ema, which is off; add --model-ema')
        if self.device_data and self.patchmix_collate:
            raise ConfigError('--device-data makes batches on the device, where PatchMix mixes them too; '
                              '--patchmix-collate mixes in the data loader, which --device-data replaces. '
                              'Drop one of them')
        if self.patchmix and self.patchmix_collate and self.no_prefetcher:
            raise ConfigError('--patchmix-collate mixes uint8 batches in the collate step and needs the '
                              'prefetcher; drop --no-prefetcher or --patchmix-collate')

    def unused_settings(self) -> List[str]:
        """Settings of a mixer or loss term that is off, each a line naming the flags and what would use them: they
        change nothing (``--guided-prob`` without a table trains Random PatchMix, say). Their defaults stand for
        "not given". Not refused: the pipeline gives its ``--train-args`` to every method's run, the baselines too.
        The loss terms of a patch head are known once the model is (a resolved config's ``patch_head``)."""
        lines = []
        off = ', which is off in this run'
        for on, names, what, why, remedy in (
                (self.patchmix, ('patchmix_alpha', 'patchmix_prob', 'patchmix_mode', 'patchmix_collate',
                                 'patchmix_off_epoch'), 'how --patchmix mixes', off, 'add --patchmix'),
                (self.patchmix_table, ('guided_prob', 'random_prob'), 'the guided batches of --patchmix-table', off,
                 'add --patchmix-table with a search\'s masks.json'),
                (not (self.patchmix and self.patchmix_table), ('patchmix_prob', 'patchmix_mode'),
                 'Random PatchMix\'s batches without --patchmix-table',
                 '; with the table, --guided-prob and --random-prob share out each batch, whose random part mixes '
                 'element-wise, each cell a fair coin', 'drop --patchmix-table'),
                # (--no-patch-loss and the grid with --patchmix: PatchMix on a plain model's image logits)
                (self.patch_head is not False, ('no_image_loss', 'patch_loss_weight', 'per_position_head')
                 + (() if self.patchmix else ('no_patch_loss', 'grid')),
                 'the loss terms of a patch head', f', which {self.model} does not have (its loss is on its image '
                 f'logits alone)', 'train a patchhead_ model'),
                (self.no_patch_loss is False or self.patch_head is False, ('patch_loss_weight',),
                 'the weight of the patch loss', ', which --no-patch-loss switches off', 'drop --no-patch-loss'),
                # (a note, not a refusal: a run's args.yaml from before may hold it, and -c reruns that run)
                (bool(self.clip_grad), ('clip_mode',), 'how --clip-grad clips the gradients',
                 f', which is off in this run ({"--clip-grad 0" if self.clip_grad == 0 else "no --clip-grad"})',
                 'add --clip-grad'),
                (self.mixup_active, ('mixup_prob', 'mixup_switch_prob', 'mixup_mode', 'mixup_off_epoch'),
                 'timm\'s Mixup/CutMix of --mixup/--cutmix', off, 'add --mixup or --cutmix'),
                (self.holdout, ('holdout_seed',), 'the held-out images of --holdout', off, 'add --holdout F')):
            # (a resolved config's grid is the default grid where none was given)
            given = [name for name in names if getattr(self, name) not in
                     ((None, DEFAULT_GRID) if name == 'grid' else (_FIELDS[name].default,))]
            if given and not on:
                flags = [' '.join(filter(None, (_flag(n), _shown(getattr(self, n))))) for n in given]
                one = len(flags) == 1
                lines.append(f'{" and ".join(flags)} {"sets" if one else "set"} {what}{why}: '
                             f'{"it changes" if one else "they change"} nothing ({remedy} to use '
                             f'{"it" if one else "them"})')
        if self.patchmix and self.patchmix_alpha != _FIELDS['patchmix_alpha'].default:
            lines.append(f'--patchmix-alpha {self.patchmix_alpha:g} changes nothing: each mask cell is '
                         f'round(Beta(a, a)) as the paper draws it, 0 or 1 with probability 1/2 for every a, so the '
                         f'masks are the same at any value (it is recorded only)')
        return lines

    def _check_rsqrt(self) -> None:
        """timm's rsqrt schedule: an lr falling as 1/sqrt(t / warmup) after the warmup, then a linear decay over the
        last ``--decay-epochs`` (a value below 1: that fraction, rounded to whole epochs) of the epochs after the
        warmup (or of all epochs with ``--warmup-prefix``). Its timescale is the warmup (train.py offers no
        ``--lr-stable-timescale``), and the decay must fit as timm's factory checks it: said here, before any work.
        (A per-update schedule rounds in updates, known once the data is: the factory checks it when the run builds
        it, and that error is a usage error naming ``--sched`` too.)"""
        if self.warmup_epochs is not None and self.warmup_epochs <= 0:
            raise ConfigError('--sched rsqrt takes its timescale from the warmup: give --warmup-epochs of 1 or more',
                              '--warmup-epochs')
        if self.epochs is None or self.warmup_epochs is None:
            return  # (a recipe's values not filled in yet)
        length = self.epochs if self.warmup_prefix else self.epochs - self.warmup_epochs
        which = '' if self.warmup_prefix else ' (--epochs less --warmup-epochs)'
        if length < 1:
            raise ConfigError(f'--sched rsqrt leaves no epochs after the warmup: --epochs {self.epochs} with '
                              f'--warmup-epochs {self.warmup_epochs}; give more --epochs, or --warmup-prefix',
                              '--epochs')
        decay = self.decay_epochs * length if self.decay_epochs < 1 else self.decay_epochs
        if not self.sched_on_updates and not 0 < round(decay) <= length:  # (timm's rounding of epochs)
            raise ConfigError(f'--sched rsqrt decays over the last --decay-epochs ({self.decay_epochs:g}'
                              + (f' of {length}, {round(decay)} epochs' if self.decay_epochs < 1 else '')
                              + f') of the {length} epochs after the warmup{which}: it must come to between 1 '
                              f'and {length} whole epochs', '--decay-epochs')

    def _check_augment(self) -> None:
        """The augmentation flags together: ranges in order, no flag that another switches off, a policy timm
        knows. Those that need the input size (a resized crop on the CIFAR-style transform) are checked by
        :func:`~timm_patchmix.engine.loaders.resolve_data`."""
        for name in ('scale', 'ratio'):
            value = getattr(self, name)
            if value is not None and value[0] > value[1]:
                raise ConfigError(f'MIN {value[0]:g} is above MAX {value[1]:g}', _flag(name))
        if self.aa is not None:
            _check_policy(self.aa)
        if 0 < self.aug_repeats < 1 or self.aug_repeats > MAX_AUG_REPEATS:
            # (timm's sampler lists every image N times per epoch: a huge N overflows it, or fills the memory)
            raise ConfigError(f'takes 0 (off) or a number of repeats from 1 to {MAX_AUG_REPEATS}, got '
                              f'{self.aug_repeats:g}', '--aug-repeats')
        given = self.augment_flags()
        self._check_augment_given(given, [n for n in ('remode', 'recount')
                                          if getattr(self, n) != getattr(Augment, n)])
        if self.color_jitter and self.aa is not None and '3a' not in self.aa:
            raise ConfigError(f'timm leaves colour jitter out beside an --aa policy other than 3a; --color-jitter '
                              f'{self.color_jitter:g} would be unused with --aa {self.aa}. Drop one or the other')
        # (the resized-crop flags never fit --device-data's inputs: resolve_data names them)
        loader_only = [f for f in given if f in ('--aa', '--color-jitter', '--reprob')]
        if self.device_data and loader_only:
            raise ConfigError(f'--device-data crops, flips and normalises on the device; {" and ".join(loader_only)} '
                              f'{"is a transform" if len(loader_only) == 1 else "are transforms"} of the data loader. '
                              f'Drop --device-data or {" and ".join(loader_only)}')

    def _check_model_kwargs(self) -> None:
        """No key of ``--model-kwargs`` that a flag given beside it sets to another value (timm's train.py passes
        both, and ``create_model`` refuses the second): the model would silently take one of them, the rest of the
        run (the mixer's grid, the data's channels) perhaps the other. The same value in both places is the same
        run (a run's ``args.yaml`` holds its grid beside the ``--model-kwargs`` grid it came from). ``in_chans``
        there must be the channels the data follows: ``--in-chans``, or else the first value of ``--input-size``
        (which timm's train.py builds the model with too), or else 3; the two flags must then agree."""
        if self.in_chans is not None and self.input_size is not None and self.in_chans != self.input_size[0]:
            raise ConfigError(f'--in-chans {self.in_chans} and --input-size {" ".join(map(str, self.input_size))} '
                              f'name different channel counts; give one of them', '--in-chans')
        if self.channels is not None and self.channels not in (1, 3):
            flag = '--in-chans' if self.in_chans is not None else '--input-size'
            raise ConfigError(f'images load as greyscale (1 channel) or RGB (3), so the data cannot have '
                              f'{self.channels} channels', flag)
        chans = self.channels if self.channels is not None else 3
        if 'in_chans' in self.model_kwargs and self.model_kwargs['in_chans'] != chans:
            raise ConfigError(f'in_chans={self.model_kwargs["in_chans"]!r} differs from the {chans} channels the data '
                              f'takes (--in-chans, or the first value of --input-size); give --in-chans '
                              f'{self.model_kwargs["in_chans"]} instead', '--model-kwargs')
        given = {'drop_rate': self.drop or None, 'drop_path_rate': self.drop_path,
                 # a resolved config's grid is the model's own (resolve), also where --model-kwargs set it
                 'grid': None if self.is_resolved else self.grid, 'per_position': self.per_position_head or None,
                 'drop_block_rate': self.drop_block, 'global_pool': self.gp, 'bn_momentum': self.bn_momentum,
                 'bn_eps': self.bn_eps}
        for key, value in given.items():
            if value is None or key not in self.model_kwargs:
                continue
            other = self.model_kwargs[key]
            if key == 'grid':
                try:
                    other = normal_grid(other)
                except ConfigError:
                    pass
            if other != value:
                flag = ' '.join(filter(None, (KWARG_FLAGS[key], _shown(value))))
                raise ConfigError(f'{key}={self.model_kwargs[key]!r} differs from {flag}, which sets it too; give '
                                  f'it in one place', '--model-kwargs')

    def _check_augment_given(self, given: Sequence[str], erasing: Sequence[str]) -> None:
        """``--no-aug`` beside augmentation flags ``given``, and the random-erasing settings ``erasing`` (field
        names) without ``--reprob``: a :class:`ConfigError` naming them."""
        if self.no_aug and given:
            raise ConfigError(f'--no-aug switches training augmentation off; {" and ".join(given)} would be unused. '
                              f'Drop one or the other')
        if self.reprob == 0 and erasing:
            raise ConfigError(f'{_flag(erasing[0])} sets the random erasing of --reprob, which is 0; add --reprob P')

    def check_flags_given(self, given: Collection[str]) -> None:
        """The refusals above for flags a command line gave at their default values, which the config alone cannot
        tell from flags not given (``--no-aug --hflip 0.5`` would drop the flip asked for): ``given``, the field
        names the command line set."""
        aug = [f.name for f in dataclasses.fields(Augment) if f.name not in ('no_aug', 'remode', 'recount')]
        self._check_augment_given(tuple(dict.fromkeys(list(self.augment_flags())
                                                      + [_flag(n) for n in aug if n in given])),
                                  [n for n in ('remode', 'recount') if n in given])
        if not self.model_ema and 'model_ema_decay' in given:
            raise ConfigError('--model-ema-decay sets the weight average of --model-ema, which is off; add '
                              '--model-ema')

    def augment_flags(self) -> Tuple[str, ...]:
        """The augmentation flags set to other than their defaults (``--no-aug`` aside)."""
        return tuple(_flag(f.name) for f in dataclasses.fields(Augment)
                     if f.name not in ('no_aug', 'remode', 'recount') and getattr(self, f.name) != f.default)

    def _check_values(self) -> None:
        """Every setting of its kind: numbers in their flags' ranges (:data:`VALUE_TYPES`), sequences of their
        lengths, switches real bools, names and paths strings; ``None`` only where it is the default."""
        for f in dataclasses.fields(self):
            _check_field(f.name, getattr(self, f.name))

    @property
    def mixup_active(self) -> bool:
        """timm's Mixup/CutMix is on."""
        return self.mixup > 0 or self.cutmix > 0 or self.cutmix_minmax is not None

    @property
    def channels(self) -> Optional[int]:
        """The channels of the data that the flags name: ``--in-chans``, or else the first value of
        ``--input-size`` (which timm's train.py builds the model with too); ``None`` leaves them to the model's
        data config. The model, the normalisation and the checks of ``--model-kwargs`` all take them from here."""
        if self.in_chans is not None:
            return self.in_chans
        return self.input_size[0] if self.input_size is not None else None

    @property
    def prefetch(self) -> bool:
        return not self.no_prefetcher

    @property
    def is_resolved(self) -> bool:
        return self.data_config is not None

    def with_recipe(self) -> 'TrainConfig':
        """The config with its recipe's values in the settings left ``None`` (the recipe itself defaults to
        ``'demo'`` on the embedded data and ``'timm'`` otherwise); ``--patchmix`` on a recipe's backbone selects
        its ``patchhead_`` model. A config that has them already comes back unchanged."""
        recipe = self.recipe or ('demo' if self.dataset in ('', 'patchshapes') and not self.data_dir else 'timm')
        changes: Dict[str, Any] = {'recipe': recipe}
        lr_rule = any(getattr(self, name) is not None for name in LR_RULE)
        for name, value in dict(TIMM_DEFAULTS, **RECIPES[recipe]).items():
            if getattr(self, name) is None and not (name == 'lr' and lr_rule):  # --lr-base... given: timm's rule
                changes[name] = value
        if self.lr_source is None:
            # (the timm recipe fills in lr None: the rule's)
            changes['lr_source'] = 'flag' if self.lr is not None else 'recipe' if changes.get('lr') else 'rule'
        elif (self.lr_source == 'recipe' and self.lr != dict(TIMM_DEFAULTS, **RECIPES[recipe]).get('lr')) or (
                self.lr_source == 'rule' and self.lr is not None and not self.is_resolved):
            # an lr set after the recipe or the rule had their say (dataclasses.replace): the caller's, recorded
            # as such, so that -c args.yaml reads it back rather than setting the recipe's or the rule's again
            changes['lr_source'] = 'flag'
        model = changes.get('model', self.model)
        if self.patchmix and self.model is None and not model.startswith('patchhead_') and not self.no_patch_loss:
            changes['model'] = 'patchhead_' + model  # a recipe's backbone, with the head --patchmix needs
        _check_optimizer(changes.get('opt', self.opt))
        return dataclasses.replace(self, **changes)

    def record(self) -> Dict[str, Any]:
        """The settings as plain data (tuples as lists), as ``args.yaml`` and the training state record them."""
        return _plain(dataclasses.asdict(self))


# the most repeats --aug-repeats takes (DeiT's recipe uses 3)
MAX_AUG_REPEATS = 64

_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
# the switches and the strings (names, choices, paths), by their annotations
_BOOLS = tuple(n for n, f in _FIELDS.items() if f.type in ('bool', 'Optional[bool]'))
_STRINGS = tuple(n for n, f in _FIELDS.items() if f.type in ('str', 'Optional[str]'))


def _expected(name: str) -> str:
    """What a setting takes, in words: ``'an integer >= 1'``, ``'3 values, each an integer >= 1'``."""
    if name in VALUE_TYPES:
        want = bounds_of(VALUE_TYPES[name]).want
        if name in SEQUENCES:
            lo, hi = SEQUENCES[name]
            count = f'{lo}' if lo == hi else ('one or more' if hi is None else f'{lo} to {hi}')
            want = f'a sequence of {count} values, each {want}'
            if _FIELDS[name].default is None:
                return 'None or ' + want
    elif name in _BOOLS:
        want = 'True or False' if _FIELDS[name].default is not None else 'True, False'
    elif name in PATHS:
        want = 'a path (str or os.PathLike)'
    elif name in _STRINGS:
        want = 'a string'
    elif name == 'data_config':
        want = 'a DataConfig'
    else:
        want = 'a valid value'
    return want + (' or None' if _FIELDS[name].default is None else '')


def _check_field(name: str, value: Any) -> None:
    """``value`` of setting ``name``'s kind and range, as :class:`TrainConfig` holds it (sequences as tuples or
    lists, the grid as ``(rows, cols)``)."""
    if value is None and _FIELDS[name].default is None:
        return
    if name in VALUE_TYPES:
        bounds = bounds_of(VALUE_TYPES[name])
        if name in SEQUENCES:
            lo, hi = SEQUENCES[name]
            if not (lo <= len(value) and (hi is None or len(value) <= hi)) or \
                    not all(bounds.accepts(v) for v in value):
                raise _value_error(name, value)
        elif not bounds.accepts(value):
            raise _value_error(name, value)
    elif name in _BOOLS:
        if not isinstance(value, bool):
            raise _value_error(name, value)
    elif name in _STRINGS:
        if not isinstance(value, str):
            raise _value_error(name, value)
    elif name == 'data_config' and not isinstance(value, DataConfig):
        raise _value_error(name, value)


def check_setting(name: str, value: Any) -> None:
    """One setting's value on its own, as :class:`TrainConfig` checks it (kind, range, length, choice), before any
    recipe fills or flag combinations are checked: a :class:`ConfigError` naming the flag when it is not one the
    setting takes. ``name`` is a :class:`TrainConfig` field that a flag sets (``grid`` for ``--patchmix-grid``)."""
    if name not in _FIELDS or name in UNFLAGGED:
        raise KeyError(name)
    if name == 'grid':
        normal_grid(value)
        return
    if name in SEQUENCES and value is not None and (isinstance(value, (str, bytes, Mapping)) or not _iterable(value)):
        raise _value_error(name, value)
    if name in PATHS and isinstance(value, os.PathLike):
        value = os.fspath(value)
    if name in KWARGS:
        _check_kwargs(name, value)
        return
    _check_field(name, value)
    _check_choice(name, value)


def _check_choice(name: str, value: Any) -> None:
    """``value`` one of setting ``name``'s choices (:data:`CHOICES`), or ``None``; any value of a setting without
    choices."""
    allowed = CHOICES.get(name)
    if allowed is not None and value is not None and value not in allowed:
        raise ConfigError(f'invalid choice: {value!r} (choose from {", ".join(map(repr, allowed))}) '
                          f'(TrainConfig.{name})', _flag(name))


def _check_kwargs(name: str, value: Any) -> None:
    if not (isinstance(value, Mapping) and all(isinstance(k, str) for k in value)):
        raise ConfigError(f'must be a dict of keyword arguments by name, got {value!r} (TrainConfig.{name})',
                          _flag(name))


def _value_error(name: str, value: Any) -> ConfigError:
    """The error of a setting whose value is not of its kind or range: it names the flag, the field, what the
    setting takes and the value given."""
    if name in UNFLAGGED:
        return ConfigError(f'TrainConfig.{name} must be {_expected(name)}, got {value!r}')
    return ConfigError(f'must be {_expected(name)}, got {value!r} (TrainConfig.{name})', _flag(name))


def _plain(v: Any) -> Any:
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v


def _check_policy(aa: str) -> None:
    """``--aa`` a policy string timm's augmentation factories read (``rand-m9-mstd0.5``, ``augmix-m5-w4-d2``,
    ``original``, ``v0``, ``3a``, ...), by building it once."""
    from timm.data.auto_augment import augment_and_mix_transform, auto_augment_transform, rand_augment_transform
    params = {'translate_const': 100, 'img_mean': (124, 116, 104)}
    try:
        if not isinstance(aa, str) or not aa:
            raise ValueError
        if aa.startswith('rand'):
            rand_augment_transform(aa, params)
        elif aa.startswith('augmix'):
            augment_and_mix_transform(aa, dict(params, translate_pct=0.3))
        else:
            auto_augment_transform(aa, params)
    except Exception:  # timm's parsers raise AssertionError, KeyError, ValueError or worse for a bad string
        raise ConfigError(f"timm has no augmentation policy {aa!r}: give rand-m<M>[-n<N>][-mstd<S>]... "
                          f"(RandAugment), augmix-m<M>-w<W>-d<D> (AugMix) or an AutoAugment policy (original, "
                          f"originalr, v0, v0r, 3a)", '--aa') from None


def _check_optimizer(opt: str) -> None:
    from timm.optim import get_optimizer_info
    try:  # timm's factory reads 'lookahead_<name>' as <name> with Lookahead
        get_optimizer_info(opt.lower().split('_')[-1])
    except ValueError:
        raise ConfigError(f'unknown optimizer {opt!r}; timm.optim.list_optimizers() names them', '--opt') from None


def scaled_lr(cfg: TrainConfig, world_size: int = 1) -> float:
    """``cfg.lr``, or timm's rule when it is ``None``: ``lr_base`` scaled by the global batch (the batch of one
    update: ``batch_size`` x ``world_size`` x ``grad_accum_steps``) over ``lr_base_size``, linearly (square root for
    Ada*/LAMB optimizers, unless ``lr_base_scale`` says otherwise)."""
    if cfg.lr is not None:
        return cfg.lr
    scale = cfg.lr_base_scale or ('sqrt' if any(o in cfg.opt.lower() for o in ('ada', 'lamb')) else 'linear')
    ratio = cfg.batch_size * world_size * cfg.grad_accum_steps / cfg.lr_base_size
    return cfg.lr_base * (math.sqrt(ratio) if scale == 'sqrt' else ratio)


def resolve(cfg: TrainConfig, *, model, num_classes: int, data_config: Mapping[str, Any],
            world_size: int = 1) -> TrainConfig:
    """The config of a run whose ``model`` is built: the grid is the model's own (a patch-head model's
    ``model.grid``; the flags' or 4x4 for image-level PatchMix on a plain model), the learning rate is scaled to the
    global batch of ``world_size`` processes when ``lr_source`` is ``'rule'``, and ``num_classes``, ``patch_head``
    and ``data_config`` are set. A config whose lr the rule had already set (a resolved one, derived with
    ``dataclasses.replace``) keeps it; where the rule gives another (a changed batch size) it is recorded as given
    (``lr_source`` ``'flag'``)."""
    from ..models import PatchHeadModel
    cfg = cfg.with_recipe()
    patch_head = isinstance(model, PatchHeadModel)
    grid = tuple(model.grid) if patch_head else (cfg.grid or DEFAULT_GRID)
    data = data_config if isinstance(data_config, DataConfig) else DataConfig.from_timm(data_config)
    lr_source = cfg.lr_source
    if lr_source == 'rule' and cfg.lr is not None and cfg.lr != scaled_lr(dataclasses.replace(cfg, lr=None),
                                                                          world_size):
        # a resolved config given again (dataclasses.replace of a run's config) whose lr is not the one the rule
        # gives it here (another batch size, or an lr the caller set): it trains at that lr, recorded as given, so
        # that -c args.yaml reruns it rather than setting the rule's again
        lr_source = 'flag'
    return dataclasses.replace(cfg, grid=grid, patch_head=patch_head, num_classes=num_classes,
                               lr=scaled_lr(cfg, world_size), lr_source=lr_source, data_config=data)
